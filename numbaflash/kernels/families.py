"""The kernel families and their factories: the only place that maps a config's type to its kernels.

A ``Family`` holds the config class, the compile target, the tuned table's name for its configs,
its operations and which variant axes it builds. ``FACTORIES`` maps (family, operation) to a
factory of a ``KernelSpec`` (``kernels.spec``): it imports its kernel module (Numba) only when
called. ``kernel_params(spec)`` is the kernel's parameter list (``kernels.params``), ``kernel_abi(spec)``
its types by Numba name (for the launcher, no Numba) and ``kernel_argtypes(spec)`` the same as
Numba types (imports Numba).
``family_of(config)`` finds a config's family by its exact type; nothing outside this module
switches on config types (``tests/test_structure_cpu.py``). The launches live in
``operations.launches``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import params
from .shapes import (
    BackwardConfig,
    DecodeConfig,
    ForwardConfig,
    MlaDecodeConfig,
    WsBackwardConfig,
    WsConfig,
    WsMlaConfig,
)
from .spec import KernelSpec, dtype_name, kernel_spec


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family: its configs' class, target and operations, and whether it builds packed
    variable-length kernels (``varlen``; every family builds the window and softcap variants of
    its masked kernels)."""

    name: str  # "sm80" | "sm90" | "sm80bwd" | "sm90bwd" | "sm80dec" | "sm80mla" | "sm90mla"
    config_type: type
    table_kind: str  # the tuned table's "kernel" field for its configs
    arch: str  # the target it compiles for
    gpus: str  # which GPUs run it, for messages
    operations: tuple[str, ...]  # in launch order
    varlen: bool = False
    sink: tuple[str, ...] = ()  # the operations it builds with a learnable sink (``KernelSpec.sink``)
    # Whether it builds its backward main kernel with a GQA group's query heads split over CTAs
    # (``KernelSpec.group_split``: launched where ``operations.launch_backward.backward_group_splits``
    # > 1; the kernel argument ``splits`` says over how many).
    group_splits: bool = False

    def runs(self, operation: str, varlen: bool = False, sink: bool = False) -> bool:
        """Whether the family has a kernel of ``operation`` (a packed variable-length one: ``varlen``;
        with a learnable sink: ``sink``)."""
        return (operation in self.operations and (self.varlen or not varlen)
                and (not sink or operation in self.sink))

    def check(self, spec: KernelSpec) -> None:
        if spec.group_split and (not self.group_splits or spec.varlen):
            raise NotImplementedError(f"the {self.name} family has no {spec.kind} kernel (a GQA split: "
                                      f"the dense Hopper backward's main kernel only)")
        if spec.sink and spec.operation not in self.sink:
            raise NotImplementedError(f"the {self.name} family has no {spec.kind} kernel (a learnable sink: "
                                      f"{', '.join(self.sink) or 'no operation'} only)")
        if not self.runs(spec.operation, spec.varlen):
            raise NotImplementedError(f"the {self.name} family has no {spec.kind} kernel "
                                      f"(it has: {', '.join(self.operations)}"
                                      f"{'' if self.varlen else '; none packed'})")


BACKWARD_OPERATIONS = ("backward_prep", "backward", "backward_dq")  # launch order of one call
DECODE_OPERATIONS = ("decode", "decode_combine")  # launch order (the combine: more than one split)

# The mma.sync forward (sm_80 on), the warp-specialised Hopper forward, the mma.sync backward
# (FlashAttention-2's algorithm, every GPU from sm_80 on, Hopper included), the warp-specialised
# Hopper backward (FlashAttention-3's design; its prepare and dQ kernels are the mma.sync ones of
# ``WsBackwardConfig.dq_config()``; no packed kernels: those calls run sm80bwd on Hopper too) and
# decode against a KV cache.
SM80 = Family("sm80", ForwardConfig, "mma", "sm_80", "a GPU of compute capability 8.0 or newer",
              ("forward", "fp8_v"), varlen=True, sink=("forward",))
SM90 = Family("sm90", WsConfig, "ws", "sm_90a", "Hopper (sm_90a)", ("forward", "fp8_v"), varlen=True,
              sink=("forward",))
