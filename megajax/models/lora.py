"""Low-rank adapters (LoRA): y = x W + (alpha / rank) dropout(x) A B beside a frozen linear.

A [in..., rank] (PEFT's default init: uniform in +-1/sqrt(in)) and B [rank, out...] (zeros, so
training starts from the base model) carry the logical axes of the base kernel's input and output
dims, with a replicated `lora_rank` dim between them: whatever splits the base kernel splits the
adapters alike. The two products go through the layout's plain linear ops (never FP8's: the
adapters run in the compute dtype):

- beside a column-parallel linear (q/k/v, fc1, MLA's up-projections), out split over tensor:
    x[B, S(_tp), D] . A[D, r] -> h[B, S(_tp), r] ; h . B[r, F_tp] (the column product: under
    sequence parallelism it all-gathers h, [B, S, r], the one new collective) -> [B, S, F_tp]
- beside a row-parallel one (proj, fc2), in split over tensor:
    x[B, S, F_tp] . A[F_tp, r] (the row product: an all-reduce, or reduce-scatter, of [B, S, r])
    -> h[B, S(_tp), r] ; h . B[r, D] -> [B, S(_tp), D]
- beside a kernel replicated over tensor (MLA's down-projections): two plain products.

Adapter parameters live in modules named `lora` (one linear's), `qkv_lora` (the fused q/k/v
projection's: one A for q, k and v, one B laid out as the fused kernel), `gate_up_lora` and
`in_proj_lora` (a Mamba-2 mixer's in_proj: one A, one B [r, groups, z | x | B | C | dt] laid out as
its fused kernel, split over tensor by groups like it; megajax/models/mamba.py),
`experts_fc1_lora` and `experts_fc2_lora` (a mixture of experts' routed experts, `ExpertLoRA`); their
leaves are `a` and `b`. With adapters everything else but a vision-language model's projector (and its
encoder unless model.vision.freeze) is frozen (megajax/models/trainable.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import LoraConfig
from megajax.models.layers import LinearOps, dropout

ADAPTER_MODULES = ("lora", "qkv_lora", "gate_up_lora", "in_proj_lora", "experts_fc1_lora", "experts_fc2_lora")


class LoRA(nnx.Module):
    """delta[..., out] = (alpha / rank) dropout(x[..., in]) . A[in, r] . B[r, out]."""

    def __init__(self, in_features: Sequence[int], out_features: Sequence[int], *, in_axes: tuple,
                 out_axes: tuple, kind: str, cfg: LoraConfig, dtype, ops: LinearOps, rngs: nnx.Rngs):
        assert kind in ("column", "row", "duplicated"), kind
        in_features, out_features = tuple(in_features), tuple(out_features)
        bound = 1.0 / math.sqrt(math.prod(in_features))  # kaiming_uniform(a=sqrt(5)), PEFT's default
        self.a = nnx.Param(jax.random.uniform(rngs.params(), (*in_features, cfg.rank), jnp.float32, -bound, bound),
                           axes=(*in_axes, "lora_rank"))
        self.b = nnx.Param(jnp.zeros((cfg.rank, *out_features), jnp.float32), axes=("lora_rank", *out_axes))
        self.scale = cfg.alpha / cfg.rank
        self.rate = cfg.dropout
        self.dtype = dtype
        plain = jax.lax.dot_general
        self.first = ops.row if kind == "row" else plain  # A's product
        self.second = ops.column if kind == "column" else plain  # B's product

    def __call__(self, x: jax.Array, dropout_rng: jax.Array | None = None, names: tuple | None = None) -> jax.Array:
        a, b = self.a[...].astype(self.dtype), self.b[...].astype(self.dtype)
        n_in = a.ndim - 1
        x = dropout(x.astype(self.dtype), self.rate, dropout_rng, names)
        h = self.first(x, a, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
        y = self.second(h, b, (((h.ndim - 1,), (0,)), ((), ())))
        return y * jnp.asarray(self.scale, y.dtype)


class ExpertLoRA(nnx.Module):
    """The adapters of one routed-expert kernel W[E, in, out...] (model.lora's `experts`): A [E, in, r],
    B [E, r, out...], one pair per expert stacked like the kernel (split over the expert axis with it,
    the in / out dims as the kernel's). They are merged into the kernel inside the step,
    W_e + (alpha / rank) A_e B_e (`merged`), so every dispatch (grouped, tiled, capacity buffers,
    expert-parallel all-to-all) runs the adapted experts unchanged; exact, without input dropout. The
    cost: the product A B (E x in x out x r multiply-adds) and the gradient of the merged kernel,
    a kernel-sized temporary (no optimizer state), per MoE layer and step."""

    def __init__(self, experts: int, in_features: int, out_features: Sequence[int], *, in_axis: str,
                 out_axes: tuple, cfg: LoraConfig, rngs: nnx.Rngs):
        out_features = tuple(out_features)
        bound = 1.0 / math.sqrt(in_features)
        self.a = nnx.Param(jax.random.uniform(rngs.params(), (experts, in_features, cfg.rank), jnp.float32, -bound,
                                              bound), axes=("experts", in_axis, "lora_rank"))
        self.b = nnx.Param(jnp.zeros((experts, cfg.rank, *out_features), jnp.float32),
                           axes=("experts", "lora_rank", *out_axes))
        self.scale = cfg.alpha / cfg.rank

    def merged(self, kernel: jax.Array) -> jax.Array:
        """kernel [E, in, out...] + (alpha / rank) A B, in fp32."""
        b = self.b[...]
        delta = jax.lax.dot_general(self.a[...], b, (((2,), (1,)), ((0,), (0,))))  # [E, in, out...]
        return kernel.astype(jnp.float32) + self.scale * delta


def adapter(cfg: LoraConfig | None, target: str, in_features, out_features, *, axes: tuple, kind: str,
            dtype, ops: LinearOps, rngs: nnx.Rngs) -> LoRA | None:
    """The adapter of linear `target` (W[in..., out...] with logical `axes`), or None when model.lora
    does not name it."""
    if cfg is None or target not in cfg.target_names():
        return None
    in_features = (in_features,) if isinstance(in_features, int) else tuple(in_features)
    out_features = (out_features,) if isinstance(out_features, int) else tuple(out_features)
    n = len(in_features)
    return LoRA(in_features, out_features, in_axes=axes[:n], out_axes=axes[n:], kind=kind, cfg=cfg, dtype=dtype,
                ops=ops, rngs=rngs)


def is_adapter(path: tuple) -> bool:
    """Whether a parameter path (of key names) is an adapter's A or B."""
    names = [str(getattr(k, "key", k)) for k in path]
    return len(names) >= 2 and names[-2] in ADAPTER_MODULES and names[-1] in ("a", "b")
