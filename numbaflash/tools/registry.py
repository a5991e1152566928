"""Every kernel the package ships, with example argument types, for offline inspection.

Each attention kernel is built from its spec (``kernels.spec.KernelSpec``, with its family's own
target; ``spec.on(arch)`` for another) and carries it as ``kernel.spec``: what
``configs.kernel_cubin`` takes."""

from __future__ import annotations

# (window, softcap) of the variants of a masked kernel (issue 35)
VARIANTS = ((True, False), (False, True), (True, True))
# (window, softcap, varlen) of the forward's dense variant builds and of its packed builds
WINDOW_SOFTCAP = tuple((w, c, False) for w, c in VARIANTS)
PACKED = tuple((w, c, True) for w in (False, True) for c in (False, True))


def registered_kernels() -> dict:
    """name -> (python kernel function, argument types, architectures it targets)."""
    from ..demos import hopper_gemm
    from ..demos.tile_gemm import TILE_GEMM_ARGTYPES, make_tile_gemm

    both = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
    kernels = {
        "tile_gemm_f16": (make_tile_gemm(False), TILE_GEMM_ARGTYPES, both),
        "tile_gemm_bf16": (make_tile_gemm(True), TILE_GEMM_ARGTYPES, both),
    }
    kernels.update(forward_kernels())
    kernels.update(forward_variant_kernels())
    kernels.update(forward_varlen_kernels())
    kernels.update(backward_kernels())
    kernels.update(backward_variant_kernels())
    kernels.update(backward_varlen_kernels())
    kernels.update(decode_variant_kernels())
    kernels.update(hopper_gemm.registered())  # sm_90a: wgmma / TMA demos
    return kernels


def on_demand_kernels() -> dict:
    """The builds the API compiles on first use and the registry does not count: the learnable-sink
    builds (``forward_sink_kernels``, ``backward_sink_kernels``), the Hopper backward's GQA-split
    builds (``backward_split_kernels``: plain, and window / softcap), the window, softcap and packed
    builds of the forward configs only long sequences pick (``forward_long_variant_kernels``), the
    long-sequence backward (``backward_long_kernels``), the e4m3 forward (``forward_fp8_kernels``),
    MLA decode (``mla_decode_kernels``) and the decode variants of paged caches read by whole tiles
    (``decode_variant_kernels(page_tiles=True)``). ``benchmarks/sass_census.py --on-demand`` and
    ``python -m numbaflash.inspect --on-demand`` check them offline."""
    return {**forward_sink_kernels(), **forward_long_variant_kernels(), **backward_sink_kernels(),
            **backward_split_kernels(), **backward_split_kernels(variants=True),
            **backward_long_kernels(), **forward_fp8_kernels(), **mla_decode_kernels(),
            **decode_variant_kernels(page_tiles=True)}


def mla_decode_kernels() -> dict:
    """The MLA decode kernels (issue 58, ``kernels.mla_decode``) of every shipped MLA config
    (``configs.shipped_mla_decode_configs``), full and causal, both dtypes, for sm_80 and Hopper
    (sm_90a). Not registered, never precompiled: the API builds one on first use
    (``flash_mla_with_kvcache``); named ``flash_mla_decode_d576v512_m<rows>_n<keys>_w<warps>k<key
    slices>_s<stages>[_paged]_<full|causal>_<dtype>``."""
    from ..configs import shipped_mla_decode_configs
    from ..kernels.families import family_of, spec_of

    kernels = {}
    for config in shipped_mla_decode_configs():
        targets = ("sm_90a",) if family_of(config).arch == "sm_90a" else ("sm_80", "sm_90a")
        for causal in (False, True):
            for bf16 in (False, True):
                kernel, argtypes = _built(spec_of(config, "decode", bf16, causal=causal))
                kernels[kernel.__name__] = (kernel, argtypes, targets)
    return kernels


