"""The learnable sink (issue 56, FlashAttention-4's ``learnable_sink``) without a GPU: the spec's axis
and its normalisation, the sink builds' parameter lists, the checks before launch, the launch's
arguments on a pretend device, and the torch op's fake kernels. The backward with a sink (d_sink,
autograd): ``test_sink_backward_cpu.py``. The kernels against float64: ``test_sink_gpu.py``; the
reference itself: ``test_sink_reference_cpu.py``."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from test_api_cpu import (  # noqa: F401  (fixtures)
    FakeDeviceArray,
    configs_for,
    cuda_like,
    cuda_like_type,
    fake_device,
    fake_qkv,
    no_compile,
    pointer,
    sm80_arguments,
)

import numbaflash
from numbaflash.kernels import families, params
from numbaflash.kernels.shapes import BackwardConfig, DecodeConfig, ForwardConfig, WsConfig
from numbaflash.kernels.spec import kernel_spec
from numbaflash.operations import forward
from numbaflash.operations import varlen as _varlen  # noqa: F401  (imported before a test patches forward)
from numbaflash.runtime import device

# ------------------------------------------------------------------ the spec's axis


def test_the_sink_is_one_axis_of_the_forward_spec():
    spec = kernel_spec("sm80", "forward", ForwardConfig(64), causal=True, sink=True)
    assert spec.sink and spec.kind == "sm80.forward+sink"
    assert spec != dataclasses.replace(spec, sink=False)
    hopper = kernel_spec("sm90", "forward", WsConfig(128), varlen=True, sink=True)
    assert hopper.kind == "sm90.forward+varlen+sink"
    assert not kernel_spec("sm80", "forward", ForwardConfig(64)).sink  # the default: today's kernel


def test_kernels_that_do_not_read_the_sink_are_built_without_it():
    for operation in ("backward", "backward_dq"):  # kernels.spec.SINK_FREE
        assert not kernel_spec("sm80bwd", operation, BackwardConfig(64), causal=True, sink=True).sink
    assert not kernel_spec("sm80dec", "decode_combine", DecodeConfig(128), sink=True).sink
    prep = kernel_spec("sm80bwd", "backward_prep", BackwardConfig(64), causal=True, sink=True)
    assert prep.sink and not prep.causal and prep.kind == "sm80bwd.backward_prep+sink"


def test_families_build_the_sink_in_the_forward_decode_and_backward_prepare_only():
    assert families.SM80.runs("forward", sink=True) and families.SM90.runs("forward", varlen=True, sink=True)
    assert families.SM80_DEC.runs("decode", sink=True)
    assert not families.SM80_DEC.runs("decode_combine", sink=True)
    assert families.SM80_BWD.runs("backward_prep", varlen=True, sink=True)
    assert families.SM90_BWD.runs("backward_prep", sink=True)
    assert not families.SM80_BWD.runs("backward", sink=True)
    unnormalised = dataclasses.replace(kernel_spec("sm80bwd", "backward", BackwardConfig(64)), sink=True)
    with pytest.raises(NotImplementedError, match=r"sm80bwd.backward\+sink kernel \(a learnable sink: "
                                                  r"backward_prep only\)"):
        families.make_kernel(unnormalised)
    decode = kernel_spec("sm80dec", "decode", DecodeConfig(128), causal=True, softcap=True, sink=True)
    assert decode.sink and not decode.sibling("decode_combine").sink
    assert families.kernel_params(decode) == params.DECODE_VARIANT + params.SINK
    assert families.kernel_params(kernel_spec("sm80dec", "decode", DecodeConfig(128), sink=True)) == (
        params.DECODE + params.SINK)


def test_the_cache_keys_sink_builds_apart():
    from numbaflash.runtime import cache

    a = families.spec_of(ForwardConfig(64), causal=True)
    assert cache.kernel_key(a, sources="s", versions={}) != cache.kernel_key(
        dataclasses.replace(a, sink=True), sources="s", versions={})


@pytest.mark.parametrize(("config", "varlen"), [(ForwardConfig(64), False), (ForwardConfig(128), True),
                                                (WsConfig(128), False), (WsConfig(64), True)])
def test_a_sink_build_takes_its_logits_last(config, varlen):
    plain = families.spec_of(config, varlen=varlen)
    sink = dataclasses.replace(plain, sink=True)
    assert families.kernel_params(sink) == families.kernel_params(plain) + params.SINK
    assert families.kernel_abi(sink)[-1] == "array(float32, 1d, C)"


@pytest.mark.parametrize(("config", "varlen", "causal"), [
    (ForwardConfig(64), False, True), (ForwardConfig(96), True, False), (WsConfig(128), False, True),
    (WsConfig(64), True, False), (DecodeConfig(128), False, True),
    (DecodeConfig(64, paged=True), False, False)])
def test_a_sink_kernel_agrees_with_its_declaration(config, varlen, causal):
    """What ``test_params_cpu`` checks for every registered kernel, for sink builds (built on
    demand, not registered): the kernel function's parameters are the declaration's names, and
    its name says ``_sink``; the plain build's name is unchanged."""
    pytest.importorskip("numba")
    operation = "decode" if isinstance(config, DecodeConfig) else "forward"
    spec = families.spec_of(config, operation, bf16=True, causal=causal, varlen=varlen, sink=True)
    kernel = families.make_kernel(spec)
    function = getattr(kernel, "py_func", kernel)
    assert tuple(inspect.signature(function).parameters) == params.names_of(families.kernel_params(spec))
    assert len(families.kernel_argtypes(spec)) == len(families.kernel_params(spec))
    plain = families.make_kernel(dataclasses.replace(spec, sink=False))
    assert kernel.__name__ == plain.__name__ + "_sink"
    assert kernel.launch_bounds == plain.launch_bounds


