"""Attention operands on the host side: what each input is (``describe``) and the checks every
call makes before anything is compiled or launched. Pure Python and numpy; torch only for torch
inputs, imported when one is seen."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .configs import ASYMMETRIC_HEAD_DIMS, MLA_HEAD_DIMS, SUPPORTED_HEAD_DIMS

FLOAT16 = np.dtype(np.float16)


def bfloat16_dtype() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


class Operand:
    """One attention operand reduced to what the kernel needs."""

    __slots__ = ("name", "shape", "dtype_name", "on_device", "obj", "strides", "pointer", "stream", "device")

    def __init__(self, name: str, shape: tuple[int, ...], dtype_name: str, on_device: bool, obj: Any,
                 strides: tuple[int, ...] = (), pointer: int = 0, stream: int | None = None,
                 device: int | None = None) -> None:
        self.name = name
        self.shape = shape
        self.dtype_name = dtype_name  # "float16" | "bfloat16"
        self.on_device = on_device
        self.obj = obj
        self.strides = strides  # in elements (device operands)
        self.pointer = pointer
        self.stream = stream  # CUDA array interface "stream" (None: not given)
        self.device = device  # CUDA device ordinal where known (torch)

    def __repr__(self) -> str:
        return f"Operand({self.name}, shape {self.shape}, {self.dtype_name}, strides {self.strides})"

    @property
    def span(self) -> int:
        """Elements from the first to the last element (the flat extent in memory)."""
        if len(self.shape) == 4:
            (b, s, h, d), (sb, ss, sh, sd) = self.shape, self.strides
            return 1 + (b - 1) * sb + (s - 1) * ss + (h - 1) * sh + (d - 1) * sd
        return 1 + sum((n - 1) * st for n, st in zip(self.shape, self.strides, strict=True))


def dtype_name_of_numpy(dtype: np.dtype, name: str) -> str:
    """'float16' or 'bfloat16' for those dtypes; TypeError for any other (ml_dtypes or not)."""
    if dtype == FLOAT16:
        return "float16"
    bf16 = bfloat16_dtype()
    if (bf16 is not None and dtype == bf16) or (dtype.name == "bfloat16" and dtype.itemsize == 2):
        return "bfloat16"
    raise TypeError(f"{name} must be float16 or bfloat16, got {dtype}")


_KINDS: dict[type, str] = {np.ndarray: "numpy"}  # type -> "numpy" | "torch" | "cai"
TORCH_TYPES: set[type] = set()  # the types kind_of has found to be torch's
_TYPESTRS: dict[str, np.dtype] = {}  # CUDA array interface typestr -> its dtype
_TORCH_DTYPES: dict = {}  # torch.float16 -> "float16", torch.bfloat16 -> "bfloat16", once torch is seen
TORCH_DTYPE_NAMES = _TORCH_DTYPES
FLOAT32: list = []  # [torch.float32], once torch is seen


def kind_of(x: Any) -> str:
    """'numpy', 'torch' or 'cai' (an object with ``__cuda_array_interface__``); TypeError else."""
    kind = _KINDS.get(type(x))
    if kind is None:
        if isinstance(x, np.ndarray):
            kind = "numpy"
        elif type(x).__module__.split(".")[0] == "torch":
            kind = "torch"
            TORCH_TYPES.add(type(x))
        elif hasattr(x, "__cuda_array_interface__"):
            kind = "cai"
        else:
            return "other"
        _KINDS[type(x)] = kind
    return kind


_TORCH = []  # [the torch module], once a torch input has been seen


def _torch():
    if not _TORCH:
        import torch

        FLOAT32.append(torch.float32)
        _TORCH.append(torch)
    return _TORCH[0]


def _torch_dtype_names() -> dict:
    if not _TORCH_DTYPES:
        torch = _torch()
        _TORCH_DTYPES.update({torch.float16: "float16", torch.bfloat16: "bfloat16"})
    return _TORCH_DTYPES


def describe(name: str, x: Any) -> Operand:
    """Classify one input: host numpy array or device array (torch CUDA tensor or
    ``__cuda_array_interface__``)."""
    kind = kind_of(x)
    if kind == "torch":
        if not x.is_cuda:
            raise TypeError(f"{name}: torch tensors must be on a CUDA device, got device {x.device}")
        dtype_name = (_TORCH_DTYPES or _torch_dtype_names()).get(x.dtype)
        if dtype_name is None:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        return Operand(name, tuple(x.shape), dtype_name, True, x, tuple(x.stride()), x.data_ptr(),
                       device=x.get_device())
    if kind == "numpy":
        return Operand(name, tuple(x.shape), dtype_name_of_numpy(x.dtype, name), False, x)
    if kind != "cai":
        raise TypeError(
            f"{name} must be a numpy array or a CUDA array (__cuda_array_interface__), "
            f"got {type(x).__name__}"
        )
    cai = x.__cuda_array_interface__
    typestr = _TYPESTRS.get(cai["typestr"])
    if typestr is None:
        try:
            typestr = _TYPESTRS[cai["typestr"]] = np.dtype(cai["typestr"])
        except TypeError as exc:
            raise TypeError(f"{name}: unknown __cuda_array_interface__ typestr {cai['typestr']!r}") from exc
    dtype = getattr(x, "dtype", None)
    dtype = dtype if isinstance(dtype, np.dtype) else typestr
    if dtype.itemsize != typestr.itemsize:
        raise TypeError(
            f"{name}: its dtype attribute ({dtype}) and its __cuda_array_interface__ typestr "
            f"({cai['typestr']}) disagree on the element size"
        )
    shape = tuple(map(int, cai["shape"]))
    itemsize = dtype.itemsize
    byte_strides = cai.get("strides")
    if byte_strides is None:
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    else:
        strides = tuple(int(s) // itemsize for s in byte_strides)
        if any(s * itemsize != b for s, b in zip(strides, byte_strides, strict=True)):
            raise ValueError(f"{name}: strides {byte_strides} are not multiples of the element size")
    return Operand(name, shape, dtype_name_of_numpy(dtype, name), True, x, strides,
                   int(cai["data"][0]), cai.get("stream"))


def check_shapes(q: Operand, k: Operand, v: Operand, paged: bool = False, value_dim: bool = False,
                 pairs: tuple[tuple[int, int], ...] = ASYMMETRIC_HEAD_DIMS) -> None:
    """q (batch, seqlen_q, heads_q, head_dim) against k and v (batch, seqlen_k, heads_kv,
    head_dim); ``paged``: k and v are a paged cache (num_pages, page_size, heads_kv, head_dim),
    whose first dimension is not q's batch. ``value_dim``: the call takes v of another head dim
    where a kernel has that pair (``configs.ASYMMETRIC_HEAD_DIMS``: the dense forward's and
    backward's; ``pairs``: the call's, the KV-cache call's fewer)."""
    for op in (q, k, v):
        if len(op.shape) != 4:
            raise ValueError(
                f"{op.name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {op.shape}"
            )
        if 0 in op.shape:
            raise ValueError(f"{op.name} is empty (shape {op.shape}); every dimension must be >= 1")
    b, _, hq, d = q.shape
    bk, _, hkv, dk = k.shape
    dv = v.shape[3]
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if bk != b and not paged:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hq % hkv:
        raise ValueError(f"heads of q ({hq}) must be a multiple of heads of k/v ({hkv})")
    if dv != d:
        listed = ", ".join(f"({a}, {c})" for a, c in pairs)
        if not value_dim:
            raise ValueError(f"v's head_dim ({dv}) differs from q's and k's ({d}): this call needs one "
                             f"head_dim (flash_attention and flash_attention_backward take the pairs "
                             f"{listed})")
        if (d, dv) not in pairs:
            raise ValueError(f"no kernel for q/k head_dim {d} with v head_dim {dv}: v's head_dim must be q's "
                             f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))}) or one of the pairs {listed}")
        return _check_dtypes_and_places(q, k, v)
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d} (flash_attention, "
                         f"flash_attention_varlen and their backwards pad other head dims up to "
                         f"{max(SUPPORTED_HEAD_DIMS)} and run 512 in halves of v on torch and numpy inputs; "
                         f"the KV-cache call does neither)")
    _check_dtypes_and_places(q, k, v)


