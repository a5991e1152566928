"""Run NVIDIA compute-sanitizer over every kernel configuration that runs on this GPU: the forward
families' and the backward's (``BackwardConfig``: every GPU runs it).

    python benchmarks/sanitize.py [--tools memcheck,racecheck] [--configs 0,3 | WsConfig | shipped]
                                  [--jobs 8] [--timeout 600] [--log-dir DIR] [--sanitizer PATH]
    python benchmarks/sanitize.py --list [--arch sm80]     # the indexed configs (no GPU needed)

Configs: shipped ones and autotune candidates of the families that run here, indexed in str order.
One job per (tool, config) runs ``compute-sanitizer --tool T ... python sanitize.py --worker
--config-index I``: the worker forces the config and checks ``flash_attention`` on small ragged,
fully masked, GQA/MQA shapes (both dtypes, causal or not, LSE on and off) against the numpy
reference, also its window and softcap kernels, its learnable-sink kernels (``SINK_CASES``,
``VARLEN_SINK_CASES``) and ``flash_attention_varlen`` on three packed sequences
(``varlen_lengths``); for a backward
config, ``flash_attention_backward`` on the same shapes (both dtypes, causal or not,
deterministic or not, plus a window case and a softcap case, and the learnable-sink cases
``BACKWARD_SINK_CASES``: the prepare kernel's sink build and d_sink) against the float64 backward,
and one ``flash_attention_varlen_backward`` case a dtype on the ``varlen_lengths`` sequences (and
one with a sink).
Logs go to ``--log-dir/{tool}_{index}.log``; a markdown table of error counts is
printed; exit 1 if any job found errors, timed out, crashed or computed a wrong result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

from numbaflash import configs
from numbaflash.configs import KernelConfig
from numbaflash.kernels.families import SM80_BWD, SM80_DEC, SM80_MLA, SM90_BWD, SM90_MLA, family_of
from numbaflash.kernels.shapes import BackwardConfig

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
WORKER_WRONG = 3  # worker exit status: a result failed the check
WRONG_LINES_SHOWN = 3  # a WRONG job's failing cases printed with the summary (``wrong_lines``)
WORKER_EXCEPTION = 4  # worker exit status: an exception (Python's own 1 is the sanitizer's)
SANITIZER_ERROR = 1  # --error-exitcode
WORKER_DONE = "worker done:"  # the worker's last line: it ran every case
_ERROR_RE = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?\s*$", re.MULTILINE)
_RACE_RE = re.compile(
    r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?,\s*(\d+) warnings?\)", re.MULTILINE
)


# --------------------------------------------------------------------------- pure parts


def parse_summary(tool: str, text: str) -> int | None:
    """Errors the sanitizer reported in ``text`` (summed over processes), None without a summary.

    racecheck counts the errors of its RACECHECK SUMMARY (warnings-only hazards are 0), else its
    ERROR SUMMARY; the other tools their ERROR SUMMARY ("N errors were not printed" is ignored).
    """
    if tool == "racecheck" and (races := _RACE_RE.findall(text)):
        return sum(int(errors) for _, errors, _ in races)
    counts = _ERROR_RE.findall(text)
    return sum(int(n) for n in counts) if counts else None


def kernel_family(config: KernelConfig) -> str:
    """'sm90' for the warp-specialised Hopper kernel, 'sm80' for the mma.sync kernel."""
    return family_of(config).name


def runnable_configs(capability: tuple[int, int]) -> list[KernelConfig | BackwardConfig]:
    """Shipped configs and candidates of the families that run on ``capability``, then the
    backward's (that fit its shared memory), sorted by str."""
    families = configs.runnable_families(capability)
    own_dims = configs.FAMILY_HEAD_DIMS  # each family's candidates at its own kernel's head dims
    found = {c for fam in families for d in own_dims[fam] for c in configs.CANDIDATES[(fam, d)]}
    found |= {c for fam, _, _, c in configs.shipped_configs() if fam in families}
    limit = configs.max_shared_bytes(capability)
    found |= {configs.backward_for_target(c, capability) for cs in configs.BACKWARD_CANDIDATES.values()
              for c in cs if c.shared_bytes <= limit}
    found |= {configs.backward_for_target(c, capability) for _, _, c in configs.shipped_backward_configs()
              if c.shared_bytes <= limit and configs.backward_runnable(c, capability)}
    found |= {c for c in configs.shipped_decode_configs() if c.shared_bytes <= limit}
    found |= {c for c in configs.shipped_mla_decode_configs() if c.shared_bytes <= limit}
    found |= set(pair_decode_configs(capability))
    if "sm90" in families:  # the pairs' Hopper forward and backward
        found |= {c for c in configs.ASYMMETRIC_WS_DEFAULTS.values() if c.shared_bytes <= limit}
        found |= {c for c in configs.ASYMMETRIC_BACKWARD_WS.values() if c.shared_bytes <= limit}
    if "sm80" in families:  # the pairs of head dims (every GPU runs the mma.sync family)
        small = [c for cs in configs.ASYMMETRIC_FALLBACKS.values() for c in cs]  # where a default won't fit
        found |= {c for c in (*configs.ASYMMETRIC_DEFAULTS.values(), *small) if c.shared_bytes <= limit}
        pairs = [c for cs in configs.ASYMMETRIC_BACKWARD_DEFAULTS.values() for c in cs]
        found |= {configs.backward_for_target(c, capability) for c in pairs if c.shared_bytes <= limit}
    return sorted(found, key=str)


