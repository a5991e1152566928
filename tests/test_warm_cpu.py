"""The backward's kernels compile in worker processes while the forward's compiles
(``operations.warm``, ``operations.backward.prepare_backward``, ``torch_ops.prepare_backward``):
started by a forward whose inputs require grad, and only then; the backward waits on a pending
compile instead of starting another; a failed background compile is compiled again in the
foreground, which raises the real error; each kernel compiles once. The workers are real
processes running a cheap stand-in compile (``_warm_fake``); no kernel is compiled, no GPU used."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import re
import sys
import threading
import types
from pathlib import Path

import _warm_fake
import pytest

from numbaflash import configs
from numbaflash.kernels.families import BACKWARD_OPERATIONS, spec_of
from numbaflash.operations import backward, forward, warm
from numbaflash.runtime import cache, device
from numbaflash.runtime import launch as runtime_launch

HOPPER = (9, 0)
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def workers(monkeypatch, tmp_path):
    """Workers that run ``_warm_fake.compile_entry``, an empty cache, no kernel compiled in this
    process (``configs.kernel_cubin`` raises the "real" error), two CPUs; returns the folder of
    the fake compiles' marks."""
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("WARM_FAKE_DIR", str(marks))
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NUMBAFLASH_CACHE", raising=False)
    monkeypatch.delenv(warm.ENV, raising=False)
    monkeypatch.setattr(cache, "toolchain", lambda: {"fake": "1"})
    monkeypatch.setattr(cache, "source_digest", lambda files=None: "0" * 64)
    monkeypatch.setattr(warm, "PENDING", {})
    monkeypatch.setattr(warm, "cpus", lambda: 2)
    monkeypatch.setattr(warm, "start", functools.partial(warm.start, compile=_warm_fake.compile_entry))

    def foreground(spec):
        raise RuntimeError(f"the real compile error of {spec.kind}")

    monkeypatch.setattr(configs, "kernel_cubin", foreground)
    return marks


def backward_specs(head_dim=128, softcap=False):
    config = configs.backward_config(HOPPER, head_dim, True, softcap=softcap)
    main = spec_of(config, "backward", True, "sm_90a", causal=True, softcap=softcap)
    return [main.sibling(operation) for operation in BACKWARD_OPERATIONS]


def test_pending_kernels_are_waited_for_and_compiled_once(workers, caplog):
    specs = backward_specs()
    with caplog.at_level(logging.INFO, logger="numbaflash"):
        assert warm.start(specs, "backward", "the test") == 3
        assert warm.start(specs, "backward", "the test") == 0  # pending: not started again
    lines = [r.getMessage() for r in caplog.records if r.name == "numbaflash"]
    assert lines == ["numbaflash: compiling 3 backward kernels in the background (1 worker process) "
                     "for the test"]
    for spec in specs:  # the foreground never compiles: it waits for the worker's entry
        entry = warm.entry_of(spec)
        assert entry.cubin == _warm_fake.cubin_of(spec) and entry.entry_name == f"{spec.operation}_entry"
    assert _warm_fake.compiles(workers) == sorted(s.operation for s in specs)
    assert not warm.PENDING
    with pytest.raises(RuntimeError, match="the real compile error"):  # taken: a later call compiles
        warm.entry_of(specs[0])


def test_a_failed_background_compile_raises_the_real_error_in_the_foreground(workers):
    failing = backward_specs(head_dim=64, softcap=True)  # the fake compile fails on a softcap kernel
    main = failing[1]
    assert main.softcap and not failing[0].softcap
    assert warm.start(failing, "backward", "the test") == 3
    with pytest.raises(RuntimeError, match=re.escape(f"the real compile error of {main.kind}")):
        warm.entry_of(main)
    assert warm.entry_of(failing[0]).cubin == _warm_fake.cubin_of(failing[0])  # the others came back


