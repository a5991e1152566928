"""The shipped attention kernels and their device pieces.

- ``forward_mma``: the cp.async + ldmatrix + mma.sync forward kernel (sm_80 and later);
- ``forward_wgmma``: the wgmma forward kernel (sm_90a);
- ``common``: the kernel ABI both share (``FORWARD_ARGTYPES``) and device constants;
- ``blocks``: which query block and (batch, head) a CTA owns, and score masks;
- ``smem``: swizzled shared tiles, cp.async copies and ldmatrix fragments;
- ``softmax``: the online-softmax steps on mma fragments;
- ``epilogue``: normalise, stage and store O, and write the log-sum-exp;
- ``registry``: every kernel the package ships, for offline inspection.
"""
