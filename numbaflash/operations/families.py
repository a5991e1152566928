"""One record per kernel family: the only place that maps a config's type to its kernels.

A ``Family`` holds the config class, the compile target, the tuned table's name for its
configs, and per operation a ``KernelOp``: the kernel factory and Numba argument types (named
as ``module:attribute`` under ``numbaflash.kernels``, imported only to compile: they import
Numba), the parameter list as type names (``kernels.abi``, for the launcher), the cache kind and
the launch function. ``family_of(config)`` finds a config's family by its exact type; nothing
outside this module switches on config types (``tests/test_structure_cpu.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..kernels.abi import (
    BACKWARD_ABI,
    BACKWARD_DQ_ABI,
    BACKWARD_PREP_ABI,
    BACKWARD_WS_ABI,
    DECODE_ABI,
    DECODE_COMBINE_ABI,
    DECODE_VARIANT_ABI,
    FORWARD_ABI,
    VARLEN_BACKWARD_ABI,
    VARLEN_BACKWARD_DQ_ABI,
    VARLEN_BACKWARD_PREP_ABI,
    VARLEN_FORWARD_ABI,
    VARLEN_WS_ABI,
    WS_ABI,
)
from ..kernels.shapes import BackwardConfig, DecodeConfig, ForwardConfig, WsBackwardConfig, WsConfig
from .launch_backward import (
    launch_backward_dq,
    launch_backward_main,
    launch_backward_prep,
    launch_backward_ws_dq,
    launch_backward_ws_main,
    launch_backward_ws_prep,
    launch_varlen_backward_dq,
    launch_varlen_backward_main,
    launch_varlen_backward_prep,
)
from .launch_decode import launch_decode, launch_decode_combine, launch_decode_variant
from .launch_forward import launch_sm80, launch_sm80_varlen, launch_sm90, launch_sm90_varlen


def _attribute(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(f"numbaflash.kernels.{module}"), name)


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """One operation's kernel in a family."""

    cache_kind: str  # the kernel cache's name for it (``runtime.cache``)
    abi: tuple[str, ...]  # parameter types by Numba name (``kernels.abi``)
    factory: str  # "module:function" (config, causal, bf16) -> the Python kernel function
    argtypes: str  # "module:NAME": the same parameter list as Numba types
    # (config) -> launch(launcher, call, gpu): what depends on the config alone is worked out once
    prepare_launch: Callable[[Any], Callable[..., None]]
    # whether the kernel's code depends on causal masking; where it does not (the backward's
    # prepare and dQ kernels), one kernel, built and cached as the non-causal one, serves both
    masked: bool = True

    def kernel_causal(self, causal: bool) -> bool:
        """The ``causal`` this operation's kernel is built, cached and loaded with."""
        return causal and self.masked

    def make_kernel(self, config: Any, causal: bool, bf16: bool):
        """The Python kernel function (imports Numba)."""
        return _attribute(self.factory)(config, self.kernel_causal(causal), bf16)

    def numba_argtypes(self) -> tuple:
        return _attribute(self.argtypes)


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family: its configs' class and its kernels, by operation."""

    name: str  # "sm80" | "sm90" | "sm80bwd" | "sm90bwd" | "sm80dec"
    config_type: type
    table_kind: str  # the tuned table's "kernel" field for its configs
    arch: str  # the target it compiles for
    gpus: str  # which GPUs run it, for messages
    ops: Mapping[str, KernelOp]

    def op(self, operation: str) -> KernelOp:
        try:
            return self.ops[operation]
        except KeyError:
            raise NotImplementedError(f"the {self.name} family has no {operation} kernel "
                                      f"(it has: {', '.join(self.ops)})") from None


