"""Context parallelism: attention over a sequence sharded across GPUs, on torch.distributed.

- ``ring_attention`` / ``ring_attention_varlen``: keys and values pass around the ring of ranks
  (``batch_isend_irecv``, overlapped with the attention of the block before); partial outputs
  merge through their LSEs; autograd sends dK and dV back around the ring to their owners.
- ``ulysses_attention`` / ``ulysses_attention_varlen``: all-to-all over heads (DeepSpeed
  Ulysses), when heads_q divides by the number of ranks (heads_kv divides by it or into it).
- ``shard`` / ``unshard`` (and the ``_varlen`` forms): cut a sequence into a layout's shards and
  put it back: "zigzag" (the causal load balance), "contiguous" or "stripe".

This is a wrapper a training loop calls in place of its attention (torchtitan-style: shard the
batch's sequence dimension with ``shard``, run the model, every attention layer calls
``ring_attention`` on its shard); PyTorch's own ``context_parallel`` only intercepts SDPA. See
``examples/context_parallel.py``. The ring, all-to-all and shard functions import torch when
first used; the layouts (``positions``, ``segments``) need nothing.
"""

from .layout import LAYOUTS, positions, segments

# the torch-facing names load with their modules on first use: the layouts and the planner
# (``layout``) import nothing but the standard library
_LAZY = {
    "ring_attention": "ring", "ring_attention_varlen": "ring", "ulysses_attention": "ulysses",
    "ulysses_attention_varlen": "ulysses",
    "shard": "sharding", "shard_varlen": "sharding", "unshard": "sharding", "unshard_parts": "sharding",
    "unshard_varlen_parts": "sharding",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "LAYOUTS",
    "positions",
    "ring_attention",
    "ring_attention_varlen",
    "segments",
    "shard",
    "shard_varlen",
    "ulysses_attention",
    "ulysses_attention_varlen",
    "unshard",
    "unshard_parts",
    "unshard_varlen_parts",
]
