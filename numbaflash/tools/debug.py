"""Where does the kernel go wrong? Run one small problem and map its errors.

    python -m numbaflash.debug                                  # B=2 H=4 S=256 D=64 fp16
    python -m numbaflash.debug --seqlen-q 200 --seqlen-k 333 --causal --dtype bf16 --tile-q 128
    python -m numbaflash.debug --impl swap-rows                 # CPU demo: a deliberately broken impl

The output buffer is filled with a NaN of a distinctive bit pattern before the call, so
elements the kernel never wrote are told apart from NaNs it computed. The result is compared
with the float64 reference (``numbaflash.tools.reference.attention_reference``) and the report
shows where the errors sit:

* a heat map of the max error per (query tile, head), ``*`` marking tiles with bad elements;
* error by ``row % m`` and ``col % m`` (m = 8, 16, ...): a wrong swizzle or fragment layout
  shows up as a fixed set of residues, e.g. rows 8-15 of every 16 (the second half of an
  mma.sync accumulator fragment) or columns 4-7 of every 8;
* hints naming the smallest such pattern, and the batches, heads or query tiles concerned;
* the worst rows and columns, the first bad element, NaN/Inf/unwritten counts;
* the LSE error (when the implementation returns it);
* a KV-tile sweep: the same problem with keys truncated to 1, 2, ... KV tiles, telling a bug
  in the first tile (loads, layouts) from one that appears only when tiles follow each other
  (online-softmax rescaling, the double-buffered pipeline).

``impl`` may be any callable ``impl(q, k, v, *, causal, softmax_scale, out)`` returning the
output or ``(out, lse)`` as numpy arrays: the tool itself is tested with broken numpy stand-ins
(``--impl swap-rows`` etc. run them on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .reference import attention_reference

Impl = Callable[..., Any]

# NaNs with a payload no arithmetic produces (GPUs give 0x7FFF for fp16, 0x7FFF/0x7FC0 for bf16).
POISON_BITS = {"fp16": 0x7E5A, "bf16": 0x7FE5}
DEFAULT_TOL = {"fp16": (4e-3, 1e-2), "bf16": (2e-2, 2e-2)}  # (atol, rtol) against float64
ROW_MODULI = (8, 16, 32, 64, 128)
COL_MODULI = (2, 4, 8, 16, 32, 64)


def numpy_dtype(name: str) -> np.dtype:
    if name == "fp16":
        return np.dtype(np.float16)
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"dtype must be fp16 or bf16, got {name!r}")


def dtype_name(dtype: np.dtype) -> str:
    return "fp16" if np.dtype(dtype) == np.float16 else "bf16"


def poisoned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array of ``shape`` filled with the poison NaN of ``dtype``."""
    return np.full(shape, POISON_BITS[dtype_name(dtype)], dtype=np.uint16).view(dtype)


def unwritten_mask(out: np.ndarray) -> np.ndarray:
    """True where ``out`` still holds the poison bits."""
    return np.ascontiguousarray(out).view(np.uint16) == POISON_BITS[dtype_name(out.dtype)]


def make_inputs(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, dtype: str, seed: int,
    heads_kv: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard-normal q (B, Sq, H, D) and k, v (B, Sk, Hkv, D) in ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    hkv = heads if heads_kv is None else heads_kv
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(dt)
    k = rng.standard_normal((batch, seqlen_k, hkv, head_dim)).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, hkv, head_dim)).astype(dt)
    return q, k, v


# --------------------------------------------------------------------------- analysis


@dataclasses.dataclass
class Pattern:
    """Errors grouped by ``index % modulus``: max error and bad count per residue."""

    axis: str  # "row" or "col"
    modulus: int
    max_err: np.ndarray  # (modulus,)
    bad: np.ndarray  # (modulus,) count of bad elements
    total: np.ndarray  # (modulus,) count of elements

    @property
    def bad_residues(self) -> list[int]:
        return [int(r) for r in np.nonzero(self.bad)[0]]


