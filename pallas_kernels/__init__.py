"""Stand-alone Pallas kernels, each beside a plain-jnp reference and a custom_vjp."""

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference, flash_attention_with_lse

__all__ = ["flash_attention", "flash_attention_reference", "flash_attention_with_lse"]
