"""numbaflash: FlashAttention in pure Python with Numba CUDA."""

from .api import flash_attention

__version__ = "0.1.0"
__all__ = ["flash_attention", "__version__"]
