"""Analytic memory and communication for a layout, to read the compiled figures against.

Memory per device: parameters (in precision.param_dtype: the compute dtype or
fp32), gradients (fp32), optimizer state (Adam's two moments, fp32, and the fp32
master copy of 16-bit parameters) for the shardings the rules tables give (a
data-parallel split that does not divide a dim counted padded);
activations per layer from Korthikanti et al. ("Reducing Activation
Recomputation in Large Transformer Models"), which count 16-bit activations:

    no recompute:       s*b*h * (34 + 5*a*s/h)                   (tensor t = 1)
    tensor t:           s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor t + SP:      s*b*h/t * (34 + 5*a*s/h)
    selective:          drops the 5*a*s/h term (attention scores, softmax, dropout)
    fused attention:    (flash, cuDNN) 2*a/h in its place (the fp32 log-sum-exp per head)
    full:               2*s*b*h (/t with SP), the layer input only

Multi-latent attention replaces the attention's 11 s*b*h by its own q/k/v widths
and latents (`mla_attention_delta`); each multi-token prediction depth adds a
layer, its projection's inputs and its own logits. All scaled by (activation
bytes / 2) for other precisions (the compute dtype's
bytes, megajax/precision/policy.py; FP8 keeps bf16 activations, its products'
one-byte copies of their inputs are not counted); b is the micro batch per
data-parallel rank. Every figure is of a run plan (megajax/plan.py): its mesh
sizes, batch layout and pipeline schedule, nothing recomputed here.

Communication per step and device, by collective kind: the collectives this
layout's program runs, counted as the compiled HLO counts them (megajax/perf/
hlo.py), in elements x bytes of the compute dtype (fp32 on CPU, where XLA runs
16-bit arithmetic in fp32). Tensor parallelism reduces b*s*h twice per layer
forward (after the attention output and MLP output projections) and twice
backward (the gradients of the q/k/v and MLP inputs), plus, with full
recomputation, the forward ones the backward needs again (the attention
output's all-reduce; with SP both all-gathers and the attention
reduce-scatter), plus once for the vocabulary-parallel embedding (forward) and
once for the output layer's input (backward); sequence parallelism replaces
each by an all-gather and a reduce-scatter of the same b*s*h.
Vocabulary-parallel cross-entropy all-reduces three fp32 [b, s] rows. Context
parallelism moves k and v (the kv heads of a tensor rank) per layer: the ring
C - 1 hops forward and C hops backward with their fp32 gradients
(collective-permutes), the all-gather implementation gathers them forward and
reduce-scatters their gradients. Data parallelism all-reduces each device's
gradient shard once (and once more over `context` without a pipeline, where
XLA reduces over it separately); FSDP all-gathers the parameters and
reduce-scatters the gradients over `fsdp` (then all-reduces the 1/fsdp shard
over `data`); the distributed optimizer reduce-scatters the gradients and
all-gathers the updated parameters over `data`. Parameters are gathered in
their dtype (16-bit with precision.param_dtype=compute: half the fp32 bytes;
on CPU XLA gathers them as fp32), gradients reduced in fp32.

Mixture of experts over `expert` (ep ranks; with parallel.expert_tensor_parallel=1, MoE parallel
folding, over expert x context x tensor, a device dispatching 1 / tensor of its tokens and, under
sequence parallelism, the MoE layers' tensor all-gathers and reduce-scatters gone), the alltoall dispatcher: each MoE layer sends a device's
tokens x top-k rows of h to the experts' devices and back, forward and
backward, in fixed buffers with one slot per device (dropless: room for every
assignment, so ep x the rows; capacity mode: the experts' capacity): 4
all-to-alls of the buffer per layer and microbatch; parallel.moe_all_to_all=ragged
moves the assignments' rows only (ragged_all_to_all), each once. The allgather dispatcher
(the default on CPU) gathers the expert group's ep x s*b*h tokens (and their
routes and weights) and reduce-scatters the fp32 outputs forward, the reverse
backward. The other parameters'
gradients are also all-reduced over `expert` (a data-parallel axis for them).
A shared expert is a second tensor-parallel MLP in the layer on the same
input: its output's and its input gradient's reduction are 2 more b*s*h
all-reduces (with SP reduce-scatters) per layer; with SP the all-gathers of
its input and of its output's cotangent are the routed experts' own.
A model run on the whole batch per microbatch (MoE, dropout:
megajax/train/step.py) reduces its gradients once per microbatch, except
through pipeline stages (once per step, after the stage loop).

Pipeline parallelism over P stages (V chunks each): a device runs its stage's
chunk of layers/(P V) layers in each tick's forward half and its backward
(from the residuals the forward stashed; the forward again only with
recompute=full) in the backward half; the compiled loop counts both halves in
every tick (the HLO does not say which ticks take a half's branch), and the
figures count them the same way. Each tick sends an activation and a cotangent
(collective-permute); what one stage alone runs but the stages keep split
between steps (the embedding and output layer, a vision-language model's
encoder) is all-gathered over `pipeline` before the loop; the embedding's and
output layer's gradients are reduce-scattered back over `pipeline`, the other
shared parameters' (final norm, encoder) all-reduced; the interleaved schedule
moves the layers into its chunk order and their gradients back once per step.
Layer activations: a device holds in its stash the residuals of each in-flight
microbatch's chunk (layers/(P V) layers' activations, as above for the
recompute policy; the schedule's stash slots: M for GPipe, at most 2 V P - 1 for
1F1B and interleaved, whatever M), and the last stage's chunk outputs waiting
for the loss (s*b*h each; 1 slot for 1F1B).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import jax

from megajax.checkpoint.source import flatten
from megajax.config import expert_tensor_folded, moe_token_dispatcher
from megajax.mesh import Rules, logical_to_spec, spec_axes
from megajax.models.trainable import frozen_in_state
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


def shard_numel(shape: tuple[int, ...], names: tuple, rules: Rules, sizes: dict[str, int]) -> int:
    """Elements of one device's shard of a tensor the rules split: each dim's split rounded up (a
    data-parallel split that does not divide a dim is stored padded, megajax/mesh.py PADDED_AXES)."""
    spec = tuple(logical_to_spec(names, rules))
    spec += (None,) * (len(shape) - len(spec))
    return math.prod(-(-n // math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ())))
                     for n, e in zip(shape, spec))


def state_bytes(axes: dict, abstract_params: dict, rules_params: Rules, rules_opt: Rules,
                sizes: dict[str, int], frozen=None, policy=None) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and optimizer state (Adam's two fp32 moments and,
    where the parameters are 16-bit, the fp32 master copy): the parameters in policy.param_dtype and
    the gradients in policy.grad_dtype (`policy`: megajax.precision.policy's; None: all in the
    dtypes of `abstract_params`, no copy); `frozen` (a predicate over parameter names,
    megajax.models.trainable.frozen_in_state) names parameters without Adam moments.

    In bf16 with the copy that is Megatron's 2 + 4 + 12 / d bytes per parameter with the distributed
    optimizer over d data-parallel ranks (18 without it); with fp32 parameters 4 + 4 + 8 / d (16)."""
    shapes = dict(flatten(abstract_params))
    params = grads = opt = 0
    for name, names in flatten(axes):
        shape = shapes[name].shape
        itemsize = jax.numpy.dtype(shapes[name].dtype).itemsize
        local, sharded = shard_numel(shape, names, rules_params, sizes), shard_numel(shape, names, rules_opt, sizes)
        params += local * (itemsize if policy is None else policy.param_dtype.itemsize)
        grads += local * (itemsize if policy is None else policy.grad_dtype.itemsize)
        if frozen is None or not frozen(name):
            opt += 2 * sharded * itemsize
        if policy is not None and policy.master_dtype is not None:
            opt += sharded * policy.master_dtype.itemsize
    return {"params": params, "grads": grads, "optimizer": opt}


