"""Forward-pass benchmark: numbaflash against PyTorch SDPA backends, in TFLOP/s.

    python -m numbaflash.bench                                  # full sweep, fp16, causal both
    python -m numbaflash.bench --seqlens 1k,4k --head-dims 128 --causal no --csv out.csv
    python -m numbaflash.bench --seqlens 4096 --check --sanity  # correctness + timing sanity

Workload (as in the reference table of ARCHITECTURE.md): ``batch * seqlen = 64k`` tokens
(``batch = 65536 // seqlen``) and model width 2048 (``heads = 2048 // head_dim``), q/k/v of
shape (batch, seqlen, heads, head_dim), fresh standard-normal inputs per shape.

FLOPs: ``4 * B * H * Sq * Sk * D`` (two matmuls, multiply + add), halved for causal; with
``--exact-causal-flops`` causal counts the visible (query, key) pairs exactly (bottom-right
aligned mask, ``Sq * (Sq + 1) / 2`` pairs for Sq == Sk), which also handles Sq != Sk.

Timing: every implementation is called on device tensors (torch tensors when PyTorch is
installed: numbaflash reads them zero-copy through ``__cuda_array_interface__``; no host
copies are timed). Timing starts after a warm-up of at least ``--warmup`` calls and
``--warmup-ms`` milliseconds, so that the GPU's clocks have settled under load (they step
down within the first ~100 ms), and the timed calls queue behind the warm-up, so the host
is ahead of the device and launch overhead is not measured. Each timed call is bracketed by
its own pair of CUDA events; the median over ``--repeats`` calls is reported. Calls rotate
over several input sets whose total size is several times the L2 cache, so no call finds
its inputs in L2. ``--sanity`` compares these numbers with a plain loop (synchronize,
``time.perf_counter`` over N calls, synchronize) and reports the launch cost per call.

Everything that needs a GPU is imported lazily: the module imports (and its pure helpers
are tested) on a machine without one.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_TOKENS = 65536
DEFAULT_WIDTH = 2048

# Implementation name -> attribute of torch.nn.attention.SDPBackend ("numbaflash" is ours).
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
# "flex": torch.nn.attention.flex_attention compiled with torch.compile (a Triton kernel).
IMPLS = ("numbaflash", *SDPA_BACKENDS, "flex")
DEFAULT_IMPLS = ("numbaflash", "flash", "cudnn", "efficient")
LABELS = {"numbaflash": "numbaflash", **{name: f"sdpa-{name}" for name in SDPA_BACKENDS}, "flex": "flex"}
FAMILIES = ("auto", "sm80", "sm90")
DTYPES = ("fp16", "bf16")

# Sleep kernel that keeps the device busy while the host's launch cost is measured
# (GPU cycles; ~25 ms at 2 GHz).
SLEEP_CYCLES = 50_000_000
DEFAULT_WARMUP_MS = 250.0  # untimed calls before timing: until the clocks have settled
MAX_WARMUP_CALLS = 5000
LAUNCH_BOUND_SHARE = 0.4  # host time per call above this share of the loop's: launch-bound
WAITED_MS = 2.0  # a call that takes this long to return, with the device busy, waited for it
FALLBACK_L2_BYTES = 64 << 20


# --------------------------------------------------------------------------- pure helpers


def parse_size(text: str) -> int:
    """``"512"`` -> 512, ``"4k"`` / ``"4K"`` -> 4096."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(text[:-1]) * 1024
    return int(text)


def parse_size_list(text: str) -> list[int]:
    """Comma-separated sizes: ``"512,1k,16k"`` -> [512, 1024, 16384]."""
    values = [parse_size(part) for part in text.split(",") if part.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive sizes separated by commas, got {text!r}")
    return values


def parse_name_list(text: str) -> list[str]:
    """Comma-separated implementation names, checked against IMPLS ("all" = every one)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return list(IMPLS)
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from {', '.join(IMPLS)}")
    return names


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Visible (query, key) pairs under a bottom-right aligned causal mask.

    Query i sees key j iff ``j <= i + seqlen_k - seqlen_q`` (FlashAttention's convention).
    """
    offset = seqlen_k - seqlen_q
    return sum(min(max(i + offset + 1, 0), seqlen_k) for i in range(seqlen_q))


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool, exact: bool = False
) -> float:
    """Forward FLOPs: 4·B·H·Sq·Sk·D, halved for causal (or exact visible pairs with ``exact``)."""
    if not causal:
        pairs = seqlen_q * seqlen_k
    elif exact:
        pairs = causal_pairs(seqlen_q, seqlen_k)
    else:
        pairs = seqlen_q * seqlen_k / 2
    return 4.0 * batch * heads * pairs * head_dim


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark configuration: q (batch, seqlen_q, heads, head_dim), k/v (batch, seqlen_k, ...)."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str  # "fp16" or "bf16"

    def flops(self, exact: bool = False) -> float:
        return attention_flops(
            self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim, self.causal, exact
        )

    def bytes_per_set(self) -> int:
        """q, k, v and the output, 2 bytes per element."""
        q = self.batch * self.seqlen_q * self.heads * self.head_dim
        kv = self.batch * self.seqlen_k * self.heads * self.head_dim
        return 2 * (2 * q + 2 * kv)


