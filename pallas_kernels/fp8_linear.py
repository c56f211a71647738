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
import numpy as np

from pallas_kernels._common import max_over as _max_over, sum_to as _sum_to, varying as _varying
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
    # The float8 weight's way to the product: gather(w8, dim) with dim the sharded dim of w [K, N]
    # (FSDP gathering the float8 copy, precision.fp8_param_gather), or None (w8 as it is).
    weight_gather: object = None
    gather_dim: int = 0


def _amax(t):
    return jnp.max(jnp.abs(t)).astype(jnp.float32)


def _quantize(t, scale, dtype):
    """(float8 t, scale used, amax of t). A None scale means: scale by t's own amax, over the whole
    tensor where a shard_map holds a part of it (its shards' maximum)."""
    amax = _amax(t)
    if scale is None:
        scale = compute_scale(_max_over(amax, _varying(t)), fp8_max(dtype))
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
    if cfg.weight_gather is not None:
        w8 = cfg.weight_gather(w8, cfg.gather_dim)
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
    # The scales' "gradient" is the amaxes, shaped like the scales (None stays None). Inside a
    # shard_map, over the shards of the tensor a scale is shared by (the axes the tensor varies
    # over and the scale does not: a weight split over `tensor`, an activation's sequence under
    # sequence parallelism), as one device would see the whole tensor.
    amaxes = Fp8Scales(*(None if s is None else
                         _max_over(amax, _varying(amax) - _varying(s)).reshape(jnp.shape(s)).astype(jnp.float32)
                         for s, amax in zip(scales, (amax_x, amax_w, amax_g))))
    return _sum_to(dx.reshape(*g.shape[:-1], k), x8), _sum_to(dw, w8), amaxes


_fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


def _config(x, w, scales, impl, formats, interpret, weight_gather=None, gather_dim=0) -> _Config:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: accepted {IMPLS}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_linear takes x [..., K] and w [K, N]; got {x.shape=} {w.shape=}")
    if not isinstance(scales, Fp8Scales):
        raise TypeError(f"scales must be an Fp8Scales, got {type(scales).__name__}")
    formats = Fp8Formats(*(jnp.dtype(t) for t in formats))
    return _Config(impl=impl, fwd=formats.fwd, bwd=formats.bwd, x_dtype=jnp.dtype(x.dtype),
                   w_dtype=jnp.dtype(w.dtype), interpret=interpret, weight_gather=weight_gather,
                   gather_dim=gather_dim)


def fp8_linear(x, w, scales: Fp8Scales = Fp8Scales(), *, impl: str = "xla",
               formats: Fp8Formats = HYBRID, interpret: bool | None = None, weight_gather=None,
               gather_dim: int = 0):
    """y [..., N] = x [..., K] @ w [K, N] in FP8 (see the module docstring for the recipe
    interface). impl: "xla" (cuBLASLt FP8 GEMMs through XLA) or "pallas" (fp8_matmul);
    formats: (forward, backward) float8 types, HYBRID or HYBRID_FNUZ; interpret: passed to
    the Pallas kernel; weight_gather(w8, dim): applied to the float8 weight before the products,
    `gather_dim` of w [K, N] (FSDP's gather of the float8 copy), or None."""
    cfg = _config(x, w, scales, impl, formats, interpret, weight_gather, gather_dim)
    return _fp8_linear(x, w, scales, cfg)


def fp8_linear_amax(x, w, scales: Fp8Scales = Fp8Scales(), *, impl: str = "xla",
                    formats: Fp8Formats = HYBRID, interpret: bool | None = None):
    """(y, Fp8Scales(amax_x, amax_w, None)): fp8_linear's forward with the amaxes it
    measured, not differentiable (evaluation, calibration)."""
    cfg = _config(x, w, scales, impl, formats, interpret)
    y, _, (amax_x, amax_w) = _forward(cfg, x, w, scales)
    return y, Fp8Scales(x=amax_x, w=amax_w, g=None)


# ----------------------------------------------------------------------------
# The experts' products: grouped (dropless) and batched (capacity) forms
# ----------------------------------------------------------------------------

def _expert_product(kind: str, a, b, group_sizes):
    """grouped: a [M, K] rows sorted by group, b [G, K, N] -> [M, N]; batched: a [G, C, K],
    b [G, K, N] -> [G, C, N]; fp32 results."""
    if kind == "grouped":
        return jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32)
    return jnp.einsum("gck,gkn->gcn", a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_experts(x, w, group_sizes, scales, cfg, kind):
    return _fp8_experts_fwd(x, w, group_sizes, scales, cfg, kind)[0]


def _fp8_experts_fwd(x, w, group_sizes, scales, cfg, kind):
    x8, sx, amax_x = _quantize(x, scales.x, cfg.fwd)
    w8, sw, amax_w = _quantize(w, scales.w, cfg.fwd)
    y = _expert_product(kind, x8.astype(jnp.float32), w8.astype(jnp.float32), group_sizes) / (sx * sw)
    return y.astype(x.dtype), (x8, w8, sx, sw, group_sizes, scales, amax_x, amax_w)


def _fp8_experts_bwd(cfg, kind, res, g):
    x8, w8, sx, sw, group_sizes, scales, amax_x, amax_w = res
    g8, sg, amax_g = _quantize(g, scales.g, cfg.bwd)
    # The products of the float8 values (exact in fp32), then the scales: dx = g w^T, dw = x^T g.
    _, vjp = jax.vjp(lambda a, b: _expert_product(kind, a, b, group_sizes), x8.astype(jnp.float32),
                     w8.astype(jnp.float32))
    dx, dw = vjp(g8.astype(jnp.float32))
    amaxes = Fp8Scales(*(None if s is None else
                         _max_over(amax, _varying(amax) - _varying(s)).reshape(jnp.shape(s)).astype(jnp.float32)
                         for s, amax in zip(scales, (amax_x, amax_w, amax_g))))
    sizes_ct = None if group_sizes is None else np.zeros(group_sizes.shape, jax.dtypes.float0)
    return (_sum_to((dx / (sg * sw)).astype(cfg.x_dtype), x8), _sum_to((dw / (sx * sg)).astype(cfg.w_dtype), w8),
            sizes_ct, amaxes)


_fp8_experts.defvjp(_fp8_experts_fwd, _fp8_experts_bwd)


def fp8_expert_product(x, w, scales: Fp8Scales = Fp8Scales(), group_sizes=None, *, formats: Fp8Formats = HYBRID):
    """The experts' product in FP8, with fp8_linear's recipe interface (scales, amaxes as their
    cotangent): grouped (`group_sizes` given: x [M, K] rows sorted by expert, w [E, K, N] ->
    [M, N], as jax.lax.ragged_dot) or batched (x [E, C, K], w [E, K, N] -> [E, C, N]). The float8
    values are multiplied exactly (fp32) and scaled after: XLA has no FP8 grouped GEMM."""
    grouped = group_sizes is not None
    if w.ndim != 3 or x.ndim != (2 if grouped else 3) or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_expert_product takes x [M, K] with group sizes, or [E, C, K], and w [E, K, N]; "
                         f"got {x.shape=} {w.shape=}")
    formats = Fp8Formats(*(jnp.dtype(t) for t in formats))
    cfg = _Config(impl="xla", fwd=formats.fwd, bwd=formats.bwd, x_dtype=jnp.dtype(x.dtype),
                  w_dtype=jnp.dtype(w.dtype), interpret=None)
    return _fp8_experts(x, w, group_sizes, scales, cfg, "grouped" if grouped else "batched")
