"""A first training step on a GPU from an empty cache (issue 55): the forward's inputs require grad,
so the backward's three kernels compile in worker processes while the forward's compiles in the
caller's (``operations.warm``), and the backward loads them: the caller compiles the forward's
kernel only. Runs ``benchmarks/first_step.py --gpu`` (fresh processes, empty caches, gradients
checked against SDPA) and prints its figures."""

from __future__ import annotations

import os
import types

import pytest
from _benchmarks import load_benchmark

GRAD_TOLERANCE = 0.1  # bf16 gradients of unit-normal inputs at 1k, against SDPA in float32


@pytest.mark.gpu
def test_first_step_compiles_the_backward_in_worker_processes():
    pytest.importorskip("torch")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the backward's kernels compile in the foreground")
    first_step = load_benchmark("first_step")
    args = types.SimpleNamespace(arch="", head_dim=128, full=False, dtype="bfloat16", cpus=None, workers=None,
                                 gpu=True)
    serial, background = (first_step.run_child(mode, args) for mode in first_step.MODES)
    print(f"\n{serial['forward']}: first step {serial['step_s']:.1f} s serial, {background['step_s']:.1f} s "
          f"with the backward in workers (forward {serial['forward_s']:.1f} / "
          f"{background['forward_s']:.1f} s)")
    assert serial["foreground_compiles"] == 4  # forward, prepare, main, dQ
    assert background["foreground_compiles"] == 1  # the forward's; the workers compiled the backward's
    for r in (serial, background):
        assert r["grad_error"] < GRAD_TOLERANCE
