"""The launch of each kernel: (family, operation) -> the launch preparer of a spec's kernel.

``prepare_launch(spec)`` returns the function that, given the kernel's config, works out once
what depends on the config alone and returns ``launch(launcher, call, gpu)``
(``operations.launch_*``). The kernels themselves (factories, parameter lists, families) are the
kernels layer's (``kernels.families``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..kernels.spec import KernelSpec
from .launch_backward import (
    launch_backward_dq,
    launch_backward_main,
    launch_backward_prep,
    launch_backward_ws_dq,
    launch_backward_ws_main,
    launch_backward_ws_prep,
    launch_backward_ws_split,
    launch_varlen_backward_dq,
    launch_varlen_backward_main,
    launch_varlen_backward_prep,
)
from .launch_decode import launch_decode, launch_decode_combine, launch_decode_variant
from .launch_forward import launch_sm80, launch_sm80_varlen, launch_sm90, launch_sm90_varlen

Prepare = Callable[[Any], Callable[..., None]]

# (family, operation) -> (dense launch, packed variable-length launch or None)
LAUNCHES: dict[tuple[str, str], tuple[Prepare, Prepare | None]] = {
    ("sm80", "forward"): (launch_sm80, launch_sm80_varlen),
    ("sm90", "forward"): (launch_sm90, launch_sm90_varlen),
    ("sm80bwd", "backward_prep"): (launch_backward_prep, launch_varlen_backward_prep),
    ("sm80bwd", "backward"): (launch_backward_main, launch_varlen_backward_main),
    ("sm80bwd", "backward_dq"): (launch_backward_dq, launch_varlen_backward_dq),
    ("sm90bwd", "backward_prep"): (launch_backward_ws_prep, None),
    ("sm90bwd", "backward"): (launch_backward_ws_main, None),
    ("sm90bwd", "backward_dq"): (launch_backward_ws_dq, None),
    ("sm80dec", "decode"): (launch_decode, None),
    ("sm80dec", "decode_combine"): (launch_decode_combine, None),
    ("sm80mla", "decode"): (launch_decode, None),
    ("sm80mla", "decode_combine"): (launch_decode_combine, None),
    ("sm90mla", "decode"): (launch_decode, None),
    ("sm90mla", "decode_combine"): (launch_decode_combine, None),
}


def prepare_launch(spec: KernelSpec) -> Prepare:
    """The launch preparer of ``spec``'s kernel: (config) -> launch(launcher, call, gpu)."""
    dense, packed = LAUNCHES[(spec.family, spec.operation)]
    if spec.varlen:
        if packed is None:
            raise NotImplementedError(f"no launch for {spec.kind}")
        return packed
    if spec.group_split:
        return launch_backward_ws_split  # its parameters end with the sums, tickets and splits
    if spec.operation == "decode" and (spec.window or spec.softcap):
        return launch_decode_variant  # the variants' parameter list (window sides, softcap factor)
    return dense
