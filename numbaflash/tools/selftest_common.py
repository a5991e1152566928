"""What every self-test mode (forward, ``--backward``, ``--decode``) shares: the dtypes and GQA
groups it draws, the log-uniform length draw, the window and softcap draw, the conversions to
and from the device, and the outcome record. ``selftest`` and ``selftest_decode`` import it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..configs import ASYMMETRIC_HEAD_DIMS

DTYPE_NAMES = ("float16", "bfloat16")
GROUPS = (1, 2, 3, 4, 8)  # heads_q // heads_kv
# of the forward cases of selftest.WINDOW_SOFTCAP_FAMILIES, those with a window, a softcap or both
WINDOW_SOFTCAP_SHARE = 0.3


@dataclasses.dataclass
class CaseResult:
    """The outcome of one case: ``message`` says what went wrong (empty when it passed)."""

    case: Any  # a Case, BackwardCase or DecodeCase
    ok: bool
    ratio: float = 0.0  # err / (2 * err_low + floor); <= 1 passes
    seconds: float = 0.0
    message: str = ""


def log_uniform(rng: np.random.Generator, high: int) -> int:
    """An int from 1 to ``high``, log-uniform: short lengths as often as long ones."""
    return int(min(high, max(1, round(math.exp(rng.uniform(0.0, math.log(high + 0.5)))))))


def draw_window_softcap(seed: int, index: int, seqlen_q: int, seqlen_k: int, stream: int = 2,
                        share: float = WINDOW_SOFTCAP_SHARE) -> tuple[tuple[int, int], float]:
    """(window_size, softcap) of a case, from a stream of its own (the rest of the case is drawn as
    before): none for all but ``share`` of them; else a window (sizes 0, 1, 127, 4096, about the
    lengths, or random; asymmetric; a side -1 sometimes, both only below a share of 1), a softcap
    (30, 50 or random), or both. ``stream``: the random stream's tag (the backward's cases draw
    theirs from tag 4)."""
    rng = np.random.default_rng([seed, index, stream])
    if rng.random() >= share:
        return (-1, -1), 0.0
    what = rng.choice(["window", "softcap", "both"], p=[0.45, 0.25, 0.3])
    window, softcap = (-1, -1), 0.0
    if what != "softcap":
        def side() -> int:
            pick = rng.choice(["small", "fixed", "lengths", "unbounded"], p=[0.35, 0.3, 0.2, 0.15])
            if pick == "small":
                return int(rng.integers(0, 64))
            if pick == "fixed":
                return int(rng.choice([0, 1, 127, 4096]))
            if pick == "lengths":
                return int(rng.integers(0, max(seqlen_q, seqlen_k) + 1))
            return -1

        window = (side(), side())
        while window == (-1, -1) and share >= 1:  # a case that must have a window bounds a side
            window = (side(), side())
    if what != "window":
        softcap = float(rng.choice([30.0, 50.0, float(rng.uniform(2.0, 80.0))]))
    return window, softcap


def numpy_dtype(name: str) -> Any:
    if name == "float16":
        return np.float16
    import ml_dtypes

    return ml_dtypes.bfloat16


def cuda_torch() -> Any:
    """torch, when it imports and sees CUDA; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def kind_note(asked: str, ran: str) -> str:
    """What a case's line says when it ran on other inputs than it drew: a torch case without a CUDA
    torch runs on numba (or numpy) arrays, and a numba case of a head dim run split on torch (or
    numpy) ones (``operations.head_dims`` takes those two only)."""
    if asked == ran:
        return ""
    why = "torch with CUDA not importable" if asked == "torch" else "a split head dim takes torch or numpy"
    return f" ({why}: ran as {ran})"


def to_device(x: np.ndarray, kind: str) -> Any:
    """``x`` as a torch CUDA tensor or a Numba device array (a DeviceBuffer for bfloat16); int32
    (varlen offsets) and float32 (a learnable sink) as they are."""
    if kind == "torch":
        torch = cuda_torch()
        if x.dtype in (np.int32, np.float32):
            return torch.from_numpy(np.ascontiguousarray(x)).cuda()
        tdtype = torch.float16 if x.dtype == np.float16 else torch.bfloat16
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(tdtype).cuda()
    from numba import cuda

    from ..runtime.buffers import DeviceBuffer

    return cuda.to_device(x) if x.dtype in (np.float16, np.int32, np.float32) else DeviceBuffer(x)


def to_host(x: Any) -> np.ndarray:
    """Any result (numpy, torch, Numba device array, DeviceBuffer) as a float64 numpy array."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.float().cpu().numpy().astype(np.float64)
    if hasattr(x, "copy_to_host"):
        if x.dtype.itemsize == 2 and hasattr(x, "view"):  # bfloat16 Numba arrays: copy the bits
            return x.view(np.uint16).copy_to_host().view(x.dtype).astype(np.float64)
        x = x.copy_to_host()
    return np.asarray(x).astype(np.float64)


def draw_sink(seed: int, index: int, heads_q: int, share: float, stream: int = 9) -> tuple[float, ...]:
    """The learnable sink of a case (``share`` of them), or () for none, from a stream of its own:
    float32 logits (heads_q,), each about N(0, 2), or (15% each) -inf (no sink on that head) or 5
    to 12 (a sink that outweighs the scores of unit-amplitude inputs)."""
    rng = np.random.default_rng([seed, index, stream])
    if rng.random() >= share:
        return ()
    logits = rng.standard_normal(heads_q) * 2.0
    pick = rng.random(heads_q)
    logits = np.where(pick < 0.15, -np.inf, np.where(pick < 0.3, rng.uniform(5.0, 12.0, heads_q), logits))
    return tuple(float(x) for x in logits.astype(np.float32))


# The head dims a forward or backward case draws in place of its stratum's: the pairs with a
# kernel and head dim 512 (run split: ``operations.head_dims``).
DRAWN_HEAD_DIMS = (*ASYMMETRIC_HEAD_DIMS, (512, 512))


def draw_value_dims(seed: int, index: int, share: float, stream: int = 26,
                    pairs: tuple[tuple[int, int], ...] = DRAWN_HEAD_DIMS) -> tuple[int, ...]:
    """The pair of head dims a case runs (``share`` of them: one of ``pairs``), else (), from a
    stream of its own (every other field of the case is what it was before)."""
    rng = np.random.default_rng([seed, index, stream])
    if rng.random() >= share:
        return ()
    return tuple(pairs[int(rng.integers(0, len(pairs)))])
