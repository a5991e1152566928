"""CPU tests of benchmarks/sanitize.py: sanitizer summary parsing, the config list, job
classification, the markdown table and the worker's result check (on numpy references)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from _benchmarks import load_benchmark

from numbaflash import configs
from numbaflash.configs import CANDIDATES, FAMILY_HEAD_DIMS, SUPPORTED_HEAD_DIMS, ForwardConfig, WsConfig
from numbaflash.kernels.families import SM90_BWD, family_of
from numbaflash.kernels.shapes import BackwardConfig, DecodeConfig, MlaDecodeConfig, WsMlaConfig
from numbaflash.tools.reference import attention_reference

REPO = pathlib.Path(__file__).resolve().parents[1]


san = load_benchmark("sanitize")

# --------------------------------------------------------------------------- parse_summary

MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
worker done: ForwardConfig(head_dim=64, block_m=128, block_n=64, warp_m_tiles=1): 0 wrong results
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at cudapy::forward_kernel+0x1a30
=========     by thread (5,0,0) in block (1,3,0)
=========     Address 0x7f3a2c000400 is out of bounds
=========     and is 1,024 bytes after the nearest allocation at 0x7f3a2c000000 of size 0 bytes
=========
========= ERROR SUMMARY: 25 errors
========= ERROR SUMMARY: 5 errors were not printed. Use --print-limit option to adjust the number of \
printed errors
"""
RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
worker done: WsConfig(head_dim=64, block_n=128): 0 wrong results
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
RACECHECK_ERRORS = """\
========= Error: Race reported between Write access at cudapy::forward_kernel+0x2c0
=========     and Read access at cudapy::forward_kernel+0x1f0 [512 hazards]
=========
========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)
"""
RACECHECK_WARNINGS = """\
========= Warning: Race reported between Write access at cudapy::forward_kernel+0x2c0
=========     and Write access at cudapy::forward_kernel+0x2c0 [32 hazards]
========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)
========= ERROR SUMMARY: 2 errors
"""
SYNCCHECK_ERROR = """\
========= Barrier error detected. Divergent thread(s) in warp
=========     at cudapy::forward_kernel+0x410
=========     by thread (33,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 1 error
"""
INITCHECK_ERRORS = """\
========= Uninitialized __global__ memory read of size 4 bytes
=========     at cudapy::forward_kernel+0x880
=========     by thread (0,0,0) in block (0,1,0)
=========     Address 0x7f1e4a000000
=========
========= ERROR SUMMARY: 4 errors
"""
CRASHED = """\
========= COMPUTE-SANITIZER
Traceback (most recent call last):
  File "benchmarks/sanitize.py", line 1, in <module>
numba.cuda.cudadrv.driver.CudaAPIError: [700] Call to cuCtxSynchronize results in CUDA_ERROR_ILLEGAL_ADDRESS
========= Target application terminated before first instrumented API call
"""


@pytest.mark.parametrize("tool, text, expected", [
    ("memcheck", MEMCHECK_CLEAN, 0),
    ("memcheck", MEMCHECK_ERRORS, 25),  # "N errors were not printed" is not counted again
    ("racecheck", RACECHECK_CLEAN, 0),
    ("racecheck", RACECHECK_ERRORS, 2),
    ("racecheck", RACECHECK_WARNINGS, 0),  # warnings only: 0 errors, whatever ERROR SUMMARY says
    ("racecheck", MEMCHECK_CLEAN, 0),  # no RACECHECK SUMMARY: its ERROR SUMMARY
    ("synccheck", SYNCCHECK_ERROR, 1),
    ("synccheck", MEMCHECK_CLEAN, 0),
    ("initcheck", INITCHECK_ERRORS, 4),
    ("initcheck", MEMCHECK_CLEAN, 0),
    ("memcheck", CRASHED, None),
    ("racecheck", CRASHED, None),
    ("memcheck", "", None),
])
def test_parse_summary(tool, text, expected):
    assert san.parse_summary(tool, text) == expected


def test_parse_summary_sums_processes():
    assert san.parse_summary("memcheck", MEMCHECK_ERRORS + MEMCHECK_CLEAN + SYNCCHECK_ERROR) == 26


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("capability, families", [((9, 0), ["sm90", "sm80"]), ((8, 0), ["sm80"]),
                                                   ((8, 9), ["sm80"])])
