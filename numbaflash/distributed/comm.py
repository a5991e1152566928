"""The ring's transport: torch.distributed point-to-point and all-to-all, nothing of our own.

With NCCL the transfers run on NCCL's own streams: ``batch_isend_irecv`` orders them after the work
already queued on the current stream, and waiting on a request makes the current stream wait for
the transfer, so the next step's attention overlaps the transfer of the block after it. With a
backend that cannot move CUDA tensors (gloo: the CPU tests, or several processes sharing one GPU)
the tensors are staged through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def resolve_group(group):
    """``group`` or the default process group; a clear error when torch.distributed is not set up."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "numbaflash.distributed needs torch.distributed initialised "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group "
                         "given: call with the group of the ranks that hold the sequence's shards")
    return group


def _staged(group, tensors: list[Tensor]) -> bool:
    """CUDA tensors on a group without NCCL (gloo alone; "cpu:gloo,cuda:nccl" has it)."""
    return any(t.is_cuda for t in tensors) and "nccl" not in str(dist.get_backend(group))


class Pending:
    """Received tensors that are usable once ``wait`` returns them."""

    def __init__(self, requests, received: list[Tensor], targets: list[Tensor] | None, sent: list[Tensor]):
        self._requests, self._received, self._targets = requests, received, targets
        self._sent = sent  # alive until the transfers are waited for

    def wait(self) -> list[Tensor]:
        for request in self._requests:
            request.wait()
        if self._targets is None:
            return self._received
        for target, staged in zip(self._targets, self._received, strict=True):
            target.copy_(staged)
        return self._targets


class Ring:
    """Ranks of ``group`` in a ring: each step sends to the next rank and receives from the one
    before it."""

    def __init__(self, group):
        self.group = resolve_group(group)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def send_recv(self, tensors: list[Tensor]) -> Pending:
        """Start sending ``tensors`` to the next rank and receiving as many like them from the
        previous rank (point-to-point needs dense tensors: a view of a fused projection is copied)."""
        tensors = [t.contiguous() for t in tensors]
        if _staged(self.group, tensors):
            targets = [torch.empty_like(t) for t in tensors]
            tensors = [t.cpu() for t in tensors]
        else:
            targets = None
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return Pending(dist.batch_isend_irecv(ops), received, targets, tensors)


def all_to_all(x: Tensor, group) -> Tensor:
    """``all_to_all_single`` over dim 0 of ``x`` (its length the group's size): piece i goes to rank
    i, and piece i of the result came from rank i."""
    x = x.contiguous()
    if _staged(group, [x]):
        out = torch.empty_like(x, device="cpu")
        dist.all_to_all_single(out, x.cpu(), group=group)
        return out.to(x.device)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_gather(x: Tensor, group) -> list[Tensor]:
    """Every rank's ``x`` (all of one shape), in rank order."""
    x = x.contiguous()
    world = dist.get_world_size(group)
    if _staged(group, [x]):
        parts = [torch.empty_like(x, device="cpu") for _ in range(world)]
        dist.all_gather(parts, x.cpu(), group=group)
        return [p.to(x.device) for p in parts]
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts
