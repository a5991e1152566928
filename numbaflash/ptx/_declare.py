"""The one place that turns a C helper name into a Numba device function."""

from __future__ import annotations

from numba import cuda, types

from ..runtime.sources import ptx_source

u16p = types.CPointer(types.uint16)
u32p = types.CPointer(types.uint32)
u64p = types.CPointer(types.uint64)
f32p = types.CPointer(types.float32)


def declare(family: str, name: str, signature):
    """Bind ``extern "C" name`` from ``ptx/<family>.cu``; LTO inlines it into the caller."""
    return cuda.declare_device(name, signature, link=ptx_source(family), abi="c")