def test_runnable_configs(capability, families):
    got = san.runnable_configs(capability)
    assert got == sorted(got, key=str) and len(set(got)) == len(got)
    assert got == san.runnable_configs(capability)  # stable: parent and worker agree
    for fam in families:
        for d in FAMILY_HEAD_DIMS[fam]:
            assert set(CANDIDATES[(fam, d)]) <= set(got)
    limit = configs.max_shared_bytes(capability)
    # the pairs: every GPU runs the mma.sync family's (and (512, 256)'s small config, the 99 KB GPUs')
    fallbacks = [c for cs in configs.ASYMMETRIC_FALLBACKS.values() for c in cs]
    pairs = {c for c in (*configs.ASYMMETRIC_DEFAULTS.values(), *fallbacks) if c.shared_bytes <= limit}
    if "sm90" in families:  # and Hopper its own forward and backward of the pair
        pairs |= set(configs.ASYMMETRIC_WS_DEFAULTS.values()) | set(configs.ASYMMETRIC_BACKWARD_WS.values())
    pairs |= set(san.pair_decode_configs(capability))  # and the pair's decode, contiguous and paged
    assert {(c.head_dim, c.value_dim, c.paged) for c in san.pair_decode_configs(capability)} == {
        (192, 128, False), (192, 128, True)}
    pairs |= {configs.backward_for_target(c, capability)
              for cs in configs.ASYMMETRIC_BACKWARD_DEFAULTS.values() for c in cs if c.shared_bytes <= limit}
    pairs |= {c for c in configs.shipped_mla_decode_configs() if c.shared_bytes <= limit}  # MLA decode's
    assert {c.head_dim for c in got if c not in pairs} == set(SUPPORTED_HEAD_DIMS)  # the new dims too
    assert pairs <= set(got)
    shipped = {c for fam, _, _, c in configs.shipped_configs() if fam in families}
    assert shipped <= set(got)
    assert any(isinstance(c, ForwardConfig) for c in got)
    assert any(isinstance(c, WsConfig) for c in got) == ("sm90" in families)
    expected = {c for fam in families for d in FAMILY_HEAD_DIMS[fam] for c in CANDIDATES[(fam, d)]} | shipped
    limit = configs.max_shared_bytes(capability)  # and the backward's, every GPU runs them
    expected |= {configs.backward_for_target(c, capability) for cs in configs.BACKWARD_CANDIDATES.values()
                 for c in cs if c.shared_bytes <= limit}
    # the shipped backward configs this GPU runs: the mma.sync ones (among the candidates) and, on
    # Hopper only, the Hopper backward's
    shipped_backward = {configs.backward_for_target(c, capability)
                        for _, _, c in configs.shipped_backward_configs()
                        if c.shared_bytes <= limit and configs.backward_runnable(c, capability)}
    own = {c for c in shipped_backward if family_of(c) is SM90_BWD}
    assert bool(own) == ("sm90" in families), own
    assert shipped_backward - own <= expected
    expected |= shipped_backward
    expected |= {c for c in configs.shipped_decode_configs() if c.shared_bytes <= limit}  # decode's
    expected |= {c for c in configs.shipped_mla_decode_configs() if c.shared_bytes <= limit}  # MLA's
    assert set(got) == expected | pairs


def test_select_indices():
    cl = san.runnable_configs((9, 0))
    assert san.select_indices(None, cl) == list(range(len(cl)))
    assert san.select_indices("3, 1,3", cl) == [1, 3]
    ws = san.select_indices("WsConfig", cl)
    assert ws and all(isinstance(cl[i], WsConfig) for i in ws)
    assert san.select_indices("head_dim=64, block_n=128", cl) == [
        i for i, c in enumerate(cl) if "head_dim=64, block_n=128" in str(c)]
    with pytest.raises(ValueError, match="out of range"):
        san.select_indices(str(len(cl)), cl)
    shipped = [cl[i] for i in san.select_indices("shipped", cl, (9, 0))]
    assert set(shipped) == ({c for _, _, _, c in san.configs.shipped_configs()}
                            | {configs.backward_for_target(c, (9, 0))
                               for _, _, c in san.configs.shipped_backward_configs()}
                            | set(san.configs.shipped_decode_configs())
                            | set(san.configs.shipped_mla_decode_configs())
                            | set(configs.ASYMMETRIC_DEFAULTS.values())
                            | {c for cs in configs.ASYMMETRIC_FALLBACKS.values() for c in cs}
                            | set(configs.ASYMMETRIC_WS_DEFAULTS.values())
                            | set(san.pair_decode_configs((9, 0)))
                            | {configs.backward_for_target(c, (9, 0))
                               for cs in configs.ASYMMETRIC_BACKWARD_DEFAULTS.values() for c in cs})
    assert len(shipped) < len(cl)


