"""Nsight Compute profile of numbaflash beside the PyTorch SDPA flash kernel, one row per kernel.

    python benchmarks/ncu_profile.py --seqlen 4096 --head-dim 128
    python benchmarks/ncu_profile.py --seqlen 4096 --head-dim 64 --causal --impls numbaflash,flash,cudnn
    python benchmarks/ncu_profile.py --from-csv saved_numbaflash.csv   # re-read a saved ncu CSV
    python benchmarks/ncu_profile.py --backward --head-dim 128 --impls numbaflash,flash   # the backward

For each implementation the script runs ``ncu`` on itself in ``--driver`` mode: the driver
builds one problem (torch CUDA tensors, same workload as ``python -m numbaflash.bench``:
64k tokens, width 2048), calls the implementation a few times to compile and warm up, then
calls it once more between ``cudaProfilerStart``/``cudaProfilerStop`` (inside an NVTX range
named after it). ncu runs with ``--profile-from-start off``, so exactly the kernels of that
one call are profiled, and with ``--clock-control none``: clocks are never changed, the GPU
runs at its own boost clock as in the benchmark. (ncu's default cache control flushes the
caches before each replay pass, so L2 hit rates are cold-cache rates.)

ncu's ``--csv`` output is parsed by :func:`parse_ncu_csv` (pure, unit-tested) into one row per
kernel: duration, registers/thread, achieved occupancy, shared-memory bank conflicts (and
shared wavefronts, to put them in proportion), L2 hit rate, tensor-pipe utilisation (all
tensor-core instructions: HMMA, i.e. mma.sync, and on Hopper HGMMA, i.e. wgmma), on Hopper
the number of wgmma instructions, and DRAM throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import glob
import io
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

# (column label, metric name, architectures: None = all, else minimum compute capability major)
METRICS: list[tuple[str, str, int | None]] = [
    ("time us", "gpu__time_duration.sum", None),
    ("regs", "launch__registers_per_thread", None),
    ("occ %", "sm__warps_active.avg.pct_of_peak_sustained_active", None),
    ("smem conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", None),
    ("smem wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", None),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", None),
    # every tensor-core instruction: HMMA (mma.sync) everywhere, and HGMMA (wgmma) on Hopper
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", None),
    ("wgmma inst", "sm__inst_executed_pipe_tensor_op_gmma.sum", 9),  # shows which kernels use wgmma
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed", None),
    # what else competes for issue slots: the exp2 unit (MUFU, "xu" pipe) and the FMA pipe
    ("issue %", "sm__inst_issued.avg.pct_of_peak_sustained_active", None),
    ("MUFU %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", None),
    ("FMA %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active", None),
]
DURATION_METRIC = "gpu__time_duration.sum"
IMPLS = ("numbaflash", "flash", "cudnn", "efficient")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
LABELS = {"numbaflash": "numbaflash", **{name: f"sdpa-{name}" for name in SDPA_BACKENDS}}
TIME_UNITS_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                    "second": 1e6, "s": 1e6}


# --------------------------------------------------------------------------- pure parsing


def metrics_for(cc_major: int | None) -> list[str]:
    """Metric names to request on a GPU of compute capability ``cc_major`` (None: unknown)."""
    return [name for _, name, need in METRICS if need is None or (cc_major is not None and cc_major >= need)]


def parse_number(text: str) -> float | None:
    """ncu's printed numbers: ``"1,234,567"`` (thousands separators), ``"12.5"``, ``"n/a"`` -> None.

    A lone comma between digits with no dot (``"9,00"``) is read as a decimal comma.
    """
    text = text.strip().strip('"')
    if not text or text.lower() in ("n/a", "nan", "-"):
        return None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d*)?", text):
        text = text.replace(",", "")
    elif re.fullmatch(r"-?\d+,\d+", text):
        text = text.replace(",", ".")
    try:
        return float(text)
    except ValueError:
        return None


@dataclasses.dataclass
class KernelProfile:
    """One profiled kernel launch."""

    id: int
    kernel: str
    metrics: dict[str, float | None] = dataclasses.field(default_factory=dict)
    units: dict[str, str] = dataclasses.field(default_factory=dict)
    impl: str = ""

    def value(self, metric: str) -> float | None:
        """Metric value in the unit the table uses (durations in microseconds)."""
        v = self.metrics.get(metric)
        if v is None:
            return None
        if metric == DURATION_METRIC:
            return v * TIME_UNITS_TO_US.get(self.units.get(metric, "nsecond"), 1e-3)
        return v


def _csv_lines(text: str) -> list[str]:
    """The CSV part of ncu's output: from the first header line on, lines starting with a quote."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith('"ID",') or line.startswith('"Kernel Name",') or line.startswith('"Metric Name",'):
            return [ln for ln in lines[i:] if ln.startswith('"')]
    return []