# The mma.sync forward, and its sliding-window and softcap variants (issue 35): one kernel operation
# each, with the same parameters and launch, compiled only when a call asks for one
# (``forward_operation``). A window kernel's right edge 0 is causal masking, so it is built and
# cached once, as the non-causal one (``masked=False``).
SM80 = Family("sm80", ForwardConfig, "mma", "sm_80", "a GPU of compute capability 8.0 or newer", {
    "forward": KernelOp("forward", FORWARD_ABI, "forward_mma:make_forward_kernel",
                        "common:FORWARD_ARGTYPES", launch_sm80),
    "forward_window": KernelOp("forward_window", FORWARD_ABI, "forward_mma:make_forward_window_kernel",
                               "common:FORWARD_ARGTYPES", launch_sm80, masked=False),
    "forward_softcap": KernelOp("forward_softcap", FORWARD_ABI, "forward_mma:make_forward_softcap_kernel",
                                "common:FORWARD_ARGTYPES", launch_sm80),
    "forward_window_softcap": KernelOp("forward_window_softcap", FORWARD_ABI,
                                       "forward_mma:make_forward_window_softcap_kernel",
                                       "common:FORWARD_ARGTYPES", launch_sm80, masked=False),
    # Packed variable-length batches (``flash_attention_varlen``): a parameter list of their own
    # (``VARLEN_FORWARD_ABI``), each plain, window and softcap variant, built on demand.
    **{f"forward_varlen{v}": KernelOp(f"forward_varlen{v}", VARLEN_FORWARD_ABI,
                                      f"forward_mma:make_forward_varlen{v}_kernel",
                                      "common:VARLEN_ARGTYPES", launch_sm80_varlen, masked="window" not in v)
       for v in ("", "_window", "_softcap", "_window_softcap")},
})


def forward_operation(window: bool, softcap: bool, varlen: bool = False) -> str:
    """The forward kernel operation of a call: ``forward`` (no window, no softcap: every family
    has it), else a window or softcap variant; ``varlen``: a packed variable-length kernel
    (``forward_varlen[_window][_softcap]``); both forward families have them all. A call whose
    operation its GPU's family lacks runs the sm80 family (``configs.dispatch_family``)."""
    return ("forward" + ("_varlen" if varlen else "") + ("_window" if window else "")
            + ("_softcap" if softcap else ""))
