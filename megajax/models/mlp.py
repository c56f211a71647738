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
from megajax.models.layers import Dense

ACT_MLP = ("batch", "length", "mlp")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, dot_general, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        common = dict(use_bias=cfg.use_bias, dtype=dtype, dot_general=dot_general, rngs=rngs)
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            self.gate = Dense(h, f, axes=("embed", "mlp"), init_std=cfg.init_std, **common)
            self.up = Dense(h, f, axes=("embed", "mlp"), init_std=cfg.init_std, **common)
        else:
            self.fc1 = Dense(h, f, axes=("embed", "mlp"), init_std=cfg.init_std, **common)
        self.fc2 = Dense(f, h, axes=("mlp", "embed"),
                         init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), **common)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        if self.swiglu:
            hidden = jax.nn.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD)
        else:
            hidden = jax.nn.gelu(self.fc1(x_BxLxD), approximate=False)
        hidden = logical_constraint(hidden, ACT_MLP)
        return self.fc2(hidden)
