"""GPU self-test: ``python -m numbaflash.selftest [--cases N|--quick] [--seed S] [--backward|--decode]
[--variants]``.

Randomised, reproducible cases against the float64 reference, with FlashAttention's criterion:
max |out - ref| <= 2 x max |low - ref| + floor, where ``low`` is the same computation done in
the input dtype. Every case draws its parameters and data from (seed, index) alone, so a failing
case replays alone with ``--seed S --case I``. Exits 0 if all pass, 1 on a failure, 2 without GPU.
About a fifth of the mma.sync family's cases run ``flash_attention_varlen`` instead, on 1 to 6
packed sequences of their own lengths (``draw_varlen``), each sequence checked the same way.
A tenth of the forward's device cases (a third with ``--variants``) take a learnable sink
(``draw_sink``: FlashAttention-4's ``learnable_sink``, one logit per query head; so do a share of
the ``--decode`` cases, and of the ``--backward`` device cases, whose d_sink is checked too).

``--backward`` tests the backward instead: the forward's output and LSE, then
``flash_attention_backward`` (random dout, deterministic or not, with or without given dq/dk/dv),
each of dq, dk, dv (and d_sink with a sink) against float64 by the same criterion.

``--variants`` (forward or backward) makes every case a varlen, sliding-window or softcap case (or
several of them): about a third varlen, the rest and half the varlen ones a window, a softcap or
both (``variant_shares``), cycling through the families that have these kernels
(``VARLEN_FAMILIES``, ``WINDOW_SOFTCAP_FAMILIES``).

``--fp8`` tests the e4m3 Hopper forward instead (``selftest_fp8``: float8_e4m3fn q, k, v with
their descales, against float64 attention of the dequantized inputs; Hopper and torch only).

``--decode`` tests ``flash_attention_with_kvcache`` instead (``selftest_decode``): ragged cache
lengths (empty and full ones too), new rows appended, paged caches, GQA, seqlen_q 1 to 16, forced
split counts, NaN in every cache row no sequence owns; with ``--variants`` every case has a
window, a softcap or both.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..configs import (
    ASYMMETRIC_DEFAULTS,
    ASYMMETRIC_WS_DEFAULTS,
    FAMILY_CAPABILITY,
    FAMILY_HEAD_DIMS,
    LONG_SEQLEN,
    SHORT_SEQLEN,
    KernelConfig,
    forward_config,
)
from ..operations.head_dims import split_part
from .reference import (
    compare_gradients_with_reference,
    compare_varlen_gradients_with_reference,
    compare_varlen_with_reference,
    compare_with_reference,
)
from .selftest_common import (
    DTYPE_NAMES,
    GROUPS,
    WINDOW_SOFTCAP_SHARE,
    CaseResult,
    cuda_torch,
    draw_sink,
    draw_value_dims,
    draw_window_softcap,
    kind_note,
    log_uniform,
    numpy_dtype,
    to_device,
    to_host,
)
from .selftest_decode import draw_decode_case, run_decode_case
from .selftest_fp8 import draw_fp8_case, run_fp8_case

FAMILIES = ("sm90", "sm80")
# (longest seqlen, cap on batch * heads_q * seqlen_q * seqlen_k, max batch, max heads_kv)
LIMITS = {False: (4096, 2 * 10**7, 4, 4), True: (640, 2 * 10**6, 2, 2)}
KINDS = ("numpy", "numba", "torch")
# The forward families whose kernels take a window and a softcap, and those with a varlen kernel
# (the backward has both): only their cases draw these (all of them with --variants).
WINDOW_SOFTCAP_FAMILIES = ("sm80", "sm90")
VARLEN_FAMILIES = ("sm80", "sm90")
# The forward families with learnable-sink kernels: their device cases draw sinks (numpy inputs
# take none), ``SINK_SHARE`` of them (``SINK_SHARE_VARIANTS`` with --variants).
SINK_FAMILIES = ("sm80", "sm90")
SINK_SHARE, SINK_SHARE_VARIANTS = 0.1, 1 / 3
# V's head dim apart from Q's and K's (``configs.ASYMMETRIC_HEAD_DIMS``: the mma.sync family's
# kernels and the Hopper forward's, every input kind, dense and packed): that share of these
# families' cases (and of the backward's) draws a pair, which runs the family's config of it
# (``pair_config``).
VALUE_DIM_FAMILIES, VALUE_DIM_SHARE = ("sm80", "sm90"), 0.15


def pair_config(family: str, pair: tuple[int, ...]):
    """The forward config a case of ``family`` runs for a pair of head dims: the Hopper kernel's
    (``configs.ASYMMETRIC_WS_DEFAULTS``) or the mma.sync kernel's (``configs.ASYMMETRIC_DEFAULTS``;
    the only one of a pair the Hopper kernel lacks). Head dim 512 runs its halves' pair."""
    d_qk, d_v = pair
    part = split_part(d_qk, d_v)
    key = (d_qk, part) if part else (d_qk, d_v)
    if family == "sm90" and key in ASYMMETRIC_WS_DEFAULTS:
        return ASYMMETRIC_WS_DEFAULTS[key]
    return ASYMMETRIC_DEFAULTS[key]


