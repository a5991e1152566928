"""Context parallelism: attention over a sequence sharded across GPUs, on torch.distributed.

- ``ring_attention`` / ``ring_attention_varlen``: keys and values pass around the ring of ranks
  (``batch_isend_irecv``, overlapped with the attention of the block before); partial outputs
  merge through their LSEs; autograd sends dK and dV back around the ring to their owners.
- ``ulysses_attention``: all-to-all over heads (DeepSpeed Ulysses), when the head counts divide
  by the number of ranks.
- ``shard`` / ``unshard`` (and the ``_varlen`` forms): cut a sequence into a layout's shards and
  put it back: "zigzag" (the causal load balance), "contiguous" or "stripe".

This is a wrapper a training loop calls in place of its attention (torchtitan-style: shard the
batch's sequence dimension with ``shard``, run the model, every attention layer calls
``ring_attention`` on its shard); PyTorch's own ``context_parallel`` only intercepts SDPA. See
``examples/context_parallel.py``. Importing this module imports torch.
"""

from .layout import LAYOUTS, segments
from .ring import ring_attention, ring_attention_varlen
from .shard import positions, shard, shard_varlen, unshard, unshard_parts, unshard_varlen_parts
from .ulysses import ulysses_attention

__all__ = [
    "LAYOUTS",
    "positions",
    "ring_attention",
    "ring_attention_varlen",
    "segments",
    "shard",
    "shard_varlen",
    "ulysses_attention",
    "unshard",
    "unshard_parts",
    "unshard_varlen_parts",
]
