"""Analytic memory and communication for a layout, to read the compiled figures against.

Memory per device: parameters (fp32 master), gradients (fp32), optimizer
state (Adam's two moments, fp32) for the shardings the rules tables give;
activations per layer from Korthikanti et al. ("Reducing Activation
Recomputation in Large Transformer Models"), which count 16-bit activations:

    no recompute:       s*b*h * (34 + 5*a*s/h)                   (tensor t = 1)
    tensor t:           s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor t + SP:      s*b*h/t * (34 + 5*a*s/h)
    selective:          drops the 5*a*s/h term (attention scores, softmax, dropout)
    full:               2*s*b*h (/t with SP), the layer input only

scaled by (activation bytes / 2) for other precisions (the compute dtype's
bytes, megajax/precision/policy.py; FP8 keeps bf16 activations, its products'
one-byte copies of their inputs are not counted); b is the micro batch per
data-parallel rank. Every figure is of a run plan (megajax/plan.py): its mesh
sizes, batch layout and pipeline schedule, nothing recomputed here.

Communication per step, Megatron's minimum for the layout (elements x bytes
of the compute dtype): tensor parallelism all-reduces b*s*h twice per layer
forward (after the attention output and MLP output projections) and twice
backward (gradients of the q/k/v and MLP inputs), plus, with full
recomputation, the forward ones the backward needs again (the attention
output's all-reduce; with SP both all-gathers and the attention
reduce-scatter), plus once for the
vocabulary-parallel embedding (forward) and once for the output layer's
input (backward); sequence parallelism replaces each by an all-gather and a
reduce-scatter of the same b*s*h. Vocabulary-parallel cross-entropy
all-reduces three fp32 [b, s] rows. Data parallelism all-reduces each
device's gradient shard once; FSDP all-gathers the parameters and
reduce-scatters the gradients over `fsdp` (then all-reduces the 1/fsdp
shard over `data`); the distributed optimizer reduce-scatters the gradients
and all-gathers the updated parameters over `data`.

Mixture of experts over `expert` (ep ranks): each MoE layer sends a device's
tokens x top-k rows of h to the experts' devices and back, forward and
backward: 4 all-to-alls of tokens*k*h*(ep-1)/ep per layer and microbatch (a
balanced routing's bytes leaving the device). The other parameters'
gradients are also all-reduced over `expert` (a data-parallel axis for them).
A shared expert is a second tensor-parallel MLP in the layer on the same
input: its output's and its input gradient's reduction are 2 more b*s*h
all-reduces (with SP reduce-scatters) per layer; with SP the all-gathers of
its input and of its output's cotangent are the routed experts' own.
A MoE model reduces its gradients once per microbatch (megajax/train/step.py),
except through pipeline stages without dropout (once per step); with a
pipeline a device's all-to-alls are those of its stage's layers.

Pipeline parallelism over P stages (V chunks each): a device holds layers/P
layers, so the per-layer terms count those; the minimum stage-to-stage traffic
is 2 x microbatches x V stage-boundary activations b*s*h (forward activations
and backward cotangents, collective-permute); the embedding and output
layer's gradients (held by every stage) are all-reduced over `pipeline`. Layer
activations: the stages recompute a chunk's forward in its backward, so a
device holds its stashed stage inputs (s*b*h each; the schedule's stash:
M for GPipe, at most 2 V P - 1 for 1F1B and interleaved, whatever M) and one
chunk's layer activations at a time.
"""

from __future__ import annotations

import math

import jax

from megajax.checkpoint.source import flatten
from megajax.mesh import Rules, logical_to_spec
from megajax.parallel.pipeline import build_schedule
from megajax.plan import RunPlan
from megajax.precision.policy import precision_policy


def shard_factor(names: tuple, rules: Rules, sizes: dict[str, int]) -> int:
    """Number of pieces a tensor with these logical dims is split into by the rules."""
    n = 1
    for entry in logical_to_spec(names, rules):
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None:
                n *= sizes[axis]
    return n