def parse_ncu_csv(text: str) -> list[KernelProfile]:
    """Parse ``ncu --csv`` output (surrounding ``==PROF==`` lines and program output allowed).

    Two layouts are understood: the details page (one row per metric, columns "Metric Name",
    "Metric Unit", "Metric Value") and the raw page (one row per kernel, one column per metric,
    optionally followed by a row of units). Kernels keep the order of their IDs.
    """
    lines = _csv_lines(text)
    if not lines:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    kernels: dict[int, KernelProfile] = {}

    def kernel_for(row: list[str], index: int) -> KernelProfile:
        kid = int(parse_number(row[col["ID"]]) or 0) if "ID" in col else index
        if kid not in kernels:
            kernels[kid] = KernelProfile(kid, row[col["Kernel Name"]] if "Kernel Name" in col else "?")
        return kernels[kid]

    if "Metric Name" in col and "Metric Value" in col:  # details page, long format
        for index, row in enumerate(body):
            if len(row) < len(header):
                continue
            k = kernel_for(row, index)
            name = row[col["Metric Name"]]
            k.metrics[name] = parse_number(row[col["Metric Value"]])
            if "Metric Unit" in col:
                k.units[name] = row[col["Metric Unit"]]
        return [kernels[i] for i in sorted(kernels)]

    metric_cols = [name for name in header if "__" in name]  # raw page, wide format
    units: dict[str, str] = {}
    if body and "ID" in col and not body[0][col["ID"]].strip():  # the row of units
        units = {name: body[0][col[name]] for name in metric_cols}
        body = body[1:]
    for index, row in enumerate(body):
        if len(row) < len(header):
            continue
        k = kernel_for(row, index)
        for name in metric_cols:
            k.metrics[name] = parse_number(row[col[name]])
            if name in units:
                k.units[name] = units[name]
    return [kernels[i] for i in sorted(kernels)]


def failed_metrics(output: str, requested: Sequence[str]) -> list[str]:
    """Requested metrics that ncu's error lines name (e.g. not available on this GPU)."""
    errors = [ln for ln in output.splitlines() if "error" in ln.lower()]
    return [m for m in requested if any(m in ln or m.split(".")[0] in ln for ln in errors)]


def short_kernel_name(name: str, width: int = 48) -> str:
    """Readable kernel name: Itanium-mangled names (Numba's) unmangled to their last two parts,
    C++ signatures stripped of ``void``, template arguments and parameters."""
    if name.startswith("_ZN"):
        parts, i = [], 3
        while i < len(name) and name[i].isdigit():
            j = i
            while j < len(name) and name[j].isdigit():
                j += 1
            n = int(name[i:j])
            parts.append(name[j:j + n])
            i = j + n
        if parts:
            name = "::".join(parts[-2:])
    else:
        name = re.sub(r"^void\s+", "", name)
        depth, out = 0, []
        for ch in name:  # drop <...> (nested) and everything from the first "(" on
            if ch == "(" and depth == 0:
                break
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth = max(depth - 1, 0)
            elif depth == 0:
                out.append(ch)
        name = "".join(out).strip()
    return name if len(name) <= width else name[: width - 3] + "..."


