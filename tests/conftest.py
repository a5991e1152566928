"""GPU tests carry the ``gpu`` marker (``hopper`` for sm_90-only ones) and are skipped,
with the reason shown, where no suitable NVIDIA GPU is present."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def _gpu_capability():
    """(major, minor) of GPU 0, or a string saying why there is none."""
    try:
        from numba import cuda

        if not cuda.is_available():
            return "no CUDA GPU/driver available (numba.cuda.is_available() is False)"
        return cuda.get_current_device().compute_capability
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"CUDA unusable: {exc}"


def pytest_collection_modifyitems(config, items):
    cap = _gpu_capability()
    for item in items:
        if "gpu" in item.keywords or "hopper" in item.keywords:
            if isinstance(cap, str):
                item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {cap}"))
            elif cap < (8, 0):
                item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: sm_{cap[0]}{cap[1]} < sm_80"))
            elif "hopper" in item.keywords and cap[0] != 9:
                item.add_marker(pytest.mark.skip(reason=f"Hopper test skipped: GPU is sm_{cap[0]}{cap[1]}"))


@pytest.fixture
def rng(request):
    """A fresh, reproducible-per-test random generator."""
    import numpy as np

    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
