"""Input validation happens on the host, before anything touches a GPU."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import numbaflash
from numbaflash import operands
from numbaflash.operations import forward, launch_forward
from numbaflash.runtime import device


def qkv(shape_q=(1, 8, 4, 64), shape_k=(1, 8, 2, 64), dtype=np.float16):
    return np.zeros(shape_q, dtype), np.zeros(shape_k, dtype), np.zeros(shape_k, dtype)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (lambda: (np.zeros((8, 4, 64), np.float16),) + qkv()[1:], ValueError, "4 dimensions"),
        (lambda: qkv(shape_k=(1, 8, 3, 64)), ValueError, "multiple of heads"),
        (lambda: qkv(shape_q=(1, 8, 4, 264), shape_k=(1, 8, 2, 264)), ValueError, "head_dim must be one of"),
        (lambda: qkv(shape_k=(2, 8, 2, 64)), ValueError, "same batch"),
        (lambda: qkv(shape_q=(1, 0, 4, 64)), ValueError, "empty"),
        (lambda: qkv(dtype=np.float32), TypeError, "float16 or bfloat16"),
        (lambda: (qkv()[0], qkv()[1], qkv()[2][:, :4]), ValueError, "same shape"),
        (lambda: (qkv()[0], qkv()[1].astype(np.float32), qkv()[2]), TypeError, "float16 or bfloat16"),
        (lambda: (qkv()[0].tolist(), qkv()[1], qkv()[2]), TypeError, "numpy array or a CUDA array"),
    ],
)
def test_bad_input_raises_before_launch(args, error, message):
    with pytest.raises(error, match=message):
        numbaflash.flash_attention(*args())


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_supported_head_dims_reach_the_kernel(head_dim, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv((1, 8, 4, head_dim), (1, 8, 2, head_dim)))


@pytest.mark.parametrize("head_dim", [8, 16, 48, 80, 112, 160, 192, 224])
def test_other_head_dims_to_256_reach_the_kernel_padded(head_dim, no_compile):
    with pytest.raises(AssertionError, match="would compile"):  # test_padded_head_dims_cpu: the glue
        numbaflash.flash_attention(*qkv((1, 8, 4, head_dim), (1, 8, 2, head_dim)))


@pytest.mark.parametrize("head_dim", [264, 384, 1024])
def test_head_dims_past_256_rejected_with_the_supported_list(head_dim, no_compile):
    with pytest.raises(ValueError) as info:
        numbaflash.flash_attention(*qkv((1, 8, 4, head_dim), (1, 8, 2, head_dim)))
    assert str(info.value) == (f"head_dim must be one of (32, 64, 96, 128, 256), got {head_dim} "
                               "(flash_attention, flash_attention_varlen and their backwards pad other head "
                               "dims up to 256 and run 512 in halves of v on torch and numpy inputs; the "
                               "KV-cache call does neither)")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e300, 1e-300, -0.0, 1e39])
def test_bad_softmax_scale_value(scale, no_compile):
    with pytest.raises(ValueError, match=f"softmax_scale.*got {re.escape(repr(scale))}"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, np.bool_(True), 1j, [0.1], np.array([0.1])])
def test_bad_softmax_scale_type(scale, no_compile):
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None, got"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", [1, 0.125, np.float32(0.3), np.float16(2.0), np.int64(3), 1e-30, 1e30])
def test_good_softmax_scale_reaches_the_kernel(scale, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize("value", ["no", "False", [False], 2, 0, 1, None, np.array(True), 1.0])
def test_flags_must_be_bools(flag, value, no_compile):
    with pytest.raises(TypeError, match=f"{flag} must be a bool \\(True or False\\), got"):
        numbaflash.flash_attention(*qkv(), **{flag: value})


@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_bool_flags_accepted(value, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv(), causal=value, return_lse=value)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int16, np.uint16, np.complex64])
@pytest.mark.parametrize("have_ml_dtypes", [True, False])
def test_other_dtypes_rejected_with_or_without_ml_dtypes(dtype, have_ml_dtypes, monkeypatch, no_compile):
    if not have_ml_dtypes:
        monkeypatch.setattr(operands, "bfloat16_dtype", lambda: None)
    with pytest.raises(TypeError, match=f"q must be float16 or bfloat16, got {np.dtype(dtype)}"):
        numbaflash.flash_attention(*qkv(dtype=dtype))


@pytest.mark.parametrize("typestr", ["<f8", "<f4", "<i2", "<u2"])
def test_device_arrays_of_other_dtypes_rejected(typestr, no_compile):
    arrays = [FakeDeviceArray(s, typestr) for s in ((1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64))]
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        numbaflash.flash_attention(*arrays)


def test_device_array_dtype_attribute_must_match_typestr(no_compile):
    q = FakeDeviceArray((1, 8, 4, 64), "<f8")
    q.dtype = np.dtype(np.float16)
    with pytest.raises(TypeError, match="disagree on the element size"):
        numbaflash.flash_attention(q, FakeDeviceArray((1, 8, 2, 64)), FakeDeviceArray((1, 8, 2, 64)))


def test_mixed_bf16_and_f16_rejected():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one dtype"):
        numbaflash.flash_attention(q, k.astype(ml_dtypes.bfloat16), v)


def test_out_must_match():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out must have"):
        numbaflash.flash_attention(q, k, v, out=np.zeros((1, 8, 4, 32), np.float16))


class FakeDeviceArray:
    """Just enough of __cuda_array_interface__ to be classified as a device array; each one
    gets its own (fake) 1 GB-aligned address unless ``pointer`` is given."""

    next_pointer = 1 << 30

    def __init__(self, shape, typestr="<f2", strides=None, pointer=None):
        if pointer is None:
            pointer = FakeDeviceArray.next_pointer
            FakeDeviceArray.next_pointer += 1 << 30
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (pointer, False), "strides": strides, "version": 3,
        }


@pytest.fixture
def no_compile(monkeypatch):
    """Pretend a Hopper GPU is current, and fail if validation lets a call reach compilation:
    each bad input must be rejected before anything is compiled or launched."""
    def compile_(*args, **kwargs):
        raise AssertionError("would compile a kernel")

    monkeypatch.setattr(device.GPU, "current", lambda: ((9, 0), 0))
    monkeypatch.setattr(forward, "forward_kernel", compile_)


def fake_qkv(shape_q=(1, 8, 4, 64), shape_k=(1, 8, 2, 64)):
    return FakeDeviceArray(shape_q), FakeDeviceArray(shape_k), FakeDeviceArray(shape_k)


def test_read_only_numpy_out_rejected(no_compile):
    out = np.zeros((1, 8, 4, 64), np.float16)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        numbaflash.flash_attention(*qkv(), out=out)


def test_stride_0_numpy_out_rejected(no_compile):
    base = np.zeros((1, 8, 1, 64), np.float16)
    out = np.lib.stride_tricks.as_strided(base, (1, 8, 4, 64), (0, 128, 0, 2), writeable=True)
    with pytest.raises(ValueError, match="share memory"):
        numbaflash.flash_attention(*qkv(), out=out)


@pytest.mark.parametrize("strides", [(4096, 0, 128, 2), (4096, 512, 0, 2), (4096, 64, 16, 2)])
def test_overlapping_device_out_rejected(strides, no_compile):
    out = FakeDeviceArray((1, 8, 4, 64), strides=strides)
    with pytest.raises(ValueError, match="share memory"):
        numbaflash.flash_attention(*fake_qkv(), out=out)


def test_device_out_sharing_memory_with_k_rejected(no_compile):
    q, k, v = fake_qkv()
    k_pointer = k.__cuda_array_interface__["data"][0]
    with pytest.raises(ValueError, match="out shares memory with k"):
        numbaflash.flash_attention(q, k, v, out=FakeDeviceArray((1, 8, 4, 64), pointer=k_pointer + 256))


def test_device_out_may_be_q(no_compile):
    q, k, v = fake_qkv()
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(q, k, v, out=q)
    partly_q = FakeDeviceArray((1, 8, 4, 64), pointer=q.__cuda_array_interface__["data"][0] + 512)
    with pytest.raises(ValueError, match="out shares memory with q"):
        numbaflash.flash_attention(q, k, v, out=partly_q)


@pytest.mark.parametrize("which", ["q", "k", "out"])
def test_device_layout_checked_before_compiling(which, no_compile):
    arrays = dict(zip("qkv", fake_qkv(), strict=True))
    misaligned = FakeDeviceArray((1, 8, 4 if which in "q out" else 2, 64), pointer=(3 << 30) + 8)
    arrays[which] = misaligned
    with pytest.raises(ValueError, match="16-byte"):
        numbaflash.flash_attention(arrays["q"], arrays["k"], arrays["v"], out=arrays.get("out"))


def test_grid_limit(no_compile):
    """Up to 65535 x 65535 (batch, head) pairs are folded into the grid; more are refused."""
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*fake_qkv((70000, 8, 4, 64), (70000, 8, 1, 64)))
    with pytest.raises(ValueError, match="exceeds the CUDA grid"):
        numbaflash.flash_attention(*fake_qkv((70000, 8, 65536, 64), (70000, 8, 1, 64)))
    assert launch_forward.forward_grid(3, 4, 70000) == (3, 65535, 5)
    assert launch_forward.forward_grid(3, 70000, 2) == (3, 65535, 3)
    assert launch_forward.forward_grid(3, 16, 2) == (3, 16, 2)  # y = heads, z = batch: no divisions


def test_folded_grid_forced(monkeypatch):
    """Tests can force the folded (batch, head) numbering on small problems."""
    monkeypatch.setattr(launch_forward, "FOLD_GRID", True)
    assert launch_forward.forward_grid(3, 16, 2) == (3, 32, 1)
    assert launch_forward.forward_grid(3, 7, 5) == (3, 35, 1)


def test_mixed_host_and_device_rejected():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="not a mix"):
        numbaflash.flash_attention(FakeDeviceArray(q.shape), k, v)


def test_device_layout_checks():
    op = operands.describe("q", FakeDeviceArray((1, 8, 2, 64), strides=(2048, 256, 128, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        operands.check_device_layout(op)
    op = operands.describe("q", FakeDeviceArray((1, 8, 2, 64), strides=(2 * 1044, 2 * 130, 2 * 65, 2)))
    with pytest.raises(ValueError, match="16-byte"):
        operands.check_device_layout(op)


@pytest.mark.parametrize("failure", ["no device", "no driver"])
def test_no_gpu_is_a_clear_runtime_error(monkeypatch, failure):
    """Whatever the machine has, a driver that finds no GPU (or no driver at all) gives a clear
    RuntimeError, before anything is compiled."""
    from cuda.bindings import driver

    class NoDevice:
        CUresult = driver.CUresult

        @staticmethod
        def cuInit(flags):
            if failure == "no driver":
                raise RuntimeError("Failed to dlopen libcuda.so.1")
            return (driver.CUresult.CUDA_ERROR_NO_DEVICE,)

    monkeypatch.setattr(device, "GPU", device.GpuState(load_driver=lambda: NoDevice))  # a fresh process
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        numbaflash.flash_attention(*qkv())


def test_reference_handles_rows_without_keys():
    from numbaflash.tools.reference import attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, 5, 1, 64), (1, 3, 1, 64), (1, 3, 1, 64)))
    out, lse = attention_reference(q, k, v, causal=True)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[..., :2]))
    assert np.isfinite(out).all() and np.isfinite(lse[..., 2:]).all()


def test_tensors_must_be_on_the_current_device():
    ops = [operands.Operand(n, (1, 1, 1, 64), "float16", True, None, device=d)
           for n, d in (("q", 0), ("k", 1))]
    with pytest.raises(ValueError, match=r"current CUDA device \(cuda:0\), got q on cuda:0, k on cuda:1"):
        operands.check_same_device(ops, 0)
    operands.check_same_device(ops[:1], 0)
    unknown = operands.Operand("q", (1, 1, 1, 64), "float16", True, None)
    operands.check_same_device([unknown], 3)  # a device not known: allowed


def test_device_buffer_rejects_other_than_16_bit_floats():
    from numbaflash.runtime.buffers import DeviceBuffer

    with pytest.raises(TypeError, match="16-bit floats, got dtype float32"):
        DeviceBuffer(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="16-bit floats, got dtype int8"):
        DeviceBuffer.empty((2, 2), np.int8)
    with pytest.raises(TypeError, match="needs a numpy array"):
        DeviceBuffer()


# ------------------------------------------------------------------ the device hot path (GPU faked)


class Launches:
    """A stand-in for the driver's ``cuLaunchKernel``: records each launch with the address of
    its parameter buffer and, copied at the launch, the buffer's bytes (the kernel's parameters
    as the driver would copy them: ``buffers`` maps each launcher's and bound launch's buffer
    address to the buffer, kept alive, so a launch is read as it was even after a call that did
    not keep its plan)."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.buffers: dict[int, object] = {}

    def __call__(self, handle, gx, gy, gz, block, by, bz, shared, stream, pointers, extra) -> int:
        buffer = self.buffers.get(pointers[0])  # the first parameter sits at the buffer's start
        self.seen.append((handle, (gx, gy, gz), block, shared, stream, pointers[0],
                          None if buffer is None else bytes(buffer)))
        return 0


