"""Building blocks: Dense (injectable dot_general), embeddings, norms, rotary, dropout, softmax.

Every parameter carries its logical axis names in the `axes` metadata; the
mapping to mesh axes lives in megajax/mesh.py. Parameters are stored in
`param_dtype` (fp32 master weights) and cast to the compute `dtype` on use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.mesh import one_device_positions

DotGeneral = Callable[..., jax.Array]


def flat_dot_general(dot_general: DotGeneral = jax.lax.dot_general) -> DotGeneral:
    """A projection `dot_general` whose backward is two plain matrix products.

    For y[..., M] = x[..., K] . W[K, M] (x's trailing dims contracted, any kernel
    layout), the backward computes dx = dy . W^T and dW = x^T . dy with the
    activation as the left operand. Left to JAX's generic transpose rule,
    XLA:CPU materialises a transposed copy of the (large) cotangent fused with
    its producer (softmax/SiLU backward), which costs more than the products
    themselves; this form halves the step time of small models on CPU.
    """
    def split(x, w, dimension_numbers):
        (lc, rc), (lb, rb) = dimension_numbers
        n_in = len(lc)
        assert not lb and not rb and tuple(lc) == tuple(range(x.ndim - n_in, x.ndim)), dimension_numbers
        free = tuple(d for d in range(w.ndim) if d not in rc)
        w2 = jnp.transpose(w, tuple(rc) + free)  # [K..., M...]
        return n_in, w2

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def product(x, w, dimension_numbers):
        n_in, w2 = split(x, w, dimension_numbers)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        return dot_general(x, w2, (contract, ((), ())))

    def forward(x, w, dimension_numbers):
        return product(x, w, dimension_numbers), (x, w)

    def backward(dimension_numbers, residuals, g):
        x, w = residuals
        n_in, w2 = split(x, w, dimension_numbers)
        lead = x.ndim - n_in  # token dims (batch, sequence), kept unmerged: they may be sharded
        n_out = w2.ndim - n_in
        # dx[..., K] = g[..., M] . W[K, M]^T ; dW[K, M] = x[..., K]^T . g[..., M] (x on the left)
        dx = dot_general(g, w2, ((tuple(range(lead, g.ndim)), tuple(range(n_in, w2.ndim))), ((), ())))
        tokens = (tuple(range(lead)), tuple(range(lead)))
        if math.prod(x.shape[lead:]) > math.prod(g.shape[lead:]):
            # The product's left operand gets a transposed copy (token dims contracted): copy the
            # smaller one, g, and transpose the (small) result instead; 2-3x faster for fc2 on CPU.
            dw2t = dot_general(g, x, (tokens, ((), ())))  # [M..., K...]
            dw2 = jnp.transpose(dw2t, tuple(range(n_out, n_out + n_in)) + tuple(range(n_out)))
        else:
            dw2 = dot_general(x, g, (tokens, ((), ())))
        assert dx.shape == x.shape and dw2.ndim == n_in + n_out
        (_, rc), _ = dimension_numbers
        free = tuple(d for d in range(w.ndim) if d not in rc)
        dw = jnp.transpose(dw2, tuple(int(i) for i in np_argsort(tuple(rc) + free)))
        return _sum_to_vma(dx.astype(x.dtype), x), _sum_to_vma(dw.astype(w.dtype), w)

    product.defvjp(forward, backward)

    def wrapped(x, w, dimension_numbers, precision=None, preferred_element_type=None):
        assert precision is None and preferred_element_type is None
        return product(x, w, dimension_numbers)

    return wrapped


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_lse(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    m = jax.lax.stop_gradient(jnp.max(x, axis, keepdims=True))
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis, keepdims=True)
    return e / s, jnp.squeeze(jnp.log(s) + m, axis)


@_softmax_lse.defjvp
def _softmax_lse_jvp(axis, primals, tangents):
    (x,), (dx,) = primals, tangents
    y, lse = _softmax_lse(x, axis)
    d_lse = jnp.sum(y * dx, axis, keepdims=True)
    return (y, lse), (y * (dx - d_lse), jnp.squeeze(d_lse, axis))


def softmax_lse(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """(softmax(x), logsumexp(x)) along `axis` for finite x, the backward pass keeping the softmax
    alone (the logsumexp's derivative is the softmax)."""
    return _softmax_lse(x, axis)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """softmax along `axis`, the values of jax.nn.softmax, whose backward pass keeps only the output
    (y dx - y <y, dx>): jax.nn.softmax's autodiff keeps exp(x - max), the sum and its inverse
    square, three arrays for a layer's scan to stack and read back where one does (the attention
    probabilities: one [query, key] array per head instead of two)."""
    return _softmax_lse(x, axis)[0]


def _sum_to_vma(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Inside shard_map: sums a cotangent over the mesh axes it varies on but its primal does not
    (what JAX's own transpose rules do for an operand replicated over, e.g., data-parallel axes)."""
    extra = _varying_axes(ct) - _varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def _varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def np_argsort(order: tuple[int, ...]) -> tuple[int, ...]:
    """Inverse permutation."""
    return tuple(sorted(range(len(order)), key=lambda i: order[i]))


def take_rows(table_VxD: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table_VxD, ids, axis=0)


@dataclasses.dataclass(frozen=True)
class LinearOps:
    """The products a model injects into its layers (Megatron's parallel-linear kinds).

    `column` serves projections whose output features are split over tensor
    parallelism (q/k/v, fc1/gate/up, output layer), `row` those whose input
    features are (o, fc2); `embed` looks rows up in the (vocab-split) table, `embed_positions`
    in the learned position table.
    The defaults are plain; tensor and sequence parallelism supply others, and `layout(kind,
    product)` wraps a per-layer product in their collectives. A layer whose product may be
    replaced by a stateful one (FP8) asks `linear(kind, name)` for its own, naming it (the names
    of megajax/config.py FP8_PRODUCT_NAMES, and `output_layer`).
    """
    column: DotGeneral = jax.lax.dot_general
    row: DotGeneral = jax.lax.dot_general
    embed: Callable[[jax.Array, jax.Array], jax.Array] = take_rows
    embed_positions: Callable[[jax.Array, jax.Array], jax.Array] = take_rows  # learned position table
    # The layout's collectives around a product of `kind` ("column" or "row"): None when the
    # products need none (XLA partitions them).
    layout: Callable[[str, DotGeneral], DotGeneral] | None = None
    # A factory of stateful products (FP8 with its scaling state), one per linear layer that asks
    # for one: low_precision(the layout's wrapper of its local product or None, "column" | "row"),
    # for the products named in `low_precision_products`; None: the plain products above.
    low_precision: Callable[[Callable[[DotGeneral], DotGeneral] | None, str], DotGeneral] | None = None
    low_precision_products: frozenset = frozenset()

    def in_low_precision(self, name: str) -> bool:
        return self.low_precision is not None and name in self.low_precision_products

    def linear(self, kind: str, name: str) -> DotGeneral:
        """The product of one linear layer of `kind` ("column", "row", "output", or "duplicated": a
        kernel replicated over tensor parallelism, as multi-latent attention's down-projections,
        whose product XLA partitions and whose plain form is jax.lax.dot_general) named `name`: a
        fresh stateful product (its own scaling state) where the ops supply one for that name,
        else the plain one."""
        assert kind in ("column", "row", "output", "duplicated"), kind
        low = self.in_low_precision(name)
        if kind == "duplicated":
            return self.low_precision(None, "column") if low else jax.lax.dot_general
        if low:
            side = "row" if kind == "row" else "column"
            return self.low_precision(None if self.layout is None else functools.partial(self.layout, side), side)
        return self.row if kind == "row" else self.column


def _tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


def normal_init(key: jax.Array, shape: tuple[int, ...], std: float, dtype=jnp.float32) -> jax.Array:
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def padded_normal_init(key: jax.Array, shape: tuple[int, ...], std: float, axis: int,
                       real_size: int, dtype=jnp.float32) -> jax.Array:
    """Normal init of the first `real_size` entries along `axis`, zeros in the padding.

    The real part does not depend on the padded size, so a model padded for
    tensor=4 holds the same weights as one padded for tensor=1.
    """
    real_shape = list(shape)
    real_shape[axis] = real_size
    w = normal_init(key, tuple(real_shape), std, dtype)
    pad = [(0, 0)] * len(shape)
    pad[axis] = (0, shape[axis] - real_size)
    return jnp.pad(w, pad)


class Dense(nnx.Module):
    """y[..., out] = x[..., in] . W[in, out] (+ b[out]); `in` and `out` may each be several dims.

    `axes` names the logical axes of W (in dims then out dims). `dot_general`
    is injected (e.g. an FP8 delayed-scaling dot_general).
    """

    def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
                 axes: tuple[str, ...], use_bias: bool = False, init_std: float = 0.02,
                 dtype=jnp.float32, param_dtype=jnp.float32,
                 dot_general: DotGeneral = jax.lax.dot_general, lora: nnx.Module | None = None, rngs: nnx.Rngs):
        self.in_features = _tuple(in_features)
        self.out_features = _tuple(out_features)
        assert len(axes) == len(self.in_features) + len(self.out_features), axes
        shape = self.in_features + self.out_features
        self.kernel = nnx.Param(normal_init(rngs.params(), shape, init_std, param_dtype), axes=axes)
        self.bias = (nnx.Param(jnp.zeros(self.out_features, param_dtype),
                               axes=axes[len(self.in_features):]) if use_bias else None)
        self.dtype = dtype
        self.dot_general = dot_general
        self.lora = lora  # a low-rank adapter beside the (frozen) kernel (megajax/models/lora.py), or None

    def __call__(self, x: jax.Array, dropout_rng: jax.Array | None = None, names: tuple | None = None) -> jax.Array:
        """`dropout_rng`, `names`: the adapter's input dropout key and x's logical dims."""
        n_in = len(self.in_features)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        y = self.dot_general(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                             (contract, ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x, dropout_rng, names).astype(y.dtype)
        return y


class Embed(nnx.Module):
    """Token embedding table [vocab (padded), embed]; `attend` gives tied output logits."""

    def __init__(self, vocab_size: int, padded_vocab_size: int, features: int, *,
                 init_std: float, dtype=jnp.float32, param_dtype=jnp.float32,
                 ops: LinearOps = LinearOps(), tied: bool = True, rngs: nnx.Rngs):
        table = padded_normal_init(rngs.params(), (padded_vocab_size, features), init_std, 0,
                                   vocab_size, param_dtype)
        self.embedding = nnx.Param(table, axes=("vocab", "embed"))
        self.dtype = dtype
        self.ops = ops
        # The tied output layer's product (`attend`); unused when the output layer is untied.
        self.attend_product = ops.linear("output", "output_layer") if tied else ops.column

    def __call__(self, ids_BxL: jax.Array) -> jax.Array:
        return self.ops.embed(self.embedding[...], ids_BxL).astype(self.dtype)

    def attend(self, x_BxLxD: jax.Array) -> jax.Array:
        """Tied output layer: logits[B, L, V] = x . E^T (column-parallel over the vocab)."""
        return self.attend_product(x_BxLxD.astype(self.dtype), self.embedding[...].astype(self.dtype),
                                   (((2,), (1,)), ((), ())))


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim; `axis` names its scale's logical axis (`head_dim` for q/k norms)."""

    def __init__(self, features: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32,
                 axis: str = "embed"):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), axes=(axis,))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype), axes=("embed",))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