def make_shapes(
    seqlens: Iterable[int],
    head_dims: Iterable[int],
    causal_modes: Iterable[bool],
    dtypes: Iterable[str],
    tokens: int = DEFAULT_TOKENS,
    width: int = DEFAULT_WIDTH,
    batch: int | None = None,
    heads: int | None = None,
) -> list[Shape]:
    """The sweep, ordered dtype > causal > head_dim > seqlen (so a table reads down seqlen)."""
    shapes = []
    for dtype in dtypes:
        for causal in causal_modes:
            for d in head_dims:
                for s in seqlens:
                    b = batch if batch is not None else max(1, tokens // s)
                    h = heads if heads is not None else max(1, width // d)
                    shapes.append(Shape(b, h, s, s, d, causal, dtype))
    return shapes


def input_sets_needed(set_bytes: int, l2_bytes: int, minimum: int = 2, maximum: int = 8) -> int:
    """Input sets to rotate over so that their total is at least 3x the L2 cache."""
    return max(minimum, min(maximum, math.ceil(3 * l2_bytes / max(set_bytes, 1))))


@dataclasses.dataclass
class Result:
    """Timing of one implementation on one shape (``error`` set when it could not run)."""

    shape: Shape
    impl: str
    times_ms: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    exact_flops: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.times_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def min_ms(self) -> float:
        return min(self.times_ms) if self.times_ms else math.nan

    @property
    def tflops(self) -> float:
        if not self.ok:
            return math.nan
        return self.shape.flops(self.exact_flops) / (self.median_ms * 1e-3) / 1e12


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with right-aligned, padded columns (pastes into docs/PERFORMANCE.md)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(str(h).rjust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    body = ["| " + " | ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join([line, rule, *body])


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_results(results: Sequence[Result], impls: Sequence[str]) -> str:
    """TFLOP/s per shape (one row) and implementation (one column), then numbaflash / each other.

    Implementations that failed show ``err`` and their messages are listed under the table.
    """
    by_shape: dict[Shape, dict[str, Result]] = {}
    for r in results:
        by_shape.setdefault(r.shape, {})[r.impl] = r
    others = [i for i in impls if i != "numbaflash"]
    ratios = others if "numbaflash" in impls else []
    headers = ["dtype", "causal", "hdim", "seqlen", "batch", "heads"]
    headers += [f"{LABELS[i]} TF/s" for i in impls] + [f"nf/{i}" for i in ratios]
    rows, notes = [], []
    for shape, per_impl in by_shape.items():
        row = [shape.dtype, "yes" if shape.causal else "no", str(shape.head_dim), str(shape.seqlen_q)]
        row += [str(shape.batch), str(shape.heads)]
        for impl in impls:
            r = per_impl.get(impl)
            if r is None:
                row.append("-")
            elif r.error is not None:
                row.append("err")
                notes.append(f"{LABELS[impl]} at {_shape_label(shape)}: {r.error}")
            else:
                row.append(_fmt(r.tflops))
        nf = per_impl.get("numbaflash")
        for impl in ratios:
            other = per_impl.get(impl)
            ok = nf is not None and nf.ok and other is not None and other.ok
            row.append(_fmt(nf.tflops / other.tflops, 2) if ok else "-")
        rows.append(row)
    text = render_table(headers, rows)
    if notes:
        text += "\n\nErrors:\n" + "\n".join(f"  {n}" for n in notes)
    return text


def _shape_label(s: Shape) -> str:
    causal = "causal" if s.causal else "non-causal"
    return f"{s.dtype} {causal} B={s.batch} H={s.heads} Sq={s.seqlen_q} Sk={s.seqlen_k} D={s.head_dim}"


CSV_FIELDS = (
    "dtype", "causal", "head_dim", "seqlen_q", "seqlen_k", "batch", "heads", "impl",
    "median_ms", "min_ms", "tflops", "repeats", "flops", "error",
)


def results_to_csv(results: Sequence[Result]) -> str:
    """One CSV row per (shape, implementation); empty timing fields where it failed."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in results:
        s = r.shape
        writer.writerow({
            "dtype": s.dtype, "causal": int(s.causal), "head_dim": s.head_dim, "seqlen_q": s.seqlen_q,
            "seqlen_k": s.seqlen_k, "batch": s.batch, "heads": s.heads, "impl": LABELS.get(r.impl, r.impl),
            "median_ms": f"{r.median_ms:.4f}" if r.ok else "", "min_ms": f"{r.min_ms:.4f}" if r.ok else "",
            "tflops": f"{r.tflops:.2f}" if r.ok else "", "repeats": len(r.times_ms),
            "flops": f"{s.flops(r.exact_flops):.0f}", "error": r.error or "",
        })
    return buf.getvalue()


def parse_nvidia_smi(line: str) -> dict[str, str]:
    """One line of ``nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version
    --format=csv,noheader,nounits`` -> dict."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) < 4:
        return {}
    return {"name": parts[0], "sm_clock": parts[1], "max_sm_clock": parts[2], "driver": parts[3]}


# --------------------------------------------------------------------------- argument parsing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m numbaflash.bench",
        description="Benchmark numbaflash's forward pass against torch SDPA backends (TFLOP/s).",
    )
    p.add_argument("--seqlens", type=parse_size_list, default=list(DEFAULT_SEQLENS),
                   help="comma-separated sequence lengths, k suffix allowed (default 512,...,16k)")
    p.add_argument("--head-dims", type=parse_size_list, default=list(DEFAULT_HEAD_DIMS),
                   help="comma-separated head dims (default 64,128)")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--dtype", choices=("fp16", "bf16", "both"), default="fp16")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per shape and implementation")
    p.add_argument("--rounds", type=int, default=3,
                   help="split each implementation's timed calls into this many blocks, interleaved with "
                        "the other implementations' in alternating order (default 3; 1: one block each)")
    p.add_argument("--warmup", type=int, default=5,
                   help="at least this many untimed calls first (the first one compiles)")
    p.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS,
                   help="and at least this long of untimed calls, so that GPU clocks settle (default 250)")
    p.add_argument("--backends", type=parse_name_list, default=list(DEFAULT_IMPLS),
                   help=f"comma-separated from {', '.join(IMPLS)} or 'all' (default: all but math)")
    p.add_argument("--tokens", type=parse_size, default=DEFAULT_TOKENS,
                   help="batch * seqlen when --batch is not given (default 64k)")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="heads * head_dim (default 2048)")
    p.add_argument("--batch", type=int, default=None, help="fixed batch size (overrides --tokens)")
    p.add_argument("--heads", type=int, default=None, help="fixed head count (overrides --width)")
    p.add_argument("--exact-causal-flops", action="store_true",
                   help="count causal FLOPs from the visible pairs instead of halving")
    p.add_argument("--family", choices=FAMILIES, default="auto",
                   help="numbaflash kernel family: auto (what the dispatcher picks), sm80 (the "
                        "mma.sync kernel every non-Hopper GPU runs, forced with its table's config), "
                        "sm90 (the Hopper kernel; Hopper only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", metavar="PATH", help="also write the results as CSV")
    p.add_argument("--plot", metavar="PATH", help="also write a PNG of TFLOP/s against seqlen (matplotlib)")
    p.add_argument("--check", action="store_true",
                   help="first verify numbaflash against torch on the first shape")
    p.add_argument("--sanity", action="store_true",
                   help="compare CUDA-event timing with a plain synchronize/perf_counter loop (first shape)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.warmup < 1 or args.warmup_ms < 0:
        build_parser().error("--repeats and --warmup must be at least 1, --warmup-ms at least 0")
    return args


def shapes_from_args(args: argparse.Namespace) -> list[Shape]:
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    return make_shapes(args.seqlens, args.head_dims, causal, dtypes, args.tokens, args.width,
                       args.batch, args.heads)


# --------------------------------------------------------------------------- progress bar


class Progress:
    """tqdm when installed, else a one-line bar on stderr; nothing when disabled or not a terminal."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description_str(label)
            self._tqdm.update(1)
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label[:60]:<60}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")


# --------------------------------------------------------------------------- environment


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        if dist == "numbaflash":
            from numbaflash import __version__

            return f"{__version__} (source tree)"
        return "not installed"


def gpu_clocks() -> dict[str, str]:
    """GPU name, SM clocks (MHz) and driver of GPU 0: NVML, else nvidia-smi, else "unknown"."""
    info = {"name": "unknown", "sm_clock": "unknown", "max_sm_clock": "unknown", "driver": "unknown",
            "source": "none"}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)

            def text(v: Any) -> str:
                return v.decode() if isinstance(v, bytes) else str(v)

            info.update(
                name=text(pynvml.nvmlDeviceGetName(handle)),
                sm_clock=str(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                max_sm_clock=str(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                driver=text(pynvml.nvmlSystemGetDriverVersion()),
                source="nvml",
            )
        finally:
            pynvml.nvmlShutdown()
        return info
    except Exception:  # pynvml missing or NVML unusable: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "-i", "0", "--query-gpu=name,clocks.sm,clocks.max.sm,driver_version",
                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout
            parsed = parse_nvidia_smi(out.splitlines()[0]) if out.strip() else {}
            if parsed:
                info.update(parsed, source="nvidia-smi")
        except Exception:
            pass
    return info


def cuda_versions(torch: Any | None) -> str:
    parts = []
    if torch is not None:
        parts.append(f"torch built with CUDA {torch.version.cuda}")
    try:
        from numba import cuda

        driver = cuda.cudadrv.driver.driver.get_version()
        parts.append(f"driver supports CUDA {driver[0]}.{driver[1]}")
        runtime = cuda.runtime.get_version()
        parts.append(f"numba runtime {runtime[0]}.{runtime[1]}")
    except Exception as exc:
        parts.append(f"numba CUDA unavailable ({type(exc).__name__})")
    return ", ".join(parts)


def environment_header(torch: Any | None) -> str:
    gpu = gpu_clocks()
    name = gpu["name"]
    if name == "unknown" and torch is not None:
        name = torch.cuda.get_device_name(0)
    libs = ", ".join(f"{d} {_version(d)}" for d in ("numbaflash", "numba", "numba-cuda", "numpy", "torch"))
    return "\n".join([
        f"GPU: {name}",
        f"SM clock: {gpu['sm_clock']} MHz current / {gpu['max_sm_clock']} MHz max (via {gpu['source']})",
        f"Driver: {gpu['driver']}; CUDA: {cuda_versions(torch)}",
        f"Libraries: {libs}",
        f"Python: {sys.version.split()[0]}",
    ])


# --------------------------------------------------------------------------- devices and timing


def _import_torch() -> Any | None:
    """torch with a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class Device:
    """Allocation, events and synchronisation through torch (preferred) or numba alone."""

    def __init__(self, torch: Any | None) -> None:
        self.torch = torch
        if torch is None:
            from numba import cuda

            self.cuda = cuda

    def l2_bytes(self) -> int:
        if self.torch is not None:
            props = self.torch.cuda.get_device_properties(0)
            return int(getattr(props, "L2_cache_size", 0)) or FALLBACK_L2_BYTES
        return FALLBACK_L2_BYTES

    def make_inputs(self, shape: Shape, n_sets: int, seed: int) -> list[tuple[Any, Any, Any, Any]]:
        """``n_sets`` of (q, k, v, out), standard normal, on the device."""
        q_shape = (shape.batch, shape.seqlen_q, shape.heads, shape.head_dim)
        kv_shape = (shape.batch, shape.seqlen_k, shape.heads, shape.head_dim)
        sets = []
        if self.torch is not None:
            torch = self.torch
            dtype = torch.float16 if shape.dtype == "fp16" else torch.bfloat16
            gen = torch.Generator(device="cuda").manual_seed(seed)
            for _ in range(n_sets):
                q, k, v = (torch.randn(s, generator=gen, device="cuda", dtype=dtype)
                           for s in (q_shape, kv_shape, kv_shape))
                sets.append((q, k, v, torch.empty_like(q)))
            return sets
        import numpy as np

        from ..runtime.buffers import DeviceBuffer  # Numba device arrays cannot hold bfloat16

        rng = np.random.default_rng(seed)
        np_dtype = np.float16 if shape.dtype == "fp16" else _bf16_numpy_dtype()
        for _ in range(n_sets):
            q, k, v = (DeviceBuffer(rng.standard_normal(s, dtype=np.float32).astype(np_dtype))
                       for s in (q_shape, kv_shape, kv_shape))
            sets.append((q, k, v, DeviceBuffer.empty(q_shape, np_dtype)))
        return sets

    def synchronize(self) -> None:
        if self.torch is not None:
            self.torch.cuda.synchronize()
        else:
            self.cuda.synchronize()

    def event(self) -> Any:
        if self.torch is not None:
            return self.torch.cuda.Event(enable_timing=True)
        return self.cuda.event()  # timing is on by default

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))  # torch and Numba events alike

    def sleep(self) -> None:
        """Occupy the GPU briefly so that the host queues the timed launches ahead of it."""
        if self.torch is not None and hasattr(self.torch.cuda, "_sleep"):
            self.torch.cuda._sleep(SLEEP_CYCLES)