def _fmt(value: float | None, metric: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if metric == "launch__registers_per_thread" or (metric.endswith(".sum") and metric != DURATION_METRIC):
        return f"{value:,.0f}"
    return f"{value:.1f}"


def format_profile_table(kernels: Sequence[KernelProfile], metrics: Sequence[str] | None = None) -> str:
    """A Markdown table: implementation, kernel, then one column per metric present."""
    wanted = list(metrics) if metrics is not None else [name for _, name, _ in METRICS]
    present = [m for m in wanted if any(k.metrics.get(m) is not None for k in kernels)]
    labels = {name: label for label, name, _ in METRICS}
    headers = ["impl", "kernel", *(labels.get(m, m) for m in present)]
    rows = [[k.impl or "-", short_kernel_name(k.kernel), *(_fmt(k.value(m), m) for m in present)]
            for k in kernels]
    if not rows:
        return "(no kernels profiled)"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        padded = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs)
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Nsight Compute metrics of numbaflash beside torch SDPA kernels.")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=None, help="default 65536 // seqlen")
    p.add_argument("--heads", type=int, default=None, help="default 2048 // head_dim")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true",
                   help="profile the backward: numbaflash's flash_attention_backward (prepare, main, dQ "
                        "kernels), SDPA's through autograd")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--impls", default="numbaflash,flash",
                   help=f"comma-separated from {', '.join(IMPLS)} (default numbaflash,flash)")
    p.add_argument("--family", choices=("auto", "sm80", "sm90"), default="auto",
                   help="numbaflash kernel family to force (as numbaflash.bench --family)")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled calls before the profiled one")
    p.add_argument("--ncu", default=None, help="path of ncu (default: PATH, then CUDA install dirs)")
    p.add_argument("--metrics", default=None, help="comma-separated metric names instead of the default set")
    p.add_argument("--save-csv", metavar="DIR", default=None, help="keep ncu's raw CSV output per impl here")
    p.add_argument("--from-csv", metavar="FILE", nargs="+", default=None,
                   help="parse saved ncu CSV file(s) instead of profiling")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # what ncu runs
    p.add_argument("--impl", default="numbaflash", help=argparse.SUPPRESS)  # driver's implementation
    return p


def _impls(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}; choose from {', '.join(IMPLS)}")
    return names


def driver_args(args: argparse.Namespace, impl: str) -> list[str]:
    out = ["--driver", "--impl", impl, "--seqlen", str(args.seqlen), "--head-dim", str(args.head_dim),
           "--dtype", args.dtype, "--warmup", str(args.warmup), "--family", args.family]
    if args.batch is not None:
        out += ["--batch", str(args.batch)]
    if args.heads is not None:
        out += ["--heads", str(args.heads)]
    if args.causal:
        out.append("--causal")
    if args.backward:
        out.append("--backward")
    return out


def ncu_command(ncu: str, metrics: Sequence[str], script: str, args: Sequence[str],
                python: str = sys.executable) -> list[str]:
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
            "--csv", "--print-units", "base", "--metrics", ",".join(metrics), python, script, *args]


# --------------------------------------------------------------------------- GPU side


def run_driver(args: argparse.Namespace) -> int:
    """Build the problem, warm up, then one call between cudaProfilerStart and Stop."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    import torch

    batch = args.batch or max(1, 65536 // args.seqlen)
    heads = args.heads or max(1, 2048 // args.head_dim)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    shape = (batch, args.seqlen, heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    if args.impl == "numbaflash" and args.backward:
        from numbaflash import flash_attention, flash_attention_backward

        dout = torch.randn(shape, device="cuda", dtype=dtype)
        out, lse = flash_attention(q, k, v, causal=args.causal, return_lse=True)

        def call() -> None:
            flash_attention_backward(dout, q, k, v, out, lse, causal=args.causal)

        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    elif args.impl == "numbaflash":
        from numbaflash import flash_attention
        from numbaflash.tools.bench import family_context

        def call() -> None:
            flash_attention(q, k, v, causal=args.causal, out=out)

        ctx = family_context(args.family, args.head_dim, args.causal, args.seqlen)
    elif args.backward:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        dout = torch.randn(shape, device="cuda", dtype=dtype).transpose(1, 2)
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[args.impl])):
            result = sdpa(qt, kt, vt, is_causal=args.causal)
        ctx = sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[args.impl]))  # a context manager enters once

        def call() -> None:
            torch.autograd.grad(result, (qt, kt, vt), dout, retain_graph=True)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def call() -> None:
            sdpa(qt, kt, vt, is_causal=args.causal)

        ctx = sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[args.impl]))
    with ctx:
        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(args.impl)
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    what = "backward" if args.backward else "forward"
    print(f"driver: {args.impl} {what} {shape} causal={args.causal} {args.dtype} done", file=sys.stderr)
    return 0


def find_ncu(explicit: str | None) -> str | None:
    if explicit:
        return explicit if os.path.isfile(explicit) else shutil.which(explicit)
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/ncu") + glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return candidates[-1] if candidates else None


def compute_capability_major() -> int | None:
    """Without creating a CUDA context in this process (ncu's child must own the GPU's counters)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "-i", "0", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return int(float(out.strip().splitlines()[0]))
    except Exception:
        return None


