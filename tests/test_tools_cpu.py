"""CPU tests of the tools' pure-Python parts: bench arguments, FLOPs, tables and CSV; ncu CSV
parsing; the debug report on deliberately broken numpy implementations."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import math
import pathlib
import statistics
import sys

import numpy as np
import pytest
from _benchmarks import load_benchmark

from numbaflash.tools import bench, debug
from numbaflash.tools.reference import attention_reference

REPO = pathlib.Path(__file__).resolve().parents[1]


ncu = load_benchmark("ncu_profile")


# --------------------------------------------------------------------------- bench: arguments


def test_parse_sizes():
    assert bench.parse_size("512") == 512
    assert bench.parse_size("4k") == 4096
    assert bench.parse_size("16K") == 16384
    assert bench.parse_size_list("512,1k, 16k") == [512, 1024, 16384]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_size_list("0,512")


def test_default_arguments_and_workload():
    args = bench.parse_args([])
    assert args.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert args.head_dims == [64, 128]
    assert args.causal == "both" and args.dtype == "fp16"
    assert args.backends == ["numbaflash", "flash", "cudnn", "efficient"]
    shapes = bench.shapes_from_args(args)
    assert len(shapes) == 6 * 2 * 2
    for s in shapes:  # 64k tokens, model width 2048
        assert s.batch * s.seqlen_q == 65536
        assert s.heads * s.head_dim == 2048
        assert s.seqlen_q == s.seqlen_k


def test_explicit_arguments():
    args = bench.parse_args([
        "--seqlens", "1k,4k", "--head-dims", "128", "--causal", "yes", "--dtype", "both",
        "--repeats", "7", "--warmup", "2", "--backends", "numbaflash,cudnn", "--csv", "out.csv",
        "--plot", "out.png", "--check", "--sanity",
    ])
    shapes = bench.shapes_from_args(args)
    assert [(s.dtype, s.causal, s.head_dim, s.seqlen_q, s.batch, s.heads) for s in shapes] == [
        ("fp16", True, 128, 1024, 64, 16), ("fp16", True, 128, 4096, 16, 16),
        ("bf16", True, 128, 1024, 64, 16), ("bf16", True, 128, 4096, 16, 16),
    ]
    assert args.repeats == 7 and args.warmup == 2 and args.check and args.sanity
    assert args.backends == ["numbaflash", "cudnn"] and args.csv == "out.csv" and args.plot == "out.png"
    assert bench.parse_args(["--backends", "all"]).backends == list(bench.IMPLS)
    fixed = bench.shapes_from_args(bench.parse_args(["--seqlens", "2k", "--head-dims", "64",
                                                     "--causal", "no", "--batch", "3", "--heads", "5"]))
    assert [(s.batch, s.heads) for s in fixed] == [(3, 5)]


@pytest.mark.parametrize("argv", [["--backends", "flash,bogus"], ["--causal", "maybe"], ["--repeats", "0"],
                                  ["--dtype", "fp8"], ["--seqlens", "abc"]])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


# --------------------------------------------------------------------------- bench: FLOPs


def test_flops_convention():
    # 4·B·H·Sq·Sk·D, halved for causal.
    assert bench.attention_flops(16, 16, 4096, 4096, 128, False) == 4 * 16 * 16 * 4096 * 4096 * 128
    assert bench.attention_flops(16, 16, 4096, 4096, 128, True) == 2 * 16 * 16 * 4096 * 4096 * 128
    shape = bench.Shape(16, 16, 4096, 4096, 128, True, "fp16")
    assert shape.flops() == bench.attention_flops(16, 16, 4096, 4096, 128, True)


@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (5, 9), (9, 5), (64, 3), (3, 64)])
def test_exact_causal_pairs_match_the_mask(sq, sk):
    visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)  # bottom-right aligned
    assert bench.causal_pairs(sq, sk) == int(visible.sum())
    assert bench.attention_flops(2, 3, sq, sk, 64, True, exact=True) == 4 * 2 * 3 * int(visible.sum()) * 64


def test_exact_causal_square_is_triangle():
    assert bench.causal_pairs(4096, 4096) == 4096 * 4097 // 2


def test_input_sets_cover_l2():
    assert bench.input_sets_needed(1 << 30, 50 << 20) == 2  # big sets: the minimum of 2
    assert bench.input_sets_needed(10 << 20, 50 << 20) == 8  # capped
    n = bench.input_sets_needed(40 << 20, 50 << 20)
    assert n * (40 << 20) >= 3 * (50 << 20)


# --------------------------------------------------------------------------- bench: tables, CSV


def _results():
    s1 = bench.Shape(16, 16, 4096, 4096, 128, False, "fp16")
    s2 = bench.Shape(16, 16, 4096, 4096, 128, True, "fp16")
    ms = s1.flops() / 300e12 * 1e3  # 300 TFLOP/s
    return [
        bench.Result(s1, "numbaflash", [ms * 2, ms * 2, ms * 2]),  # 150 TFLOP/s
        bench.Result(s1, "flash", [ms, ms * 1.1, ms * 0.9]),  # median ms -> 300
        bench.Result(s2, "numbaflash", error="RuntimeError: boom"),
        bench.Result(s2, "flash", [ms / 2]),  # causal: half the FLOPs in half the time -> 300
    ]


def test_result_tflops():
    r = _results()
    assert r[0].tflops == pytest.approx(150.0)
    assert r[1].tflops == pytest.approx(300.0)
    assert r[1].median_ms == pytest.approx(r[1].times_ms[0])
    assert math.isnan(r[2].tflops) and not r[2].ok
    assert r[3].tflops == pytest.approx(300.0)


def test_format_results_table():
    text = bench.format_results(_results(), ["numbaflash", "flash"])
    lines = text.splitlines()
    assert "numbaflash TF/s" in lines[0] and "sdpa-flash TF/s" in lines[0] and "nf/flash" in lines[0]
    assert len({len(line) for line in lines[:4]}) == 1  # aligned Markdown rows
    assert "150.0" in lines[2] and "300.0" in lines[2] and "0.50" in lines[2]
    assert "err" in lines[3] and "300.0" in lines[3]
    assert "Errors:" in text and "RuntimeError: boom" in text


def test_render_table_markdown():
    text = bench.render_table(["a", "bbb"], [["1", "2"], ["333", "4"]])
    lines = text.splitlines()
    assert lines[0].startswith("| ") and lines[1].startswith("|-") and lines[1].endswith(":|")
    assert len({len(line) for line in lines}) == 1


def test_csv_round_trip():
    text = bench.results_to_csv(_results())
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == list(bench.CSV_FIELDS)
    assert len(rows) == 4
    assert rows[0]["impl"] == "numbaflash" and float(rows[0]["tflops"]) == pytest.approx(150.0, rel=1e-3)
    assert rows[1]["impl"] == "sdpa-flash" and rows[1]["repeats"] == "3"
    assert rows[2]["tflops"] == "" and rows[2]["error"] == "RuntimeError: boom"
    assert rows[3]["causal"] == "1" and float(rows[3]["flops"]) == pytest.approx(_results()[3].shape.flops())


def test_parse_nvidia_smi():
    info = bench.parse_nvidia_smi("NVIDIA H100 80GB HBM3, 1980, 1980, 570.86.15\n")
    assert info == {"name": "NVIDIA H100 80GB HBM3", "sm_clock": "1980", "max_sm_clock": "1980",
                    "driver": "570.86.15"}
    assert bench.parse_nvidia_smi("garbage") == {}


class _FakeEvent:
    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock["now"]


class _FakeDevice:
    """Time advances only inside calls: event pairs measure exactly the call."""

    def __init__(self):
        self.clock = {"now": 0.0}
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1

    def event(self):
        return _FakeEvent(self.clock)

    def elapsed_ms(self, a, b):
        return b.t - a.t

    def sleep(self):
        self.clock["now"] += 1000.0


def test_time_with_events_rotates_sets_and_times_each_call():
    dev = _FakeDevice()
    order = []

    def make(i, ms):
        def call():
            order.append(i)
            dev.clock["now"] += ms
        return call

    times = bench.time_with_events(dev, [make(0, 1.0), make(1, 2.0), make(2, 3.0)], warmup=2, repeats=7)
    # warm-up: 1 compile call, 3 timing-estimate calls, then >= 2 more; then 7 timed calls
    assert order[:4] == [0, 0, 1, 2] and len(order) == 4 + 2 + 7
    assert order[-7:] == [0, 1, 2, 0, 1, 2, 0]
    assert times == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0]
    plain = bench.time_plain_loop(dev, [make(0, 0.0)], warmup=1, repeats=3)
    assert plain >= 0.0


def test_round_orders_alternate():
    assert bench.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert bench.round_orders(["a"], 1) == [["a"]]


def test_sweep_interleaves_rounds_and_keeps_every_call(monkeypatch):
    """--rounds 3 --repeats 7: each implementation timed in blocks of 3, 2, 2 calls, in the
    order a b / b a / a b; one Result each with all 7 times."""
    blocks = []

    def fake_run_one(device, impl, shape, sets, args, repeats=None, result=None):
        blocks.append((impl, repeats))
        result.times_ms.extend([1.0] * repeats)
        return result

    monkeypatch.setattr(bench, "run_one", fake_run_one)

    class Dev:
        def make_inputs(self, shape, n_sets, seed):
            return [None] * n_sets

        def l2_bytes(self):
            return 50 << 20

    args = bench.parse_args(["--repeats", "7", "--rounds", "3", "--seqlens", "1k", "--head-dims", "64",
                             "--causal", "no", "--no-progress"])
    shapes = bench.shapes_from_args(args)
    results = bench.run_sweep(Dev(), shapes, ["a", "b"], args)
    assert blocks == [("a", 3), ("b", 3), ("b", 2), ("a", 2), ("a", 2), ("b", 2)]
    assert [(r.impl, len(r.times_ms)) for r in results] == [("a", 7), ("b", 7)]


def test_warm_up_runs_for_the_requested_time(monkeypatch):
    dev = _FakeDevice()
    ticks = iter(range(1000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks) * 0.001)  # 1 ms per reading
    calls = []
    n = bench.warm_up(dev, [lambda: calls.append(1)], min_calls=2, min_ms=30.0)
    # the 3 estimate calls took 1 ms together (two clock readings): 1/3 ms each -> 90 calls
    assert n == 4 + 90 and len(calls) == n
    assert bench.warm_up(dev, [lambda: None], min_calls=2, min_ms=1e9) == 4 + bench.MAX_WARMUP_CALLS


def test_time_span_counts_gaps_and_host_issue_times_each_call():
    dev = _FakeDevice()

    def call():
        dev.clock["now"] += 2.0

    assert bench.time_span(dev, [call], warmup=1, repeats=4) == 2.0
    host = bench.time_host_issue(dev, [call], repeats=3)
    assert len(host) == 3 and all(t >= 0 for t in host)


def _sanity(events, plain, span=None, host=(0.05,) * 10):
    """``events``: per-call times of one round (used for every round) or a list of rounds."""
    rounds = events if isinstance(events[0], list) else [list(events)] * 3
    plain = plain if isinstance(plain, list) else [plain] * 3
    mean = statistics.fmean(rounds[0])
    return bench.SanityRow("numbaflash", rounds, plain, mean if span is None else span, list(host))


def test_sanity_row_agrees_within_noise():
    r = _sanity([1.0] * 10, 1.005)
    assert r.noise == 0.01 and r.agrees and r.diagnosis() == "agrees"
    assert not _sanity([1.0] * 10, 1.05).agrees


def test_sanity_row_compares_plain_loop_with_the_mean_and_reports_median_skew():
    r = _sanity([1.0] * 9 + [1.9], 1.09)  # one slow call in ten: mean 1.09, median 1.0
    assert r.events_ms == 1.0 and abs(r.events_mean_ms - 1.09) < 1e-12
    assert r.agrees and abs(r.skew - 0.09) < 1e-12
    assert "-9.0%" in bench.format_sanity([r], flops=1e12)


def test_sanity_row_noise_is_run_to_run_spread():
    r = _sanity([[1.0] * 10, [1.1] * 10, [1.05] * 10], [1.0, 1.02, 1.12])
    assert abs(r.noise - 0.12 / 1.02) < 1e-9
    assert r.agrees  # plain median 1.02 vs mean-of-rounds median 1.05


def test_sanity_row_diagnoses_each_cause():
    waits = _sanity([1.0] * 10, 1.2, span=1.2)
    assert "waits for the device" in waits.diagnosis()
    launch_bound = _sanity([0.1] * 10, 0.08, host=[0.075] * 10)
    assert launch_bound.diagnosis().startswith("launch-bound: the host needs 0.075 ms")
    jumps = _sanity([1.0] * 10, 1.2, host=[0.05] * 9 + [5.0])
    assert "some calls wait" in jumps.diagnosis() and "5.0 ms" in jumps.diagnosis()
    hiccup = _sanity([1.0] * 10, 1.2, host=[0.05] * 9 + [0.6])  # 12x the median, still no wait
    assert hiccup.diagnosis() == "differs by more than the run-to-run noise"
    assert _sanity([1.0] * 10, 1.2).diagnosis() == "differs by more than the run-to-run noise"


def test_format_sanity_table():
    text = bench.format_sanity([_sanity([1.0] * 10, 1.0)], flops=1e12)
    assert "numbaflash" in text and "1000.0" in text and "agrees" in text


def test_plot_without_or_with_matplotlib(tmp_path):
    path = tmp_path / "plot.png"
    written = bench.plot_results(_results(), str(path))
    if importlib.util.find_spec("matplotlib") is None:
        assert not written and not path.exists()
    else:
        assert written and path.stat().st_size > 0


def test_progress_disabled_is_silent(capsys):
    p = bench.Progress(3, enabled=False)
    p.update("x")
    p.close()
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- ncu CSV parsing

def _quoted(*fields: str) -> str:
    return ",".join(f'"{f}"' for f in fields)


NF_KERNEL = "_ZN10numbaflash7kernels11forward_mma14forward_kernelB2v1E"
FA_KERNEL = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
             "cutlass::half_t>, false, false>(pytorch_flash::Flash_fwd_params)")
DETAILS_HEADER = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
                  "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
                  "Metric Value")


def _details_row(kid: str, kernel: str, block: str, metric: str, unit: str, value: str) -> str:
    return _quoted(kid, "4242", "python3.12", "127.0.0.1", kernel, "1", "7", block, "(32, 16, 16)", "0",
                   "9.0", "Command line profiler metrics", metric, unit, value)


# What `ncu --csv --print-units base --metrics ...` prints (details page, one row per metric),
# with the profiler's own lines and the driver's output around it.
DETAILS_CSV = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
    "driver: numbaflash (16, 4096, 16, 128) causal=False fp16 done",
    f'==PROF== Profiling "{NF_KERNEL}" - 0: 0%....50%....100% - 38 passes',
    "==PROF== Disconnected from process 4242",
    _quoted(*DETAILS_HEADER),
    _details_row("0", NF_KERNEL, "(256, 1, 1)", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%",
                 "21.37"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)", "gpu__time_duration.sum", "nsecond", "2,345,678"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "",
                 "1,048,576"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)", "launch__registers_per_thread", "register/thread", "168"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)", "lts__t_sector_hit_rate.pct", "%", "61.5"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)",
                 "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "n/a"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)",
                 "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "43.2"),
    _details_row("0", NF_KERNEL, "(256, 1, 1)", "sm__warps_active.avg.pct_of_peak_sustained_active", "%",
                 "12.4"),
    _details_row("1", FA_KERNEL, "(128, 1, 1)", "gpu__time_duration.sum", "usecond", "1,234.5"),
    _details_row("1", FA_KERNEL, "(128, 1, 1)", "launch__registers_per_thread", "register/thread", "255"),
    "",
])

# The raw page: one row per kernel, one column per metric, then a row of units.
RAW_CSV = "\n".join([
    _quoted("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Device",
            "CC", "gpu__time_duration.sum", "launch__registers_per_thread", "lts__t_sector_hit_rate.pct"),
    _quoted("", "", "", "", "", "", "", "", "", "msecond", "register/thread", "%"),
    _quoted("0", "77", "python", "host", "flash_fwd_kernel", "1", "7", "0", "9.0", "1.5", "255", "70.25"),
    _quoted("1", "77", "python", "host", "other_kernel", "1", "7", "0", "9.0", "0.002", "32", "n/a"),
    "",
])


def test_parse_number():
    assert ncu.parse_number("1,234,567") == 1234567.0
    assert ncu.parse_number("1,234.5") == 1234.5
    assert ncu.parse_number("12.5") == 12.5
    assert ncu.parse_number("9,00") == 9.0  # decimal comma locale
    assert ncu.parse_number('"168"') == 168.0
    assert ncu.parse_number("n/a") is None and ncu.parse_number("") is None


def test_parse_details_csv():
    kernels = ncu.parse_ncu_csv(DETAILS_CSV)
    assert [k.id for k in kernels] == [0, 1]
    nf, fa = kernels
    assert nf.kernel.startswith("_ZN10numbaflash")
    assert nf.metrics["launch__registers_per_thread"] == 168
    assert nf.metrics["l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"] == 1048576
    assert nf.metrics["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"] is None
    assert nf.value("gpu__time_duration.sum") == pytest.approx(2345.678)  # ns -> us
    assert fa.kernel.startswith("void pytorch_flash::flash_fwd_kernel<")  # commas inside quotes kept
    assert fa.value("gpu__time_duration.sum") == pytest.approx(1234.5)  # already us
    assert fa.metrics["launch__registers_per_thread"] == 255


def test_parse_raw_csv_with_units_row():
    kernels = ncu.parse_ncu_csv(RAW_CSV)
    assert [k.kernel for k in kernels] == ["flash_fwd_kernel", "other_kernel"]
    assert kernels[0].value("gpu__time_duration.sum") == pytest.approx(1500.0)  # ms -> us
    assert kernels[0].metrics["lts__t_sector_hit_rate.pct"] == 70.25
    assert kernels[1].metrics["lts__t_sector_hit_rate.pct"] is None


def test_parse_nothing():
    assert ncu.parse_ncu_csv("==PROF== nothing profiled\n") == []


def test_profile_table():
    kernels = ncu.parse_ncu_csv(DETAILS_CSV)
    kernels[0].impl, kernels[1].impl = "numbaflash", "sdpa-flash"
    text = ncu.format_profile_table(kernels)
    lines = text.splitlines()
    assert "time us" in lines[0] and "regs" in lines[0] and "L2 hit %" in lines[0]
    assert "gmma %" not in lines[0]  # no kernel has a value for it
    assert "numbaflash" in lines[2] and "forward_mma::forward_kernel" in lines[2]
    assert "2345.7" in lines[2] and "168" in lines[2] and "1,048,576" in lines[2]
    assert "sdpa-flash" in lines[3] and "pytorch_flash::flash_fwd_kernel" in lines[3] and "1234.5" in lines[3]
    assert len({len(line) for line in lines}) == 1


def test_short_kernel_names():
    assert ncu.short_kernel_name("_ZN6cudapy10numbaflash7forwardB2v1E") == "numbaflash::forward"
    assert ncu.short_kernel_name("void ns::k<a<1, 2>, b>(int, float)") == "ns::k"
    assert len(ncu.short_kernel_name("x" * 100, width=20)) == 20


def test_metric_selection_and_command():
    assert "sm__inst_executed_pipe_tensor_op_gmma.sum" not in ncu.metrics_for(8)
    assert "sm__inst_executed_pipe_tensor_op_gmma.sum" in ncu.metrics_for(9)
    assert "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active" in ncu.metrics_for(8)
    assert "gpu__time_duration.sum" in ncu.metrics_for(None)
    cmd = ncu.ncu_command("ncu", ["a.sum", "b.pct"], "script.py", ["--driver"], python="py")
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    assert "--profile-from-start" in cmd and cmd[cmd.index("--metrics") + 1] == "a.sum,b.pct"
    assert cmd[-3:] == ["py", "script.py", "--driver"]
    args = ncu.build_parser().parse_args(["--seqlen", "2048", "--causal", "--batch", "4"])
    dargs = ncu.driver_args(args, "flash")
    assert dargs[:3] == ["--driver", "--impl", "flash"] and "--causal" in dargs and "4" in dargs
    assert dargs[dargs.index("--family") + 1] == "auto"  # the driver forces what the parent was told
    forced = ncu.driver_args(ncu.build_parser().parse_args(["--family", "sm80"]), "numbaflash")
    assert ncu.build_parser().parse_args(forced).family == "sm80"
    assert "--backward" not in dargs  # the forward unless asked
    backward = ncu.driver_args(ncu.build_parser().parse_args(["--backward", "--causal"]), "numbaflash")
    parsed = ncu.build_parser().parse_args(backward)
    assert parsed.backward and parsed.causal and parsed.driver


def test_failed_metrics():
    gmma = "sm__inst_executed_pipe_tensor_op_gmma.sum"
    out = f"==ERROR== Failed to find metric {gmma}\n"
    requested = ncu.metrics_for(9)
    assert ncu.failed_metrics(out, requested) == [gmma]
    assert ncu.failed_metrics("==PROF== all fine\n", requested) == []


FAKE_NCU = """#!{python}
import sys
args = sys.argv[1:]
assert args[:2] == ["--clock-control", "none"], args
metrics = args[args.index("--metrics") + 1].split(",")
if "bogus__metric.sum" in metrics:
    print("==ERROR== Failed to find metric bogus__metric.sum", file=sys.stderr)
    sys.exit(1)