def state_bytes(axes: dict, abstract_params: dict, rules_params: Rules, rules_opt: Rules,
                sizes: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and Adam state (all fp32)."""
    shapes = dict(flatten(abstract_params))
    params = opt = 0
    for name, names in flatten(axes):
        numel = math.prod(shapes[name].shape)
        itemsize = jax.numpy.dtype(shapes[name].dtype).itemsize
        params += numel // shard_factor(names, rules_params, sizes) * itemsize
        opt += 2 * numel // shard_factor(names, rules_opt, sizes) * itemsize
    return {"params": params, "grads": params, "optimizer": opt}


def activation_bytes(plan: RunPlan) -> int:
    """Korthikanti's per-device activation memory for all layers of one microbatch."""
    cfg, sizes = plan.cfg, plan.sizes
    m, t = cfg.model, sizes["tensor"]
    s, b, h, a = cfg.train.seq_len / sizes["context"], plan.batch.micro_batch, m.hidden_size, m.num_heads
    sp = cfg.parallel.sequence_parallel and t > 1
    attn = 5 * a * s / h
    policy = cfg.parallel.recompute
    if policy == "full":
        per_layer = 2 * s * b * h / (t if sp else 1)
    elif sp:
        per_layer = s * b * h / t * (34 + (0 if policy == "selective" else attn))
    else:
        per_layer = s * b * h * (10 + 24 / t + (0 if policy == "selective" else attn / t))
    scale = precision_policy(cfg).activation_bytes / 2
    pipe = plan.pipeline
    if pipe is not None:
        chunks = pipe.stages * pipe.virtual_stages
        stash = pipeline_stash(plan)
        return int((per_layer * m.num_layers / chunks + stash * s * b * h / (t if sp else 1)) * scale)
    return int(per_layer * m.num_layers * scale)


def pipeline_stash(plan: RunPlan) -> int:
    """Stage inputs a device keeps for its backward (the plan's schedule's stash slots; 0 without a
    pipeline)."""
    c = plan.pipeline
    if c is None:
        return 0
    return build_schedule(c.schedule, c.stages, c.microbatches, c.virtual_stages).stash


def logits_bytes(plan: RunPlan) -> int:
    """fp32 logits of one microbatch and their gradient, vocabulary-parallel over tensor."""
    sizes = plan.sizes
    tokens = plan.batch.micro_batch * plan.batch.seq_len / sizes["context"]
    return int(2 * tokens * plan.padded_vocab / sizes["tensor"] * 4)


def communication_bytes(plan: RunPlan, local_param_bytes: int, expert_param_bytes: int = 0,
                        stage_shared_param_bytes: int = 0) -> dict[str, int]:
    """Megatron's minimum bytes per device per step, by collective kind (`stage_shared_param_bytes`:
    the tensor shard of the parameters every pipeline stage holds, reduced over `pipeline`)."""
    cfg, sizes = plan.cfg, plan.sizes
    m = cfg.model
    t = sizes["tensor"]
    act = precision_policy(cfg).activation_bytes
    tokens = plan.batch.micro_batch * plan.batch.seq_len / sizes["context"]
    bsh = tokens * m.hidden_size * act
    out = {k: 0.0 for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")}
    a = plan.batch.accumulation
    pipe = plan.pipeline
    p = pipe.stages if pipe is not None else 1
    layers = m.num_layers / p
    moe_layers = m.num_moe_layers() / p  # the layers with an all-to-all (and a shared expert)
    if pipe is not None:
        out["collective-permute"] += 2 * a * pipe.virtual_stages * bsh
        out["all-reduce"] += stage_shared_param_bytes
    if t > 1:
        per_step = 4 * layers + 2
        shared = 2 * moe_layers if m.num_experts and m.moe_shared_expert_ffn_size else 0  # the shared expert
        full = cfg.parallel.recompute == "full"
        # Full recompute re-runs a layer's forward for its backward, but only the collectives whose
        # results the backward needs: all but the one after the MLP (the layer's output).
        if cfg.parallel.sequence_parallel:
            out["all-gather"] += a * (per_step + (2 * layers if full else 0)) * bsh
            out["reduce-scatter"] += a * (per_step + shared + (layers if full else 0)) * bsh
        else:
            out["all-reduce"] += a * (per_step + shared + (layers if full else 0)) * bsh
        out["all-reduce"] += a * 3 * tokens * 4  # vocabulary-parallel cross-entropy
    ep = sizes.get("expert", 1)
    # A MoE model reduces its gradients per microbatch, except through pipeline stages (once per
    # step, after the stage loop) unless dropout keeps the batch split with the compiler there.
    dropout = m.hidden_dropout > 0 or m.attention_dropout > 0
    reductions = a if m.num_experts and (p == 1 or dropout) else 1
    if m.num_experts and ep > 1:
        out["all-to-all"] += a * 4 * moe_layers * tokens * m.moe_router_topk * m.hidden_size * act * (ep - 1) / ep
        out["all-reduce"] += reductions * (local_param_bytes - expert_param_bytes)
    fsdp, data = sizes["fsdp"], sizes["data"]
    shard = local_param_bytes * reductions
    if fsdp > 1:  # ZeRO-3: gather the parameters, reduce-scatter the gradients
        out["all-gather"] += shard
        out["reduce-scatter"] += shard
        shard = shard / fsdp
    if data > 1:
        if cfg.parallel.distributed_optimizer:  # ZeRO-1: reduce-scatter gradients, all-gather updated params
            out["reduce-scatter"] += shard
            out["all-gather"] += shard
        else:
            out["all-reduce"] += shard
    return {k: int(v) for k, v in out.items()}


def tensor_shard_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                             sizes: dict[str, int]) -> int:
    """Bytes of the gradient a device reduces over the data axes: its tensor-parallel shard."""
    no_data = {**sizes, "data": 1, "fsdp": 1}
    return state_bytes(axes, abstract_params, rules_params, rules_params, no_data)["params"]


def stage_shared_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                             sizes: dict[str, int]) -> int:
    """The part of tensor_shard_param_bytes outside the stacked layers (embedding, final norm,
    output layer): what every pipeline stage holds."""
    no_data = {**sizes, "data": 1, "fsdp": 1}
    shared = {k: v for k, v in flatten(axes) if "layers" not in v}
    shapes = {k: v for k, v in flatten(abstract_params) if k in shared}
    return sum(math.prod(shapes[k].shape) * jax.numpy.dtype(shapes[k].dtype).itemsize
               // shard_factor(names, rules_params, no_data) for k, names in shared.items())


def expert_shard_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                             sizes: dict[str, int]) -> int:
    """The part of tensor_shard_param_bytes held by expert kernels (not reduced over `expert`)."""
    no_data = {**sizes, "data": 1, "fsdp": 1}
    experts = {k: v for k, v in flatten(axes) if "experts" in v}
    shapes = {k: v for k, v in flatten(abstract_params) if k in experts}
    return sum(math.prod(shapes[k].shape) * jax.numpy.dtype(shapes[k].dtype).itemsize
               // shard_factor(names, rules_params, no_data) for k, names in experts.items())


def memory_estimate(plan: RunPlan, spec) -> dict[str, int]:
    """Per-device bytes of `plan`'s run: parameters, gradients, Adam state, layer activations, logits,
    total (`spec`: the model spec, megajax.train.state.build_model_spec)."""
    rules = plan.rules
    est = {**state_bytes(spec.axes, spec.abstract_params, rules.params, rules.opt_state, plan.sizes),
           "activations": activation_bytes(plan),
           "logits": logits_bytes(plan)}
    est["total"] = sum(est.values())
    return est