def activation_bytes(plan: RunPlan) -> int:
    """Korthikanti's per-device activation memory for all layers of one microbatch (through pipeline
    stages: the stash, pipeline_stash_bytes)."""
    if plan.pipeline is not None:
        return pipeline_stash_bytes(plan)
    cfg, sizes = plan.cfg, plan.sizes
    m, t = cfg.model, sizes["tensor"]
    s, b, h = cfg.train.seq_len / sizes["context"], plan.batch.micro_batch, m.hidden_size
    sp = cfg.parallel.sequence_parallel and t > 1
    scale = precision_policy(cfg).activation_bytes / 2
    # Each multi-token prediction depth: a layer, plus its two norms' inputs and the concatenated
    # [2h] input of its projection (8 bytes per hidden feature at 16 bits).
    full = cfg.parallel.recompute == "full"
    per_layer = layer_activation_bytes(plan)
    mtp = m.mtp_num_layers * (per_layer + (0 if full else 8 * s * b * h / (t if sp else 1) * scale))
    return int(per_layer * m.num_layers + mtp)


def layer_activation_bytes(plan: RunPlan) -> float:
    """Korthikanti's activation bytes one layer keeps for its backward, per device and microbatch, for
    the recompute policy (a hybrid's: the mean over its pattern), in the compute dtype."""
    cfg, sizes = plan.cfg, plan.sizes
    m, t = cfg.model, sizes["tensor"]
    s, b, h, a = cfg.train.seq_len / sizes["context"], plan.batch.micro_batch, m.hidden_size, m.num_heads
    sp = cfg.parallel.sequence_parallel and t > 1
    # The scores, softmax and its dropout mask (5 a s / h) where they are materialised (attention_impl
    # xla); a fused kernel (flash, cuDNN) keeps the softmax's fp32 log-sum-exp per head instead.
    attn = 5 * a * s / h if m.attention_impl == "xla" else 2 * a / h
    policy = cfg.parallel.recompute
    if policy == "full":
        per_layer = 2 * s * b * h / (t if sp else 1)
    elif sp:
        per_layer = s * b * h / t * (34 + (0 if policy == "selective" else attn))
    else:
        per_layer = s * b * h * (10 + 24 / t + (0 if policy == "selective" else attn / t))
    if m.multi_latent_attention and policy != "full":
        per_layer += s * b * mla_attention_delta(m, t)
    if m.hybrid_layer_pattern:  # the mean over the pattern's one-mixer layers
        pattern = m.hybrid_pattern()
        per_layer = sum(hybrid_layer_bytes(kind, m, s, b, t, sp, policy) for kind in pattern) / len(pattern)
    return per_layer * precision_policy(cfg).activation_bytes / 2


def vision_activation_bytes(plan: RunPlan) -> int:
    """A vision-language model's encoder activations for one microbatch (one image per sequence, its
    model.vision.max_tiles pictures when tiled): per
    layer that runs, Korthikanti's count without tensor or sequence splitting (the encoder's activations
    are replicated over tensor), none of its layers' inputs kept when it is frozen (no backward)."""
    v = plan.cfg.model.vision
    if v is None or v.freeze:
        return 0
    t, d, a, b = v.num_patches + v.class_token, v.hidden_size, v.num_heads, plan.batch.micro_batch * v.max_tiles
    per_layer = t * b * d * (34 + 5 * a * t / d)
    scale = precision_policy(plan.cfg).activation_bytes / 2
    return int(per_layer * v.feature_layers() * scale)


