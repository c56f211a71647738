"""Stand-alone Pallas kernels, each beside a plain-jnp reference and a custom_vjp."""

from pallas_kernels.flash_attention import (
    flash_attention, flash_attention_reference, flash_attention_with_lse)
from pallas_kernels.fp8_linear import Fp8Scales, fp8_expert_product, fp8_linear, fp8_linear_amax
from pallas_kernels.fp8_matmul import (
    HYBRID, HYBRID_FNUZ, Fp8Formats, compute_scale, default_formats, fp8_matmul,
    fp8_matmul_reference, fp8_matmul_xla, fp8_max, quantize)
from pallas_kernels.ssd import ssd, ssd_chunked, ssd_flops, ssd_reference

__all__ = [
    "flash_attention", "flash_attention_reference", "flash_attention_with_lse",
    "ssd", "ssd_chunked", "ssd_reference", "ssd_flops",
    "fp8_matmul", "fp8_matmul_xla", "fp8_matmul_reference", "quantize", "compute_scale",
    "fp8_max", "Fp8Formats", "HYBRID", "HYBRID_FNUZ", "default_formats",
    "fp8_linear", "fp8_linear_amax", "fp8_expert_product", "Fp8Scales",
]