def pair_decode_configs(capability: tuple[int, int]) -> list:
    """The decode configs of the pairs of head dims (``configs.DECODE_HEAD_DIM_PAIRS``) a GPU of
    ``capability`` dispatches, contiguous and paged (16 packed rows: head dims above 128 take no
    more)."""
    return [configs.decode_config(capability, d, 16, paged, head_dim_v=dv)
            for d, dv in configs.DECODE_HEAD_DIM_PAIRS for paged in (False, True)]


def select_indices(spec: str | None, config_list: list[KernelConfig],
                   capability: tuple[int, int] = (9, 0)) -> list[int]:
    """``--configs``: all if empty, ``shipped`` for those the dispatcher can launch (the tuned
    table and defaults, ``configs.shipped_configs``; the backward's as a GPU of ``capability``,
    the one ``config_list`` is for, compiles them), a comma list of indices, else the configs
    whose str contains it."""
    if not spec:
        return list(range(len(config_list)))
    if spec == "shipped":
        shipped = {c for _, _, _, c in configs.shipped_configs()}
        shipped |= {configs.backward_for_target(c, capability)
                    for _, _, c in configs.shipped_backward_configs()}
        shipped |= set(configs.shipped_decode_configs()) | set(pair_decode_configs(capability))
        shipped |= set(configs.shipped_mla_decode_configs())
        shipped |= set(configs.ASYMMETRIC_DEFAULTS.values()) | set(configs.ASYMMETRIC_WS_DEFAULTS.values())
        shipped |= {c for cs in configs.ASYMMETRIC_FALLBACKS.values() for c in cs}
        shipped |= {configs.backward_for_target(c, capability)
                    for cs in configs.ASYMMETRIC_BACKWARD_DEFAULTS.values() for c in cs}
        return [i for i, c in enumerate(config_list) if c in shipped]
    parts = [p.strip() for p in spec.split(",")]
    if all(p.isdigit() for p in parts):
        bad = [p for p in parts if int(p) >= len(config_list)]
        if bad:
            raise ValueError(f"config indices {bad} out of range 0..{len(config_list) - 1}")
        return sorted({int(p) for p in parts})
    return [i for i, c in enumerate(config_list) if spec in str(c)]


@dataclasses.dataclass(frozen=True)
class JobResult:
    """One sanitizer run: ``rc`` None when it timed out, ``errors`` None when no summary was found,
    ``finished`` whether the worker printed its last line (WORKER_DONE), ``wrong`` the first of the
    worker's WRONG lines (the cases whose results failed the check)."""

    tool: str
    index: int
    rc: int | None
    errors: int | None
    finished: bool = True
    log: str = ""
    wrong: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        # racecheck may use the error exit code for warnings only, which count 0 errors.
        allowed = (0, SANITIZER_ERROR) if self.tool == "racecheck" else (0,)
        return self.errors == 0 and self.finished and self.rc in allowed

    @property
    def cell(self) -> str:
        if self.rc is None:
            return "TIMEOUT"
        if self.errors:
            return str(self.errors)
        if self.rc == WORKER_WRONG:
            return "WRONG"
        return "0" if self.ok else f"CRASH rc={self.rc}"


def format_table(rows: list[tuple[int, KernelConfig]], results: dict[tuple[str, int], JobResult],
                 tools: list[str]) -> str:
    """Markdown table: one row per (index, config), one column per tool ("-": not run)."""
    lines = ["| # | config | family | head_dim | " + " | ".join(tools) + " |",
             "|--:|:--|:--|--:|" + "--:|" * len(tools)]
    for i, config in rows:
        cells = [results[(t, i)].cell if (t, i) in results else "-" for t in tools]
        head = f"| {i} | {config} | {kernel_family(config)} | {config.head_dim} | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(results: list[JobResult]) -> str:
    errors = sum(r.errors or 0 for r in results)
    failed = sum(not r.ok for r in results)
    return f"sanitizer: {len(results)} jobs, {errors} errors" + (f" ({failed} jobs failed)" if failed else "")


def check_result(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, out: np.ndarray,
                 lse: np.ndarray | None, **extras) -> list[str]:
    """What is wrong with one result (empty: nothing), by the criterion the tests and the
    self-test use (``numbaflash.tools.reference.compare_with_reference``), plus no inf.
    ``extras``: the call's ``window_size``, ``softcap`` and ``sink``."""
    from numbaflash.tools.reference import compare_with_reference

    _, problems = compare_with_reference(q, k, v, out, lse, causal=causal, **extras)
    got = np.asarray(out, np.float64)
    if not np.isfinite(got).all():
        problems.append(f"{np.count_nonzero(~np.isfinite(got))} non-finite outputs")
    return problems


