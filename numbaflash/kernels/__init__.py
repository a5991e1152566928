"""The shipped attention kernels and the device pieces they are built from.

Kernels, one module each (the varlen, window and softcap builds live with their kernel):

- ``forward_mma``: the cp.async + ldmatrix + mma.sync forward (sm_80 and later);
- ``forward_ws``: the warp-specialised TMA + wgmma forward (sm_90a);
- ``backward_mma``: FlashAttention-2's backward on mma.sync: prepare, main and dQ kernels;
- ``backward_ws``: the warp-specialised TMA + wgmma backward's main kernel (sm_90a; its prepare
  and dQ kernels are ``backward_mma``'s);
- ``decode_mma``: decode against a (paged) KV cache, split over keys, and its combine kernel.

Shared device pieces: ``wgmma_gemms`` (wgmma S and PV steps), ``ring`` (mbarrier rings as named
steps), ``blocks`` (which block a CTA owns, masks), ``smem`` (swizzled tiles, cp.async copies,
ldmatrix fragments), ``softmax`` (online-softmax steps on mma fragments), ``epilogue`` (normalise
and store O, write the log-sum-exp), and ``common`` (the online-softmax rescale threshold, device
constants, ``unroll``: a loop unrolled in Python).

Plain Python, importable without Numba:

- ``spec``: ``KernelSpec``, the immutable record of one kernel variant (family, operation,
  config, dtype, target, causal and the variant axes), normalised when built;
- ``families``: the family records and the registry of factories, (family, operation) ->
  factory(spec), and each spec's parameter list;
- ``params``: each kernel's parameters declared once, as (name, Numba type name); the ABI the
  launcher packs, the Numba argument types and the binding order come from them;
- ``shapes``: every kernel's compile-time config class;
- ``abi``: the parameter types by Numba name (derived from ``params``) and the backward's
  workspace layout.

Nothing here imports ``api``, ``operations``, ``tools`` or ``demos`` (``tests/test_structure_cpu.py``).
"""
