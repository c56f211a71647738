"""The train step: loss, gradients over microbatches, clipping, update, loss scaling.

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
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import Config
from megajax.mesh import ShardingRules, activation_sharding, logical_to_spec, spec_without
from megajax.models.layout import STACK_NAMES
from megajax.models.moe import router_losses, updated_expert_bias
from megajax.parallel.pipeline import StageFunctions, build_schedule, pipeline_gradients
from megajax.precision.fp8 import HISTORY, scales_of, update_fp8_state, with_scales
from megajax.precision.loss_scale import DynamicLossScale
from megajax.precision.policy import precision_policy
from megajax.train.optimizer import clip_by_global_norm, update_count
from megajax.train.state import ModelSpec, TrainState, build_model_spec

BATCH_AXES = (None, "batch", "length")  # [accumulation, batch, seq]
BATCH_KEYS_OPTIONAL = ("positions", "segment_ids")
METRIC_KEYS = ("loss", "grad_norm", "lr", "skipped", "loss_scale", "num_tokens")
# Mixture of experts: losses as defined in router_losses (mean over MoE layers), the busiest and
# idlest expert's share of the token-expert assignments (over layers; 1/num_experts is balanced),
# the fraction of assignments dropped by the expert capacity.
MOE_METRIC_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_max_expert_share", "moe_min_expert_share",
                   "moe_dropped_fraction")


def metric_keys(cfg: Config) -> tuple[str, ...]:
    return METRIC_KEYS + (MOE_METRIC_KEYS if cfg.model.num_experts else ())


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


def per_shard_rules(rules: ShardingRules) -> ShardingRules:
    """Activation rules for the model as one data-parallel shard sees it: the `batch` dim is the
    per-shard batch (its data-parallel split is the vmapped dim, see `make_train_step`)."""
    return dataclasses.replace(rules, activations={**rules.activations, "batch": ()})


def vmapped_axes(cfg: Config, rules: ShardingRules, sizes: dict) -> tuple[str, ...]:
    """Mesh axes of the per-shard gradient vmap: where the rules put the batch; none for a MoE
    model (see the module docstring)."""
    if cfg.model.num_experts:
        return ()
    return tuple(a for a in rules.activations["batch"] if sizes[a] > 1)


_without = spec_without  # a PartitionSpec's entries without some mesh axes


def make_train_step(cfg: Config, spec: ModelSpec, tx: optax.GradientTransformation,
                    scaler: DynamicLossScale | None, schedule: Callable,
                    mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Callable:
    """Returns step(state, batch) -> (state, metrics), not yet jitted.

    Gradients are reduced over the data-parallel devices once per step, as in Megatron: each
    microbatch's gradient is computed per data-parallel shard (a vmap over the shards, whose dim
    is laid over the data axes, so nothing crosses them), the shards' gradients are accumulated
    unreduced, and one sum over the shards after the last microbatch becomes one all-reduce (or a
    reduce-scatter where the gradient is sharded: FSDP, distributed optimizer). FSDP parameters are
    gathered once per step for the same reason. The price: during the step every device holds whole
    (tensor-parallel) parameters and a gradient of the same size. The model inside the vmap sees one
    shard's batch, so it is built with rules whose `batch` is not split (`per_shard_rules`).

    Without accumulation (one microbatch) there is one reduction anyway, so the step runs the model
    on the whole batch under the normal rules: FSDP keeps its parameters and gradients sharded
    through the step (gathered per layer, reduce-scattered as the backward pass produces them).

    FP8 (delayed scaling): the loss is differentiated with respect to the products' scales too;
    those "gradients" are the amaxes each product saw (fp8_linear's custom VJP). They are combined
    with max, never summed: over microbatches, over data-parallel shards (once, with the
    gradients' reduction) and, since each amax is a max over the global tensor, over tensor
    shards. The scaling state is then rolled forward (megajax/precision/fp8.py), identically on
    every device, and never reaches clipping or the optimizer.
    """
    clip = cfg.optim.clip_grad
    policy = precision_policy(cfg)
    fp8_policy = policy.fp8
    use_dropout = cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape)) if mesh is not None else {}
    # The data-parallel mesh axes of the vmap: where the rules put the batch.
    dp_axes = vmapped_axes(cfg, rules, sizes) if mesh is not None else ()
    dp = math.prod(sizes[a] for a in dp_axes)
    plain_act_rules = rules.activations if rules is not None else None
    moe = cfg.model.num_experts > 0
    if dp_axes:
        shard_rules = per_shard_rules(rules)
        shard_spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size(), mesh=mesh, rules=shard_rules)
        shard_act_rules = shard_rules.activations
        specs = lambda table: jax.tree.map(lambda names: logical_to_spec(names, table), spec.axes,
                                           is_leaf=lambda x: isinstance(x, tuple))
        param_specs = specs(rules.params)
        grad_specs = specs(rules.opt_state)  # where the optimizer update runs: sharded over data by ZeRO-1
    else:
        shard_spec, shard_act_rules = spec, plain_act_rules

    def constrain(x, spec_entries):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec_entries)))

    def micro_loss(params, fp8_scales, micro, rng, norm, scale, fp8, accum, model=shard_spec, expert_bias=None):
        """(scaled loss to differentiate, sums for the metrics) of one microbatch (of one shard)."""
        fp8 = None if fp8 is None else with_scales(fp8, fp8_scales)
        bias = {} if expert_bias is None else {"expert_bias": expert_bias}
        out = model.apply(params, micro["tokens"], micro.get("positions"), micro.get("segment_ids"),
                          dropout_rng=rng, fp8=fp8, router_stats=moe, **bias)
        logits, stats = out if moe else (out, None)
        loss_sum = jnp.sum(cross_entropy(logits, micro["labels"]) * micro["loss_mask"])
        sums = {"loss_sum": loss_sum}
        loss = loss_sum / norm
        if moe:
            # The model runs on the whole microbatch (vmapped_axes): its statistics are global.
            aux, z = router_losses(stats, stats.balance_tokens, stats.count, cfg.model)
            loss = loss + (jnp.sum(aux) + jnp.sum(z)) / accum
            layers = aux.shape[0]
            sums.update(moe_aux_loss=jnp.sum(aux) / (accum * layers), moe_z_loss=jnp.sum(z) / (accum * layers),
                        moe_tokens=stats.tokens, moe_dropped=jnp.sum(stats.dropped))
        return loss * scale, sums

    # Gradients with respect to the parameters, and the FP8 products' amaxes (see above).
    grad_fn = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)

    pipelined = sizes.get("pipeline", 1) > 1
    if pipelined:
        # The data-parallel axes the stage loop splits the batch over itself (see pipeline_gradients).
        pipeline_dp_axes = tuple(a for a in rules.activations["batch"] if sizes[a] > 1)
        # Context parallelism: the stage loop also splits the sequence over `context` (the ring
        # attention's own collectives then run in place); its gradient sums are reduced like a data axis's.
        pipeline_seq_axes = tuple(a for a in rules.activations["length"] if sizes[a] > 1)
        pipeline_dp_axes += pipeline_seq_axes
        pipeline_grad_specs, pipeline_param_specs = (
            jax.tree.map(lambda names: logical_to_spec(names, table), spec.axes, is_leaf=lambda x: isinstance(x, tuple))
            for table in (rules.opt_state, rules.params))

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if pipelined:
            with activation_sharding(mesh, plain_act_rules):
                return _pipeline_step(state, batch)
        if batch["tokens"].shape[0] == 1 or not dp_axes:  # one microbatch, or a MoE model
            with activation_sharding(mesh, plain_act_rules):
                return _step(state, batch, ())
        with activation_sharding(mesh, shard_act_rules):
            return _step(state, batch, dp_axes)

    def _step(state: TrainState, batch: dict, dp_axes: tuple[str, ...]):
        def on_own_shard(grads):
            """Pins per-shard gradients [dp, ...] to their own devices (no data-parallel collective)."""
            if not dp_axes:
                return grads
            return jax.tree.map(lambda g, s: constrain(g, (dp_axes, *_without(s, dp_axes))), grads, param_specs)

        fp8 = state.fp8
        fp8_scales = {} if fp8 is None else scales_of(fp8)

        def shard_grads(params, micro, rng, norm, scale):
            """Gradients, FP8 amaxes and loss sums of one microbatch, per data-parallel shard:
            [dp, ...] and [dp] from micro [dp, b, ...] (no leading dim without data parallelism)."""
            if not dp_axes:
                (_, sums), (grads, amaxes) = grad_fn(params, fp8_scales, micro, rng, norm, scale, fp8, accum, spec,
                                                     state.moe_expert_bias)
                return grads, amaxes, sums
            # Each shard draws its own dropout masks.
            rngs = None if rng is None else jax.random.split(rng, dp)
            per_shard = lambda p, m, r: grad_fn(p, fp8_scales, m, r, norm, scale, fp8, accum, shard_spec,
                                                state.moe_expert_bias)
            (_, sums), (grads, amaxes) = jax.vmap(per_shard, in_axes=(None, 0, 0 if rng is not None else None),
                                                  spmd_axis_name=dp_axes)(params, micro, rngs)
            return grads, amaxes, sums

        accum = batch["tokens"].shape[0]
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1.0)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if use_dropout else None
        params = state.params
        if dp_axes:
            # [A, dp x b, S] -> [A, dp, b, S]: the data-parallel dim made explicit (no data moves).
            seq_entry = logical_to_spec(BATCH_AXES, rules.activations)[2]
            batch = {k: constrain(v.reshape(accum, dp, -1, *v.shape[2:]), (None, dp_axes, None, seq_entry))
                     for k, v in batch.items()}
            # Every shard uses whole (tensor-parallel) parameters: FSDP gathers them here, once.
            params = jax.tree.map(lambda p, s: constrain(p, _without(s, dp_axes)), params, param_specs)

        def run_micro(i):
            micro = jax.tree.map(lambda x: x[i], batch)
            rng = None if step_rng is None else jax.random.fold_in(step_rng, i)
            return shard_grads(params, micro, rng, num_tokens, scale)

        if accum == 1:
            grads, amaxes, sums = run_micro(0)
        else:
            def body(carry, i):
                g, a, l = run_micro(i)
                # Gradients and metric sums add up over microbatches; amaxes take the max.
                return (on_own_shard(jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry[0], g)),
                        jax.tree.map(jnp.maximum, carry[1], a),
                        jax.tree.map(jnp.add, carry[2], l)), None
            lead = (dp,) if dp_axes else ()
            zeros = (on_own_shard(jax.tree.map(lambda p: jnp.zeros(lead + p.shape, policy.grad_dtype), params)),
                     jax.tree.map(lambda s: jnp.zeros(lead + s.shape, jnp.float32), fp8_scales),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run_micro, 0)[2]))
            (grads, amaxes, sums), _ = jax.lax.scan(body, zeros, jnp.arange(accum))
        # Sums over shards (the vmapped dim, when there is one) and microbatches.
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0) if dp_axes else x, sums)
        if dp_axes:
            # The one data-parallel reduction of the step: an all-reduce, or a reduce-scatter onto
            # the optimizer's shards (FSDP, distributed optimizer); amaxes: a max over the shards.
            grads = jax.tree.map(lambda g, s: constrain(jnp.sum(g.astype(policy.reduction_dtype), axis=0), tuple(s)),
                                 on_own_shard(grads), grad_specs)
            amaxes = jax.tree.map(lambda a: jnp.max(a, axis=0), amaxes)

        return finish(state, grads, amaxes, sums, num_tokens, scale)

    def _pipeline_step(state: TrainState, batch: dict):
        """The step through the pipeline stages (megajax/parallel/pipeline.py): the accumulation
        microbatches are the pipeline's microbatches."""
        sched = build_schedule(cfg.parallel.pipeline_schedule, sizes["pipeline"], batch["tokens"].shape[0],
                               cfg.parallel.virtual_stages)
        num_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1.0)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if use_dropout else None
        # FSDP parameters are gathered once per step, before the stages (see docs/parallelism.md: pipeline).
        # (Experts stay split over `expert`: each device holds its own experts.)
        stage_specs = jax.tree.map(lambda s: P(*_without(s, ("data", "fsdp"))), pipeline_param_specs)
        params = jax.tree.map(lambda p, s: constrain(p, tuple(s)), state.params, stage_specs)
        accum = batch["tokens"].shape[0]
        # FP8 (delayed scaling): the products' scales ride along with the parameters (a layer's with
        # its layer, split over `pipeline`); their "gradients" are this step's amaxes, max-combined.
        scales = {} if state.fp8 is None else flatten_dict(scales_of(state.fp8))
        # The MoE routers' expert bias [layers, E] rides along the same way (no gradient: dropped after).
        bias = {} if state.moe_expert_bias is None else {EXPERT_BIAS_PATH: state.moe_expert_bias}
        tree, maxed, specs = params, None, stage_specs
        if scales or bias:
            tree = unflatten_dict({**flatten_dict(params), **scales, **bias})
            maxed = unflatten_dict({**{k: False for k in flatten_dict(params)}, **{k: True for k in scales},
                                    **{k: False for k in bias}})
            specs = unflatten_dict({**flatten_dict(stage_specs),
                                    **{k: P("pipeline") if k[0] in STACK_NAMES else P() for k in (*scales, *bias)}})
        if cfg.model.interleaves_dense_layers():  # the stages split the groups [MoE layer, dense layers]
            f = cfg.model.moe_layer_freq
            tree = group_stacks(tree, f)
            maxed = None if maxed is None else group_stacks(maxed, f)
            specs = group_stacks(specs, f)
        # Dropout's masks keep the batch split inside the stage loop with the compiler (gradients
        # reduced per microbatch; see docs/parallelism.md: pipeline).
        grads, loss_sum, router = pipeline_gradients(
            stage_functions(spec, cfg), sched, mesh, tree, batch,
            None if step_rng is None else jax.random.key_data(step_rng), scale / num_tokens, policy.grad_dtype,
            specs, data_axes=() if use_dropout else pipeline_dp_axes, router_seed=scale / accum, maxed=maxed,
            seq_axes=() if use_dropout else pipeline_seq_axes)
        if cfg.model.interleaves_dense_layers():
            grads = ungroup_stacks(grads)
        amaxes = {}
        if scales or bias:
            flat = flatten_dict(grads)
            amaxes = unflatten_dict({k: flat.pop(k) for k in scales})
            flat.pop(EXPERT_BIAS_PATH, None)
            grads = unflatten_dict(flat)
        grads = jax.tree.map(lambda g, s: constrain(g, tuple(s)), grads, pipeline_grad_specs)
        sums = {"loss_sum": loss_sum}
        if moe:
            layers = cfg.model.num_moe_layers()
            sums.update(moe_aux_loss=router["aux"] / (accum * layers), moe_z_loss=router["z"] / (accum * layers),
                        moe_tokens=router["tokens"], moe_dropped=router["dropped"])
        return finish(state, grads, amaxes, sums, num_tokens, scale)

    def finish(state: TrainState, grads, amaxes, sums: dict, num_tokens, scale):
        """Unscale, clip, update (or skip a non-finite step) and the metrics."""
        fp8 = state.fp8
        loss_sum = sums["loss_sum"]
        grads = jax.tree.map(lambda g: g / scale, grads)
        loss = loss_sum / num_tokens
        grads, grad_norm = clip_by_global_norm(grads, clip)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        lr = schedule(update_count(state.opt_state))
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)

        def keep_if_skipped(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_fp8 = None if fp8 is None else keep_if_skipped(update_fp8_state(fp8, amaxes, fp8_policy.margin), fp8)
        bias = state.moe_expert_bias
        if bias is not None:  # aux-loss-free balancing: the step's global counts move the bias
            bias = keep_if_skipped(updated_expert_bias(bias, sums["moe_tokens"], cfg.model.moe_router_bias_update_rate),
                                   bias)
        new_state = TrainState(
            step=state.step + 1,
            params=keep_if_skipped(new_params, state.params),
            opt_state=keep_if_skipped(new_opt, state.opt_state),
            loss_scale=scaler.update(state.loss_scale, ~finite) if scaler else None,
            rng=state.rng,
            fp8=new_fp8,
            moe_expert_bias=bias,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": ~finite,
                   "loss_scale": scale, "num_tokens": num_tokens}
        if moe:
            metrics.update(moe_metrics(sums, cfg.model.moe_router_topk))
        return new_state, metrics

    return step


# Where a pipeline step puts the MoE routers' expert bias in the tree it runs the stages on.
EXPERT_BIAS_PATH = ("layers", "mlp", "expert_bias")


def group_stacks(tree: dict, f: int) -> dict:
    """A tree of a model with dense layers between its MoE layers (moe_layer_freq f > 1) as the
    pipeline takes it: one stack over the groups [MoE layer, f - 1 dense layers], `layers` =
    {"moe": the MoE layers [G, ...], "dense": the dense ones [G, f - 1, ...]} (arrays, bools, or
    PartitionSpecs given the extra dim)."""
    def dense(x):
        if isinstance(x, P):
            return P(x[0] if len(x) else None, None, *x[1:])
        return x.reshape((-1, f - 1) + x.shape[1:]) if hasattr(x, "reshape") else x
    rest = {k: v for k, v in tree.items() if k not in STACK_NAMES}
    return {**rest, "layers": {"moe": tree["layers"], "dense": jax.tree.map(
        dense, tree["dense_layers"], is_leaf=lambda x: isinstance(x, P))}}


def ungroup_stacks(tree: dict) -> dict:
    """group_stacks undone (arrays): `layers` and `dense_layers` in model form again."""
    rest = {k: v for k, v in tree.items() if k != "layers"}
    return {**rest, "layers": tree["layers"]["moe"],
            "dense_layers": jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree["layers"]["dense"])}