def test_worker_shapes_cover_the_edges():
    for config in san.runnable_configs((9, 0)):
        if isinstance(config, (DecodeConfig, MlaDecodeConfig, WsMlaConfig)):  # decode_cases, mla_cases
            continue
        rows = config.block_n if isinstance(config, san.BackwardConfig) else config.block_m  # CTA blocks
        shapes = san.worker_shapes(rows)
        assert any(sq >= sk + 2 * rows for _, sq, sk, _, _ in shapes)  # fully masked CTAs / query blocks
        assert any(sq < sk for _, sq, sk, _, _ in shapes)
        assert any(hq > hkv > 1 for *_, hq, hkv in shapes) and any(hkv == 1 for *_, hkv in shapes)
        assert any(sq % rows and sk % 16 for _, sq, sk, _, _ in shapes)  # ragged
        assert all(b == 2 for b, *_ in shapes)


def test_varlen_case_covers_the_edges():
    """Every mma.sync config's varlen case: three sequences, one with keys and no query row, one
    query row with no key, a ragged one with whole causal blocks that see no key; the plain, the
    causal and a window + softcap kernel."""
    sm80 = [c for c in san.runnable_configs((9, 0)) if isinstance(c, ForwardConfig)]
    assert sm80
    for config in sm80:
        lengths_q, lengths_k = san.varlen_lengths(config.block_m)
        pairs = list(zip(lengths_q, lengths_k, strict=True))
        assert len(pairs) == 3 and sum(lengths_q) >= 1 and sum(lengths_k) >= 1
        assert (0, 5) in pairs and (1, 0) in pairs
        sq, sk = pairs[2]
        assert sq >= sk + 2 * config.block_m and sq % config.block_m and sk % 16
    assert {causal for causal, _, _ in san.VARLEN_CASES} == {False, True}
    assert any(window != (-1, -1) and softcap > 0 for _, window, softcap in san.VARLEN_CASES)
    assert ((False, (-1, -1), 0.0) in san.VARLEN_CASES) and ((True, (-1, -1), 0.0) in san.VARLEN_CASES)


class _HostBuffer:
    """A stand-in for a device array: a numpy array with ``copy_to_host``."""

    def __init__(self, array):
        self.array = np.array(array)

    def copy_to_host(self):
        return self.array.copy()