# The Hopper kernel and its sliding-window and softcap variants (issue 35), as the sm80 family's:
# one parameter list and launch, the variants built on demand, a window kernel once (non-causal);
# and its packed variable-length builds (``VARLEN_WS_ABI``), each plain, window and softcap.
SM90 = Family("sm90", WsConfig, "ws", "sm_90a", "Hopper (sm_90a)", {
    **{f"forward{v}": KernelOp(f"forward_ws{v}", WS_ABI, f"forward_ws:make_forward_ws{v}_kernel",
                               "forward_ws:WS_ARGTYPES", launch_sm90, masked="window" not in v)
       for v in ("", "_window", "_softcap", "_window_softcap")},
    **{f"forward_varlen{v}": KernelOp(f"forward_ws_varlen{v}", VARLEN_WS_ABI,
                                      f"forward_ws:make_forward_ws_varlen{v}_kernel",
                                      "forward_ws:VARLEN_WS_ARGTYPES", launch_sm90_varlen,
                                      masked="window" not in v)
       for v in ("", "_window", "_softcap", "_window_softcap")},
})
# The mma.sync backward (FlashAttention-2's algorithm): three kernels a call, run in this order
# (``operations.backward``). Compiled for the GPU's own target like the sm80 forward, so it runs
# on every GPU from sm_80 on, Hopper included.
SM80_BWD = Family("sm80bwd", BackwardConfig, "mma_bwd", "sm_80", "a GPU of compute capability 8.0 or newer", {
    "backward_prep": KernelOp("backward_prep", BACKWARD_PREP_ABI, "backward_mma:make_backward_prep_kernel",
                              "backward_mma:BACKWARD_PREP_ARGTYPES", launch_backward_prep, masked=False),
    "backward": KernelOp("backward", BACKWARD_ABI, "backward_mma:make_backward_kernel",
                         "backward_mma:BACKWARD_ARGTYPES", launch_backward_main),
    "backward_dq": KernelOp("backward_dq", BACKWARD_DQ_ABI, "backward_mma:make_backward_dq_kernel",
                            "backward_mma:BACKWARD_DQ_ARGTYPES", launch_backward_dq, masked=False),
    # The main kernel's sliding-window and softcap variants (issue 35), as the forward's: the same
    # parameters and launch, built on demand (``backward_operation``); a window kernel is built
    # and cached once, as the non-causal one.
    "backward_window": KernelOp("backward_window", BACKWARD_ABI, "backward_mma:make_backward_window_kernel",
                                "backward_mma:BACKWARD_ARGTYPES", launch_backward_main, masked=False),
    "backward_softcap": KernelOp("backward_softcap", BACKWARD_ABI,
                                 "backward_mma:make_backward_softcap_kernel",
                                 "backward_mma:BACKWARD_ARGTYPES", launch_backward_main),
    "backward_window_softcap": KernelOp("backward_window_softcap", BACKWARD_ABI,
                                        "backward_mma:make_backward_window_softcap_kernel",
                                        "backward_mma:BACKWARD_ARGTYPES", launch_backward_main, masked=False),
    # Packed variable-length batches (``flash_attention_varlen_backward``): prepare, main (plain,
    # window, softcap, both) and dQ kernels of their own parameter lists (``VARLEN_BACKWARD_*_ABI``),
    # built on demand.
    "backward_varlen_prep": KernelOp("backward_varlen_prep", VARLEN_BACKWARD_PREP_ABI,
                                     "backward_mma:make_backward_varlen_prep_kernel",
                                     "backward_mma:VARLEN_BACKWARD_PREP_ARGTYPES",
                                     launch_varlen_backward_prep,
                                     masked=False),
    "backward_varlen_dq": KernelOp("backward_varlen_dq", VARLEN_BACKWARD_DQ_ABI,
                                   "backward_mma:make_backward_varlen_dq_kernel",
                                   "backward_mma:VARLEN_BACKWARD_DQ_ARGTYPES", launch_varlen_backward_dq,
                                   masked=False),
    **{f"backward_varlen{v}": KernelOp(f"backward_varlen{v}", VARLEN_BACKWARD_ABI,
                                       f"backward_mma:make_backward_varlen{v}_kernel",
                                       "backward_mma:VARLEN_BACKWARD_ARGTYPES", launch_varlen_backward_main,
                                       masked="window" not in v)
       for v in ("", "_window", "_softcap", "_window_softcap")},
})
# The warp-specialised Hopper backward (``backward_ws``, FlashAttention-3's design): its main kernel
# (plain, window, softcap, both: the mma.sync family's variants, one parameter list
# ``BACKWARD_WS_ABI``) with the mma.sync prepare and dQ kernels of ``WsBackwardConfig.dq_config()``
# (their parameter lists and launches, built for that config). No packed variable-length kernels:
# those calls run the sm80bwd family on Hopper too (``configs.backward_dispatch_family``).
SM90_BWD = Family("sm90bwd", WsBackwardConfig, "ws_bwd", "sm_90a", "Hopper (sm_90a)", {
    "backward_prep": KernelOp("backward_ws_prep", BACKWARD_PREP_ABI,
                              "backward_ws:make_backward_ws_prep_kernel",
                              "backward_mma:BACKWARD_PREP_ARGTYPES", launch_backward_ws_prep, masked=False),
    "backward_dq": KernelOp("backward_ws_dq", BACKWARD_DQ_ABI, "backward_ws:make_backward_ws_dq_kernel",
                            "backward_mma:BACKWARD_DQ_ARGTYPES", launch_backward_ws_dq, masked=False),
    **{f"backward{v}": KernelOp(f"backward_ws{v}", BACKWARD_WS_ABI, f"backward_ws:make_backward_ws{v}_kernel",
                                "backward_ws:BACKWARD_WS_ARGTYPES", launch_backward_ws_main,
                                masked="window" not in v)
       for v in ("", "_window", "_softcap", "_window_softcap")},
})
BACKWARD_OPERATIONS = ("backward_prep", "backward", "backward_dq")  # launch order of one call
BACKWARD_VARIANTS = ("backward_window", "backward_softcap", "backward_window_softcap")
# The packed variable-length call's three kernels, in launch order ("backward_varlen": the main
# kernel, or its window / softcap variant: ``backward_operation(..., varlen=True)``).
VARLEN_BACKWARD_OPERATIONS = ("backward_varlen_prep", "backward_varlen", "backward_varlen_dq")


