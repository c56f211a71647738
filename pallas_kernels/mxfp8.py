"""MXFP8 products: a [M, K] and b [N, K] quantized in 32-element blocks along K with e8m0 scales
(the OCP MX v1.0 format; pallas_kernels/block_scaling.py quantizes them), multiplied as

    mxfp8_matmul(a, a_codes, b, b_codes, *, out_dtype) = (a * 2^a_codes) @ (b * 2^b_codes)^T

Two implementations, chosen once from the device (`native_mxfp8()`):

* native, where the GPU multiplies MXFP8 itself (NVIDIA Blackwell, compute capability 10+):
  `jax.nn.scaled_matmul`, the block-scaled GEMM primitive `jax.nn.scaled_dot_general` runs with
  its `mxfp8` configuration (cuDNN's block-scaled dot on CUDA; XLA's `scaled_dot` composite on
  ROCm). megajax hands it operands it quantized itself, by the rule scaled_dot_general's own
  quantizer, Transformer Engine and cuDNN use (amax / 448 rounded up to a power of two): one
  quantization on every device keeps a run's numerics independent of the GPU it ran on.
* emulated everywhere else (CPU, Hopper, MI300): the exact values (e4m3 element x 2^scale,
  computed in fp32, or in a 16-bit out_dtype, where power-of-two scales keep them exact) multiplied
  with fp32 accumulation, as the tensor cores of a Blackwell GPU accumulate the same products.

K need not be a multiple of 32 (a short last block; the native path pads K with zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._common import cdiv, compute_capability
from pallas_kernels.block_scaling import MXFP8, MXFP8_FNUZ, QTensor, dequantize_rows

BLOCK = 32
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e4m3fnuz))
OUT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))


def native_mxfp8() -> bool:
    """Whether the default device multiplies MXFP8 natively: an NVIDIA GPU of compute capability
    10 or more (Blackwell), which jax.nn.scaled_matmul lowers to cuDNN's block-scaled GEMM."""
    cc = compute_capability()
    return cc is not None and cc[0] >= 10


def _check(a, a_codes, b, b_codes, out_dtype):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"mxfp8_matmul takes a [M, K] and b [N, K]; got {a.shape=} {b.shape=}")
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype}: accepted {[t.name for t in FP8_DTYPES]}")
    nb = cdiv(a.shape[1], BLOCK)
    for name, s, rows in (("a_codes", a_codes, a.shape[0]), ("b_codes", b_codes, b.shape[0])):
        if tuple(s.shape) != (rows, nb) or jnp.dtype(s.dtype) != jnp.dtype(jnp.uint8):
            raise ValueError(f"{name}: expected uint8 e8m0 codes of shape ({rows}, {nb}); got "
                             f"{s.dtype} {tuple(s.shape)}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} must be one of {[t.name for t in OUT_DTYPES]}")


def _native(a, a_codes, b, b_codes, out_dtype):
    k = a.shape[1]
    pad = cdiv(k, BLOCK) * BLOCK - k
    if pad:
        a, b = (jnp.pad(v, ((0, 0), (0, pad))) for v in (a, b))
    sa, sb = (lax.bitcast_convert_type(c, jnp.float8_e8m0fnu) for c in (a_codes, b_codes))
    out = jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None], preferred_element_type=out_dtype)
    return out[0]


def _emulated(a, a_codes, b, b_codes, out_dtype):
    dq = jnp.dtype(out_dtype) if jnp.dtype(out_dtype).itemsize == 2 else jnp.dtype(jnp.float32)
    fmt = MXFP8 if jnp.dtype(a.dtype) == jnp.dtype(jnp.float8_e4m3fn) else MXFP8_FNUZ
    a_dq = dequantize_rows(QTensor(a, a_codes), fmt, dq)
    b_dq = dequantize_rows(QTensor(b, b_codes), fmt, dq)
    out = lax.dot_general(a_dq, b_dq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def mxfp8_matmul(a, a_codes, b, b_codes, *, out_dtype, native: bool | None = None):
    """(a * 2^a_codes) @ (b * 2^b_codes)^T with fp32 accumulation.

    Args:
      a: [M, K] float8 elements; b: [N, K].
      a_codes: [M, ceil(K/32)] uint8 e8m0 codes (2^(code - 127); 255 = NaN); b_codes: [N, ceil(K/32)].
      out_dtype: float32, bfloat16 or float16.
      native: jax.nn.scaled_matmul (True) or the exact emulation (False); None: native_mxfp8().
    Returns: [M, N] in out_dtype.
    """
    _check(a, a_codes, b, b_codes, out_dtype)
    use_native = native_mxfp8() if native is None else native
    if use_native and jnp.dtype(a.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"the native MXFP8 GEMM takes float8_e4m3fn elements; got {a.dtype}")
    return (_native if use_native else _emulated)(a, a_codes, b, b_codes, jnp.dtype(out_dtype))


def mxfp8_matmul_reference(a, a_codes, b, b_codes):
    """The exact product in numpy float64: [M, N]."""
    def real(v, c):
        v64 = np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)
        c = np.asarray(c).astype(np.int64)
        f = np.where(c == 255, np.nan, np.ldexp(1.0, c - 127))
        return v64 * np.repeat(f, BLOCK, axis=1)[:, :v64.shape[1]]
    return real(a, a_codes) @ real(b, b_codes).T
