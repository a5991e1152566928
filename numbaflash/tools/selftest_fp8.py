"""The self-test's FP8 mode (``python -m numbaflash.selftest --fp8``; issue 60): the e4m3 Hopper
forward on random cases against float64 attention of the dequantized inputs (x8 · descale).

Tolerance: FlashAttention's rule, with the FP8 computation as the "same computation in the input
precision". Its yardstick is the float64 attention of the same dequantized inputs with P rounded
to e4m3 before P·V (P = exp(s - row max) times 256, the kernel's static scale; the row sums taken
before the rounding), which no e4m3 PV product can avoid. A case passes when

    max |out - exact| <= 3 max |rounded - exact| + 2^-8 max |exact|

(the last term: the 16-bit output's own rounding), and its LSE, where asked, matches the exact one
within ``lse_tolerance``: the 16-bit kernels' (``reference.lse_tolerance``) plus 2^-11 of the
largest Σ_d |q_d k_d| · scale of the case. The scores are exact products of e4m3 values, but
Hopper's FP8 wgmma sums them with less than fp32's precision: on an H200 the 48 LSE errors past
the 16-bit tolerance (300 cases, seed 1130; docs/PERFORMANCE.md, "The FP8 forward") were 2^-12.2
to 2^-14.5 of that sum, where the 16-bit kernels' fp32 sums stay within 2^-15 of the LSE. Rows
that see no key must give 0 and LSE -inf (or the sink's logit).

Cases draw head dims 64, 128 and 256; batch, lengths (log-uniform, seqlen_q far from seqlen_k),
GQA groups, causal masking, windows, softcaps (``draw_window_softcap``; every case with
``--variants``), learnable sinks, bf16 or fp16 output, descales per (batch, KV head) from
``fp8.quantize`` (some with the Hadamard rotation of q and k) or none (e4m3 values as they are),
and amplitudes that make the softmax flat or peaked. About 30% of the cases (half with
``--variants``) are packed: 2-4 sequences of their own lengths (empty ones too) through
``flash_attention_varlen``, each judged against its own reference. About 30% of the dense cases run
the mma.sync e4m3 kernel (``ForwardConfig.fp8``), forced on Hopper. Needs torch with CUDA and an FP8
GPU (sm_89 on; packed cases: Hopper).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..configs import FP8_HEAD_DIMS
from .reference import lse_tolerance as lse_tolerance_16
from .reference import visible_keys
from .selftest_common import GROUPS, CaseResult, draw_sink, draw_window_softcap, log_uniform

P_SCALE = 256.0  # the kernel's static P scale (``kernels.softmax.P_SCALE_E4M3``)
MMA_SHARE = 0.3  # of the dense cases: the mma.sync e4m3 kernel (forced on Hopper)
LIMITS = {False: (4096, 10**7), True: (512, 10**6)}  # (longest seqlen, b·h·sq·sk cap: the float64 reference)


@dataclasses.dataclass
class Fp8Case:
    """One FP8 problem; everything, data included, follows from (seed, index)."""

    seed: int
    index: int
    head_dim: int
    causal: bool
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    amplitude: float  # the inputs are N(0, amplitude²) before quantization
    scaling: str  # "per-head" (fp8.quantize), "hadamard" (rotated q and k, then per head), "none"
    out_dtype: str  # "bfloat16" | "float16"
    return_lse: bool
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sink: tuple[float, ...] = ()
    # packed (``flash_attention_varlen``): each sequence's own lengths, at most seqlen_q and seqlen_k
    # (the first's are those); empty: a dense call
    q_lengths: tuple[int, ...] = ()
    k_lengths: tuple[int, ...] = ()
    family: str = "fp8"
    # dense cases: the mma.sync e4m3 kernel (``ForwardConfig.fp8``) instead of the Hopper one, forced
    # on Hopper (every dense case runs it on other FP8 GPUs)
    mma: bool = False

    def describe(self) -> str:
        return (f"d{self.head_dim} b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k} h{self.heads_q}/"
                f"{self.heads_kv} {'causal' if self.causal else 'full'} amp{self.amplitude:g} {self.scaling} "
                f"out={self.out_dtype} lse={int(self.return_lse)}"
                + (f" window={self.window_size}" if self.window_size != (-1, -1) else "")
                + (f" softcap={self.softcap:g}" if self.softcap else "")
                + (f" sink={','.join(f'{x:.3g}' for x in self.sink)}" if self.sink else "")
                + (f" packed q{list(self.q_lengths)} k{list(self.k_lengths)}" if self.q_lengths else "")
                + (" mma" if self.mma else ""))


def draw_fp8_case(seed: int, index: int, quick: bool = False, variants: bool = False) -> Fp8Case:
    """The case (seed, index): head dims cycle; the rest is random, within ``LIMITS``."""
    rng = np.random.default_rng([seed, index, 60])
    head_dim = FP8_HEAD_DIMS[index % len(FP8_HEAD_DIMS)]
    longest, cap = LIMITS[quick]
    group = int(rng.choice(GROUPS))
    heads_kv = int(rng.integers(1, 4))
    heads_q = heads_kv * group
    batch = int(rng.integers(1, 4))
    seqlen_q, seqlen_k = log_uniform(rng, longest), log_uniform(rng, longest)
    packing = np.random.default_rng([seed, index, 63])  # its own stream: the other draws stay as they were
    packed = packing.random() < (0.5 if variants else 0.3)
    if packed:
        batch = int(packing.integers(2, 5))
    while batch * heads_q * seqlen_q * seqlen_k > cap:
        seqlen_q, seqlen_k = max(1, seqlen_q // 2), max(1, seqlen_k // 2)
    causal = bool(rng.random() < 0.5)
    scaling = str(rng.choice(["per-head", "hadamard", "none"], p=[0.6, 0.2, 0.2]))
    window, softcap = draw_window_softcap(seed, index, seqlen_q, seqlen_k, stream=61,
                                          share=1.0 if variants else 0.3)
    if window != (-1, -1):
        causal = False
    q_lengths = k_lengths = ()
    if packed:
        q_lengths = (seqlen_q, *(int(packing.integers(0, seqlen_q + 1)) for _ in range(batch - 1)))
        k_lengths = (seqlen_k, *(int(packing.integers(0, seqlen_k + 1)) for _ in range(batch - 1)))
        order = packing.permutation(batch)  # the longest anywhere in the pack
        q_lengths, k_lengths = tuple(q_lengths[i] for i in order), tuple(k_lengths[i] for i in order)
    mma = not packed and np.random.default_rng([seed, index, 64]).random() < MMA_SHARE  # its own stream
    return Fp8Case(seed, index, head_dim, causal, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                   amplitude=float(rng.choice([0.5, 1.0, 3.0])), scaling=scaling,
                   out_dtype=str(rng.choice(["bfloat16", "float16"], p=[0.75, 0.25])),
                   return_lse=bool(rng.random() < 0.5), window_size=window, softcap=softcap,
                   sink=draw_sink(seed, index, heads_q, 0.15, stream=62), q_lengths=q_lengths,
                   k_lengths=k_lengths, mma=bool(mma))


def lse_tolerance(ref_lse: np.ndarray, magnitude: float) -> float:
    """The FP8 kernel's LSE tolerance: the 16-bit kernels' plus 2^-11 of ``magnitude``, the largest
    Σ_d |q_d k_d| · scale (what the tensor cores' e4m3 sums hold; module docstring)."""
    return lse_tolerance_16(ref_lse) + 2.0**-11 * magnitude


def _reference(q, k, v, case: Fp8Case):
    """float64 (exact, rounded, lse, magnitude): attention of the dequantized q, k, v (numpy (b, s,
    h, d)), the same with P rounded to e4m3 as the kernel scales it, and the largest Σ_d |q_d k_d| ·
    scale (``lse_tolerance``)."""
    import ml_dtypes

    b, sq, hq, d = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    qf = q.transpose(0, 2, 1, 3)
    kf = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)
    vf = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)
    s = qf @ kf.transpose(0, 1, 3, 2) / np.sqrt(d)
    magnitude = float((np.abs(qf) @ np.abs(kf).transpose(0, 1, 3, 2)).max(initial=0.0)) / np.sqrt(d)
    if case.softcap > 0:
        s = case.softcap * np.tanh(s / case.softcap)
    if case.causal or case.window_size != (-1, -1):
        s = np.where(visible_keys(sq, sk, case.causal, case.window_size), s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    sink = np.asarray(case.sink, np.float64)[None, :, None, None] if case.sink else None
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True) + (np.exp(sink - m) if sink is not None else 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(total > 0, np.log(total) + m, -np.inf)[..., 0]
        inverse = np.where(total > 0, 1.0 / total, 0.0)
    rounded_p = (p * P_SCALE).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / P_SCALE
    exact = ((p * inverse) @ vf).transpose(0, 2, 1, 3)
    rounded = ((rounded_p * inverse) @ vf).transpose(0, 2, 1, 3)
    return exact, rounded, lse, magnitude


def _run_packed(case: Fp8Case, q8, k8, v8, deq, options: dict):
    """A packed case: each sequence's first rows of the dense draws, packed, through
    ``flash_attention_varlen``; (out, lse, exact, rounded, ref_lse, magnitude), the outputs and
    references as flat rows (rows, heads, head_dim) and LSEs as (heads, rows) of every sequence."""
    import torch

    import numbaflash as nf

    def pack(x, lengths):
        return torch.cat([x[b, :n] for b, n in enumerate(lengths)]).cuda()

    cu_q = np.concatenate([[0], np.cumsum(case.q_lengths)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(case.k_lengths)]).astype(np.int32)
    q, k, v = pack(q8, case.q_lengths), pack(k8, case.k_lengths), pack(v8, case.k_lengths)
    out = torch.full((q.shape[0], case.heads_q, case.head_dim), float("nan"), dtype=options["out_dtype"],
                     device="cuda")
    result = nf.flash_attention_varlen(q, k, v, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(),
                                       case.seqlen_q, case.seqlen_k, out=out, **options)
    got, lse = result if case.return_lse else (result, None)
    torch.cuda.synchronize()
    parts, magnitude = [], 0.0
    for b, (sq, sk) in enumerate(zip(case.q_lengths, case.k_lengths, strict=True)):
        one = dataclasses.replace(case, batch=1, seqlen_q=sq, seqlen_k=sk, q_lengths=(), k_lengths=())
        q_b, k_b, v_b = deq[0][b:b + 1, :sq], deq[1][b:b + 1, :sk], deq[2][b:b + 1, :sk]
        exact, rounded, ref_lse, m = _reference(q_b, k_b, v_b, one)
        parts.append((exact[0], rounded[0], ref_lse[0]))
        magnitude = max(magnitude, m)
    exact = np.concatenate([p[0] for p in parts])  # (rows, heads, head_dim)
    rounded = np.concatenate([p[1] for p in parts])
    ref_lse = np.concatenate([p[2] for p in parts], axis=-1)  # (heads, rows)
    return (got.double().cpu().numpy(), None if lse is None else lse.double().cpu().numpy(), exact, rounded,
            ref_lse, magnitude)


def run_fp8_case(case: Fp8Case) -> CaseResult:
    """Run one case on the GPU and judge it (``CaseResult.ratio``: the error over the bound); an
    ``mma`` case on Hopper with the mma.sync configs in ``configs.FP8_DEFAULTS`` for its call."""
    from numbaflash.operations.fp8_forward import mma_kernel_forced

    if not case.mma:
        return _run_fp8_case(case)
    with mma_kernel_forced():
        return _run_fp8_case(case)


def _run_fp8_case(case: Fp8Case) -> CaseResult:
    import torch

    import numbaflash as nf
    from numbaflash import fp8

    start = time.perf_counter()
    try:
        g = torch.Generator().manual_seed(case.seed * 1_000_003 + case.index)
        rows = ((case.seqlen_q, case.heads_q), (case.seqlen_k, case.heads_kv), (case.seqlen_k, case.heads_kv))
        q, k, v = (torch.randn(case.batch, s, h, case.head_dim, generator=g) * case.amplitude
                   for s, h in rows)
        if case.scaling == "none":
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
            descales = {}
            deq = tuple(x.double().numpy() for x in (q8, k8, v8))
        else:
            x = fp8.quantize(q, k, v, hadamard=case.scaling == "hadamard", seed=case.index)
            q8, k8, v8 = x.q, x.k, x.v
            descales = {name: getattr(x, name).cuda() for name in ("q_descale", "k_descale", "v_descale")}
            deq = tuple(t.double().numpy() for t in x.dequantize())
        out_dtype = getattr(torch, case.out_dtype)
        sink = torch.tensor(case.sink, dtype=torch.float32, device="cuda") if case.sink else None
        options = dict(**descales, causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                       return_lse=case.return_lse, learnable_sink=sink, out_dtype=out_dtype)
        if case.q_lengths:
            got, lse, exact, rounded, ref_lse, magnitude = _run_packed(case, q8, k8, v8, deq, options)
        else:
            out = torch.full((case.batch, case.seqlen_q, case.heads_q, case.head_dim), float("nan"),
                             dtype=out_dtype, device="cuda")
            result = nf.flash_attention(q8.cuda(), k8.cuda(), v8.cuda(), out=out, **options)
            got, lse = result if case.return_lse else (result, None)
            torch.cuda.synchronize()
            got = got.double().cpu().numpy()
            lse = None if lse is None else lse.double().cpu().numpy()
            exact, rounded, ref_lse, magnitude = _reference(*deq, case)
        seconds = time.perf_counter() - start
        if not np.isfinite(got).all():
            return CaseResult(case, False, float("inf"), seconds,
                              "non-finite output (an element not written?)")
        bound = 3 * float(np.abs(rounded - exact).max()) + 2.0**-8 * float(np.abs(exact).max()) + 1e-6
        ratio = float(np.abs(got - exact).max()) / bound
        message = "" if ratio <= 1 else f"max error {ratio * bound:.3g} over the bound {bound:.3g}"
        if lse is not None:
            seen = np.isfinite(ref_lse)
            if not np.array_equal(np.isfinite(lse), seen):
                message += " LSE: finite where the reference is not (or the other way)"
            elif seen.any() and np.abs(lse[seen] - ref_lse[seen]).max() > lse_tolerance(ref_lse, magnitude):
                message += (f" LSE error {np.abs(lse[seen] - ref_lse[seen]).max():.3g} over "
                            f"{lse_tolerance(ref_lse, magnitude):.3g}")
        return CaseResult(case, not message, ratio, seconds, message.strip())
    except Exception as exc:  # noqa: BLE001 - a case that raises fails, and the run goes on
        return CaseResult(case, False, float("inf"), time.perf_counter() - start,
                          f"raised {type(exc).__name__}: {exc}")
