"""The train step from small pieces, chosen once per layout:

    step = finish . gradients,   gradients = data_parallel_gradients | pipeline_gradients

The pieces: the step's inputs and the microbatch loss (megajax/train/loss.py), a gradient
function over the step's microbatches (`data_parallel_gradients` here; `pipeline_gradients` in
megajax/train/pipeline_step.py, through the stages), and `make_finish` (unscale, clip, update or
skip, metrics).

Batch layout: every array is [accumulation, micro_batch x data-parallel, seq]
(`tokens`, `labels`, `loss_mask`, optionally `positions`, `segment_ids`).
The loss is the mean over all unmasked tokens of the global batch, so
accumulating A microbatches of b gives the same update as one batch of A*b.

Mixture of experts: the router's load-balancing loss and z-loss are added to the
cross entropy (the logged `loss` stays the cross entropy; `moe_aux_loss` and
`moe_z_loss` are logged beside it). Their statistics are those of the whole
micro-batch across every data-parallel (and expert-parallel) shard, so they do
not depend on the layout; with A microbatches each microbatch's losses count
1/A, as in Megatron-Core (its aux loss is per micro-batch, scaled by
1/num_microbatches; the token counts here are global over data-parallel ranks,
as in its `global_aux_loss`). A MoE model's microbatches run on the whole
micro-batch under the plain rules (no per-shard vmap: `jax.lax.ragged_dot` has
no batching rule for an unbatched weight), so its gradient is reduced over the
data-parallel devices once per microbatch rather than once per step.

Aux-loss-free balancing (model.moe_router_bias_update_rate > 0): the routers' expert bias
(TrainState.moe_expert_bias) is an input of every microbatch, and after the update it moves by
the rate toward balance from the step's assignments per expert, summed over the microbatches and
the whole batch (as Megatron-Core's all-reduce over data-parallel ranks); a skipped step keeps it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import Config
from megajax.mesh import ShardingRules, activation_sharding, logical_to_spec, mesh_sizes, spec_without, tree_specs
from megajax.models.moe import updated_expert_bias
from megajax.plan import PipelineChoice
from megajax.precision.fp8 import scales_of, update_fp8_state
from megajax.precision.loss_scale import DynamicLossScale
from megajax.precision.policy import precision_policy
from megajax.models.vision import IMAGE_AXES
from megajax.train.loss import Gradients, StepInputs, cross_entropy, mask_image_labels, microbatch_loss, step_inputs
from megajax.train.ops import MOE_RECORD_FIELDS
from megajax.train.optimizer import apply_update, clip_coefficient, update_count
from megajax.train.pipeline_step import pipeline_gradients
from megajax.train.state import ModelSpec, TrainState, build_model_spec

BATCH_AXES = (None, "batch", "length")  # [accumulation, batch, seq]
BATCH_KEYS_OPTIONAL = ("positions", "segment_ids")
METRIC_KEYS = ("loss", "grad_norm", "lr", "skipped", "loss_scale", "num_tokens")
# Mixture of experts (the logged records' MoE fields, megajax/train/ops.py): losses as defined in
# router_losses (mean over MoE layers), the busiest and idlest expert's share of the token-expert
# assignments (over layers; 1/num_experts is balanced), the fraction of assignments dropped by the
# expert capacity.
MOE_METRIC_KEYS = MOE_RECORD_FIELDS


def metric_keys(cfg: Config) -> tuple[str, ...]:
    return (METRIC_KEYS + (MOE_METRIC_KEYS if cfg.model.num_experts else ())
            + (("mtp_loss",) if cfg.model.mtp_num_layers else ()))


def batch_shardings(mesh: Mesh, rules: ShardingRules, keys) -> dict:
    """Every array [accumulation, batch, seq] (images: [accumulation, batch, N, H, W, 3])."""
    return {k: NamedSharding(mesh, logical_to_spec(IMAGE_AXES if k == "images" else BATCH_AXES, rules.activations))
            for k in keys}


def moe_metrics(sums: dict, topk: int) -> dict:
    """The logged MoE metrics from the step's sums (tokens per expert [layers, E])."""
    tokens = sums["moe_tokens"]
    share = tokens / jnp.maximum(jnp.sum(tokens, axis=-1, keepdims=True), 1.0)
    return {"moe_aux_loss": sums["moe_aux_loss"], "moe_z_loss": sums["moe_z_loss"],
            "moe_max_expert_share": jnp.max(share), "moe_min_expert_share": jnp.min(share),
            "moe_dropped_fraction": sums["moe_dropped"] / jnp.maximum(jnp.sum(tokens), 1.0)}