@dataclasses.dataclass
class DebugResult:
    """Everything the report prints; arrays are indexed (batch, head, row, col)."""

    config: dict[str, Any]
    atol: float
    rtol: float
    tile_q: int
    err: np.ndarray  # |out - ref|, inf where out is not finite
    bad: np.ndarray  # bool
    n_nan: int  # computed NaNs (not poison)
    n_inf: int
    n_unwritten: int
    poisoned: bool
    tile_max: np.ndarray  # (n_tiles, heads) max error over batch, rows of the tile, cols
    tile_bad: np.ndarray  # (n_tiles, heads) bad counts
    row_patterns: list[Pattern]
    col_patterns: list[Pattern]
    first_bad: tuple[int, int, int, int] | None  # (batch, head, row, col)
    first_bad_values: tuple[float, float] | None  # (got, expected)
    hints: list[str]
    lse_err: np.ndarray | None = None  # (batch, head, row)
    kv_sweep: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad.any() and self.n_unwritten == 0

    @property
    def max_err(self) -> float:
        return float(self.err.max()) if self.err.size else 0.0


def _residue_stats(err: np.ndarray, bad: np.ndarray, axis: int, modulus: int, name: str) -> Pattern:
    """Group ``err``/``bad`` (b, h, row, col) by index % modulus along ``axis`` (2 rows, 3 cols)."""
    n = err.shape[axis]
    residue = np.arange(n) % modulus
    other = tuple(a for a in range(4) if a != axis)
    per_index_max = err.max(axis=other) if err.size else np.zeros(n)
    per_index_bad = bad.sum(axis=other)
    per_index_total = np.full(n, err.size // max(n, 1))
    max_err = np.zeros(modulus)
    np.maximum.at(max_err, residue, per_index_max)
    bad_count = np.bincount(residue, weights=per_index_bad, minlength=modulus).astype(np.int64)
    total = np.bincount(residue, weights=per_index_total, minlength=modulus).astype(np.int64)
    return Pattern(name, modulus, max_err, bad_count, total)


def format_residues(residues: Sequence[int]) -> str:
    """[0, 1, 2, 5, 8, 9] -> "0-2, 5, 8-9"."""
    parts: list[str] = []
    start = prev = None
    for r in list(residues) + [None]:
        if start is not None and (r is None or r != prev + 1):
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ", ".join(parts)


def _pattern_hint(patterns: Sequence[Pattern], index_bad: np.ndarray, what: str) -> str | None:
    """The smallest modulus whose bad residues are a strict subset of all residues."""
    for p in patterns:
        residues = p.bad_residues
        idx = np.arange(index_bad.shape[0])
        periods = np.unique(idx[index_bad] // p.modulus)
        # A pattern needs repeats: bad indices in at least two periods (not one ragged tail).
        if residues and len(residues) < p.modulus and p.total[residues].all() and periods.size >= 2:
            in_set = np.isin(idx % p.modulus, residues)
            every = bool(index_bad[in_set].all())
            tail = f" (every {what} with those residues has bad elements)" if every else ""
            return f"bad {what}s occur only at {what} % {p.modulus} in {{{format_residues(residues)}}}{tail}"
    return None


def _subset_hint(bad_per: np.ndarray, label: str) -> str | None:
    """"bad elements only in heads {1, 3}" when only some indices along one dimension are bad."""
    idx = [int(i) for i in np.nonzero(bad_per)[0]]
    if idx and len(idx) < bad_per.shape[0]:
        return f"bad elements only in {label} {{{format_residues(idx)}}} of {bad_per.shape[0]}"
    return None


def analyze(
    out: np.ndarray,
    ref: np.ndarray,
    *,
    tile_q: int = 64,
    atol: float,
    rtol: float,
    poisoned_output: bool = True,
    lse: np.ndarray | None = None,
    ref_lse: np.ndarray | None = None,
    config: dict[str, Any] | None = None,
) -> DebugResult:
    """Compare ``out`` (B, Sq, H, D) with the float64 ``ref`` and locate the errors."""
    unwritten = unwritten_mask(out) if poisoned_output else np.zeros(out.shape, bool)
    got = np.asarray(out, dtype=np.float64)
    finite = np.isfinite(got)
    n_nan = int((np.isnan(got) & ~unwritten).sum())
    n_inf = int(np.isinf(got).sum())
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(got - ref), np.inf)
    bad = ~(err <= atol + rtol * np.abs(ref))
    # Work in (batch, head, row, col): the order a kernel's CTAs and warps cover the output.
    err_t, bad_t = err.transpose(0, 2, 1, 3), bad.transpose(0, 2, 1, 3)
    b, h, sq, d = err_t.shape
    n_tiles = math.ceil(sq / tile_q)
    tile_max = np.zeros((n_tiles, h))
    tile_bad = np.zeros((n_tiles, h), dtype=np.int64)
    for t in range(n_tiles):
        rows = slice(t * tile_q, min((t + 1) * tile_q, sq))
        tile_max[t] = err_t[:, :, rows].max(axis=(0, 2, 3))
        tile_bad[t] = bad_t[:, :, rows].sum(axis=(0, 2, 3))
    row_patterns = [_residue_stats(err_t, bad_t, 2, m, "row") for m in ROW_MODULI if m < sq]
    col_patterns = [_residue_stats(err_t, bad_t, 3, m, "col") for m in COL_MODULI if m < d]

    first_bad = first_values = None
    if bad_t.any():
        fb = tuple(int(i) for i in np.argwhere(bad_t)[0])
        first_bad = (fb[0], fb[1], fb[2], fb[3])
        first_values = (float(got[fb[0], fb[2], fb[1], fb[3]]), float(ref[fb[0], fb[2], fb[1], fb[3]]))

    hints: list[str] = []
    if unwritten.any():
        un_t = unwritten.transpose(0, 2, 1, 3)
        rows_un = np.nonzero(un_t.any(axis=(0, 1, 3)))[0]
        where = format_residues(rows_un.tolist())
        hints.append(f"{int(unwritten.sum())} elements never written, in rows {where}")
    if bad_t.any():
        row_bad = bad_t.any(axis=(0, 1, 3))  # per row index
        col_bad = bad_t.any(axis=(0, 1, 2))
        for hint in (
            _pattern_hint(row_patterns, row_bad, "row"),
            _pattern_hint(col_patterns, col_bad, "col"),
            _subset_hint(bad_t.any(axis=(1, 2, 3)), "batches"),
            _subset_hint(bad_t.any(axis=(0, 2, 3)), "heads"),
            _subset_hint(tile_bad.sum(axis=1) > 0, f"query tiles (of {tile_q} rows)"),
        ):
            if hint:
                hints.append(hint)
        if (~finite & ~unwritten).any():
            hints.append(f"{n_nan} NaN and {n_inf} Inf values computed: look at masking and the row max/sum")

    lse_err = None
    if lse is not None and ref_lse is not None:
        lse64 = np.asarray(lse, dtype=np.float64)
        both_inf = np.isneginf(lse64) & np.isneginf(ref_lse)
        with np.errstate(invalid="ignore"):
            lse_err = np.where(both_inf, 0.0, np.abs(lse64 - ref_lse))
        lse_err = np.where(np.isnan(lse_err), np.inf, lse_err)

    return DebugResult(
        config=config or {}, atol=atol, rtol=rtol, tile_q=tile_q, err=err_t, bad=bad_t, n_nan=n_nan,
        n_inf=n_inf, n_unwritten=int(unwritten.sum()), poisoned=poisoned_output, tile_max=tile_max,
        tile_bad=tile_bad, row_patterns=row_patterns, col_patterns=col_patterns, first_bad=first_bad,
        first_bad_values=first_values, hints=hints, lse_err=lse_err,
    )


# --------------------------------------------------------------------------- running an impl


def call_impl(
    impl: Impl, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, softmax_scale: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """Run ``impl`` with a poisoned ``out``; returns (out, lse or None) as numpy."""
    out = poisoned(q.shape, q.dtype)
    result = impl(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out)
    if isinstance(result, tuple):
        return np.asarray(result[0]), (None if result[1] is None else np.asarray(result[1]))
    return np.asarray(result), None


def kv_tile_sweep(
    impl: Impl, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, softmax_scale: float,
    tile_k: int, atol: float, rtol: float, max_steps: int = 8,
) -> list[tuple[int, float, int]]:
    """(seqlen_k used, max error, bad count) with keys truncated to 1, 2, ... KV tiles."""
    sk = k.shape[1]
    lengths = list(range(tile_k, sk, tile_k))[: max_steps - 1] + [sk]
    rows = []
    for n in lengths:
        kn, vn = np.ascontiguousarray(k[:, :n]), np.ascontiguousarray(v[:, :n])
        out, _ = call_impl(impl, q, kn, vn, causal, softmax_scale)
        ref, _ = attention_reference(q, kn, vn, causal=causal, softmax_scale=softmax_scale)
        got = np.asarray(out, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            err = np.where(np.isfinite(got), np.abs(got - ref), np.inf)
        rows.append((n, float(err.max()), int((~(err <= atol + rtol * np.abs(ref))).sum())))
    return rows


def run_debug(
    impl: Impl,
    *,
    batch: int = 2,
    heads: int = 4,
    heads_kv: int | None = None,
    seqlen_q: int = 256,
    seqlen_k: int = 256,
    head_dim: int = 64,
    causal: bool = False,
    dtype: str = "fp16",
    seed: int = 0,
    softmax_scale: float | None = None,
    tile_q: int = 64,
    tile_k: int = 64,
    atol: float | None = None,
    rtol: float | None = None,
    kv_sweep: bool = True,
) -> DebugResult:
    """Run ``impl`` on one random problem and analyse its output against the float64 reference."""
    q, k, v = make_inputs(batch, heads, seqlen_q, seqlen_k, head_dim, dtype, seed, heads_kv)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    default_atol, default_rtol = DEFAULT_TOL[dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    out, lse = call_impl(impl, q, k, v, causal, scale)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    config = dict(impl=getattr(impl, "name", getattr(impl, "__name__", type(impl).__name__)), batch=batch,
                  heads=heads, heads_kv=heads_kv or heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  head_dim=head_dim, causal=causal, dtype=dtype, seed=seed, softmax_scale=scale)
    result = analyze(out, ref, tile_q=tile_q, atol=atol, rtol=rtol, lse=lse, ref_lse=ref_lse, config=config)
    note = getattr(impl, "note", None)
    if note:
        result.notes.append(note)
        result.poisoned = getattr(impl, "poisoned", True)
    if kv_sweep:
        result.kv_sweep = kv_tile_sweep(impl, q, k, v, causal, scale, tile_k, atol, rtol)
    return result


# --------------------------------------------------------------------------- report


def _e(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1e}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [" ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += [" ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _pattern_table(p: Pattern) -> str:
    headers = [f"{p.axis} % {p.modulus}", *(str(r) for r in range(p.modulus))]
    return _table(headers, [["max err", *(_e(x) for x in p.max_err)], ["bad", *(str(x) for x in p.bad)]])


def format_report(r: DebugResult, top: int = 5) -> str:
    c = r.config
    lines = [
        f"numbaflash debug: impl={c.get('impl')} B={c.get('batch')} H={c.get('heads')} "
        f"Hkv={c.get('heads_kv')} Sq={c.get('seqlen_q')} Sk={c.get('seqlen_k')} D={c.get('head_dim')} "
        f"causal={c.get('causal')} dtype={c.get('dtype')} seed={c.get('seed')} "
        f"scale={c.get('softmax_scale', float('nan')):.6g}",
        f"tolerance: |out - ref| <= {r.atol:g} + {r.rtol:g} * |ref|  (ref: float64)",
    ]
    lines += [f"note: {n}" for n in r.notes]
    total = r.err.size
    n_bad = int(r.bad.sum())
    finite = r.err[np.isfinite(r.err)]
    lines.append(
        f"max |err| {_e(r.max_err)}, mean {_e(float(finite.mean()) if finite.size else 0.0)}; "
        f"bad {n_bad}/{total} ({100.0 * n_bad / max(total, 1):.2f}%); NaN {r.n_nan}, Inf {r.n_inf}, "
        + (f"unwritten {r.n_unwritten} (output poisoned first)" if r.poisoned else "unwritten: not checked")
    )
    if r.first_bad is not None and r.first_bad_values is not None:
        b, h, row, col = r.first_bad
        got, exp = r.first_bad_values
        lines.append(f"first bad element: batch {b}, head {h}, row {row}, col {col}: got {got:.5g}, "
                     f"expected {exp:.5g}")
    lines.append(f"verdict: {'PASS' if r.ok else 'FAIL'}")
    if r.hints:
        lines.append("\nHints:")
        lines += [f"  - {h}" for h in r.hints]

    n_tiles, heads = r.tile_max.shape
    sq = r.err.shape[2]
    lines.append(f"\nMax |err| per (query tile of {r.tile_q} rows, head); * = tile has bad elements")
    headers = ["tile", "rows", *(f"h{i}" for i in range(heads))]
    rows = []
    for t in range(n_tiles):
        cells = [f"{_e(r.tile_max[t, i])}{'*' if r.tile_bad[t, i] else ' '}" for i in range(heads)]
        rows.append([str(t), f"{t * r.tile_q}-{min((t + 1) * r.tile_q, sq) - 1}", *cells])
    lines.append(_table(headers, rows))

    for patterns in (r.row_patterns, r.col_patterns):
        for p in patterns:
            if p.modulus in (8, 16):
                lines.append("")
                lines.append(_pattern_table(p))

    if r.bad.any() or r.max_err > 0:
        row_max = r.err.max(axis=(0, 1, 3))
        row_bad_cols = r.bad.any(axis=(0, 1)).sum(axis=-1)
        lines.append(f"\nWorst rows (of {sq}):")
        for row in np.argsort(-row_max, kind="stable")[:top]:
            lines.append(f"  row {int(row):5d}: max err {_e(float(row_max[row]))}, "
                         f"bad in {int(row_bad_cols[row])}/{r.err.shape[3]} cols")
        col_max = r.err.max(axis=(0, 1, 2))
        col_bad_rows = r.bad.any(axis=(0, 1)).sum(axis=0)
        lines.append(f"Worst columns (of {r.err.shape[3]}):")
        for col in np.argsort(-col_max, kind="stable")[:top]:
            lines.append(f"  col {int(col):5d}: max err {_e(float(col_max[col]))}, "
                         f"bad in {int(col_bad_rows[col])}/{sq} rows")

    if r.lse_err is not None:
        per_tile = ", ".join(_e(float(r.lse_err[:, :, t * r.tile_q:(t + 1) * r.tile_q].max()))
                             for t in range(n_tiles))
        lines.append(f"\nLSE: max |err| {_e(float(r.lse_err.max()))}; per query tile: {per_tile}")
    if r.kv_sweep:
        lines.append("\nKV-tile sweep (keys truncated; the first tile count where errors appear matters):")
        sweep = [[str(n), _e(e), str(b)] for n, e, b in r.kv_sweep]
        lines.append(_table(["seqlen_k", "max err", "bad"], sweep))
    return "\n".join(lines)


# --------------------------------------------------------------------------- implementations


class NumbaflashImpl:
    """numbaflash on device buffers, the poisoned ``out`` uploaded as the output buffer, so
    that any element the kernel never writes still holds the poison after the call."""

    name = "numbaflash"

    def __init__(self) -> None:
        self.note: str | None = None
        self.poisoned = True

    def __call__(self, q, k, v, *, causal, softmax_scale, out):
        from numba import cuda

        import numbaflash

        from ..runtime.buffers import DeviceBuffer

        dq, dk, dv, dout = (DeviceBuffer(x) for x in (q, k, v, out))
        _, lse = numbaflash.flash_attention(dq, dk, dv, causal=causal, softmax_scale=softmax_scale,
                                            return_lse=True, out=dout)
        if not hasattr(lse, "copy_to_host"):
            lse = cuda.as_cuda_array(lse)
        return dout.copy_to_host(), lse.copy_to_host()


def reference_impl(q, k, v, *, causal, softmax_scale, out):
    """Correct stand-in: float64 reference rounded to the input dtype."""
    o, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out[...] = o.astype(out.dtype)
    return out, lse.astype(np.float32)


def swap_rows_impl(q, k, v, *, causal, softmax_scale, out):
    """Broken stand-in: rows 8-15 of every 16 come out in reverse order (a fragment-row bug)."""
    reference_impl(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out)
    idx = np.arange(q.shape[1])
    r = idx % 16
    src = np.where(r >= 8, idx - r + 23 - r, idx)
    src = np.where(src < q.shape[1], src, idx)
    out[...] = out[:, src].copy()
    return out


def swap_cols_impl(q, k, v, *, causal, softmax_scale, out):
    """Broken stand-in: columns 4<->5 and 6<->7 of every 8 swapped (a swizzle bug)."""
    reference_impl(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out)
    idx = np.arange(q.shape[3])
    src = np.where(idx % 8 >= 4, idx ^ 1, idx)
    out[...] = out[..., src].copy()
    return out


def skip_last_tile_impl(q, k, v, *, causal, softmax_scale, out):
    """Broken stand-in: the last 64-row query tile is never written (a grid-size bug)."""
    o, _ = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    last = (q.shape[1] - 1) // 64 * 64
    out[:, :last] = o[:, :last].astype(out.dtype)
    return out


STANDINS: dict[str, Impl] = {
    "reference": reference_impl,
    "swap-rows": swap_rows_impl,
    "swap-cols": swap_cols_impl,
    "skip-last-tile": skip_last_tile_impl,
}


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m numbaflash.debug",
                                description="Run one small attention problem and report where errors sit.")
    p.add_argument("--impl", choices=("numbaflash", *STANDINS), default="numbaflash",
                   help="numbaflash (GPU) or a numpy stand-in (CPU demos of the report)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--heads-kv", type=int, default=None, help="k/v heads (GQA); default = --heads")
    p.add_argument("--seqlen-q", type=int, default=256)
    p.add_argument("--seqlen-k", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--softmax-scale", type=float, default=None)
    p.add_argument("--tile-q", type=int, default=64, help="query rows per tile in the heat map")
    p.add_argument("--tile-k", type=int, default=64, help="keys per KV tile in the KV sweep")
    p.add_argument("--atol", type=float, default=None, help="default 4e-3 (fp16) / 2e-2 (bf16)")
    p.add_argument("--rtol", type=float, default=None, help="default 1e-2 (fp16) / 2e-2 (bf16)")
    p.add_argument("--no-kv-sweep", action="store_true", help="skip the KV-tile truncation sweep")
    p.add_argument("--top", type=int, default=5, help="worst rows/columns to list")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    impl: Impl = NumbaflashImpl() if args.impl == "numbaflash" else STANDINS[args.impl]
    result = run_debug(
        impl, batch=args.batch, heads=args.heads, heads_kv=args.heads_kv, seqlen_q=args.seqlen_q,
        seqlen_k=args.seqlen_k, head_dim=args.head_dim, causal=args.causal, dtype=args.dtype,
        seed=args.seed, softmax_scale=args.softmax_scale, tile_q=args.tile_q, tile_k=args.tile_k,
        atol=args.atol, rtol=args.rtol, kv_sweep=not args.no_kv_sweep,
    )
    if args.impl == "numbaflash":  # the GPU, clocks and library versions head the report
        from .bench import _import_torch, environment_header

        print(environment_header(_import_torch()) + "\n")
    print(format_report(result, top=args.top))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
