"""One ring step's attention calls on tensors: the planner's ``BlockCall``s applied to a dense
batch (slices, no copies) or to packed sequences (rows gathered per call), the merge of partial
outputs through their LSEs, and the single-GPU attention the calls run.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from .layout import BlockCall, plan_step, segments


def _deterministic() -> bool:
    """The single-GPU backward in its deterministic mode where torch asks for it (as the torch ops
    do); the ring's own sums run in a fixed order, so the whole backward is then repeatable."""
    return torch.are_deterministic_algorithms_enabled()


class LocalAttention:
    """The single-GPU attention that each block runs: numbaflash's kernels through the torch ops'
    implementations (looked up at each call, as the ops do). ``forward`` returns (out, lse) with
    lse float32 (batch, heads_q, rows); the packed forms take cu_seqlens and give lse (heads_q,
    rows); ``backward`` gives (dq, dk, dv) in the inputs' dtype. ``sink``: a learnable sink, float32
    (heads_q,), folded in by the kernel (out rounded once, lse with the sink)."""

    def check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """The kernels' dtype and shape rules; packed (rows, heads, d) inputs as one batch."""
        from .. import torch_ops

        if q.dim() == 3:
            q, k, v = q[None], k[None], v[None]
        torch_ops.check_tensors(q, k, v)

    def forward(self, q, k, v, causal, scale, window, softcap, sink=None):
        from .. import torch_ops

        return torch_ops.run_forward(q, k, v, causal, scale, window, softcap, sink)

    def backward(self, dout, q, k, v, out, lse, causal, scale, window, softcap):
        from .. import torch_ops

        return torch_ops.run_backward(dout, q, k, v, out, lse, causal, scale, _deterministic(), window,
                                      softcap)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, sink=None):
        from .. import torch_ops

        return torch_ops.run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, sink)

    def varlen_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap
    ):
        from .. import torch_ops

        return torch_ops.run_varlen_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, _deterministic(), window,
            softcap)


def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold a partial attention (``out``, ``lse``) over other keys into the running float32
    (``acc_out``, ``acc_lse``), in place: the softmax over the union of the keys. out is (..., rows,
    heads, d), lse (..., heads, rows). Rows that have seen no key yet carry lse -inf and out 0;
    a row with -inf on both sides stays (0, -inf), never NaN."""
    new = torch.logaddexp(acc_lse, lse)
    base = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_acc = torch.exp(acc_lse - base).transpose(-1, -2).unsqueeze(-1)
    w_new = torch.exp(lse.to(new.dtype) - base).transpose(-1, -2).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new)


def fold_sink_rows(out: Tensor, lse: Tensor, sink: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """``fold_sink`` on the rows ``rows`` (an index on dim -3 of out, -1 of lse; None: all),
    the others as they are."""
    if rows is None:
        return fold_sink(out, lse, sink)
    folded_out, folded_lse = fold_sink(out.index_select(-3, rows), lse.index_select(-1, rows), sink)
    return out.index_copy(-3, rows, folded_out), lse.index_copy(-1, rows, folded_lse)


def fold_sink(out: Tensor, lse: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of the softmax over the keys and a learnable sink (gpt-oss, FlashAttention-4's
    ``learnable_sink``: one logit a head, with no value) from those over the keys alone. out is
    (..., rows, heads, d), lse (..., heads, rows), sink float32 (heads,)."""
    folded = torch.logaddexp(lse, sink.to(lse.dtype)[:, None])
    scale = torch.exp(lse - folded).transpose(-1, -2).unsqueeze(-1)
    return (out.to(scale.dtype) * scale).to(out.dtype), folded


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """d loss / d sink over these rows: -sum exp(sink - lse) * rowsum(dout * out), per head
    (``lse`` and ``out`` those with the sink folded in)."""
    wide = torch.promote_types(lse.dtype, torch.float32)
    d = (dout.to(wide) * out.to(wide)).sum(-1).transpose(-1, -2)  # (..., heads, rows)
    p_sink = torch.exp(sink.to(lse.dtype)[:, None] - lse)
    return -(p_sink * d).reshape(-1, *d.shape[-2:]).sum((0, 2)).to(sink.dtype)


@lru_cache(maxsize=4096)
def _plan(
    layout: str, seqlen: int, world: int, rank: int, owner: int, causal: bool, window: tuple[int, int]
) -> tuple[BlockCall, ...]:
    return tuple(
        plan_step(
            segments(layout, seqlen, world, rank), segments(layout, seqlen, world, owner), causal, window
        )
    )


class DenseBlock:
    """A ``BlockCall`` on (batch, rows, heads, d) tensors: views of the rows it covers."""

    def __init__(self, call: BlockCall):
        self.call = call
        self.q_rows = slice(call.q_lo, call.q_hi)
        self.k_rows = slice(call.k_lo, call.k_hi)
        self.q_pieces = ((call.q_lo, call.q_hi),)  # the local query rows, [lo, hi) ranges

    def forward(self, attn, q, k, v, scale, softcap, sink=None):
        c = self.call
        return attn.forward(
            q[:, self.q_rows], k[:, self.k_rows], v[:, self.k_rows], c.causal, scale, c.window, softcap, sink
        )

    def covers(self, rows_q: int, rows_k: int) -> tuple[bool, bool]:
        """Whether the block spans every local query row, and every key row."""
        c = self.call
        return c.q_lo == 0 and c.q_hi == rows_q, c.k_lo == 0 and c.k_hi == rows_k

    def merge(self, acc_out, acc_lse, out, lse):
        merge_(acc_out[:, self.q_rows], acc_lse[:, :, self.q_rows], out, lse)

    def backward(self, attn, dout, q, k, v, out, lse, scale, softcap):
        c = self.call
        return attn.backward(
            dout[:, self.q_rows],
            q[:, self.q_rows],
            k[:, self.k_rows],
            v[:, self.k_rows],
            out[:, self.q_rows],
            lse[:, :, self.q_rows].contiguous(),
            c.causal,
            scale,
            c.window,
            softcap,
        )

    def add_q(self, acc, g):
        acc[:, self.q_rows] += g

    def add_k(self, acc, g):
        acc[:, self.k_rows] += g