def hybrid_layer_bytes(kind: str, m, s: float, b: int, t: int, sp: bool, policy: str) -> float:
    """16-bit activation bytes one layer of a hybrid keeps for its backward (Korthikanti's terms split
    by mixer: attention 2 h norm input + 11 h + 5 a s, the MLP or MoE 2 h + 19 h; under sequence
    parallelism all split over tensor, else the norm inputs and 3 h of each mixer replicated). A Mamba-2
    layer: the norm input (2 h), in_proj's outputs (2 (2 d + 2 G N + H)), the conv's input and output
    and dt in fp32 (8 (d + 2 G N) + 4 H), each chunk's scores (4 G Q) and states (4 H P N / Q) in fp32,
    y and the gated product in fp32 (8 d) and out_proj's input (2 d), d = heads x head dim split over
    tensor; selective recompute keeps the sequence mixing's inputs, chunk states and output only.
    Full recompute keeps each group's input (2 h per group)."""
    h = m.hidden_size
    if policy == "full":
        return 2 * s * b * h / (t if sp else 1) / len(m.hybrid_group())
    if kind == "M":
        q = min(m.mamba_chunk_size, s)
        d, gn, heads = m.mamba_inner_size(), m.mamba_num_groups * m.mamba_state_dim, m.mamba_num_heads
        states = 4 * heads * m.mamba_head_dim * m.mamba_state_dim / q
        if policy == "selective":  # the sequence mixing keeps its inputs, the chunk states and y
            inner = 2 * (2 * d + 2 * gn + heads) + states + 10 * d
        else:
            inner = 2 * (2 * d + 2 * gn + heads) + 8 * (d + 2 * gn) + 4 * heads + 4 * m.mamba_num_groups * q + states + 10 * d
        return s * b * (2 * h / (t if sp else 1) + inner / t)
    fused = m.attention_impl != "xla"  # a fused kernel keeps the log-sum-exp, not the scores
    attn = 0 if policy == "selective" else (2 if fused else 5 * s) * m.num_heads / h
    core = 11 + attn if kind == "*" else 19
    if sp:
        return s * b * h * (2 + core) / t
    return s * b * h * (2 + 3 + (core - 3) / t)


def mla_attention_delta(m, t: int) -> float:
    """Per token: multi-latent attention's 16-bit activation bytes minus the 11 h Korthikanti counts for
    standard attention (2 h input, 4 h q and k, 2 h v, 2 h o's input, h dropout mask; the q/k/v/o
    ones split over tensor). Its q and k have H (N + P) features, v and o's input H V, split over
    tensor; its latents are replicated over tensor (also under sequence parallelism): the q latent
    and its norm's output (2 Rq each), the kv down-projection's output (Rkv + P) and the kv latent's
    norm output (Rkv), 2 bytes each."""
    heads = m.num_heads
    sharded = 4 * heads * (m.qk_head_dim + m.qk_pos_emb_head_dim) + 4 * heads * m.v_head_dim - 8 * m.hidden_size
    latent = 4 * (m.q_lora_rank or 0) + 2 * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + 2 * m.kv_lora_rank
    return sharded / t + latent


@functools.lru_cache(maxsize=4096)
def schedule_of(schedule: str, stages: int, microbatches: int, virtual: int):
    """The pipeline schedule of that shape, built once (a plan estimates many layouts of each)."""
    return build_schedule(schedule, stages, microbatches, virtual)


def pipeline_stash(plan: RunPlan) -> int:
    """Microbatches a device keeps the residuals of for its backward (the plan's schedule's stash
    slots; 0 without a pipeline)."""
    c = plan.pipeline
    if c is None:
        return 0
    return schedule_of(c.schedule, c.stages, c.microbatches, c.virtual_stages).stash


def pipeline_stash_bytes(plan: RunPlan) -> int:
    """A device's pipeline stash (0 without a pipeline): per slot one chunk's layer activations
    (layer_activation_bytes per layer), and the
    last stage's chunk outputs waiting for the loss (s*b*h each, the schedule's head_stash slots);
    every device holds buffers of the most slots any stage uses."""
    c = plan.pipeline
    if c is None:
        return 0
    cfg, sizes = plan.cfg, plan.sizes
    per_layer = layer_activation_bytes(plan)
    t = sizes["tensor"]
    sp = cfg.parallel.sequence_parallel and t > 1
    sc = schedule_of(c.schedule, c.stages, c.microbatches, c.virtual_stages)
    s, b, h = cfg.train.seq_len / sizes["context"], plan.batch.micro_batch, cfg.model.hidden_size
    output = s * b * h / (t if sp else 1) * precision_policy(cfg).activation_bytes
    return int(sc.stash * per_layer * cfg.model.num_layers / (c.stages * c.virtual_stages) + sc.head_stash * output)


def logits_bytes(plan: RunPlan) -> int:
    """fp32 logits of one microbatch and their gradient, vocabulary-parallel over tensor."""
    sizes = plan.sizes
    tokens = plan.batch.micro_batch * plan.batch.seq_len / sizes["context"]
    depths = 1 + plan.cfg.model.mtp_num_layers  # each multi-token prediction depth has its own logits
    return int(2 * depths * tokens * plan.padded_vocab / sizes["tensor"] * 4)