def make_norm(kind: str, features: int, *, eps: float, dtype, param_dtype=jnp.float32) -> nnx.Module:
    cls = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}[kind]
    return cls(features, eps=eps, dtype=dtype, param_dtype=param_dtype)


# ----------------------------------------------------------------------------
# Rotary position embedding ("rotate half" pairing: dim j with j + head_dim/2)
# ----------------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_position: int = 8192, beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with Llama-3's or YaRN's frequency scaling when asked."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling == "yarn":
        # Dims that turn fewer than beta_slow times over the original context are interpolated (slowed by
        # `factor`), those turning more than beta_fast times kept, a linear ramp between (over whole dims).
        def dim_of(turns):
            return head_dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(dim_of(beta_fast)), 0)
        high = min(math.ceil(dim_of(beta_slow)), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2) - low) / ((high - low) or 0.001), 0.0, 1.0)
        return (inv_freq / factor * ramp + inv_freq * (1 - ramp)).astype(np.float32)
    if scaling == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = original_max_position / low_freq_factor
        high_freq_wavelen = original_max_position / high_freq_factor
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
        # and the band between interpolated smoothly.
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        between = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        scaled = np.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        inv_freq = scaled
    elif scaling != "none":
        raise ValueError(f"unknown rope scaling {scaling!r}")
    return inv_freq.astype(np.float32)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_gains(cfg) -> tuple[float, float]:
    """(the rotated parts' gain, the attention scores' gain) of a model config: YaRN scales cos and sin
    by mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim), and multi-latent attention's
    softmax scale by mscale(factor, rope_mscale_all_dim)^2; (1, 1) without YaRN."""
    if cfg.rope_scaling != "yarn":
        return 1.0, 1.0
    f = cfg.rope_scaling_factor
    all_dim = yarn_mscale(f, cfg.rope_mscale_all_dim)
    return yarn_mscale(f, cfg.rope_mscale) / all_dim, all_dim * all_dim


def apply_rope(x_BxLxHxK: jax.Array, positions_BxL: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    angles = positions_BxL[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, L, K/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def dropout(x: jax.Array, rate: float, rng: jax.Array | None, names: tuple[str | None, ...] | None = None) -> jax.Array:
    """Inverted dropout; the identity when rate is 0 or no rng is given (evaluation).

    The mask is the one a single device draws for the whole activation (logical dims `names`):
    where a layout holds a part of it (a shard inside the pipeline's stage loop, context
    parallelism's token order), the mask is taken at those elements, so every layout drops the
    elements one device drops."""
    if rate == 0.0 or rng is None:
        return x
    layout = None if names is None else one_device_positions(names, x.shape)
    if layout is None:
        keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    else:
        whole, where = layout
        keep = jax.random.bernoulli(rng, 1.0 - rate, whole)
        for dim, (n, at) in enumerate(zip(x.shape, where)):
            if at is not None:
                keep = (jax.lax.dynamic_slice_in_dim(keep, at, n, axis=dim) if jnp.ndim(at) == 0
                        else jnp.take(keep, at, axis=dim))
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
