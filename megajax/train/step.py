"""The train step: loss, gradients over microbatches, clipping, update, loss scaling.

Batch layout: every array is [accumulation, micro_batch x data-parallel, seq]
(`tokens`, `labels`, `loss_mask`, optionally `positions`, `segment_ids`).
The loss is the mean over all unmasked tokens of the global batch, so
accumulating A microbatches of b gives the same update as one batch of A*b.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import Config
from megajax.mesh import ShardingRules, activation_sharding, logical_to_spec
from megajax.precision.loss_scale import DynamicLossScale
from megajax.train.optimizer import update_count
from megajax.train.state import ModelSpec, TrainState

BATCH_AXES = (None, "batch", "length")  # [accumulation, batch, seq]
BATCH_KEYS_OPTIONAL = ("positions", "segment_ids")


def cross_entropy(logits_BxLxV: jax.Array, labels_BxL: jax.Array) -> jax.Array:
    """Per-token cross entropy in fp32, written so a vocab-sharded `logits` is never gathered:
    only [B, L] reductions (max, sum of exp, the label's logit) cross the vocab shards."""
    logits = logits_BxLxV.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[..., 0]
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    label_logit = jnp.sum(jnp.where(vocab_ids == labels_BxL[..., None], logits, 0.0), axis=-1)
    return lse - label_logit


def batch_shardings(mesh: Mesh, rules: ShardingRules, keys) -> dict:
    sharding = NamedSharding(mesh, logical_to_spec(BATCH_AXES, rules.activations))
    return {k: sharding for k in keys}


def make_train_step(cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation,
                    scaler: DynamicLossScale | None, schedule: Callable,
                    mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Callable:
    """Returns step(state, batch) -> (state, metrics), not yet jitted."""
    clip = cfg.optim.clip_grad
    use_dropout = cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0
    act_rules = rules.activations if rules is not None else None

    def micro_loss(params, micro, rng, norm, scale):
        logits = spec.apply(params, micro["tokens"], micro.get("positions"), micro.get("segment_ids"),
                            dropout_rng=rng)
        loss_sum = jnp.sum(cross_entropy(logits, micro["labels"]) * micro["loss_mask"])
        return loss_sum / norm * scale, loss_sum

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with activation_sharding(mesh, act_rules):
            return _step(state, batch)

    def _step(state: TrainState, batch: dict):
        accum = batch["tokens"].shape[0]
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1.0)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if use_dropout else None

        def run_micro(i):
            micro = jax.tree.map(lambda x: x[i], batch)
            rng = None if step_rng is None else jax.random.fold_in(step_rng, i)
            (_, loss_sum), grads = grad_fn(state.params, micro, rng, num_tokens, scale)
            return grads, loss_sum

        if accum == 1:
            grads, loss_sum = run_micro(0)
        else:
            def body(carry, i):
                g_acc, l_acc = carry
                g, l = run_micro(i)
                return (jax.tree.map(jnp.add, g_acc, g), l_acc + l), None
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (grads, loss_sum), _ = jax.lax.scan(body, (zeros, jnp.float32(0.0)), jnp.arange(accum))

        grads = jax.tree.map(lambda g: g / scale, grads)
        loss = loss_sum / num_tokens
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        if clip > 0:
            coeff = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * coeff, grads)
        lr = schedule(update_count(state.opt_state))
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)

        def keep_if_skipped(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_state = TrainState(
            step=state.step + 1,
            params=keep_if_skipped(new_params, state.params),
            opt_state=keep_if_skipped(new_opt, state.opt_state),
            loss_scale=scaler.update(state.loss_scale, ~finite) if scaler else None,
            rng=state.rng,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": ~finite,
                   "loss_scale": scale, "num_tokens": num_tokens}
        return new_state, metrics

    return step


def make_eval_step(spec: ModelSpec, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Callable:
    """Returns eval(params, batch) -> (sum of token losses, number of tokens), not yet jitted."""
    act_rules = rules.activations if rules is not None else None

    def evaluate(params: dict, batch: dict):
        with activation_sharding(mesh, act_rules):
            def micro(carry, i):
                m = jax.tree.map(lambda x: x[i], batch)
                logits = spec.apply(params, m["tokens"], m.get("positions"), m.get("segment_ids"))
                loss = jnp.sum(cross_entropy(logits, m["labels"]) * m["loss_mask"])
                return (carry[0] + loss, carry[1] + jnp.sum(m["loss_mask"])), None
            (loss, count), _ = jax.lax.scan(micro, (jnp.float32(0), jnp.float32(0)),
                                            jnp.arange(batch["tokens"].shape[0]))
            return loss, count

    return evaluate


def jit_train_step(step: Callable, state_sh: TrainState, batch_sh: dict, mesh: Mesh) -> Callable:
    replicated = NamedSharding(mesh, P())
    metric_sh = {k: replicated for k in ("loss", "grad_norm", "lr", "skipped", "loss_scale", "num_tokens")}
    return jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, metric_sh),
                   donate_argnums=(0,))