def _passes(plan: RunPlan) -> dict[str, float]:
    """How often per step a device runs each kind of pass: `fwd` / `bwd` layer passes (layers x
    microbatches; in a pipeline, its stage's chunk per tick in each half), `extra` the forward passes
    full recompute adds in the backward, `moe_*` the same for
    the MoE layers, `micro` the embedding / output layer / loss passes, `ticks` the stage loop's
    ticks (0 without a pipeline). A pipeline counts both halves in every tick, as the compiled
    program's loop does (the HLO does not say which ticks take a half's branch)."""
    m, pipe = plan.cfg.model, plan.pipeline
    full = plan.cfg.parallel.recompute == "full"
    head_moe = m.num_router_layers() - m.num_moe_layers()  # a MoE multi-token prediction block's, with the loss
    if pipe is None:
        a = plan.batch.accumulation
        layers, moe = a * m.num_layers, a * m.num_router_layers()
        return {"fwd": layers, "bwd": layers, "extra": layers if full else 0, "moe_fwd": moe, "moe_bwd": moe,
                "moe_extra": a * m.num_moe_layers() if full else 0, "micro": a, "ticks": 0}
    ticks = schedule_of(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages).ticks
    chunks = pipe.stages * pipe.virtual_stages
    c, c_moe = m.num_layers / chunks, m.num_moe_layers() / chunks
    return {"fwd": ticks * c, "bwd": ticks * c, "extra": ticks * c if full else 0,
            "moe_fwd": ticks * (c_moe + head_moe), "moe_bwd": ticks * (c_moe + head_moe),
            "moe_extra": ticks * c_moe if full else 0, "micro": ticks, "ticks": ticks}


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def communication_bytes(plan: RunPlan, local_param_bytes: int, expert_param_bytes: int = 0,
                        stage_shared_param_bytes: int = 0, platform: str = "gpu",
                        lora_tensor_reduced_bytes: int = 0, stage_gathered_param_bytes: int = 0,
                        stage_scattered_param_bytes: int = 0, stage_tensor_reduced_bytes: int = 0) -> dict[str, int]:
    """The bytes per device per step of the layout's collectives, by kind (`stage_shared_param_bytes`:
    the tensor shard of the parameters every pipeline stage holds, reduced over `pipeline`;
    `lora_tensor_reduced_bytes`: lora_tensor_reduced_bytes's; `stage_gathered_param_bytes`: the part
    of the shared ones gathered over `pipeline` for the step, stage_gathered_param_bytes's;
    `stage_scattered_param_bytes`: the part whose gradient is reduce-scattered back, stage_scattered_param_bytes's;
    `stage_tensor_reduced_bytes`: stage_tensor_reduced_bytes's). On
    `platform` cpu, XLA runs 16-bit floating point arithmetic in fp32, its collectives included."""
    out = dict.fromkeys(COLLECTIVES, 0.0)
    for (kind, _axis), v in _communication(plan, local_param_bytes, expert_param_bytes,
                                           stage_shared_param_bytes, platform, lora_tensor_reduced_bytes,
                                           stage_gathered_param_bytes, stage_scattered_param_bytes,
                                           stage_tensor_reduced_bytes).items():
        out[kind] += v
    return {k: int(v) for k, v in out.items()}


def communication_by_axis(plan: RunPlan, local_param_bytes: int, expert_param_bytes: int = 0,
                          stage_shared_param_bytes: int = 0, platform: str = "gpu",
                          lora_tensor_reduced_bytes: int = 0,
                          stage_gathered_param_bytes: int = 0, stage_scattered_param_bytes: int = 0,
                          stage_tensor_reduced_bytes: int = 0) -> dict[tuple[str, str], int]:
    """communication_bytes split by (kind, mesh axis it runs over): the figures `megajax plan` times
    over each axis's links. The data-parallel reduction of a layout with a pipeline and `context`
    runs over both axes; it is counted under `data`."""
    return {k: int(v) for k, v in _communication(plan, local_param_bytes, expert_param_bytes,
                                                 stage_shared_param_bytes, platform,
                                                 lora_tensor_reduced_bytes, stage_gathered_param_bytes,
                                                 stage_scattered_param_bytes, stage_tensor_reduced_bytes).items()}


TENSOR_SPLIT = ("heads", "kv_heads", "mlp", "ssm_groups", "vocab")  # the logical dims tensor parallelism splits


def lora_tensor_reduced_bytes(axes: dict, abstract_params: dict, rules_params: Rules, sizes: dict[str, int],
                              sp: bool) -> int:
    """Bytes of the LoRA adapters' gradients a tensor-parallel rank all-reduces over `tensor` (per
    microbatch): the adapter halves whole on every tensor rank (no tensor-split dim) whose gradient
    sums over what the ranks split. Under sequence parallelism every such half (A beside a
    column-parallel linear, B beside a row-parallel one: their inputs are sequence shards); without it
    only the routed experts' (fc1's A, fc2's B: the merged kernel's gradient is split over the expert
    ffn dim). Each as a device holds it outside the data axes (split over `expert`). 0 without adapters."""
    from megajax.models.lora import is_adapter
    shapes = dict(flatten(abstract_params))
    no_data = {**sizes, "data": 1, "fsdp": 1}
    total = 0
    for path, names in flatten(axes):
        keys = tuple(path.split("/"))
        if not is_adapter(keys) or any(n in TENSOR_SPLIT for n in names if n):
            continue
        if sp or keys[-2].startswith("experts_"):
            x = shapes[path]
            total += math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize // shard_factor(names, rules_params, no_data)
    return total


def stage_tensor_reduced_bytes(axes: dict, abstract_params: dict, rules_params: Rules, sizes: dict[str, int]) -> int:
    """Bytes of the stacked layers' parameters whole on every tensor rank (norm scales, a MoE router; not
    the LoRA adapters, lora_tensor_reduced_bytes's) a device holds: inside pipeline stages, under
    sequence parallelism, the backward of each chunk all-reduces their gradients over `tensor`
    (their inputs are sequence shards; megajax/parallel/pipeline.py `_StageLoop.vary`)."""
    from megajax.models.lora import is_adapter
    shapes = dict(flatten(abstract_params))
    no_data = {**sizes, "data": 1, "fsdp": 1}
    total = 0
    for path, names in flatten(axes):
        if "layers" not in names or is_adapter(tuple(path.split("/"))) or \
                "tensor" in spec_axes(logical_to_spec(names, rules_params)):
            continue
        x = shapes[path]
        total += math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize // shard_factor(names, rules_params, no_data)
    return total


def _lora_linears(m) -> tuple[float, float]:
    """(column-parallel, row-parallel) linears with a LoRA adapter per layer, averaged over the layers
    (a hybrid's over its pattern; a MoE layer's MLP adapters are its shared expert's)."""
    targets = set(m.lora.target_names())
    column = ({"qkv", "fc1", "q_proj", "q_up_proj", "kv_up_proj", "in_proj"}) & targets
    row = {"proj", "fc2", "out_proj"} & targets
    if m.hybrid_layer_pattern:
        pattern = m.hybrid_pattern()
        per = {"M": ("in_proj", "out_proj"), "*": ("qkv", "proj"), "-": ("fc1", "fc2"),
               "E": ("fc1", "fc2") if m.moe_shared_expert_ffn_size else ()}
        col = sum(sum(t in column for t in per[k]) for k in pattern) / len(pattern)
        rw = sum(sum(t in row for t in per[k]) for k in pattern) / len(pattern)
        return col, rw
    mlp = 1.0 - (m.num_moe_layers() / m.num_layers if m.num_experts and not m.moe_shared_expert_ffn_size else 0.0)
    attention_col = len(column - {"fc1"})
    return attention_col + mlp * ("fc1" in column), ("proj" in row) + mlp * ("fc2" in row)


