"""Layer 0, options: jax_blink's settings (``jax_blink.config``) and the one reader of its
``JAX_BLINK_*`` environment variables."""
from jax_blink.options.settings import (AUTO, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, KNOWN_ENVIRONMENT,
                                        Options, check_chunk_bytes, config, env_value, override,
                                        parse_byte_count)

__all__ = ["AUTO", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "KNOWN_ENVIRONMENT", "Options", "check_chunk_bytes", "config", "env_value", "override",
           "parse_byte_count"]