# ------------------------------------------------------------------ checks before launch


def sink_array(shape=(4,), typestr="<f4", strides=None, pointer=None):
    return FakeDeviceArray(shape, typestr, strides, pointer)


@pytest.mark.parametrize(("sink", "error", "message"), [
    (lambda: sink_array((2,)), ValueError, r"learnable_sink must have shape \(heads_q,\) = \(4,\), got \(2,"),
    (lambda: sink_array((1, 4)), ValueError, r"shape \(heads_q,\) = \(4,\), got \(1, 4\)"),
    (lambda: sink_array(typestr="<f2"), TypeError, "learnable_sink must be float32, got float16"),
    (lambda: sink_array(typestr="<f8"), TypeError, "learnable_sink must be float32, got float64"),
    (lambda: sink_array(strides=(8,)), ValueError, "learnable_sink must be contiguous, got stride 2"),
    (lambda: sink_array(pointer=(1 << 40) + 2), ValueError, "learnable_sink must start on a 4-byte boundary"),
    (lambda: np.zeros(4, np.float32), TypeError, r"learnable_sink must be a float32 device array of shape "
                                                 r"\(heads_q,\) = \(4,\).*got ndarray"),
    (lambda: [0.0] * 4, TypeError, "got list"),
])
def test_a_bad_sink_is_refused_before_launch(sink, error, message, no_compile):  # noqa: F811
    q, k, v = fake_qkv()  # heads_q 4
    with pytest.raises(error, match=message):
        numbaflash.flash_attention(q, k, v, learnable_sink=sink())


def offsets():
    cu = FakeDeviceArray((3,), "<i4")
    cu.shape = (3,)
    return cu


def test_a_bad_varlen_sink_is_refused_before_launch(no_compile):  # noqa: F811
    q, k, v = FakeDeviceArray((40, 4, 64)), FakeDeviceArray((50, 2, 64)), FakeDeviceArray((50, 2, 64))
    cu = offsets()
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(heads_q,\) = \(4,\), got \(3,\)"):
        numbaflash.flash_attention_varlen(q, k, v, cu, cu, 20, 25, learnable_sink=sink_array((3,)))
    with pytest.raises(TypeError, match="learnable_sink must be float32"):
        numbaflash.flash_attention_varlen(q, k, v, cu, cu, 20, 25, learnable_sink=sink_array(typestr="<i4"))


