"""The self-test's decode cases (``python -m numbaflash.selftest --decode``): random
``flash_attention_with_kvcache`` calls against float64, each drawn from (seed, index) alone.

A case is a batch of sequences, each with its own cache length (0 to the cache's room, empty and
full ones included), new rows appended or not, contiguous or paged (any page size, pages
shuffled), GQA, seqlen_q 1 to 16, causal or not, a sliding window and a softcap in a share of
them, a learnable sink in another (``selftest_common.draw_sink``), ``cache_batch_idx`` (a cache of
more rows than sequences, the rows shuffled) and ``cache_leftpad`` in another
(``draw_cache_options``), the rotary embedding (``draw_rotary``, with new rows), an automatic or
a forced split count, the LSE, a given out. Every cache
row the call must not read (past each sequence's length, before its left padding, the rows and
pages no sequence uses) is NaN, so a kernel that lets one reach its output fails. Checks: each
sequence against float64 on its own keys (``compare_varlen_with_reference``: FlashAttention's
criterion), the new rows in the cache bit for bit (rotated ones: within a rounding of the dtype,
the rotation's float32 arithmetic may be contracted differently) and nothing else changed, a given
out returned.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from ..configs import DECODE_HEAD_DIM_PAIRS, MLA_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from .reference import compare_varlen_with_reference, rotary_embedding, rotary_query_step
from .selftest_common import (
    DTYPE_NAMES,
    GROUPS,
    CaseResult,
    cuda_torch,
    draw_sink,
    draw_value_dims,
    draw_window_softcap,
    kind_note,
    log_uniform,
    numpy_dtype,
    to_device,
    to_host,
)

# (longest cache, cap on batch * heads_q * seqlen_q * keys: the float64 reference's cost)
DECODE_LIMITS = {False: (4096, 2 * 10**7), True: (600, 2 * 10**6)}
PAGE_SIZES = (1, 7, 16, 64, 100, 256)
DECODE_WINDOW_SOFTCAP_SHARE = 0.35
DECODE_KINDS = ("torch", "numba")
DECODE_SINK_SHARE, DECODE_SINK_SHARE_VARIANTS = 0.15, 1 / 3  # cases with a learnable sink
DECODE_CACHE_OPTION_SHARE = 0.25  # cases with cache_batch_idx, cache_leftpad or both (a third each)
DECODE_ROTARY_SHARE = 0.4  # of the cases with new rows: a rotary embedding
DECODE_VALUE_DIM_SHARE = 0.15  # a pair of head dims (``configs.DECODE_HEAD_DIM_PAIRS``) in place of head_dim
DECODE_MLA_SHARE = 0.1  # MLA decode (``flash_mla_with_kvcache``) in place of the KV-cache call
MLA_HEADS = (1, 5, 16, 32, 64, 128)  # its query heads


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode problem; everything, data included, follows from (seed, index)."""

    seed: int
    index: int
    head_dim: int
    causal: bool
    dtype: str
    seqlen_q: int
    heads_q: int
    heads_kv: int
    capacity: int  # rows a sequence's cache holds (contiguous), or max_pages * page_size (paged)
    cache_seqlens: tuple[int, ...]  # one per sequence: its cached rows before the call
    seqlen_new: int  # rows of k_new / v_new appended (0: none given)
    page_size: int  # 0: a contiguous cache
    num_splits: int  # 0: automatic
    kind: str  # "torch" | "numba"
    amplitude: float  # q, k_cache and k_new are scaled by it
    softmax_scale: float | None
    return_lse: bool
    use_out: bool
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    family: str = "decode"
    # A learnable sink (issue 56): the float32 logits of each query head, () for none; drawn from a
    # stream of its own (``selftest_common.draw_sink``), so every other field is as before.
    sink: tuple[float, ...] = ()
    # The KV-cache call's options (issue 56): each sequence's cache row (a permutation of more rows
    # than sequences) and where its keys start (0 .. its cache_seqlens), () for none; drawn from a
    # stream of their own (``draw_cache_options``).
    cache_batch_idx: tuple[int, ...] = ()
    cache_leftpad: tuple[int, ...] = ()
    # The rotary embedding (issue 56; ``draw_rotary``, a stream of its own): 0 none, 1 halves, 2
    # interleaved, and its dim.
    rotary: int = 0
    rotary_dim: int = 0
    # A pair of head dims (q's and k's, v's and out's; ``configs.ASYMMETRIC_HEAD_DIMS``) run in
    # place of ``head_dim``, () for none; drawn from a stream of its own (``draw_value_dims``, 28).
    value_dims: tuple[int, ...] = ()
    # MLA decode (issue 58; ``draw_mla``, a stream of its own): ``flash_mla_with_kvcache`` on a latent
    # cache (one KV head of ``configs.MLA_HEAD_DIMS``, V its first columns), no new rows or options.
    mla: bool = False

    @property
    def dims(self) -> tuple[int, int]:
        """(q's and k's head dim, v's and out's)."""
        if self.mla:
            return MLA_HEAD_DIMS
        return self.value_dims if self.value_dims else (self.head_dim, self.head_dim)

    @property
    def batch(self) -> int:
        return len(self.cache_seqlens)

    @property
    def cache_batch(self) -> int:
        """Rows of the cache (contiguous) or of the block table (paged)."""
        return max(self.cache_batch_idx) + 1 if self.cache_batch_idx else self.batch

    def row_of(self, b: int) -> int:
        """The cache's row (or the block table's) that sequence b uses."""
        return self.cache_batch_idx[b] if self.cache_batch_idx else b

    def start_of(self, b: int) -> int:
        """The cache row where sequence b's keys start."""
        return self.cache_leftpad[b] if self.cache_leftpad else 0

    @property
    def varlen(self) -> bool:  # the summary's counters
        return False

    @property
    def keys(self) -> tuple[int, ...]:
        """Each sequence's keys: its cached rows (past its left padding) and the new ones."""
        return tuple(n - self.start_of(b) + self.seqlen_new for b, n in enumerate(self.cache_seqlens))

    def describe(self) -> str:
        scale = "default" if self.softmax_scale is None else f"{self.softmax_scale:.4g}"
        cache = f"paged{self.page_size}" if self.page_size else "contiguous"
        d, dv = self.dims
        dims = f"d{d}v{dv}" if dv != d else f"d{d}"
        call = "mla" if self.mla else "decode"
        return (f"{call} {dims} {'causal' if self.causal else 'full'} {self.dtype} "
                f"b{self.batch} sq{self.seqlen_q} h{self.heads_q}/{self.heads_kv} {cache} "
                f"capacity{self.capacity} cache_seqlens={','.join(map(str, self.cache_seqlens))} "
                f"new{self.seqlen_new} splits={self.num_splits or 'auto'} {self.kind} "
                f"amp{self.amplitude:.3g} scale={scale} lse={int(self.return_lse)} out={int(self.use_out)}"
                + (f" window={self.window_size}" if self.window_size != (-1, -1) else "")
                + (f" softcap={self.softcap:g}" if self.softcap else "")
                + (f" sink={','.join(f'{x:.3g}' for x in self.sink)}" if self.sink else "")
                + "".join(f" {name}={','.join(map(str, values))}" for name, values in
                          (("cache_batch_idx", self.cache_batch_idx), ("cache_leftpad", self.cache_leftpad))
                          if values)
                + (f" rotary={('halves', 'interleaved')[self.rotary - 1]}{self.rotary_dim}"
                   if self.rotary else ""))


