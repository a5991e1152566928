"""numbaflash: FlashAttention in pure Python with Numba CUDA."""

__version__ = "0.1.0"
