"""The parameter layout of a model: each parameter's name and shape, read off the model itself.

Names are the '/'-joined paths of the pure parameter dict; tensors under
`layers/` are stacked (dim 0 is the layer); kernels are [in..., out...]:

    embed/embedding           [Vp, D]          Vp = padded vocabulary; rows >= vocab_size are zero
    pos_embed                 [P, D]           learned positions only
    layers/attn_norm/scale    [L, D]           (+ bias for LayerNorm); mlp_norm the same
    layers/attn/q/kernel      [L, D, H, hd]    k, v: [L, D, KV, hd]    o: [L, H, hd, D]
    layers/attn/q/bias        [L, H, hd]       k, v: [L, KV, hd]       o: [L, D]
    layers/mlp/gate|up/kernel [L, D, F]        (swiglu)    fc1/kernel [L, D, F] (gelu)
    layers/mlp/fc2/kernel     [L, F, D]        biases: gate|up|fc1 [L, F], fc2 [L, D]
    layers/mlp/router         [L, D, E]        MoE: experts gate|up|fc1 [L, E, D, F], fc2 [L, E, F, D]
    layers/mlp/shared_experts/gate|up|fc1|fc2/kernel   MoE shared expert: the MLP's, F = its size S
    final_norm/scale          [D]              (+ bias)
    output                    [D, Vp]          untied embeddings only

Shapes come from abstract evaluation (`nnx.eval_shape`) of `Transformer`:
nothing is allocated and nothing is spelled out by hand, so a parameter the
model gains appears here, in the checkpoint checks, in the export tables'
completeness check and in the FLOP count at once.
"""

from __future__ import annotations

import dataclasses
import functools

from flax import nnx, traverse_util

from megajax.config import ModelConfig


@functools.lru_cache(maxsize=64)
def _shapes(fields: tuple, padded_vocab_size: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from megajax.models.transformer import Transformer
    m = ModelConfig(*fields)
    abstract = nnx.eval_shape(lambda: Transformer(m, padded_vocab_size=padded_vocab_size, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    return tuple(sorted((name, tuple(x.shape)) for name, x in traverse_util.flatten_dict(params, sep="/").items()))


def param_shapes(m: ModelConfig, padded_vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the model with resolved config `m`.

    `padded_vocab_size` defaults to m.padded_vocab_size(); a checkpoint saved
    with another padding passes its own.
    """
    padded = padded_vocab_size or m.padded_vocab_size()
    return dict(_shapes(dataclasses.astuple(m), padded))
