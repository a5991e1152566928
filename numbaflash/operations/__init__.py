"""Operations: what the API routes a validated call to.

``forward``, ``backward``, ``decode``, ``varlen`` and ``varlen_backward`` each pick the config
(``configs``), build the spec of each kernel they run (``kernels.spec``), load the kernels and
launch them on device arrays or stage numpy arrays through page-locked memory. ``launches``
maps each (family, operation) to its launch (``launch_forward``, ``launch_backward``,
``launch_decode``); the kernels themselves are the kernels layer's (``kernels.families``).
``entry`` holds the checked entries of the dense operations (validate, then run): what ``api``
routes a call to, and what the torch ops run.
"""
