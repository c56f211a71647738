"""The objective of a step and what its gradient functions share.

`step_inputs` (the step's token count, loss scale and dropout key), `microbatch_loss` (one
microbatch's objective and metric sums), `moe_sums` (the router statistics every gradient
function reports) and `Gradients` (what a gradient function returns to the finish).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from megajax.config import Config
from megajax.models.moe import router_losses
from megajax.models.vision import frozen_parameters
from megajax.models.transformer import shift_left
from megajax.precision.fp8 import with_scales
from megajax.train.state import ModelSpec, TrainState


def cross_entropy(logits_BxLxV: jax.Array, labels_BxL: jax.Array) -> jax.Array:
    """Per-token cross entropy in fp32, written so a vocab-sharded `logits` is never gathered:
    only [B, L] reductions (max, sum of exp, the label's logit) cross the vocab shards."""
    logits = logits_BxLxV.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[..., 0]
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    label_logit = jnp.sum(jnp.where(vocab_ids == labels_BxL[..., None], logits, 0.0), axis=-1)
    return lse - label_logit


@struct.dataclass
class StepInputs:
    """What every piece of one step reads: the global batch's unmasked tokens (>= 1; the loss is
    their mean), the loss scale (1 without fp16), the step's dropout key (None without dropout)
    and the number of microbatches."""
    num_tokens: jax.Array  # f32 []
    scale: jax.Array  # f32 []
    rng: jax.Array | None  # the step's key; microbatch i uses fold_in(rng, i)
    accum: int = struct.field(pytree_node=False)


def step_inputs(state: TrainState, batch: dict, use_dropout: bool) -> StepInputs:
    return StepInputs(
        num_tokens=jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0),
        scale=state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1.0),
        rng=jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if use_dropout else None,
        accum=batch["tokens"].shape[0])


@struct.dataclass
class Gradients:
    """A gradient function's result: gradients of the scaled loss (laid out as the optimizer's
    state), the FP8 products' amaxes (max-combined; {} without FP8) and the metric sums
    (`loss_sum`, and with MoE the `moe_sums`)."""
    grads: dict
    amaxes: dict
    sums: dict


def moe_sums(aux: jax.Array, z: jax.Array, dropped: jax.Array, tokens: jax.Array, per: int) -> dict:
    """The router statistics a step sums: the balancing and z losses (summed over layers, divided by
    `per` = microbatches x MoE layers: their logged means), the dropped assignments, and the tokens
    per expert [layers, E] (what the expert bias moves by)."""
    return {"moe_aux_loss": aux / per, "moe_z_loss": z / per, "moe_tokens": tokens, "moe_dropped": dropped}


def mtp_loss_sum(mtp_logits_DxBxLxV: jax.Array, labels_BxL: jax.Array, loss_mask_BxL: jax.Array,
                 shift: Callable = shift_left, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    """Multi-token prediction's cross entropy summed over tokens, averaged over the depths: depth k
    (from 1) is scored on the labels k places further on, where the loss mask (shifted alike) keeps
    them and they are inside the sequence (Megatron-Core's rolled labels and mask) and, in a packed
    batch, inside the same document. `shift`: the layout's shift along the sequence
    (ModelSpec.sequence_shift)."""
    depths = mtp_logits_DxBxLxV.shape[0]
    total = 0.0
    for k in range(1, depths + 1):
        labels, mask = mtp_targets(labels_BxL, loss_mask_BxL, k, shift, segment_ids_BxL)
        total = total + jnp.sum(cross_entropy(mtp_logits_DxBxLxV[k - 1], labels) * mask)
    return total / depths


def mtp_targets(labels_BxL: jax.Array, loss_mask_BxL: jax.Array, k: int, shift: Callable = shift_left,
                segment_ids_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(labels, loss mask) of multi-token prediction depth k: k places further on along the sequence
    (`shift`: the layout's), the last k positions masked (past the end: label and mask 0), and with
    `segment_ids_BxL` the last k positions of every document (their label is another document's)."""
    labels, mask = shift(labels_BxL, k), shift(loss_mask_BxL, k)
    if segment_ids_BxL is not None:
        mask = jnp.where(shift(segment_ids_BxL, k) == segment_ids_BxL, mask, 0)
    return labels, mask


def path_name(path) -> str:
    """A key path of a parameter tree as its '/'-joined name ("vision/layers/q/kernel")."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def mask_image_labels(cfg: Config, batch: dict) -> dict:
    """A vision-language model's batch with no loss where the label is an image placeholder: nothing
    predicts an image's positions (the last one predicts the text after it). Other batches unchanged."""
    v = cfg.model.vision
    if v is None:
        return batch
    keep = (batch["labels"] != v.image_token_id).astype(batch["loss_mask"].dtype)
    return dict(batch, loss_mask=batch["loss_mask"] * keep)


def microbatch_loss(cfg: Config) -> Callable:
    """loss(model, params, fp8 scales, micro, rng, inputs, fp8, expert bias, frozen=None) -> (scaled
    loss to differentiate, metric sums) of one microbatch (of one data-parallel shard inside the vmap);
    `frozen`: the frozen base parameters beside adapters (TrainState.frozen).
    `model` is a ModelSpec, `fp8` the scaling state whose scales are replaced by the argument (so
    their "gradients" are the amaxes), `expert_bias` the routers' (or None)."""
    moe = cfg.model.num_experts > 0
    depths = cfg.model.mtp_num_layers

    frozen_path = frozen_parameters(cfg.model)

    def loss_fn(model: ModelSpec, params, fp8_scales, micro, rng, inputs: StepInputs, fp8, expert_bias, frozen=None):
        fp8 = None if fp8 is None else with_scales(fp8, fp8_scales)
        bias = {} if expert_bias is None else {"expert_bias": expert_bias}
        if frozen_path is not None:  # no gradient flows into frozen parameters (their gradient is zero)
            params = jax.tree_util.tree_map_with_path(
                lambda path, x: jax.lax.stop_gradient(x) if frozen_path(path_name(path)) else x, params)
        out = model.apply(params, micro["tokens"], micro.get("positions"), micro.get("segment_ids"),
                          dropout_rng=rng, fp8=fp8, frozen=frozen, router_stats=moe, **bias,
                          **({"mtp": True} if depths else {}), **({"images": micro["images"]} if "images" in micro else {}))
        if depths:
            logits, stats, mtp_logits = out
        else:
            logits, stats = out if moe else (out, None)
        loss_sum = jnp.sum(cross_entropy(logits, micro["labels"]) * micro["loss_mask"])
        sums = {"loss_sum": loss_sum}
        loss = loss_sum / inputs.num_tokens
        if depths:
            mtp_sum = mtp_loss_sum(mtp_logits, micro["labels"], micro["loss_mask"], model.sequence_shift,
                                   micro.get("segment_ids"))
            sums["mtp_loss_sum"] = mtp_sum
            loss = loss + cfg.model.mtp_loss_scaling_factor * mtp_sum / inputs.num_tokens
        if moe:
            # The model runs on the whole microbatch (vmapped_axes): its statistics are global.
            aux, z = router_losses(stats, stats.balance_tokens, stats.count, cfg.model)
            loss = loss + (jnp.sum(aux) + jnp.sum(z)) / inputs.accum
            sums.update(moe_sums(jnp.sum(aux), jnp.sum(z), jnp.sum(stats.dropped), stats.tokens,
                                 inputs.accum * aux.shape[0]))
        return loss * inputs.scale, sums

    return loss_fn
