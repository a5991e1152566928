"""Tools around the kernels: benchmarks (``bench``), a debugger that localises wrong tiles
(``debug``), offline SASS inspection (``inspect``), the float64 reference (``reference``) and
the self-test (``selftest``), with ``registry`` (every shipped kernel, for offline inspection)
and ``ws_launch`` (the Hopper kernel with any config and grid, on torch tensors, for tests and
kernel experiments). ``python -m numbaflash.<tool>`` runs each tool."""