def worker_shapes(block_m: int) -> list[tuple[int, int, int, int, int]]:
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv): ragged + GQA, 1 x 1 MQA, causal fully
    masked CTAs (seqlen_q >= seqlen_k + 2 block_m), seqlen_q < seqlen_k."""
    return [(2, 77, 45, 4, 2), (2, 1, 1, 2, 1), (2, 30 + 2 * block_m + 13, 30, 2, 1), (2, 33, 200, 4, 4)]


# --------------------------------------------------------------------------- worker (under the sanitizer)


# The sliding-window and softcap kernels (issue 35) of both forward families, run on each config
# beside the plain ones: (window_size, softcap) of each extra case, causal and not.
WINDOW_SOFTCAP_CASES = (((5, 0), 0.0), ((17, 3), 30.0), ((-1, -1), 50.0), ((0, -1), 0.0))
# The learnable-sink kernels (issue 56) of both forward families: (window_size, softcap) of each
# sink case, causal and not, with the LSE, the logits of ``sink_logits``.
SINK_CASES = (((-1, -1), 0.0), ((17, 3), 30.0))


def sink_logits(heads_q: int) -> np.ndarray:
    """The worker's learnable sink: float32 (heads_q,), one head with none (-inf), one that
    outweighs the scores (6), and two ordinary ones."""
    return np.resize(np.array([0.5, -np.inf, 6.0, -2.0], np.float32), heads_q)


def run_case(config: KernelConfig, capability: tuple[int, int], host: list[np.ndarray], device: list,
             causal: bool, want_lse: bool, window_size: tuple[int, int] = (-1, -1),
             softcap: float = 0.0, sink: np.ndarray | None = None) -> list[str]:
    """One ``flash_attention`` call on device arrays (``out`` poisoned with NaN), checked; ``sink``:
    a learnable sink's logits (host), given as a device array."""
    from numba import cuda

    from numbaflash import flash_attention
    from numbaflash.runtime.buffers import DeviceBuffer

    q = host[0]
    out = DeviceBuffer(np.full((*q.shape[:3], host[2].shape[3]), np.nan, q.dtype))  # v's head dim
    # a window kernel runs the causal or the full config, whatever ``causal`` is: force both
    forced = configs.force_config(capability, causal, config)
    with forced, configs.force_config(capability, not causal, config):
        res = flash_attention(*device, causal=causal, return_lse=want_lse, out=out, window_size=window_size,
                              softcap=softcap, learnable_sink=None if sink is None else cuda.to_device(sink))
    lse = res[1].copy_to_host() if want_lse else None
    return check_result(*host, causal, out.copy_to_host(), lse, window_size=window_size, softcap=softcap,
                        sink=sink)


# The mma.sync family's packed variable-length kernels, run on each of its configs: (causal,
# window_size, softcap) of each call on the ``varlen_lengths`` sequences (the plain and causal
# kernels, and the window + softcap one).
VARLEN_CASES = ((False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (17, 3), 30.0))
# Its learnable-sink builds: the same, with the sink of ``sink_logits`` and the LSE (the keyless
# sequence's rows: 0 and LSE = the sink).
VARLEN_SINK_CASES = ((True, (-1, -1), 0.0), (False, (17, 3), 30.0))


def varlen_lengths(block_m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(seqlens_q, seqlens_k) of the worker's varlen case: three sequences, one with keys and no
    query row, one query row with no key (0 and LSE -inf), and a ragged one with whole causal
    blocks that see no key (seqlen_q >= seqlen_k + 2 block_m), as the dense worker shapes."""
    return (0, 1, 30 + 2 * block_m + 13), (5, 0, 30)


def run_varlen_case(config: KernelConfig, capability: tuple[int, int], host: list[np.ndarray], device: list,
                    causal: bool, want_lse: bool, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, sink: np.ndarray | None = None) -> list[str]:
    """One ``flash_attention_varlen`` call on device arrays (host: q, k, v, cu_seqlens_q,
    cu_seqlens_k; ``out`` poisoned with NaN), the config forced causal and not, checked per
    sequence; ``sink``: a learnable sink's logits (host), given as a device array."""
    from numba import cuda

    from numbaflash import flash_attention_varlen
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_varlen_with_reference

    q, k, v, cu_q, cu_k = host
    out = DeviceBuffer(np.full((*q.shape[:-1], host[2].shape[-1]), np.nan, q.dtype))  # v's head dim
    max_q, max_k = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
    forced = configs.force_config(capability, causal, config)
    with_sink = {} if sink is None else {"learnable_sink": cuda.to_device(sink)}
    with forced, configs.force_config(capability, not causal, config):
        res = flash_attention_varlen(*device, max_q, max_k, causal=causal, return_lse=want_lse, out=out,
                                     window_size=window_size, softcap=softcap, **with_sink)
    lse = res[1].copy_to_host() if want_lse else None
    got = out.copy_to_host()
    _, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, got, lse, causal=causal,
                                                window_size=window_size, softcap=softcap, sink=sink)
    if not np.isfinite(np.asarray(got, np.float64)).all():
        problems.append(f"{np.count_nonzero(~np.isfinite(np.asarray(got, np.float64)))} non-finite outputs")
    return problems


def run_varlen_worker(config: KernelConfig, capability: tuple[int, int], dtype, rng) -> int:
    """``VARLEN_CASES`` x LSE on and off on ``config`` (GQA, heads 4/2), and ``VARLEN_SINK_CASES``;
    the wrong results."""
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer

    lengths_q, lengths_k = varlen_lengths(config.block_m)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    d, dv = config.head_dim, getattr(config, "value_dim", config.head_dim)
    q = rng.standard_normal((int(cu_q[-1]), 4, d)).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), 2, d)).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), 2, dv)).astype(dtype)
    host = [q, k, v, cu_q, cu_k]
    device = [DeviceBuffer(x) for x in (q, k, v)] + [cuda.to_device(cu_q), cuda.to_device(cu_k)]
    failures = 0
    for causal, window, softcap in VARLEN_CASES:
        for want_lse in (False, True):
            problems = run_varlen_case(config, capability, host, device, causal, want_lse, window, softcap)
            for p in problems:
                print(f"WRONG {config} {np.dtype(dtype).name} varlen seqlens_q={lengths_q} "
                      f"seqlens_k={lengths_k} causal={causal} lse={want_lse} window={window} "
                      f"softcap={softcap}: {p}", flush=True)
            failures += bool(problems)
    for causal, window, softcap in VARLEN_SINK_CASES:
        problems = run_varlen_case(config, capability, host, device, causal, True, window, softcap,
                                   sink_logits(4))
        for p in problems:
            print(f"WRONG {config} {np.dtype(dtype).name} varlen seqlens_q={lengths_q} seqlens_k={lengths_k} "
                  f"causal={causal} window={window} softcap={softcap} sink: {p}", flush=True)
        failures += bool(problems)
    return failures