def test_a_worker_that_dies_leaves_the_compile_to_the_foreground(workers):
    specs = backward_specs(head_dim=32)  # the fake compile ends the worker process
    assert warm.start(specs, "backward", "the test") == 3
    for spec in specs:
        with pytest.raises(RuntimeError, match="the real compile error"):
            warm.entry_of(spec)
    assert not warm.PENDING


def test_nothing_starts_when_off_cached_or_on_one_cpu(workers, monkeypatch):
    specs = backward_specs()
    monkeypatch.setenv(warm.ENV, "0")
    assert warm.start(specs, "backward", "the test") == 0
    monkeypatch.delenv(warm.ENV)
    monkeypatch.setattr(warm, "cpus", lambda: 1)
    assert warm.start(specs, "backward", "the test") == 0
    monkeypatch.setattr(warm, "cpus", lambda: 8)
    for spec in specs[:2]:  # in the cache (another process compiled them): not started
        cache.store(cache.CacheEntry(configs.kernel_key(spec), "e", b"cubin"))
    assert warm.start(specs, "backward", "the test") == 1
    assert list(warm.PENDING) == specs[2:]
    warm.entry_of(specs[2])
    assert not warm.PENDING and _warm_fake.compiles(workers) == ["backward_dq"]


@pytest.fixture
def hopper_state(monkeypatch):
    """A pretend H100 as the current device; kernels load from whatever cubin they get
    (``cuda.core`` faked), launchers are plain records."""
    state = device.GpuState()
    monkeypatch.setattr(device, "GPU", state)
    monkeypatch.setattr(state, "current", lambda: (HOPPER, 0))
    monkeypatch.setattr(state, "shared_limit", lambda ordinal: 227 * 1024)
    loaded = []

    def from_cubin(cubin):
        loaded.append(cubin)
        return types.SimpleNamespace(get_kernel=lambda name: types.SimpleNamespace(handle=len(loaded)))

    core = types.ModuleType("cuda.core")
    core.ObjectCode = types.SimpleNamespace(from_cubin=from_cubin)
    monkeypatch.setitem(sys.modules, "cuda.core", core)
    monkeypatch.setattr(runtime_launch, "KernelLauncher", lambda kernel, abi, name: (kernel, name))
    monkeypatch.setattr(runtime_launch, "set_dynamic_shared_limit", lambda handle, ordinal, nbytes: None)
    monkeypatch.setattr(backward, "_PREPARED", set())
    configs._backward_choice.cache_clear()
    yield loaded
    configs._backward_choice.cache_clear()


def tensor(shape, requires_grad=True, is_cuda=True):
    import torch

    return types.SimpleNamespace(shape=shape, dtype=torch.bfloat16, requires_grad=requires_grad,
                                 is_cuda=is_cuda, get_device=lambda: 0 if is_cuda else -1)


def torch_ops_fresh(monkeypatch):
    """``numbaflash.torch_ops`` (skipped without torch) with no call prepared yet in this process."""
    torch_ops = pytest.importorskip("numbaflash.torch_ops")
    monkeypatch.setattr(torch_ops, "_PREPARED_CALLS", set())
    return torch_ops


def test_a_forward_that_needs_grad_prepares_the_backward_it_will_run(workers, hopper_state, monkeypatch):
    torch_ops = torch_ops_fresh(monkeypatch)
    q, k = tensor((2, 1024, 8, 128)), tensor((2, 1024, 8, 128), requires_grad=False)
    plain = tensor((2, 1024, 8, 128), requires_grad=False)
    assert torch_ops.prepare_backward(plain, plain, plain, True, 0.1) == 0  # no grad: no backward follows
    assert torch_ops.prepare_backward(tensor(q.shape, is_cuda=False), k, k, True, 0.1) == 0  # not a GPU's
    assert not warm.PENDING
    assert torch_ops.prepare_backward(q, k, k, True, 0.1) == 3
    assert set(warm.PENDING) == set(backward_specs())
    assert torch_ops.prepare_backward(q, k, k, True, 0.1) == 0  # the next steps: one lookup
    # the backward loads its three kernels from the workers' cubins; nothing compiles here
    kernels = backward.backward_kernels(HOPPER, 0, 128, True, True)
    assert hopper_state == [_warm_fake.cubin_of(s) for s in backward_specs()]
    assert kernels.config == configs.backward_config(HOPPER, 128, True)
    assert _warm_fake.compiles(workers) == sorted(BACKWARD_OPERATIONS)


