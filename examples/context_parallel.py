"""Context-parallel training with numbaflash: one long sequence sharded over the GPUs.

A small causal language model trains on a sequence of ``--seqlen`` tokens split over the ranks in
the zigzag layout. Every rank holds its shard of the tokens and of the labels; every attention
layer calls ``numbaflash.distributed.ring_attention`` on its shard; rotary embeddings use the
tokens' *global* positions (``nd.positions``); the loss is the mean over all ranks' tokens, and
the weight gradients are summed over the ranks (as data parallelism would). With ``--check``,
rank 0 first runs the same model on the gathered sequence with ``numbaflash.flash_attention``
and prints both losses and gradient norms.

    torchrun --nproc-per-node 2 examples/context_parallel.py --seqlen 65536 --check
    torchrun --nproc-per-node 2 examples/context_parallel.py --backend gloo   # two ranks, one GPU
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import numbaflash
import numbaflash.distributed as nd


def rotary(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seqlen, heads, d) at global positions ``pos`` (seqlen,)."""
    d = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = pos.float()[:, None] * freq[None, :]
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, heads_kv: int):
        super().__init__()
        self.heads, self.heads_kv, self.d = heads, heads_kv, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * heads_kv) * self.d, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(),
                                 nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x, pos, attention):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.d, self.heads_kv * self.d, self.heads_kv * self.d], dim=-1
        )
        q = rotary(q.view(b, s, self.heads, self.d), pos)
        k = rotary(k.view(b, s, self.heads_kv, self.d), pos)
        o = attention(q, k, v.reshape(b, s, self.heads_kv, self.d))
        x = x + self.proj(o.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab=1024, dim=512, layers=2, heads=8, heads_kv=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, heads_kv) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, pos, attention):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, pos, attention)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layout", default="zigzag", choices=nd.LAYOUTS)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--check", action="store_true", help="rank 0 also runs the gathered sequence on one GPU")
    args = p.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.manual_seed(0)  # the same weights and tokens on every rank
    model = Model().cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (1, args.seqlen + 1), device="cuda")
    inputs, labels = ids[:, :-1], ids[:, 1:]
    # this rank's shard: tokens, labels and their global positions
    my_ids = nd.shard(inputs, args.layout, world, rank)
    my_labels = nd.shard(labels, args.layout, world, rank)
    my_pos = torch.tensor(nd.positions(args.layout, args.seqlen, world, rank), device="cuda")

    def ring(q, k, v):
        return nd.ring_attention(q, k, v, causal=True, layout=args.layout)

    if args.check and rank == 0:
        logits = model(inputs, torch.arange(args.seqlen, device="cuda"),
                       lambda q, k, v: numbaflash.flash_attention(q, k, v, causal=True))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters()))
        print(f"one GPU, gathered sequence: loss {loss.item():.5f}, gradient norm {norm.item():.5f}")
        model.zero_grad()
    for step in range(args.steps):
        logits = model(my_ids, my_pos, ring)
        # the mean over every rank's tokens: each rank's sum over the whole sequence's count
        loss = F.cross_entropy(logits.float().flatten(0, 1), my_labels.flatten(), reduction="sum")
        loss = loss / args.seqlen
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if step == 0 and rank == 0:
            norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters()))
            print(f"{world} ranks, {args.layout}: loss {total.item():.5f}, gradient norm {norm.item():.5f}")
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {total.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