def _check_dtypes_and_places(q: Operand, k: Operand, v: Operand) -> None:
    """q, k and v of one dtype, all numpy or all device arrays."""
    if not q.dtype_name == k.dtype_name == v.dtype_name:
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype_name}, {k.dtype_name}, {v.dtype_name}")
    if not q.on_device == k.on_device == v.on_device:
        raise TypeError("q, k, v must be all numpy (host) arrays or all device arrays, not a mix")


def check_device_layout(op: Operand) -> None:
    """The kernel moves 16-byte chunks: head_dim contiguous, rows 16-byte aligned."""
    s0, s1, s2, s3 = op.strides
    if s3 != 1:
        raise ValueError(
            f"{op.name}: the last (head_dim) dimension must be contiguous (stride 1), got strides "
            f"{op.strides} (in elements); pass a contiguous copy"
        )
    if op.pointer % 16 or s0 % 8 or s1 % 8 or s2 % 8:
        raise ValueError(
            f"{op.name}: rows must start on 16-byte boundaries (pointer {op.pointer:#x}, strides "
            f"{op.strides} in elements must be multiples of 8); pass a contiguous copy"
        )
    if s0 < 0 or s1 < 0 or s2 < 0:
        raise ValueError(f"{op.name}: negative strides {op.strides} are not supported")