def test_numpy_inputs_take_no_sink_yet(no_compile):  # noqa: F811
    q = np.zeros((1, 8, 4, 64), np.float16)
    k = np.zeros((1, 8, 2, 64), np.float16)
    sink = np.zeros(4, np.float32)
    with pytest.raises(NotImplementedError, match=r"flash_attention\(\): learnable_sink is not supported"):
        numbaflash.flash_attention(q, k, k, learnable_sink=sink)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(NotImplementedError, match=r"flash_attention_varlen\(\): learnable_sink"):
        numbaflash.flash_attention_varlen(q[0], k[0], k[0], cu, cu, 8, 8, learnable_sink=sink)


# ------------------------------------------------------------------ the launch


@pytest.fixture
def loads(fake_device, monkeypatch):  # noqa: F811
    """The specs the pretend device loads."""
    import types

    seen = []

    def loaded_kernel(spec):
        seen.append(spec)
        return types.SimpleNamespace(handle=len(seen)), "entry"

    monkeypatch.setattr(forward, "loaded_kernel", loaded_kernel)
    return seen


def launch_parameters(spec, launch) -> bytes:

    from numbaflash.runtime import launch as runtime_launch

    abi = families.kernel_abi(spec)
    _, size = runtime_launch._packer(runtime_launch.param_layout(abi), len(abi))
    assert launch[6] is not None, "Launches copies every parameter buffer at launch"
    return launch[6][:size]


def sink_packed(spec, *args) -> bytes:
    import ctypes

    from numbaflash.runtime import launch as runtime_launch

    abi = families.kernel_abi(spec)
    pack, size = runtime_launch._packer(runtime_launch.param_layout(abi), len(abi))
    buffer = ctypes.create_string_buffer(size)
    pack(buffer, *args)
    return buffer.raw


def test_an_sm80_sink_call_runs_the_sink_build_with_the_sink_last(fake_device, loads):  # noqa: F811
    """The sink build of the config a plain call runs, its own plan, and every argument of the
    plain call's launch then the sink's pointer; a second call of the layout reuses the plan with
    its own sink pointer."""
    fake_device.capability = (8, 0)
    config = configs_for((8, 0), 64, True)
    shape_q, shape_k = (2, 100, 4, 64), (2, 120, 2, 64)
    q, k, v = fake_qkv(shape_q, shape_k)
    numbaflash.flash_attention(q, k, v, causal=True, softmax_scale=0.5)
    for _ in range(2):
        out, sink = FakeDeviceArray(shape_q), sink_array()
        numbaflash.flash_attention(q, k, v, causal=True, softmax_scale=0.5, out=out, learnable_sink=sink)
        spec = loads[-1]
        assert spec.sink and spec.config == config and spec.causal
        expected = sm80_arguments(config, pointer(q), pointer(k), pointer(v), pointer(out),
                                  (device.GPU.scratch[0], 1), shape_q, shape_k, 0.5, False)
        assert launch_parameters(spec, fake_device.launches.seen[-1]) == sink_packed(spec, *expected,
                                                                                     (pointer(sink), 4))
    assert [s.sink for s in loads] == [False, True]  # one load each
    assert len(device.GPU.plans) == 2  # the sink call's plan is its own


def test_a_hopper_sink_call_passes_the_sink_after_the_lse(fake_device, loads):  # noqa: F811
    q, k, v = fake_qkv((1, 256, 4, 128), (1, 256, 2, 128))
    sink = sink_array()
    numbaflash.flash_attention(q, k, v, causal=True, learnable_sink=sink)
    spec = loads[-1]
    assert spec.family == "sm90" and spec.sink
    raw = launch_parameters(spec, fake_device.launches.seen[-1])
    assert pointer(sink).to_bytes(8, "little") in raw[-56:]  # the last parameter (an array record): the sink


