"""numbaflash: FlashAttention in pure Python with Numba CUDA."""

from .api import (
    flash_attention,
    flash_attention_backward,
    flash_attention_varlen,
    flash_attention_varlen_backward,
    flash_attention_with_kvcache,
    flash_mla_with_kvcache,
)
from .runtime.pipeline import release_staging
from .runtime.version import VERSION as __version__

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_varlen",
           "flash_attention_varlen_backward", "flash_attention_with_kvcache", "flash_mla_with_kvcache",
           "release_staging",
           "__version__"]