def _communication(plan: RunPlan, local_param_bytes: int, expert_param_bytes: int,
                   stage_shared_param_bytes: int, platform: str,
                   lora_reduced_bytes: int = 0, stage_gathered_param_bytes: int = 0,
                   stage_scattered_param_bytes: int = 0, stage_tensor_reduced_bytes: int = 0,
                   ) -> dict[tuple[str, str], float]:
    cfg, sizes = plan.cfg, plan.sizes
    m = cfg.model
    t, cp = sizes["tensor"], sizes["context"]
    act = 4 if platform == "cpu" else precision_policy(cfg).activation_bytes
    tokens = plan.batch.micro_batch * plan.batch.seq_len / cp  # a device's tokens of a microbatch
    bsh = tokens * m.hidden_size * act
    sp = cfg.parallel.sequence_parallel and t > 1
    n = _passes(plan)
    out: dict[tuple[str, str], float] = defaultdict(float)  # (kind, axis) -> bytes
    pipe = plan.pipeline
    if pipe is not None:  # each tick sends an activation forward and a cotangent back
        out["collective-permute", "pipeline"] += 2 * n["ticks"] * bsh / (t if sp else 1)
        # The embedding's and output layer's gradients reduce-scattered onto the stages' shares, the
        # others' all-reduced; what is kept split between steps gathered (the ends, an encoder).
        out["all-reduce", "pipeline"] += stage_shared_param_bytes - stage_scattered_param_bytes
        out["reduce-scatter", "pipeline"] += stage_scattered_param_bytes
        out["all-gather", "pipeline"] += stage_gathered_param_bytes
        if pipe.virtual_stages > 1:  # the layers into the stages' chunk order (in their own dtype) and
            # their gradients (fp32) back
            moved = 1.0 if platform == "cpu" else precision_policy(cfg).param_dtype.itemsize / 4
            out["collective-permute", "pipeline"] += (1 + moved) * (local_param_bytes - stage_shared_param_bytes)
    if t > 1:
        # Per layer 2 products reduce forward and 2 backward (Megatron's f/g); full recompute reruns
        # those of a layer's forward the backward needs (not the one after the MLP: 1 all-reduce, or
        # 2 all-gathers and 1 reduce-scatter); the embedding (forward) and the output layer (its
        # input's gradient) once per microbatch; a shared expert adds one forward and one backward.
        # A hybrid's layer is one mixer: one product reduces forward and one backward; full recompute
        # reruns a group of layers (model.hybrid_group()), all but its last layer's reduction needed.
        shared = n["moe_fwd"] + n["moe_bwd"] if m.num_experts and m.moe_shared_expert_ffn_size else 0
        r = 1 if m.hybrid_layer_pattern else 2
        rerun = (1 - 1 / len(m.hybrid_group())) if m.hybrid_layer_pattern else 1
        if sp:
            out["all-gather", "tensor"] += (r * n["fwd"] + r * n["bwd"] + r * n["extra"] + 2 * n["micro"]) * bsh
            out["reduce-scatter", "tensor"] += (r * n["fwd"] + r * n["bwd"] + rerun * n["extra"] + 2 * n["micro"]
                                                + shared) * bsh
        else:
            out["all-reduce", "tensor"] += (r * n["fwd"] + r * n["bwd"] + rerun * n["extra"] + 2 * n["micro"]
                                            + shared) * bsh
        out["all-reduce", "tensor"] += n["micro"] * 3 * tokens * 4  # vocabulary-parallel cross-entropy
        if pipe is not None and sp:  # each tick's backward: its chunk's tensor-replicated weights' gradients
            out["all-reduce", "tensor"] += n["ticks"] * stage_tensor_reduced_bytes / pipe.virtual_stages
        if m.lora is not None:
            # Per adapted linear and layer pass one [tokens, rank] activation crosses the tensor ranks
            # (models/lora.py): beside a row-parallel linear the row product's reduction forward (and
            # the gather of its gradient backward under SP), beside a column-parallel one the column
            # product's gather forward under SP and the reduction of h's gradient backward. The
            # tensor-whole adapter halves' gradients are all-reduced per microbatch. The frozen output
            # layer needs no gathered input for a weight gradient: one gather fewer under SP.
            col, row = _lora_linears(m)
            rb = tokens * m.lora.rank * act
            fwd = n["fwd"] + n["extra"]
            if sp:
                out["all-gather", "tensor"] += (col * fwd + row * n["bwd"]) * rb - n["micro"] * bsh
                out["reduce-scatter", "tensor"] += (row * fwd + col * n["bwd"]) * rb
            else:
                out["all-reduce", "tensor"] += (row * fwd + col * n["bwd"]) * rb
            out["all-reduce", "tensor"] += n["micro"] * lora_reduced_bytes
    if cp > 1:  # attention over the sequence's chunks: k and v (kv heads of this tensor rank)
        # k and v together (multi-latent attention: k of N + P dims, v of V, or padded to N + P for the
        # fused kernels)
        if m.multi_latent_attention:
            k_dim = m.qk_head_dim + m.qk_pos_emb_head_dim
            widths = k_dim + (m.v_head_dim if m.attention_impl == "xla" else k_dim)
        else:
            widths = 2 * m.head_dim
        kv = tokens * (m.num_kv_heads / t) * widths * act
        if m.hybrid_layer_pattern:  # only its attention layers; its Mamba layers: mamba_context_bytes
            kv *= m.attention_layers() / m.num_layers
            for kind, volume in mamba_context_bytes(m, tokens, t, cp, act, n).items():
                out[kind, "context"] += volume
        kv32 = kv * 4 / act  # their gradients accumulate in fp32
        fwd = n["fwd"] + n["extra"]
        if cfg.parallel.context_impl == "ring":  # cp - 1 hops forward; backward cp hops with dk, dv
            out["collective-permute", "context"] += fwd * (cp - 1) * kv + n["bwd"] * ((cp - 1) * (kv + kv32) + kv32)
        else:  # all-gather k and v, reduce-scatter their gradients
            out["all-gather", "context"] += fwd * cp * kv
            out["reduce-scatter", "context"] += n["bwd"] * cp * kv
        # Multi-token prediction's shifts along the sequence: per depth its tokens and positions (the
        # model), labels and loss mask (the loss), each [batch, sequence] of 4 bytes gathered whole.
        out["all-gather", "context"] += n["micro"] * 4 * m.mtp_num_layers * cp * tokens * 4
    # The experts' group: `expert`, or with MoE parallel folding expert x context x tensor, where a
    # device dispatches its own 1 / tensor of the tokens (no tensor collectives in the MoE layer under
    # sequence parallelism: its input is not gathered, its output not reduce-scattered).
    ep = math.prod(sizes.get(a, 1) for a in plan.rules.activations["experts"]) if m.num_experts else 1
    folded = bool(m.num_experts) and expert_tensor_folded(cfg) and t > 1
    if folded:
        tokens = tokens / t
        if sp:
            out["all-gather", "tensor"] -= (n["moe_fwd"] + n["moe_bwd"] + n["moe_extra"]) * bsh
            out["reduce-scatter", "tensor"] -= (n["moe_fwd"] + n["moe_bwd"]) * bsh
    if m.num_experts and ep > 1 and moe_token_dispatcher(cfg, platform) == "allgather":
        # The expert group's tokens, routes (int32) and weights (fp32) gathered forward, the fp32
        # partial outputs reduce-scattered; backward the output's gradient gathered, the tokens' and
        # weights' gradients reduce-scattered.
        rows, k = ep * tokens, m.moe_router_topk
        fwd, bwd = n["moe_fwd"] + n["moe_extra"], n["moe_bwd"]
        out["all-gather", "expert"] += fwd * rows * (m.hidden_size * act + 8 * k) + bwd * rows * m.hidden_size * 4
        out["reduce-scatter", "expert"] += fwd * rows * m.hidden_size * 4 + bwd * rows * (m.hidden_size * act + 4 * k)
    elif m.num_experts and ep > 1:
        # Each MoE layer sends its (sequence-gathered) tokens x top-k rows to the experts' devices and
        # back, forward and backward, in fixed buffers of one slot per device (dropless: room for every
        # assignment; capacity: each device's experts' capacity).
        rows = (tokens * m.moe_router_topk if m.moe_expert_capacity_factor is None else
                ep * math.ceil(tokens * m.moe_router_topk / m.num_experts * m.moe_expert_capacity_factor)
                * m.num_experts / ep)
        # (parallel.moe_all_to_all=ragged: only the assignments' own rows move, each once)
        padded = m.moe_expert_capacity_factor is None and cfg.parallel.moe_all_to_all == "padded"
        buffer = (ep if padded else 1) * rows * m.hidden_size * act
        out["all-to-all", "expert"] += 2 * (n["moe_fwd"] + n["moe_bwd"] + n["moe_extra"]) * buffer
    # Data-parallel reductions: once per step (after the accumulation or the stage loop), or per
    # microbatch where the model runs on the whole batch (MoE, dropout: megajax/train/step.py); of
    # the reduce-scattered ends' gradients a device reduces its stage's share.
    reduced = local_param_bytes - stage_scattered_param_bytes * (1 - 1 / sizes["pipeline"])
    m_dropout = m.hidden_dropout > 0 or m.attention_dropout > 0
    reductions = plan.batch.accumulation if (m.num_experts or m_dropout) and pipe is None else 1
    fsdp, data = sizes["fsdp"], sizes["data"]
    # The other parameters' gradients are reduced over `expert` too (after the stage loop, in the
    # same reduction as over the data axes when there is one).
    if m.num_experts and ep > 1 and data * (1 if pipe is None else cp) == 1:
        out["all-reduce", "expert"] += reductions * (reduced - expert_param_bytes)
    shard = reduced * reductions
    # The parameters are gathered in their own dtype (precision.param_dtype; local_param_bytes counts
    # fp32), the gradients reduced in fp32; on CPU XLA gathers 16-bit values as fp32.
    gathered = 1.0 if platform == "cpu" else precision_policy(cfg).param_dtype.itemsize / 4
    if fsdp > 1:  # ZeRO-3: gather the parameters, reduce-scatter the gradients
        out["all-gather", "fsdp"] += shard * gathered
        out["reduce-scatter", "fsdp"] += shard
        shard = shard / fsdp
    if cp > 1 and pipe is None:  # gradients reduced over `context` per microbatch (a separate all-reduce)
        out["all-reduce", "context"] += shard / reductions * plan.batch.accumulation
    if data > 1 or (cp > 1 and pipe is not None):
        if cfg.parallel.distributed_optimizer:  # ZeRO-1: reduce-scatter gradients, all-gather updated params
            out["reduce-scatter", "data"] += shard
            out["all-gather", "data"] += shard * gathered
        else:
            out["all-reduce", "data"] += shard
    return dict(out)


