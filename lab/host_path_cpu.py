"""Host cost of one ``numbaflash.flash_attention`` call on torch "CUDA" tensors, with no GPU: the
Python path of ``benchmarks/launch_overhead.py`` (issue 32) measured and profiled on a CPU.

    . .venv/bin/activate
    python lab/host_path_cpu.py [--calls 20000] [--repeats 5] [--profile] [--top 25]

For each kernel family, as ``launch_overhead.py`` runs them on an H100 (``sm90`` at head dim 128
and ``sm80`` at head dim 32, both on a pretend sm_90 device; problem (1, 256, 1, d) fp16,
causal), with and without ``out=``, and ``flash_attention_with_kvcache`` as ``decode_speed.py
--host`` calls it (batch 1, 256 keys, GQA 32/8, d128; also paged, pages of 64): the best of
``--repeats`` wall times of ``--calls`` back-to-back calls, in microseconds a call; ``--profile``
adds a cProfile of each, sorted by own time.

What is real and what is faked:

- The tensors are torch CPU tensors of a ``torch.Tensor`` subclass (``CudaLike``, module
  ``torch.cudalike``, torch functions not overridden) that say ``is_cuda`` and ``get_device()
  == 0``: ``shape``, ``stride()``, ``data_ptr()``, ``dtype``, ``requires_grad`` and
  ``torch.empty`` (the new ``out``) are torch's own, on the CPU. The routing check
  (``torch_route.route``) runs as it is, with ``torch_route.Tensor`` pointed at the subclass so that
  the direct path serves the call, as it does for a plain CUDA tensor.
- The device state (``runtime.device.GPU``) is a ``GpuState`` filled in for a pretend H100
  (capability, shared-memory limit, SM count, an LSE scratch address); the kernels "load" as
  stand-ins (nothing is compiled), and ``KernelLauncher`` is the real one: it packs every
  parameter, then calls a C function through ctypes with the real argument types in place of
  ``cuLaunchKernel`` (libc ``abs``, whose result is 0 for the stand-in kernel handle 0; for the
  decode's programmatic launch, ``cuLaunchKernelEx``, libc ``sched_yield``), so the ctypes
  conversion is counted; the decode kernel's registers are given (186, its d128 build's). The
  current-context query is libc ``strlen`` on the zeroed
  ``c_int`` (0: device 0) through ctypes.
- torch's current stream is a Python function that returns 0 (the real one,
  ``torch._C._cuda_getCurrentRawStream``, is a C call of about 0.1 us); the Hopper kernel's
  tensor-map slots are ``runtime.map_slots.MapSlots`` without device memory (a miss fills the
  slot table with no encoding and no copy; the hot path only hits).

Not counted: the driver's own launch time (a few microseconds on a real GPU) and torch's CUDA
caching allocator (``torch.empty`` here is the CPU allocator). Numbers from this machine are for
comparing host paths with each other; the figures of record come from ``launch_overhead.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import ctypes.util
import io
import pstats
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _disabled_torch_function_impl

import numbaflash
from numbaflash import operands, torch_route
from numbaflash.operations import decode, forward
from numbaflash.runtime import device as gpu_state
from numbaflash.runtime import launch as runtime_launch
from numbaflash.runtime import map_slots as map_slots_module

CAPABILITY = (9, 0)  # the H100 of launch_overhead.py: sm90 at d128, the sm80 kernel at d32
FAMILIES = {"sm90": 128, "sm80": 32}


class CudaLike(torch.Tensor):
    """A torch CPU tensor that says it is on CUDA device 0 (torch functions are not overridden:
    every other attribute and method is torch's own)."""

    __torch_function__ = _disabled_torch_function_impl
    is_cuda = True

    def get_device(self) -> int:
        return 0


CudaLike.__module__ = "torch.cudalike"  # operands.kind_of classifies by the type's module


def cuda_like(shape: tuple[int, ...]) -> CudaLike:
    return torch.Tensor._make_subclass(CudaLike, torch.zeros(shape, dtype=torch.float16))


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"))


def fake_launch_function() -> Callable[..., int]:
    """libc ``abs`` typed as ``cuLaunchKernel`` (11 arguments; the first, the handle 0, makes the
    result 0; the System V ABI lets a callee ignore arguments it does not read)."""
    fn = _libc().abs
    p, u = ctypes.c_void_p, ctypes.c_uint
    fn.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
    fn.restype = ctypes.c_int
    return fn


def fake_launch_ex_function() -> Callable[..., int]:
    """libc ``sched_yield`` typed as ``cuLaunchKernelEx`` (4 arguments, ignored; result 0): the
    programmatic launch of the decode's split kernels. A system call, about as cheap as the
    driver's launch is not: it counts the ctypes conversion, not the driver."""
    fn = _libc().sched_yield
    fn.argtypes = [ctypes.POINTER(runtime_launch._LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def fake_ctx_get_device() -> Callable[..., int]:
    """libc ``strlen`` typed as ``cuCtxGetDevice(int *)``: 0 on the zeroed int, which stays 0."""
    fn = _libc().strlen
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    return fn


def fake_two_argument_call() -> Callable[..., int]:
    """libc ``abs`` typed as ``cuEventRecord`` / ``cuStreamIsCapturing`` (0 for a first argument 0)."""
    fn = _libc().abs
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class HostSlots:
    """A stand-in for ``runtime.map_slots.MapSlots`` with what its hit costs: a ctypes call (the
    capture query, libc ``abs``), an ordered-dict lookup that moves the key to the end, and a
    ctypes call after the launch (the event record). A miss takes a new slot (no encoding, no
    copy); the hot path only hits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._query = self._record = fake_two_argument_call()
        self._status = ctypes.c_int()
        self._status_address = ctypes.addressof(self._status)
        self.slot_of: OrderedDict[tuple, int] = OrderedDict()
        self.device_of = [(1 << 32) + 512 * i for i in range(map_slots_module.SLOTS)]
        self._event_handles = [0] * map_slots_module.SLOTS

    def address(self, key: tuple, encode, stream: int) -> tuple[int, int]:
        if self._query(0, self._status_address):
            raise RuntimeError("capture query failed")
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self.slot_of[key] = len(self.slot_of) % map_slots_module.SLOTS
        else:
            self.slot_of.move_to_end(key)
        return self.device_of[slot], slot

    def used(self, slot: int, stream: int) -> None:
        if self._record(self._event_handles[slot], stream):
            raise RuntimeError("event record failed")


def install_fakes() -> None:
    """Point numbaflash at the pretend GPU (process-wide: this script runs nothing else)."""
    state = gpu_state.GpuState()
    state._driver = types.SimpleNamespace()  # "initialised": the hot path never calls it
    state._ctx_get_device = fake_ctx_get_device()
    state.capabilities[0] = CAPABILITY
    state.shared_limits[0] = 227 * 1024
    state.sm_counts[0] = 132
    state.scratch[0] = 1 << 33
    gpu_state.GPU = state
    launch_function = fake_launch_function()
    libcuda = types.SimpleNamespace(cuLaunchKernel=launch_function,
                                    cuLaunchKernelEx=fake_launch_ex_function())
    runtime_launch._libcuda = lambda: libcuda
    runtime_launch.set_dynamic_shared_limit = lambda handle, device, nbytes: None
    runtime_launch.kernel_registers = lambda handle, device: 186  # decode's CTAs a SM (its d128 build)
    forward.loaded_kernel = lambda spec: (types.SimpleNamespace(handle=0), f"{spec.operation}_entry")
    decode.loaded_kernel = forward.loaded_kernel  # (imported there by name)
    slots: dict[int, HostSlots] = {}
    map_slots_module.map_slots = lambda device: slots.setdefault(device, HostSlots())
    operands._RAW_STREAM = lambda device: 0
    torch_route.Tensor = CudaLike  # the routing check's "plain tensor" is the subclass here


def calls_for(head_dim: int) -> dict[str, Callable[[], Any]]:
    """The two calls of ``launch_overhead.py`` for one head dim: a new out, and out= given."""
    q, k, v, out = (cuda_like((1, 256, 1, head_dim)) for _ in range(4))

    def plain():
        numbaflash.flash_attention(q, k, v, causal=True)

    def given_out():
        numbaflash.flash_attention(q, k, v, causal=True, out=out)

    return {"": plain, " out=": given_out}


def decode_calls() -> dict[str, Callable[[], Any]]:
    """``decode_speed.py --host``'s call: batch 1, 256 cached keys, GQA 32/8, d128, one query row,
    a new out, out= given, and the cache paged (pages of 64, out= given)."""
    q, out = cuda_like((1, 1, 32, 128)), cuda_like((1, 1, 32, 128))
    k, v = cuda_like((1, 256, 8, 128)), cuda_like((1, 256, 8, 128))
    pages_k, pages_v = cuda_like((4, 64, 8, 128)), cuda_like((4, 64, 8, 128))
    seqlens = torch.Tensor._make_subclass(CudaLike, torch.full((1,), 256, dtype=torch.int32))
    table = torch.Tensor._make_subclass(CudaLike, torch.arange(4, dtype=torch.int32).reshape(1, 4))

    def plain():
        numbaflash.flash_attention_with_kvcache(q, k, v, seqlens)

    def given_out():
        numbaflash.flash_attention_with_kvcache(q, k, v, seqlens, out=out)

    def paged():
        numbaflash.flash_attention_with_kvcache(q, pages_k, pages_v, seqlens, block_table=table, out=out)

    return {"": plain, " out=": given_out, " paged out=": paged}


def us_per_call(call: Callable[[], Any], calls: int, repeats: int) -> float:
    """Best of ``repeats`` wall times of ``calls`` back-to-back calls, in microseconds a call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def profile(call: Callable[[], Any], calls: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    install_fakes()
    print(f"torch {torch.__version__}; (1, 256, 1, d) fp16 causal on a pretend sm_90; best of "
          f"{args.repeats} x {args.calls} calls")
    rows, profiles = [], []
    runs = [(family, calls_for(head_dim), f"d{head_dim}") for family, head_dim in FAMILIES.items()]
    runs.append(("decode", decode_calls(), "d128"))
    for family, calls, dim in runs:
        for suffix, call in calls.items():
            for _ in range(100):  # load, prepare, fill the ready table and the map slots
                call()
            name = f"{family} {dim}{suffix}"
            rows.append((name, us_per_call(call, args.calls, args.repeats)))
            if args.profile:
                profiles.append((name, profile(call, args.calls, args.top)))
    print(f"{'call':<22} {'us/call':>8}")
    for name, us in rows:
        print(f"{name:<22} {us:>8.2f}")
    for name, text in profiles:
        print(f"\n--- {name}\n{text}")


if __name__ == "__main__":
    main()
