"""The Hopper kernel's pieces that are plain arithmetic, run on CPU: the mbarrier ring steps
(``kernels.ring``, through the device functions' Python bodies, against a model of an mbarrier's
phases) and the shared-memory and barrier layouts that ``WsConfig`` computes once for the
kernel and for ``shared_bytes``."""

from __future__ import annotations

import itertools
import random

import pytest

from numbaflash import configs
from numbaflash.kernels.ring import RingBarriers, make_ring
from numbaflash.kernels.shapes import MBARRIER_BYTES, SMEM_ALIGN, WARPGROUP_ROWS, WsConfig


def py(ring):
    """The ring's steps as plain Python functions (the device functions' bodies)."""
    return {name: getattr(step, "py_func", step) for name, step in ring._asdict().items()}


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_ring_slots_rounds_and_addresses(stages):
    r = py(make_ring(stages, 1000))
    bars = RingBarriers(full=4096, empty=4096 + 8 * stages)
    for i in range(5 * stages):
        s = r["slot"](i)
        assert s == i % stages and r["parity"](i) == (i // stages) % 2
        assert r["full"](bars, s) == 4096 + MBARRIER_BYTES * s
        assert r["empty"](bars, s) == 4096 + MBARRIER_BYTES * (stages + s)
        assert r["offset"](s) == 1000 * s
        assert r["advance"](i, 3) == i + 3
    # the stages of one ring's full barriers never reach its empty ones
    fulls = {r["full"](bars, s) for s in range(stages)}
    assert fulls.isdisjoint({r["empty"](bars, s) for s in range(stages)})


class Mbarrier:
    """An mbarrier's phases: ``completed`` phases so far, one per ``count`` arrivals. A wait
    for parity p passes once the phase of that parity has completed, i.e. while the phase in
    progress has the other parity (a fresh barrier passes a wait for parity 1)."""

    def __init__(self, count):
        self.count, self.arrivals, self.completed = count, 0, 0

    def arrive(self):
        self.arrivals += 1
        if self.arrivals == self.count:
            self.arrivals, self.completed = 0, self.completed + 1

    def passes(self, parity):
        return self.completed % 2 != parity


@pytest.mark.parametrize(("stages", "consumers", "seed"),
                         list(itertools.product([1, 2, 3, 4], [1, 3], range(3))))
def test_ring_protocol_never_overwrites_or_reads_early(stages, consumers, seed):
    """A producer and ``consumers`` warps, interleaved at random, go through 40 uses of a ring
    by its steps' arithmetic (wait_full / wait_empty parities, slots): the producer fills a
    stage only after every consumer has released its previous round, each consumer reads use
    i only after it has landed, and nobody deadlocks."""
    r = py(make_ring(stages, 0))
    full = [Mbarrier(1) for _ in range(stages)]
    empty = [Mbarrier(consumers) for _ in range(stages)]
    holds = [None] * stages  # the use a stage holds
    uses = 40
    produced, consumed = 0, [0] * consumers
    rng = random.Random(seed)
    while min(consumed) < uses:
        movers = []
        i = produced
        if i < uses and empty[r["slot"](i)].passes(r["parity"](i) ^ 1):  # wait_empty
            movers.append(("producer", None))
        for c in range(consumers):
            j = consumed[c]
            if j < produced and full[r["slot"](j)].passes(r["parity"](j)):  # wait_full
                movers.append(("consumer", c))
        assert movers, "deadlock"
        who, c = rng.choice(movers)
        if who == "producer":
            s = r["slot"](i)
            assert holds[s] is None or all(done > holds[s] for done in consumed), "overwrote a stage in use"
            holds[s] = i
            full[s].arrive()  # arm + the copy's completion
            produced += 1
        else:
            j = consumed[c]
            assert holds[r["slot"](j)] == j, "read a stage before its use landed"
            empty[r["slot"](j)].arrive()  # release
            consumed[c] += 1


# Every tile size (head dim x block_n) with the plain rings, every ring arrangement (stages,
# consumers, Q buffers, O in the Q buffer or the V ring) at one tile size, and
# every config autotune tries or the table ships: not their whole product.
_RINGS = [(s, c, qs, oq, ov) for s, c, qs, oq, ov in itertools.product((2, 3), (2, 3), (1, 2), (False, True),
                                                                        (False, True))
          if not (oq and qs != 1) and not (ov and (oq or c != 2))]
CONFIGS = list(dict.fromkeys(
    [WsConfig(d, n) for d in (64, 96, 128, 256) for n in (64, 128, 176)]
    + [WsConfig(64, 64, s, c, q_stages=qs, o_in_q=oq, o_in_v=ov) for s, c, qs, oq, ov in _RINGS]
    + [c for cands in configs.CANDIDATES.values() for c in cands if isinstance(c, WsConfig)]
    + [c for _, _, _, c in configs.shipped_configs() if isinstance(c, WsConfig)]
    + list(configs.ASYMMETRIC_WS_DEFAULTS.values())))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_shared_layout_tiles_are_aligned_and_disjoint(config):
    t = config.tile_bytes
    at = config.shared_layout
    assert config.shared_bytes == at.end + SMEM_ALIGN
    assert config.shared_bytes == config.q_stages * t["q"] + config.stages * (t["k"] + t["v"]) + t["o"] + 1024
    regions = [("q", at.q, config.q_stages * t["q"]), ("k", at.k, config.stages * t["k"]),
               ("v", at.v, config.stages * t["v"])]
    if not config.o_in_q and not config.o_in_v:
        regions.append(("o", at.o, t["o"]))
    for _, start, size in regions:
        assert start % 1024 == 0 and start + size <= at.end  # swizzle atoms: 1024-aligned
    for (_, a, n), (_, b, m) in itertools.combinations(regions, 2):
        assert a + n <= b or b + m <= a
    if config.o_in_v:  # O staged at the start of the V ring, which holds its rows
        assert at.o == at.v and config.block_m * config.value_dim * 2 <= config.stages * t["v"]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_barrier_layout_one_word_each(config):
    at = config.barrier_layout
    q, kv = config.q_stages, config.stages
    words = []
    for ring, stages in ((at.q_full, q), (at.q_empty, q), (at.k_full, kv), (at.k_empty, kv), (at.v_full, kv),
                         (at.v_empty, kv)):
        words += [ring + MBARRIER_BYTES * s for s in range(stages)]
    words.append(at.o_empty)
    assert sorted(words) == [MBARRIER_BYTES * w for w in range(at.words)]  # every word once, no gap
    assert at.q_full == 0  # the kernel keeps the array's own address for it


def test_block_rows_are_warpgroups():
    assert WsConfig(64, consumers=3).block_m == 3 * WARPGROUP_ROWS
    assert WsConfig(128).block_m == 2 * WARPGROUP_ROWS