impl = args[args.index("--impl") + 1]
print("==PROF== Connected to process 1")
print('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"')
for m in metrics:
    print(f'"0","{{impl}}_kernel","{{m}}","","7"')
"""


def test_profile_main_with_a_fake_ncu(tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable))
    fake.chmod(0o755)
    status = ncu.main(["--ncu", str(fake), "--impls", "numbaflash,flash", "--seqlen", "1024",
                       "--metrics", "gpu__time_duration.sum,bogus__metric.sum,launch__registers_per_thread",
                       "--save-csv", str(tmp_path / "csv")])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "retrying without" in captured.err
    lines = captured.out.splitlines()
    assert "B=64 H=16 S=1024 D=128" in lines[0]
    table = [ln for ln in lines if ln.startswith("|")]
    assert "time us" in table[0] and "regs" in table[0] and "bogus" not in table[0]
    assert "numbaflash" in table[2] and "numbaflash_kernel" in table[2]
    assert "sdpa-flash" in table[3] and "flash_kernel" in table[3]
    assert (tmp_path / "csv" / "ncu_flash.csv").exists()
    assert any(ln.startswith("GPU: ") for ln in lines)
    assert any(ln.startswith("Nsight Compute: ") for ln in lines)


# --------------------------------------------------------------------------- debug

SMALL = dict(batch=1, heads=2, seqlen_q=128, seqlen_k=128, head_dim=64, seed=3)


def test_poison_bits_roundtrip():
    out = debug.poisoned((2, 3), np.dtype(np.float16))
    assert np.isnan(out.astype(np.float32)).all() and debug.unwritten_mask(out).all()
    out[0, 0] = np.float16(np.nan)  # a computed NaN is not "unwritten"
    assert not debug.unwritten_mask(out)[0, 0]


def test_format_residues():
    assert debug.format_residues([0, 1, 2, 5, 8, 9]) == "0-2, 5, 8-9"
    assert debug.format_residues([7]) == "7"
    assert debug.format_residues([]) == ""


def test_correct_impl_passes():
    r = debug.run_debug(debug.reference_impl, **SMALL, causal=True)
    assert r.ok and not r.hints and r.n_unwritten == 0 and r.first_bad is None
    assert r.lse_err is not None and r.lse_err.max() < 1e-5
    assert all(bad == 0 for _, _, bad in r.kv_sweep)
    assert "verdict: PASS" in debug.format_report(r)


def test_rows_8_to_15_of_every_16_are_pinpointed():
    r = debug.run_debug(debug.swap_rows_impl, **SMALL)
    assert not r.ok
    by16 = next(p for p in r.row_patterns if p.modulus == 16)
    by8 = next(p for p in r.row_patterns if p.modulus == 8)
    assert by16.bad_residues == list(range(8, 16))
    assert by8.bad_residues == list(range(8))  # mod 8 cannot see it: the hint picks 16
    assert r.first_bad is not None and r.first_bad[2] == 8
    assert any("row % 16 in {8-15}" in h for h in r.hints)
    report = debug.format_report(r)
    assert "verdict: FAIL" in report and "row % 16 in {8-15}" in report


def test_swizzled_columns_are_pinpointed():
    r = debug.run_debug(debug.swap_cols_impl, **SMALL, kv_sweep=False)
    by8 = next(p for p in r.col_patterns if p.modulus == 8)
    assert by8.bad_residues == [4, 5, 6, 7]
    assert any("col % 8 in {4-7}" in h for h in r.hints)
    assert not any("row %" in h for h in r.hints)


def test_unwritten_tile_is_found():
    r = debug.run_debug(debug.skip_last_tile_impl, **SMALL, kv_sweep=False)
    assert r.n_unwritten == 64 * 2 * 64  # last 64 rows, 2 heads, 64 columns
    assert r.n_nan == 0  # poison is not counted as computed NaN
    assert list(r.tile_bad.sum(axis=1) > 0) == [False, True]
    assert any("never written, in rows 64-127" in h for h in r.hints)
    assert any("query tiles (of 64 rows) {1}" in h for h in r.hints)
    assert "inf*" in debug.format_report(r)


def test_tile_size_option():
    r = debug.run_debug(debug.skip_last_tile_impl, **SMALL, tile_q=32, kv_sweep=False)
    assert r.tile_max.shape == (4, 2)
    assert list(r.tile_bad.sum(axis=1) > 0) == [False, False, True, True]


def test_head_and_nan_bugs():
    def bad_head(q, k, v, *, causal, softmax_scale, out):
        debug.reference_impl(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out)
        out[:, :, 1] = 0
        out[0, 5, 1, 3] = np.nan
        return out

    r = debug.run_debug(bad_head, **SMALL, kv_sweep=False)
    assert r.n_nan == 1 and r.n_unwritten == 0
    assert any("heads {1} of 2" in h for h in r.hints)
    assert any("NaN" in h for h in r.hints)


def test_kv_sweep_locates_multi_tile_bug():
    def first_tile_only(q, k, v, *, causal, softmax_scale, out):
        """Forgets every KV tile after the first (as a broken pipeline would)."""
        o, _ = attention_reference(q, k[:, :64], v[:, :64], causal=causal, softmax_scale=softmax_scale)
        out[...] = o.astype(out.dtype)
        return out

    r = debug.run_debug(first_tile_only, **SMALL, tile_k=64)
    assert [n for n, _, _ in r.kv_sweep] == [64, 128]
    assert r.kv_sweep[0][2] == 0 and r.kv_sweep[1][2] > 0
    assert "KV-tile sweep" in debug.format_report(r)


def test_bf16_reference_passes():
    pytest.importorskip("ml_dtypes")
    r = debug.run_debug(debug.reference_impl, **SMALL, dtype="bf16", causal=True, kv_sweep=False)
    assert r.ok
    assert debug.unwritten_mask(debug.poisoned((4,), debug.numpy_dtype("bf16"))).all()


def test_debug_cli_on_a_standin(capsys):
    assert debug.main(["--impl", "swap-rows", "--batch", "1", "--heads", "2", "--seqlen-q", "64",
                       "--seqlen-k", "64", "--no-kv-sweep"]) == 1
    out = capsys.readouterr().out
    assert "row % 16 in {8-15}" in out and "Max |err| per (query tile of 64 rows, head)" in out
    assert debug.main(["--impl", "reference", "--batch", "1", "--heads", "1", "--seqlen-q", "32",
                       "--seqlen-k", "48", "--causal", "--tile-q", "16"]) == 0


def test_bench_family_and_flex_options():
    args = bench.parse_args(["--family", "sm80", "--backends", "numbaflash,flash,flex"])
    assert args.family == "sm80" and args.backends == ["numbaflash", "flash", "flex"]
    assert bench.parse_args([]).family == "auto"
    assert bench.LABELS["flex"] == "flex"
    with pytest.raises(SystemExit):
        bench.parse_args(["--family", "sm70"])


def test_host_cost_warms_up_then_times_back_to_back_and_one_by_one(monkeypatch):
    """20 untimed calls, ``calls`` back-to-back between two synchronisations, then one call at a
    time (at most 500) with the device busy; 2 ms of host clock a call reads 2000 µs both ways;
    the profile lists the calls' own function."""
    dev = _FakeDevice()
    ticks = {"now": 0.0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: ticks["now"])
    made = []

    def call():
        made.append(1)
        ticks["now"] += 0.002

    wall, busy = bench.host_cost_us(dev, call, 30)
    assert len(made) == 20 + 30 + 30
    assert abs(wall - 2000.0) < 1e-6 and abs(busy - 2000.0) < 1e-6
    assert "call" in bench.profile_calls(dev, call, 5)


def test_sink_speed_pairs_adjacent_calls(monkeypatch):
    """``benchmarks/sink_speed.paired_ratio``: the plain and sink calls alternate one by one in one
    timed run, and each ratio divides a sink call's time by the plain call's just before it."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sink_speed = load_benchmark("sink_speed")
    seen = {}

    def timed(device, calls, warmup, repeats, warmup_ms=0.0):
        seen["calls"], seen["repeats"] = calls, repeats
        plain = [1.0, 2.0, 1.0, 4.0, 1.0]  # a clock step at pair 3 moves both calls of the pair
        sink = [1.01, 2.04, 1.03, 4.0, 1.02]
        return [t for pair in zip(plain, sink, strict=True) for t in pair]

    monkeypatch.setattr(bench, "time_with_events", timed)
    monkeypatch.setattr(bench, "Device", lambda torch: None)
    median, low, high = sink_speed.paired_ratio("plain", "sink", 5)
    assert seen == {"calls": ["plain", "sink"], "repeats": 10}
    assert (median, low, high) == pytest.approx((1.02, 1.01, 1.02))  # of 1.00, 1.01, 1.02, 1.02, 1.03