def make_finish(cfg: Config, tx: optax.GradientTransformation, scaler: DynamicLossScale | None,
                schedule: Callable) -> Callable:
    """finish(state, Gradients, inputs) -> (state, metrics): unscale, clip, update (or keep the old
    state where the step is not finite), roll the FP8 scaling state and the expert bias forward."""
    clip, fp8_policy, moe = cfg.optim.clip_grad, precision_policy(cfg).fp8, cfg.model.num_experts > 0

    def finish(state: TrainState, g: Gradients, inputs: StepInputs, ok: jax.Array | None = None):
        loss = g.sums["loss_sum"] / inputs.num_tokens
        grad_norm = optax.tree.norm(g.grads) / inputs.scale  # of the unscaled gradients, before clipping
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        lr = schedule(update_count(state.opt_state))
        factor = clip_coefficient(grad_norm, clip) / inputs.scale  # unscale and clip: one product

        def update(grads, opt_state, params, lr):
            grads = jax.tree.map(lambda x: x * factor, grads)
            # lr: this update's learning rate, an operand of the branch (make_optimizer)
            extra = {"learning_rate": lr} if isinstance(tx, optax.GradientTransformationExtraArgs) else {}
            return apply_update(tx, grads, opt_state, params, **extra)  # (an fp32 master copy's rounding)

        # The parameters and optimizer state change only where the step is finite (and `ok`, the
        # caller's flag): a conditional whose branch unscales, clips and updates in the same fused
        # loops, which write the new state once (a select after them would read and write every
        # parameter and moment again, and the scaled gradients would be a pass of their own).
        apply = finite if ok is None else finite & ok
        new_params, new_opt = jax.lax.cond(apply, update, lambda g, o, p, lr: (p, o), g.grads, state.opt_state,
                                           state.params, lr)

        def keep_if_skipped(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        fp8 = state.fp8
        new_fp8 = None if fp8 is None else keep_if_skipped(update_fp8_state(fp8, g.amaxes, fp8_policy.margin), fp8)
        bias = state.moe_expert_bias
        if bias is not None:  # aux-loss-free balancing: the step's global counts move the bias
            bias = keep_if_skipped(
                updated_expert_bias(bias, g.sums["moe_tokens"], cfg.model.moe_router_bias_update_rate), bias)
        new_state = TrainState(
            step=state.step + 1,
            params=new_params,
            opt_state=new_opt,
            loss_scale=scaler.update(state.loss_scale, ~finite) if scaler else None,
            rng=state.rng,
            fp8=new_fp8,
            moe_expert_bias=bias,
            frozen=state.frozen,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": ~finite,
                   "loss_scale": inputs.scale, "num_tokens": inputs.num_tokens}
        if moe:
            metrics.update(moe_metrics(g.sums, cfg.model.moe_router_topk))
        if "mtp_loss_sum" in g.sums:  # multi-token prediction's cross entropy (not in `loss`)
            metrics["mtp_loss"] = g.sums["mtp_loss_sum"] / inputs.num_tokens
        return new_state, metrics

    return finish


def make_train_step(cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation,
                    scaler: DynamicLossScale | None, schedule: Callable,
                    mesh: Mesh | None = None, rules: ShardingRules | None = None,
                    pipeline: PipelineChoice | None = None) -> Callable:
    """Returns step(state, batch) -> (state, metrics), not yet jitted: the layout's gradient
    function (through the pipeline stages with the plan's `pipeline` choice), then the finish.

    FP8 (delayed scaling): the loss is differentiated with respect to the products' scales too;
    those "gradients" are the amaxes each product saw (fp8_linear's custom VJP). They are combined
    with max, never summed: over microbatches, over data-parallel shards (once, with the
    gradients' reduction) and, since each amax is a max over the global tensor, over tensor
    shards. The scaling state is then rolled forward (megajax/precision/fp8.py), identically on
    every device, and never reaches clipping or the optimizer.
    """
    use_dropout = cfg.model.uses_dropout()
    if pipeline is not None:
        gradients = pipeline_gradients(cfg, spec, mesh, rules, pipeline)
    else:
        gradients = data_parallel_gradients(cfg, spec, mesh, rules)
    finish = make_finish(cfg, tx, scaler, schedule)

    def step(state: TrainState, batch: dict, ok: jax.Array | None = None) -> tuple[TrainState, dict]:
        batch = mask_image_labels(cfg, batch)
        inputs = step_inputs(state, batch, use_dropout)
        return finish(state, gradients(state, batch, inputs), inputs, ok)

    return step


# ----------------------------------------------------------------------------
# Data-parallel gradients
# ----------------------------------------------------------------------------

def per_shard_rules(rules: ShardingRules) -> ShardingRules:
    """Activation rules for the model as one data-parallel shard sees it: the `batch` dim is the
    per-shard batch (its data-parallel split is the vmapped dim, see `data_parallel_gradients`)."""
    return dataclasses.replace(rules, activations={**rules.activations, "batch": ()})


def vmapped_axes(cfg: Config, rules: ShardingRules, sizes: dict) -> tuple[str, ...]:
    """Mesh axes of the per-shard gradient vmap: where the rules put the batch; none for a MoE
    model (see the module docstring) or with dropout (whose masks are drawn for the whole
    microbatch, as one device draws them: megajax/models/layers.py `dropout`)."""
    if cfg.model.num_experts or cfg.model.uses_dropout():
        return ()
    return tuple(a for a in rules.activations["batch"] if sizes[a] > 1)


def accumulate(run_micro: Callable, accum: int, grad_dtype, pin: Callable = lambda g: g):
    """(gradients, amaxes, sums) of `accum` microbatches, `run_micro(i)` giving microbatch i's:
    gradients and sums add up (gradients in `grad_dtype`, kept in place by `pin`; those of 16-bit
    parameters cast as they come out), amaxes take the max."""
    if accum == 1:
        grads, amaxes, sums = run_micro(0)
        return jax.tree.map(lambda g: g.astype(grad_dtype), grads), amaxes, sums

    def body(carry, i):
        g, a, s = run_micro(i)
        return (pin(jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry[0], g)),
                jax.tree.map(jnp.maximum, carry[1], a), jax.tree.map(jnp.add, carry[2], s)), None

    grads, amaxes, sums = jax.eval_shape(run_micro, 0)
    zeros = (pin(jax.tree.map(lambda x: jnp.zeros(x.shape, grad_dtype), grads)),
             jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), amaxes),
             jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sums))
    return jax.lax.scan(body, zeros, jnp.arange(accum))[0]