def stage_functions(spec: ModelSpec, cfg: Config) -> StageFunctions:
    """The model's embedding, layer stack (with a MoE model's router losses, as `micro_loss` adds
    them) and output layer + loss as a pipeline runs them."""
    fp8_paths = set() if spec.abstract_fp8 is None else set(flatten_dict(scales_of(spec.abstract_fp8)))
    history = {} if spec.abstract_fp8 is None else flatten_dict(spec.abstract_fp8)

    def model(tree):
        """The model on a parameter tree; under FP8 the tree also holds the products' scales (the
        amax histories, which the forward pass does not read, are zeros of their shape), and with
        an expert bias the bias (which `layers` hands to the layer stack)."""
        flat = flatten_dict(tree)
        flat.pop(EXPERT_BIAS_PATH, None)
        if not fp8_paths:
            return nnx.merge(spec.graphdef, unflatten_dict(flat))
        fp8 = {}
        for path in fp8_paths:
            s = flat.pop(path)
            h = history[path[:-1] + (HISTORY,)].shape
            fp8[path] = s
            fp8[path[:-1] + (HISTORY,)] = jnp.zeros((*s.shape[:-1], *h[-2:]), jnp.float32)
        return nnx.merge(spec.graphdef, unflatten_dict(flat), unflatten_dict(fp8))

    def positions(m):
        if m.get("positions") is not None:
            return m["positions"]
        b, l = m["tokens"].shape
        return jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))

    def embed(params, m, key):
        return model(ungroup_stacks(params) if grouped else params).embed_input(m["tokens"], positions(m), key)

    grouped = cfg.model.interleaves_dense_layers()
    f = cfg.model.moe_layer_freq if grouped else 1

    def layers(params, x, m, key, first_layer, data_sum):
        if grouped:  # a chunk of groups (group_stacks); first_layer counts groups
            params, first_layer = ungroup_stacks(params), first_layer * f
        bias = flatten_dict(params).get(EXPERT_BIAS_PATH)  # [chunk layers, E] or None
        x, stats = model(params).layer_stack(x, positions_BxL=positions(m), segment_ids_BxL=m.get("segment_ids"),
                                             dropout_rng=key, first_layer=first_layer, expert_bias=bias)
        if stats is None:
            return x, None
        # This shard's share of the whole microbatch's losses (its probabilities, all shards' counts).
        aux, z = router_losses(stats, data_sum(stats.balance_tokens), data_sum(stats.count), cfg.model)
        return x, {"loss": jnp.sum(aux) + jnp.sum(z), "aux": jnp.sum(aux), "z": jnp.sum(z),
                   "dropped": jnp.sum(stats.dropped), "tokens": stats.tokens}

    def head(params, x, m):
        params = ungroup_stacks(params) if grouped else params
        return jnp.sum(cross_entropy(model(params).logits(x), m["labels"]) * m["loss_mask"])

    return StageFunctions(embed=embed, layers=layers, head=head, experts=cfg.model.num_experts)


