"""The backward's plans with no GPU (the driver and kernels faked as in ``test_backward_api_cpu``,
torch tensors that say they are on CUDA as in ``test_api_cpu``): a torch call of a validated
layout takes ``backward.run_torch`` and launches what the full path launches; every per-call
check sends a call that may be bad back to the full path, which gives the error."""

from __future__ import annotations

import numpy as np
import pytest
from test_api_cpu import cuda_like, cuda_like_type
from test_backward_api_cpu import AMPERE, HOPPER, FakeLauncher, fake_gpu  # noqa: F401  (the fixture)
from test_sink_backward_cpu import zeroed  # noqa: F401  (the fixture)

import numbaflash
from numbaflash import configs, operands
from numbaflash.kernels import abi
from numbaflash.operations import backward, entry
from numbaflash.operations.launch_backward import BackwardCall, backward_group_splits
from numbaflash.runtime import device

torch = pytest.importorskip("torch")

Q_SHAPE, K_SHAPE = (2, 100, 4, 64), (2, 130, 2, 64)


@pytest.fixture
def gpu(fake_gpu):  # noqa: F811
    """``test_backward_api_cpu``'s pretend GPU (its launchers also bind: ``FakeLauncher.bind``)."""
    return fake_gpu


@pytest.fixture
def streams(monkeypatch):
    """torch's current stream on the pretend device (the last of the list)."""
    found = [5]
    monkeypatch.setattr(operands, "_RAW_STREAM", lambda ordinal: found[-1])
    return found


def inputs(q_shape=Q_SHAPE, k_shape=K_SHAPE, dtype=torch.float16, **kwargs) -> dict:
    """dout, q, k, v, out, lse as torch tensors on the pretend device (keyword dict)."""
    b, s, h, _ = q_shape
    made = {name: cuda_like(torch, shape, dtype=dtype, **kwargs)
            for name, shape in (("dout", q_shape), ("q", q_shape), ("k", k_shape), ("v", k_shape),
                                ("out", q_shape))}
    return {**made, "lse": cuda_like(torch, (b, h, s), dtype=torch.float32)}


ARGS = ("dout", "q", "k", "v", "out", "lse")


def direct(x: dict, causal=True, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None,
           window_size=(-1, -1), softcap=0.0, learnable_sink=None):
    return entry.direct_flash_attention_backward(*(x[n] for n in ARGS), causal, softmax_scale, deterministic,
                                                 dq, dk, dv, window_size, softcap, learnable_sink)


def fast(x: dict, causal=True, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None,
         window_size=(-1, -1), softcap=0.0, learnable_sink=None):
    return backward.run_torch(*(x[n] for n in ARGS), causal, softmax_scale, deterministic, dq, dk, dv,
                              window_size, softcap, learnable_sink)


def on_device(view):
    """A view of a pretend-device tensor, on the pretend device too (a plain view is a CPU
    tensor)."""
    x = torch.Tensor._make_subclass(cuda_like_type(torch), view)
    x.ordinal = 0
    return x


def pointer_of(x) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__cuda_array_interface__["data"][0]


def launches_named(launches, results) -> list:
    """The recorded launches with the pointers a call allocates named: the gradients (by name)
    and the workspace's parts (by offset from its base, the prepare kernel's lse2 argument)."""
    names = {pointer_of(g): n for g, n in zip(results, ("dq", "dk", "dv", "d_sink"), strict=False)}
    base = launches[0][5][4][0]
    [plan] = device.GPU.plans.values()
    end = base + 4 * plan.workspace

    def name(arg):
        if type(arg) is not tuple:
            return arg
        pointer, elements = arg
        if pointer in names:
            return names[pointer], elements
        return (("ws", pointer - base) if base <= pointer < end else pointer), elements

    return [(op, grid, block, stream, shared, tuple(map(name, args)))
            for op, grid, block, stream, shared, args in launches]


CASES = {
    "plain": {},
    "deterministic": {"deterministic": True},
    "scale": {"softmax_scale": 0.25, "causal": False},
    "window": {"window_size": (17, 3), "causal": False},
    "softcap": {"softcap": 30.0},
    "window softcap": {"window_size": (40, 0), "softcap": 20.0, "deterministic": True},
}