def run_worker(config: KernelConfig) -> int:
    """Every shape x dtype x causal x LSE case on ``config``, its window and softcap cases, and the
    varlen cases; 0, or WORKER_WRONG with messages."""
    import ml_dtypes
    from numba import cuda

    from numbaflash.runtime.buffers import DeviceBuffer

    capability = tuple(cuda.get_current_device().compute_capability)
    rng = np.random.default_rng(0)
    failures = 0
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for b, sq, sk, hq, hkv in worker_shapes(config.block_m):
            shapes = [(b, sq, hq, config.head_dim), (b, sk, hkv, config.head_dim),
                      (b, sk, hkv, getattr(config, "value_dim", config.head_dim))]
            host = [rng.standard_normal(s).astype(dtype) for s in shapes]
            device = [DeviceBuffer(x) for x in host]  # float16 and bfloat16 alike
            extras = [((-1, -1), 0.0), *WINDOW_SOFTCAP_CASES]
            for causal in (False, True):
                for want_lse in (False, True):
                    for window, softcap in extras:
                        problems = run_case(config, capability, host, device, causal, want_lse, window,
                                            softcap)
                        for p in problems:
                            print(f"WRONG {config} {np.dtype(dtype).name} (b, sq, sk, hq, hkv)="
                                  f"{(b, sq, sk, hq, hkv)} causal={causal} lse={want_lse} window={window} "
                                  f"softcap={softcap}: {p}", flush=True)
                        failures += bool(problems)
            for window, softcap in SINK_CASES:
                for causal in (False, True):
                    problems = run_case(config, capability, host, device, causal, True, window, softcap,
                                        sink_logits(hq))
                    for p in problems:
                        print(f"WRONG {config} {np.dtype(dtype).name} (b, sq, sk, hq, hkv)="
                              f"{(b, sq, sk, hq, hkv)} causal={causal} window={window} softcap={softcap} "
                              f"sink: {p}", flush=True)
                    failures += bool(problems)
        failures += run_varlen_worker(config, capability, dtype, rng)
    print(f"{WORKER_DONE} {config}: {failures} wrong results", flush=True)
    return WORKER_WRONG if failures else 0


def poisoned(like: np.ndarray):
    """A device buffer of ``like``'s shape and dtype filled with NaN, written from the host: the
    backward workers' dq, dk, dv (``like`` q, k, v) and the O their forward writes (``out=``,
    ``like`` dout). Poisoned, so an element a kernel skips is caught; written from the host, as
    initcheck does not see the Hopper forward's TMA bulk stores (on the H200, a torch kernel
    reading a fresh O the forward stored is flagged element for element, notebook ICTMA), so the
    backward's reads of O are checked like any other's."""
    from numbaflash.runtime.buffers import DeviceBuffer

    return DeviceBuffer(np.full(like.shape, np.nan, like.dtype))


def run_backward_worker(config: BackwardConfig) -> int:
    """The backward of ``config`` on every worker shape x dtype x causal x deterministic case
    (device arrays; dq, dk, dv given and poisoned with NaN), checked against float64."""
    import ml_dtypes
    from numba import cuda

    from numbaflash import flash_attention, flash_attention_backward
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_gradients_with_reference

    capability = tuple(cuda.get_current_device().compute_capability)
    rng = np.random.default_rng(0)
    failures = 0
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for b, sq, sk, hq, hkv in worker_shapes(config.block_n):
            d, dv = config.head_dim, getattr(config, "value_dim", config.head_dim)
            q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
            dout = rng.standard_normal((b, sq, hq, dv)).astype(dtype)
            k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
            v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
            device = [DeviceBuffer(x) for x in (q, k, v)]
            for causal in (False, True):
                out, lse = flash_attention(*device, causal=causal, return_lse=True, out=poisoned(dout))
                for deterministic in (False, True):
                    grads = [poisoned(x) for x in (q, k, v)]
                    with configs.force_config(capability, causal, config):
                        flash_attention_backward(DeviceBuffer(dout), *device, out, lse, causal=causal,
                                                 deterministic=deterministic, dq=grads[0], dk=grads[1],
                                                 dv=grads[2])
                    _, problems = compare_gradients_with_reference(
                        q, k, v, dout, tuple(g.copy_to_host() for g in grads), causal=causal)
                    for p in problems:
                        print(f"WRONG {config} {np.dtype(dtype).name} (b, sq, sk, hq, hkv)="
                              f"{(b, sq, sk, hq, hkv)} causal={causal} deterministic={deterministic}: {p}",
                              flush=True)
                    failures += bool(problems)
            # The main kernel's window and softcap variants (issue 35): one case each
            for window, softcap, deterministic in BACKWARD_WINDOW_SOFTCAP_CASES:
                extras = {"window_size": window, "softcap": softcap}
                out, lse = flash_attention(*device, return_lse=True, out=poisoned(dout), **extras)
                grads = [poisoned(x) for x in (q, k, v)]
                # a window runs the causal or the full config, whatever ``causal`` is: force both
                forced = (configs.force_config(capability, c, config) for c in (False, True))
                with next(forced), next(forced):
                    flash_attention_backward(DeviceBuffer(dout), *device, out, lse, dq=grads[0], dk=grads[1],
                                             dv=grads[2], deterministic=deterministic, **extras)
                _, problems = compare_gradients_with_reference(
                    q, k, v, dout, tuple(g.copy_to_host() for g in grads), **extras)
                for p in problems:
                    print(f"WRONG {config} {np.dtype(dtype).name} (b, sq, sk, hq, hkv)="
                          f"{(b, sq, sk, hq, hkv)} window={window} softcap={softcap} "
                          f"deterministic={deterministic}: {p}", flush=True)
                failures += bool(problems)
            failures += run_backward_sink_cases(config, capability, (q, k, v, dout), device)
        # The packed variable-length backward: one case a dtype (causal for bfloat16), and one with a sink
        failures += run_varlen_backward_case(config, capability, dtype, rng, causal=dtype is not np.float16)
        failures += run_varlen_backward_case(config, capability, dtype, rng, causal=True,
                                             sink=sink_logits(4))
    print(f"{WORKER_DONE} {config}: {failures} wrong results", flush=True)
    return WORKER_WRONG if failures else 0