def forward_fp8_kernels() -> dict:
    """The e4m3 (FP8) Hopper forward kernels (issue 60, ``WsConfig.fp8``): each head dim's config
    (``configs.FP8_DEFAULTS``), full and causal, bf16 and fp16 output (packed: bf16), and its V
    prep (``kernels.fp8_prep``), dense and packed, for sm_90a. Not registered, never precompiled:
    the API builds one on first use. Named like the 16-bit kernels with ``e4m3_`` before the output dtype
    (``..._causal_e4m3_bf16_sm90``); the preps ``fp8_transpose_v_d<head dim>_sm90``. Then the e4m3
    mma.sync forward of the other FP8 GPUs (``configs.FP8_MMA_DEFAULTS``), full and causal, bf16 and
    fp16 output, for sm_89 (``..._e4m3_bf16_sm89``)."""
    from ..configs import FP8_DEFAULTS, FP8_MMA_DEFAULTS
    from ..kernels.families import spec_of

    kernels = {}
    for config in FP8_DEFAULTS.values():
        for varlen in (False, True):
            kernel, argtypes = _built(spec_of(config, "fp8_v", varlen=varlen))
            kernels[f"{kernel.__name__}_sm90"] = (kernel, argtypes, ("sm_90a",))
        for causal in (False, True):
            for bf16 in (True, False):
                kernel, argtypes = _built(spec_of(config, "forward", bf16, causal=causal))
                kernels[f"{kernel.__name__}_sm90"] = (kernel, argtypes, ("sm_90a",))
            kernel, argtypes = _built(spec_of(config, "forward", True, causal=causal, varlen=True))
            kernels[f"{kernel.__name__}_sm90"] = (kernel, argtypes, ("sm_90a",))
    for config in FP8_MMA_DEFAULTS.values():
        for causal in (False, True):
            for bf16 in (True, False):
                kernel, argtypes = _built(spec_of(config, "forward", bf16, "sm_89", causal=causal))
                kernels[f"{kernel.__name__}_sm89"] = (kernel, argtypes, ("sm_89",))
    return kernels


def _built(spec):
    """(kernel, Numba argument types) of ``spec``, the kernel carrying its spec."""
    from ..kernels.families import kernel_argtypes, make_kernel

    kernel = make_kernel(spec)
    kernel.spec = spec
    return kernel, kernel_argtypes(spec)


def forward_kernels() -> dict:
    """The shipped forward configurations, each for the architecture it is dispatched on."""
    return _forward_kernels(((False, False, False),))


def forward_variant_kernels() -> dict:
    """The sliding-window and softcap kernels (issue 35) of every forward config the dispatcher
    picks for them below ``configs.LONG_SEQLEN`` (``shipped_configs(window=..., long=False)``;
    ``forward_long_variant_kernels`` has the others), both dtypes: the mma.sync family's for sm_80
    and for Hopper (sm_90a), which runs them at the head dims its own kernel lacks, and the Hopper
    kernel's for sm_90a. Compiled on demand by the API, or by ``precompile``; named like the plain
    kernels with ``window`` in place of ``full|causal`` and ``_softcap`` after it
    (``..._window_softcap_f16_sm80``)."""
    return _forward_kernels(WINDOW_SOFTCAP, long=False)


def forward_varlen_kernels() -> dict:
    """The packed variable-length kernels (``flash_attention_varlen``) of every forward config the
    dispatcher picks for them below ``configs.LONG_SEQLEN``: plain (full and causal), window,
    softcap and window + softcap, both dtypes, for the targets of ``forward_variant_kernels``.
    Compiled on demand, or by ``precompile``; named like the plain kernels with ``varlen_`` before
    ``full|causal|window`` (``..._varlen_causal_f16_sm80``)."""
    return _forward_kernels(PACKED, long=False)