def moe_metrics(sums: dict, topk: int) -> dict:
    """The logged MoE metrics from the step's sums (tokens per expert [layers, E])."""
    tokens = sums["moe_tokens"]
    share = tokens / jnp.maximum(jnp.sum(tokens, axis=-1, keepdims=True), 1.0)
    return {"moe_aux_loss": sums["moe_aux_loss"], "moe_z_loss": sums["moe_z_loss"],
            "moe_max_expert_share": jnp.max(share), "moe_min_expert_share": jnp.min(share),
            "moe_dropped_fraction": sums["moe_dropped"] / jnp.maximum(jnp.sum(tokens), 1.0)}


def make_eval_step(spec: ModelSpec, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Callable:
    """Returns eval(params, batch, fp8=None, expert_bias=None) -> (sum of token losses, number of
    tokens), not yet jitted; `fp8` is the run's FP8 scaling state (used as it is: evaluation records
    no amax), `expert_bias` the MoE routers' (TrainState.moe_expert_bias)."""
    act_rules = rules.activations if rules is not None else None

    def evaluate(params: dict, batch: dict, fp8: dict | None = None, expert_bias: jax.Array | None = None):
        with activation_sharding(mesh, act_rules):
            def micro(carry, i):
                m = jax.tree.map(lambda x: x[i], batch)
                logits = spec.apply(params, m["tokens"], m.get("positions"), m.get("segment_ids"), fp8=fp8,
                                    **({} if expert_bias is None else {"expert_bias": expert_bias}))
                loss = jnp.sum(cross_entropy(logits, m["labels"]) * m["loss_mask"])
                return (carry[0] + loss, carry[1] + jnp.sum(m["loss_mask"])), None
            (loss, count), _ = jax.lax.scan(micro, (jnp.float32(0), jnp.float32(0)),
                                            jnp.arange(batch["tokens"].shape[0]))
            return loss, count

    return evaluate
