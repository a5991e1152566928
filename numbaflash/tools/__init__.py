"""Tools around the kernels: benchmarks (``bench``), a debugger that localises wrong tiles
(``debug``), offline SASS inspection (``inspect``), the float64 reference (``reference``) and
the self-test (``selftest``). ``python -m numbaflash.<tool>`` runs each."""