@pytest.mark.parametrize("capability", [AMPERE, HOPPER])
@pytest.mark.parametrize("case", list(CASES))
def test_a_known_layout_launches_what_the_full_path_launches(gpu, streams, monkeypatch, capability,
                                                             case):
    """The second torch call of a layout skips describing (``backward.run_torch``) and launches
    the three kernels with the full path's grids and arguments, for its own gradients, workspace
    and stream; one plan serves both, the Hopper main kernel's maps looked up by the same key."""
    gpu.capability, gpu.limit = capability, configs.max_shared_bytes(capability)
    kwargs = CASES[case]
    x = inputs()
    full = direct(x, **kwargs)
    first = list(FakeLauncher.launches)
    FakeLauncher.launches.clear()
    streams.append(9)
    with monkeypatch.context() as patch:
        patch.setattr(entry, "describe", None)  # the full path would fail now
        planned = direct(x, **kwargs)
    assert [pointer_of(g) for g in planned] != [pointer_of(g) for g in full]  # new gradients
    assert all(g.shape == r.shape and g.dtype == r.dtype for g, r in zip(planned, (x["q"], x["k"], x["v"]),
                                                                          strict=True))
    again = launches_named(FakeLauncher.launches, planned)
    want = [(op, grid, block, 9 if stream == 5 else stream, shared, args)
            for op, grid, block, stream, shared, args in launches_named(first, full)]
    assert again == want
    assert [key[0] for key in device.GPU.plans] == ["backward"]
    if capability == HOPPER and "softcap" not in kwargs:  # the Hopper backward (d64 softcap: mma.sync's)
        pointers = tuple(x[n].data_ptr() for n in ("q", "k", "v", "dout"))
        assert [key[1:] for key in gpu.slots.keys] == [pointers, pointers]
        assert [slot for slot, _ in gpu.slots.used_slots] == [0, 0]


def test_the_plan_key_is_the_full_paths(gpu, streams):
    """``plan_key`` of the validated operands is the key ``run_torch`` reads off the tensors."""
    x = inputs()
    direct(x, softmax_scale=None, window_size=(9, 0), softcap=5.0)
    [key] = device.GPU.plans
    ops = [operands.describe(n, x[n]) for n in ("q", "k", "v", "dout", "out")]
    lse = operands.describe_lse(x["lse"], (2, 4, 100), True)
    assert key == backward.plan_key(0, "float16", True, 1 / 8, False, (9, 0), 5.0, (*ops, lse),
                                    (None, None, None), False)
    assert fast(x, window_size=(9, 0), softcap=5.0) is not None
    assert fast(x, softmax_scale=0.125, window_size=(9, 0), softcap=5.0) is not None  # the default's value
    assert fast(x, softmax_scale=0.126, window_size=(9, 0), softcap=5.0) is None


def _misaligned(x):
    return {**x, "q": cuda_like(torch, Q_SHAPE, offset=4)}


def _strided(x):
    return {**x, "q": on_device(cuda_like(torch, (2, 100, 4, 128))[..., :64])}


FALLBACKS = {  # name: (change of the inputs or of the keywords, the full path's error or None: it runs)
    "q float32": (lambda x: {**x, "q": cuda_like(torch, Q_SHAPE, dtype=torch.float32)}, TypeError,
                  "float16 or bfloat16"),
    "dout bfloat16": (lambda x: {**x, "dout": cuda_like(torch, Q_SHAPE, dtype=torch.bfloat16)}, ValueError,
                      "dtype float16"),
    "lse float16": (lambda x: {**x, "lse": cuda_like(torch, (2, 4, 100))}, TypeError, "lse must be float32"),
    "q misaligned": (_misaligned, ValueError, "16-byte"),
    "k on device 1": (lambda x: {**x, "k": cuda_like(torch, K_SHAPE, ordinal=1)}, ValueError,
                      "current CUDA device"),
    "q strided": (_strided, None, None),
    "causal 1": ({"causal": 1}, TypeError, "causal must be a bool"),
    "deterministic None": ({"deterministic": None}, TypeError, "deterministic must be a bool"),
    "scale True": ({"softmax_scale": True}, TypeError, "softmax_scale must be a real number"),
    "scale int": ({"softmax_scale": 1}, None, None),
    "window list": ({"window_size": [-1, -1]}, None, None),
    "window bad": ({"window_size": (-2, 0)}, ValueError, "window_size must be"),
    "softcap int": ({"softcap": 0}, None, None),
}