def check_flag(name: str, value: Any) -> bool:
    """``causal`` / ``return_lse``: a Python or numpy bool, nothing else (``'no'`` is truthy)."""
    if value is True or value is False:
        return value
    if not isinstance(value, np.bool_):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return bool(value)


_F32 = np.finfo(np.float32)
_F32_TINY, _F32_MAX = float(_F32.tiny), float(_F32.max)


def check_softmax_scale(scale: Any, head_dim: int) -> float:
    """The scale as a float: a real number (not a bool or a string), positive, and finite and
    non-zero once multiplied by log2(e) in float32, as the kernel uses it."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {scale!r}")
    if not _F32_TINY <= scale * math.log2(math.e) <= _F32_MAX:
        raise ValueError(
            f"softmax_scale * log2(e) must be a normal float32 (the kernel's scale), so "
            f"softmax_scale must lie in about [8.1e-39, 2.4e38], got {scale!r}"
        )
    return scale


def check_window_size(window_size: Any) -> tuple[int, int]:
    """``window_size`` as ``(left, right)``: a pair (tuple or list) of ints (Python or numpy, not
    bools), each -1 (unbounded) or >= 0 (FlashAttention's sliding window)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral)
                   for x in window_size)):
        raise TypeError("window_size must be a pair (left, right) of ints, each -1 (unbounded) or >= 0, got "
                        f"{type(window_size).__name__} {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError("window_size must be (left, right) with each -1 (unbounded) or >= 0, got "
                         f"({left}, {right})")
    return left, right