def profile_impl(ncu: str, impl: str, metrics: list[str], args: argparse.Namespace) -> list[KernelProfile]:
    """Run ncu on the driver for ``impl``; retry once without metrics that ncu rejects."""
    for attempt in range(2):
        cmd = ncu_command(ncu, metrics, os.path.abspath(__file__), driver_args(args, impl))
        print("$ " + " ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        output = proc.stdout + "\n" + proc.stderr
        if args.save_csv:
            os.makedirs(args.save_csv, exist_ok=True)
            with open(os.path.join(args.save_csv, f"ncu_{impl}.csv"), "w") as f:
                f.write(proc.stdout)
        kernels = parse_ncu_csv(proc.stdout)
        if proc.returncode == 0 and kernels:
            for k in kernels:
                k.impl = LABELS[impl]
            return kernels
        bad = failed_metrics(output, metrics)
        if attempt == 0 and bad:
            print(f"ncu rejected {', '.join(bad)}; retrying without", file=sys.stderr)
            metrics = [m for m in metrics if m not in bad]
            continue
        tail = "\n".join(output.strip().splitlines()[-25:])
        print(f"ncu failed for {impl} (exit {proc.returncode}, {len(kernels)} kernels parsed):\n{tail}",
              file=sys.stderr)
        return []
    return []


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.driver:
        return run_driver(args)
    if args.from_csv:
        kernels: list[KernelProfile] = []
        for path in args.from_csv:
            with open(path) as f:
                parsed = parse_ncu_csv(f.read())
            for k in parsed:
                k.impl = os.path.splitext(os.path.basename(path))[0]
            kernels += parsed
        print(format_profile_table(kernels))
        return 0 if kernels else 1
    ncu = find_ncu(args.ncu)
    if ncu is None:
        print("ncu (Nsight Compute) not found: install it or pass --ncu /path/to/ncu", file=sys.stderr)
        return 2
    if args.metrics:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    else:
        metrics = metrics_for(compute_capability_major())
    batch = args.batch or max(1, 65536 // args.seqlen)
    heads = args.heads or max(1, 2048 // args.head_dim)
    kernels = []
    for impl in _impls(args.impls):
        kernels += profile_impl(ncu, impl, metrics, args)
    print(f"# ncu profile: {args.dtype} B={batch} H={heads} S={args.seqlen} D={args.head_dim} "
          f"{'causal' if args.causal else 'non-causal'}, numbaflash family {args.family} "
          f"(ncu --clock-control none)\n")
    print(environment(ncu) + "\n")
    print(format_profile_table(kernels, metrics))
    return 0 if kernels else 1


def environment(ncu: str) -> str:
    """GPU, clocks, driver and library versions (as the bench tool prints them) and ncu's version."""
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
        version = out.strip().splitlines()[-1] if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    try:
        from numbaflash.tools.bench import _import_torch, environment_header

        header = environment_header(_import_torch())
    except Exception as exc:  # numbaflash not importable: still report ncu
        header = f"environment unavailable ({type(exc).__name__}: {exc})"
    return f"{header}\nNsight Compute: {version}"


if __name__ == "__main__":
    sys.exit(main())