def backward_operation(window: bool, softcap: bool, varlen: bool = False) -> str:
    """The main backward kernel operation of a call: ``backward``, or a window or softcap variant
    (the prepare and dQ kernels serve them all); ``varlen``: the packed variable-length main
    kernel (``backward_varlen[_window][_softcap]``)."""
    return ("backward" + ("_varlen" if varlen else "") + ("_window" if window else "")
            + ("_softcap" if softcap else ""))
# Decode against a KV cache: the attention kernel, then (more than one split)
# the combine kernel, which does not depend on causal masking. The attention kernel's sliding-window
# and softcap variants (issue 35) take the plain parameters, then the window's sides and the
# softcap's factor (``DECODE_VARIANT_ABI``), built on demand (``decode_operation``); a window
# kernel is built and cached once, as the non-causal one. The combine kernel serves them all.
SM80_DEC = Family("sm80dec", DecodeConfig, "mma_dec", "sm_80", "a GPU of compute capability 8.0 or newer", {
    "decode": KernelOp("decode", DECODE_ABI, "decode_mma:make_decode_kernel", "decode_mma:DECODE_ARGTYPES",
                       launch_decode),
    "decode_combine": KernelOp("decode_combine", DECODE_COMBINE_ABI, "decode_mma:make_decode_combine_kernel",
                               "decode_mma:DECODE_COMBINE_ARGTYPES", launch_decode_combine, masked=False),
    **{f"decode{v}": KernelOp(f"decode{v}", DECODE_VARIANT_ABI, f"decode_mma:make_decode{v}_kernel",
                              "decode_mma:DECODE_VARIANT_ARGTYPES", launch_decode_variant,
                              masked="window" not in v)
       for v in ("_window", "_softcap", "_window_softcap")},
})
DECODE_OPERATIONS = ("decode", "decode_combine")  # the plain call's two kernels, in launch order
DECODE_VARIANTS = ("decode_window", "decode_softcap", "decode_window_softcap")


def decode_operation(window: bool, softcap: bool) -> str:
    """The decode attention kernel operation of a call: ``decode``, or a window or softcap variant
    (``decode_window``, ``decode_softcap``, ``decode_window_softcap``); ``decode_combine`` merges
    the splits of every one."""
    return "decode" + ("_window" if window else "") + ("_softcap" if softcap else "")
FAMILIES: dict[str, Family] = {f.name: f for f in (SM80, SM90, SM80_BWD, SM90_BWD, SM80_DEC)}
_BY_TYPE: dict[type, Family] = {f.config_type: f for f in FAMILIES.values()}
_BY_TABLE_KIND: dict[str, Family] = {f.table_kind: f for f in FAMILIES.values()}


def family_of(config: Any) -> Family:
    """The family whose kernels take ``config`` (by its exact type)."""
    family = _BY_TYPE.get(type(config))
    if family is None:
        raise TypeError(f"no kernel family takes a {type(config).__name__} "
                        f"(expected one of {', '.join(t.__name__ for t in _BY_TYPE)})")
    return family


def family_of_table_kind(kind: str) -> Family:
    """The family whose configs the tuned table marks ``"kernel": kind``."""
    family = _BY_TABLE_KIND.get(kind)
    if family is None:
        raise ValueError(f"unknown kernel {kind!r} in a config table entry, expected one of "
                         f"{', '.join(_BY_TABLE_KIND)}")
    return family
