"""Where a rank's tokens sit in the gathered sequence, and which attention calls one ring step needs.

Pure Python (no torch, no GPU): the context-parallel code and its CPU tests share it.

**Layouts.** A sequence of ``seqlen`` tokens is split over ``world`` ranks. A rank holds one or
more *segments*: runs of tokens at global positions ``start + stride * i`` for ``i`` in
``range(length)``, stored one after another in the rank's local tensor.

- ``"contiguous"``: rank r holds tokens ``[r*L, (r+1)*L)``, ``L = seqlen / world``.
- ``"zigzag"``: the sequence is cut into ``2*world`` chunks of ``c = seqlen / (2*world)``; rank r
  holds chunk r and chunk ``2*world - 1 - r``. Under a causal mask every rank then has the same
  work (ring-flash-attention's load balance).
- ``"stripe"``: rank r holds tokens ``r, r + world, r + 2*world, ...`` (stride ``world``).

**Masks.** Attention over the gathered sequence uses FlashAttention's window rule with
seqlen_q = seqlen_k: query at global position p sees the key at global position t iff
``p - left <= t <= p + right`` (-1 unbounded; causal sets right to 0). On one pair of segments of
equal stride this is a *band* on local diagonals ``lo <= j - i <= hi`` (i the query's local
index, j the key's), and a band on a rectangle is exactly what one kernel call can mask once the
rows that see nothing and the keys nobody sees are sliced away (``slice_band``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

LAYOUTS = ("zigzag", "contiguous", "stripe")
_INF = float("inf")


@dataclass(frozen=True)
class Segment:
    """``length`` tokens at global positions ``start + stride * i``, i in ``range(length)``."""

    start: int
    length: int
    stride: int = 1

    def positions(self) -> list[int]:
        return [self.start + self.stride * i for i in range(self.length)]


@dataclass(frozen=True)
class BlockCall:
    """One attention call of a ring step: local query rows ``[q_lo, q_hi)`` against local key
    rows ``[k_lo, k_hi)``, masked by (``causal``, ``window``) in FlashAttention's bottom-right
    convention on the sliced shapes. Every query row of the slice sees at least one key."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    window: tuple[int, int]

    @property
    def mask_key(self) -> tuple[bool, tuple[int, int]]:
        return self.causal, self.window


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def divisor(layout: str, world: int) -> int:
    """What a sequence's length must be a multiple of to shard it over ``world`` ranks."""
    return 2 * world if check_layout(layout) == "zigzag" else world


def segments(layout: str, seqlen: int, world: int, rank: int) -> list[Segment]:
    """The segments rank ``rank`` of ``world`` holds of a ``seqlen``-token sequence, in the order
    they are stored locally."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, world) with world >= 1, got rank {rank}, world {world}")
    d = divisor(layout, world)
    if seqlen < d or seqlen % d:
        raise ValueError(
            f"the {layout} layout over {world} ranks needs a sequence length that is a positive "
            f"multiple of {d}, got {seqlen}"
        )
    if layout == "contiguous":
        n = seqlen // world
        return [Segment(rank * n, n)]
    if layout == "zigzag":
        c = seqlen // (2 * world)
        return [Segment(rank * c, c), Segment((2 * world - 1 - rank) * c, c)]
    return [Segment(rank, seqlen // world, world)]


def positions(layout: str, seqlen: int, world: int, rank: int) -> list[int]:
    """The global positions of rank ``rank``'s tokens, in local order (e.g. for rotary
    embeddings of a shard)."""
    return [p for s in segments(layout, seqlen, world, rank) for p in s.positions()]


def _floor_div(a: float, b: int) -> float:
    return a if a in (_INF, -_INF) else a // b


def _ceil_div(a: float, b: int) -> float:
    return a if a in (_INF, -_INF) else -((-a) // b)


def global_window(causal: bool, window: tuple[int, int]) -> tuple[float, float]:
    """(left, right) of the gathered sequence's mask as distances (inf: unbounded)."""
    left = _INF if window[0] < 0 else window[0]
    right = _INF if window[1] < 0 else window[1]
    if causal:
        right = min(right, 0)
    return left, right


def pair_band(qs: Segment, ks: Segment, left: float, right: float) -> tuple[float, float]:
    """The band ``lo <= j - i <= hi`` (local indices) that the global mask draws on a pair of
    segments of equal stride."""
    if qs.stride != ks.stride:
        raise ValueError(f"segments of different strides ({qs.stride}, {ks.stride})")
    delta = ks.start - qs.start  # t - p = stride * (j - i) + delta
    return _ceil_div(-left - delta, qs.stride), _floor_div(right - delta, qs.stride)


def _clip(lo: float, hi: float, rows: int, cols: int) -> tuple[float, float] | None:
    """The band's diagonals present in a rows x cols rectangle (None: no cell)."""
    a, b = max(lo, -(rows - 1)), min(hi, cols - 1)
    return (a, b) if a <= b else None