class FakeSlots:
    """``runtime.map_slots.MapSlots``' interface: a slot per key, every lookup and use recorded."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.keys: list[tuple] = []
        self.slot_of: dict[tuple, int] = {}
        self.used_slots: list[tuple[int, int]] = []

    def address(self, key, encode, stream):
        self.keys.append(key)
        slot = self.slot_of.setdefault(key, len(self.slot_of))
        return (1 << 36) + 512 * slot, slot

    def used(self, slot, stream):
        self.used_slots.append((slot, stream))


@pytest.fixture
def fake_device(monkeypatch):
    """A fresh GPU state on a pretend device 0 (sm_90 unless changed): kernels 'load' without
    compiling, the real ``KernelLauncher`` packs every launch and hands it to ``Launches``, the
    Hopper kernel's tensor maps go to ``FakeSlots``, and new CUDA-array-interface outputs are
    ``FakeDeviceArray``s."""
    import ctypes
    import types

    from numbaflash.runtime import launch as runtime_launch
    from numbaflash.runtime import map_slots

    state = device.GpuState()
    monkeypatch.setattr(device, "GPU", state)
    gpu = types.SimpleNamespace(capability=(9, 0), ordinal=0, loads=[], launches=Launches(),
                                slots=FakeSlots(), streams=[7])
    monkeypatch.setattr(state, "current", lambda: (gpu.capability, gpu.ordinal))
    monkeypatch.setattr(state, "shared_limit", lambda ordinal: 227 * 1024)
    monkeypatch.setattr(state, "sm_count", lambda ordinal: 132)
    state.scratch[0] = 1 << 35

    def loaded_kernel(spec):
        gpu.loads.append((spec.config, spec.causal, spec.bf16, spec.arch))
        return types.SimpleNamespace(handle=len(gpu.loads)), "entry"

    monkeypatch.setattr(forward, "loaded_kernel", loaded_kernel)
    driver = types.SimpleNamespace(cuLaunchKernel=gpu.launches)
    monkeypatch.setattr(runtime_launch, "_libcuda", lambda: driver)
    real_init, real_bind = runtime_launch.KernelLauncher.__init__, runtime_launch.KernelLauncher.bind

    def init(self, *args, **kwargs):  # every parameter buffer, for Launches to copy at launch
        real_init(self, *args, **kwargs)
        gpu.launches.buffers[ctypes.addressof(self._buffer)] = self._buffer

    def bind(self, *args, **kwargs):
        fire = real_bind(self, *args, **kwargs)
        gpu.launches.buffers[ctypes.addressof(fire.buffer)] = fire.buffer
        return fire

    monkeypatch.setattr(runtime_launch.KernelLauncher, "__init__", init)
    monkeypatch.setattr(runtime_launch.KernelLauncher, "bind", bind)
    monkeypatch.setattr(runtime_launch, "set_dynamic_shared_limit", lambda handle, ordinal, nbytes: None)
    monkeypatch.setattr(map_slots, "map_slots", lambda ordinal: gpu.slots)
    monkeypatch.setattr(operands, "_RAW_STREAM", lambda ordinal: gpu.streams[-1])
    for name, typestr in (("empty_like", "<f2"), ("empty_lse", "<f4")):  # new CAI arrays: fake ones
        real = getattr(forward, name)
        monkeypatch.setattr(forward, name, lambda ref, shape, *rest, real=real, typestr=typestr: (
            real(ref, shape, *rest) if operands.kind_of(ref) == "torch" else FakeDeviceArray(shape, typestr)))
    return gpu


def parameters(config, launch) -> bytes:
    """The parameter bytes of one recorded launch, by the family's parameter list."""

    from numbaflash.kernels.families import kernel_abi, spec_of
    from numbaflash.runtime import launch as runtime_launch

    abi = kernel_abi(spec_of(config))
    _, size = runtime_launch._packer(runtime_launch.param_layout(abi), len(abi))
    assert launch[6] is not None, "Launches copies every parameter buffer at launch"
    return launch[6][:size]


