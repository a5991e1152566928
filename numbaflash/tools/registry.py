"""Every kernel the package ships, with example argument types, for offline inspection."""

from __future__ import annotations


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


def forward_kernels() -> dict:
    """The shipped forward configurations, each for the architecture it is dispatched on."""
    from ..configs import FAMILY_ARCH, kernel_argtypes, make_kernel, shipped_configs

    kernels = {}
    for family, _, causal, config in shipped_configs():
        for bf16 in (False, True):
            kernel = make_kernel(config, causal, bf16)
            kernel.forward_key = (config, causal, bf16)  # what configs.kernel_cubin takes
            # The mma.sync kernel runs on every GPU from sm_80 on: check it for Hopper too.
            archs = ("sm_80", "sm_90a") if FAMILY_ARCH[family] == "sm_80" else (FAMILY_ARCH[family],)
            kernels[f"{kernel.__name__}_{family}"] = (kernel, kernel_argtypes(config), archs)
    return kernels


def forward_variant_kernels() -> dict:
    """The sliding-window and softcap kernels (issue 35) of every forward config the dispatcher
    picks for them (``shipped_configs(operation)``), both dtypes: the mma.sync family's for sm_80
    and for Hopper (sm_90a), which runs them at the head dims its own kernel lacks, and the Hopper
    kernel's for sm_90a. Compiled on demand by the API, not by ``precompile``; named like the plain
    kernels with ``window`` in place of ``full|causal`` and ``_softcap`` after it
    (``..._window_softcap_f16_sm80``). Each kernel's ``forward_key`` is (config, causal, bf16,
    operation), what ``configs.kernel_cubin`` takes."""
    return _operation_kernels(("forward_window", "forward_softcap", "forward_window_softcap"))


def forward_varlen_kernels() -> dict:
    """The packed variable-length kernels (``flash_attention_varlen``) of every forward config the
    dispatcher picks for them: plain (full and causal), window, softcap and window + softcap, both
    dtypes, for the targets of ``forward_variant_kernels``. Compiled on demand, not by
    ``precompile``; named like the plain kernels with ``varlen_`` before ``full|causal|window``
    (``..._varlen_causal_f16_sm80``); ``forward_key`` is (config, causal, bf16, operation)."""
    from ..operations.families import forward_operation

    return _operation_kernels(tuple(forward_operation(w, c, varlen=True) for w in (False, True)
                                    for c in (False, True)))


def _operation_kernels(operations: tuple[str, ...]) -> dict:
    """name -> (kernel, argument types, targets) of ``operations``' kernels, each on the configs the
    dispatcher picks for it (a window kernel is built once, as non-causal)."""
    from ..configs import FAMILY_ARCH, kernel_argtypes, make_kernel, shipped_configs
    from ..operations.families import family_of

    kernels = {}
    for operation in operations:
        for family, _, causal, config in shipped_configs(operation):
            archs = ("sm_80", "sm_90a") if FAMILY_ARCH[family] == "sm_80" else (FAMILY_ARCH[family],)
            op = family_of(config).op(operation)
            for bf16 in (False, True):
                kernel = make_kernel(config, causal, bf16, operation)
                name = f"{kernel.__name__}_{family}"
                if name not in kernels:
                    kernel.forward_key = (config, op.kernel_causal(causal), bf16, operation)
                    kernels[name] = (kernel, kernel_argtypes(config, operation), archs)
    return kernels


def _backward_arch(config) -> str:
    """The target that compiles a shipped backward config: its family's (``sm_90a`` for the Hopper
    backward's); for the mma.sync backward's, the H100's (dQ added four floats at a time) sm_90a,
    the A100's and smaller GPUs' sm_80."""
    from ..operations.families import SM80_BWD, family_of

    if family_of(config) is not SM80_BWD:
        return family_of(config).arch
    return "sm_90a" if config.dq_vector == 4 else "sm_80"


def backward_kernels() -> dict:
    """The shipped backward configurations (``configs.shipped_backward_configs``): each config's
    prepare, main and dQ kernels, causal and not, both dtypes, for the target that compiles
    each (``configs.backward_for_target``): the A100's and smaller GPUs' for sm_80, the H100's
    (the same mma.sync backward, dQ added four floats at a time) for sm_90a, and the Hopper
    backward's (``WsBackwardConfig``, sm_90a). Named
    ``flash_<cache kind>_d<head dim>_m<block_m>_n<block_n><tag>_<full|causal>_<f16|bf16>`` (the
    cache kind is the operation for the mma.sync backward, ``backward_ws...`` for the Hopper
    one's; every name holds "backward"; no ``<full|causal>`` for the prepare and dQ kernels, which serve
    both: ``KernelOp.masked``); each kernel's ``backward_key`` is (config, causal, bf16,
    operation), what ``configs.kernel_cubin`` takes."""
    from ..configs import kernel_argtypes, make_kernel, shipped_backward_configs
    from ..operations.families import BACKWARD_OPERATIONS, family_of

    kernels = {}
    for _, causal, config in shipped_backward_configs():
        for bf16 in (False, True):
            for operation in BACKWARD_OPERATIONS:
                op = family_of(config).op(operation)
                shape = f"d{config.head_dim}_m{config.block_m}_n{config.block_n}{config.tag}"
                kind = f"{'causal_' if causal else 'full_'}" if op.masked else ""
                name = f"flash_{op.cache_kind}_{shape}_{kind}{'bf16' if bf16 else 'f16'}"
                if name in kernels:
                    continue
                kernel = make_kernel(config, causal, bf16, operation)
                kernel.backward_key = (config, op.kernel_causal(causal), bf16, operation)
                kernels[name] = (kernel, kernel_argtypes(config, operation), (_backward_arch(config),))
    return kernels


