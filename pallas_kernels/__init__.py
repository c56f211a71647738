"""Stand-alone Pallas kernels, each beside a plain-jnp reference and a custom_vjp."""

from pallas_kernels.block_scaled_linear import block_scaled_expert_product, block_scaled_linear
from pallas_kernels.block_scaling import (
    BLOCKWISE, MXFP8, BlockFormat, QTensor, block_format, dequantize_rows, quantize_rows, quantize_tiles)
from pallas_kernels.blockwise_fp8 import blockwise_matmul, blockwise_matmul_reference, blockwise_matmul_xla
from pallas_kernels.flash_attention import (
    flash_attention, flash_attention_reference, flash_attention_with_lse)
from pallas_kernels.fp8_linear import Fp8Scales, fp8_expert_product, fp8_linear, fp8_linear_amax
from pallas_kernels.fp8_matmul import (
    HYBRID, HYBRID_FNUZ, Fp8Formats, compute_scale, default_formats, fp8_matmul,
    fp8_matmul_reference, fp8_matmul_xla, fp8_max, quantize)
from pallas_kernels.mxfp8 import mxfp8_matmul, mxfp8_matmul_reference, native_mxfp8
from pallas_kernels.ssd import ssd, ssd_chunked, ssd_flops, ssd_reference

__all__ = [
    "flash_attention", "flash_attention_reference", "flash_attention_with_lse",
    "ssd", "ssd_chunked", "ssd_reference", "ssd_flops",
    "fp8_matmul", "fp8_matmul_xla", "fp8_matmul_reference", "quantize", "compute_scale",
    "fp8_max", "Fp8Formats", "HYBRID", "HYBRID_FNUZ", "default_formats",
    "fp8_linear", "fp8_linear_amax", "fp8_expert_product", "Fp8Scales",
    "BLOCKWISE", "MXFP8", "BlockFormat", "QTensor", "block_format", "quantize_rows", "quantize_tiles",
    "dequantize_rows", "blockwise_matmul", "blockwise_matmul_xla", "blockwise_matmul_reference",
    "mxfp8_matmul", "mxfp8_matmul_reference", "native_mxfp8", "block_scaled_linear",
    "block_scaled_expert_product",
]
