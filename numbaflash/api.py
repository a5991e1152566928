"""Host API: validation, dtype/layout handling, dispatch by GPU, launch, staging."""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from typing import Any

import numpy as np

from .configs import SUPPORTED_HEAD_DIMS, forward_config, forward_cubin
from .kernels.abi import FORWARD_ABI, WS_ABI
from .kernels.shapes import WsConfig
from .runtime.compiler import arch_of
from .runtime.launch import KernelLauncher, set_dynamic_shared_limit

_FLOAT16 = np.dtype(np.float16)


def _bfloat16_dtype() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass
class _Operand:
    """One attention operand reduced to what the kernel needs."""

    name: str
    shape: tuple[int, ...]
    dtype_name: str  # "float16" | "bfloat16"
    on_device: bool
    obj: Any
    strides: tuple[int, ...] = ()  # in elements (device operands)
    pointer: int = 0
    stream: int | None = None  # CUDA array interface "stream" (None: not given)
    device: int | None = None  # CUDA device ordinal where known (torch)


def _dtype_name_of_numpy(dtype: np.dtype, name: str) -> str:
    """'float16' or 'bfloat16' for those dtypes; TypeError for any other (ml_dtypes or not)."""
    if dtype == _FLOAT16:
        return "float16"
    bf16 = _bfloat16_dtype()
    if (bf16 is not None and dtype == bf16) or (dtype.name == "bfloat16" and dtype.itemsize == 2):
        return "bfloat16"
    raise TypeError(f"{name} must be float16 or bfloat16, got {dtype}")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _describe(name: str, x: Any) -> _Operand:
    """Classify one input: host numpy array or device array (``__cuda_array_interface__``)."""
    if isinstance(x, np.ndarray):
        return _Operand(name, tuple(x.shape), _dtype_name_of_numpy(x.dtype, name), False, x)
    if _is_torch(x):
        import torch

        if x.device.type != "cuda":
            raise TypeError(f"{name}: torch tensors must be on a CUDA device, got device {x.device}")
        names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
        if x.dtype not in names:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        strides = tuple(int(s) for s in x.stride())
        return _Operand(name, tuple(x.shape), names[x.dtype], True, x, strides, x.data_ptr(),
                        device=x.device.index)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(
            f"{name} must be a numpy array or a CUDA array (__cuda_array_interface__), "
            f"got {type(x).__name__}"
        )
    try:
        typestr = np.dtype(cai["typestr"])
    except TypeError as exc:
        raise TypeError(f"{name}: unknown __cuda_array_interface__ typestr {cai['typestr']!r}") from exc
    dtype = getattr(x, "dtype", None)
    dtype = dtype if isinstance(dtype, np.dtype) else typestr
    if dtype.itemsize != typestr.itemsize:
        raise TypeError(
            f"{name}: its dtype attribute ({dtype}) and its __cuda_array_interface__ typestr "
            f"({cai['typestr']}) disagree on the element size"
        )
    shape = tuple(int(s) for s in cai["shape"])
    itemsize = dtype.itemsize
    if cai.get("strides") is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    else:
        if any(s % itemsize for s in cai["strides"]):
            raise ValueError(f"{name}: strides {cai['strides']} are not multiples of the element size")
        strides = tuple(int(s) // itemsize for s in cai["strides"])
    stream = cai.get("stream")
    return _Operand(name, shape, _dtype_name_of_numpy(dtype, name), True, x, strides,
                    int(cai["data"][0]), stream)


def _check_shapes(q: _Operand, k: _Operand, v: _Operand) -> None:
    for op in (q, k, v):
        if len(op.shape) != 4:
            raise ValueError(
                f"{op.name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {op.shape}"
            )
        if 0 in op.shape:
            raise ValueError(f"{op.name} is empty (shape {op.shape}); every dimension must be >= 1")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, _, hq, d = q.shape
    bk, _, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hq % hkv:
        raise ValueError(f"heads of q ({hq}) must be a multiple of heads of k/v ({hkv})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    dtypes = {op.dtype_name for op in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype_name}, {k.dtype_name}, {v.dtype_name}")
    places = {op.on_device for op in (q, k, v)}
    if len(places) != 1:
        raise TypeError("q, k, v must be all numpy (host) arrays or all device arrays, not a mix")


def _check_device_layout(op: _Operand) -> None:
    """The kernel moves 16-byte chunks: head_dim contiguous, rows 16-byte aligned."""
    if op.strides[3] != 1:
        raise ValueError(
            f"{op.name}: the last (head_dim) dimension must be contiguous (stride 1), got strides "
            f"{op.strides} (in elements); pass a contiguous copy"
        )
    if op.pointer % 16 or any(s % 8 for s in op.strides[:3] if s):
        raise ValueError(
            f"{op.name}: rows must start on 16-byte boundaries (pointer {op.pointer:#x}, strides "
            f"{op.strides} in elements must be multiples of 8); pass a contiguous copy"
        )
    if any(s < 0 for s in op.strides):
        raise ValueError(f"{op.name}: negative strides {op.strides} are not supported")


def _check_flag(name: str, value: Any) -> bool:
    """``causal`` / ``return_lse``: a Python or numpy bool, nothing else (``'no'`` is truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return bool(value)


def _check_softmax_scale(scale: Any, head_dim: int) -> float:
    """The scale as a float: a real number (not a bool or a string), positive, and finite and
    non-zero once multiplied by log2(e) in float32, as the kernel uses it."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {scale!r}")
    f32 = np.finfo(np.float32)
    if not float(f32.tiny) <= scale * math.log2(math.e) <= float(f32.max):
        raise ValueError(
            f"softmax_scale * log2(e) must be a normal float32 (the kernel's scale), so "
            f"softmax_scale must lie in about [8.1e-39, 2.4e38], got {scale!r}"
        )
    return scale


