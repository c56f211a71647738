"""Gradients through the pipeline stages: the model in the pieces a stage runs, the train state
as the stage loop takes it, and the gradient function the train step composes with its finish.

The accumulation microbatches are the pipeline's microbatches; the schedule and the stage loop are
megajax/parallel/pipeline.py's. What rides along with the parameters into the stages: the FP8
products' scales (a layer's with its layer, split over `pipeline`; their "gradients" are this
step's amaxes, max-combined) and the MoE routers' expert bias [layers, E] (no gradient: dropped
after). A model with dense layers between its MoE layers enters as one stack of groups; a
dense-first model's dense layers run on the first stage with the embedding, the multi-token
prediction depths on the last with the loss (both whole on every stage: the `stack` axis). A
vision-language model's encoder and projector run with the embedding on the first stage, on its
microbatch's images; their weights enter the stages whole over `tensor` (the stages' products are
written per shard, and the encoder's are plain) and over `pipeline` (between steps the stages keep
one copy split among them: megajax.mesh.encoder_storage_axes).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.config import Config
from megajax.mesh import ShardingRules, activation_sharding, mesh_sizes, spec_without, tree_specs
from megajax.models.layout import EXPERT_BIAS, MTP_EXPERT_BIAS, STACK_NAMES
from megajax.models.moe import router_losses
from megajax.models.trainable import frozen_in_state, join
from megajax.parallel.pipeline import StageFunctions, build_schedule, schedule_gradients
from megajax.parallel.tensor import vocab_parallel_cross_entropy
from megajax.plan import PipelineChoice
from megajax.precision.fp8 import HISTORY, scales_of
from megajax.precision.policy import precision_policy
from megajax.train.loss import Gradients, StepInputs, moe_sums, mtp_targets
from megajax.train.state import ModelSpec, TrainState

# Where the MoE routers' expert bias rides in the tree the stages run on: the MoE layers' rows with
# their layers, a mixture-of-experts MTP block's with it (whole on every stage).
EXPERT_BIAS_PATH = tuple(EXPERT_BIAS.split("/"))
MTP_EXPERT_BIAS_PATH = tuple(MTP_EXPERT_BIAS.split("/"))


def pipeline_gradients(cfg: Config, spec: ModelSpec, mesh: Mesh, rules: ShardingRules,
                       choice: PipelineChoice) -> Callable:
    """gradients(state, batch, inputs) -> Gradients through the pipeline stages, on the schedule
    the plan chose (RunPlan.pipeline).

    FSDP parameters are gathered once per step, before the stages (experts stay split over
    `expert`: each device holds its own). The stage loop runs manual over every mesh axis; the
    gradient sums over the data-parallel axes (and `context`, which splits the sequence) are
    reduced once after it."""
    sizes, m = mesh_sizes(mesh), cfg.model
    stage_axis = rules.params["stage"][0]
    seq_axes = tuple(a for a in rules.activations["length"] if sizes[a] > 1)
    data_axes = tuple(a for a in rules.activations["batch"] if sizes[a] > 1) + seq_axes
    token_axes = tuple(a for a in rules.activations["residual_length"]  # sequence parallelism's
                       if a not in rules.activations["length"] and sizes[a] > 1)
    # Collectives inside the chunks (tensor, context, the experts' dispatch and router counts):
    # every device then takes every branch of a tick (megajax/parallel/pipeline.py).
    lockstep = m.num_experts > 0 or any(sizes[a] > 1 for a in (*rules.activations["heads"], *seq_axes))
    grad_specs = tree_specs(spec.axes, rules.opt_state)
    # With adapters the stages run on the whole tree, the frozen parameters beside them (no gradient).
    param_specs = tree_specs(join(spec.frozen_axes, spec.axes), rules.params)
    frozen_paths = set() if spec.frozen_axes is None else set(flatten_dict(spec.frozen_axes))
    gathered = set(rules.params["embed"]) | {"data"}  # the FSDP / data-parallel copies, gathered per step
    stage_specs = jax.tree.map(lambda s: P(*spec_without(s, gathered)), param_specs)
    # The embedding and output layer, kept split over the stages between steps (vocab_storage_axes),
    # enter the stages whole; their gradients leave reduce-scattered onto the stages' shares (`vocab_dims`).
    stage_specs |= {k: jax.tree.map(lambda s: P(*spec_without(s, {stage_axis})), v)
                    for k, v in stage_specs.items() if k not in STACK_NAMES}
    vocab_dims = ({path: names.index("vocab") for path, names in flatten_dict(join(spec.frozen_axes, spec.axes)).items()
                   if "vocab" in names} if stage_axis in rules.params["vocab"] else {})
    if m.vision is not None:  # the encoder and projector run whole on the first stage (their tensor and pipeline splits gathered)
        encoder = gathered | set(rules.params["vision_heads"]) | set(rules.params["vision_mlp"])
        stage_specs |= {k: jax.tree.map(lambda s: P(*spec_without(s, encoder)), param_specs[k])
                        for k in ("vision", "projector")}
    fns, grad_dtype = stage_functions(spec, cfg, mesh, rules), precision_policy(cfg).grad_dtype
    grouped = m.interleaves_dense_layers()

    def constrain(x, s):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))

    sched = build_schedule(choice.schedule, choice.stages, choice.microbatches, choice.virtual_stages)

    def gradients(state: TrainState, batch: dict, inputs: StepInputs) -> Gradients:
        assert inputs.accum == choice.microbatches, (inputs.accum, choice)
        params = jax.tree.map(constrain, join(state.frozen, state.params), stage_specs)
        tree, maxed, specs, scales = stage_tree(state, params, stage_specs, stage_axis,
                                                ("layers",) if m.dense_first_layers() else STACK_NAMES,
                                                m.num_moe_layers())
        if grouped:  # the stages split the groups [MoE layer, dense layers]
            tree, maxed, specs = (group_stacks(t, m.moe_layer_freq) for t in (tree, maxed, specs))
        scatter = unflatten_dict({k: vocab_dims.get(k, -1) for k in flatten_dict(tree)})
        with activation_sharding(mesh, rules.activations):
            grads, head_sums, router = schedule_gradients(
                fns, sched, mesh, tree, batch, None if inputs.rng is None else jax.random.key_data(inputs.rng),
                inputs.scale / inputs.num_tokens, grad_dtype, specs, axis=stage_axis, data_axes=data_axes,
                router_seed=inputs.scale / inputs.accum, maxed=maxed, seq_axes=seq_axes,
                token_axes=token_axes, lockstep=lockstep, scatter=scatter)
        flat = flatten_dict(ungroup_stacks(grads) if grouped else grads)
        amaxes = unflatten_dict({k: flat.pop(k) for k in scales}) if scales else {}
        flat.pop(EXPERT_BIAS_PATH, None)
        flat.pop(MTP_EXPERT_BIAS_PATH, None)
        for path in frozen_paths:  # zeros (stop_gradient in the stages' model)
            flat.pop(path)
        grads = jax.tree.map(constrain, unflatten_dict(flat), grad_specs)
        sums = {"loss_sum": head_sums["loss"]}
        if "mtp_loss" in head_sums:  # multi-token prediction's cross entropy (in the objective, not in `loss`)
            sums["mtp_loss_sum"] = head_sums["mtp_loss"]
        if "router" in head_sums:  # a mixture-of-experts MTP block's routers, after the layers'
            mtp = head_sums["router"]
            router = {k: router[k] + mtp[k] for k in ("aux", "z", "dropped")} | {
                "tokens": jnp.concatenate([router["tokens"], mtp["tokens"]])}
        if router is not None:
            sums.update(moe_sums(router["aux"], router["z"], router["dropped"], router["tokens"],
                                 inputs.accum * m.num_router_layers()))
        return Gradients(grads, amaxes, sums)

    return gradients


def stage_tree(state: TrainState, params: dict, specs: dict, stage_axis: str,
               split: tuple[str, ...] = STACK_NAMES, moe_layers: int = 0) -> tuple[dict, dict, dict, dict]:
    """(tree, maxed, specs, scales): the parameters with the FP8 scales and the expert bias beside
    them (those of the stacks in `split` over the stages like their layers; the bias's first
    `moe_layers` rows are the layers', the rest a MoE multi-token prediction block's), which of the
    tree's "gradients" are max-combined (the scales': amaxes), the tree's specs, and the flat scales."""
    scales = {} if state.fp8 is None else flatten_dict(scales_of(state.fp8))
    bias = {}
    if state.moe_expert_bias is not None:
        bias[EXPERT_BIAS_PATH] = state.moe_expert_bias[:moe_layers]
        if state.moe_expert_bias.shape[0] > moe_layers:
            bias[MTP_EXPERT_BIAS_PATH] = state.moe_expert_bias[moe_layers:]
    flat = flatten_dict(params)
    extra = {**scales, **bias}
    tree = unflatten_dict({**flat, **extra})
    maxed = unflatten_dict({**{k: False for k in flat}, **{k: k in scales for k in extra}})
    specs = unflatten_dict({**flatten_dict(specs), **{k: P(stage_axis) if k[0] in split else P() for k in extra}})
    return tree, maxed, specs, scales


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