@pytest.mark.parametrize("bad", list(FALLBACKS))
def test_what_may_differ_between_calls_is_checked_on_every_call(gpu, streams, bad):
    """A plan covers one layout: a call that differs in what the plan cannot vouch for (a dtype,
    a pointer's alignment, a device, a new layout, a flag or scale of another type) gets None from
    ``run_torch`` and takes the full path, which raises the usual error or runs it."""
    x = inputs()
    direct(x)
    assert fast(x) is not None
    change, error, message = FALLBACKS[bad]
    y, kwargs = (change(x), {}) if callable(change) else (x, change)
    assert fast(y, **kwargs) is None
    launches = len(FakeLauncher.launches)
    if error is None:
        assert len(direct(y, **kwargs)) == 3
        assert len(FakeLauncher.launches) == launches + 3
    else:
        with pytest.raises(error, match=message):
            direct(y, **kwargs)
        assert len(FakeLauncher.launches) == launches


def test_forced_configs_take_the_full_path(gpu, streams):
    x = inputs()
    direct(x)
    forced = configs.backward_config(HOPPER, 64, True)
    with configs.force_config(HOPPER, True, forced):
        assert fast(x) is None
        direct(x)
    assert len(device.GPU.plans) == 1 and len(FakeLauncher.launches) == 6


def given_gradients(x, same_dk_dv=False):
    dq = cuda_like(torch, Q_SHAPE)
    dk = cuda_like(torch, K_SHAPE)
    return {"dq": dq, "dk": dk, "dv": dk if same_dk_dv else cuda_like(torch, K_SHAPE)}


def test_given_gradients_are_written_and_checked(gpu, streams):
    """Given dq, dk, dv: their layouts are in the key; the plan launches into them; a given
    gradient overlapping an input or another gradient, or misaligned, takes the full path,
    which refuses it."""
    x = inputs()
    grads = given_gradients(x)
    direct(x, **grads)
    found = fast(x, **given_gradients(x))
    assert found is not None and len(found) == 3
    assert fast(x) is None  # no gradients given: another layout, not seen yet
    _, main, dq = FakeLauncher.launches[-3:]
    assert dq[5][1][0] == found[0].data_ptr() and main[5][4][0] == found[1].data_ptr()
    for change, message in (({"dv": x["k"]}, "dv shares memory with k"),
                            (given_gradients(x, same_dk_dv=True), "dk shares memory with dv"),
                            ({"dq": cuda_like(torch, Q_SHAPE, offset=4)}, "16-byte")):
        bad = {**given_gradients(x), **change}
        assert fast(x, **bad) is None
        with pytest.raises(ValueError, match=message):
            direct(x, **bad)


def test_interleaved_gradients_take_the_full_path(gpu, streams):
    """dK and dV as the two halves of one packed array share no element (the full path takes
    them) but their extents overlap: the plan sends them to the full path, every call."""
    x = inputs()
    packed = cuda_like(torch, (2, 130, 2, 2, 64))
    grads = {"dk": on_device(packed[:, :, :, 0]), "dv": on_device(packed[:, :, :, 1])}
    direct(x, **grads)
    assert fast(x, **grads) is None
    assert direct(x, **grads)[1:] == (grads["dk"], grads["dv"])


def test_a_sink_call_passes_the_sink_and_a_zeroed_d_sink(gpu, streams, zeroed):  # noqa: F811
    x = inputs()
    sink = cuda_like(torch, (4,), dtype=torch.float32)
    direct(x, learnable_sink=sink)
    found = fast(x, learnable_sink=sink)
    assert len(found) == 4 and found[3] is zeroed[-1][0] and zeroed[-1][1:] == (4, 5)
    prep = FakeLauncher.launches[-3]
    assert prep[5][-2:] == ((sink.data_ptr(), 4), (pointer_of(found[3]), 4))
    assert fast(x) is None  # the sinkless call: its own plan, not made yet
    for bad in (cuda_like(torch, (4,)), cuda_like(torch, (5,), dtype=torch.float32),
                on_device(cuda_like(torch, (8,), dtype=torch.float32)[::2])):
        assert fast(x, learnable_sink=bad) is None


