"""The FP8 linear product y = x @ w with per-tensor scales and a custom VJP.

    y = fp8_linear(x, w, scales, impl="xla" | "pallas", formats=HYBRID)

x [..., K] and w [K, N] are quantized to `formats.fwd` (e4m3) with `scales.x` and
`scales.w`; y [..., N] = dequantized product, in x's dtype. The backward pass quantizes
the output gradient g [..., N] to `formats.bwd` (e5m2) with `scales.g` and computes

    dx = g @ w^T  (x's dtype),      dw = x^T @ g  (w's dtype)

from the same float8 x and w the forward used (kept as residuals, one byte per value).
Every product is `fp8_matmul` (impl="pallas") or `fp8_matmul_xla` (impl="xla", which
XLA's GPU compiler turns into cuBLASLt FP8 GEMMs).

Interface for a training recipe (the scaling state lives with the caller):

* `scales` is an `Fp8Scales(x, w, g)` of fp32 scalars: quantization scales,
  float8 value = saturate(real value * scale), typically `compute_scale(amax,
  fp8_max(dtype), margin)` from an amax history (delayed scaling). An entry may be None:
  that tensor is then scaled by its own current amax ("current" scaling), computed where
  it is quantized (for g: inside the backward pass).
* "Overwrite with gradient": the cotangent fp8_linear returns for `scales` is not a
  derivative. It is `Fp8Scales(x=amax_x, w=amax_w, g=amax_g)`, the max |value| of the
  unquantized x, w and g this call saw (fp32 scalars; None for None entries). A train
  step differentiates its loss with respect to the scales as well as the parameters,
  reads this step's amaxes from those "gradients", rolls them into its amax histories
  and computes the next scales; it never hands them to the optimizer. Without
  differentiation no amax is computed.
* JAX adds the cotangents of a value used more than once. Give every use of fp8_linear
  its own Fp8Scales (stacked along `layers` like the weights in a scanned model), and
  combine the amaxes of microbatches or pipeline stages with max, not sum.
* `fp8_linear_amax(x, w, scales)` returns (y, Fp8Scales(amax_x, amax_w, None)) for
  callers that want the forward amaxes without differentiating.

The gradient is not differentiable again (no second-order FP8).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul import (
    HYBRID, Fp8Formats, compute_scale, fp8_matmul, fp8_matmul_xla, fp8_max, quantize)

IMPLS = ("xla", "pallas")


class Fp8Scales(NamedTuple):
    """Per-tensor quantization scales of one linear (fp32 scalars; None = current scaling).
    As the cotangent of fp8_linear: the amaxes of x, w and g instead (see the module doc)."""

    x: jax.Array | None = None
    w: jax.Array | None = None
    g: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class _Config:
    impl: str
    fwd: jnp.dtype          # float8 type of x and w
    bwd: jnp.dtype          # float8 type of g
    x_dtype: jnp.dtype      # of y and dx
    w_dtype: jnp.dtype      # of dw
    interpret: bool | None


def _amax(t):
    return jnp.max(jnp.abs(t)).astype(jnp.float32)


def _quantize(t, scale, dtype):
    """(float8 t, scale used, amax of t). A None scale means: scale by t's own amax."""
    amax = _amax(t)
    if scale is None:
        scale = compute_scale(amax, fp8_max(dtype))
    scale = jnp.asarray(scale, jnp.float32).reshape(())
    return quantize(t, scale, dtype), scale, amax


def _matmul(cfg: _Config, a, b, a_scale, b_scale, out_dtype, **layout):
    """One product of dequantized operands: a_scale, b_scale are quantization scales."""
    if cfg.impl == "pallas":
        return fp8_matmul(a, b, 1.0 / a_scale, 1.0 / b_scale, out_dtype=out_dtype,
                          interpret=cfg.interpret, **layout)
    return fp8_matmul_xla(a, b, 1.0 / a_scale, 1.0 / b_scale, out_dtype=out_dtype, **layout)