def _check_no_self_overlap(op: _Operand) -> None:
    """Distinct elements of ``op`` must be distinct memory (no stride 0, no overlapping rows):
    dimensions sorted by stride, each stride at least the extent of those inside it."""
    extent = 1
    for n, stride in sorted(((n, abs(st)) for n, st in zip(op.shape, op.strides, strict=True) if n > 1),
                            key=lambda d: d[1]):
        if stride < extent:
            raise ValueError(
                f"{op.name}: strides {op.strides} (in elements) for shape {op.shape} make elements "
                "share memory (a stride 0 or overlapping rows); pass an array with its own memory"
            )
        extent = stride * n


def _check_out_aliasing(od: _Operand, ops: list[_Operand], itemsize: int = 2) -> None:
    """A device ``out`` may be exactly q (each CTA reads its Q rows before writing them) but
    must not share memory with k or v, or partly with q: other CTAs would read it after it
    was overwritten."""
    lo, hi = od.pointer, od.pointer + _span(od) * itemsize
    for op in ops:
        if op.pointer < hi and lo < op.pointer + _span(op) * itemsize:
            if op.name == "q" and op.pointer == od.pointer and op.strides == od.strides:
                continue
            raise ValueError(
                f"out shares memory with {op.name}; the kernel would read values it has already "
                f"overwritten: pass an out that does not overlap k or v (out may be q itself)"
            )


MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


# Tests set this to launch the folded grid on small problems (the path batch > 65535 takes).
_FOLD_GRID = False


