"""The shipped attention kernels and their device pieces.

- ``forward_mma``: the cp.async + ldmatrix + mma.sync forward kernel (sm_80 and later);
- ``forward_ws``: the warp-specialised TMA + wgmma forward kernel (sm_90a), with its GEMM
  steps in ``wgmma_gemms`` and its mbarrier rings in ``ring``;
- ``shapes``: ``ForwardConfig`` and ``WsConfig``, the kernels' compile-time shapes, in plain
  Python;
- ``spec``: ``KernelSpec``, the immutable record of one kernel variant (family, operation,
  config, dtype, target, causal and the variant axes), normalised when built;
- ``families``: the family records and the registry of factories, (family, operation) ->
  factory(spec), and each spec's parameter list;
- ``params``: each kernel's parameters declared once, as (name, Numba type name); the ABI the
  launcher packs, the Numba argument types and the binding order come from them;
- ``abi``: the parameter types by Numba name (derived from ``params``) and the backward's
  workspace layout, without importing Numba;
- ``common``: the online-softmax rescale threshold, device constants, and ``unroll``
  (generated code: a loop unrolled in Python);
- ``blocks``: which query block and (batch, head) a CTA owns, and score masks;
- ``smem``: swizzled shared tiles, cp.async copies and ldmatrix fragments;
- ``softmax``: the online-softmax steps on mma fragments;
- ``epilogue``: normalise, stage and store O, and write the log-sum-exp.

Nothing here imports ``api``, ``operations``, ``tools`` or ``demos`` (``tests/test_structure_cpu.py``).
"""