def run_backward_sink_cases(config: BackwardConfig, capability: tuple[int, int], host: tuple,
                            device: list) -> int:
    """The ``BACKWARD_SINK_CASES`` of one shape (``host``: q, k, v, dout; ``device``: q, k, v):
    the forward and the backward with the sink of ``sink_logits``, dq, dk, dv given and poisoned,
    (dq, dk, dv, d_sink) against float64; how many were wrong."""
    from numba import cuda

    from numbaflash import flash_attention, flash_attention_backward
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_gradients_with_reference

    q, k, v, dout = host
    sink = sink_logits(q.shape[2])
    failures = 0
    for window, softcap, causal, deterministic in BACKWARD_SINK_CASES:
        extras = {"window_size": window, "softcap": softcap, "causal": causal}
        sink_d = cuda.to_device(sink)
        out, lse = flash_attention(*device, return_lse=True, learnable_sink=sink_d, out=poisoned(dout),
                                   **extras)
        grads = [poisoned(x) for x in (q, k, v)]
        forced = (configs.force_config(capability, c, config) for c in (False, True))
        with next(forced), next(forced):
            *_, d_sink = flash_attention_backward(DeviceBuffer(dout), *device, out, lse, dq=grads[0],
                                                  dk=grads[1], dv=grads[2], deterministic=deterministic,
                                                  learnable_sink=sink_d, **extras)
        found = (*(g.copy_to_host() for g in grads), d_sink.copy_to_host())
        _, problems = compare_gradients_with_reference(q, k, v, dout, found, sink=sink, **extras)
        shape = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])  # (b, sq, sk, hq, hkv)
        for p in problems:
            print(f"WRONG {config} {q.dtype.name} (b, sq, sk, hq, hkv)={shape} window={window} "
                  f"softcap={softcap} causal={causal} deterministic={deterministic} sink: {p}", flush=True)
        failures += bool(problems)
    return failures


def run_varlen_backward_case(config: BackwardConfig, capability: tuple[int, int], dtype, rng,
                             causal: bool, sink: np.ndarray | None = None) -> int:
    """One ``flash_attention_varlen_backward`` call on ``config`` (forced), deterministic, on the
    ``varlen_lengths`` sequences of its block_m (keys and no query row, a query row and no key, a
    ragged one), GQA 4/2, device arrays, dq, dk, dv given and poisoned with NaN; 1 if wrong.
    ``sink``: a learnable sink's logits (4,) (host): d_sink checked too."""
    from numba import cuda

    from numbaflash import flash_attention_varlen, flash_attention_varlen_backward
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_varlen_gradients_with_reference

    lengths_q, lengths_k = varlen_lengths(config.block_m)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    max_q, max_k = max(lengths_q), max(lengths_k)
    d, dv = config.head_dim, getattr(config, "value_dim", config.head_dim)
    q = rng.standard_normal((int(cu_q[-1]), 4, d)).astype(dtype)
    dout = rng.standard_normal((int(cu_q[-1]), 4, dv)).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), 2, d)).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), 2, dv)).astype(dtype)
    device = [DeviceBuffer(x) for x in (q, k, v)]
    offsets = [cuda.to_device(cu_q), cuda.to_device(cu_k), max_q, max_k]
    with_sink = {} if sink is None else {"learnable_sink": cuda.to_device(sink)}
    out, lse = flash_attention_varlen(*device, *offsets, causal=causal, return_lse=True,
                                      out=poisoned(dout), **with_sink)
    grads = [poisoned(x) for x in (q, k, v)]
    with configs.force_config(capability, causal, config):
        found = flash_attention_varlen_backward(DeviceBuffer(dout), *device, out, lse, *offsets,
                                                causal=causal, deterministic=True, dq=grads[0], dk=grads[1],
                                                dv=grads[2], **with_sink)
    host_grads = tuple(g.copy_to_host() for g in grads) + tuple(x.copy_to_host() for x in found[3:])
    _, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, host_grads,
                                                          causal=causal, sink=sink)
    for p in problems:
        print(f"WRONG {config} {np.dtype(dtype).name} varlen seqlens_q={lengths_q} seqlens_k={lengths_k} "
              f"causal={causal} deterministic=True{' sink' if sink is not None else ''}: {p}", flush=True)
    return int(bool(problems))