def _forward_grid(m_blocks: int, heads_q: int, batch: int) -> tuple[int, int, int]:
    """(query blocks, y, z). Normally y = heads_q and z = batch, which the kernel reads off its
    block index. Past 65535 of either (CUDA's limit for y and z) the (batch, head) pairs are
    numbered head-fastest over y and z (``blocks.query_block`` unfolds them with two divisions;
    spare CTAs return)."""
    pairs = heads_q * batch
    if heads_q <= MAX_GRID_YZ and batch <= MAX_GRID_YZ and not _FOLD_GRID:
        y, z = heads_q, batch
    else:
        y = min(pairs, MAX_GRID_YZ)
        z = -(-pairs // y)
    if m_blocks > MAX_GRID_X or z > MAX_GRID_YZ:
        raise ValueError(
            f"batch * heads_q = {pairs} with {m_blocks} query blocks exceeds the CUDA grid "
            f"({MAX_GRID_X} x {MAX_GRID_YZ} x {MAX_GRID_YZ} blocks); split the call"
        )
    return m_blocks, y, z


_GPU_LOCK = threading.Lock()
_KERNELS: dict = {}


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _current_gpu() -> tuple[tuple[int, int], int]:
    """(compute capability, ordinal) of the current device, with a context current on this thread.

    Asks the driver which device the thread's current context belongs to (one call). With no
    context current it makes device 0's primary context current, as Numba, PyTorch and CuPy
    do, so that arrays of any of them work with it. Numba is not imported on this path: on a
    kernel-cache hit, a first call costs no Numba import.
    """
    ordinal = _current_context_device()
    if ordinal is None:
        ordinal = _make_primary_context_current()
    cap = _CAPABILITY.get(ordinal)
    if cap is None:
        cap = _CAPABILITY[ordinal] = _device_capability(ordinal)
    if cap < (8, 0):
        raise RuntimeError(
            f"numbaflash needs compute capability >= 8.0 (sm_80, Ampere or newer); this GPU is "
            f"sm_{cap[0]}{cap[1]}"
        )
    return cap, ordinal


_NO_GPU = ("numbaflash needs an NVIDIA GPU with compute capability >= 8.0 (sm_80), and none "
           "is available")


def _load_driver():
    from cuda.bindings import driver

    return driver


_DRIVER = None  # cuda.bindings.driver, once cuInit has succeeded in this process


def _driver():
    """``cuda.bindings.driver``, initialised (``cuInit`` runs until it first succeeds, not on
    every call); RuntimeError if there is no usable driver or GPU."""
    global _DRIVER
    if _DRIVER is not None:
        return _DRIVER
    try:
        driver = _load_driver()
        (err,) = driver.cuInit(0)
    except Exception as exc:  # no libcuda.so: the bindings raise when they load it
        raise RuntimeError(f"{_NO_GPU} (no CUDA driver: {exc})") from None
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{_NO_GPU} (cuInit: {err.name})")
    _DRIVER = driver
    return driver


def _current_context_device() -> int | None:
    """Ordinal of the device of this thread's current CUDA context, or None if there is none."""
    driver = _driver()
    err, device = driver.cuCtxGetDevice()
    return int(device) if err == driver.CUresult.CUDA_SUCCESS else None


def _make_primary_context_current() -> int:
    """Retain device 0's primary context (kept for the process) and make it current."""
    driver = _driver()
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        raise RuntimeError(f"{_NO_GPU} (no CUDA device visible)")
    err, device = driver.cuDeviceGet(0)
    err, context = driver.cuDevicePrimaryCtxRetain(device)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot create a CUDA context on device 0: {err.name}")
    (err,) = driver.cuCtxSetCurrent(context)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot make device 0's context current: {err.name}")
    return 0


def _device_capability(ordinal: int) -> tuple[int, int]:
    driver = _driver()
    attr = driver.CUdevice_attribute
    _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ordinal)
    _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ordinal)
    return int(major), int(minor)


_SHARED_LIMIT: dict[int, int] = {}  # ordinal -> opt-in dynamic shared memory a CTA, bytes


def _device_shared_limit(ordinal: int) -> int:
    """The most dynamic shared memory a CTA may opt in to on device ``ordinal`` (the driver's
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 163 KB on an A100, 99 KB on sm_86/89/120, 227 KB on an H100)."""
    limit = _SHARED_LIMIT.get(ordinal)
    if limit is None:
        driver = _driver()
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        err, value = driver.cuDeviceGetAttribute(attr, ordinal)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot read the shared-memory limit of device {ordinal}: {err.name}")
        limit = _SHARED_LIMIT[ordinal] = int(value)
    return limit


def _forward_kernel(capability, device: int, head_dim: int, causal: bool, bf16: bool,
                   seqlen: int | None = None):
    """(launcher, config) for this problem on the current device (ordinal ``device``).

    The config is the table's for this GPU, passing over entries that need more shared memory
    than the device gives a CTA (``configs.forward_config``), and taking its short-sequence
    entry where ``seqlen`` (the longer of seqlen_q and seqlen_k) is at most ``SHORT_SEQLEN``,
    its long-sequence entry where it is at least ``LONG_SEQLEN``.
    The cubin comes from the on-disk kernel cache (``runtime.cache``) or is compiled and stored
    there; it is loaded once per process, and its shared-memory limit is raised once per device.
    """
    limit = _device_shared_limit(device)
    config = forward_config(capability, head_dim, causal, limit, seqlen)
    key = (config, causal, bf16, capability, device)
    launcher = _KERNELS.get(key)
    if launcher is None:
        if config.shared_bytes > limit:  # only a forced config gets here (force_config)
            raise RuntimeError(f"{config} needs {config.shared_bytes} bytes of shared memory a CTA; device "
                               f"{device} (sm_{capability[0]}{capability[1]}) allows {limit}")
        with _GPU_LOCK:
            launcher = _KERNELS.get(key)
            if launcher is None:
                kernel, name = _loaded_forward(config, causal, bf16, arch_of(capability))
                set_dynamic_shared_limit(kernel.handle, device, config.shared_bytes)
                abi = WS_ABI if isinstance(config, WsConfig) else FORWARD_ABI
                launcher = _KERNELS[key] = KernelLauncher(kernel, abi, name)
    return launcher, config