def mamba_context_bytes(m, tokens: float, t: int, cp: int, act: int, n: dict) -> dict[str, float]:
    """A hybrid's Mamba layers under context parallelism, per step: the all-to-alls of x and dt to head
    shards and of y (fp32) back, forward and the same backward; B and C all-gathered over the context
    forward and their gradients reduce-scattered backward (each device's share of its tensor shard)."""
    layers = m.mamba_layers() / m.num_layers
    d, g = m.mamba_inner_size() / t, m.mamba_num_groups * m.mamba_state_dim / t
    fwd, bwd = (n["fwd"] + n["extra"]) * layers, n["bwd"] * layers
    a2a = tokens * ((d + m.mamba_num_heads / t) * act + d * 4)  # whole buffers, as the HLO counts them
    return {"all-to-all": (fwd + bwd) * a2a, "all-gather": fwd * cp * tokens * 2 * g * act,
            "reduce-scatter": bwd * cp * tokens * 2 * g * 4}


def tensor_shard_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                             sizes: dict[str, int]) -> int:
    """Bytes of the gradient a device reduces over the data axes: its tensor-parallel shard (the
    parameters outside the stacked layers whole over `pipeline`: the stage loop returns their
    gradients whole, a vision-language model's encoder included)."""
    return _shard_bytes(axes, abstract_params, rules_params, sizes, lambda names: True)


