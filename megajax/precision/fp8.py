"""FP8 linear products by recipe, with the per-tensor recipes' scaling state (Transformer Engine's
recipes, in JAX).

    product = Fp8Dot(policy.fp8)            # one per linear layer: a dot_general with state
    y = product(x, w, dimension_numbers)     # x [..., K...] . w -> y

`Fp8Dot` is what the model's layers receive instead of `jax.lax.dot_general` for the products
FP8 replaces (see megajax/models/layers.py `LinearOps`). It flattens the product to
x [M, K] @ w [K, N] and runs, by precision.fp8_recipe:

    delayed, current      pallas_kernels.fp8_linear: e4m3 x and w, e5m2 output gradient g, each
                          scaled per tensor (the fnuz types on ROCm)
    blockwise, mxfp8      pallas_kernels.block_scaled_linear: e4m3 throughout, each block scaled
                          by its own amax (1 x 128 / 128 x 128, or 32-element blocks); no state

(the experts' products likewise: `grouped`, `batched`).

Scaling state (recipe `delayed`) is not a parameter: it is held in `Fp8Meta` variables,

    scale         f32 [3]        quantization scales of (x, w, g): float8 = saturate(value * scale)
    amax_history  f32 [H, 3]     the last H steps' amaxes of (x, w, g), newest first

stacked to [layers, 3] and [layers, H, 3] in the scanned layers. The train step splits the
model state by variable type (`nnx.Param` -> optimizer, `Fp8Meta` -> here), differentiates the
loss with respect to the scales too, and reads each product's amaxes of this step from those
"gradients" (fp8_linear's custom VJP returns the amaxes of x, w and g as the scales'
cotangent). After max-reducing them over microbatches and data-parallel shards (tensor shards
are already covered: an amax is a max over the global tensor), `update_fp8_state` applies
Transformer Engine's rule (amax_compute_algo "max"):

    history <- [amax, history[:-1]]                         (the oldest entry drops out)
    scale   <- fp8_max / max(history) / 2^margin            (kept where that max is 0 or not finite)

so the scale step t quantizes with comes from the amaxes of steps t-H .. t-1, identical on every
device. Recipe `current` keeps no state: each tensor is scaled by its own amax where it is
quantized (for a gradient, inside the backward pass): per microbatch, and when gradients are
accumulated (the step's per-shard path) per data-parallel shard, so that recipe does not compute
exactly the same function on every layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from megajax.precision.policy import Fp8Policy

SCALE, HISTORY = "scale", "amax_history"
TENSORS = ("x", "w", "g")  # the order of the last dim of the scaling state


class Fp8Meta(nnx.Variable):
    """FP8 scaling state (scales, amax histories): saved and restored with the train state,
    never seen by the optimizer."""


class Fp8Dot(nnx.Module):
    """A dot_general computing its product in FP8, holding the product's scaling state.

    Takes what `jax.lax.dot_general` takes for a projection: x's trailing dims contracted with
    any dims of w (w's remaining dims become the output's trailing dims), no batch dims."""

    def __init__(self, policy: Fp8Policy, layout=None, side: str = "column", weight_gather=None):
        from pallas_kernels import HYBRID_FNUZ, default_formats, native_mxfp8  # imported where FP8 is used
        self.policy = policy
        self.formats = default_formats()
        # The block-scaled recipes' element type (e4m3fnuz on ROCm) and, for mxfp8, whether the
        # device multiplies MXFP8 itself (jax.nn.scaled_matmul) or emulates it: chosen once, here.
        self.fnuz = self.formats == HYBRID_FNUZ
        self.native = policy.recipe == "mxfp8" and native_mxfp8()
        # The layout's collectives around the local product (tensor / sequence parallelism,
        # megajax/parallel/tensor.py), or None: layout(product) -> a product.
        self.layout = layout
        # "column" (the weight's first dims are the input features: the embedding dim under FSDP)
        # or "row" (its last dims are the output features, the embedding dim).
        self.side = side
        # precision.fp8_param_gather: weight_gather(float8 array, dim) constrains the quantized weight
        # to its FSDP shards and then to the whole (megajax/mesh.py fp8_param_gather), or None.
        self.weight_gather = weight_gather
        if policy.delayed:
            self.scale = Fp8Meta(jnp.ones((len(TENSORS),), jnp.float32), axes=(None,))
            self.amax_history = Fp8Meta(jnp.zeros((policy.amax_history_len, len(TENSORS)), jnp.float32),
                                        axes=(None, None))

    def scales(self):
        """The Fp8Scales this product quantizes with."""
        from pallas_kernels import Fp8Scales
        if not self.policy.delayed:
            return Fp8Scales()  # current scaling: every tensor scaled by its own amax
        s = self.scale[...]
        return Fp8Scales(x=s[0], w=s[1], g=s[2])

    def __call__(self, x: jax.Array, w: jax.Array, dimension_numbers, precision=None,
                 preferred_element_type=None) -> jax.Array:
        assert precision is None and preferred_element_type is None
        product = self.local if self.layout is None else self.layout(self.local)
        return product(x, w, dimension_numbers)

    def grouped(self, x_MxK: jax.Array, w_ExKxN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
        """The experts' grouped product (rows sorted by expert, as jax.lax.ragged_dot) in FP8."""
        from pallas_kernels import block_scaled_expert_product, fp8_expert_product
        if self.policy.block_scaled:
            return block_scaled_expert_product(x_MxK, w_ExKxN, group_sizes_E, recipe=self.policy.recipe,
                                               fnuz=self.fnuz)
        return fp8_expert_product(x_MxK, w_ExKxN, self.scales(), group_sizes_E, formats=self.formats)

    def batched(self, x_ExCxK: jax.Array, w_ExKxN: jax.Array) -> jax.Array:
        """The experts' batched product (capacity buffers) in FP8."""
        from pallas_kernels import block_scaled_expert_product, fp8_expert_product
        if self.policy.block_scaled:
            return block_scaled_expert_product(x_ExCxK, w_ExKxN, recipe=self.policy.recipe, fnuz=self.fnuz)
        return fp8_expert_product(x_ExCxK, w_ExKxN, self.scales(), formats=self.formats)

    def local(self, x: jax.Array, w: jax.Array, dimension_numbers) -> jax.Array:
        """The product of the operands as this device holds them."""
        from pallas_kernels import block_scaled_linear, fp8_linear
        (lc, rc), (lb, rb) = dimension_numbers
        n_in = len(lc)
        assert not lb and not rb and tuple(lc) == tuple(range(x.ndim - n_in, x.ndim)), dimension_numbers
        free = tuple(d for d in range(w.ndim) if d not in rc)
        k = math.prod(x.shape[x.ndim - n_in:])
        out_shape = tuple(w.shape[d] for d in free)
        w_KxN = jnp.transpose(w, tuple(rc) + free).reshape(k, -1)
        x_xK = x.reshape(*x.shape[:x.ndim - n_in], k)  # [..., K]
        gather = dict(weight_gather=self.weight_gather, gather_dim=0 if self.side == "column" else 1)
        if self.policy.block_scaled:
            y = block_scaled_linear(x_xK, w_KxN, recipe=self.policy.recipe, impl=self.policy.impl, fnuz=self.fnuz,
                                    native=self.native, **gather)
        else:
            y = fp8_linear(x_xK, w_KxN, self.scales(), impl=self.policy.impl, formats=self.formats, **gather)
        return y.reshape(*y.shape[:-1], *out_shape)