_LOADED: dict = {}


def _loaded_forward(config, causal: bool, bf16: bool, arch: str):
    """(cuda.core Kernel, entry name) of a forward kernel, loaded once per process (the loaded
    library serves every device; call with ``_GPU_LOCK`` held)."""
    key = (config, causal, bf16, arch)
    if key not in _LOADED:
        from cuda.core import ObjectCode

        entry = forward_cubin(config, causal, bf16, arch)
        kernel = ObjectCode.from_cubin(entry.cubin).get_kernel(entry.entry_name)
        _LOADED[key] = (kernel, entry.entry_name)
    return _LOADED[key]


_UNUSED_LSE: dict = {}


def _unused_lse(device: int) -> tuple[int, int]:
    """(pointer, 1) of a float32 device scalar for the LSE argument when no LSE is asked for;
    one per device, kept for the process (a fresh allocation per call would later be freed
    with cuMemFree, which makes the host wait for the device)."""
    if device not in _UNUSED_LSE:
        with _GPU_LOCK:
            if device not in _UNUSED_LSE:
                driver = _driver()
                err, pointer = driver.cuMemAlloc(4)
                if err != driver.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cannot allocate 4 bytes on device {device}: {err.name}")
                _UNUSED_LSE[device] = int(pointer)
    return _UNUSED_LSE[device], 1


def _device_pointer(obj: Any) -> int:
    if _is_torch(obj):
        return obj.data_ptr()
    return int(obj.__cuda_array_interface__["data"][0])


def _span(op: _Operand) -> int:
    """Elements from ``op``'s first to its last element (its flat extent in memory)."""
    return 1 + sum((n - 1) * s for n, s in zip(op.shape, op.strides, strict=True))


def _stream_handle(q: _Operand) -> int:
    """The stream to launch on: torch's current stream for torch inputs, else the stream the
    CUDA array interface names (None, or 1 = the legacy default stream: handle 0)."""
    if _is_torch(q.obj):
        import torch

        return torch.cuda.current_stream(q.obj.device).cuda_stream
    return 0 if q.stream in (None, 1) else int(q.stream)


def _check_same_device(ops: list[_Operand], current: int) -> None:
    """Torch operands must sit on Numba's current device (ordinal ``current``): the kernel runs there."""
    devices = {op.device for op in ops if op.device is not None}
    if devices and devices != {current}:
        where = ", ".join(f"{op.name} on cuda:{op.device}" for op in ops if op.device is not None)
        raise ValueError(
            f"all tensors must be on the current CUDA device (cuda:{current}), got {where}; "
            "move them, or make their device current first (torch.cuda.set_device, "
            "numba.cuda.select_device)"
        )