def packed(config, *args) -> bytes:
    import ctypes

    from numbaflash.kernels.families import kernel_abi, spec_of
    from numbaflash.runtime import launch as runtime_launch

    abi = kernel_abi(spec_of(config))
    pack, size = runtime_launch._packer(runtime_launch.param_layout(abi), len(abi))
    buffer = ctypes.create_string_buffer(size)
    pack(buffer, *args)
    return buffer.raw


def sm80_arguments(config, q, k, v, o, lse, shape_q, shape_k, scale, write_lse):
    """What the mma.sync forward kernel gets (``FORWARD_ABI``), for dense operands at these
    pointers, with no window and no softcap (their three parameters 0)."""
    (b, sq, hq, d), (_, sk, hkv, _) = shape_q, shape_k
    sq_strides, sk_strides = (sq * hq * d, hq * d, d), (sk * hkv * d, hkv * d, d)
    return ((q, b * sq * hq * d), (k, b * sk * hkv * d), (v, b * sk * hkv * d), (o, b * sq * hq * d), lse,
            *sq_strides, *sk_strides, *sk_strides, *sq_strides, sq, sk, b, hq, hq // hkv,
            np.float32(scale * np.log2(np.e)), write_lse, 0, 0, np.float32(0.0))


def pointer(array) -> int:
    return array.__cuda_array_interface__["data"][0]