# ----------------------------------------------------------------------------
# The scaling state as a pure dict (what TrainState holds)
# ----------------------------------------------------------------------------

def _split(fp8: dict, leaf: str) -> dict:
    flat = traverse_util.flatten_dict(fp8)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k[-1] == leaf})


def scales_of(fp8: dict) -> dict:
    """The `scale` leaves of a scaling-state dict (what the loss is differentiated against)."""
    return _split(fp8, SCALE)


def with_scales(fp8: dict, scales: dict) -> dict:
    """`fp8` with its `scale` leaves replaced by those of `scales` (same paths)."""
    flat = traverse_util.flatten_dict(fp8)
    flat.update(traverse_util.flatten_dict(scales))
    return traverse_util.unflatten_dict(flat)


def fp8_max_per_tensor(formats=None) -> np.ndarray:
    """[3] largest finite values of the float8 types of (x, w, g): 448, 448, 57344 (hybrid)."""
    from pallas_kernels import default_formats, fp8_max
    formats = formats or default_formats()
    return np.asarray([fp8_max(formats.fwd), fp8_max(formats.fwd), fp8_max(formats.bwd)], np.float32)


def update_fp8_state(fp8: dict, amaxes: dict, margin: int, formats=None) -> dict:
    """The next scaling state from this step's amaxes (`amaxes` shaped like scales_of(fp8):
    [..., 3] per product; max-reduced over microbatches and data-parallel shards already)."""
    from pallas_kernels import compute_scale
    limits = jnp.asarray(fp8_max_per_tensor(formats))
    flat, flat_amax = traverse_util.flatten_dict(fp8), traverse_util.flatten_dict(amaxes)
    out = {}
    for path, amax in flat_amax.items():
        owner = path[:-1]
        history, scale = flat[owner + (HISTORY,)], flat[owner + (SCALE,)]
        # history [..., H, 3]: this step's amax first, the oldest dropped.
        history = jnp.concatenate([amax.astype(jnp.float32)[..., None, :], history[..., :-1, :]], axis=-2)
        out[owner + (HISTORY,)] = history
        out[owner + (SCALE,)] = compute_scale(jnp.max(history, axis=-2), limits, margin, fallback=scale)
    assert set(out) == set(flat), "every product's state is updated"
    return traverse_util.unflatten_dict(out)


def initial_fp8_state(abstract_fp8: dict) -> dict:
    """A fresh scaling state: scales 1, empty (zero) histories (Transformer Engine's start)."""
    def fresh(path, x):
        return (jnp.ones if path[-1].key == SCALE else jnp.zeros)(x.shape, x.dtype)
    return jax.tree_util.tree_map_with_path(fresh, abstract_fp8)