@pytest.mark.parametrize("broken", [False, True])
def test_varlen_worker_with_a_stand_in(monkeypatch, capsys, broken):
    """The worker's varlen calls (no GPU: host stand-ins for the device arrays and the kernel):
    each gets the case's offsets, maxima and options and a NaN-poisoned out, the config forced
    causal and not; a float64 result passes, an unwritten row of the keyless sequence is WRONG."""
    import numba.cuda

    import numbaflash
    import numbaflash.runtime.buffers
    from numbaflash.tools.reference import varlen_attention_reference

    config = next(c for c in san.runnable_configs((9, 0)) if isinstance(c, ForwardConfig))
    seen = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, return_lse, out, window_size, softcap,
                 learnable_sink=None):
        q, k, v, cu_q, cu_k = (x.array if isinstance(x, _HostBuffer) else x for x in (q, k, v, cu_q, cu_k))
        sink = None if learnable_sink is None else learnable_sink.array
        assert np.isnan(out.array.astype(np.float32)).all()
        assert (max_q, max_k) == (int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))
        for either in (False, True):  # what the varlen kernel of either kind would launch
            chosen = configs.forward_config((9, 0), config.head_dim, either, varlen=True)
            assert chosen == config
        seen.append((causal, window_size, softcap, return_lse, sink is not None))
        options = {"causal": causal, "window_size": window_size, "softcap": softcap, "sink": sink}
        got, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, rounding_dtype=q.dtype, **options)
        _, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, **options)
        if broken:
            got[int(cu_q[1])] = np.nan  # sequence 1: one query row, no key
        out.array[...] = got.astype(q.dtype)
        return (out, _HostBuffer(lse.astype(np.float32))) if return_lse else out

    monkeypatch.setattr(numbaflash.runtime.buffers, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(numba.cuda, "to_device", _HostBuffer)
    monkeypatch.setattr(numbaflash, "flash_attention_varlen", stand_in)
    failures = san.run_varlen_worker(config, (9, 0), np.float16, np.random.default_rng(0))
    plain = [(c, w, s, lse, False) for c, w, s in san.VARLEN_CASES for lse in (False, True)]
    assert sorted(seen) == sorted(plain + [(c, w, s, True, True) for c, w, s in san.VARLEN_SINK_CASES])
    printed = capsys.readouterr().out
    if broken:  # every call wrong, with two problems: the keyless row, and a non-finite output
        calls = 2 * len(san.VARLEN_CASES) + len(san.VARLEN_SINK_CASES)
        assert failures == calls and printed.count("WRONG") == 2 * failures
        assert "sequence 1 (seqlen_q 1, seqlen_k 0)" in printed and "non-finite" in printed
    else:
        assert failures == 0 and printed == ""


def test_job_command():
    cmd = san.job_command("/cs", "racecheck", 7, "sm90", 20)
    assert cmd[:7] == ["/cs", "--tool", "racecheck", "--error-exitcode", "1", "--print-limit", "20"]
    assert cmd[7:9] == ["--racecheck-report", "all"]
    assert cmd[-5:] == ["--worker", "--config-index", "7", "--arch", "sm90"]
    assert "--racecheck-report" not in san.job_command("/cs", "memcheck", 0, "sm80", 5)


# --------------------------------------------------------------------------- results and table


@pytest.mark.parametrize("tool, rc, errors, cell, ok", [
    ("memcheck", 0, 0, "0", True),
    ("memcheck", 1, 3, "3", False),
    ("memcheck", None, None, "TIMEOUT", False),
    ("memcheck", -11, None, "CRASH rc=-11", False),
    ("memcheck", 4, 0, "CRASH rc=4", False),
    ("memcheck", 1, 0, "CRASH rc=1", False),
    ("initcheck", 3, 0, "WRONG", False),
    ("racecheck", 1, 0, "0", True),  # warnings only
    ("racecheck", 1, 2, "2", False),
])
def test_job_result(tool, rc, errors, cell, ok):
    r = san.JobResult(tool, 0, rc, errors)
    assert r.cell == cell and r.ok == ok


def test_job_result_needs_the_worker_to_finish():
    """A summary of 0 with rc 0 or 1 is no pass if the worker never printed its last line."""
    for tool, rc in (("memcheck", 0), ("racecheck", 1)):
        r = san.JobResult(tool, 0, rc, 0, finished=False)
        assert not r.ok and r.cell == f"CRASH rc={rc}"


def test_format_table_and_summary():
    fwd, wg = ForwardConfig(64, 128, 64), WsConfig(128, 64, 3)
    results = {
        ("memcheck", 0): san.JobResult("memcheck", 0, 0, 0),
        ("racecheck", 0): san.JobResult("racecheck", 0, 1, 2),
        ("memcheck", 5): san.JobResult("memcheck", 5, None, None),
    }
    table = san.format_table([(0, fwd), (5, wg)], results, ["memcheck", "racecheck"])
    lines = table.splitlines()
    assert lines[0] == "| # | config | family | head_dim | memcheck | racecheck |"
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == f"| 0 | {fwd} | sm80 | 64 | 0 | 2 |"
    assert lines[3] == f"| 5 | {wg} | sm90 | 128 | TIMEOUT | - |"
    assert san.summary_line(list(results.values())) == "sanitizer: 3 jobs, 2 errors (2 jobs failed)"
    assert san.summary_line([results[("memcheck", 0)]]) == "sanitizer: 1 jobs, 0 errors"


# --------------------------------------------------------------------------- worker check


def _case(dtype, sq=40, sk=10, hq=4, hkv=2, d=64, causal=True):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, sq, hq, d)).astype(dtype)
    k, v = (rng.standard_normal((2, sk, hkv, d)).astype(dtype) for _ in range(2))
    out, _ = attention_reference(q, k, v, causal=causal, rounding_dtype=dtype)  # as if computed in dtype
    _, lse = attention_reference(q, k, v, causal=causal)  # the kernel's LSE is float32
    return q, k, v, out.astype(dtype), lse.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_check_result_accepts_reference(dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v, out, lse = _case(dtype)
    assert san.check_result(q, k, v, True, out, lse) == []
    assert san.check_result(q, k, v, True, out, None) == []


def test_check_result_catches_wrong_results():
    q, k, v, out, lse = _case(np.float16)  # causal, sq 40 > sk 10: rows 0..29 see no key
    bad = out.copy()
    bad[1, 3, 2, 5] = np.nan
    assert any("non-finite" in p for p in san.check_result(q, k, v, True, bad, lse))
    bad = out.copy()
    bad[0, 0, 0, 0] = 1e-3
    assert any("see no key" in p for p in san.check_result(q, k, v, True, bad, lse))
    bad = out.copy()
    bad[0, 35] += 0.5
    assert any("max error" in p for p in san.check_result(q, k, v, True, bad, lse))
    bad_lse = lse.copy()
    bad_lse[0, 0, 0] = 0.0
    assert any("LSE is not -inf exactly" in p for p in san.check_result(q, k, v, True, out, bad_lse))
    bad_lse = lse.copy()
    bad_lse[0, 0, 35] += 1.0
    assert any("LSE max abs error" in p for p in san.check_result(q, k, v, True, out, bad_lse))


# --------------------------------------------------------------------------- parent, fake sanitizer

FAKE_SANITIZER = """\
import sys, time
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Compute Sanitizer\\nVersion 2099.1.0")
    sys.exit(0)
tool, index = args[args.index("--tool") + 1], int(args[args.index("--config-index") + 1])
if (tool, index) == ("synccheck", 2):
    time.sleep(60)
if (tool, index) == ("memcheck", 1):
    print("worker done: fake")
    print("========= ERROR SUMMARY: 2 errors")
    sys.exit(1)
if (tool, index) == ("synccheck", 1):  # a worker whose results failed the check
    print("\\n".join(f"WRONG case {c}" for c in "abcd"))
    print("worker done: fake")
    print("========= ERROR SUMMARY: 0 errors")
    sys.exit(3)
if (tool, index) != ("memcheck", 2):  # exits 0 with no errors, but before the worker's end
    print("worker done: fake")
print("========= ERROR SUMMARY: 0 errors")
"""


def test_main_with_fake_sanitizer(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_SANITIZER)
    fake.chmod(0o755)
    monkeypatch.setattr(san, "gpu_info", lambda: ((9, 0), "Fake H100"))
    logs = tmp_path / "logs"
    rc = san.main(["--sanitizer", str(fake), "--tools", "memcheck,synccheck", "--configs", "0,1,2",
                   "--jobs", "6", "--timeout", "3", "--log-dir", str(logs)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "GPU: Fake H100" in out and "Version 2099.1.0" in out and str(logs) in out
    cl = san.runnable_configs((9, 0))
    assert f"| 0 | {cl[0]} | {san.kernel_family(cl[0])} | {cl[0].head_dim} | 0 | 0 |" in out
    assert f"| 1 | {cl[1]} | {san.kernel_family(cl[1])} | {cl[1].head_dim} | 2 | WRONG |" in out
    assert f"| 2 | {cl[2]} | {san.kernel_family(cl[2])} | {cl[2].head_dim} | CRASH rc=0 | TIMEOUT |" in out
    # a WRONG job's first failing cases come with the summary, so one run names them
    assert "#1 synccheck: WRONG case a\n#1 synccheck: WRONG case b\n#1 synccheck: WRONG case c\n" in out
    assert "WRONG case d" not in out
    assert out.rstrip().endswith("sanitizer: 6 jobs, 2 errors (4 jobs failed)")
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        f"{t}_{i}.log" for t in ("memcheck", "synccheck") for i in range(3))
    assert "--worker --config-index 1 --arch sm90" in (logs / "memcheck_1.log").read_text()


def test_decode_cases_dispatch_to_their_config():
    """The decode worker's (group, seqlen_q) cases pack into the rows of the config they test."""
    for config in configs.shipped_decode_configs():
        for group, sq in san.decode_cases(config):
            chosen = configs.decode_config((9, 0), config.head_dim, group * sq, config.paged)
            assert chosen.m_tiles == config.m_tiles


def test_mla_cases_dispatch_to_their_config():
    """The MLA worker's (heads, seqlen_q) cases dispatch to the config they test on a GPU that ships it."""
    caps = [*configs.FAMILY_CAPABILITY.values(), *configs.SMALL_SHARED_CAPABILITIES]
    for config in configs.shipped_mla_decode_configs():
        ships = [cap for cap in caps if config in configs.mla_decode_configs_for(cap)]
        for heads, sq in san.mla_cases(config):
            assert any(configs.mla_decode_config(cap, heads * sq, config.paged) == config for cap in ships)


@pytest.mark.parametrize("broken", [False, True])
def test_varlen_backward_case_with_a_stand_in(monkeypatch, capsys, broken):
    """The backward worker's varlen case (no GPU: host stand-ins for the device arrays and both
    passes): the backward gets the offsets, maxima, deterministic mode and NaN-poisoned dq, dk,
    dv with the config forced; float64 gradients pass, an unwritten dk row of the sequence with
    keys and no query row is WRONG."""
    import numba.cuda

    import numbaflash
    import numbaflash.runtime.buffers
    from numbaflash.tools.reference import varlen_attention_backward_reference, varlen_attention_reference

    config = next(c for c in san.runnable_configs((9, 0)) if isinstance(c, BackwardConfig))
    seen = []

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, return_lse, out):
        q, k, v, cu_q, cu_k = (x.array for x in (q, k, v, cu_q, cu_k))
        # O goes into a NaN-poisoned buffer written from the host (initcheck, notebook ICTMA)
        assert np.isnan(out.array.astype(np.float32)).all() and out.array.dtype == q.dtype
        o, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal)
        out.array[...] = o.astype(q.dtype)
        return out, _HostBuffer(lse.astype(np.float32))

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, deterministic, dq, dk, dv):
        dout, q, k, v, cu_q, cu_k = (x.array for x in (dout, q, k, v, cu_q, cu_k))
        assert all(np.isnan(g.array.astype(np.float32)).all() for g in (dq, dk, dv))
        assert (max_q, max_k) == (int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))
        assert config in configs.OVERRIDES.values()  # forced
        seen.append((causal, deterministic))
        grads = varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k, causal=causal)
        for g, ref in zip((dq, dk, dv), grads, strict=True):
            g.array[...] = ref.astype(q.dtype)
        if broken:
            dk.array[0] = np.nan  # sequence 0: keys, no query row
        return dq, dk, dv

    monkeypatch.setattr(numbaflash.runtime.buffers, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(numba.cuda, "to_device", _HostBuffer)
    monkeypatch.setattr(numbaflash, "flash_attention_varlen", forward)
    monkeypatch.setattr(numbaflash, "flash_attention_varlen_backward", backward)
    failures = san.run_varlen_backward_case(config, (9, 0), np.float16, np.random.default_rng(0), causal=True)
    assert seen == [(True, True)]
    printed = capsys.readouterr().out
    if broken:
        assert failures == 1 and "sequence 0 (seqlen_q 0, seqlen_k 5)" in printed
    else:
        assert failures == 0 and printed == ""


@pytest.mark.parametrize("broken", [False, True])
def test_varlen_backward_sink_case_with_a_stand_in(monkeypatch, capsys, broken):
    """The backward worker's varlen case with a learnable sink (issue 56): both passes get the
    sink, the backward returns d_sink fourth and it is checked (a d_sink off by one is WRONG)."""
    import numba.cuda

    import numbaflash
    import numbaflash.runtime.buffers
    from numbaflash.tools.reference import varlen_attention_backward_reference, varlen_attention_reference

    config = next(c for c in san.runnable_configs((9, 0)) if isinstance(c, BackwardConfig))
    sink = san.sink_logits(4)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, return_lse, learnable_sink, out):
        q, k, v, cu_q, cu_k = (x.array for x in (q, k, v, cu_q, cu_k))
        assert np.array_equal(learnable_sink.array, sink)
        assert np.isnan(out.array.astype(np.float32)).all()
        o, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=causal, sink=sink)
        out.array[...] = o.astype(q.dtype)
        return out, _HostBuffer(lse.astype(np.float32))

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, deterministic, dq, dk, dv,
                 learnable_sink):
        dout, q, k, v, cu_q, cu_k = (x.array for x in (dout, q, k, v, cu_q, cu_k))
        grads = varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k, causal=causal,
                                                    sink=learnable_sink.array)
        for g, ref in zip((dq, dk, dv), grads[:3], strict=True):
            g.array[...] = ref.astype(q.dtype)
        d_sink = grads[3].astype(np.float32) + (1.0 if broken else 0.0)
        return dq, dk, dv, _HostBuffer(d_sink)

    monkeypatch.setattr(numbaflash.runtime.buffers, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(numba.cuda, "to_device", _HostBuffer)
    monkeypatch.setattr(numbaflash, "flash_attention_varlen", forward)
    monkeypatch.setattr(numbaflash, "flash_attention_varlen_backward", backward)
    failures = san.run_varlen_backward_case(config, (9, 0), np.float16, np.random.default_rng(0), causal=True,
                                            sink=sink)
    printed = capsys.readouterr().out
    if broken:
        assert failures == 1 and "d_sink max error" in printed and "sink:" in printed
    else:
        assert failures == 0 and printed == ""


@pytest.mark.parametrize("paged", [False, True])
def test_decode_worker_with_a_stand_in(monkeypatch, capsys, paged):
    """The decode worker's calls (no GPU: host stand-ins for the device arrays and the kernel, the
    float64 ``kvcache_reference`` as the call): every case, the cache options' (issue 56) included,
    gets its arrays, and the worker's own expectation of each sequence's keys (the cache row
    cache_batch_idx[b], from cache_leftpad[b]) agrees with the reference."""
    import numba.cuda

    import numbaflash
    import numbaflash.runtime.buffers
    from numbaflash.tools.reference import kvcache_reference

    config = next(c for c in configs.shipped_decode_configs() if c.paged == paged and c.head_dim == 64)
    seen = []

    def stand_in(q, k_cache, v_cache, cache_seqlens, *, block_table, causal, num_splits, return_lse, out,
                 window_size, softcap, learnable_sink=None, cache_batch_idx=None, cache_leftpad=None,
                 k_new=None, v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False):
        host = {name: None if x is None else x.array for name, x in (
            ("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("lens", cache_seqlens),
            ("table", block_table), ("sink", learnable_sink), ("idx", cache_batch_idx),
            ("pad", cache_leftpad), ("k_new", k_new), ("v_new", v_new), ("cos", rotary_cos),
            ("sin", rotary_sin))}
        assert np.isnan(out.array.astype(np.float32)).all()
        rotary = 0 if host["cos"] is None else 1 + rotary_interleaved
        seen.append((window_size, softcap, causal, host["sink"] is not None, host["idx"] is not None,
                     host["pad"] is not None, rotary))
        args = (host["q"], host["k_cache"], host["v_cache"], host["lens"])
        kw = {"k_new": host["k_new"], "v_new": host["v_new"], "block_table": host["table"],
              "cache_batch_idx": host["idx"], "cache_leftpad": host["pad"], "causal": causal,
              "window_size": window_size, "softcap": softcap, "sink": host["sink"], "rotary_cos": host["cos"],
              "rotary_sin": host["sin"], "rotary_interleaved": rotary_interleaved}
        got = kvcache_reference(*args, rounding_dtype=host["q"].dtype, **kw)[0]
        lse = kvcache_reference(*args, **kw)[1]
        out.array[...] = got.astype(host["q"].dtype)
        return out, _HostBuffer(lse.astype(np.float32))

    monkeypatch.setattr(numbaflash.runtime.buffers, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(numba.cuda, "to_device", _HostBuffer)
    monkeypatch.setattr(numbaflash, "flash_attention_with_kvcache", stand_in)
    assert san.run_decode_worker(config) == 0
    assert "0 wrong results" in capsys.readouterr().out
    options = {(w, s, c, False, idx is not None, pad is not None, rotary)
               for w, s, c, idx, pad, rotary in san.DECODE_OPTION_CASES}
    assert options <= set(seen) and {o[6] for o in options} == {0, 1, 2}