def draw_rotary(seed: int, index: int, head_dim: int, seqlen_new: int,
                share: float = DECODE_ROTARY_SHARE) -> tuple[int, int]:
    """(rotary, rotary_dim) of a case, (0, 0) for none, from a stream of its own (25): in ``share``
    of the cases with new rows, halves or interleaved, a multiple of 16 up to head_dim."""
    rng = np.random.default_rng([seed, index, 25])
    if not seqlen_new or rng.random() >= share:
        return 0, 0
    return int(rng.integers(1, 3)), 16 * int(rng.integers(1, head_dim // 16 + 1))


def draw_cache_options(seed: int, index: int, cache_seqlens: list[int],
                       share: float = DECODE_CACHE_OPTION_SHARE) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(cache_batch_idx, cache_leftpad) of a case, () each for none, from a stream of its own (24): in
    ``share`` of the cases one of them or both. cache_batch_idx: the first batch of a shuffle of
    batch + 0..2 rows; cache_leftpad: each sequence's 0, its whole cache or a random row of it."""
    rng = np.random.default_rng([seed, index, 24])
    if rng.random() >= share:
        return (), ()
    which = int(rng.integers(0, 3))  # 0: cache_batch_idx, 1: cache_leftpad, 2: both
    batch = len(cache_seqlens)
    idx = pad = ()
    if which != 1:
        idx = tuple(int(x) for x in rng.permutation(batch + int(rng.integers(0, 3)))[:batch])
    if which != 0:
        pad = tuple(int(rng.choice([0, n, int(rng.integers(0, n + 1))])) for n in cache_seqlens)
    return idx, pad


def draw_decode_case(seed: int, index: int, quick: bool = False, variants: bool = False) -> DecodeCase:
    """The decode case ``index`` of run ``seed`` (pure, no GPU). Head dims, causality and dtypes
    cycle; ``variants``: every case has a window, a softcap or both (else
    ``DECODE_WINDOW_SOFTCAP_SHARE`` of them)."""
    combos = [(d, c, t) for d in SUPPORTED_HEAD_DIMS for c in (True, False) for t in DTYPE_NAMES]
    head_dim, causal, dtype = combos[(index + seed) % len(combos)]
    rng = np.random.default_rng([seed, index, 20])
    longest, cap = DECODE_LIMITS[quick]
    batch = int(rng.integers(1, 7))
    heads_kv = int(rng.integers(1, 3 if quick else 5))
    group = int(rng.choice(GROUPS))
    seqlen_q = int(rng.choice([1, 1, 1, 2, 3, 4, int(rng.integers(5, 17))]))
    capacity = log_uniform(rng, longest)
    page_size = int(rng.choice(PAGE_SIZES)) if rng.random() < 0.4 else 0
    if page_size:  # whole pages: the sequence's room
        capacity = max(1, -(-capacity // page_size)) * page_size
    seqlen_new = 0 if rng.random() < 0.5 else int(rng.integers(1, min(4, capacity) + 1))
    room = capacity - seqlen_new

    def length() -> int:
        pick = rng.choice(["empty", "full", "one", "any"], p=[0.1, 0.15, 0.1, 0.65])
        if pick == "empty":
            return 0
        if pick == "full":
            return room
        if pick == "one":
            return min(1, room)
        return int(rng.integers(0, room + 1))

    seqlens = [length() for _ in range(batch)]
    while batch * heads_kv * group * seqlen_q * max(1, capacity) > cap:  # the reference's budget
        if batch > 1:
            batch -= 1
            seqlens.pop()
        elif group > 1:
            group //= 2
        else:
            capacity = max(seqlen_new + 1, capacity // 2)
            if page_size:
                capacity = -(-capacity // page_size) * page_size
            room = capacity - seqlen_new
            seqlens = [min(n, room) for n in seqlens]
    big = rng.random() < 0.2
    amplitude = float(rng.uniform(5.0, 20.0)) if big else 1.0
    scale = float(rng.uniform(0.02, 0.3)) if rng.random() < 0.2 else None
    splits = 0 if rng.random() < 0.6 else int(rng.choice([1, 2, 3, 5, 8, 32]))
    share = 1.0 if variants else DECODE_WINDOW_SOFTCAP_SHARE
    window, softcap = draw_window_softcap(seed, index, seqlen_q, capacity, stream=21, share=share)
    kind = str(rng.choice(DECODE_KINDS, p=[0.7, 0.3]))
    sink_share = DECODE_SINK_SHARE_VARIANTS if variants else DECODE_SINK_SHARE
    sink = draw_sink(seed, index, heads_kv * group, sink_share, stream=23)
    idx, pad = draw_cache_options(seed, index, seqlens)
    rotary, rotary_dim = draw_rotary(seed, index, head_dim, seqlen_new)
    value_dims = draw_value_dims(seed, index, DECODE_VALUE_DIM_SHARE, stream=28, pairs=DECODE_HEAD_DIM_PAIRS)
    if value_dims:  # the rotary dim within q's and k's head dim
        rotary_dim = min(rotary_dim, value_dims[0])
    case = DecodeCase(seed, index, head_dim, causal, dtype, seqlen_q, heads_kv * group, heads_kv, capacity,
                      tuple(seqlens), seqlen_new, page_size, splits, kind, amplitude, scale,
                      bool(rng.random() < 0.5), bool(rng.random() < 0.3), window, softcap, sink=sink,
                      cache_batch_idx=idx, cache_leftpad=pad, rotary=rotary, rotary_dim=rotary_dim,
                      value_dims=value_dims)
    return case if variants else draw_mla(case, cap)


def draw_mla(case: DecodeCase, cap: int) -> DecodeCase:
    """``DECODE_MLA_SHARE`` of the cases (not of a ``variants`` run: MLA takes no window or softcap)
    become MLA decode, from a stream of their own (29): the
    case's lengths, cache, dtype, causality, seqlen_q, split count, scale and outputs, with one
    latent KV head and ``MLA_HEADS`` query heads, and nothing the MLA call does not take (new rows,
    window, softcap, sink, cache options, rotary, another pair). Batch, then heads, shrink to a
    quarter of the reference's budget ``cap`` (576 columns: about 4x a d128 key's cost)."""
    rng = np.random.default_rng([case.seed, case.index, 29])
    if rng.random() >= DECODE_MLA_SHARE:
        return case
    heads = int(rng.choice(MLA_HEADS))
    seqlens = list(case.cache_seqlens)
    while len(seqlens) * heads * case.seqlen_q * max(1, case.capacity) > cap // 4:
        if len(seqlens) > 1:
            seqlens.pop()
        elif heads > 1:
            heads //= 2
        else:
            break
    return dataclasses.replace(case, heads_q=heads, heads_kv=1, cache_seqlens=tuple(seqlens), seqlen_new=0,
                               window_size=(-1, -1), softcap=0.0, sink=(), cache_batch_idx=(),
                               cache_leftpad=(), rotary=0, rotary_dim=0, value_dims=(), mla=True)


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """A case's host arrays: q (batch, seqlen_q, heads_q, d); the caches as the call finds them
    (contiguous (cache_batch, capacity, heads_kv, d) or paged (num_pages, page_size, heads_kv, d),
    NaN wherever no sequence's keys lie); k_new / v_new (batch, seqlen_new, heads_kv, d) or None;
    the block table (cache_batch, max_pages) int32 or None; cache_seqlens int32 (batch,);
    cache_batch_idx and cache_leftpad int32 (batch,) or None; rotary_cos and rotary_sin (capacity +
    seqlen_q, rotary_dim / 2) of the case's dtype (RoPE angles) or None."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k_new: np.ndarray | None
    v_new: np.ndarray | None
    block_table: np.ndarray | None
    cache_seqlens: np.ndarray
    cache_batch_idx: np.ndarray | None = None
    cache_leftpad: np.ndarray | None = None
    rotary_cos: np.ndarray | None = None
    rotary_sin: np.ndarray | None = None


def cache_rows(case: DecodeCase, table: np.ndarray | None, b: int, first: int, stop: int) -> tuple:
    """Index of rows ``first`` .. ``stop`` - 1 of sequence b's cache (its cache row or block table
    row ``case.row_of(b)``) in a cache array (its leading two axes)."""
    j = np.arange(first, stop)
    row = case.row_of(b)
    if table is None:
        return np.full(j.shape, row), j
    return table[row, j // case.page_size], j % case.page_size


def make_decode_inputs(case: DecodeCase) -> DecodeInputs:
    """The case's arrays, from its own random stream (numpy, the case's dtype)."""
    rng = np.random.default_rng([case.seed, case.index, 22])
    dtype = numpy_dtype(case.dtype)
    b, hkv = case.batch, case.heads_kv
    d, dv = case.dims
    rows = case.cache_batch
    table = None
    if case.page_size:
        per_seq = case.capacity // case.page_size
        pages = rows * per_seq + int(rng.integers(0, 4))  # some pages no sequence owns
        table = rng.permutation(pages)[:rows * per_seq].reshape(rows, per_seq).astype(np.int32)
        lead = (pages, case.page_size)
    else:
        lead = (rows, case.capacity)
    k_cache = np.full((*lead, hkv, d), np.nan)
    v_cache = np.full((*lead, hkv, dv), np.nan)
    for s, n in enumerate(case.cache_seqlens):
        # the rows before the left padding stay NaN (rows 0 .. n drawn as ever: the data of a case
        # without options is as before)
        where = cache_rows(case, table, s, 0, n)
        keys = rng.standard_normal((n, hkv, d)) * case.amplitude
        values = keys[..., :dv] if case.mla else rng.standard_normal((n, hkv, dv))  # MLA: V in K
        start = case.start_of(s)
        k_cache[where[0][start:], where[1][start:]] = keys[start:]
        v_cache[where[0][start:], where[1][start:]] = values[start:]
    q = rng.standard_normal((b, case.seqlen_q, case.heads_q, d)) * case.amplitude
    k_new = v_new = None
    if case.seqlen_new:
        k_new = (rng.standard_normal((b, case.seqlen_new, hkv, d)) * case.amplitude).astype(dtype)
        v_new = rng.standard_normal((b, case.seqlen_new, hkv, dv)).astype(dtype)
    index = {name: np.asarray(values, np.int32) if values else None for name, values in
             (("cache_batch_idx", case.cache_batch_idx), ("cache_leftpad", case.cache_leftpad))}
    if case.rotary:  # RoPE angles of every position the cache holds, and a query's past it
        angle = np.arange(case.capacity + case.seqlen_q)[:, None] / 10000.0 ** (
            np.arange(case.rotary_dim // 2) * 2 / case.rotary_dim)[None, :]
        index.update(rotary_cos=np.cos(angle).astype(dtype), rotary_sin=np.sin(angle).astype(dtype))
    return DecodeInputs(q.astype(dtype), k_cache.astype(dtype), v_cache.astype(dtype), k_new, v_new, table,
                        np.asarray(case.cache_seqlens, np.int32), **index)


def rotated(case: DecodeCase, inputs: DecodeInputs) -> tuple[np.ndarray, np.ndarray | None]:
    """q and k_new as the call rotates them (``reference.rotary_embedding``; as they are without a
    rotary embedding): new row t of sequence b at cache_seqlens[b] + t, query i at cache_seqlens[b] +
    i·step (FlashAttention's ``rotary_query_step``)."""
    if not case.rotary:
        return inputs.q, inputs.k_new
    step = rotary_query_step(case.causal, case.window_size, case.capacity)
    q, k_new = inputs.q.copy(), inputs.k_new.copy()
    for b, n in enumerate(case.cache_seqlens):
        tables = (inputs.rotary_cos, inputs.rotary_sin)
        q[b] = rotary_embedding(q[b], *tables, n + np.arange(case.seqlen_q) * step, case.rotary == 2)
        k_new[b] = rotary_embedding(k_new[b], *tables, n + np.arange(case.seqlen_new), case.rotary == 2)
    return q, k_new


def packed_problem(case: DecodeCase, inputs: DecodeInputs) -> tuple:
    """The case as a packed batch (``compare_varlen_with_reference``'s form): q (batch * seqlen_q,
    heads_q, d); k, v (sum of keys, heads_kv, d): each sequence's cached rows, then its new ones;
    cu_seqlens_q, cu_seqlens_k."""
    ks, vs = [], []
    q, k_new = rotated(case, inputs)
    for s, n in enumerate(case.cache_seqlens):
        where = cache_rows(case, inputs.block_table, s, case.start_of(s), n)
        ks.append(inputs.k_cache[where])
        vs.append(inputs.v_cache[where])
        if k_new is not None:
            ks.append(k_new[s])
            vs.append(inputs.v_new[s])
    q = q.reshape(-1, case.heads_q, case.dims[0])
    cu_q = np.arange(case.batch + 1, dtype=np.int32) * case.seqlen_q
    cu_k = np.concatenate([[0], np.cumsum(case.keys)]).astype(np.int32)
    return q, np.concatenate(ks), np.concatenate(vs), cu_q, cu_k


def expected_caches(case: DecodeCase, inputs: DecodeInputs) -> tuple[np.ndarray, np.ndarray]:
    """The caches after the call: the new rows at each sequence's cache_seqlens[b] (within its
    room; of its cache row ``case.row_of(b)``), everything else as it was."""
    k, v = inputs.k_cache.copy(), inputs.v_cache.copy()
    k_new = rotated(case, inputs)[1]
    for s, n in enumerate(case.cache_seqlens):
        if k_new is not None:
            where = cache_rows(case, inputs.block_table, s, n, n + case.seqlen_new)
            k[where], v[where] = k_new[s], inputs.v_new[s]
    return k, v


def same_cache(got: np.ndarray, want: np.ndarray, rotary: bool, dtype: str) -> bool:
    """Whether a cache after the call is the expected one (float64 values): bit for bit, or with a
    rotary embedding within a rounding of ``dtype`` (the rotated rows: float32 products the
    compiler may contract into FMAs; every other element differs by far more if wrong)."""
    if not rotary:
        return np.array_equal(got, want, equal_nan=True)
    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    nan = np.isnan(want)
    return bool((np.isnan(got) == nan).all() and (np.abs(got - want)[~nan] <= ulp * np.abs(want[~nan])).all())


def run_decode_case(case: DecodeCase) -> Any:
    """Run one decode case on the current GPU; never raises. Returns a
    ``selftest_common.CaseResult``."""
    import numbaflash

    start = time.perf_counter()
    try:
        inputs = make_decode_inputs(case)
        kind = case.kind if case.kind != "torch" or cuda_torch() is not None else "numba"
        dev = {f.name: None if getattr(inputs, f.name) is None else to_device(getattr(inputs, f.name), kind)
               for f in dataclasses.fields(inputs)}
        out = None
        if case.use_out:  # poison: unwritten elements show up as NaN
            out = to_device(np.full((*inputs.q.shape[:3], case.dims[1]), np.nan, inputs.q.dtype), kind)
        sink = np.array(case.sink, np.float32) if case.sink else None
        extra = {} if sink is None else {"learnable_sink": to_device(sink, kind)}
        for name in ("cache_batch_idx", "cache_leftpad", "rotary_cos", "rotary_sin"):
            if dev[name] is not None:
                extra[name] = dev[name]
        if case.rotary:
            extra["rotary_interleaved"] = case.rotary == 2
        if case.mla:
            result = numbaflash.flash_mla_with_kvcache(
                dev["q"], dev["k_cache"], dev["cache_seqlens"], dev["block_table"], causal=case.causal,
                softmax_scale=case.softmax_scale, num_splits=case.num_splits, return_lse=case.return_lse,
                out=out)
        else:
            result = numbaflash.flash_attention_with_kvcache(
                dev["q"], dev["k_cache"], dev["v_cache"], dev["cache_seqlens"], k_new=dev["k_new"],
                v_new=dev["v_new"], block_table=dev["block_table"], causal=case.causal,
                softmax_scale=case.softmax_scale, window_size=case.window_size, softcap=case.softcap,
                num_splits=case.num_splits, return_lse=case.return_lse, out=out, **extra)
        got, lse = result if case.return_lse else (result, None)
        problems = [] if out is None or got is out else ["the result is not the given out"]
        got = to_host(got).reshape(-1, case.heads_q, case.dims[1])
        if lse is not None:  # (batch, heads_q, seqlen_q) -> (heads_q, batch * seqlen_q)
            lse = to_host(lse).transpose(1, 0, 2).reshape(case.heads_q, -1)
        q, k, v, cu_q, cu_k = packed_problem(case, inputs)
        ratio, found = compare_varlen_with_reference(q, k, v, cu_q, cu_k, got, lse, causal=case.causal,
                                                     softmax_scale=case.softmax_scale,
                                                     window_size=case.window_size, softcap=case.softcap,
                                                     sink=sink)
        problems += [p.replace("sequence", "batch entry", 1) for p in found]
        for name, want, have in zip(("k_cache", "v_cache"), expected_caches(case, inputs),
                                    (dev["k_cache"], dev["v_cache"]), strict=True):
            if not same_cache(to_host(have), want.astype(np.float64), case.rotary != 0, case.dtype):
                problems.append(f"{name} after the call is not the cache with the new rows appended")
        note = kind_note(case.kind, kind)
        return CaseResult(case, not problems, ratio, time.perf_counter() - start, "; ".join(problems) + note)
    except Exception as exc:
        return CaseResult(case, False, math.inf, time.perf_counter() - start,
                          f"raised {type(exc).__name__}: {exc}")