def test_device_calls_of_one_layout_share_a_plan_and_launch_with_their_own_pointers(fake_device):
    """The second call of a layout reuses the first's plan (no load, no new plan) and its
    launch carries the second call's pointers and stream, with the same parameters otherwise."""
    fake_device.capability = (8, 0)
    config = configs_for((8, 0), 64, True)
    shape_q, shape_k = (2, 100, 4, 64), (2, 120, 2, 64)
    for stream in (7, 9):
        q, k, v = fake_qkv(shape_q, shape_k)
        out = FakeDeviceArray(shape_q)
        q.__cuda_array_interface__["stream"] = stream
        result = numbaflash.flash_attention(q, k, v, causal=True, softmax_scale=0.5, out=out)
        assert result is out
        launch = fake_device.launches.seen[-1]
        assert launch[1:5] == ((-(-100 // config.block_m), 4, 2), config.threads, config.shared_bytes, stream)
        expected = sm80_arguments(config, pointer(q), pointer(k), pointer(v), pointer(out),
                                  (device.GPU.scratch[0], 1), shape_q, shape_k, 0.5, False)
        assert parameters(config, launch) == packed(config, *expected)
    assert len(fake_device.loads) == 1 and len(device.GPU.plans) == 1


def configs_for(capability, head_dim, causal):
    from numbaflash import configs

    return configs.forward_config(capability, head_dim, causal, 227 * 1024 if capability == (9, 0) else None,
                                  None)


def test_hopper_plan_keys_its_tensor_maps_by_layout_and_pointers(fake_device):
    shape = (1, 256, 2, 128)
    calls = [fake_qkv(shape, shape) for _ in range(2)]
    for q, k, v in calls:
        numbaflash.flash_attention(q, k, v, causal=True)
    first, second = fake_device.slots.keys
    assert first[0] == second[0]  # one layout
    assert first[1:4] == tuple(map(pointer, calls[0])) and second[1:4] == tuple(map(pointer, calls[1]))
    assert [slot for slot, _ in fake_device.slots.used_slots] == [0, 1]
    assert len(fake_device.launches.seen) == 2 and len(device.GPU.plans) == 1


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_grid_is_persistent(fake_device, causal):
    """The Hopper forward launches at most one CTA a SM, each walking work units (one CTA a work
    unit lost 1.5-10.5% on an H200: docs/PERFORMANCE.md, "Measurements behind dispatch rules"),
    and no more CTAs than the problem's query blocks."""
    big, small = (2, 4096, 16, 128), (1, 256, 2, 128)  # 1024 and 4 query blocks of 128 rows
    for shape, ctas in ((big, 132), (small, 4)):
        numbaflash.flash_attention(*fake_qkv(shape, shape), causal=causal)
        assert fake_device.loads[-1][0].__class__.__name__ == "WsConfig"
        assert fake_device.launches.seen[-1][1] == (ctas, 1, 1)


def test_plans_are_bounded(fake_device, monkeypatch):
    monkeypatch.setattr(forward, "PLANS_KEPT", 2)
    for seqlen in (64, 65, 66):
        numbaflash.flash_attention(*fake_qkv((1, seqlen, 2, 64), (1, seqlen, 2, 64)))
    assert len(device.GPU.plans) == 2


def test_forced_configs_make_no_plans(fake_device):
    from numbaflash import configs

    forced = configs.forward_config((8, 0), 64, False)
    with configs.force_config((9, 0), False, forced):
        numbaflash.flash_attention(*fake_qkv())
    assert not device.GPU.plans and len(fake_device.launches.seen) == 1


# torch tensors on the pretend device: CPU tensors of a subclass (module ``torch.*``, so
# operands.kind_of takes them for torch's) that say they are on CUDA device ``ordinal``


@functools.cache
def cuda_like_type(torch):
    class CudaLike(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl
        is_cuda = True

        def get_device(self):
            return self.ordinal

    CudaLike.__module__ = "torch.testing_cuda_like"
    return CudaLike


def cuda_like(torch, shape, ordinal=0, dtype=None, offset=0):
    base = torch.zeros(int(np.prod(shape)) + offset, dtype=dtype or torch.float16)
    x = torch.Tensor._make_subclass(cuda_like_type(torch), base[offset:].view(shape))
    x.ordinal = ordinal
    return x


@pytest.fixture
def torch_qkv(fake_device):
    torch = pytest.importorskip("torch")

    def make(shape_q=(1, 64, 4, 64), shape_k=(1, 80, 2, 64), **kwargs):
        return (cuda_like(torch, shape_q, **kwargs), cuda_like(torch, shape_k, **kwargs),
                cuda_like(torch, shape_k, **kwargs))

    return torch, make


def direct(q, k, v, **kwargs):
    from numbaflash.operations.entry import direct_flash_attention

    args = {"causal": False, "softmax_scale": None, "return_lse": False, "out": None, **kwargs}
    return direct_flash_attention(q, k, v, args["causal"], args["softmax_scale"], args["return_lse"],
                                  args["out"])


def test_torch_calls_of_a_known_layout_skip_describing(torch_qkv, fake_device, monkeypatch):
    """A torch call whose layout has a plan is served by ``forward.run_torch``: the launch of the
    full path, with the new call's pointers, stream, out and LSE."""
    torch, make = torch_qkv
    config = configs_for((9, 0), 64, True)
    first = direct(*make(), causal=True, return_lse=True)
    monkeypatch.setattr(numbaflash.operations.entry, "describe", None)  # the full path would fail now
    fake_device.streams.append(11)
    q, k, v = make()
    out, lse = direct(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (1, 4, 64)
    assert lse.dtype == torch.float32 and out.data_ptr() != first[0].data_ptr()
    assert len(fake_device.launches.seen) == 2 and fake_device.launches.seen[1][4] == 11
    assert fake_device.slots.keys[1][1:] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert config == fake_device.loads[0][0] and len(fake_device.loads) == 1


def test_torch_fast_path_matches_the_full_path(torch_qkv, fake_device):
    """The same call through the full path (CUDA-array-interface operands at the same pointers)
    and through the plan (torch) launches with the same parameter bytes."""
    torch, make = torch_qkv
    fake_device.capability = (8, 0)
    config = configs_for((8, 0), 64, False)
    q, k, v = make()
    out = cuda_like(torch, q.shape)
    for _ in range(2):  # the full path, then the plan
        direct(q, k, v, softmax_scale=0.25, out=out)
    as_cai = [FakeDeviceArray(tuple(x.shape), pointer=x.data_ptr()) for x in (q, k, v, out)]
    numbaflash.flash_attention(*as_cai[:3], softmax_scale=0.25, out=as_cai[3])
    full, planned, cai = (parameters(config, launch) for launch in fake_device.launches.seen)
    assert full == planned == cai
    assert planned == packed(config, *sm80_arguments(config, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                     out.data_ptr(), (device.GPU.scratch[0], 1), q.shape,
                                                     k.shape, 0.25, False))


@pytest.mark.parametrize("bad", ["misaligned", "other device", "out overlaps k", "out partly q", "causal 1",
                                 "scale True", "float32"])
def test_torch_calls_of_a_known_layout_are_still_checked(torch_qkv, fake_device, monkeypatch, bad):
    """A plan covers the layout only: what can differ between calls of one layout is checked on
    every call, with the full path's messages."""
    torch, make = torch_qkv
    q, k, v = make()
    out = cuda_like(torch, q.shape)
    direct(q, k, v, causal=True, out=out)
    with monkeypatch.context() as patch:  # the plan serves these: no describing
        patch.setattr(numbaflash.operations.entry, "describe", None)
        direct(q, k, v, causal=True, out=q)  # out may be q itself
        direct(q, k, v, causal=True, out=out)
    kwargs = {"causal": True, "out": out}
    if bad == "misaligned":
        q = make(offset=1)[0]
        error, message = ValueError, "16-byte"
    elif bad == "other device":
        k = make(ordinal=1)[1]
        error, message = ValueError, "current CUDA device"
    elif bad == "out overlaps k":  # q | k | v in one buffer: out at k's start overlaps k (and v), never q
        base = torch.zeros(q.numel() + 2 * k.numel(), dtype=torch.float16)
        ends = np.cumsum([0, q.numel(), k.numel(), k.numel()])
        q, k, v = (torch.Tensor._make_subclass(cuda_like_type(torch), base[a:b].view(x.shape))
                   for a, b, x in zip(ends[:-1], ends[1:], (q, k, v), strict=True))
        for x in (q, k, v):
            x.ordinal = 0
        kwargs["out"] = cuda_like(torch, q.shape)
        kwargs["out"].data_ptr = lambda: k.data_ptr()
        error, message = ValueError, "out shares memory with k"
    elif bad == "out partly q":
        kwargs["out"] = cuda_like(torch, q.shape)
        kwargs["out"].data_ptr = lambda: q.data_ptr() + 16
        error, message = ValueError, "out shares memory with q"
    elif bad == "causal 1":
        kwargs["causal"] = 1
        error, message = TypeError, "causal must be a bool"
    elif bad == "scale True":
        kwargs["softmax_scale"] = True
        error, message = TypeError, "softmax_scale must be a real number"
    else:
        q, k, v = make(dtype=torch.float32)
        error, message = TypeError, "float16 or bfloat16"
    with pytest.raises(error, match=message):
        direct(q, k, v, **kwargs)
    assert len(fake_device.launches.seen) == 3
