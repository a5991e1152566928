"""A Hopper forward captured in a CUDA graph keeps its tensor maps (``runtime/map_slots.py``):
after more operand layouts than the eager ring holds have passed through it, a replay still
reads the graph's own q, k, v and writes its own out.

Two paths into the capture: the layout was warmed up eagerly first, as torch's docs prescribe
(the capture hits a ring slot and pins it), or it was not (the capture misses and gets a slot of
its own; with no spare slot left, so that the slots grow under torch's global-mode capture).
Needs an sm_90 GPU and torch with CUDA; about 270 small eager forwards a case.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the CUDA-graph test needs it")

import numbaflash  # noqa: E402
from numbaflash.runtime import map_slots as ms  # noqa: E402
from numbaflash.tools.reference import compare_with_reference  # noqa: E402

pytestmark = pytest.mark.hopper

# (batch, seqlen, heads, head_dim), fp16, d128 (the Hopper kernel); one shape a case, so that
# the second case's layout is new even where the allocator hands out the first case's pointers.
SHAPES = {True: (1, 256, 2, 128), False: (1, 320, 2, 128)}
CHURN_ROWS = 16  # seqlen of each eager layout that passes through the ring


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA: the CUDA-graph test needs a CUDA build of torch")
    return torch.device("cuda")


def slots_of_this_device() -> ms.MapSlots:
    return ms.map_slots(torch.cuda.current_device())


def churn(pool: torch.Tensor, count: int, start: int = 0) -> None:
    """``count`` eager forwards, each on a new layout (q, k, v: a window of ``pool`` one row
    further on, so each call needs new tensor maps)."""
    for i in range(start, start + count):
        window = pool[:, i:i + CHURN_ROWS]
        numbaflash.flash_attention(window, window, window, causal=True)


@pytest.mark.parametrize("warm", [True, False], ids=["ring-slot-pinned", "own-slot"])
def test_a_replay_after_the_ring_turned_over_reads_its_own_operands(cuda, warm):
    shape = SHAPES[warm]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).half() for _ in range(3))
    out = torch.empty_like(q)
    pool = torch.randn((1, CHURN_ROWS + ms.SLOTS + 20, 1, 128), device="cuda", generator=gen).half()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles or loads the kernel: never inside the capture
        if warm:
            numbaflash.flash_attention(q, k, v, causal=True, out=out)
        else:
            churn(pool, 1, start=ms.SLOTS + 12)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    slots = slots_of_this_device()
    held_before = len(slots.pinned) + len(slots.captured)
    if not warm:
        with slots.lock:
            slots.free.clear()  # never-used slots, dropped: the capture's miss must allocate

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        numbaflash.flash_attention(q, k, v, causal=True, out=out)
    assert len(slots.pinned) + len(slots.captured) == held_before + 1, "the capture pinned no slot"

    churn(pool, ms.SLOTS + 10)  # every ring slot evicted and rewritten at least once
    torch.cuda.synchronize()

    for seed in (6, 7):
        gen.manual_seed(seed)
        with torch.no_grad():
            for x in (q, k, v):
                x.copy_(torch.randn(shape, device="cuda", generator=gen).half())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _, problems = compare_with_reference(*(x.cpu().numpy() for x in (q, k, v)), out.cpu().numpy(),
                                             causal=True)
        assert not problems, "; ".join(problems)
        assert torch.equal(out, numbaflash.flash_attention(q, k, v, causal=True))
