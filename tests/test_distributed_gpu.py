"""Context parallelism on GPUs with numbaflash's kernels (issue 59's exactness point): ring
attention (zigzag, contiguous, stripe; causal or not; GQA; windows; softcap; packed sequences)
and the all-to-all, forward and backward, against the float64 attention of the gathered
sequence by FlashAttention's criterion, beside the single-GPU call's own error.

With two or more GPUs the ranks are one a GPU on NCCL (all the GPUs, so the same file runs any
world size); on one GPU two ranks share it over gloo (tensors staged through the host): the
schedule and the kernels are the same, the transport is not. Each rank writes its table to
``$NUMBAFLASH_DISTRIBUTED_LOG`` (a folder; default the test's tmp folder)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from _distributed_cases import gpu_worker  # noqa: E402


def _run(tmp_path, world: int, backend: str) -> None:
    out_dir = os.environ.get("NUMBAFLASH_DISTRIBUTED_LOG", str(tmp_path))
    os.makedirs(out_dir, exist_ok=True)
    mp.spawn(gpu_worker, args=(world, str(tmp_path / "init"), backend, out_dir), nprocs=world)
    for r in range(world):
        with open(os.path.join(out_dir, f"gpu_rank{r}.txt")) as f:
            assert f.read().count("\n") >= 12


@pytest.mark.gpu
def test_context_parallel_on_every_gpu(tmp_path):
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(
            f"NCCL context parallelism needs 2 GPUs, this machine has {count} "
            "(test_context_parallel_ranks_sharing_one_gpu covers one)"
        )
    _run(tmp_path, count, "nccl")


@pytest.mark.gpu
def test_context_parallel_ranks_sharing_one_gpu(tmp_path):
    _run(tmp_path, 2, "gloo")