SM80_BWD = Family("sm80bwd", BackwardConfig, "mma_bwd", "sm_80", "a GPU of compute capability 8.0 or newer",
                  BACKWARD_OPERATIONS, varlen=True, sink=("backward_prep",))
SM90_BWD = Family("sm90bwd", WsBackwardConfig, "ws_bwd", "sm_90a", "Hopper (sm_90a)", BACKWARD_OPERATIONS,
                  sink=("backward_prep",), group_splits=True)
SM80_DEC = Family("sm80dec", DecodeConfig, "mma_dec", "sm_80", "a GPU of compute capability 8.0 or newer",
                  DECODE_OPERATIONS, sink=("decode",))
# MLA decode (DeepSeek's latent cache: V is K's first columns; ``kernels.mla_decode``), whose combine
# kernel is decode's.
SM80_MLA = Family("sm80mla", MlaDecodeConfig, "mma_mla", "sm_80", "a GPU of compute capability 8.0 or newer",
                  DECODE_OPERATIONS)
# MLA decode on Hopper (wgmma; ``kernels.mla_ws``), the same launch and combine kernel.
SM90_MLA = Family("sm90mla", WsMlaConfig, "ws_mla", "sm_90a", "Hopper (sm_90a)", DECODE_OPERATIONS)

FAMILIES: dict[str, Family] = {f.name: f for f in (SM80, SM90, SM80_BWD, SM90_BWD, SM80_DEC, SM80_MLA,
                                                    SM90_MLA)}
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


# ---------------------------------------------------------------------------- factories
# Each takes a normalised spec and returns the Python kernel function; each imports its kernel
# module (Numba) only when called.

def _forward(s: KernelSpec):
    from .forward_mma import make_forward_kernel

    return make_forward_kernel(s.config, s.causal, s.bf16, window=s.window, softcap=s.softcap,
                               varlen=s.varlen, sink=s.sink)


def _forward_ws(s: KernelSpec):
    from .forward_ws import make_forward_ws_kernel

    return make_forward_ws_kernel(s.config, s.causal, s.bf16, window=s.window, softcap=s.softcap,
                                  varlen=s.varlen, sink=s.sink)


def _backward_prep(s: KernelSpec):
    from .backward_common import make_backward_prep_kernel

    return make_backward_prep_kernel(_mma_backward_config(s.config), False, s.bf16, varlen=s.varlen,
                                     sink=s.sink)


def _backward(s: KernelSpec):
    from .backward_mma import make_backward_kernel

    return make_backward_kernel(s.config, s.causal, s.bf16, window=s.window, softcap=s.softcap,
                                varlen=s.varlen)


def _backward_dq(s: KernelSpec):
    from .backward_common import make_backward_dq_kernel

    return make_backward_dq_kernel(_mma_backward_config(s.config), False, s.bf16, varlen=s.varlen)


def _backward_ws(s: KernelSpec):
    from .backward_ws import make_backward_ws_kernel

    return make_backward_ws_kernel(s.config, s.causal, s.bf16, window=s.window, softcap=s.softcap,
                                   group_split=s.group_split)


def _fp8_v(s: KernelSpec):
    from .fp8_prep import make_transpose_v_kernel

    return make_transpose_v_kernel(s.config.head_dim, s.varlen)


def _decode(s: KernelSpec):
    from .decode_mma import make_decode_kernel

    return make_decode_kernel(s.config, s.causal, s.bf16, window=s.window, softcap=s.softcap, sink=s.sink,
                              batch_idx=s.batch_idx, leftpad=s.leftpad, rotary=s.rotary)


def _mla_decode(s: KernelSpec):
    from .mla_decode import make_mla_decode_kernel

    return make_mla_decode_kernel(s.config, s.causal, s.bf16)


def _mla_ws_decode(s: KernelSpec):
    from .mla_ws import make_mla_ws_kernel

    return make_mla_ws_kernel(s.config, s.causal, s.bf16)


def _decode_combine(s: KernelSpec):
    from .decode_mma import make_decode_combine_kernel

    return make_decode_combine_kernel(s.config, False, s.bf16)