def _forward(cfg: _Config, x, w, scales: Fp8Scales):
    """(y, residuals, forward amaxes)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)                                        # [M, K]
    x8, sx, amax_x = _quantize(x2, scales.x, cfg.fwd)
    w8, sw, amax_w = _quantize(w, scales.w, cfg.fwd)             # [K, N]
    y = _matmul(cfg, x8, w8, sx, sw, x.dtype)                     # [M, N]
    y = y.reshape(*x.shape[:-1], w.shape[1])
    return y, (x8, w8, sx, sw), (amax_x, amax_w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_linear(x, w, scales, cfg):
    return _forward(cfg, x, w, scales)[0]


def _fp8_linear_fwd(x, w, scales, cfg):
    y, (x8, w8, sx, sw), (amax_x, amax_w) = _forward(cfg, x, w, scales)
    return y, (x8, w8, sx, sw, scales, amax_x, amax_w)


def _fp8_linear_bwd(cfg, res, g):
    x8, w8, sx, sw, scales, amax_x, amax_w = res
    k, n = w8.shape
    g8, sg, amax_g = _quantize(g.reshape(-1, n), scales.g, cfg.bwd)  # [M, N]
    # dx [M, K] = g [M, N] @ w^T: w8 [K, N] is already [out, contracted] (transpose_b).
    dx = _matmul(cfg, g8, w8, sg, sw, cfg.x_dtype, transpose_b=True)
    # dw [K, N] = x^T @ g: x8 [M, K] read as [contracted, out] (transpose_a).
    dw = _matmul(cfg, x8, g8, sx, sg, cfg.w_dtype, transpose_a=True)
    # The scales' "gradient" is the amaxes, shaped like the scales (None stays None).
    amaxes = Fp8Scales(*(None if s is None else amax.reshape(jnp.shape(s)).astype(jnp.float32)
                         for s, amax in zip(scales, (amax_x, amax_w, amax_g))))
    return dx.reshape(*g.shape[:-1], k), dw, amaxes


_fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


def _config(x, w, scales, impl, formats, interpret) -> _Config:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: accepted {IMPLS}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_linear takes x [..., K] and w [K, N]; got {x.shape=} {w.shape=}")
    if not isinstance(scales, Fp8Scales):
        raise TypeError(f"scales must be an Fp8Scales, got {type(scales).__name__}")
    formats = Fp8Formats(*(jnp.dtype(t) for t in formats))
    return _Config(impl=impl, fwd=formats.fwd, bwd=formats.bwd, x_dtype=jnp.dtype(x.dtype),
                   w_dtype=jnp.dtype(w.dtype), interpret=interpret)


def fp8_linear(x, w, scales: Fp8Scales = Fp8Scales(), *, impl: str = "xla",
               formats: Fp8Formats = HYBRID, interpret: bool | None = None):
    """y [..., N] = x [..., K] @ w [K, N] in FP8 (see the module docstring for the recipe
    interface). impl: "xla" (cuBLASLt FP8 GEMMs through XLA) or "pallas" (fp8_matmul);
    formats: (forward, backward) float8 types, HYBRID or HYBRID_FNUZ; interpret: passed to
    the Pallas kernel."""
    cfg = _config(x, w, scales, impl, formats, interpret)
    return _fp8_linear(x, w, scales, cfg)


def fp8_linear_amax(x, w, scales: Fp8Scales = Fp8Scales(), *, impl: str = "xla",
                    formats: Fp8Formats = HYBRID, interpret: bool | None = None):
    """(y, Fp8Scales(amax_x, amax_w, None)): fp8_linear's forward with the amaxes it
    measured, not differentiable (evaluation, calibration)."""
    cfg = _config(x, w, scales, impl, formats, interpret)
    y, _, (amax_x, amax_w) = _forward(cfg, x, w, scales)
    return y, Fp8Scales(x=amax_x, w=amax_w, g=None)