def _bf16_numpy_dtype() -> Any:
    try:
        import ml_dtypes
    except ImportError as exc:
        raise RuntimeError("bf16 without torch needs ml_dtypes (pip install ml_dtypes)") from exc
    return ml_dtypes.bfloat16


def warm_up(device: Device, calls: Sequence[Callable[[], Any]], min_calls: int, min_ms: float) -> int:
    """Run untimed calls until the GPU's clocks have settled, and leave them queued.

    H100/H200 clocks step down under sustained load within the first ~100 ms (measured: a
    kernel timed right after an idle or sleeping GPU ran up to 15% faster than the same kernel
    30 calls later), so timing starts only after at least ``min_ms`` of calls (and at least
    ``min_calls``). The calls are not waited for: the timed calls queue behind them, so the
    host is ahead of the device when timing starts. Returns the number of calls made.
    """
    calls[0]()  # the first call may compile
    device.synchronize()
    t0 = time.perf_counter()
    for i in range(3):
        calls[i % len(calls)]()
    device.synchronize()
    per_call_ms = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    n = min(max(min_calls, math.ceil(min_ms / per_call_ms)), MAX_WARMUP_CALLS)
    for i in range(n):
        calls[i % len(calls)]()
    return n + 4


def time_with_events(
    device: Device, calls: Sequence[Callable[[], Any]], warmup: int, repeats: int, warmup_ms: float = 0.0
) -> list[float]:
    """Milliseconds of each of ``repeats`` calls, each between its own pair of CUDA events.

    Call i runs ``calls[i % len(calls)]`` (one closure per input set), after ``warm_up``.
    """
    starts = [device.event() for _ in range(repeats)]
    ends = [device.event() for _ in range(repeats)]
    warm_up(device, calls, warmup, warmup_ms)
    for i in range(repeats):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    device.synchronize()
    return [device.elapsed_ms(s, e) for s, e in zip(starts, ends, strict=True)]


