"""Feed-forward blocks: GELU MLP (GPT) and SwiGLU (Llama).

Tensor parallelism follows from the weight layouts: fc1/gate/up are
[embed, mlp] (column-parallel), fc2 is [mlp, embed] (row-parallel).
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.layers import Dense, LinearOps

ACT_MLP = ("batch", "length", "mlp")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, ops: LinearOps, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        common = dict(use_bias=cfg.use_bias, dtype=dtype, rngs=rngs)
        col = dict(common, dot_general=ops.column, init_std=cfg.init_std)
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            self.gate = Dense(h, f, axes=("embed", "mlp"), **col)
            self.up = Dense(h, f, axes=("embed", "mlp"), **col)
        else:
            self.fc1 = Dense(h, f, axes=("embed", "mlp"), **col)
        self.fc2 = Dense(f, h, axes=("mlp", "embed"), dot_general=ops.row,
                         init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), **common)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        if self.swiglu:
            hidden = jax.nn.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD)
        else:
            hidden = jax.nn.gelu(self.fc1(x_BxLxD), approximate=False)
        hidden = logical_constraint(hidden, ACT_MLP)
        return self.fc2(hidden)