def run_kind(case: Any) -> str:
    """The input kind a case runs: its own, but numba for torch without a CUDA torch, and torch (else
    numpy) for a numba case of a head dim run split (``operations.head_dims``: torch and numpy
    inputs only)."""
    kind = case.kind if case.kind != "torch" or cuda_torch() is not None else "numba"
    if kind == "numba" and split_part(*case.dims) is not None:
        kind = "torch" if cuda_torch() is not None else "numpy"
    return kind


def describe_problem(case: Any) -> str:
    """The part of a forward or backward case's one-line description they share: family, head
    dim, masking, dtype, shape, input kind, amplitude and scale."""
    scale = "default" if case.softmax_scale is None else f"{case.softmax_scale:.4g}"
    pair = getattr(case, "value_dims", ())
    dims = f"d{pair[0]}v{pair[1]}" if pair else f"d{case.head_dim}"
    return (f"{case.family} {dims} {'causal' if case.causal else 'full'} {case.dtype} "
            f"b{case.batch} sq{case.seqlen_q} sk{case.seqlen_k} h{case.heads_q}/{case.heads_kv} "
            f"{case.kind} amp{case.amplitude:.3g} scale={scale}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One test problem; everything, data included, follows from (seed, index)."""

    seed: int
    index: int
    family: str
    head_dim: int
    causal: bool
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    kind: str  # "numpy" | "numba" | "torch"
    amplitude: float  # q and k are scaled by it
    softmax_scale: float | None
    return_lse: bool
    use_out: bool
    # Force the family's config for short, plain or long sequences ("short", "", "long":
    # ``configs.SHORT_SEQLEN``, ``LONG_SEQLEN``), whatever the case's lengths: each is tested on
    # every kind of shape.
    span: str = ""
    # A sliding window and a softcap (issue 35), drawn for some of the cases of the
    # ``WINDOW_SOFTCAP_FAMILIES`` (``draw_window_softcap``); (-1, -1) and 0.0: none.
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    # A packed variable-length case (``flash_attention_varlen``), drawn for some of the cases of
    # the ``VARLEN_FAMILIES`` (``draw_varlen``): each sequence's query and key lengths; () for a dense
    # case. Then ``batch`` is the number of sequences and ``seqlen_q`` / ``seqlen_k`` the
    # max_seqlen_q / max_seqlen_k passed (at least every length, at times more).
    seqlens_q: tuple[int, ...] = ()
    seqlens_k: tuple[int, ...] = ()
    # A learnable sink (issue 56): the float32 logits of each query head (``draw_sink``), drawn for
    # some device cases of the ``SINK_FAMILIES``; () for none. Drawn from a stream of its own, so
    # every other field is what it was before sinks.
    sink: tuple[float, ...] = ()
    # A pair of head dims (Q's and K's, V's: ``configs.ASYMMETRIC_HEAD_DIMS``) the case runs in
    # place of ``head_dim`` (``draw_value_dims``, a stream of its own: every other field, the
    # stratum's head_dim included, is what it was before the pairs); () for none.
    value_dims: tuple[int, ...] = ()

    @property
    def dims(self) -> tuple[int, int]:
        """(Q's and K's head dim, V's) of the case's tensors."""
        return self.value_dims if self.value_dims else (self.head_dim, self.head_dim)

    @property
    def varlen(self) -> bool:
        return bool(self.seqlens_q)

    @property
    def variant(self) -> bool:
        """Varlen, a window or a softcap: what every case of ``--variants`` is."""
        return self.varlen or self.window_size != (-1, -1) or self.softcap > 0

    def describe(self) -> str:
        return (f"{describe_problem(self)} lse={int(self.return_lse)} out={int(self.use_out)}"
                + (f" {self.span}-config" if self.span else "")
                + (f" window={self.window_size}" if self.window_size != (-1, -1) else "")
                + (f" softcap={self.softcap:g}" if self.softcap else "")
                + (f" varlen seqlens_q={','.join(map(str, self.seqlens_q))} "
                   f"seqlens_k={','.join(map(str, self.seqlens_k))}" if self.varlen else "")
                + (f" sink={','.join(f'{x:.3g}' for x in self.sink)}" if self.sink else ""))


def strata(families: Sequence[str]) -> list[tuple[str, int, bool, str]]:
    """Every (family, head_dim, causal, dtype) combination, each family at the head dims of its
    own kernel (Hopper runs the sm80 family at the others): cases cycle through them."""
    return [(f, d, c, t) for f in families for d in FAMILY_HEAD_DIMS[f] for c in (False, True)
            for t in DTYPE_NAMES]


SPANS = {"short": SHORT_SEQLEN, "": None, "long": LONG_SEQLEN}  # span -> the seqlen that selects it


def case_config(family: str, head_dim: int, causal: bool, span: str) -> KernelConfig:
    """The shipped config a case forces: the family's for short, plain or long sequences."""
    return forward_config(FAMILY_CAPABILITY[family], head_dim, causal, seqlen=SPANS[span])


def block_m(family: str, head_dim: int, causal: bool, span: str = "") -> int:
    """Query rows per CTA of the shipped config."""
    return case_config(family, head_dim, causal, span).block_m


def draw_shape(rng: np.random.Generator, causal: bool, quick: bool, cap: int,
               block_rows) -> tuple[int, int, int, int, int]:
    """(batch, heads_kv, group, seqlen_q, seqlen_k) of a case: ragged (55%), equal lengths (15%),
    one length 1 (10%), or (causal) whole blocks of ``block_rows()`` query rows that see no key
    (20%); then shrunk until batch * heads_q * seqlen_q * seqlen_k is at most ``cap`` (the float64
    reference stays affordable)."""
    max_seq, _, max_batch, max_hkv = LIMITS[quick]
    batch = int(rng.integers(1, max_batch + 1))
    heads_kv = int(rng.choice([1, *range(1, max_hkv + 1)]))
    group = int(rng.choice(GROUPS[:4] if quick else GROUPS))
    shape = rng.choice(["ragged", "same", "one", "empty_ctas"], p=[0.55, 0.15, 0.1, 0.2])
    sq, sk = log_uniform(rng, max_seq), log_uniform(rng, max_seq)
    if shape == "same":
        sk = sq
    elif shape == "one":
        sq, sk = (1, sk) if rng.random() < 0.5 else (sq, 1)
    elif shape == "empty_ctas" and causal:  # whole blocks whose rows see no key
        bm = block_rows()
        sk = log_uniform(rng, max(1, max_seq - 2 * bm - 64))
        sq = min(max_seq, sk + 2 * bm + int(rng.integers(0, 64)))
    while batch * heads_kv * group * sq * sk > cap:
        if batch > 1:
            batch = max(1, cap // (heads_kv * group * sq * sk))
        elif group > 1 or heads_kv > 1:
            group, heads_kv = (group // 2, heads_kv) if group > 1 else (group, heads_kv - 1)
        else:
            sq, sk = (sq // 2, sk) if sq >= sk else (sq, sk // 2)
    return batch, heads_kv, group, sq, sk


def variant_families(families: Sequence[str]) -> list[str]:
    """Those of ``families`` with a window/softcap or a varlen kernel: the strata of ``--variants``."""
    return [f for f in families if f in WINDOW_SOFTCAP_FAMILIES or f in VARLEN_FAMILIES]


def draw_case(seed: int, index: int, families: Sequence[str], quick: bool = False,
              variants: bool = False) -> Case:
    """The case ``index`` of run ``seed``: pure (no GPU), independent of the other indices.
    ``variants``: only the families with variant kernels, every case varlen, windowed or softcapped."""
    combos = strata(variant_families(families) if variants else families)
    if not combos:
        raise ValueError(f"no family of {list(families)} has window/softcap or varlen kernels")
    family, head_dim, causal, dtype = combos[(index + seed) % len(combos)]
    cap = LIMITS[quick][1]
    rng = np.random.default_rng([seed, index])
    span = list(SPANS)[int(np.random.default_rng([seed, index, 1]).integers(0, len(SPANS)))]  # own stream
    batch, heads_kv, group, sq, sk = draw_shape(rng, causal, quick, cap,
                                                lambda: block_m(family, head_dim, causal, span))
    big = rng.random() < 0.2
    amplitude = float(rng.uniform(10.0, 20.0 if dtype == "float16" else 30.0)) if big else 1.0
    scale = float(rng.uniform(0.02, 0.3)) if rng.random() < 0.25 else None
    varlen_share, window_share = variant_shares(seed, index, family in VARLEN_FAMILIES,
                                                family in WINDOW_SOFTCAP_FAMILIES, variants)
    lengths = draw_varlen(seed, index, heads_kv * group, quick, share=varlen_share)
    if lengths is not None:  # the packed sequences replace the dense shape; heads as drawn
        seqlens_q, seqlens_k, sq, sk = lengths
        batch = len(seqlens_q)
    else:
        seqlens_q = seqlens_k = ()
    window, softcap = draw_window_softcap(seed, index, sq, sk, share=window_share)
    kind = str(rng.choice(KINDS, p=[0.7, 0.15, 0.15]))
    return_lse, use_out = bool(rng.random() < 0.5), bool(rng.random() < 0.3)
    sink = ()
    if family in SINK_FAMILIES and kind != "numpy":
        sink = draw_sink(seed, index, heads_kv * group, SINK_SHARE_VARIANTS if variants else SINK_SHARE)
    value_dims = draw_value_dims(seed, index, VALUE_DIM_SHARE) if family in VALUE_DIM_FAMILIES else ()
    return Case(seed, index, family, head_dim, causal, dtype, batch, sq, sk, heads_kv * group, heads_kv,
                kind, amplitude, scale, return_lse, use_out, span, window, softcap, seqlens_q, seqlens_k,
                sink, value_dims)



VARIANTS_VARLEN_SHARE = 1 / 3  # with --variants: of the cases of families with both kinds, the varlen ones


def variant_shares(seed: int, index: int, varlen: bool, window_softcap: bool, variants: bool,
                   stream: int = 7) -> tuple[float, float]:
    """The chances that ``draw_varlen`` and ``draw_window_softcap`` draw a varlen case and a
    window/softcap, for a case whose family has these kernels (``varlen``, ``window_softcap``):
    ``VARLEN_SHARE`` and ``WINDOW_SOFTCAP_SHARE``, or with ``variants`` 1 or 0 each, at least one 1
    (where the family has either), from a stream of its own: ``VARIANTS_VARLEN_SHARE`` varlen (half
    of them with a window/softcap too), the others a window, a softcap or both. ``stream``: the
    random stream's tag (the backward's cases draw theirs from tag 8)."""
    if not variants:
        return VARLEN_SHARE if varlen else 0.0, WINDOW_SOFTCAP_SHARE if window_softcap else 0.0
    rng = np.random.default_rng([seed, index, stream])
    with_varlen = varlen and (not window_softcap or rng.random() < VARIANTS_VARLEN_SHARE)
    with_window = window_softcap and (not with_varlen or rng.random() < 0.5)
    return float(with_varlen), float(with_window)


VARLEN_SHARE = 0.2  # of the VARLEN_FAMILIES' cases, those run through flash_attention_varlen
VARLEN_MAX_SEQUENCES = 6


def draw_varlen(seed: int, index: int, heads_q: int, quick: bool = False, stream: int = 5,
                cap: int | None = None,
                share: float = VARLEN_SHARE) -> tuple[tuple[int, ...], tuple[int, ...], int, int] | None:
    """(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k) of a varlen case (``share`` of them), or
    None for a dense one, from a stream of its own (the rest of the case is drawn as before): 1 to
    6 sequences, each length 0, 1, below 64, about a multiple of 64 (one off or on it), or
    log-uniform up to the longest seqlen of ``LIMITS``; a sequence's key length its query length
    or drawn apart.
    At least one query row and one key row in all; then the longest products halved until
    heads_q * sum(seqlen_q * seqlen_k) is within the reference budget (``LIMITS``). The maxima
    passed are the longest lengths (at least 1), at times more (the grid's extra blocks and
    the window's bounds must not care). ``cap``: another reference budget (the backward's)."""
    rng = np.random.default_rng([seed, index, stream])
    if rng.random() >= share:
        return None
    max_seq, cap = LIMITS[quick][0], cap or LIMITS[quick][1]

    def length() -> int:
        pick = rng.choice(["zero", "one", "small", "tile", "any"], p=[0.15, 0.15, 0.2, 0.15, 0.35])
        if pick == "zero":
            return 0
        if pick == "one":
            return 1
        if pick == "small":
            return int(rng.integers(2, 64))
        if pick == "tile":
            return int(min(max_seq, 64 * int(rng.integers(1, 5)) + int(rng.integers(-1, 2))))
        return log_uniform(rng, max_seq)

    count = int(rng.integers(1, VARLEN_MAX_SEQUENCES + 1))
    seqlens_q = [length() for _ in range(count)]
    seqlens_k = [n if rng.random() < 0.4 else length() for n in seqlens_q]
    for lengths in (seqlens_q, seqlens_k):  # the packed arrays are never empty
        if not any(lengths):
            lengths[int(rng.integers(0, count))] = int(rng.integers(1, 64))
    while heads_q * sum(a * b for a, b in zip(seqlens_q, seqlens_k, strict=True)) > cap:
        b = max(range(count), key=lambda i: seqlens_q[i] * seqlens_k[i])
        if seqlens_q[b] >= seqlens_k[b]:
            seqlens_q[b] //= 2
        else:
            seqlens_k[b] //= 2
    max_q, max_k = max(1, *seqlens_q), max(1, *seqlens_k)
    if rng.random() < 0.25:  # maxima above the longest sequence
        max_q = min(max_seq, max_q + int(rng.integers(1, 200)))
        max_k = min(max_seq, max_k + int(rng.integers(0, 200)))
    return tuple(seqlens_q), tuple(seqlens_k), max_q, max_k


def reference_cost(case: Any) -> int:
    """What the float64 reference of a case costs, in score elements: batch * heads_q * seqlen_q
    * seqlen_k, or heads_q * sum(seqlen_q * seqlen_k) over a varlen case's sequences (at most
    ``LIMITS``' cap)."""
    if getattr(case, "seqlens_q", ()):
        return case.heads_q * sum(a * b for a, b in zip(case.seqlens_q, case.seqlens_k, strict=True))
    return case.batch * case.heads_q * case.seqlen_q * case.seqlen_k


def varlen_offsets(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """cu_seqlens_q, cu_seqlens_k of a varlen case: int32 (batch + 1,) numpy arrays."""
    return tuple(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
                 for n in (case.seqlens_q, case.seqlens_k))


def make_inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v as numpy arrays of the case's dtype: (batch, seqlen, heads, head_dim), or packed
    (total, heads, head_dim) for a varlen case."""
    rng = np.random.default_rng([case.seed, case.index, 1])
    dtype = numpy_dtype(case.dtype)
    if case.varlen:
        rows_q, rows_k = (sum(case.seqlens_q),), (sum(case.seqlens_k),)
    else:
        rows_q, rows_k = (case.batch, case.seqlen_q), (case.batch, case.seqlen_k)
    d, dv = case.dims
    q = rng.standard_normal((*rows_q, case.heads_q, d)) * case.amplitude
    k = rng.standard_normal((*rows_k, case.heads_kv, d)) * case.amplitude
    v = rng.standard_normal((*rows_k, case.heads_kv, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def run_case(case: Case, capability: tuple[int, int]) -> CaseResult:
    """Run one case on the current GPU with its family's shipped config forced; never raises.
    A varlen case calls ``flash_attention_varlen`` (numpy offsets for numpy inputs, device ones
    of the same kind otherwise) and checks each sequence (``compare_varlen_with_reference``)."""
    import numbaflash
    from numbaflash.configs import force_config

    start = time.perf_counter()
    try:
        q, k, v = make_inputs(case)
        kind = run_kind(case)
        args = (q, k, v) if kind == "numpy" else tuple(to_device(x, kind) for x in (q, k, v))
        out = None
        if case.use_out:
            # poison (v's head dim: out's): unwritten elements show up as NaN
            out = np.full((*q.shape[:-1], v.shape[-1]), np.nan, q.dtype)
            out = out if kind == "numpy" else to_device(out, kind)
        extras = {"window_size": case.window_size, "softcap": case.softcap}
        # a window kernel takes the causal or the full config, whatever the case's causal flag
        if case.value_dims:  # the family's config of the pair
            forced = tuple(force_config(capability, c, pair_config(case.family, case.value_dims))
                           for c in (case.causal, not case.causal))
        else:
            forced = tuple(force_config(capability, c, case_config(case.family, case.head_dim, c, case.span))
                           for c in (case.causal, not case.causal))
        options = {"causal": case.causal, "softmax_scale": case.softmax_scale, **extras}
        calls = dict(options)  # the call's keywords: the options, and the sink as a device array
        if case.sink:
            options["sink"] = np.array(case.sink, np.float32)
            calls["learnable_sink"] = to_device(options["sink"], kind)
        if case.varlen:
            offsets = varlen_offsets(case)
            offsets_in = offsets if kind == "numpy" else tuple(to_device(x, kind) for x in offsets)
        with forced[0], forced[1]:
            if case.varlen:
                result = numbaflash.flash_attention_varlen(*args, *offsets_in, case.seqlen_q, case.seqlen_k,
                                                           return_lse=case.return_lse, out=out, **calls)
            else:
                result = numbaflash.flash_attention(*args, return_lse=case.return_lse, out=out, **calls)
        got, lse = result if case.return_lse else (result, None)
        problems = [] if out is None or got is out else ["the result is not the given out"]
        got, lse = to_host(got), None if lse is None else to_host(lse)
        if case.varlen:
            ratio, found = compare_varlen_with_reference(q, k, v, *offsets, got, lse, **options)
        else:
            ratio, found = compare_with_reference(q, k, v, got, lse, **options)
        problems += found
        note = kind_note(case.kind, kind)
        return CaseResult(case, not problems, ratio, time.perf_counter() - start, "; ".join(problems) + note)
    except Exception as exc:
        return CaseResult(case, False, math.inf, time.perf_counter() - start,
                          f"raised {type(exc).__name__}: {exc}")


@dataclasses.dataclass(frozen=True)
class BackwardCase:
    """One backward problem; everything, data included, follows from (seed, index)."""

    seed: int
    index: int
    head_dim: int
    causal: bool
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    kind: str  # "numpy" | "numba" | "torch"
    amplitude: float
    softmax_scale: float | None
    deterministic: bool
    use_outs: bool
    family: str = "backward"
    # A sliding window and a softcap (issue 35), in about 30% of the cases (``draw_window_softcap``)
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    # A packed variable-length case (``flash_attention_varlen_backward``, ``draw_varlen``): as the
    # forward's ``Case``: each sequence's lengths, ``batch`` the sequences, seqlen_q / seqlen_k the
    # maxima passed; () for a dense case.
    seqlens_q: tuple[int, ...] = ()
    seqlens_k: tuple[int, ...] = ()
    # A learnable sink (issue 56; device cases only, ``draw_sink`` on a stream of its own: every
    # other field is what it was before sinks): the backward returns d_sink, checked too.
    sink: tuple[float, ...] = ()
    # A pair of head dims run in place of ``head_dim`` (``draw_value_dims``, stream 27), as the
    # forward case's.
    value_dims: tuple[int, ...] = ()

    varlen = Case.varlen
    dims = Case.dims
    variant = Case.variant

    def describe(self) -> str:
        return (f"{describe_problem(self)} det={int(self.deterministic)} outs={int(self.use_outs)}"
                + (f" window={self.window_size}" if self.window_size != (-1, -1) else "")
                + (f" softcap={self.softcap:g}" if self.softcap else "")
                + (f" varlen seqlens_q={','.join(map(str, self.seqlens_q))} "
                   f"seqlens_k={','.join(map(str, self.seqlens_k))}" if self.varlen else "")
                + (f" sink={','.join(f'{x:.3g}' for x in self.sink)}" if self.sink else ""))


BACKWARD_BLOCK = 128  # rows of the backward's key blocks (the widest): "empty_ctas" shapes use it
LONG_SHARE = 0.05  # dense backward cases of a long query sequence (``draw_long_sequence``)


def draw_long_sequence(seed: int, index: int, share: float, cap: int, stream: int = 28
                       ) -> tuple[int, int, int, int] | None:
    """(heads_kv, group, seqlen_q, seqlen_k) of a dense backward case of a long query sequence
    (``share`` of them, from a stream of their own): at least ``configs.BACKWARD_LONG_SEQLEN``
    query rows, ragged, the config such calls take (``configs.backward_is_long``); at most 4 query
    heads and few keys, so that one sequence's float64 reference stays within ``cap``. None for
    the other cases."""
    from ..configs import BACKWARD_LONG_SEQLEN

    rng = np.random.default_rng([seed, index, stream])
    if rng.random() >= share:
        return None
    heads_kv = int(rng.integers(1, 3))
    group = int(rng.choice([1, 2])) if heads_kv == 2 else int(rng.choice([1, 2, 4]))
    sq = BACKWARD_LONG_SEQLEN + int(rng.integers(0, 160))
    sk = int(rng.integers(1, max(2, cap // (sq * heads_kv * group)) + 1))
    return heads_kv, group, sq, sk


def draw_backward_case(seed: int, index: int, quick: bool = False, variants: bool = False) -> BackwardCase:
    """The backward case ``index`` of run ``seed`` (pure, no GPU). Head dims, causality and dtypes
    cycle; shapes are drawn as for the forward (ragged, equal, length 1, causal rows that see no
    key), within half the forward's reference budget. ``variants``: every case varlen, windowed
    or softcapped (``variant_shares``). Device cases take a learnable sink as the forward's do
    (``SINK_SHARE``; stream 10). ``LONG_SHARE`` of the dense cases have a long query sequence
    (``draw_long_sequence``, stream 28; not with ``quick``, nor with a sink: its logits are per
    query head of the shape drawn first)."""
    from ..configs import SUPPORTED_HEAD_DIMS

    combos = [(d, c, t) for d in SUPPORTED_HEAD_DIMS for c in (False, True) for t in DTYPE_NAMES]
    head_dim, causal, dtype = combos[(index + seed) % len(combos)]
    rng = np.random.default_rng([seed, index, 2])
    cap = LIMITS[quick][1] // 2  # the backward reference costs about twice the forward's
    batch, heads_kv, group, sq, sk = draw_shape(rng, causal, quick, cap, lambda: BACKWARD_BLOCK)
    big = rng.random() < 0.2
    amplitude = float(rng.uniform(5.0, 10.0)) if big else 1.0
    scale = float(rng.uniform(0.02, 0.3)) if rng.random() < 0.25 else None
    varlen_share, window_share = variant_shares(seed, index, True, True, variants, stream=8)
    window, softcap = draw_window_softcap(seed, index, sq, sk, stream=4, share=window_share)
    # About a fifth of the cases run the packed variable-length backward (a stream of their own).
    lengths = draw_varlen(seed, index, heads_kv * group, quick, stream=6, cap=cap, share=varlen_share)
    seqlens_q, seqlens_k = (), ()
    if lengths is not None:
        seqlens_q, seqlens_k, sq, sk = lengths
        batch = len(seqlens_q)
    kind = str(rng.choice(KINDS, p=[0.5, 0.2, 0.3]))  # (drawn in the order they always were)
    deterministic, use_outs = bool(rng.random() < 0.3), bool(rng.random() < 0.3)
    sink = ()
    if kind != "numpy":  # numpy inputs take no sink
        sink = draw_sink(seed, index, heads_kv * group, SINK_SHARE_VARIANTS if variants else SINK_SHARE,
                         stream=10)
    value_dims = draw_value_dims(seed, index, VALUE_DIM_SHARE, stream=27)
    long = None if lengths is not None or quick or sink else draw_long_sequence(seed, index, LONG_SHARE, cap)
    if long is not None:  # one sequence (the window, drawn for the shape it replaces, still holds)
        batch = 1
        heads_kv, group, sq, sk = long
    return BackwardCase(seed, index, head_dim, causal, dtype, batch, sq, sk, heads_kv * group, heads_kv,
                        kind, amplitude, scale, deterministic, use_outs, window_size=window,
                        softcap=softcap, seqlens_q=seqlens_q, seqlens_k=seqlens_k, sink=sink,
                        value_dims=value_dims)


def run_backward_case(case: BackwardCase) -> CaseResult:
    """Forward (output and LSE) then ``flash_attention_backward`` on the case; never raises."""
    import numbaflash

    start = time.perf_counter()
    try:
        rng = np.random.default_rng([case.seed, case.index, 3])
        dtype = numpy_dtype(case.dtype)
        if case.varlen:  # packed (total, heads, head_dim)
            rows_q, rows_k = (sum(case.seqlens_q),), (sum(case.seqlens_k),)
        else:
            rows_q, rows_k = (case.batch, case.seqlen_q), (case.batch, case.seqlen_k)
        d, value_dim = case.dims
        q = rng.standard_normal((*rows_q, case.heads_q, d)) * case.amplitude
        k = rng.standard_normal((*rows_k, case.heads_kv, d)) * case.amplitude
        v = rng.standard_normal((*rows_k, case.heads_kv, value_dim))
        dout = rng.standard_normal((*q.shape[:-1], value_dim))
        q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
        kind = run_kind(case)
        args = (q, k, v) if kind == "numpy" else tuple(to_device(x, kind) for x in (q, k, v))
        dout_in = dout if kind == "numpy" else to_device(dout, kind)
        extras = {"window_size": case.window_size, "softcap": case.softcap}
        checks = dict(extras)  # the reference's keywords: with a sink, its logits
        if case.sink:
            checks["sink"] = np.array(case.sink, np.float32)
            extras["learnable_sink"] = to_device(checks["sink"], kind)
        if case.varlen:
            offsets = varlen_offsets(case)
            offsets_in = offsets if kind == "numpy" else tuple(to_device(x, kind) for x in offsets)
            sequences = (*offsets_in, case.seqlen_q, case.seqlen_k)
            out, lse = numbaflash.flash_attention_varlen(*args, *sequences, causal=case.causal,
                                                         softmax_scale=case.softmax_scale, return_lse=True,
                                                         **extras)
        else:
            out, lse = numbaflash.flash_attention(*args, causal=case.causal, softmax_scale=case.softmax_scale,
                                                  return_lse=True, **extras)
        outs = {}
        if case.use_outs:  # poisoned: unwritten elements show up as NaN
            for name, like in (("dq", q), ("dk", k), ("dv", v)):
                x = np.full(like.shape, np.nan, like.dtype)
                outs[name] = x if kind == "numpy" else to_device(x, kind)
        if case.varlen:
            grads = numbaflash.flash_attention_varlen_backward(dout_in, *args, out, lse, *sequences,
                                                               causal=case.causal,
                                                               softmax_scale=case.softmax_scale,
                                                               deterministic=case.deterministic, **outs,
                                                               **extras)
        else:
            grads = numbaflash.flash_attention_backward(dout_in, *args, out, lse, causal=case.causal,
                                                        softmax_scale=case.softmax_scale,
                                                        deterministic=case.deterministic, **outs, **extras)
        problems = []
        if len(grads) != (4 if case.sink else 3):
            problems.append(f"{len(grads)} results, expected {4 if case.sink else 3}")
        if outs and any(g is not outs[n] for g, n in zip(grads[:3], ("dq", "dk", "dv"), strict=True)):
            problems.append("a result is not the given dq/dk/dv")
        host_grads = tuple(to_host(g) for g in grads)
        if case.varlen:
            ratio, found = compare_varlen_gradients_with_reference(q, k, v, dout, *offsets, host_grads,
                                                                   causal=case.causal,
                                                                   softmax_scale=case.softmax_scale, **checks)
        else:
            ratio, found = compare_gradients_with_reference(q, k, v, dout, host_grads, causal=case.causal,
                                                            softmax_scale=case.softmax_scale, **checks)
        problems += found
        note = kind_note(case.kind, kind)
        return CaseResult(case, not problems, ratio, time.perf_counter() - start, "; ".join(problems) + note)
    except Exception as exc:
        return CaseResult(case, False, math.inf, time.perf_counter() - start,
                          f"raised {type(exc).__name__}: {exc}")


def parse_case_list(text: str) -> list[int]:
    """'3' or '3,17,40' -> case indices."""
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected case indices separated by commas, got {text!r}") from None
    if not indices or min(indices) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative case indices, got {text!r}")
    return indices


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m numbaflash.selftest",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--cases", type=int, default=None, help="number of cases (default 100; 24 with --quick)")
    p.add_argument("--quick", action="store_true", help="a small, fast set with small shapes")
    p.add_argument("--seed", type=int, default=None, help="seed to replay (default: a fresh random one)")
    p.add_argument("--case", type=parse_case_list, action="append", default=[],
                   help="run only these case indices (repeatable, or a comma list)")
    p.add_argument("--family", choices=FAMILIES, default=None, help="test only this kernel family")
    p.add_argument("--backward", action="store_true",
                   help="test flash_attention_backward (dq, dk, dv) instead of the forward")
    p.add_argument("--decode", action="store_true",
                   help="test flash_attention_with_kvcache (decode against a KV cache) instead of the "
                        "forward")
    p.add_argument("--fp8", action="store_true",
                   help="test the e4m3 (FP8) forward instead of the 16-bit one: the Hopper kernel, and "
                        "the mma.sync one on 30%% of the dense cases (torch and an sm_90 GPU)")
    p.add_argument("--variants", action="store_true",
                   help="make every case varlen, sliding-window or softcap (or several), on the "
                        "families with those kernels; with --backward too; with --decode, every case "
                        "a window, a softcap or both")
    p.add_argument("--pairs", action="store_true",
                   help="every forward or backward case runs a pair of head dims in place of its own: "
                        "(192, 128), (512, 256) or head dim 512 (run in halves of v)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case")
    return p


def variant_label(args: argparse.Namespace) -> str:
    """What every case of a ``--variants`` run is, for the header line."""
    if not args.variants:
        return ""
    return "variant (window/softcap) " if args.decode else "variant (varlen/window/softcap) "


def replay_command(args: argparse.Namespace, seed: int, index: int) -> str:
    flags = (" --quick" if args.quick else "") + (f" --family {args.family}" if args.family else "") + (
        " --backward" if args.backward else "") + (" --decode" if args.decode else "") + (
        " --fp8" if args.fp8 else "") + (
        " --variants" if args.variants else "") + (" --pairs" if args.pairs else "")
    return f"python -m numbaflash.selftest --seed {seed}{flags} --case {index}"


def _versions() -> str:
    from importlib import metadata

    from .. import __version__

    try:
        numba_cuda = metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        numba_cuda = "not installed"
    return f"numbaflash {__version__}, numba-cuda {numba_cuda}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backward and args.decode:
        parser.error("--backward and --decode test different operations: give one of them")
    if args.decode and args.family:
        parser.error("--decode has one kernel family per GPU: --family does not apply")
    if args.fp8 and (args.backward or args.decode or args.pairs or args.family):
        parser.error("--fp8 tests the e4m3 forward alone: --backward, --decode, --pairs and --family do "
                     "not apply")
    if args.decode and args.pairs:
        parser.error("--pairs applies to the forward and the backward (decode takes (192, 128) in its share)")
    if args.pairs:  # every case draws a pair (draw_value_dims' share)
        global VALUE_DIM_SHARE
        VALUE_DIM_SHARE = 1.0
    from numba import cuda

    from ..configs import runnable_families

    if not cuda.is_available():
        print("numbaflash self-test: no CUDA GPU available (numba.cuda.is_available() is False); "
              "it needs an NVIDIA GPU with compute capability >= 8.0 and its driver.", file=sys.stderr)
        return 2
    device = cuda.get_current_device()
    capability = tuple(device.compute_capability)
    name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    families = runnable_families(capability)
    if capability < (8, 0) or (args.family and args.family not in families):
        print(f"numbaflash self-test: {name} (sm_{capability[0]}{capability[1]}) cannot run "
              f"{args.family or 'numbaflash'} kernels (runs: {families if capability >= (8, 0) else 'none'})",
              file=sys.stderr)
        return 2
    families = [args.family] if args.family else families
    if args.variants and not args.backward and not args.decode:
        families = variant_families(families)
        if not families:
            print(f"numbaflash self-test: --variants: {args.family} has no window/softcap or varlen kernels "
                  f"(they are in {sorted({*WINDOW_SOFTCAP_FAMILIES, *VARLEN_FAMILIES})})", file=sys.stderr)
            return 2
    if args.fp8:
        if capability[0] != 9 or cuda_torch() is None:
            print("numbaflash self-test: --fp8 needs a Hopper GPU (sm_90) and torch with CUDA; this is "
                  f"{name} (sm_{capability[0]}{capability[1]})", file=sys.stderr)
            return 2
        families = ["fp8"]
    if args.backward or args.decode:
        families = ["backward" if args.backward else "decode"]
    seed = secrets.randbits(32) if args.seed is None else args.seed
    default_cases = 24 if args.quick else 100
    indices = sorted({i for group in args.case for i in group}) or range(args.cases or default_cases)
    print(f"GPU: {name}, compute capability {capability[0]}.{capability[1]}; {_versions()}")
    print(f"seed {seed} (replay: --seed {seed}); families {', '.join(families)}; {len(indices)} "
          f"{variant_label(args)}cases", flush=True)
    results = []
    for index in indices:
        if args.backward:
            result = run_backward_case(draw_backward_case(seed, index, args.quick, args.variants))
        elif args.decode:
            result = run_decode_case(draw_decode_case(seed, index, args.quick, args.variants))
        elif args.fp8:
            result = run_fp8_case(draw_fp8_case(seed, index, args.quick, args.variants))
        else:
            result = run_case(draw_case(seed, index, families, args.quick, args.variants), capability)
        results.append(result)
        if args.verbose or not result.ok:
            print(f"[{'ok' if result.ok else 'FAIL'}] case {index}: {result.case.describe()} "
                  f"ratio {result.ratio:.3f} {result.seconds:.2f}s {result.message}".rstrip(), flush=True)
    for family in families:
        rs = [r for r in results if r.case.family == family]
        worst = max((r.ratio for r in rs), default=0.0)
        varlen = sum(getattr(r.case, "varlen", False) for r in rs)  # (an FP8 case has no varlen)
        windowed = sum(r.case.window_size != (-1, -1) or r.case.softcap > 0 for r in rs)
        counts = ((varlen, "varlen"), (windowed, "window/softcap"))
        kinds = ", ".join(f"{n} {what}" for n, what in counts if n)
        print(f"{family}: {len(rs)} cases" + (f" ({kinds})" if kinds else "")
              + f", {sum(r.ok for r in rs)} passed, {sum(not r.ok for r in rs)} "
              f"failed, worst error ratio {worst:.3f}, {sum(r.seconds for r in rs):.1f}s")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED case {r.case.index}: {r.case.describe()}\n  {r.message}\n  replay: "
              f"{replay_command(args, seed, r.case.index)}")
    print(f"{'FAILED' if failed else 'PASSED'}: {len(results) - len(failed)}/{len(results)} cases passed "
          f"(seed {seed})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