def _mma_backward_config(config: BackwardConfig | WsBackwardConfig) -> BackwardConfig:
    """The mma.sync config whose prepare and dQ kernels a backward config runs: its own, or the
    Hopper backward's ``dq_config()``."""
    return config.dq_config() if family_of(config) is SM90_BWD else config


FACTORIES: dict[tuple[str, str], Callable[[KernelSpec], Any]] = {
    ("sm80", "forward"): _forward,
    ("sm90", "forward"): _forward_ws,
    ("sm90", "fp8_v"): _fp8_v,
    ("sm80", "fp8_v"): _fp8_v,
    ("sm80bwd", "backward_prep"): _backward_prep,
    ("sm80bwd", "backward"): _backward,
    ("sm80bwd", "backward_dq"): _backward_dq,
    ("sm90bwd", "backward_prep"): _backward_prep,
    ("sm90bwd", "backward"): _backward_ws,
    ("sm90bwd", "backward_dq"): _backward_dq,
    ("sm80dec", "decode"): _decode,
    ("sm80dec", "decode_combine"): _decode_combine,
    ("sm80mla", "decode"): _mla_decode,
    ("sm80mla", "decode_combine"): _decode_combine,
    ("sm90mla", "decode"): _mla_ws_decode,
    ("sm90mla", "decode_combine"): _decode_combine,
}


_PACKAGE = Path(__file__).resolve().parents[1]  # numbaflash/
# Files every kernel's binary depends on, beyond the modules its factory imports: the registry and
# spec (how a spec becomes factory arguments), the compile and link options and the link list
# (``runtime.compiler``, ``runtime.sources``), and the PTX helpers linked into every kernel.
_ALWAYS = ("kernels/families.py", "kernels/spec.py", "runtime/compiler.py", "runtime/sources.py")