def dense_blocks(
    layout: str, seqlen: int, world: int, rank: int, causal: bool, window: tuple[int, int]
) -> list[list[DenseBlock]]:
    """For each owner rank, the blocks of local queries against that rank's keys (a sequence of
    ``seqlen`` tokens in all)."""
    return [
        [DenseBlock(c) for c in _plan(layout, seqlen, world, rank, owner, causal, window)]
        for owner in range(world)
    ]


class PackedBlock:
    """Calls on packed sequences (rows, heads, d) that share one mask: each sequence's query rows
    against its key rows form one pseudo-sequence of a varlen call. ``q_index`` / ``k_index``:
    the local rows, None where they are all rows in order (no gather); ``q_pieces`` the query
    rows as [lo, hi) ranges on the host."""

    def __init__(self, causal, window, q_index, k_index, cu_q, cu_k, max_q, max_k, q_pieces):
        self.causal, self.window, self.q_pieces = causal, window, tuple(q_pieces)
        self.q_index, self.k_index = q_index, k_index
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k

    @staticmethod
    def _take(x, index, dim=0):
        return x if index is None else x.index_select(dim, index)

    def _mask(self, scale, softcap) -> tuple:
        """The varlen call's arguments after q, k, v (and dout, out, lse)."""
        return self.cu_q, self.cu_k, self.max_q, self.max_k, self.causal, scale, self.window, softcap

    def forward(self, attn, q, k, v, scale, softcap, sink=None):
        take = self._take
        return attn.varlen_forward(take(q, self.q_index), take(k, self.k_index), take(v, self.k_index),
                                   *self._mask(scale, softcap), sink)

    def covers(self, rows_q: int, rows_k: int) -> tuple[bool, bool]:
        """Whether the block spans every local query row, and every key row, in order."""
        return self.q_index is None, self.k_index is None

    def merge(self, acc_out, acc_lse, out, lse):
        if self.q_index is None:
            merge_(acc_out, acc_lse, out, lse)
            return
        rows_out = acc_out.index_select(0, self.q_index)
        rows_lse = acc_lse.index_select(1, self.q_index)
        merge_(rows_out, rows_lse, out, lse)
        acc_out.index_copy_(0, self.q_index, rows_out)
        acc_lse.index_copy_(1, self.q_index, rows_lse)

    def backward(self, attn, dout, q, k, v, out, lse, scale, softcap):
        take, qi, ki = self._take, self.q_index, self.k_index
        return attn.varlen_backward(take(dout, qi), take(q, qi), take(k, ki), take(v, ki), take(out, qi),
                                    take(lse, qi, 1).contiguous(), *self._mask(scale, softcap))

    def add_q(self, acc, g):
        if self.q_index is None:
            acc += g
        else:
            acc.index_add_(0, self.q_index, g.to(acc.dtype))

    def add_k(self, acc, g):
        if self.k_index is None:
            acc += g
        else:
            acc.index_add_(0, self.k_index, g.to(acc.dtype))


def _rows(pieces: list[tuple[int, int]], total: int, device) -> Tensor | None:
    """The row index of the concatenated [lo, hi) pieces (each non-empty); None when they are all
    rows in order."""
    ends = [0] + [hi for _, hi in pieces]
    if all(lo == end for (lo, _), end in zip(pieces, ends, strict=False)) and ends[-1] == total:
        return None
    index = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in pieces])
    return torch.from_numpy(index).to(device)


def packed_blocks(
    layout: str, seqlens: list[int], world: int, rank: int, causal: bool, window: tuple[int, int], device
) -> list[list[PackedBlock]]:
    """For each owner rank, the varlen calls of local packed queries against that rank's packed
    keys: sequence i of ``seqlens`` (global lengths) holds ``seqlens[i] / world`` local rows on
    every rank. The calls of one mask go into one varlen call, one pseudo-sequence each; a
    sequence that needs two calls of one mask puts them in two varlen calls (no query row twice
    in one call)."""
    local = [s // world for s in seqlens]
    starts = [sum(local[:i]) for i in range(len(local))]
    total = sum(local)
    plans = []
    for owner in range(world):
        groups: dict = {}
        for i, seqlen in enumerate(seqlens):
            if seqlen == 0:
                continue
            seen: dict = {}
            for c in _plan(layout, seqlen, world, rank, owner, causal, window):
                n = seen[c.mask_key] = seen.get(c.mask_key, -1) + 1
                groups.setdefault((c.mask_key, n), []).append((starts[i], c))
        blocks = []
        for ((causal_c, window_c), _), calls in groups.items():
            qp = [(s + c.q_lo, s + c.q_hi) for s, c in calls]
            kp = [(s + c.k_lo, s + c.k_hi) for s, c in calls]
            cu_q = torch.tensor([0] + _cumsum([hi - lo for lo, hi in qp]), dtype=torch.int32, device=device)
            cu_k = torch.tensor([0] + _cumsum([hi - lo for lo, hi in kp]), dtype=torch.int32, device=device)
            blocks.append(
                PackedBlock(
                    causal_c,
                    window_c,
                    _rows(qp, total, device),
                    _rows(kp, total, device),
                    cu_q,
                    cu_k,
                    max(hi - lo for lo, hi in qp),
                    max(hi - lo for lo, hi in kp),
                    qp,
                )
            )
        plans.append(blocks)
    return plans


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out
