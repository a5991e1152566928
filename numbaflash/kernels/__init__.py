"""The shipped attention kernels and their device pieces.

- ``forward_mma``: the cp.async + ldmatrix + mma.sync forward kernel (sm_80 and later);
- ``forward_ws``: the warp-specialised TMA + wgmma forward kernel (sm_90a), with its GEMM
  steps in ``wgmma_gemms`` and its mbarrier rings in ``ring``;
- ``shapes``: ``ForwardConfig`` and ``WsConfig``, the kernels' compile-time shapes, in plain
  Python;
- ``abi``: both kernels' parameter lists (the ABI) as Numba's type names, so the launcher packs
  arguments without importing Numba;
- ``common``: the mma.sync kernel's parameter list as Numba types (``FORWARD_ARGTYPES``, checked
  against ``abi``), the online-softmax rescale threshold, device constants, and ``unroll``
  (generated code: a loop unrolled in Python);
- ``blocks``: which query block and (batch, head) a CTA owns, and score masks;
- ``smem``: swizzled shared tiles, cp.async copies and ldmatrix fragments;
- ``softmax``: the online-softmax steps on mma fragments;
- ``epilogue``: normalise, stage and store O, and write the log-sum-exp.

Nothing here imports ``api``, ``operations``, ``tools`` or ``demos`` (``tests/test_structure_cpu.py``).
"""