# The backward's window and softcap variants, run on each backward config beside the plain cases:
# (window_size, softcap, deterministic); the window's turns in deterministic mode.
BACKWARD_WINDOW_SOFTCAP_CASES = (((17, 3), 0.0, True), ((-1, -1), 30.0, False))
# The backward with a learnable sink (issue 56: the prepare kernel's sink build adds d_sink):
# (window_size, softcap, causal, deterministic), with the sink of ``sink_logits``.
BACKWARD_SINK_CASES = (((-1, -1), 0.0, True, False), ((17, 3), 30.0, False, True))


# The decode kernel's window and softcap variants, run on each decode config beside the plain cases:
# (window_size, softcap, causal); the window leaves most of the cache's tiles unread and, with
# three splits, splits with no tile (their partials empty).
DECODE_WINDOW_SOFTCAP_CASES = (((33, 2), 0.0, False), ((-1, -1), 30.0, True))
# Its learnable-sink builds (issue 56): (window_size, softcap, causal) with the sink of
# ``sink_logits`` (causal rows before a one-row cache's diagonal: 0 and LSE = the sink).
DECODE_SINK_CASES = (((-1, -1), 0.0, True), ((33, 2), 30.0, False))
# The builds of the KV-cache call's options (issue 56): (window_size, softcap, causal, cache_batch_idx,
# cache_leftpad, rotary) over the same cache, its rows in another order and its keys left-padded
# (sequence 2's whole cache: only its new rows, or no key); rotary 1 (halves) or 2 (interleaved),
# run with new rows only (RoPE tables of min(head_dim, 64) columns).
DECODE_OPTION_CASES = (((-1, -1), 0.0, True, (2, 0, 1), None, 0),
                       ((-1, -1), 0.0, False, None, (0, 30, -1), 0),
                       ((33, 2), 30.0, False, (1, 2, 0), (0, 5, -1), 0),
                       ((-1, -1), 0.0, True, None, None, 1),
                       ((33, 2), 0.0, False, (2, 0, 1), (0, 30, -1), 2))


def decode_cases(config) -> list[tuple[int, int]]:
    """(group, seqlen_q) whose packed rows dispatch to ``config`` (16 rows, or 17 to 32)."""
    return [(4, 1), (1, 3), (8, 2)] if config.m_tiles == 1 else [(8, 4), (4, 5)]


