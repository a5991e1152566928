"""The shipped attention kernels and their device pieces.

- ``forward_mma``: the cp.async + ldmatrix + mma.sync forward kernel (sm_80 and later);
- ``forward_ws``: the warp-specialised TMA + wgmma forward kernel (sm_90a), with its GEMM
  steps in ``wgmma_gemms``;
- ``common``: the mma.sync kernel's ABI (``FORWARD_ARGTYPES``) and device constants of both;
- ``blocks``: which query block and (batch, head) a CTA owns, and score masks;
- ``smem``: swizzled shared tiles, cp.async copies and ldmatrix fragments;
- ``softmax``: the online-softmax steps on mma fragments;
- ``epilogue``: normalise, stage and store O, and write the log-sum-exp.

Nothing here imports ``api``, ``tools`` or ``demos`` (``tests/test_structure.py``).
"""
