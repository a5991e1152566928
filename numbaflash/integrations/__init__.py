"""numbaflash inside other libraries. Each integration is its own module and imports its library
only when called: ``numbaflash.integrations.transformers`` (Hugging Face transformers)."""