def data_parallel_gradients(cfg: Config, spec: ModelSpec, mesh: Mesh | None,
                            rules: ShardingRules | None) -> Callable:
    """gradients(state, batch, inputs) -> Gradients over the data-parallel (and tensor, context,
    expert) layouts, reduced over the data-parallel devices once per step, as in Megatron.

    With several microbatches each one's gradient is computed per data-parallel shard (a vmap over
    the shards, whose dim is laid over the data axes, so nothing crosses them), the shards'
    gradients are accumulated unreduced, and one sum over the shards after the last microbatch
    becomes one all-reduce (or a reduce-scatter where the gradient is sharded: FSDP, distributed
    optimizer). FSDP parameters are gathered once per step for the same reason. The price: during
    the step every device holds whole (tensor-parallel) parameters and a gradient of the same size.
    The model inside the vmap sees one shard's batch, so it is built with rules whose `batch` is not
    split (`per_shard_rules`).

    With one microbatch there is one reduction anyway, so the model runs on the whole batch under
    the normal rules: FSDP keeps its parameters and gradients sharded through the step (gathered
    per layer, reduce-scattered as the backward pass produces them). So does a MoE model
    (`vmapped_axes`)."""
    policy = precision_policy(cfg)
    sizes = {} if mesh is None else mesh_sizes(mesh)
    dp_axes = () if mesh is None else vmapped_axes(cfg, rules, sizes)
    loss_and_grads = jax.value_and_grad(microbatch_loss(cfg), argnums=(1, 2), has_aux=True)

    def micro_of(batch, inputs, i):
        rng = None if inputs.rng is None else jax.random.fold_in(inputs.rng, i)
        return jax.tree.map(lambda x: x[i], batch), rng

    def whole_batch(state, batch, inputs):
        scales = {} if state.fp8 is None else scales_of(state.fp8)

        def run_micro(i):
            micro, rng = micro_of(batch, inputs, i)
            (_, sums), (grads, amaxes) = loss_and_grads(spec, state.params, scales, micro, rng, inputs,
                                                        state.fp8, state.moe_expert_bias, state.frozen)
            return grads, amaxes, sums

        with activation_sharding(mesh, None if rules is None else rules.activations):
            return Gradients(*accumulate(run_micro, inputs.accum, policy.grad_dtype))

    if not dp_axes:
        return whole_batch

    dp = math.prod(sizes[a] for a in dp_axes)
    shard_rules = per_shard_rules(rules)
    shard_spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size(), mesh=mesh, rules=shard_rules)
    param_specs, grad_specs = (tree_specs(spec.axes, table) for table in (rules.params, rules.opt_state))
    frozen_specs = None if spec.frozen_axes is None else tree_specs(spec.frozen_axes, rules.params)
    seq_entry = logical_to_spec(BATCH_AXES, rules.activations)[2]

    def constrain(x, entries):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))

    def on_own_shard(grads):
        """Pins per-shard gradients [dp, ...] to their own devices (no data-parallel collective)."""
        return jax.tree.map(lambda g, s: constrain(g, (dp_axes, *spec_without(s, dp_axes))), grads, param_specs)

    def per_shard(state, batch, inputs):
        if inputs.accum == 1:
            return whole_batch(state, batch, inputs)
        scales = {} if state.fp8 is None else scales_of(state.fp8)
        with activation_sharding(mesh, shard_rules.activations):
            # [A, dp x b, S] -> [A, dp, b, S]: the data-parallel dim made explicit (no data moves).
            batch = {k: constrain(v.reshape(inputs.accum, dp, -1, *v.shape[2:]),
                                  (None, dp_axes, None) + ((None,) * (v.ndim - 2) if k == "images" else (seq_entry,)))
                     for k, v in batch.items()}
            # Every shard uses whole (tensor-parallel) parameters: FSDP gathers them here, once.
            params = jax.tree.map(lambda p, s: constrain(p, spec_without(s, dp_axes)), state.params, param_specs)
            frozen = None if state.frozen is None else jax.tree.map(
                lambda p, s: constrain(p, spec_without(s, dp_axes)), state.frozen, frozen_specs)

            def run_micro(i):
                micro, rng = micro_of(batch, inputs, i)
                assert rng is None, "dropout runs on the whole batch (vmapped_axes)"
                one = lambda p, m: loss_and_grads(shard_spec, p, scales, m, None, inputs, state.fp8,
                                                  state.moe_expert_bias, frozen)
                (_, sums), (grads, amaxes) = jax.vmap(one, in_axes=(None, 0), spmd_axis_name=dp_axes)(params, micro)
                return grads, amaxes, sums

            grads, amaxes, sums = accumulate(run_micro, inputs.accum, policy.grad_dtype, on_own_shard)
            # The one data-parallel reduction of the step: an all-reduce, or a reduce-scatter onto
            # the optimizer's shards (FSDP, distributed optimizer); amaxes: a max over the shards.
            grads = jax.tree.map(lambda g, s: constrain(jnp.sum(g.astype(policy.reduction_dtype), axis=0), tuple(s)),
                                 on_own_shard(grads), grad_specs)
            return Gradients(grads, jax.tree.map(lambda a: jnp.max(a, axis=0), amaxes),
                             jax.tree.map(lambda x: jnp.sum(x, axis=0), sums))

    return per_shard


