"""megajax: Megatron-LM's training capabilities in JAX."""

__version__ = "0.1.0"