def check_softcap(softcap: Any, softmax_scale: float) -> float:
    """``softcap`` as a float: a real number (not a bool or a string), 0 (off) or positive and
    finite, such that the kernel's factors softcap·log2(e) and softmax_scale / softcap are normal
    float32 values."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 for none), got {type(softcap).__name__} "
                        f"{softcap!r}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be 0 (off) or a positive finite number, got {softcap!r}")
    if softcap > 0 and not (_F32_TINY <= softcap * math.log2(math.e) <= _F32_MAX
                            and _F32_TINY <= softmax_scale / softcap <= _F32_MAX):
        raise ValueError(f"softcap * log2(e) and softmax_scale / softcap must be normal float32 values (the "
                         f"kernel's factors), got softcap {softcap!r} with softmax_scale {softmax_scale!r}")
    return softcap


def describe_out(out: Any, qd: Operand, value_dim: int | None = None) -> Operand:
    """``out`` given for a forward call of query ``qd``: q's shape (its head dim v's, ``value_dim``,
    where that differs) and dtype, where the inputs live, writeable when a numpy array."""
    od = describe("out", out)
    shape = qd.shape if value_dim is None else (*qd.shape[:-1], value_dim)
    if od.shape != shape or od.dtype_name != qd.dtype_name:
        whose = "q's shape" if shape == qd.shape else "q's shape with v's head_dim"
        raise ValueError(f"out must have {whose} {shape} and dtype {qd.dtype_name}, "
                         f"got {od.shape} {od.dtype_name}")
    if od.on_device != qd.on_device:
        raise TypeError("out must live where the inputs live (numpy for numpy inputs, device otherwise)")
    if not od.on_device and not out.flags.writeable:
        raise ValueError("out is a read-only numpy array; pass a writeable one")
    return od


def check_no_self_overlap(op: Operand) -> None:
    """Distinct elements of ``op`` must be distinct memory (no stride 0, no overlapping rows):
    dimensions sorted by stride, each stride at least the extent of those inside it. Any rank
    (the packed varlen layouts are 3-D)."""
    contiguous, size = [], 1
    for n in reversed(op.shape):
        contiguous.insert(0, size)
        size *= n
    if tuple(op.strides) == tuple(contiguous):  # C-contiguous: nothing to sort
        return
    extent = 1
    for n, stride in sorted(((n, abs(st)) for n, st in zip(op.shape, op.strides, strict=True) if n > 1),
                            key=lambda d: d[1]):
        if stride < extent:
            raise ValueError(
                f"{op.name}: strides {op.strides} (in elements) for shape {op.shape} make elements "
                "share memory (a stride 0 or overlapping rows); pass an array with its own memory"
            )
        extent = stride * n


def check_out_aliasing(od: Operand, ops: list[Operand], itemsize: int = 2) -> None:
    """A device ``out`` may be exactly q (each CTA reads its Q rows before writing them) but
    must not share memory with k or v, or partly with q: other CTAs would read it after it
    was overwritten."""
    lo, hi = od.pointer, od.pointer + od.span * itemsize
    for op in ops:
        if op.pointer < hi and lo < op.pointer + op.span * itemsize:
            if op.name == "q" and op.pointer == od.pointer and op.strides == od.strides:
                continue
            raise ValueError(
                f"out shares memory with {op.name}; the kernel would read values it has already "
                f"overwritten: pass an out that does not overlap k or v (out may be q itself)"
            )


def check_same_device(ops: list[Operand], current: int) -> None:
    """Torch operands must sit on the current device (ordinal ``current``): the kernel runs there."""
    for op in ops:
        if op.device is not None and op.device != current:
            where = ", ".join(f"{o.name} on cuda:{o.device}" for o in ops if o.device is not None)
            raise ValueError(
                f"all tensors must be on the current CUDA device (cuda:{current}), got {where}; "
                "move them, or make their device current first (torch.cuda.set_device, "
                "numba.cuda.select_device)"
            )


def device_pointer(obj: Any) -> int:
    if kind_of(obj) == "torch":
        return obj.data_ptr()
    return int(obj.__cuda_array_interface__["data"][0])


def stream_handle(q: Operand) -> int:
    """The stream to launch on: torch's current stream for torch inputs, else the stream the
    CUDA array interface names (None, or 1 = the legacy default stream: handle 0)."""
    if q.device is not None:  # torch (the only kind whose device is known)
        return torch_stream(q.device)
    return 0 if q.stream in (None, 1) else int(q.stream)


_RAW_STREAM = None


def torch_stream(device: int) -> int:
    """torch's current stream on ``device`` as a handle: its raw-stream query where this torch
    has it (what Triton calls per launch: a fraction of a microsecond), else the public API."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        torch = _torch()
        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _RAW_STREAM(device)


def empty_like(ref: Any, shape: tuple[int, ...], dtype_name: str):
    """A new device array for the output, of the inputs' library where we know it."""
    if kind_of(ref) == "torch":
        return ref.new_empty(shape)  # ref's dtype and device (torch.empty with keywords costs 2x)
    module = type(ref).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy.empty(shape, dtype=ref.dtype)
    from numba import cuda

    dtype = FLOAT16 if dtype_name == "float16" else bfloat16_dtype()
    return cuda.device_array(shape, dtype=dtype)


def empty_lse(ref: Any, shape: tuple[int, ...]):
    if kind_of(ref) == "torch":
        return ref.new_empty(shape, dtype=_torch().float32)
    if type(ref).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.empty(shape, dtype=cupy.float32)
    from numba import cuda

    return cuda.device_array(shape, dtype=np.float32)


# ------------------------------------------------------------------ the backward's operands


def _where(op: Operand) -> str:
    return "a device array" if op.on_device else "a numpy (host) array"


def check_like(op: Operand, ref: Operand) -> None:
    """``op`` lives where ``ref`` lives (numpy or device) and has its shape and dtype (dout and
    out like q; the gradients like q, k or v)."""
    if op.on_device != ref.on_device:
        raise TypeError(f"{op.name} must be {_where(ref)} like {ref.name}, got {_where(op)}")
    if op.shape != ref.shape or op.dtype_name != ref.dtype_name:
        raise ValueError(f"{op.name} must have {ref.name}'s shape {ref.shape} and dtype {ref.dtype_name}, "
                         f"got {op.shape} {op.dtype_name}")