def make_eval_step(spec: ModelSpec, mesh: Mesh | None = None, rules: ShardingRules | None = None,
                   cfg: Config | None = None) -> Callable:
    """Returns eval(params, batch, fp8=None, expert_bias=None, frozen=None) -> (sum of token losses,
    number of tokens), not yet jitted; `fp8` is the run's FP8 scaling state (used as it is: evaluation
    records no amax), `expert_bias` the MoE routers' (TrainState.moe_expert_bias), `frozen` the frozen
    base parameters of a model with adapters (TrainState.frozen)."""
    act_rules = rules.activations if rules is not None else None

    def evaluate(params: dict, batch: dict, fp8: dict | None = None, expert_bias: jax.Array | None = None,
                 frozen: dict | None = None):
        if cfg is not None:
            batch = mask_image_labels(cfg, batch)
        with activation_sharding(mesh, act_rules):
            def micro(carry, i):
                m = jax.tree.map(lambda x: x[i], batch)
                logits = spec.apply(params, m["tokens"], m.get("positions"), m.get("segment_ids"), fp8=fp8,
                                    frozen=frozen, **({} if expert_bias is None else {"expert_bias": expert_bias}),
                                    **({"images": m["images"]} if "images" in m else {}))
                loss = jnp.sum(cross_entropy(logits, m["labels"]) * m["loss_mask"])
                return (carry[0] + loss, carry[1] + jnp.sum(m["loss_mask"])), None
            (loss, count), _ = jax.lax.scan(micro, (jnp.float32(0), jnp.float32(0)),
                                            jnp.arange(batch["tokens"].shape[0]))
            return loss, count

    return evaluate