def time_plain_loop(device: Device, calls: Sequence[Callable[[], Any]], warmup: int, repeats: int,
                    warmup_ms: float = 0.0) -> float:
    """Mean milliseconds per call of a plain loop: warm up, synchronize, perf_counter, N calls,
    synchronize."""
    warm_up(device, calls, warmup, warmup_ms)
    device.synchronize()
    t0 = time.perf_counter()
    for i in range(repeats):
        calls[i % len(calls)]()
    device.synchronize()
    return (time.perf_counter() - t0) * 1e3 / repeats


def time_span(device: Device, calls: Sequence[Callable[[], Any]], warmup: int, repeats: int,
              warmup_ms: float = 0.0) -> float:
    """Milliseconds per call from one pair of CUDA events around ``repeats`` back-to-back calls
    queued behind the warm-up: device time including any idle gaps between calls. With the
    host ahead there is a gap only where a call makes the host wait for the device."""
    start, end = device.event(), device.event()
    warm_up(device, calls, warmup, warmup_ms)
    start.record()
    for i in range(repeats):
        calls[i % len(calls)]()
    end.record()
    device.synchronize()
    return device.elapsed_ms(start, end) / repeats


def time_host_issue(device: Device, calls: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """Host milliseconds until each call returns, the device busy with a sleep kernel first: the
    per-call launch cost; a call that waits for the device shows up as a long one."""
    device.synchronize()
    device.sleep()
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        times.append((time.perf_counter() - t0) * 1e3)
    device.synchronize()
    return times


def time_back_to_back_us(device: Device, call: Callable[[], Any], calls: int) -> float:
    """Host microseconds a call over ``calls`` back-to-back calls, synchronised before and after
    (the host-cost measure of ``benchmarks/launch_overhead.py`` and ``decode_speed.py --host``)."""
    device.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    device.synchronize()
    return elapsed / calls * 1e6


def host_cost_us(device: Device, call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(back-to-back µs a call, median µs of one call with the device busy) after 20 untimed
    calls: a call's host cost, two ways."""
    for _ in range(20):
        call()
    wall = time_back_to_back_us(device, call, calls)
    busy = statistics.median(time_host_issue(device, [call], min(calls, 500))) * 1e3
    return wall, busy


def profile_calls(device: Device, call: Callable[[], Any], calls: int, top: int = 25) -> str:
    """A cProfile of ``calls`` back-to-back calls, the ``top`` functions by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    device.synchronize()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    device.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


SANITY_ROUNDS = 3


@dataclasses.dataclass
class SanityRow:
    """One implementation timed by the sweep's method and by a plain loop, in alternating
    rounds, plus two diagnostics (all milliseconds per call)."""

    impl: str
    events: list[list[float]]  # per round: per-call event-pair times (the sweep's method)
    plain: list[float]  # per round: perf_counter loop with synchronize, ms per call
    span: float  # one event pair around back-to-back calls
    host: list[float]  # host time per call, device busy

    @property
    def events_ms(self) -> float:
        """The number the sweep reports: median of every per-call time."""
        return statistics.median(t for r in self.events for t in r)

    @property
    def events_mean_ms(self) -> float:
        """Median over rounds of the mean per-call time: what a loop over the same calls sees."""
        return statistics.median(statistics.fmean(r) for r in self.events)

    @property
    def plain_ms(self) -> float:
        return statistics.median(self.plain)

    @property
    def noise(self) -> float:
        """Run-to-run spread: (max - min) / median over rounds of each method, the larger of the
        two, at least 1%."""

        def spread(values: Sequence[float]) -> float:
            return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0

        return max(spread([statistics.fmean(r) for r in self.events]), spread(self.plain), 0.01)

    @property
    def plain_ratio(self) -> float:
        """Plain loop over the event-timed mean: 1 when both methods time the same work."""
        return self.plain_ms / self.events_mean_ms

    @property
    def skew(self) -> float:
        """How far the reported median sits below the mean (slow outlier calls)."""
        return self.events_mean_ms / self.events_ms - 1

    @property
    def agrees(self) -> bool:
        return abs(self.plain_ratio - 1) <= self.noise

    def diagnosis(self) -> str:
        """Why the plain loop differs, read from the diagnostic columns."""
        if self.agrees:
            return "agrees"
        host = statistics.median(self.host)
        if self.span > self.events_mean_ms * (1 + self.noise):
            return "device idles between calls although the host is ahead: a call waits for the device"
        if host > LAUNCH_BOUND_SHARE * self.plain_ms:
            return (f"launch-bound: the host needs {host:.3f} ms per call of the loop's "
                    f"{self.plain_ms:.3f} ms; per-call events then time host work and their own cost")
        if max(self.host) > WAITED_MS:
            return f"some calls wait for the device (one took {max(self.host):.1f} ms to return)"
        return "differs by more than the run-to-run noise"


def measure_sanity(device: Device, calls: Sequence[Callable[[], Any]], impl: str, warmup: int,
                   repeats: int, warmup_ms: float = 0.0, rounds: int = SANITY_ROUNDS) -> SanityRow:
    events, plain = [], []
    for _ in range(rounds):  # alternate, so that clock drift hits both methods alike
        events.append(time_with_events(device, calls, warmup, repeats, warmup_ms))
        plain.append(time_plain_loop(device, calls, warmup, repeats, warmup_ms))
    span = time_span(device, calls, warmup, repeats, warmup_ms)
    host = time_host_issue(device, calls, repeats)
    return SanityRow(impl, events, plain, span, host)


def format_sanity(rows: Sequence[SanityRow], flops: float) -> str:
    headers = ["impl", "events median", "events mean", "plain loop", "plain/mean", "noise", "median skew",
               "span", "host/call (max)", "TF/s median", "TF/s plain", "verdict"]
    body = []
    for r in rows:
        body.append([
            LABELS.get(r.impl, r.impl), f"{r.events_ms:.4f}", f"{r.events_mean_ms:.4f}", f"{r.plain_ms:.4f}",
            f"{r.plain_ratio:.3f}", f"{r.noise:.1%}", f"{-r.skew:+.1%}", f"{r.span:.4f}",
            f"{statistics.median(r.host):.3f} ({max(r.host):.3f})",
            _fmt(flops / 1e12 / (r.events_ms * 1e-3)), _fmt(flops / 1e12 / (r.plain_ms * 1e-3)),
            r.diagnosis(),
        ])
    return render_table(headers, body)


# --------------------------------------------------------------------------- implementations


def _load_numbaflash() -> Callable[..., Any]:
    import numbaflash

    fn = getattr(numbaflash, "flash_attention", None)
    if fn is None:
        raise RuntimeError("numbaflash.flash_attention is not available in this version")
    return fn


def family_context(family: str, head_dim: int, causal: bool,
                   seqlen: int | None = None) -> contextlib.AbstractContextManager:
    """Within it, numbaflash launches ``family``'s table config for this head dim and longest
    sequence ``seqlen`` (``auto``: whatever the dispatcher picks)."""
    if family == "auto":
        return contextlib.nullcontext()
    from numbaflash import configs
    from numbaflash.runtime.device import GPU

    capability, _ = GPU.current()
    if family == "sm90" and configs.arch_family(capability) != "sm90":
        raise RuntimeError(f"--family sm90 needs a Hopper GPU, this one is sm_{capability[0]}{capability[1]}")
    config = configs.forward_config(configs.FAMILY_CAPABILITY[family], head_dim, causal, seqlen=seqlen)
    return configs.force_config(capability, causal, config)


def flex_calls(views: Sequence[tuple[Any, Any, Any]], shape: Shape) -> list[Callable[[], Any]]:
    """FlexAttention under torch.compile; causal as a block mask, bottom-right aligned."""
    import torch
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Each shape compiles its own kernel: past dynamo's recompile limit (8) torch would run the
    # uncompiled flex_attention (scores in memory: slow, out of memory at 16k) without a word.
    dynamo = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                  "accumulated_cache_size_limit"):
        if hasattr(dynamo, limit):
            setattr(dynamo, limit, max(getattr(dynamo, limit), 1024))
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = None
    if shape.causal:
        diag = shape.seqlen_k - shape.seqlen_q

        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + diag

        mask = create_block_mask(visible, B=None, H=None, Q_LEN=shape.seqlen_q, KV_LEN=shape.seqlen_k)
    return [lambda v=v: compiled(v[0], v[1], v[2], block_mask=mask) for v in views]


def make_calls(
    impl: str, shape: Shape, sets: Sequence[tuple[Any, Any, Any, Any]], torch: Any | None,
    family: str = "auto",
) -> tuple[list[Callable[[], Any]], contextlib.AbstractContextManager]:
    """One zero-argument closure per input set, and the context to run them in."""
    causal = shape.causal
    if impl == "numbaflash":
        fa = _load_numbaflash()
        calls = [lambda s=s: fa(s[0], s[1], s[2], causal=causal, out=s[3]) for s in sets]
        return calls, family_context(family, shape.head_dim, causal, max(shape.seqlen_q, shape.seqlen_k))
    if torch is None:
        raise RuntimeError("needs PyTorch with CUDA")
    if impl == "flex":
        views = [tuple(t.transpose(1, 2) for t in s[:3]) for s in sets]
        return flex_calls(views, shape), contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl], None)
    if backend is None:
        raise RuntimeError(f"SDPBackend.{SDPA_BACKENDS[impl]} not in this torch")
    # SDPA takes (B, H, S, D): transposed views of the same (B, S, H, D) storage, no copies.
    views = [tuple(t.transpose(1, 2) for t in s[:3]) for s in sets]
    calls = [lambda v=v: sdpa(v[0], v[1], v[2], is_causal=causal) for v in views]
    return calls, sdpa_kernel(backend)


def run_one(device: Device, impl: str, shape: Shape, sets: Sequence[Any], args: argparse.Namespace,
            repeats: int | None = None, result: Result | None = None) -> Result:
    """Time ``repeats`` (default ``args.repeats``) calls of ``impl`` after a clock-settling
    warm-up; the times are appended to ``result`` (a new one by default)."""
    result = result or Result(shape, impl, exact_flops=args.exact_causal_flops)
    try:
        calls, ctx = make_calls(impl, shape, sets, device.torch, args.family)
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times = time_with_events(device, calls, args.warmup, repeats or args.repeats, args.warmup_ms)
        if min(times) <= 0:
            raise RuntimeError(f"non-positive event time {min(times)} ms (no real CUDA events?)")
        result.times_ms.extend(times)
    except Exception as exc:  # report and go on with the sweep
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        with contextlib.suppress(Exception):
            device.synchronize()
    return result


def round_orders(impls: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the implementations in each timing round: forwards, then backwards, and so
    on, so that a slow drift of the clocks (or of the GPU's temperature) favours nobody."""
    return [list(impls) if r % 2 == 0 else list(reversed(impls)) for r in range(rounds)]


def run_sweep(
    device: Device, shapes: Sequence[Shape], impls: Sequence[str], args: argparse.Namespace
) -> list[Result]:
    """Every shape x implementation. With ``--rounds R`` each implementation is timed in R
    blocks of ``repeats / R`` calls, the blocks interleaved (``round_orders``); its median is
    over all of its calls."""
    results: list[Result] = []
    rounds = max(1, min(args.rounds, args.repeats))
    per_round = [args.repeats // rounds + (r < args.repeats % rounds) for r in range(rounds)]
    progress = Progress(len(shapes) * len(impls) * rounds, enabled=not args.no_progress)
    try:
        for index, shape in enumerate(shapes):
            n_sets = input_sets_needed(shape.bytes_per_set(), device.l2_bytes())
            sets = device.make_inputs(shape, n_sets, args.seed + index)
            by_impl = {impl: Result(shape, impl, exact_flops=args.exact_causal_flops) for impl in impls}
            for r, order in enumerate(round_orders(impls, rounds)):
                for impl in order:
                    progress.update(f"{LABELS.get(impl, impl)} {shape.dtype} D={shape.head_dim} "
                                    f"S={shape.seqlen_q}{' causal' if shape.causal else ''}")
                    if by_impl[impl].error is None:
                        run_one(device, impl, shape, sets, args, per_round[r], by_impl[impl])
            results.extend(by_impl[impl] for impl in impls)
            del sets
    finally:
        progress.close()
    return results


# --------------------------------------------------------------------------- check and sanity


def run_check(device: Device, shape: Shape, impls: Sequence[str], args: argparse.Namespace) -> bool:
    """numbaflash vs torch on ``shape``: FlashAttention's criterion against a float32 reference
    (numbaflash's max error <= 2x SDPA's + 1e-4) on the first batch element, and the plain
    max difference between the two outputs."""
    torch = device.torch
    print(f"\n## Check: {_shape_label(shape)}")
    if torch is None:
        print("check skipped: needs PyTorch with CUDA")
        return False
    q, k, v, out = device.make_inputs(shape, 1, args.seed)[0]
    try:
        fa = _load_numbaflash()
        with family_context(args.family, shape.head_dim, shape.causal, max(shape.seqlen_q, shape.seqlen_k)):
            fa(q, k, v, causal=shape.causal, out=out)
        torch.cuda.synchronize()
    except Exception as exc:
        print(f"CHECK FAILED: numbaflash raised {type(exc).__name__}: {exc}")
        return False
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    ref_impls = [i for i in impls if i in SDPA_BACKENDS] or ["flash"]
    theirs, used = None, None
    for impl in ref_impls:
        try:
            with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[impl])), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=shape.causal)
            used = impl
            break
        except Exception:
            continue
    if theirs is None:
        print("CHECK FAILED: no SDPA backend ran this shape")
        return False
    theirs = theirs.transpose(1, 2)  # back to (B, S, H, D)
    diff = (out.float() - theirs.float()).abs()
    print(f"numbaflash vs {LABELS[used]}: max |diff| {diff.max().item():.3e}, mean {diff.mean().item():.3e}")
    heads = max(1, min(shape.heads, 2**28 // (shape.seqlen_q * shape.seqlen_k)))
    qs, ks, vs = (t[:1, :, :heads].float().transpose(1, 2) for t in (q, k, v))  # (1, h, S, D)
    scores = (qs @ ks.transpose(-1, -2)) / math.sqrt(shape.head_dim)
    if shape.causal:
        visible = torch.ones(shape.seqlen_q, shape.seqlen_k, dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(~visible.tril(shape.seqlen_k - shape.seqlen_q), float("-inf"))
    ref = (torch.softmax(scores, dim=-1) @ vs).transpose(1, 2)  # (1, S, h, D)
    err_nf = (out[:1, :, :heads].float() - ref).abs().max().item()
    err_pt = (theirs[:1, :, :heads].float() - ref).abs().max().item()
    ok = err_nf <= 2 * err_pt + 1e-4 and math.isfinite(err_nf)
    print(f"vs float32 reference (batch 0, {heads} heads): numbaflash max err {err_nf:.3e}, "
          f"{LABELS[used]} {err_pt:.3e} -> {'CHECK PASSED' if ok else 'CHECK FAILED'} (<= 2x + 1e-4)")
    return ok


def run_sanity(device: Device, shape: Shape, impls: Sequence[str], args: argparse.Namespace) -> bool:
    """The sweep's timing method next to a plain loop, same shape and inputs (all ms per call).

    ``SANITY_ROUNDS`` alternating rounds of each. Columns: events median (what the sweep
    reports) and mean; plain loop (synchronize + perf_counter); plain/mean, which is 1 when both
    methods time the same work; noise = run-to-run spread over rounds; median skew = how far
    the median sits below the mean; span = one event pair around back-to-back calls (device
    time with any gaps); host = time for a call to return while the device is busy (launch
    cost). True when plain/mean is within the noise for every implementation that ran.
    """
    print(f"\n## Timing sanity: {_shape_label(shape)}")
    n_sets = input_sets_needed(shape.bytes_per_set(), device.l2_bytes())
    sets = device.make_inputs(shape, n_sets, args.seed)
    rows, errors = [], []
    for impl in impls:
        try:
            calls, ctx = make_calls(impl, shape, sets, device.torch, args.family)
            with ctx, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows.append(measure_sanity(device, calls, impl, args.warmup, args.repeats, args.warmup_ms))
        except Exception as exc:
            errors.append(f"{LABELS[impl]}: {type(exc).__name__}: {exc}"[:160])
            with contextlib.suppress(Exception):
                device.synchronize()
    if rows:
        print(format_sanity(rows, shape.flops(args.exact_causal_flops)))
    for e in errors:
        print(f"  not measured: {e}")
    clocks = gpu_clocks()
    print(f"SM clock now: {clocks['sm_clock']} MHz (max {clocks['max_sm_clock']})")
    return all(r.agrees for r in rows)


# --------------------------------------------------------------------------- plot


def plot_results(results: Sequence[Result], path: str) -> bool:
    """PNG of TFLOP/s against seqlen: one panel per (dtype, causal, head_dim), one line per impl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written",
              file=sys.stderr)
        return False
    groups: dict[tuple[str, bool, int], dict[str, list[tuple[int, float]]]] = {}
    for r in results:
        if r.ok:
            key = (r.shape.dtype, r.shape.causal, r.shape.head_dim)
            groups.setdefault(key, {}).setdefault(r.impl, []).append((r.shape.seqlen_q, r.tflops))
    if not groups:
        print("--plot: no successful results to plot", file=sys.stderr)
        return False
    n = len(groups)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (key, lines) in zip(axes.flat, sorted(groups.items()), strict=False):
        for impl, points in lines.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=LABELS[impl])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} {'causal' if key[1] else 'non-causal'} head dim {key[2]}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = shapes_from_args(args)
    torch = _import_torch()
    impls = list(args.backends)
    if torch is None:
        dropped = [i for i in impls if i != "numbaflash"]
        impls = [i for i in impls if i == "numbaflash"]
        if dropped:
            print(f"note: PyTorch with CUDA not found: skipping {', '.join(dropped)}", file=sys.stderr)
    if not impls:
        print("nothing to benchmark", file=sys.stderr)
        return 2
    if torch is None:
        from numba import cuda

        if not cuda.is_available():
            print("no CUDA GPU available (neither torch.cuda nor numba.cuda sees one)", file=sys.stderr)
            return 2
    device = Device(torch)
    print("# numbaflash benchmark\n")
    print(environment_header(torch))
    flops_rule = "exact visible pairs" if args.exact_causal_flops else "halved"
    print(f"numbaflash kernel family: {args.family}")
    print(f"FLOPs: 4*B*H*Sq*Sk*D, causal {flops_rule}; median of {args.repeats} CUDA-event-timed calls "
          f"in {max(1, min(args.rounds, args.repeats))} interleaved rounds, each after >= {args.warmup} "
          f"warm-up calls and >= {args.warmup_ms:g} ms of them (clocks settled); "
          "inputs rotated over sets totalling >= 3x L2")
    status = 0
    if args.check and not run_check(device, shapes[0], impls, args):
        status = 1
    if args.sanity and not run_sanity(device, shapes[0], impls, args):
        status = 1
    results = run_sweep(device, shapes, impls, args)
    print("\n## TFLOP/s (forward)\n")
    print(format_results(results, impls))
    clocks = gpu_clocks()
    print(f"\nSM clock after the sweep: {clocks['sm_clock']} MHz (max {clocks['max_sm_clock']})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            f.write(results_to_csv(results))
        print(f"CSV written to {os.path.abspath(args.csv)}")
    if args.plot and plot_results(results, args.plot):
        print(f"plot written to {os.path.abspath(args.plot)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
