"""Feed-forward blocks: GELU MLP (GPT), SwiGLU (Llama) and squared ReLU (Nemotron-H).

Tensor parallelism follows from the weight layouts: fc1/gate/up are
[embed, mlp] (column-parallel), fc2 is [mlp, embed] (row-parallel).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.layers import Dense, LinearOps
from megajax.models.lora import adapter

ACT_MLP = ("batch", "length", "mlp")
RESIDUAL = ("batch", "residual_length", "embed")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, ops: LinearOps, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        common = dict(use_bias=cfg.use_bias, dtype=dtype, rngs=rngs)
        col = dict(common, dot_general=ops.column, init_std=cfg.init_std)
        self.swiglu, self.activation = cfg.activation == "swiglu", cfg.activation
        lora = dict(dtype=dtype, ops=ops, rngs=rngs)
        if self.swiglu:
            self.gate = Dense(h, f, axes=("embed", "mlp"), **col)
            self.up = Dense(h, f, axes=("embed", "mlp"), **col)
            self.gate_up_product = ops.linear("column", "fc1")  # fc1: gate and up as one product (`gate_up`)
            # model.lora's `fc1`: one A [D, r] for gate and up, B [r, F, 2] laid out as the fused kernel.
            self.gate_up_lora = adapter(cfg.lora, "fc1", h, (f, 2), axes=("embed", "mlp", "gate_up"),
                                        kind="column", **lora)
        else:
            self.fc1 = Dense(h, f, axes=("embed", "mlp"), **dict(col, dot_general=ops.linear("column", "fc1")),
                             lora=adapter(cfg.lora, "fc1", h, f, axes=("embed", "mlp"), kind="column", **lora))
        self.fc2 = Dense(f, h, axes=("mlp", "embed"), dot_general=ops.linear("row", "fc2"),
                         init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
                         lora=adapter(cfg.lora, "fc2", f, h, axes=("mlp", "embed"), kind="row", **lora), **common)

    def gate_up(self, x_BxLxD: jax.Array, dropout_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Both SwiGLU input projections as one product with W[D, F, 2] (F split by tensor
        parallelism; one input all-gather under sequence parallelism)."""
        w = jnp.stack([self.gate.kernel[...], self.up.kernel[...]], axis=-1).astype(self.gate.dtype)
        out = self.gate_up_product(x_BxLxD.astype(self.gate.dtype), w, (((2,), (0,)), ((), ())))
        if self.gate.bias is not None:
            out = out + jnp.stack([self.gate.bias[...], self.up.bias[...]], axis=-1).astype(out.dtype)
        if self.gate_up_lora is not None:
            out = out + self.gate_up_lora(x_BxLxD, dropout_rng, RESIDUAL).astype(out.dtype)
        return out[..., 0], out[..., 1]

    def __call__(self, x_BxLxD: jax.Array, fused: bool = True, dropout_rng: jax.Array | None = None) -> jax.Array:
        """`fused=False`: gate and up as two products, reading the weights where they are (generation:
        the stacked W[D, F, 2] would be a copy of both weights on every call). `dropout_rng`: the
        adapters' input dropout key (model.lora.dropout), None in evaluation."""
        rngs = [None, None] if dropout_rng is None else jax.random.split(dropout_rng)
        if self.swiglu:
            if fused:
                gate, up = self.gate_up(x_BxLxD, rngs[0])
            else:
                gate, up = self.gate(x_BxLxD), self.up(x_BxLxD)
                if self.gate_up_lora is not None:
                    delta = self.gate_up_lora(x_BxLxD).astype(gate.dtype)
                    gate, up = gate + delta[..., 0], up + delta[..., 1]
            hidden = jax.nn.silu(gate) * up
        elif self.activation == "squared_relu":
            hidden = jnp.square(jax.nn.relu(self.fc1(x_BxLxD, rngs[0], RESIDUAL)))
        else:
            hidden = jax.nn.gelu(self.fc1(x_BxLxD, rngs[0], RESIDUAL), approximate=self.activation == "gelu_tanh")
        hidden = logical_constraint(hidden, ACT_MLP)
        return self.fc2(hidden, rngs[1], ACT_MLP)
