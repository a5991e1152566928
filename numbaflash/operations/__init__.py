"""Operations: what the API routes a validated call to.

``families`` holds one record per kernel family (``sm80``: the mma.sync kernels every GPU from
sm_80 on runs; ``sm90``: the warp-specialised Hopper kernels): its config class, and for each
operation the kernel factory, the parameter list (ABI), the cache kind and the launch.
``forward`` is the forward operation: pick the config, load the kernel, launch it on device
arrays or run the numpy pipeline. ``entry`` holds the checked entries of the dense operations
(validate, then run): what ``api`` routes a call to, and what the torch ops run. A new operation
(backward, decode, variable length) adds a ``KernelOp`` to each family that has a kernel for it,
and a module here beside ``forward``.
"""