def forward_long_variant_kernels() -> dict:
    """The window, softcap and packed builds (``forward_variant_kernels``' and
    ``forward_varlen_kernels``' kinds) of the forward configs only sequences of
    ``configs.LONG_SEQLEN`` and more pick (the ``/long`` table entries: d128 128 x 176, d96 128 x
    192). Not registered (``on_demand_kernels``), as the long-sequence backward's are not: the API
    builds them on first use, ``precompile`` builds them; their plain builds are registered
    (``forward_kernels``)."""
    return _forward_kernels(WINDOW_SOFTCAP + PACKED, long=None)


def forward_sink_kernels() -> dict:
    """The learnable-sink builds (issue 56, ``KernelSpec.sink``) of the plain and packed forward
    kernels (``forward_kernels``, ``forward_varlen_kernels``), for the same targets. Not in
    ``registered_kernels`` (the registered count stays) and never precompiled: the API builds a
    sink kernel on first use. Named like the kernel they extend with ``_sink`` after the dtype
    (``..._causal_f16_sink_sm80``); ``benchmarks/sass_census.py --sink`` compiles them."""
    import dataclasses

    kernels = {}
    for name, (kernel, _, archs) in {**forward_kernels(), **forward_varlen_kernels()}.items():
        built, argtypes = _built(dataclasses.replace(kernel.spec, sink=True))
        kernels[f"{built.__name__}_{name.rsplit('_', 1)[1]}"] = (built, argtypes, archs)
    return kernels


def backward_sink_kernels() -> dict:
    """The learnable-sink builds (issue 56) of the backward's prepare kernels, dense
    (``backward_kernels``) and packed (``backward_varlen_kernels``): the only backward kernel with
    a sink build (it adds d_sink; the main and dQ kernels are the plain ones,
    ``kernels.spec.SINK_FREE``). Not registered, never precompiled (as ``forward_sink_kernels``);
    named like the prepare kernel they extend with ``_sink`` last."""
    import dataclasses

    kernels = {}
    for name, (kernel, _, archs) in {**backward_kernels(), **backward_varlen_kernels()}.items():
        if kernel.spec.operation == "backward_prep":
            built, argtypes = _built(dataclasses.replace(kernel.spec, sink=True))
            kernels[f"{name}_sink"] = (built, argtypes, archs)
    return kernels


def _forward_kernels(variants: tuple[tuple[bool, bool, bool], ...], long: bool | None = True) -> dict:
    """name -> (kernel, argument types, targets) of the (window, softcap, varlen) ``variants``'
    forward kernels, each on the configs the dispatcher picks for it (a window kernel is built
    once, as non-causal). ``long``: True every config, False not those only long sequences pick,
    None only those (``backward_kernels(long=...)``'s split)."""
    from ..configs import shipped_configs
    from ..kernels.families import spec_of

    kernels = {}
    for window, softcap, varlen in variants:
        chosen = shipped_configs(window=window, varlen=varlen, long=long is not False)
        if long is None:
            short = shipped_configs(window=window, varlen=varlen, long=False)
            chosen = [item for item in chosen if item not in short]
        for family, _, causal, config in chosen:
            spec0 = spec_of(config)
            # The mma.sync kernel runs on every GPU from sm_80 on: check it for Hopper too.
            archs = ("sm_80", "sm_90a") if spec0.arch == "sm_80" else (spec0.arch,)
            for bf16 in (False, True):
                spec = spec_of(config, "forward", bf16, causal=causal, window=window, softcap=softcap,
                               varlen=varlen)
                kernel, argtypes = _built(spec)
                name = f"{kernel.__name__}_{family}"
                if name not in kernels:
                    kernels[name] = (kernel, argtypes, archs)
    return kernels


def _backward_arch(config) -> str:
    """The target that compiles a shipped backward config: its family's (``sm_90a`` for the Hopper
    backward's); for the mma.sync backward's, the H100's (dQ added four floats at a time) sm_90a,
    the A100's and smaller GPUs' sm_80."""
    from ..kernels.families import SM80_BWD, family_of

    if family_of(config) is not SM80_BWD:
        return family_of(config).arch
    return "sm_90a" if config.dq_vector == 4 else "sm_80"


