"""numbaflash inside other libraries. Each integration is its own module and imports its library
only when called: ``numbaflash.integrations.transformers`` (Hugging Face transformers) and
``numbaflash.integrations.flash_attn`` (flash-attn's Python interface, for code written for it) and
``numbaflash.integrations.sdpa`` (torch's ``scaled_dot_product_attention`` on numbaflash where it
computes the call exactly)."""
