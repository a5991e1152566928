"""Device buffers for 16-bit float arrays that Numba's device arrays cannot hold.

Numba device arrays cannot be built from ``ml_dtypes.bfloat16`` numpy arrays (no buffer
protocol code for it). ``DeviceBuffer`` keeps the bytes on the GPU as uint16 and presents them
through ``__cuda_array_interface__`` together with a ``dtype`` attribute that says what they
are; ``numbaflash.flash_attention`` reads ``dtype`` first. Works the same for float16.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DeviceBuffer:
    """A contiguous (shape, dtype) 16-bit array in GPU memory.

    ``DeviceBuffer(host)`` copies a numpy array to the device; ``DeviceBuffer.empty(shape,
    dtype)`` allocates one; ``copy_to_host()`` returns a numpy array of the original dtype.
    """

    def __init__(self, host: np.ndarray | None = None, *, _raw: Any = None,
                 _dtype: np.dtype | None = None) -> None:
        from numba import cuda

        if host is not None:
            host = np.ascontiguousarray(host)
            if host.dtype.itemsize != 2:
                raise TypeError(f"DeviceBuffer holds 16-bit floats, got dtype {host.dtype}")
            self.dtype = host.dtype
            self.raw = cuda.to_device(host.view(np.uint16))
        elif _raw is not None and _dtype is not None:
            self.dtype, self.raw = _dtype, _raw
        else:
            raise TypeError("DeviceBuffer needs a numpy array (or use DeviceBuffer.empty)")
        self.shape = tuple(self.raw.shape)

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: Any) -> DeviceBuffer:
        from numba import cuda

        dtype = np.dtype(dtype)
        if dtype.itemsize != 2:
            raise TypeError(f"DeviceBuffer holds 16-bit floats, got dtype {dtype}")
        return cls(_raw=cuda.device_array(shape, np.uint16), _dtype=dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.raw.__cuda_array_interface__

    def copy_to_host(self) -> np.ndarray:
        return self.raw.copy_to_host().view(self.dtype)