def _launch_forward(launcher, config, ops: list[_Operand], lse: tuple[int, int], seqlen_k: int,
                    heads_kv: int, scale_log2: np.float32, write_lse: bool, stream: int, device: int) -> None:
    """Launch the forward kernel on q, k, v, out (``ops``) described by pointers and strides."""
    if isinstance(config, WsConfig):
        _launch_ws(launcher, config, ops, lse, seqlen_k, heads_kv, scale_log2, write_lse, stream, device)
        return
    batch, seqlen_q, heads_q, _ = ops[0].shape
    grid = _forward_grid((seqlen_q + config.block_m - 1) // config.block_m, heads_q, batch)
    strides = [s for op in ops for s in op.strides[:3]]
    launcher(grid, config.threads, stream, config.shared_bytes,
             *[(op.pointer, _span(op)) for op in ops], lse, *strides,
             seqlen_q, seqlen_k, batch, heads_q, heads_q // heads_kv, scale_log2, write_lse)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: int) -> int:
    if device not in _SM_COUNT:
        driver = _driver()
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        _SM_COUNT[device] = int(driver.cuDeviceGetAttribute(attr, device)[1])
    return _SM_COUNT[device]


def _tma_strides(op: _Operand) -> list[int]:
    """Byte strides for a tensor map: a size-1 dimension's stride is never used, so a 0 there
    (broadcast) becomes the extent of the dimensions inside it."""
    strides, inner = [], 2 * op.shape[3]
    for n, st in zip(reversed(op.shape[:3]), reversed(op.strides[:3]), strict=True):
        strides.append(2 * st if st or n > 1 else inner)
        inner = strides[-1] * n
    return [*reversed(strides), 2]


def _launch_ws(launcher, config, ops: list[_Operand], lse: tuple[int, int], seqlen_k: int, heads_kv: int,
               scale_log2: np.float32, write_lse: bool, stream: int, device: int,
               ctas: int | None = None) -> None:
    """Launch the warp-specialised Hopper kernel: tensor maps of q, k, v, out (cached in device
    memory by pointer, shape and strides) and a persistent grid of at most one CTA per SM
    (``ctas``: fewer, for tests that make each CTA walk many tiles)."""
    from .runtime.map_slots import map_slots
    from .runtime.tensor_map import encode_tensor_map

    batch, seqlen_q, heads_q, _ = ops[0].shape
    dtype = "bf16" if ops[0].dtype_name == "bfloat16" else "f16"
    rows = (config.block_m, config.block_n, config.block_n, 64)  # box rows of q, k, v, o
    cols = config.box_cols  # one swizzle block: 64 columns (128B swizzle) or 32 (64B, head dim 96)
    swizzle = f"{config.row_bytes}B"
    key = (dtype, rows, cols, *((op.pointer, op.shape, op.strides) for op in ops))

    def encode():
        return np.stack([encode_tensor_map(op.pointer, op.shape, _tma_strides(op), (1, r, 1, cols),
                                           swizzle=swizzle, dtype=dtype)
                         for op, r in zip(ops, rows, strict=True)])

    tiles = -(-seqlen_q // config.block_m) * heads_q * batch
    grid = (min(tiles, ctas or _sm_count(device)), 1, 1)
    slots = map_slots(device)
    with slots.lock:
        maps, slot = slots.address(key, encode, stream)
        try:
            launcher(grid, config.threads, stream, config.shared_bytes,
                     *[(maps + 128 * i, 16) for i in range(4)], lse, seqlen_q, seqlen_k,
                     config.first_block_lead(seqlen_q), heads_q, heads_q // heads_kv, batch, scale_log2,
                     write_lse)
        finally:  # even after a failed launch: the slot's copy is on the stream
            slots.used(slot, stream)


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: Any = None,
) -> Any:
    """Exact attention ``O = softmax(Q Kᵀ · scale) V`` on tensor cores.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16.
        k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype; heads_q a multiple of
            heads_kv (GQA / MQA). head_dim 32, 64, 96, 128 or 256; any seqlen >= 1.
            All three numpy arrays (staged through page-locked memory in chunks on several
            streams; the result is a numpy array over pooled pinned memory), or all
            device arrays: torch CUDA tensors, CuPy arrays, Numba device arrays or any
            ``__cuda_array_interface__`` object (zero copy; the result stays on the device,
            of the same library for torch and CuPy, a Numba device array otherwise). Strided
            device inputs work when head_dim is contiguous and rows are 16-byte aligned.
        causal: (bool) mask keys after the diagonal, bottom-right aligned (query i sees key
            j iff j <= i + seqlen_k - seqlen_q). Rows that see no key give 0.
        softmax_scale: positive real scale of QKᵀ; default 1/sqrt(head_dim).
        return_lse: (bool) also return the float32 log-sum-exp, (batch, heads_q, seqlen_q);
            -inf for rows that see no key.
        out: optional output array (same shape and dtype as q, same kind as the inputs,
            writeable, no element sharing memory with another; a device out must not
            overlap k or v, but may be q itself).

    Raises:
        TypeError, ValueError: bad input, before anything is compiled or launched.
        RuntimeError: no usable GPU of compute capability 8.0 or newer.

    Returns:
        ``out`` (batch, seqlen_q, heads_q, head_dim) in q's dtype, or ``(out, lse)``.
    """
    ops = [_describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))]
    qd, kd, vd = ops
    _check_shapes(qd, kd, vd)
    batch, seqlen_q, heads_q, head_dim = qd.shape
    seqlen_k, heads_kv = kd.shape[1], kd.shape[2]
    causal = _check_flag("causal", causal)
    return_lse = _check_flag("return_lse", return_lse)
    softmax_scale = _check_softmax_scale(softmax_scale, head_dim)
    o_shape = (batch, seqlen_q, heads_q, head_dim)
    od = None
    if out is not None:
        od = _describe("out", out)
        if od.shape != qd.shape or od.dtype_name != qd.dtype_name:
            raise ValueError(
                f"out must have q's shape {qd.shape} and dtype {qd.dtype_name}, "
                f"got {od.shape} {od.dtype_name}"
            )
        if od.on_device != qd.on_device:
            raise TypeError("out must live where the inputs live (numpy for numpy inputs, device otherwise)")
        if not od.on_device:
            if not out.flags.writeable:
                raise ValueError("out is a read-only numpy array; pass a writeable one")
            od.strides = tuple(st // out.itemsize for st in out.strides)
        _check_no_self_overlap(od)
    _forward_grid((seqlen_q + 15) // 16, heads_q, batch)  # the grid fits (checked again at launch)
    if qd.on_device:  # layout checks before anything is compiled
        for op in ops:
            _check_device_layout(op)
        if od is not None:
            _check_device_layout(od)
            _check_out_aliasing(od, ops)
    capability, device = _current_gpu()
    if qd.on_device:
        _check_same_device(ops if od is None else [*ops, od], device)
    bf16 = qd.dtype_name == "bfloat16"
    launcher, config = _forward_kernel(capability, device, head_dim, causal, bf16, max(seqlen_q, seqlen_k))
    scale_log2 = np.float32(softmax_scale * math.log2(math.e))

    if qd.on_device:
        if out is None:
            out = _empty_like(q, o_shape, qd)
            od = _describe("out", out)
        lse_obj = _empty_lse(q, (batch, heads_q, seqlen_q)) if return_lse else None
        lse = (_device_pointer(lse_obj), batch * heads_q * seqlen_q) if return_lse else _unused_lse(device)
        _launch_forward(launcher, config, [*ops, od], lse, seqlen_k, heads_kv, scale_log2,
                        return_lse, _stream_handle(qd), device)
        return (out, lse_obj) if return_lse else out

    # numpy: the chunked pipeline over pinned staging buffers and several streams.
    from .runtime.pipeline import pinned_empty, run_numpy_forward

    # Results go to pooled pinned memory (the copy engines write them in place), or straight
    # into ``out`` unless it shares memory with an input (then via a copy).
    direct = out is not None and not any(np.may_share_memory(out, x) for x in (q, k, v))
    result = out if direct else pinned_empty(o_shape, q.dtype)
    lse_host = pinned_empty((batch, heads_q, seqlen_q), np.float32) if return_lse else None

    def launch_chunk(lay, base: int, sub, stream: int) -> None:
        """The kernel on one chunk, whose q, k, v, o (and LSE) sit dense from ``base``."""
        def dense(name, shape, offset):
            strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
            return _Operand(name, shape, qd.dtype_name, True, None, strides, base + offset)

        chunk_ops = [dense("q", lay.q_shape, lay.q), dense("k", lay.kv_shape, lay.k),
                     dense("v", lay.kv_shape, lay.v), dense("out", lay.q_shape, lay.o)]
        lse_arg = (base + lay.lse, math.prod(lay.lse_shape)) if return_lse else _unused_lse(device)
        _launch_forward(launcher, config, chunk_ops, lse_arg, sub.seqlen_k, sub.heads_kv, scale_log2,
                        return_lse, stream, device)

    run_numpy_forward(device, q, k, v, result, lse_host, launch_chunk, causal, config.block_m)
    if out is not None and not direct:
        out[...] = result
        result = out
    return (result, lse_host) if return_lse else result


def _empty_like(ref: Any, shape: tuple[int, ...], op: _Operand):
    """A new device array for the output, of the inputs' library where we know it."""
    if _is_torch(ref):
        import torch

        return torch.empty(shape, dtype=ref.dtype, device=ref.device)
    module = type(ref).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy.empty(shape, dtype=ref.dtype)
    from numba import cuda

    dtype = _FLOAT16 if op.dtype_name == "float16" else _bfloat16_dtype()
    return cuda.device_array(shape, dtype=dtype)


def _empty_lse(ref: Any, shape: tuple[int, ...]):
    if _is_torch(ref):
        import torch

        return torch.empty(shape, dtype=torch.float32, device=ref.device)
    if type(ref).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.empty(shape, dtype=cupy.float32)
    from numba import cuda

    return cuda.device_array(shape, dtype=np.float32)