def test_a_varlen_sink_call_passes_the_sink_last(fake_device, loads):  # noqa: F811
    fake_device.capability = (8, 0)
    q, k, v = FakeDeviceArray((40, 4, 64)), FakeDeviceArray((50, 2, 64)), FakeDeviceArray((50, 2, 64))
    cu_q, cu_k, sink = offsets(), offsets(), sink_array()
    out = FakeDeviceArray((40, 4, 64))
    numbaflash.flash_attention_varlen(q, k, v, cu_q, cu_k, 20, 25, learnable_sink=sink, out=out)
    spec = loads[-1]
    assert spec.varlen and spec.sink and spec.family == "sm80"
    raw = launch_parameters(spec, fake_device.launches.seen[-1])
    assert pointer(sink).to_bytes(8, "little") in raw[-56:]


@pytest.mark.parametrize("bad", ["float16", "length 3", "strided", "other device"])
def test_torch_sink_calls_of_a_known_layout_take_the_plan(fake_device, loads, monkeypatch, bad):  # noqa: F811
    """A torch call with a sink whose layout has a plan skips the full checks
    (``forward.run_torch``) and launches the sink build with the same parameter bytes as the full
    path, its own sink's pointer last; a sink the plan cannot take (another dtype, length or
    stride, another device) is left to the full path, which names what is wrong."""
    torch = pytest.importorskip("torch")
    from numbaflash.operations.entry import direct_flash_attention

    fake_device.capability = (8, 0)
    q, k, v = (cuda_like(torch, shape) for shape in ((2, 100, 4, 64), (2, 120, 2, 64), (2, 120, 2, 64)))
    sinks = [cuda_like(torch, (4,), dtype=torch.float32) for _ in range(2)]
    out = cuda_like(torch, q.shape)
    direct_flash_attention(q, k, v, True, None, False, out, learnable_sink=sinks[0])  # makes the plan
    with monkeypatch.context() as patch:  # the plan serves this one: no describing
        patch.setattr(numbaflash.operations.entry, "describe_sink", None)
        direct_flash_attention(q, k, v, True, None, False, out, learnable_sink=sinks[1])
    spec = loads[-1]
    first, second = (launch_parameters(spec, launch) for launch in fake_device.launches.seen)
    was, now = (sink.data_ptr().to_bytes(8, "little") for sink in sinks)
    assert was in first[-56:] and first.count(was) == 1  # the last parameter (an array record): the sink
    assert second == first.replace(was, now)
    if bad == "float16":
        sink, error, message = cuda_like(torch, (4,)), TypeError, "learnable_sink must be float32"
    elif bad == "length 3":
        sink, error, message = cuda_like(torch, (3,), dtype=torch.float32), ValueError, r"got \(3,\)"
    elif bad == "strided":
        sink = torch.Tensor._make_subclass(cuda_like_type(torch),
                                           cuda_like(torch, (8,), dtype=torch.float32).as_strided((4,), (2,)))
        sink.ordinal = 0
        error, message = ValueError, "learnable_sink must be contiguous, got stride 2"
    else:
        sink, error, message = cuda_like(torch, (4,), ordinal=1, dtype=torch.float32), ValueError, "device"
    with pytest.raises(error, match=message):
        direct_flash_attention(q, k, v, True, None, False, out, learnable_sink=sink)
    assert len(fake_device.launches.seen) == 2


# ------------------------------------------------------------------ the torch op


def test_the_torch_op_takes_the_sink_on_fake_tensors():
    """Under a fake-tensor mode (what torch.compile traces with) a sink call goes through the
    custom op, whose fake kernel checks the sink's shape and dtype."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty((1, 8, 4, 64), dtype=torch.float16, device="cuda")
        k = torch.empty((1, 8, 2, 64), dtype=torch.float16, device="cuda")
        out, lse = numbaflash.flash_attention(q, k, k, learnable_sink=torch.empty(4, device="cuda"),
                                              return_lse=True)
        assert out.shape == q.shape and lse.shape == (1, 4, 8)
        with pytest.raises(ValueError, match=r"learnable_sink must have shape \(4,\) and dtype torch.float"):
            numbaflash.flash_attention(q, k, k, learnable_sink=torch.empty(3, device="cuda"))
