"""GPU tests carry the ``gpu`` marker (``hopper`` for sm_90-only ones) and are skipped,
with the reason shown, where no suitable NVIDIA GPU is present.

``NUMBAFLASH_REQUIRE_GPU=1`` turns those skips into failures: use it on every GPU machine,
so that an unusable CUDA install (a wrong cu12/cu13 extra, a driver mismatch) cannot leave
the run green with every GPU test skipped.

The ``rng`` fixture seeds from the test's id (stable across processes) plus
``NUMBAFLASH_TEST_SEED`` (default 0); a failing test's report shows its seed.
"""

from __future__ import annotations

import functools
import os
import types
import zlib

import pytest

REQUIRE_GPU = os.environ.get("NUMBAFLASH_REQUIRE_GPU", "") not in ("", "0")
BASE_SEED = int(os.environ.get("NUMBAFLASH_TEST_SEED", "0"))


@functools.lru_cache(maxsize=1)
def _gpu_capability():
    """(major, minor) of the current GPU, or a string saying why there is none."""
    try:
        from numba import cuda

        if not cuda.is_available():
            return "no CUDA GPU/driver available (numba.cuda.is_available() is False)"
        return tuple(cuda.get_current_device().compute_capability)
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"CUDA unusable: {type(exc).__name__}: {exc}"


def _why_not_runnable(item) -> str | None:
    """Why this GPU test cannot run here, or None if it can."""
    if "gpu" not in item.keywords and "hopper" not in item.keywords:
        return None
    cap = _gpu_capability()
    if isinstance(cap, str):
        return f"GPU test skipped: {cap}"
    if cap < (8, 0):
        return f"GPU test skipped: sm_{cap[0]}{cap[1]} < sm_80"
    if "hopper" in item.keywords and cap[0] != 9:
        return f"Hopper test skipped: GPU is sm_{cap[0]}{cap[1]}"
    return None


# Parameters that pick a compiled kernel: under pytest-xdist (``-n N --dist loadgroup``) the
# tests of one kernel go to one worker, so each kernel is compiled once, not once per worker.
KERNEL_PARAMS = ("family", "head_dim", "causal", "dtype", "cfg")


def pytest_configure(config):
    """One kernel cache folder for the whole run, so that no kernel is compiled twice: every
    test that compiles through the cache (the API, ``configs.kernel_cubin``, the offline SASS
    tests), every xdist worker and every subprocess shares it. ``NUMBAFLASH_CACHE_DIR`` when set
    (a GPU run that carries its cache), else a new empty folder, so a run starts from nothing.
    Tests of the cache itself point it elsewhere (``monkeypatch``)."""
    if "NUMBAFLASH_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        import tempfile

        config._numbaflash_cache = os.environ["NUMBAFLASH_CACHE_DIR"] = tempfile.mkdtemp(
            prefix="numbaflash-test-cache-")


def pytest_unconfigure(config):
    folder = getattr(config, "_numbaflash_cache", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("NUMBAFLASH_CACHE_DIR", None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    grouped = config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup"
    for item in items:
        reason = _why_not_runnable(item)
        if reason is not None and not (REQUIRE_GPU and _counts_as_missing(reason)):
            item.add_marker(pytest.mark.skip(reason=reason))
        params = getattr(item, "callspec", None)
        if grouped and params is not None and any(p in params.params for p in KERNEL_PARAMS):
            key = "-".join(str(params.params[p]) for p in KERNEL_PARAMS if p in params.params)
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{key}"))


def _counts_as_missing(reason: str) -> bool:
    """A Hopper-only test on a working non-Hopper GPU is skipped even when a GPU is required."""
    return not (reason.startswith("Hopper") and not isinstance(_gpu_capability(), str))


def pytest_runtest_setup(item):
    reason = _why_not_runnable(item)
    if REQUIRE_GPU and reason is not None and _counts_as_missing(reason):
        pytest.fail(f"NUMBAFLASH_REQUIRE_GPU is set, but {reason.split(': ', 1)[1]}", pytrace=False)


def test_seed(nodeid: str) -> int:
    """The rng seed of one test: stable across processes and machines."""
    return (zlib.crc32(nodeid.encode()) + BASE_SEED) % 2**32


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture
def table_with(monkeypatch):
    """``table_with({key: config, ...})``: the tuned table plus these entries, for this test."""
    from numbaflash import configs

    def patch(entries: dict) -> None:
        table = dict(configs._table())
        table.update({key: configs.config_to_json(config) for key, config in entries.items()})
        monkeypatch.setattr(configs, "_table", lambda: table)
        configs._table_choice.cache_clear()  # choices are memoised per process

    yield patch
    configs._table_choice.cache_clear()


@pytest.fixture
def rng(request):
    """A fresh random generator, reproducible for each test across processes."""
    import numpy as np

    seed = test_seed(request.node.nodeid)
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture
def fake_hopper(monkeypatch):
    """The self-test's ``main`` on a stand-in sm_90 GPU whose cases (forward, backward, decode) are
    not run: case 2 fails, the others pass. Returns the list of the cases drawn, in order."""
    import numba.cuda

    from numbaflash.tools import selftest

    device = types.SimpleNamespace(compute_capability=(9, 0), name=b"Stand-in H100")
    monkeypatch.setattr(numba.cuda, "is_available", lambda: True)
    monkeypatch.setattr(numba.cuda, "get_current_device", lambda: device)
    drawn = []

    def run(case, *_):
        drawn.append(case)
        return selftest.CaseResult(case, case.index != 2, 0.5, 0.0, "" if case.index != 2 else "stand-in")

    monkeypatch.setattr(selftest, "run_case", run)
    monkeypatch.setattr(selftest, "run_backward_case", run)
    monkeypatch.setattr(selftest, "run_decode_case", run)
    return drawn


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "rng_seed"]
        if seeds:
            report.sections.append(
                ("rng seed", f"rng seed {seeds[0]} (crc32 of the test id + NUMBAFLASH_TEST_SEED={BASE_SEED})")
            )