def run_decode_worker(config) -> int:
    """Decode on ``config``'s shapes: ragged cache lengths (1 to the capacity), with and without
    appended rows, one and three splits, causal or not, a window and a softcap case
    (``DECODE_WINDOW_SOFTCAP_CASES``), the sink cases (``DECODE_SINK_CASES``) and the cache options'
    and rotary embedding's (``DECODE_OPTION_CASES``; -1 in a cache_leftpad: the sequence's
    cache_seqlens), both dtypes,
    contiguous or (its kind) paged with shuffled pages (of 16 rows; page tiles: of ``block_n``, and no
    cache_leftpad, which such a cache does not dispatch to them); ``out`` poisoned with NaN; each
    sequence against float64."""
    import ml_dtypes
    from numba import cuda

    from numbaflash import flash_attention_with_kvcache
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_with_reference, rotary_embedding, rotary_query_step

    rng = np.random.default_rng(0)
    batch, heads_kv, capacity, page = 3, 2, 208, 16
    if config.page_tiles:
        page = config.block_n
        capacity = max(-(-capacity // page), 2) * page
    d, dv = config.head_dim, config.value_dim
    failures = 0
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for group, sq in decode_cases(config):
            for n_new in (0, 2):
                lens = np.array([1, 77, capacity - n_new], np.int32)
                q = rng.standard_normal((batch, sq, heads_kv * group, d)).astype(dtype)
                k_rows, v_rows = (rng.standard_normal((batch, capacity, heads_kv, width)).astype(dtype)
                                  for width in (d, dv))
                new = [rng.standard_normal((batch, n_new, heads_kv, width)).astype(dtype)
                       for width in (d, dv)]
                table = None
                k_cache, v_cache = k_rows, v_rows
                if config.paged:
                    per_seq = capacity // page
                    order = rng.permutation(batch * per_seq).astype(np.int32)
                    table = order.reshape(batch, per_seq)
                    k_cache = np.empty((batch * per_seq, page, heads_kv, d), dtype)
                    v_cache = np.empty((batch * per_seq, page, heads_kv, dv), dtype)
                    k_cache[table] = k_rows.reshape(batch, per_seq, page, heads_kv, d)
                    v_cache[table] = v_rows.reshape(batch, per_seq, page, heads_kv, dv)
                cases = [(*c, None, None, None, 0) for c in (((-1, -1), 0.0, False), ((-1, -1), 0.0, True),
                                                             *DECODE_WINDOW_SOFTCAP_CASES)]
                cases += [(*c, sink_logits(heads_kv * group), None, None, 0) for c in DECODE_SINK_CASES]
                for w, s, c, idx, pad, rotary in DECODE_OPTION_CASES:  # a leftpad of -1: the whole cache
                    if config.page_tiles and pad is not None:
                        continue
                    pad = None if pad is None else np.where(np.array(pad) < 0, lens, pad)
                    if n_new or not rotary:
                        cases.append((w, s, c, None, idx, pad, rotary))
                dim = min(d, 64)
                angle = (np.arange(capacity + sq)[:, None]
                         / 10000.0 ** (np.arange(dim // 2) * 2 / dim)[None, :])
                cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
                for splits in (1, 3):
                    for window, softcap, causal, sink, idx, pad, rotary in cases:
                        out = DeviceBuffer(np.full((*q.shape[:3], dv), np.nan, dtype))
                        kwargs = {"block_table": None if table is None else cuda.to_device(table),
                                  "causal": causal, "num_splits": splits, "return_lse": True, "out": out,
                                  "window_size": window, "softcap": softcap,
                                  "learnable_sink": None if sink is None else cuda.to_device(sink),
                                  "cache_batch_idx": None if idx is None else cuda.to_device(
                                      np.array(idx, np.int32)),
                                  "cache_leftpad": None if pad is None else cuda.to_device(
                                      pad.astype(np.int32))}
                        if rotary:
                            kwargs.update(rotary_cos=DeviceBuffer(cos), rotary_sin=DeviceBuffer(sin),
                                          rotary_interleaved=rotary == 2)
                        if n_new:
                            kwargs.update(k_new=DeviceBuffer(new[0]), v_new=DeviceBuffer(new[1]))
                        with configs.force_decode_config(config):
                            _, lse = flash_attention_with_kvcache(DeviceBuffer(q), DeviceBuffer(k_cache),
                                                                 DeviceBuffer(v_cache), cuda.to_device(lens),
                                                                 **kwargs)
                        got, lse = out.copy_to_host(), lse.copy_to_host()
                        for b in range(batch):
                            n, row = int(lens[b]), b if idx is None else idx[b]
                            start = 0 if pad is None else int(pad[b])
                            q_b, new_b = q[b:b + 1], new[0][b]
                            if rotary:  # rotated by the reference (FlashAttention's positions)
                                step = rotary_query_step(causal, window, capacity)
                                positions = n + np.arange(sq) * step
                                q_b = rotary_embedding(q[b], cos, sin, positions, rotary == 2)[None]
                                new_b = rotary_embedding(new_b, cos, sin, n + np.arange(n_new), rotary == 2)
                            keys = np.concatenate([k_rows[row, start:n], new_b])[None]
                            values = np.concatenate([v_rows[row, start:n], new[1][b]])[None]
                            _, problems = compare_with_reference(q_b, keys, values, got[b:b + 1],
                                                                 lse[b:b + 1], causal=causal,
                                                                 window_size=window, softcap=softcap,
                                                                 sink=sink)
                            for p in problems:
                                print(f"WRONG {config} {np.dtype(dtype).name} group={group} sq={sq} "
                                      f"new={n_new} splits={splits} causal={causal} window={window} "
                                      f"softcap={softcap} sink={sink is not None} cache_batch_idx={idx} "
                                      f"cache_leftpad={pad} rotary={rotary} batch {b}: {p}", flush=True)
                            failures += bool(problems)
    print(f"{WORKER_DONE} {config}: {failures} wrong results", flush=True)
    return WORKER_WRONG if failures else 0


def mla_cases(config) -> list[tuple[int, int]]:
    """(query heads, seqlen_q) whose packed rows dispatch to the MLA ``config`` (its rows, the second
    case ragged: not a multiple of 16, over two row blocks where it has 64)."""
    return {16: [(16, 1), (5, 3)], 32: [(32, 1), (9, 3)], 64: [(64, 1), (40, 3)]}[config.rows]


def run_mla_worker(config) -> int:
    """MLA decode (``flash_mla_with_kvcache``) on ``config``'s shapes (``mla_cases``): ragged cache
    lengths (1, 77, 0 and the capacity), one and three splits, causal or not, both dtypes, contiguous
    or (its kind) paged with shuffled pages of 16; every row past a sequence's length, every unused
    page and ``out`` NaN; each sequence against float64 (``compare_mla_with_reference``)."""
    import ml_dtypes
    from numba import cuda

    from numbaflash import flash_mla_with_kvcache
    from numbaflash.runtime.buffers import DeviceBuffer
    from numbaflash.tools.reference import compare_mla_with_reference

    rng = np.random.default_rng(0)
    capacity, page = 176, 16  # 11 pages; 3 tiles of 64 keys (the Hopper kernel: a pair and an odd one)
    d, dv = config.head_dim, config.value_dim
    lens = np.array([1, 77, 0, capacity], np.int32)
    batch = len(lens)
    failures = 0
    for dtype in (np.float16, ml_dtypes.bfloat16):
        rows = rng.standard_normal((batch, capacity, 1, d)).astype(dtype)
        for b, n in enumerate(lens):
            rows[b, n:] = np.nan
        table, cache = None, rows
        if config.paged:
            per_seq = capacity // page
            order = rng.permutation(batch * per_seq + 2)[:batch * per_seq]
            table = order.astype(np.int32).reshape(batch, per_seq)
            cache = np.full((batch * per_seq + 2, page, 1, d), np.nan, dtype)
            cache[table] = rows.reshape(batch, per_seq, page, 1, d)
        for heads, sq in mla_cases(config):
            q = rng.standard_normal((batch, sq, heads, d)).astype(dtype)
            for splits in (1, 3):
                for causal in (False, True):
                    out = DeviceBuffer(np.full((batch, sq, heads, dv), np.nan, dtype))
                    with configs.force_decode_config(config):
                        _, lse = flash_mla_with_kvcache(
                            DeviceBuffer(q), DeviceBuffer(cache), cuda.to_device(lens),
                            None if table is None else cuda.to_device(table), causal=causal,
                            num_splits=splits, return_lse=True, out=out)
                    got = out.copy_to_host()
                    problems = compare_mla_with_reference(q, cache, lens, got, lse.copy_to_host(),
                                                          block_table=table, causal=causal)
                    for p in problems:
                        print(f"WRONG {config} {np.dtype(dtype).name} heads={heads} sq={sq} splits={splits} "
                              f"causal={causal}: {p}", flush=True)
                    failures += bool(problems)
    print(f"{WORKER_DONE} {config}: {failures} wrong results", flush=True)
    return WORKER_WRONG if failures else 0


# --------------------------------------------------------------------------- parent


def gpu_info() -> tuple[tuple[int, int], str] | None:
    """(compute capability, name) of the current GPU, or None without one."""
    try:
        from numba import cuda

        if not cuda.is_available():
            return None
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return tuple(dev.compute_capability), name
    except Exception:
        return None


def find_sanitizer(explicit: str | None) -> str | None:
    if explicit:
        return explicit if os.path.isfile(explicit) else shutil.which(explicit)
    found = shutil.which("compute-sanitizer")
    patterns = ["/usr/local/cuda*/bin/compute-sanitizer",
                "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                f"{sys.prefix}/lib/python*/site-packages/nvidia/**/compute-sanitizer"]  # pip wheel
    candidates = [p for pat in patterns for p in sorted(glob.glob(pat, recursive=True)) if os.path.isfile(p)]
    return found or (candidates[-1] if candidates else None)


def job_command(sanitizer: str, tool: str, index: int, arch: str, print_limit: int) -> list[str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", str(SANITIZER_ERROR),
           "--print-limit", str(print_limit)]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    # cuda.core's module loading probes driver entry points with cuGetProcAddress, which fails
    # by design for ones this driver lacks: host-side API errors, not kernel errors.
    cmd += ["--report-api-errors", "no"]
    return cmd + [sys.executable, str(SCRIPT), "--worker", "--config-index", str(index), "--arch", arch]


def run_job(cmd: list[str], tool: str, index: int, log_path: Path, timeout: float) -> JobResult:
    """Run one sanitizer job with its output in ``log_path``; kill its process group on timeout."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    text = log_path.read_text(errors="replace")
    return JobResult(tool, index, rc, parse_summary(tool, text), WORKER_DONE in text, str(log_path),
                     wrong_lines(text))


def wrong_lines(text: str, limit: int = WRONG_LINES_SHOWN) -> tuple[str, ...]:
    """The first ``limit`` WRONG lines of a worker's log: what the summary prints for a job whose
    results failed the check, so that one run names the failing cases without its logs."""
    return tuple(line for line in text.splitlines() if line.startswith("WRONG "))[:limit]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tools", default=",".join(TOOLS), help="comma list of " + ", ".join(TOOLS))
    p.add_argument("--configs", help="comma list of indices, 'shipped', or a substring of the config str")
    p.add_argument("--arch", choices=sorted(configs.FAMILY_CAPABILITY), help="GPU family (default: detected)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="sanitizer processes at a time")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--log-dir", type=Path, help="where {tool}_{index}.log go (default: a new temp dir)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, then CUDA installs)")
    p.add_argument("--print-limit", type=int, default=20, help="errors the sanitizer prints per job")
    p.add_argument("--list", action="store_true", help="print the indexed configs and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config-index", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = None if args.arch and (args.list or args.worker) else gpu_info()
    arch = args.arch or (configs.arch_family(info[0]) if info else "sm90")
    config_list = runnable_configs(configs.FAMILY_CAPABILITY[arch])
    if args.worker:
        try:
            config = config_list[args.config_index]
            if family_of(config) is SM80_DEC:
                return run_decode_worker(config)
            if family_of(config) in (SM80_MLA, SM90_MLA):
                return run_mla_worker(config)
            if family_of(config) in (SM80_BWD, SM90_BWD):
                return run_backward_worker(config)
            return run_worker(config)
        except BaseException:
            traceback.print_exc()
            return WORKER_EXCEPTION
    if args.list:
        origin = "given" if args.arch else "detected" if info else "no GPU: default, use --arch"
        print(f"{arch} ({origin}):")
        for i, c in enumerate(config_list):
            print(f"{i:3d}  {kernel_family(c)}  d{c.head_dim}  {c}")
        return 0
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    sanitizer = find_sanitizer(args.sanitizer)
    if info is None or sanitizer is None or not set(tools) <= set(TOOLS):
        print("needs a GPU, compute-sanitizer (--sanitizer PATH) and tools among " + ", ".join(TOOLS),
              file=sys.stderr)
        return 2
    indices = select_indices(args.configs, config_list, configs.FAMILY_CAPABILITY[arch])
    if not indices:
        print(f"--configs {args.configs!r} matches none of the {len(config_list)} configs (--list)",
              file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="numbaflash-sanitize-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"GPU: {info[1]} (sm_{info[0][0]}{info[0][1]}, configs of {arch})")
    version = next((line for line in version.splitlines() if "Version" in line), version or "?")
    print(f"compute-sanitizer: {sanitizer}: {version}")
    print(f"logs: {log_dir}", flush=True)
    jobs = [(t, i) for i in indices for t in tools]
    results: dict[tuple[str, int], JobResult] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_job, job_command(sanitizer, t, i, arch, args.print_limit), t, i,
                               log_dir / f"{t}_{i}.log", args.timeout): (t, i) for t, i in jobs}
        for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            r = results[futures[fut]] = fut.result()
            print(f"[{n}/{len(jobs)}] {r.tool} #{r.index}: {r.cell}", file=sys.stderr, flush=True)
    print()
    print(format_table([(i, config_list[i]) for i in indices], results, tools))
    for (tool, i), r in sorted(results.items(), key=lambda item: (item[0][1], item[0][0])):
        for line in r.wrong:
            print(f"#{i} {tool}: {line}")
    print(summary_line(list(results.values())))
    return 0 if all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
