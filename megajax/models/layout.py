"""The parameter layout of a model: each parameter's name and shape, read off the model itself.

Names are the '/'-joined paths of the pure parameter dict; tensors under
`layers/` are stacked (dim 0 is the layer); kernels are [in..., out...]:

    embed/embedding           [Vp, D]          Vp = padded vocabulary; rows >= vocab_size are zero
    pos_embed                 [P, D]           learned positions only
    layers/attn_norm/scale    [L, D]           (+ bias for LayerNorm); mlp_norm the same
    layers/attn/q/kernel      [L, D, H, hd]    k, v: [L, D, KV, hd]    o: [L, H, hd, D]
    layers/attn/q/bias        [L, H, hd]       k, v: [L, KV, hd]       o: [L, D]
    layers/attn/q_norm/scale  [L, hd]          k_norm the same (model.qk_norm)
    layers/mlp/gate|up/kernel [L, D, F]        (swiglu)    fc1/kernel [L, D, F] (gelu)
    layers/mlp/fc2/kernel     [L, F, D]        biases: gate|up|fc1 [L, F], fc2 [L, D]
    layers/mlp/router         [L, D, E]        MoE: experts gate|up|fc1 [L, E, D, F], fc2 [L, E, F, D]
    layers/mlp/shared_experts/gate|up|fc1|fc2/kernel   MoE shared expert: the MLP's, F = its size S
    layers/mlp/shared_expert_gate [L, D]       its gate (model.moe_shared_expert_gate)
    dense_layers/...          [L - L/R, ...]   model.moe_layer_freq R > 1: the dense layers (the paths
                                               of a dense model's `layers/`); `layers/` then holds the
                                               L/R MoE layers (see layer_slots); with the list
                                               form (dense layers first) the first dense ones
    layers/attn/q_down|q_up|kv_down|kv_up|o/kernel, q_norm|kv_norm/scale   multi-latent attention
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

import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from megajax.config import LoraConfig, ModelConfig, VisionConfig


@functools.lru_cache(maxsize=64)
def _shapes(fields: tuple, padded_vocab_size: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from megajax.models.vision import build_model
    m = _model_of(fields)
    abstract = nnx.eval_shape(lambda: build_model(m, padded_vocab_size=padded_vocab_size, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    return tuple(sorted((name, tuple(x.shape)) for name, x in traverse_util.flatten_dict(params, sep="/").items()))


def param_shapes(m: ModelConfig, padded_vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the model with resolved config `m`.

    `padded_vocab_size` defaults to m.padded_vocab_size(); a checkpoint saved
    with another padding passes its own.
    """
    padded = padded_vocab_size or m.padded_vocab_size()
    return dict(_shapes(_hashable(m), padded))


def _hashable(m) -> tuple:
    """The fields of `m` as a hashable tuple (lists as tuples, model.vision and model.lora as their
    fields' tuples)."""
    return tuple(tuple(v) if isinstance(v, list) else _hashable(v) if dataclasses.is_dataclass(v) else v
                 for v in (getattr(m, f.name) for f in dataclasses.fields(m)))


def _model_of(fields: tuple) -> ModelConfig:
    values = dict(zip((f.name for f in dataclasses.fields(ModelConfig)), fields))
    if values["vision"] is not None:
        values["vision"] = VisionConfig(*values["vision"])
    if values["lora"] is not None:
        rank, alpha, dropout, targets = values["lora"]
        values["lora"] = LoraConfig(rank, alpha, dropout, list(targets))
    return ModelConfig(**{k: list(v) if isinstance(v, tuple) and k not in ("vision", "lora") else v
                          for k, v in values.items()})


# The MoE routers' expert bias (aux-loss-free balancing) is training state, not a parameter
# (TrainState.moe_expert_bias), but checkpoints in other formats hold it beside the router's
# weight: exporters and importers name it like a parameter of the layer stack.
EXPERT_BIAS = "layers/mlp/expert_bias"  # [MoE layers, E] fp32
# A mixture-of-experts multi-token prediction block's (model.mtp_moe()): the state's rows after the layers'.
MTP_EXPERT_BIAS = "mtp/block/mlp/expert_bias"  # [MTP depths, E] fp32
STACK_NAMES = ("layers", "dense_layers")  # the trees of stacked parameters: dim 0 is the layer
STACKS = tuple(name + "/" for name in STACK_NAMES)  # their parameters' path prefixes


def layer_slots(m: ModelConfig) -> list[tuple[str, int]]:
    """For each model layer (from 0), the stack holding it and its index there: ("layers/", n) for
    every layer, or, with model.moe_layer_freq R > 1 (layer n is MoE when n % R == 0), the MoE
    layers in `layers/` and the dense ones in `dense_layers/`, each stack in model order."""
    k = m.dense_first_layers()
    if k:  # moe_layer_freq's list form, the dense layers first
        return [("dense_layers/", n) if n < k else ("layers/", n - k) for n in range(m.num_layers)]
    if not m.interleaves_dense_layers():
        return [("layers/", n) for n in range(m.num_layers)]
    r = m.moe_layer_freq
    return [("layers/", n // r) if n % r == 0 else ("dense_layers/", n - n // r - 1) for n in range(m.num_layers)]


def stacked(path: str) -> bool:
    """Whether the parameter `path` is stacked over layers."""
    return path.startswith(STACKS)


def has_expert_bias(m: ModelConfig) -> bool:
    """Whether the model's routers carry an expert bias (model.moe_router_bias_update_rate > 0)."""
    return bool(m.num_experts) and m.moe_router_bias_update_rate > 0


def tensor_shapes(m: ModelConfig, padded_vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    """param_shapes and, for a model with one, the expert bias: every tensor an export writes and an
    import reads (`EXPERT_BIAS`, and `MTP_EXPERT_BIAS` for a mixture-of-experts MTP block)."""
    shapes = param_shapes(m, padded_vocab_size)
    shapes.update({name: (rows.stop - rows.start, m.num_experts) for name, rows in expert_bias_rows(m).items()})
    return shapes


def expert_bias_rows(m: ModelConfig) -> dict[str, range]:
    """Where each named expert bias sits in the train state's one array (TrainState.moe_expert_bias,
    [m.num_router_layers(), E]): the MoE layers' rows, then the MoE multi-token prediction depths'.
    Empty for a model without an expert bias."""
    if not has_expert_bias(m):
        return {}
    layers = m.num_moe_layers()
    out = {EXPERT_BIAS: range(0, layers)}
    if m.mtp_moe():
        out[MTP_EXPERT_BIAS] = range(layers, m.num_router_layers())
    return out


def split_expert_bias(tree: dict) -> tuple[dict, object | None]:
    """(the parameter tree without the expert biases, the train state's bias [router layers, E] or
    None) of an imported tree: its `EXPERT_BIAS`, then its `MTP_EXPERT_BIAS` rows."""
    flat = traverse_util.flatten_dict(tree, sep="/")
    biases = [flat.pop(name) for name in (EXPERT_BIAS, MTP_EXPERT_BIAS) if name in flat]
    if not biases:
        return tree, None
    join = np.concatenate if all(isinstance(b, np.ndarray) for b in biases) else jnp.concatenate
    bias = biases[0] if len(biases) == 1 else join(biases)
    return traverse_util.unflatten_dict(flat, sep="/"), bias