def stage_functions(spec: ModelSpec, cfg: Config, mesh: Mesh, rules: ShardingRules) -> StageFunctions:
    """The model's embedding, layer stack (with a MoE model's router losses, as `micro_loss` adds
    them) and output layer + loss as a pipeline runs them (on each device's shards: the loss is
    the vocab-parallel cross entropy)."""
    ce = vocab_parallel_cross_entropy(mesh, rules.activations, cfg.model.vocab_size)
    fp8_paths = set() if spec.abstract_fp8 is None else set(flatten_dict(scales_of(spec.abstract_fp8)))
    frozen_paths = set() if spec.frozen_axes is None else set(flatten_dict(spec.frozen_axes))
    frozen = frozen_in_state(cfg.model)  # model.vision.freeze's, model.freeze_language_model's
    if frozen is not None:
        frozen_paths |= {p for p in flatten_dict(spec.axes) if frozen("/".join(p))}
    history = {} if spec.abstract_fp8 is None else flatten_dict(spec.abstract_fp8)

    def model(tree):
        """The model on a parameter tree; under FP8 the tree also holds the products' scales (the
        amax histories, which the forward pass does not read, are zeros of their shape), and with
        an expert bias the bias (which `layers` hands to the layer stack)."""
        flat = flatten_dict(tree)
        flat.pop(EXPERT_BIAS_PATH, None)
        flat.pop(MTP_EXPERT_BIAS_PATH, None)
        for path in frozen_paths:  # model.lora's frozen base: no gradient is computed for it
            flat[path] = jax.lax.stop_gradient(flat[path])
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

    def embed(params, m, key, layer_key):
        net = model(ungroup_stacks(params) if grouped else params)
        # A vision-language model's encoder and projector run here, on the first stage only.
        x = net.embed_input(m["tokens"], positions(m), key, **({"images_BxNxHxWxC": m["images"]} if "images" in m else {}))
        if dense_first:  # the first stage runs the dense layers (every stage holds them)
            x = net.dense_first_stack(x, positions_BxL=positions(m), segment_ids_BxL=m.get("segment_ids"),
                                      dropout_rng=layer_key)
        return x

    grouped = cfg.model.interleaves_dense_layers()
    f = cfg.model.moe_layer_freq if grouped else 1
    dense_first, depths = cfg.model.dense_first_layers(), cfg.model.mtp_num_layers

    def layers(params, x, m, key, first_layer, data_sum):
        if grouped:  # a chunk of groups (group_stacks); first_layer counts groups
            params, first_layer = ungroup_stacks(params), first_layer * f
        bias = flatten_dict(params).get(EXPERT_BIAS_PATH)  # [chunk layers, E] or None
        x, stats = model(params).layer_stack(x, positions_BxL=positions(m), segment_ids_BxL=m.get("segment_ids"),
                                             dropout_rng=key, first_layer=first_layer, expert_bias=bias,
                                             dense_first=False)
        if stats is None:
            return x, None
        # This shard's share of the whole microbatch's losses (its probabilities, all shards' counts).
        aux, z = router_losses(stats, data_sum(stats.balance_tokens), data_sum(stats.count), cfg.model)
        return x, {"loss": jnp.sum(aux) + jnp.sum(z), "aux": jnp.sum(aux), "z": jnp.sum(z),
                   "dropped": jnp.sum(stats.dropped), "tokens": stats.tokens}

    def head(params, x, m, data_sum):
        net = model(ungroup_stacks(params) if grouped else params)
        loss = jnp.sum(ce(net.output_logits(x), m["labels"]) * m["loss_mask"])
        if not depths:
            return loss, {"loss": loss}
        # Multi-token prediction on the last stage, weighed as micro_loss weighs it.
        bias = flatten_dict(params).get(MTP_EXPERT_BIAS_PATH)  # [depths, E] or None
        hidden, stats = net.mtp_hidden(m["tokens"], x, positions(m), m.get("segment_ids"), bias)
        mtp = 0.0
        for k, h in enumerate(hidden, start=1):
            labels, mask = mtp_targets(m["labels"], m["loss_mask"], k, net.sequence_shift, m.get("segment_ids"))
            mtp = mtp + jnp.sum(ce(net.output_layer(h), labels) * mask)
        mtp = mtp / depths
        objective, sums = loss + cfg.model.mtp_loss_scaling_factor * mtp, {"loss": loss, "mtp_loss": mtp}
        if stats is None:
            return objective, sums
        # A mixture-of-experts block: its router losses, weighed as the layers' are (StageFunctions.head).
        aux, z = router_losses(stats, data_sum(stats.balance_tokens), data_sum(stats.count), cfg.model)
        sums["router"] = {"aux": jnp.sum(aux), "z": jnp.sum(z), "dropped": jnp.sum(stats.dropped),
                          "tokens": stats.tokens}
        return (objective, jnp.sum(aux) + jnp.sum(z)), sums

    return StageFunctions(embed=embed, layers=layers, head=head, experts=cfg.model.num_experts)