def stage_shared_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                             sizes: dict[str, int]) -> int:
    """The part of tensor_shard_param_bytes outside the stacked layers (embedding, final norm,
    output layer): what every pipeline stage holds during the step, and whose gradient the stages
    all-reduce (a vision-language model's encoder whole: it is kept split over `pipeline` between
    steps, megajax.mesh.encoder_storage_axes, and gathered for the step)."""
    return _shard_bytes(axes, abstract_params, rules_params, sizes, lambda names: "layers" not in names)


def stage_gathered_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                               sizes: dict[str, int]) -> int:
    """The part of stage_shared_param_bytes kept split over `pipeline` between steps (a vision-language
    model's encoder and projector): gathered whole onto every stage once per step."""
    def kept_split(names):
        return "layers" not in names and "pipeline" in spec_axes(logical_to_spec(names, rules_params))
    return _shard_bytes(axes, abstract_params, rules_params, sizes, kept_split) if sizes.get("pipeline", 1) > 1 else 0


def stage_scattered_param_bytes(axes: dict, abstract_params: dict, rules_params: Rules,
                                sizes: dict[str, int]) -> int:
    """The part of stage_gathered_param_bytes whose gradient the stages reduce-scatter onto their shares
    (the embedding and output layer: a vocabulary dim kept split over `pipeline`,
    megajax.mesh.vocab_storage_axes); the data-parallel reduction then reduces 1 / stages of it."""
    if sizes.get("pipeline", 1) == 1 or "pipeline" not in rules_params["vocab"]:
        return 0
    return _shard_bytes(axes, abstract_params, rules_params, sizes, lambda names: "vocab" in names)


def _shard_bytes(axes: dict, abstract_params: dict, rules_params: Rules, sizes: dict[str, int], keep) -> int:
    """Bytes of a device's shard outside the data axes of the parameters whose logical dims `keep`
    accepts, those outside the stacked layers whole over `pipeline`."""
    no_data = {**sizes, "data": 1, "fsdp": 1}
    shapes = dict(flatten(abstract_params))
    total = 0
    for name, names in flatten(axes):
        if keep(names):
            split = no_data if "layers" in names else {**no_data, "pipeline": 1}
            x = shapes[name]
            total += math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize // shard_factor(names, rules_params, split)
    return total


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
    est = {**state_bytes(spec.axes, spec.abstract_params, rules.params, rules.opt_state, plan.sizes,
                         frozen_in_state(plan.cfg.model), precision_policy(plan.cfg)),
           "activations": activation_bytes(plan) + vision_activation_bytes(plan),
           "logits": logits_bytes(plan)}
    if getattr(spec, "frozen_axes", None) is not None:  # model.lora: the frozen base, no gradient, no Adam state
        est["params"] += state_bytes(spec.frozen_axes, spec.abstract_frozen, rules.params, rules.opt_state,
                                     plan.sizes)["params"]
    est["total"] = sum(est.values())
    return est


# ---- Memory-bound work and fixed costs, for the step-time estimate (megajax/perf/planner.py) ----

ADAM_BYTES_PER_PARAM_BYTE = 7 / 2  # per byte of Adam state (two fp32 moments): read p, g, m, v, write p, m, v


def _layer_passes(plan: RunPlan) -> tuple[float, float, float]:
    """(layer forward passes, backward passes, microbatches) a device does useful work on in a step:
    its layers (layers / pipeline stages) per microbatch; the forward again where it is recomputed
    (recompute=full, with or without a pipeline); the output layer and loss once per microbatch (a pipeline's last stage, spread over the
    stages). A pipeline's bubble is the caller's (the schedule's idle halves)."""
    m, pipe = plan.cfg.model, plan.pipeline
    stages = plan.sizes["pipeline"]
    micro = pipe.microbatches if pipe is not None else plan.batch.accumulation
    layers = micro * m.num_layers / stages
    recompute = plan.cfg.parallel.recompute == "full"
    return layers * (2 if recompute else 1), layers, micro / stages


def elementwise_bytes(plan: RunPlan, platform: str = "gpu") -> float:
    """Bytes a device's memory-bound (element-wise) work reads and writes in a step: per token of a layer
    forward, its two norms (read, write: 4 h) and two residual adds (6 h), split over tensor only
    under sequence parallelism; rotary embedding of q and k (read, write); the attention's softmax
    over the scores where they are materialised (attention_impl xla: 4 passes over heads x the
    sequence); the MLP's activation (gated: read gate and up, write: 3 f; else 2 f), a MoE layer's
    over its top-k experts' rows plus the dispatch's copies of h in and out and the router's softmax;
    each split over tensor. The backward reads and writes twice what the forward does. Per
    microbatch the loss's softmax over the logits (3 passes forward, 3 backward, the vocabulary split
    over tensor). At the compute dtype's bytes (fp32 on CPU); plus FP8's casts (fp8_cast_bytes)."""
    cfg, sizes = plan.cfg, plan.sizes
    m, t = cfg.model, sizes["tensor"]
    sp = cfg.parallel.sequence_parallel and t > 1
    tokens = plan.batch.micro_batch * plan.batch.seq_len / sizes["context"]
    h = m.hidden_size
    rep = h / (t if sp else 1)
    qk = (m.num_heads + m.num_kv_heads) * m.head_dim / t
    scores = 4 * m.num_heads / t * plan.batch.seq_len if m.attention_impl == "xla" else 0.0
    gated = 3 if m.activation == "swiglu" else 2
    dense = 10 * rep + 2 * qk + scores + gated * m.ffn_hidden_size / t
    layer = dense
    if m.num_experts:
        k = m.moe_router_topk
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        etp = 1 if expert_tensor_folded(cfg) else t
        moe = (10 * rep + 2 * qk + scores + gated * k * moe_ffn / etp + 4 * k * h + 3 * m.num_experts
               + gated * m.moe_shared_expert_ffn_size / t)
        share = m.num_moe_layers() / m.num_layers
        layer = (1 - share) * dense + share * moe
    fwd, bwd, micro = _layer_passes(plan)
    logits = 6 * plan.padded_vocab / t * (1 + m.mtp_num_layers)
    act = 4 if platform == "cpu" else precision_policy(cfg).activation_bytes
    return tokens * act * ((fwd + 2 * bwd) * layer + micro * logits) + fp8_cast_bytes(plan, platform)