def backward_variant_kernels() -> dict:
    """The backward main kernel's sliding-window and softcap variants (issue 35) of every shipped
    backward config, both dtypes, for the target that compiles each (as ``backward_kernels``).
    Compiled on demand by the API, not by ``precompile``; named like the plain main kernels with
    ``window`` in place of ``full|causal`` and ``_softcap`` after it
    (``flash_backward_d128_m64_n128_k2_q2_window_softcap_f16``); each kernel's ``backward_key``
    is (config, causal, bf16, operation)."""
    from ..configs import kernel_argtypes, make_kernel, shipped_backward_configs
    from ..operations.families import BACKWARD_VARIANTS, family_of

    kernels = {}
    for operation in BACKWARD_VARIANTS:  # each variant's dispatch (configs.backward_dispatch_family)
        for _, causal, config in shipped_backward_configs(operation):
            for bf16 in (False, True):
                op = family_of(config).op(operation)
                kernel = make_kernel(config, causal, bf16, operation)
                if kernel.__name__ in kernels:
                    continue
                kernel.backward_key = (config, op.kernel_causal(causal), bf16, operation)
                argtypes = kernel_argtypes(config, operation)
                kernels[kernel.__name__] = (kernel, argtypes, (_backward_arch(config),))
    return kernels


def backward_varlen_kernels() -> dict:
    """The backward's packed variable-length kernels (``flash_attention_varlen_backward``) of every
    shipped backward config: prepare, dQ, and the main kernel plain (full and causal), window,
    softcap and window + softcap, both dtypes, for the target that compiles each (as
    ``backward_kernels``; on Hopper the mma.sync configs it runs packed calls with:
    ``configs.backward_dispatch_family``). Compiled on demand, not by ``precompile``; named like the
    plain kernels with ``varlen_`` before ``full|causal|window`` (and before the dtype for the
    prepare and dQ kernels); ``backward_key`` is (config, causal, bf16, operation)."""
    from ..configs import kernel_argtypes, make_kernel, shipped_backward_configs
    from ..operations.families import backward_operation, family_of

    operations = ["backward_varlen_prep", "backward_varlen_dq"]
    operations += [backward_operation(w, s, varlen=True) for w in (False, True) for s in (False, True)]
    kernels = {}
    for _, causal, config in shipped_backward_configs("backward_varlen"):
        for bf16 in (False, True):
            for operation in operations:
                op = family_of(config).op(operation)
                kernel = make_kernel(config, causal, bf16, operation)
                name = kernel.__name__
                if not op.masked and "prep" in operation:  # the prepare kernel's name has no tag
                    name = f"{name}{config.tag}"
                if name in kernels:
                    continue
                kernel.backward_key = (config, op.kernel_causal(causal), bf16, operation)
                kernels[name] = (kernel, kernel_argtypes(config, operation), (_backward_arch(config),))
    return kernels


def decode_variant_kernels() -> dict:
    """The decode kernel's sliding-window and softcap variants (issue 35,
    ``families.DECODE_VARIANTS``) of every shipped decode config (``configs.shipped_decode_configs``),
    both dtypes, for sm_80 and Hopper (sm_90a), which run the same mma.sync kernel. Compiled on
    demand by the API, not by ``precompile``; named like the plain decode kernels with ``window``
    in place of ``full|causal`` and ``_softcap`` after it
    (``flash_decode_d128_m16_n64_w4_s3_paged_window_softcap_f16``; a window kernel is built once,
    as non-causal). Each kernel's ``decode_key`` is (config, causal, bf16, operation), what
    ``configs.kernel_cubin`` takes."""
    from ..configs import kernel_argtypes, make_kernel, shipped_decode_configs
    from ..operations.families import DECODE_VARIANTS, family_of

    kernels = {}
    for config in shipped_decode_configs():
        for operation in DECODE_VARIANTS:
            op = family_of(config).op(operation)
            for causal in (False, True):
                for bf16 in (False, True):
                    kernel = make_kernel(config, causal, bf16, operation)
                    if kernel.__name__ in kernels:
                        continue
                    kernel.decode_key = (config, op.kernel_causal(causal), bf16, operation)
                    argtypes = kernel_argtypes(config, operation)
                    kernels[kernel.__name__] = (kernel, argtypes, ("sm_80", "sm_90a"))
    return kernels