def test_a_variant_prepares_its_own_kernels(workers, hopper_state, monkeypatch):
    torch_ops = torch_ops_fresh(monkeypatch)
    q = tensor((1, 4096, 4, 64))
    # a window whose sides bound the problem: the window kernel of the causal config
    assert torch_ops.prepare_backward(q, q, q, False, 0.1, (256, 0)) == 3
    main = [s for s in warm.PENDING if s.operation == "backward"]
    assert len(main) == 1 and main[0].window and not main[0].causal
    config, spec = backward.backward_specs(HOPPER, 227 * 1024, 64, True, True, window=True)
    assert main == [spec]
    # packed sequences: the varlen builds of the mma.sync backward
    packed = tensor((4096, 4, 64))
    assert torch_ops.prepare_backward(packed, packed, packed, True, 0.1, max_seqlens=(1024, 1024)) == 3
    packed = [s for s in warm.PENDING if s.varlen]
    assert sorted(s.operation for s in packed) == sorted(BACKWARD_OPERATIONS)
    assert packed[0].family == "sm80bwd"
    for spec in list(warm.PENDING):
        warm.entry_of(spec)


def test_the_forward_op_prepares_the_backward_before_it_runs(monkeypatch):
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    calls = []
    monkeypatch.setattr(torch_ops, "prepare_backward", lambda *args: calls.append(("prepare", args[3])))

    def run_forward(q, k, v, causal, scale, *variant):
        calls.append(("forward", causal))
        return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

    monkeypatch.setattr(torch_ops, "run_forward", run_forward)
    q = torch.randn(1, 16, 2, 64, dtype=torch.float16, requires_grad=True)
    torch_ops.flash_attention_forward(q, q, q, True, 0.125)
    assert calls == [("prepare", True), ("forward", True)]


def test_loaded_kernels_take_the_pending_compile(workers, hopper_state):
    spec = backward_specs()[0]
    assert warm.start([spec], "backward", "the test") == 1
    with device.GPU.lock:
        kernel, name = forward.loaded_kernel(spec)
    assert name == "backward_prep_entry" and hopper_state == [_warm_fake.cubin_of(spec)]


def test_a_hung_worker_is_waited_for_a_while_only(workers, monkeypatch):
    monkeypatch.setenv("WARM_FAKE_SLEEP", "3")
    monkeypatch.setattr(warm, "WAIT_S", 0.2)
    spec = backward_specs()[0]
    assert warm.start([spec], "backward", "the test") == 1
    with pytest.raises(RuntimeError, match="the real compile error"):
        warm.entry_of(spec)
    assert not warm.PENDING


def test_processes_sharing_the_cache_compile_a_kernel_once(workers, monkeypatch):
    """Two processes' workers on one kernel at once (as two ranks of a job): one compiles, the
    other waits on the kernel's lock file, then loads the entry the first stored."""
    monkeypatch.setenv("WARM_FAKE_SLEEP", "1")
    spec = backward_specs()[0]
    futures = [concurrent.futures.Future() for _ in range(2)]
    threads = [threading.Thread(target=warm._run_worker, args=([spec], [f], _warm_fake.compile_cached))
               for f in futures]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [f.result().cubin for f in futures] == [_warm_fake.cubin_of(spec)] * 2
    assert _warm_fake.compiles(workers) == ["backward_prep"]