def fp8_cast_bytes(plan: RunPlan, platform: str = "gpu") -> float:
    """Bytes FP8's casts read and write in a step (0 without FP8, and on CPU): per FP8 product and
    token, the input's amax and cast (read 16 bits, write 8), the output gradient's the same backward,
    and the transposed FP8 copies of both the kernel's gradient takes (Hopper's FP8 products want both
    operands K-major): 5 (K + N) bytes; per kernel its cast and transposed copy, 5 bytes per weight,
    once per step (the same for every microbatch). The layers' linear products (q, k, v, o, the MLP's;
    a MoE layer's experts over their top-k rows), split over tensor."""
    cfg, sizes = plan.cfg, plan.sizes
    if cfg.train.precision != "fp8" or platform == "cpu":
        return 0.0
    m, t = cfg.model, sizes["tensor"]
    h, f = m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    up = (2 if m.activation == "swiglu" else 1) * f
    widths = (h + (q + 2 * kv) / t) + (q / t + h) + (h + up / t) + (f / t + h)  # K + N of qkv, o, fc1, fc2
    weights = (h * (q + 2 * kv) + q * h + h * up + f * h) / t
    if m.num_experts:
        k, ef = m.moe_router_topk, m.moe_ffn_hidden_size or f
        eup = (2 if m.activation == "swiglu" else 1) * ef
        share = m.num_moe_layers() / m.num_layers
        widths += share * (k * (2 * h + (eup + ef) / t) - (2 * h + (up + f) / t))
        weights += share * (m.num_experts / sizes["expert"] * (h * eup + ef * h) - (h * up + f * h)) / t
    tokens = plan.batch.micro_batch * plan.batch.seq_len / sizes["context"]
    _, layer_passes, _ = _layer_passes(plan)  # a device's layers x microbatches
    # (the kernels' casts are the same for every microbatch: once per step, hoisted out of the loop)
    return 5.0 * (layer_passes * tokens * widths + m.num_layers / sizes["pipeline"] * weights)


def optimizer_bytes(optimizer_state_bytes: int) -> float:
    """Bytes the optimizer's update reads and writes on a device: per parameter of its Adam state's
    shard (its two fp32 moments: `optimizer_state_bytes`), the parameter, gradient and moments read,
    the parameter and moments written."""
    return ADAM_BYTES_PER_PARAM_BYTE * optimizer_state_bytes


def collective_calls(plan: RunPlan, platform: str = "gpu") -> dict[str, float]:
    """Collective calls per step on a device's critical path, by mesh axis (each pays the kind's
    latency): per layer pass the tensor-parallel reductions (2 forward, 2 backward, with sequence
    parallelism an all-gather and a reduce-scatter each), the embedding's and output layer's, and the
    vocabulary-parallel loss's; the context ring's hops (C - 1 forward of k and v, C backward of k, v
    and their gradients, and the keys' segment ids where documents are masked, each its own transfer;
    the all-gather implementation one gather forward, one reduce-scatter backward); the experts' dispatch (all-to-all:
    2 forward, 2 backward; allgather: 3 gathers and a reduce-scatter forward, a gather and 2
    reduce-scatters backward) per MoE layer pass; a pipeline's 2 transfers per tick. The counts are
    the compiled program's (a pipeline: both halves of every tick, analytic._passes). The data-parallel
    reductions, once per step or microbatch and overlapping the backward, are left out."""
    cfg, sizes = plan.cfg, plan.sizes
    m, t, cp = cfg.model, sizes["tensor"], sizes["context"]
    sp = cfg.parallel.sequence_parallel and t > 1
    n = _passes(plan)
    out: dict[str, float] = defaultdict(float)
    if plan.pipeline is not None:
        out["pipeline"] += 2 * n["ticks"]
    if t > 1:
        r = 1 if m.hybrid_layer_pattern else 2
        per = r * (n["fwd"] + n["bwd"] + n["extra"]) + 2 * n["micro"]
        out["tensor"] += per * (2 if sp else 1) + n["micro"]
    if cp > 1:
        fwd = n["fwd"] + n["extra"]
        if cfg.parallel.context_impl == "ring":  # each array of the hop's tree is its own transfer
            seg = 1 if cfg.data.reset_attention_mask else 0  # the keys' segment ids travel with them
            out["context"] += fwd * (cp - 1) * (2 + seg) + n["bwd"] * cp * (4 + seg)
        else:
            out["context"] += fwd + n["bwd"]
    ep = math.prod(sizes.get(a, 1) for a in plan.rules.activations["experts"]) if m.num_experts else 1
    if m.num_experts and ep > 1:
        fwd, bwd = n["moe_fwd"] + n["moe_extra"], n["moe_bwd"]
        if moe_token_dispatcher(cfg, platform) == "allgather":
            out["expert"] += 4 * fwd + 3 * bwd
        else:
            out["expert"] += 2 * fwd + 2 * bwd
    return dict(out)


def pipeline_lockstep(plan: RunPlan) -> bool:
    """Whether a pipeline's chunks hold collectives (tensor, context, the experts'), so that every
    device runs every half some stage runs at a tick, on zeros where it has no work of its own
    (megajax/train/pipeline_step.py)."""
    if plan.pipeline is None:
        return False
    acts = plan.rules.activations
    return bool(plan.cfg.model.num_experts) or any(plan.sizes[a] > 1 for a in (*acts["heads"], *acts["length"]))