def _backward_spec(config, operation: str, bf16: bool, causal: bool, window: bool = False,
                   softcap: bool = False, varlen: bool = False):
    from ..kernels.families import spec_of

    return spec_of(config, operation, bf16, _backward_arch(config), causal=causal, window=window,
                   softcap=softcap, varlen=varlen)


def backward_kernels(long: bool = False) -> dict:
    """The shipped backward configurations (``configs.shipped_backward_configs``; with ``long`` only
    those that long query sequences add, ``backward_long_kernels``): each config's
    prepare, main and dQ kernels, causal and not, both dtypes, for the target that compiles
    each (``configs.backward_for_target``): the A100's and smaller GPUs' for sm_80, the H100's
    (the same mma.sync backward, dQ added four floats at a time) for sm_90a, and the Hopper
    backward's (``WsBackwardConfig``, sm_90a). Named
    ``flash_<operation>_d<head dim>_m<block_m>_n<block_n><tag>_<full|causal>_<f16|bf16>`` (the
    operation with ``backward_ws`` for ``backward`` in the Hopper backward's; every name holds
    "backward"; no ``<full|causal>`` for the prepare and dQ kernels, which serve both:
    ``kernels.spec.CAUSAL_FREE``)."""
    from ..configs import shipped_backward_configs
    from ..kernels.families import BACKWARD_OPERATIONS, SM90_BWD, family_of

    kernels = {}
    short = shipped_backward_configs(long=False)
    chosen = [item for item in shipped_backward_configs() if item not in short] if long else short
    for _, causal, config in chosen:
        for bf16 in (False, True):
            for operation in BACKWARD_OPERATIONS:
                spec = _backward_spec(config, operation, bf16, causal)
                label = operation
                if family_of(config) is SM90_BWD:
                    label = operation.replace("backward", "backward_ws")
                shape = f"d{config.head_dim}_m{config.block_m}_n{config.block_n}{config.tag}"
                kind = f"{'causal_' if causal else 'full_'}" if operation == "backward" else ""
                name = f"flash_{label}_{shape}_{kind}{'bf16' if bf16 else 'f16'}"
                if name not in kernels:
                    kernel, argtypes = _built(spec)
                    kernels[name] = (kernel, argtypes, (spec.arch,))
    return kernels


def backward_long_kernels() -> dict:
    """The kernels only long query sequences run (``configs.BACKWARD_WS_LONG``: the d128 Hopper
    backward of 80 query rows a step, its prepare and dQ kernels, causal and full, both dtypes), and
    their main kernels' GQA-split builds. Not registered (``on_demand_kernels``): the API builds them
    on first use, ``precompile`` builds them. Named as ``backward_kernels``' (the ``m80`` tells)."""
    import dataclasses

    from ..kernels.families import FAMILIES

    kernels = backward_kernels(long=True)
    for kernel, _, archs in list(kernels.values()):
        spec = kernel.spec
        if spec.operation == "backward" and FAMILIES[spec.family].group_splits:
            built, argtypes = _built(dataclasses.replace(spec, group_split=True))
            kernels[built.__name__] = (built, argtypes, archs)
    return kernels


def backward_variant_kernels() -> dict:
    """The backward main kernel's sliding-window and softcap variants (issue 35) of every shipped
    backward config, both dtypes, for the target that compiles each (as ``backward_kernels``).
    Compiled on demand by the API, or by ``precompile``; named like the plain main kernels with
    ``window`` in place of ``full|causal`` and ``_softcap`` after it
    (``flash_backward_d128_m64_n128_k2_q2_window_softcap_f16``)."""
    from ..configs import shipped_backward_configs

    kernels = {}
    for window, softcap in VARIANTS:  # each variant's dispatch (configs.backward_dispatch_family)
        for _, causal, config in shipped_backward_configs(window=window, softcap=softcap):
            for bf16 in (False, True):
                kernel, argtypes = _built(_backward_spec(config, "backward", bf16, causal, window, softcap))
                if kernel.__name__ not in kernels:
                    kernels[kernel.__name__] = (kernel, argtypes, (kernel.spec.arch,))
    return kernels