def test_plans_are_shared_with_the_forwards_and_bounded(gpu, streams, monkeypatch):
    from numbaflash.operations import forward

    monkeypatch.setattr(forward, "PLANS_KEPT", 2)
    for seqlen in (64, 65, 66):
        direct(inputs((1, seqlen, 2, 64), (1, seqlen, 2, 64)))
    assert len(device.GPU.plans) == 2


def test_numbaflash_api_takes_the_plan(gpu, streams, monkeypatch):
    x = inputs()
    numbaflash.flash_attention_backward(*(x[n] for n in ARGS), causal=True)
    monkeypatch.setattr(entry, "describe", None)
    dq, dk, dv = numbaflash.flash_attention_backward(*(x[n] for n in ARGS), causal=True)
    assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))  # torch's: the plan's new_empty
    assert (dq.shape, dk.shape, dv.shape) == (Q_SHAPE, K_SHAPE, K_SHAPE)


# ------------------------------------------------------------------ the GQA split (branch gqa-split)


def _split_layout(q_shape=Q_SHAPE, k_shape=K_SHAPE, deterministic=False):
    """(config, splits, workspace layout) of a causal d64 float16 call on the pretend H100 (132 SMs)."""
    config = configs.backward_config(HOPPER, 64, True, 227 * 1024)
    key_blocks = -(-k_shape[1] // config.block_n)
    splits = backward_group_splits(key_blocks, k_shape[2], q_shape[0], q_shape[2] // k_shape[2], 132,
                                   deterministic)
    return config, splits, backward.call_workspace(config, q_shape, k_shape, splits)


def test_a_split_call_goes_through_a_plan(gpu, streams, monkeypatch):
    """A GQA call the Hopper backward splits (2 key blocks x 2 KV heads x batch 2 = 8 CTAs on 132
    SMs: each group of 2 query heads over 2 CTAs) keeps a plan of the split: its workspace holds the
    dK / dV sums and tickets, its main launch is the split build's (the grid times the splits, the
    sums', the tickets' and ``splits`` last), and each fire zeroes the sums and tickets of its own
    workspace on its own stream after the prepare kernel and before the main one. The bound
    launches are what the unbound launches of the same call (``launch_all``: the numpy path's)
    give."""
    at = []  # how many kernels had been launched at each memset
    monkeypatch.setattr(device.GPU, "zero_words", lambda pointer, count, stream: (
        gpu.zeroed.append((pointer, count, stream)), at.append(len(FakeLauncher.launches))))
    config, splits, layout = _split_layout()
    assert splits == 2 and layout.dkv_elements == 2 * 2 * 2 * (2 * config.block_n * 64)
    x = inputs()
    direct(x)
    [(key, plan)] = device.GPU.plans.items()
    assert plan.splits == splits
    assert plan.workspace == layout.total > backward.call_workspace(config, Q_SHAPE, K_SHAPE).total
    assert [s.group_split for s in gpu.specs if s.operation == "backward"] == [True]
    assert at == [1]
    for stream in (9, 11):  # two planned calls: new gradients and workspaces, their own streams
        FakeLauncher.launches.clear()
        gpu.zeroed.clear()
        at.clear()
        streams.append(stream)
        with monkeypatch.context() as patch:
            patch.setattr(entry, "describe", None)  # the full path would fail now
            planned = direct(x)
        assert list(device.GPU.plans) == [key]
        prep, main, dq = FakeLauncher.launches
        base = prep[5][4][0]  # the workspace's base: the LSE in log2 units comes first
        ws = layout.at(base)
        assert main[1] == (2 * 2 * splits * 2, 1, 1)
        assert len(main[5]) == len(abi.BACKWARD_WS_SPLIT_ABI)
        assert main[5][-3:] == (ws.dkv_accum, ws.tickets, splits)
        assert main[5][6:10] == (ws.lse_log2, ws.delta, ws.dq_accum, ws.counters)
        assert gpu.zeroed == [(ws.dkv_accum[0], layout.dkv_elements + layout.ticket_elements, stream)]
        assert at == [1]  # after the prepare kernel, before the main one, on the call's stream
        assert [launch[3] for launch in FakeLauncher.launches] == [stream] * 3
    # the same call launched unbound (Launch.__call__): the same launches and memset
    bound, memsets = list(FakeLauncher.launches), list(gpu.zeroed)
    FakeLauncher.launches.clear()
    gpu.zeroed.clear()
    kernels = backward.backward_kernels(HOPPER, 0, 64, True, False, group_split=True)
    var = backward.backward_variant(True, (-1, -1), 0.0, 0.125, 100, 130)
    ops = [operands.describe(n, x[n]) for n in ("dout", "q", "k", "v", "out")]
    ops += [operands.Operand(n, g.shape, "float16", True, g, backward._dense(g.shape), g.data_ptr(), device=0)
            for n, g in zip(("dq", "dk", "dv"), planned, strict=True)]  # the plan's new gradients
    call = BackwardCall(*ops, (x["lse"].data_ptr(), 2 * 4 * 100), ws, layout.rows, var.scale_log2,
                        np.float32(0.125), False, 11, 0, var.window_left, var.window_right, var.cap_scale,
                        group_splits=splits)
    backward.launch_all(kernels, call)
    assert FakeLauncher.launches == bound and gpu.zeroed == memsets


def test_the_plan_key_separates_split_and_unsplit_calls(gpu, streams, monkeypatch):
    """Whether a call splits (``call_group_splits``) follows from its plan key: for one layout the
    choice differs with ``deterministic`` (in the key: two plans, the split one's workspace larger,
    the deterministic one's main launch the unsplit build's with no memset), and with the grid (the
    shapes: a batch whose grid fills two waves does not split); the SM count read is the key's
    device's. Each kept plan's ``splits`` is ``call_group_splits`` of its key."""
    seen = []
    monkeypatch.setattr(device.GPU, "sm_count", lambda ordinal: seen.append(ordinal) or 132)
    x = inputs()
    direct(x)
    FakeLauncher.launches.clear()
    direct(x, deterministic=True)
    assert len(gpu.zeroed) == 1  # the split call's only
    _, main, _ = FakeLauncher.launches
    assert len(main[5]) == len(abi.BACKWARD_WS_ABI) and main[1] == (2 * 2 * 2, 1, 1)
    (split_key, split_plan), (plain_key, plain_plan) = device.GPU.plans.items()
    assert [i for i, (a, b) in enumerate(zip(split_key, plain_key, strict=True)) if a != b] == [5]
    assert (split_key[5], plain_key[5]) == (False, True)  # deterministic
    assert (split_plan.splits, plain_plan.splits) == (2, 1)
    assert split_plan.workspace == _split_layout()[2].total
    assert plain_plan.workspace == _split_layout(deterministic=True)[2].total < split_plan.workspace
    # 2 key blocks x 2 KV heads x batch 66 = 264 CTAs: two waves of 132 SMs, no split
    big_q, big_k = (66, 100, 4, 64), (66, 130, 2, 64)
    assert _split_layout(big_q, big_k)[1] == 1
    direct(inputs(big_q, big_k))
    big_plan = device.GPU.plans[next(k for k in device.GPU.plans if k[8] == big_q)]
    assert big_plan.splits == 1 and len(gpu.zeroed) == 1
    assert seen and set(seen) == {0}  # the key's device
    for key, plan in device.GPU.plans.items():
        q_shape, k_shape, deterministic = key[8], key[10], key[5]
        splits = backward.call_group_splits(HOPPER, key[1], 64, True, q_shape, k_shape, deterministic)
        assert plan.splits == splits
    # and the fast path keeps them apart: each call fires its own plan
    FakeLauncher.launches.clear()
    assert fast(x, deterministic=True) is not None and len(gpu.zeroed) == 1
    assert fast(x) is not None and len(gpu.zeroed) == 2
    assert [launch[1][0] for launch in FakeLauncher.launches[1::3]] == [8, 16]
