"""``KernelSpec``: everything that makes one compiled kernel distinct, in one immutable record.

A call builds its kernels' specs once, at dispatch (``kernel_spec``); the spec is then the kernel
cache's key (``runtime.cache``), the key of the loaded kernels and launch plans, and the factory's
argument (``kernels.families.make_kernel``). No flag travels as a string: a variant axis
(window, softcap, varlen, paged, and the axes to come) is one field here.

Normalisation happens once, here, so that equal kernels have equal specs:

- a sliding-window kernel is built non-causal (a window whose right side is 0 is causal masking);
- the kernels that do not depend on the mask or the softcap (``CAUSAL_FREE``: the backward's
  prepare and dQ kernels, the decode's combine kernel) are built without them, so one kernel
  serves every call; the combine kernel also serves packed and paged calls alike; the e4m3
  forward's V prep (``fp8_v``) is built once per config and layout (dense or packed), free of
  all of them and of the dtype;
- the kernels that do not read a learnable sink (``SINK_FREE``: the backward's main and dQ
  kernels, which take the forward's sink-inclusive LSE unchanged, and the combine kernel) are
  built without it: of a backward, only the prepare kernel has a sink build (it adds d_sink);
- ``group_split`` (a GQA group's query heads split over CTAs, their dK and dV summed) is an axis
  of the backward's main kernel only (the Hopper backward's: ``Family.group_splits``);
- the KV-cache call's ``cache_batch_idx``, ``cache_leftpad`` and rotary embedding (``batch_idx``,
  ``leftpad``, ``rotary``) are axes of the decode kernel only (the combine kernel reads no cache).

Plain Python (no Numba): the API imports it on every call's first dispatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DTYPES = ("float16", "bfloat16")
# Operations whose kernels do not depend on causal masking, the window or the softcap.
CAUSAL_FREE = frozenset({"backward_prep", "backward_dq", "decode_combine", "fp8_v"})
# Operations whose kernels never read a learnable sink (the backward's prepare kernel does: d_sink).
SINK_FREE = frozenset({"backward", "backward_dq", "decode_combine", "fp8_v"})
# Operations with a GQA-split build (``KernelSpec.group_split``): the backward's main kernel.
GROUP_SPLIT_OPERATIONS = frozenset({"backward"})
# Operations whose kernels serve packed (varlen) and paged calls alike.
LAYOUT_FREE = frozenset({"decode_combine"})
# Operations whose kernels do not depend on the 16-bit dtype (the e4m3 forward's V prep: bytes in,
# bytes out): built as float16 whatever the call's output dtype.
DTYPE_FREE = frozenset({"fp8_v"})


@dataclasses.dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel variant. Build it with ``kernel_spec`` (which normalises); its hash is computed
    once (the spec keys dictionaries on the dispatch path).

    ``family``: "sm80", "sm90", "sm80bwd", "sm90bwd" or "sm80dec"; ``operation``: "forward",
    "fp8_v" (the e4m3 forward's V prep), "backward_prep", "backward", "backward_dq", "decode" or
    "decode_combine"; ``config``: the
    family's frozen config (``kernels.shapes``); ``dtype``: "float16" or "bfloat16"; ``arch``:
    the compile target ("sm_80", "sm_90a", ...; "" where not yet known). A new axis is a new
    field with a default (its default the kernel of today)."""

    family: str
    operation: str
    config: Any
    dtype: str = "float16"
    arch: str = ""
    causal: bool = False
    window: bool = False
    softcap: bool = False
    varlen: bool = False
    paged: bool = False
    sink: bool = False
    batch_idx: bool = False
    leftpad: bool = False
    rotary: int = 0  # the KV-cache call's rotary embedding: 0 none, 1 halves, 2 interleaved
    group_split: bool = False  # the backward main kernel's GQA split (``kernels.backward_ws``)
    _hash: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.family, self.operation, self.config, self.dtype, self.arch, self.causal, self.window,
                  self.softcap, self.varlen, self.paged, self.sink, self.batch_idx, self.leftpad, self.rotary,
                  self.group_split)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt through __init__ in the unpickling process, whose string hashes differ
        return KernelSpec, tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init)

    @property
    def bf16(self) -> bool:
        """Whether the kernel reads and writes bfloat16 (else float16)."""
        return self.dtype == "bfloat16"

    @property
    def kind(self) -> str:
        """A readable name of the variant, for listings and the cache's key: the family, the
        operation and each axis that is set (``sm80.forward+window+varlen``); never parsed."""
        axes = "".join(f"+{f.name}" for f in dataclasses.fields(self)
                       if f.name in AXES and getattr(self, f.name))
        return f"{self.family}.{self.operation}{axes}"

    def sibling(self, operation: str, *, sink: bool | None = None) -> KernelSpec:
        """The spec of another kernel of the same call (the backward's prepare and dQ kernels,
        the decode's combine kernel), normalised for it; ``sink`` (None: this spec's) whether the
        call has a learnable sink (a backward's main spec is built without it: ``SINK_FREE``)."""
        return kernel_spec(self.family, operation, self.config, self.dtype, self.arch, causal=self.causal,
                           window=self.window, softcap=self.softcap, varlen=self.varlen, paged=self.paged,
                           sink=self.sink if sink is None else sink, batch_idx=self.batch_idx,
                           leftpad=self.leftpad, rotary=self.rotary, group_split=self.group_split)

    def on(self, arch: str) -> KernelSpec:
        """The same kernel for another target."""
        return dataclasses.replace(self, arch=arch)


# The variant axes (boolean fields, named in ``KernelSpec.kind``); causal is the mask, not an axis.
AXES = ("window", "softcap", "varlen", "paged", "sink", "batch_idx", "leftpad", "rotary", "group_split")


def kernel_spec(family: str, operation: str, config: Any, dtype: str = "float16", arch: str = "", *,
                causal: bool = False, window: bool = False, softcap: bool = False, varlen: bool = False,
                paged: bool = False, sink: bool = False, batch_idx: bool = False,
                leftpad: bool = False, rotary: int = 0, group_split: bool = False) -> KernelSpec:
    """The normalised spec of one kernel (see the module's docstring); ``dtype`` "float16" or
    "bfloat16". A decode kernel's paging is its config's (``DecodeConfig.paged``); ``batch_idx``
    and ``leftpad`` (the KV-cache call's ``cache_batch_idx`` and ``cache_leftpad``) and ``rotary``
    (its rotary embedding: 0 none, 1 halves, 2 interleaved) are the decode kernel's only;
    ``group_split`` (GQA groups split over CTAs) the backward main kernel's only."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if operation == "decode":
        paged = bool(config.paged)
    else:
        batch_idx = leftpad = False
        rotary = 0
    if rotary not in (0, 1, 2):
        raise ValueError(f"rotary must be 0 (none), 1 (halves) or 2 (interleaved), got {rotary!r}")
    if operation in CAUSAL_FREE:
        causal = window = softcap = False
    if operation in SINK_FREE:
        sink = False
    if operation not in GROUP_SPLIT_OPERATIONS:
        group_split = False
    if operation in LAYOUT_FREE:
        varlen = paged = False
    if operation in DTYPE_FREE:
        dtype = DTYPES[0]
    if window:
        causal = False
    return KernelSpec(family, operation, config, dtype, arch, bool(causal), bool(window), bool(softcap),
                      bool(varlen), bool(paged), bool(sink), bool(batch_idx), bool(leftpad), int(rotary),
                      bool(group_split))


def dtype_name(bf16: bool) -> str:
    """The spec's dtype of a bf16 flag."""
    return "bfloat16" if bf16 else "float16"