def backward_split_kernels(variants: bool = False) -> dict:
    """The GQA-split builds (``KernelSpec.group_split``, ``kernels.backward_ws``) of the Hopper
    backward's main kernels of ``backward_kernels`` (causal and full, both dtypes: 8), with
    ``variants`` those of ``backward_variant_kernels`` instead (window, softcap). Not registered
    (``on_demand_kernels``): the API builds a split build on first use, ``precompile`` builds them
    (the variants' with its variants). Named like
    the kernel they split with ``_split`` before the dtype
    (``flash_backward_ws_d128_m64_n128_s2_causal_split_bf16``)."""
    import dataclasses

    from ..kernels.families import FAMILIES

    kernels = {}
    for kernel, _, archs in (backward_variant_kernels() if variants else backward_kernels()).values():
        spec = kernel.spec
        if spec.operation == "backward" and FAMILIES[spec.family].group_splits:
            built, argtypes = _built(dataclasses.replace(spec, group_split=True))
            kernels[built.__name__] = (built, argtypes, archs)
    return kernels


def backward_varlen_kernels() -> dict:
    """The backward's packed variable-length kernels (``flash_attention_varlen_backward``) of every
    shipped backward config: prepare, dQ, and the main kernel plain (full and causal), window,
    softcap and window + softcap, both dtypes, for the target that compiles each (as
    ``backward_kernels``; on Hopper the mma.sync configs it runs packed calls with:
    ``configs.backward_dispatch_family``). Compiled on demand, or by ``precompile``; named like the
    plain kernels with ``varlen_`` before ``full|causal|window`` (and before the dtype for the
    prepare and dQ kernels)."""
    from ..configs import shipped_backward_configs

    parts = [("backward_prep", False, False), ("backward_dq", False, False)]
    parts += [("backward", w, s) for w in (False, True) for s in (False, True)]
    kernels = {}
    for _, causal, config in shipped_backward_configs(varlen=True):
        for bf16 in (False, True):
            for operation, window, softcap in parts:
                spec = _backward_spec(config, operation, bf16, causal, window, softcap, varlen=True)
                kernel, argtypes = _built(spec)
                name = kernel.__name__
                if operation == "backward_prep":  # the prepare kernel's name has no tag
                    name = f"{name}{config.tag}"
                if name not in kernels:
                    kernels[name] = (kernel, argtypes, (spec.arch,))
    return kernels


def decode_variant_kernels(page_tiles: bool = False) -> dict:
    """The decode kernel's sliding-window and softcap variants (issue 35, ``VARIANTS``) of every
    shipped decode config (``configs.shipped_decode_configs``), both dtypes, for sm_80 and Hopper
    (sm_90a), which run the same mma.sync kernel. Compiled on demand by the API, or by
    ``precompile``; named like the plain decode kernels with ``window`` in place of
    ``full|causal`` and ``_softcap`` after it
    (``flash_decode_d128_m16_n64_w4_s3_paged_window_softcap_f16``; a window kernel is built once,
    as non-causal). ``page_tiles``: those of the configs with ``DecodeConfig.page_tiles`` instead
    (in ``on_demand_kernels``: the registered count stays at issue 54's 907)."""
    from ..configs import shipped_decode_configs
    from ..kernels.families import spec_of

    kernels = {}
    for config in (c for c in shipped_decode_configs() if c.page_tiles == page_tiles):
        for window, softcap in VARIANTS:
            for causal in (False, True):
                for bf16 in (False, True):
                    spec = spec_of(config, "decode", bf16, causal=causal, window=window, softcap=softcap)
                    kernel, argtypes = _built(spec)
                    if kernel.__name__ not in kernels:
                        kernels[kernel.__name__] = (kernel, argtypes, ("sm_80", "sm_90a"))
    return kernels