@functools.cache
def _imported_modules(path: Path, top_level: bool = False) -> tuple[Path, ...]:
    """The files of the ``numbaflash.kernels`` and ``numbaflash.ptx`` modules that ``path`` imports
    anywhere (top level, inside functions): relative imports, ``from . import x`` and absolute
    ``numbaflash.`` imports (``top_level``: the module's own imports, not its functions').
    (Layering keeps device code to those two packages; what a kernel takes from ``runtime`` is
    ``_ALWAYS``.) Read once per file in a process, as ``kernel_source_files`` is."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.parent.relative_to(_PACKAGE.parent).parts  # ("numbaflash", "kernels")
    found = []
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
            elif node.module and node.module.split(".")[0] == "numbaflash":
                base = ()
            else:
                continue
            module = (*base, *node.module.split(".")) if node.module else base
            found.append(module)
            found.extend((*module, alias.name) for alias in node.names)  # ``from . import x``
        elif isinstance(node, ast.Import):
            found.extend(tuple(a.name.split(".")) for a in node.names if a.name.split(".")[0] == "numbaflash")
    files = []
    for module in found:
        if module[1:2] not in (("kernels",), ("ptx",)):  # device code lives in these two packages only
            continue
        base = _PACKAGE.parent.joinpath(*module)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                files.append(candidate)
    return tuple(files)


@functools.cache
def kernel_source_files(family: str, operation: str) -> tuple[Path, ...]:
    """Every file whose content can change the binary of a (family, operation) kernel: the
    modules its factory imports, and theirs, transitively (found by reading the imports, without
    importing anything), ``_ALWAYS`` and every ``ptx/*.cu``; sorted. An unknown pair (a test's
    own kernel) gets every module of ``kernels/`` and of ``ptx/``. The kernel cache keys each
    kernel by these files' content (``configs.kernel_key``), so an edit recompiles the
    kernels it can change and no others."""
    from ..runtime.sources import ptx_directory

    every = sorted((_PACKAGE / "kernels").glob("*.py")) + sorted((_PACKAGE / "ptx").glob("*.py"))
    factory = FACTORIES.get((family, operation))
    try:
        start = every if factory is None else _imported_modules_of_function(factory)
    except (OSError, TypeError):  # an installation without the factory's source text: key by everything
        start = every
    registry = Path(__file__).resolve()
    seen = {registry}
    todo = [*start, *_imported_modules(registry, top_level=True),  # not its factories' imports
            *(_PACKAGE / f for f in _ALWAYS if _PACKAGE / f != registry)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(_imported_modules(path))
    return tuple(sorted(seen) + sorted(ptx_directory().glob("*.cu")))


def _imported_modules_of_function(function: Callable) -> list[Path]:
    """The module files a factory function imports (its body's ``from .x import y``)."""
    source = textwrap.dedent(inspect.getsource(function))
    module = Path(inspect.getsourcefile(function)).resolve()
    files = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            candidate = module.parent / (node.module.replace(".", "/") + ".py")
            if candidate.is_file():
                files.append(candidate)
    return files or [module]


def make_kernel(spec: KernelSpec):
    """The Python kernel function of ``spec`` (imports Numba)."""
    FAMILIES[spec.family].check(spec)
    return FACTORIES[(spec.family, spec.operation)](spec)


# ---------------------------------------------------------------------------- parameter lists

def kernel_params(spec: KernelSpec) -> tuple[params.Param, ...]:
    """The parameters of ``spec``'s kernel, in order (``kernels.params``): its operation's, with
    the packed sequences of a varlen build, an e4m3 build's descales, the window's and softcap's for
    a decode variant, and
    the learnable sink's logits last for a sink build (the backward's prepare kernel: the logits
    and d_sink, ``params.SINK_GRADIENT``; a decode build: ``params.decode_params``, then its
    cache options), and the GQA split's sums, tickets and count last for a split build of the
    Hopper backward's main kernel (``params.GROUP_SPLIT``)."""
    family, op = spec.family, spec.operation
    if op == "fp8_v":
        return params.FP8_V_VARLEN if spec.varlen else params.FP8_V
    if op == "forward":
        if family == "sm90":
            declared = params.VARLEN_WS_FORWARD if spec.varlen else params.WS_FORWARD
            if spec.config.fp8:  # e4m3 inputs: their descales (``params.DESCALES``)
                declared += params.DESCALES
        else:
            declared = params.VARLEN_FORWARD if spec.varlen else params.FORWARD
            if spec.config.fp8:
                declared += params.DESCALES
        return declared + params.SINK if spec.sink else declared
    if op == "backward_prep":
        declared = params.VARLEN_BACKWARD_PREP if spec.varlen else params.BACKWARD_PREP
        return declared + params.SINK_GRADIENT if spec.sink else declared
    if op == "backward_dq":
        return params.VARLEN_BACKWARD_DQ if spec.varlen else params.BACKWARD_DQ
    if op == "backward":
        if family == "sm90bwd":
            return params.WS_BACKWARD + params.GROUP_SPLIT if spec.group_split else params.WS_BACKWARD
        return params.VARLEN_BACKWARD if spec.varlen else params.BACKWARD
    if op == "decode":
        return params.decode_params(spec.window or spec.softcap, spec.sink, spec.batch_idx, spec.leftpad,
                                    bool(spec.rotary))
    if op == "decode_combine":
        return params.DECODE_COMBINE
    raise NotImplementedError(spec.kind)


def kernel_abi(spec: KernelSpec) -> tuple[str, ...]:
    """The parameter types of ``spec``'s kernel by Numba name (what the launcher packs; no Numba)."""
    return params.types_of(kernel_params(spec))


def kernel_argtypes(spec: KernelSpec) -> tuple:
    """The parameter types of ``spec``'s kernel as Numba types (imports Numba)."""
    return params.numba_types(kernel_params(spec))


def spec_of(config: Any, operation: str = "forward", bf16: bool = False, arch: str | None = None, *,
            causal: bool = False, window: bool = False, softcap: bool = False,
            varlen: bool = False, sink: bool = False, group_split: bool = False) -> KernelSpec:
    """The normalised spec of ``config``'s ``operation`` kernel (``kernels.spec.kernel_spec``) in its
    family; ``arch`` None: the family's own target."""
    family = family_of(config)
    arch = family.arch if arch is None else arch
    return kernel_spec(family.name, operation, config, dtype_name(bf16), arch, causal=causal, window=window,
                       softcap=softcap, varlen=varlen, sink=sink, group_split=group_split)