def slice_band(lo: float, hi: float, rows: int, cols: int) -> BlockCall | None:
    """The call that masks band [lo, hi] on a rows x cols rectangle: the rows that see some key and
    the keys some row sees, and the window that draws the band in bottom-right convention on
    those slices. None when no cell is in the band."""
    if lo > hi:
        return None
    q_lo = 0 if hi == _INF else max(0, -hi)
    q_hi = rows if lo == -_INF else min(rows, cols - lo)
    if q_lo >= q_hi:
        return None
    k_lo = 0 if lo == -_INF else max(0, q_lo + lo)
    k_hi = cols if hi == _INF else min(cols, q_hi + hi)
    if k_lo >= k_hi:
        return None
    q_lo, q_hi, k_lo, k_hi = int(q_lo), int(q_hi), int(k_lo), int(k_hi)
    nq, nk = q_hi - q_lo, k_hi - k_lo
    shift = nk - nq  # the kernel's diagonal: query i's last key is i + shift + right
    lo2, hi2 = lo + q_lo - k_lo, hi + q_lo - k_lo  # the band in sliced indices
    # unbounded where the band already covers every diagonal of the slice
    left = -1 if lo2 <= -(nq - 1) else int(shift - lo2)
    right = -1 if hi2 >= nk - 1 else int(hi2 - shift)
    assert left != -1 or lo2 <= -(nq - 1)
    assert left >= -1 and right >= -1, (lo, hi, rows, cols)
    if right == 0 and left == -1:
        return BlockCall(q_lo, q_hi, k_lo, k_hi, True, (-1, -1))
    return BlockCall(q_lo, q_hi, k_lo, k_hi, False, (left, right))


def _group_calls(
    q_segs: list[Segment],
    k_segs: list[Segment],
    q_groups: list[range],
    k_groups: list[range],
    left: float,
    right: float,
) -> list[BlockCall] | None:
    """Calls for one grouping of the segments (each group a run of consecutive local segments),
    or None when some pair of groups draws a mask that is not one band."""
    q_off = [sum(s.length for s in q_segs[:i]) for i in range(len(q_segs) + 1)]
    k_off = [sum(s.length for s in k_segs[:i]) for i in range(len(k_segs) + 1)]
    calls = []
    for qg, kg in product(q_groups, k_groups):
        pairs = []  # (row offset, col offset, rows, cols, clipped band) in group coordinates
        for a, b in product(qg, kg):
            lo, hi = pair_band(q_segs[a], k_segs[b], left, right)
            rows, cols = q_segs[a].length, k_segs[b].length
            pairs.append(
                (
                    q_off[a] - q_off[qg[0]],
                    k_off[b] - k_off[kg[0]],
                    rows,
                    cols,
                    _clip(lo, hi, rows, cols),
                    lo,
                    hi,
                )
            )
        if all(p[4] is None for p in pairs):
            continue
        # the group's band, in group coordinates, must draw every pair's clipped band
        los = {-_INF} | {p[5] + p[1] - p[0] for p in pairs if p[4] is not None}
        his = {_INF} | {p[6] + p[1] - p[0] for p in pairs if p[4] is not None}
        found = None
        for glo, ghi in product(sorted(los), sorted(his)):
            if all(
                _clip(glo - ko + ro, ghi - ko + ro, rows, cols) == clipped
                for ro, ko, rows, cols, clipped, _, _ in pairs
            ):
                found = (glo, ghi)
                break
        if found is None:
            return None
        call = slice_band(
            found[0], found[1], q_off[qg[-1] + 1] - q_off[qg[0]], k_off[kg[-1] + 1] - k_off[kg[0]]
        )
        if call is not None:
            qb, kb = q_off[qg[0]], k_off[kg[0]]
            calls.append(
                BlockCall(
                    call.q_lo + qb, call.q_hi + qb, call.k_lo + kb, call.k_hi + kb, call.causal, call.window
                )
            )
    return calls


def plan_step(
    q_segs: list[Segment], k_segs: list[Segment], causal: bool, window: tuple[int, int] = (-1, -1)
) -> list[BlockCall]:
    """The fewest kernel calls that compute attention of the local queries (``q_segs``) over one
    rank's keys (``k_segs``) under the gathered sequence's mask. Each call covers either all local
    rows or one segment's, on each side; no two calls share a (query, key) cell, and the calls
    together cover exactly the cells the mask lets through."""
    left, right = global_window(causal, window)
    whole_q, each_q = [range(len(q_segs))], [range(i, i + 1) for i in range(len(q_segs))]
    whole_k, each_k = [range(len(k_segs))], [range(i, i + 1) for i in range(len(k_segs))]
    best = None
    for qg, kg in ((whole_q, whole_k), (whole_q, each_k), (each_q, whole_k), (each_q, each_k)):
        calls = _group_calls(q_segs, k_segs, qg, kg, left, right)
        if calls is not None and (best is None or len(calls) < len(best)):
            best = calls
    assert best is not None  # one segment pair is always one band
    return best


def visible(p: int, t: int, causal: bool, window: tuple[int, int]) -> bool:
    """Whether the query at global position p sees the key at global position t."""
    left, right = global_window(causal, window)
    return p - left <= t <= p + right


def call_mask(call: BlockCall, rows: int, cols: int) -> set[tuple[int, int]]:
    """The (local row, local col) cells a call lets through, by FlashAttention's rule on its
    sliced shapes (for tests)."""
    nq, nk = call.q_hi - call.q_lo, call.k_hi - call.k_lo
    left, right = call.window
    if call.causal:
        right = 0
    cells = set()
    for i in range(nq):
        for j in range(nk):
            if (left < 0 or j >= i + nk - nq - left) and (right < 0 or j <= i + nk - nq + right):
                cells.add((call.q_lo + i, call.k_lo + j))
    return cells