def describe_lse(x: Any, shape: tuple[int, ...], on_device: bool,
                 what: str = "(batch, heads_q, seqlen_q)") -> Operand:
    """The forward's log-sum-exp as an operand: float32 of ``shape`` (batch, heads_q, seqlen_q),
    a numpy array when the other inputs are (any layout: it is copied), else a C-contiguous
    device array (the kernel reads it flat) on a 4-byte boundary."""
    kind = kind_of(x)
    device = None
    if kind == "numpy":
        dtype, dims, strides, pointer = x.dtype, tuple(x.shape), (), 0
    elif kind == "torch":
        if not x.is_cuda:
            raise TypeError(f"lse: torch tensors must be on a CUDA device, got device {x.device}")
        if x.dtype != _torch().float32:
            raise TypeError(f"lse must be float32 (what flash_attention(..., return_lse=True) returns), "
                            f"got {x.dtype}")
        dtype, dims, strides, pointer = np.dtype(np.float32), tuple(x.shape), tuple(x.stride()), x.data_ptr()
        device = x.get_device()
    elif kind == "cai":
        cai = x.__cuda_array_interface__
        try:
            dtype = np.dtype(cai["typestr"])
        except TypeError as exc:
            raise TypeError(f"lse: unknown __cuda_array_interface__ typestr {cai['typestr']!r}") from exc
        dims = tuple(map(int, cai["shape"]))
        byte_strides = cai.get("strides")
        strides = (tuple(math.prod(dims[i + 1:]) for i in range(len(dims))) if byte_strides is None
                   else tuple(int(s) // 4 if int(s) % 4 == 0 else -1 for s in byte_strides))
        pointer = int(cai["data"][0])
    else:
        raise TypeError(f"lse must be a numpy array or a CUDA array (__cuda_array_interface__), "
                        f"got {type(x).__name__}")
    on = kind != "numpy"
    if on != on_device:
        where = "a device array" if on_device else "a numpy (host) array"
        raise TypeError(f"lse must be {where} like q, got {'a device' if on else 'a numpy (host)'} array")
    if dtype != np.float32:
        raise TypeError(f"lse must be float32 (what flash_attention(..., return_lse=True) returns), "
                        f"got {dtype}")
    if dims != tuple(shape):
        raise ValueError(f"lse must have shape {what} = {tuple(shape)}, got {dims}")
    if on:
        dense = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        if any(n > 1 and st != want for n, st, want in zip(dims, strides, dense, strict=True)):
            raise ValueError(f"lse must be C-contiguous (strides {dense} in elements), got strides "
                             f"{strides}; pass a contiguous copy")
        if pointer % 4:
            raise ValueError(f"lse must start on a 4-byte boundary, got pointer {pointer:#x}")
    return Operand("lse", dims, "float32", on, x, strides, pointer, device=device)


def describe_gradient(name: str, x: Any, ref: Operand) -> Operand:
    """A given dq, dk or dv: like ``ref`` (q, k or v: place, shape and dtype), writeable, with no
    two elements in the same memory. A numpy array's strides are filled in (in elements)."""
    op = describe(name, x)
    check_like(op, ref)
    if not op.on_device:
        if not x.flags.writeable:
            raise ValueError(f"{name} is a read-only numpy array; pass a writeable one")
        op.strides = tuple(st // x.itemsize for st in x.strides)
    check_no_self_overlap(op)
    return op


# Bound on numpy's exact overlap search (np.shares_memory); past it arrays count as overlapping.
OVERLAP_WORK = 100_000


class _AddressRange:
    """A device operand's addresses, shape and strides as a numpy array interface, so that
    ``np.shares_memory`` can tell whether two operands share an element. numpy only does
    arithmetic on the address: nothing reads the device memory."""

    def __init__(self, op: Operand) -> None:
        itemsize = 4 if op.dtype_name == "float32" else 2
        self.__array_interface__ = {"shape": op.shape, "typestr": f"<u{itemsize}", "version": 3,
                                    "data": (op.pointer, True),
                                    "strides": tuple(st * itemsize for st in op.strides)}


def _memory(op: Operand) -> np.ndarray:
    return np.asarray(_AddressRange(op)) if op.on_device else op.obj


def shares_memory(a: Operand, b: Operand) -> bool:
    """Whether two operands of the same kind have an element in the same memory (exactly, within
    ``OVERLAP_WORK``; beyond it, whether their extents overlap). Device operands whose address
    ranges are apart (the usual case) are told apart without numpy."""
    if a.on_device and b.on_device and min(a.strides) >= 0 and min(b.strides) >= 0:
        a_end = a.pointer + a.span * (4 if a.dtype_name == "float32" else 2)
        b_end = b.pointer + b.span * (4 if b.dtype_name == "float32" else 2)
        if a_end <= b.pointer or b_end <= a.pointer:
            return False
    x, y = _memory(a), _memory(b)
    if not np.may_share_memory(x, y):
        return False
    too_hard = getattr(getattr(np, "exceptions", np), "TooHardError", None) or np.TooHardError
    try:
        return bool(np.shares_memory(x, y, max_work=OVERLAP_WORK))
    except too_hard:
        return True


def check_outputs_disjoint(outs: list[Operand], inputs: list[Operand]) -> None:
    """No output shares memory with another output or with any input (the kernels read every
    input until the last launch, and each output is written by one kernel)."""
    for i, a in enumerate(outs):
        for b in (*outs[i + 1:], *inputs):
            if shares_memory(a, b):
                raise ValueError(
                    f"{a.name} shares memory with {b.name}; an output must not overlap the inputs or the "
                    f"other outputs: pass {a.name} with memory of its own (or None for a new array)"
                )


# ------------------------------------------------------------------ decode's index arrays


def _small_device_array(name: str, x: Any, dtype: str, what: str) -> tuple:
    """(dims, strides in elements, pointer, device or None) of a 4-byte ``dtype`` device array
    (a torch CUDA tensor or any ``__cuda_array_interface__`` object); ``what`` names the
    expected kind in the error for anything else."""
    kind = kind_of(x)
    if kind == "torch":
        if not x.is_cuda:
            raise TypeError(f"{name}: torch tensors must be on a CUDA device, got device {x.device}")
        if x.dtype != getattr(_torch(), dtype):
            raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
        return tuple(x.shape), tuple(x.stride()), x.data_ptr(), x.get_device()
    if kind != "cai":
        raise TypeError(f"{name} must be {what}, got {type(x).__name__}")
    cai = x.__cuda_array_interface__
    try:
        found = np.dtype(cai["typestr"])
    except TypeError as exc:
        raise TypeError(f"{name}: unknown __cuda_array_interface__ typestr {cai['typestr']!r}") from exc
    if found != np.dtype(dtype):
        raise TypeError(f"{name} must be {dtype}, got {found}")
    dims = tuple(map(int, cai["shape"]))
    byte_strides = cai.get("strides")
    strides = (tuple(math.prod(dims[i + 1:]) for i in range(len(dims))) if byte_strides is None
               else tuple(int(s) // 4 for s in byte_strides))
    return dims, strides, int(cai["data"][0]), None


def describe_index(name: str, x: Any, shape: tuple[int, ...]) -> Operand:
    """An int32 device array of ``shape`` (cache_seqlens, block_table), its last dimension
    contiguous, on a 4-byte boundary."""
    dims, strides, pointer, device = _small_device_array(name, x, "int32",
                                                         "an int32 device array (torch, CuPy, Numba)")
    if dims != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {dims}")
    if dims[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name}: its last dimension must be contiguous, got strides {strides}")
    if pointer % 4:
        raise ValueError(f"{name} must start on a 4-byte boundary, got pointer {pointer:#x}")
    return Operand(name, dims, "int32", True, x, strides, pointer, device=device)


def describe_rotary(cos: Any, sin: Any, q: Operand, room: int, has_new: bool) -> tuple[Operand, Operand, int]:
    """FlashAttention's ``rotary_cos`` and ``rotary_sin`` of the KV-cache call: (cos, sin, rotary_dim).
    Each a contiguous device array of q's dtype, shape (seqlen_ro, rotary_dim / 2), the same for
    both; rotary_dim a multiple of 16 (FlashAttention's rule) and at most head_dim; seqlen_ro at
    least ``room`` (the cache's rows a sequence, as FlashAttention checks); k_new given (the rotary
    embedding rotates q and the appended keys)."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not has_new:
        raise ValueError("rotary_cos / rotary_sin rotate q and k_new before it is appended: give k_new and "
                         "v_new too (as FlashAttention requires)")
    head_dim = q.shape[3]
    found = []
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        op = describe(name, x)
        if not op.on_device:
            raise TypeError(f"{name} must be a device array (torch, CuPy, Numba), got numpy")
        if len(op.shape) != 2:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {op.shape}")
        if op.dtype_name != q.dtype_name:
            raise TypeError(f"{name} must be {q.dtype_name} (q's dtype), got {op.dtype_name}")
        rows, half = op.shape
        if (half > 1 and op.strides[1] != 1) or (rows > 1 and op.strides[0] != half):
            raise ValueError(f"{name} must be contiguous, got strides {op.strides} (in elements)")
        found.append(op)
    cosd, sind = found
    if sind.shape != cosd.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {cosd.shape}, got {sind.shape}")
    rows, half = cosd.shape
    dim = 2 * half
    if dim % 16 or dim > head_dim or dim == 0:
        raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1]) must be a multiple of 16 from 16 to head_dim "
                         f"({head_dim}), got {dim}")
    if rows < room:
        raise ValueError(f"rotary_cos / rotary_sin have {rows} rows (positions), fewer than the cache holds "
                         f"a sequence ({room})")
    return cosd, sind, dim


def torch_small_pointer(x: Any, dtype: Any, length: int, device: int) -> int | None:
    """The device pointer of a torch CUDA vector that a validated plan can take as it is (the
    fast paths' check of a learnable sink, cache_batch_idx or cache_leftpad): of ``dtype``,
    shape (length,), contiguous, on ``device``, on a 4-byte boundary. None for anything else:
    the full checks (``describe_sink``, ``describe_index``) then run and name what is wrong."""
    if (type(x) not in TORCH_TYPES or x.dtype is not dtype or x.get_device() != device
            or x.shape != (length,) or (length > 1 and x.stride()[0] != 1)):
        return None
    pointer = x.data_ptr()
    return None if pointer & 3 else pointer


def describe_sink(x: Any, heads_q: int, on_device: bool, function: str = "flash_attention") -> Operand:
    """A learnable sink (FlashAttention-4's ``learnable_sink``) as an operand: float32 logits of
    shape (heads_q,), one per query head, a contiguous device array (torch CUDA tensor or any
    ``__cuda_array_interface__`` object) on a 4-byte boundary. Numpy inputs take none yet
    (NotImplementedError)."""
    if not on_device:
        raise NotImplementedError(f"{function}(): learnable_sink is not supported with numpy inputs yet; "
                                  f"pass device arrays (torch CUDA tensors, CuPy, Numba)")
    dims, strides, pointer, device = _small_device_array(
        "learnable_sink", x, "float32",
        f"a float32 device array of shape (heads_q,) = ({heads_q},) (torch CUDA tensor, CuPy, Numba)")
    if dims != (heads_q,):
        raise ValueError(f"learnable_sink must have shape (heads_q,) = ({heads_q},), got {dims}")
    if heads_q > 1 and strides[0] != 1:
        raise ValueError(f"learnable_sink must be contiguous, got stride {strides[0]}")
    if pointer % 4:
        raise ValueError(f"learnable_sink must start on a 4-byte boundary, got pointer {pointer:#x}")
    return Operand("learnable_sink", dims, "float32", True, x, (1,), pointer, device=device)


def check_mla_shapes(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], q_dtype: str, kv_dtype: str,
                     head_dim_v: Any) -> None:
    """MLA decode's operands (``flash_mla_with_kvcache``, its torch route and its custom op's fake
    kernel): q's head dim ``MLA_HEAD_DIMS[0]`` (576), a latent cache (batch or num_pages, rows, 1,
    576) of q's dtype, and ``head_dim_v`` ``MLA_HEAD_DIMS[1]`` (512)."""
    d_qk, d_v = MLA_HEAD_DIMS
    if len(q_shape) != 4 or q_shape[3] != d_qk:
        raise ValueError(f"q's head_dim must be {d_qk} (512 latent + 64 rotary), got shape {tuple(q_shape)}")
    if len(kv_shape) != 4 or tuple(kv_shape[2:]) != (1, d_qk) or kv_dtype != q_dtype:
        raise ValueError(f"kv_cache must be a {q_dtype} array of shape (batch or num_pages, rows, 1, {d_qk}) "
                         f"(one latent row a token), got {tuple(kv_shape)} {kv_dtype}")
    if isinstance(head_dim_v, bool) or head_dim_v != d_v:
        raise ValueError(f"head_dim_v must be {d_v} (V is the cache's first {d_v} values), "
                         f"got {head_dim_v!r}")
