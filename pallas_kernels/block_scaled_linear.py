"""The linear product y = x @ w in block-scaled FP8 (recipes `blockwise` and `mxfp8`), with a
custom VJP, and the experts' grouped and batched products alike.

    y = block_scaled_linear(x, w, recipe="blockwise" | "mxfp8", impl=..., fnuz=False)

x [..., K] and w [K, N]; every product takes e4m3 operands (e4m3fnuz with fnuz=True, MI300)
quantized along its contracted dim (pallas_kernels/block_scaling.py):

    forward      y  = x @ w       x in blocks along K (1 x 128 | 1 x 32), w: blockwise's 128 x 128
                                  tiles | mxfp8's 32-blocks along K
    input grad   dx = g @ w^T     g in blocks along N, w: the same tiles read transposed | w
                                  quantized again in 32-blocks along N
    weight grad  dw = x^T @ g     x and g both in blocks along the tokens M (128 x 1 | 32 x 1)

so each tensor is quantized once per dim it is contracted over (x twice, g twice; the weight
once for blockwise, twice for mxfp8), and the backward pass keeps only float8 copies (x along M,
w for the input gradient: one byte per value). The products: blockwise through
`blockwise_matmul` (impl="pallas": the Pallas kernel; "xla": dequantize-then-dot),
mxfp8 through `mxfp8_matmul` (native=True: jax.nn.scaled_matmul on Blackwell; False: the exact
emulation; None: chosen from the device). y and dx come out in x's dtype, dw in w's.

There is no scaling state: every block is scaled by its own amax where it is quantized. Inside
a shard_map a block never spans two devices' shards of a contracted dim when the shards hold
whole blocks (a multiple of 128 | 32 along K; the tokens of each shard for the weight gradient).

The experts' products (`block_scaled_expert_product`: grouped rows sorted by expert, as
jax.lax.ragged_dot, or batched capacity buffers) quantize the same way, a weight per expert and
the weight gradient's blocks along the tokens restarting at each expert's first row (no block
spans two experts); their float8 values are multiplied exactly in fp32 (XLA has no grouped
FP8 GEMM: FP8's numerics, not its speed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import on_rocm, sum_to
from pallas_kernels.block_scaling import (
    BlockFormat, QTensor, block_format, dequantize_rows, dequantize_segments, quantize_rows, quantize_segments,
    quantize_tiles, segment_blocks, tiles_as_rows)
from pallas_kernels.blockwise_fp8 import blockwise_matmul, blockwise_matmul_xla
from pallas_kernels.mxfp8 import mxfp8_matmul

RECIPES = ("blockwise", "mxfp8")
IMPLS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class _Config:
    fmt: BlockFormat
    impl: str                # blockwise: "xla" | "pallas"
    native: bool | None      # mxfp8: jax.nn.scaled_matmul (True), emulation (False), None: by device
    x_dtype: jnp.dtype
    w_dtype: jnp.dtype
    interpret: bool | None
    weight_gather: object = None  # gather(float8 array, dim) (FSDP's gather of the float8 weight), or None
    gather_dim: int = 0           # the dim of w [K, N] it gathers


def _config(recipe, impl, fnuz, native, interpret, x_dtype, w_dtype, weight_gather=None, gather_dim=0) -> _Config:
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: accepted {RECIPES}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: accepted {IMPLS}")
    if recipe == "mxfp8" and impl == "pallas":
        raise ValueError("impl='pallas': there is no Pallas MXFP8 kernel (MXFP8 runs through "
                         "jax.nn.scaled_matmul, or its emulation); use impl='xla'")
    fnuz = on_rocm() if fnuz is None else fnuz
    return _Config(fmt=block_format(recipe, fnuz), impl=impl, native=native, x_dtype=jnp.dtype(x_dtype),
                   w_dtype=jnp.dtype(w_dtype), interpret=interpret, weight_gather=weight_gather,
                   gather_dim=gather_dim)


def _matmul(cfg: _Config, a: QTensor, b: QTensor, out_dtype):
    """a [M, K] and b [N, K], both in blocks along K -> a @ b^T [M, N]."""
    if cfg.fmt.name == "mxfp8":
        return mxfp8_matmul(a.values, a.scales, b.values, b.scales, out_dtype=out_dtype, native=cfg.native)
    if cfg.impl == "pallas":
        return blockwise_matmul(a.values, a.scales, b.values, b.scales, out_dtype=out_dtype,
                                interpret=cfg.interpret)
    return blockwise_matmul_xla(a.values, a.scales, b.values, b.scales, out_dtype=out_dtype)


def quantize_weight(w_KxN, fmt: BlockFormat, gather=None, gather_dim: int = 0) -> tuple[QTensor, QTensor]:
    """(w^T [N, K] in blocks along K: the forward's operand, w [K, N] in blocks along N: the input
    gradient's). Blockwise: one quantization in 128 x 128 tiles, read both ways. `gather(values,
    dim)`: FSDP's gather of the float8 values, whose dim `gather_dim` of w is sharded (mxfp8
    gathers the forward's copy and quantizes the input gradient's from its values)."""
    if fmt.name == "blockwise":
        tiles = quantize_tiles(w_KxN.T, fmt)                     # [N, K]
        if gather is not None:
            tiles = QTensor(gather(tiles.values, 1 - gather_dim), tiles.scales)
        return tiles_as_rows(tiles, fmt), tiles_as_rows(tiles, fmt, transpose=True)
    fwd = quantize_rows(w_KxN.T, fmt)                            # [N, K]
    if gather is None:
        return fwd, quantize_rows(w_KxN, fmt)
    fwd = QTensor(gather(fwd.values, 1 - gather_dim), fwd.scales)
    return fwd, quantize_rows(dequantize_rows(fwd, fmt).T, fmt)


# ----------------------------------------------------------------------------------- linear


def _forward(cfg: _Config, x, w):
    k, n = w.shape
    x2 = x.reshape(-1, k)                                   # [M, K]
    w_fwd, w_bwd = quantize_weight(w, cfg.fmt, cfg.weight_gather, cfg.gather_dim)
    y = _matmul(cfg, quantize_rows(x2, cfg.fmt), w_fwd, x.dtype).reshape(*x.shape[:-1], n)
    return y, (quantize_rows(x2.T, cfg.fmt), w_bwd)          # x^T [K, M] in blocks along M


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear(x, w, cfg):
    return _forward(cfg, x, w)[0]


def _linear_fwd(x, w, cfg):
    return _forward(cfg, x, w)


def _linear_bwd(cfg, res, g):
    x_cols, w_bwd = res                                     # [K, M] along M, [K, N] along N
    k, n = w_bwd.values.shape
    g2 = g.reshape(-1, n)                                   # [M, N]
    dx = _matmul(cfg, quantize_rows(g2, cfg.fmt), w_bwd, cfg.x_dtype)      # g @ w^T: [M, K]
    dw = _matmul(cfg, x_cols, quantize_rows(g2.T, cfg.fmt), cfg.w_dtype)   # x^T @ g: [K, N]
    return sum_to(dx.reshape(*g.shape[:-1], k), x_cols.values), sum_to(dw, w_bwd.values)


_linear.defvjp(_linear_fwd, _linear_bwd)


def block_scaled_linear(x, w, *, recipe: str, impl: str = "xla", fnuz: bool | None = None,
                        native: bool | None = None, interpret: bool | None = None, weight_gather=None,
                        gather_dim: int = 0):
    """y [..., N] = x [..., K] @ w [K, N] in block-scaled FP8 (module docstring).

    recipe: "blockwise" or "mxfp8"; impl: "xla" or "pallas" (blockwise's kernel); fnuz: e4m3fnuz
    elements (None: on ROCm); native: mxfp8's implementation (None: from the device);
    interpret: passed to the Pallas kernel; weight_gather(values, dim): FSDP's gather of the float8
    weight, whose dim `gather_dim` of w [K, N] is sharded (quantize_weight), or None."""
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"block_scaled_linear takes x [..., K] and w [K, N]; got {x.shape=} {w.shape=}")
    return _linear(x, w, _config(recipe, impl, fnuz, native, interpret, x.dtype, w.dtype, weight_gather,
                                 gather_dim))


# ----------------------------------------------------------------------------------- experts


def _expert_product(kind: str, a, b, group_sizes):
    if kind == "grouped":
        return jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32)
    return jnp.einsum("gck,gkn->gcn", a, b, preferred_element_type=jnp.float32)


def _expert_weights(w_ExKxN, fmt: BlockFormat):
    """The experts' weights: (the forward's exact fp32 values [E, K, N], the input gradient's
    quantized copy: values [E, K, N] in blocks along N)."""
    def one(w):
        fwd, bwd = quantize_weight(w, fmt)
        return dequantize_rows(fwd, fmt).T, bwd
    return jax.vmap(one)(w_ExKxN)


def _tokens_quantized(kind, t, group_sizes, fmt: BlockFormat) -> QTensor:
    """t quantized in blocks along the tokens: batched [E, C, F] along C (kept as [E, F, C]),
    grouped [M, F] along M, each expert's blocks starting at its first row."""
    if kind == "batched":
        return quantize_rows(jnp.swapaxes(t, 1, 2), fmt)
    segment, count = segment_blocks(group_sizes, t.shape[0], fmt.block)
    return quantize_segments(t, fmt, segment, count)


def _tokens_values(kind, q: QTensor, group_sizes, fmt: BlockFormat):
    """The exact fp32 values of _tokens_quantized's result, laid out as its input."""
    if kind == "batched":
        return jnp.swapaxes(dequantize_rows(q, fmt), 1, 2)
    segment, _ = segment_blocks(group_sizes, q.values.shape[0], fmt.block)
    return dequantize_segments(q, fmt, segment)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _experts(x, w, group_sizes, cfg, kind):
    return _experts_fwd(x, w, group_sizes, cfg, kind)[0]


def _experts_fwd(x, w, group_sizes, cfg, kind):
    fmt = cfg.fmt
    w_fwd, w_bwd = _expert_weights(w, fmt)
    y = _expert_product(kind, dequantize_rows(quantize_rows(x, fmt), fmt), w_fwd, group_sizes)
    # Kept for the backward: float8 copies of x along the tokens and of w along N.
    return y.astype(x.dtype), (_tokens_quantized(kind, x, group_sizes, fmt), w_bwd, group_sizes)


def _experts_bwd(cfg, kind, res, g):
    x_tokens, w_bwd, group_sizes = res
    fmt = cfg.fmt
    product = functools.partial(_expert_product, kind, group_sizes=group_sizes)
    x_values = _tokens_values(kind, x_tokens, group_sizes, fmt)
    w_values = jax.vmap(lambda q: dequantize_rows(q, fmt))(w_bwd)
    g_rows = dequantize_rows(quantize_rows(g, fmt), fmt)                   # blocks along N
    _, vjp_x = jax.vjp(lambda a: product(a, w_values), x_values)
    (dx,) = vjp_x(g_rows)
    _, vjp_w = jax.vjp(lambda b: product(x_values, b), w_values)
    (dw,) = vjp_w(_tokens_values(kind, _tokens_quantized(kind, g, group_sizes, fmt), group_sizes, fmt))
    sizes_ct = None if group_sizes is None else np.zeros(group_sizes.shape, jax.dtypes.float0)
    return (sum_to(dx.astype(cfg.x_dtype), x_tokens.values), sum_to(dw.astype(cfg.w_dtype), w_bwd.values),
            sizes_ct)


_experts.defvjp(_experts_fwd, _experts_bwd)


def block_scaled_expert_product(x, w, group_sizes=None, *, recipe: str, fnuz: bool | None = None):
    """The experts' product in block-scaled FP8: grouped (`group_sizes` given: x [M, K] rows sorted
    by expert, w [E, K, N] -> [M, N]) or batched (x [E, C, K], w [E, K, N] -> [E, C, N])."""
    grouped = group_sizes is not None
    if w.ndim != 3 or x.ndim != (2 if grouped else 3) or x.shape[-1] != w.shape[1]:
        raise ValueError(f"block_scaled_expert_product takes x [M, K] with group sizes, or [E, C, K], and "
                         f"w [E, K, N]; got {x.shape=} {w.shape=}")
    cfg = _config(recipe, "xla", fnuz, False, None, x.dtype, w.dtype)
    return _experts(x, w, group_sizes, cfg, "grouped" if grouped else "batched")
