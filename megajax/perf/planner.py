"""`megajax plan`: a mesh for a cluster, chosen by estimate instead of by hand.

    megajax plan --config model/llama3-70b --cluster 32xH100 train.global_batch=256 --output mesh.yaml

Every layout of the cluster's devices is enumerated: tensor parallelism inside a
node (with sequence parallelism), context, expert (MoE models), pipeline (1F1B,
or interleaved with 2 or 4 chunks per stage), and the rest of the devices as
data parallelism (plain, with the distributed optimizer, FSDP, or FSDP inside
data parallelism); for each, every recompute policy and micro batch (those a
command line sets, KEEPABLE, are kept). Each is planned exactly as `megajax
train` would plan it (megajax/plan.py: a layout the run would refuse is never
offered) and estimated:

- memory per device: the analytic model (megajax/perf/analytic.py, the figure
  `megajax bench` prints beside XLA's compiled one), against the device's
  memory less `HEADROOM` (allocator fragmentation, workspaces, the runtime);
- step time: the model FLOPs of a step (megajax/train/flops.py) plus what
  recompute adds (parallel.recompute; a pipeline adds none of its own): each
  product at its shape's share of the peak in the kind's matmul table (the
  published ones of megajax/perf/matmul_tables.py, or `megajax bench
  --gemm-table`'s: megajax/perf/gemm.py; under FP8 the layers' products at the
  FP8 peak and the ratio of the kinds' matmul ceilings), attention's fused
  kernel and what no table lists at `efficiency` of the (16-bit) peak (without
  a table, everything at `efficiency`); plus the memory-bound work, the bytes
  the element-wise ops read and write (analytic.elementwise_bytes: norms,
  residual adds, rotary embedding, softmax, the MLP's activation, the loss,
  FP8's casts) over the kind's memory bandwidth (`memory_gbps` x
  `memory_efficiency`), all stretched by the pipeline bubble of the plan's own
  schedule (a vision-language model's encoder runs on the first stage, which
  then sets the pace; devices sharing a host lose no time to it unless the
  stages run in lockstep, when idle stages compute on zeros); plus the
  optimizer's update (7 fp32 reads and writes per parameter of the device's
  shard of the Adam state, at the memory bandwidth, or at `optimizer_gbps`
  where `megajax bench --gemm-table` measured the update's own); plus fixed
  costs: each collective call's latency (`collective_latency_us` for a node's
  devices, times a ring's (n - 1)/(node - 1); analytic.collective_calls) and
  each pipeline tick's (`tick_overhead_us`); plus each axis's collectives (the
  analytic bytes `megajax bench` checks against the compiled HLO, split by
  axis) over that axis's links (`transfer_seconds`): NVLink (or the vendor's
  equivalent, or the measured bus bandwidth `collective_gbps`) inside a node,
  and across nodes hierarchically, each device's 1/ici share over its own
  network port. A ring all-reduce moves 2(n-1)/n of its buffer per device, an
  all-gather, reduce-scatter or all-to-all (n-1)/n, a collective-permute all of
  it. The data-parallel reductions (data, FSDP, and the gradients' reductions
  over expert and context) overlap the backward pass where the step reduces as
  its one microbatch's backward produces the gradients (or per microbatch:
  MoE, dropout; Megatron's --overlap-grad-reduce / --overlap-param-gather;
  XLA's asynchronous collectives): only what exceeds the backward's compute
  time counts (all of it on devices that share a host's cores, `shared_host`,
  whose collectives are copies and sums done by the cores that compute);
  gradients accumulated over several microbatches or returned by a pipeline's
  loop are reduced after it and count whole. With parallel.tp_comm_overlap the
  kind's `tp_overlap` share of the sequence-parallel gathers and scatters runs
  beside the products (collective matmuls, megajax/parallel/tensor.py); the
  rest of the tensor, context, expert and pipeline transfers sit on the
  critical path and count whole.

The layouts that fit are ranked by estimated step time (then by memory); the
top few are printed with the parts of their time, and `--output FILE.yaml`
writes the best as a mesh config (the form of configs/mesh/*.yaml: `mesh:`
with `dcn:` for the inter-node factors, and the `parallel:` and `train:` keys
the layout sets). For each parallelism the best does not use, the report names
the fastest fitting layout that does and where its time goes: why that axis
was not chosen (e.g. expert parallelism for a mixture of experts whose experts
FSDP gathers within the backward's time). The device table below is extended or overridden with
`--device-kinds FILE.yaml` (a mapping of kind name to the same fields).
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from megajax.config import MESH_AXES, Config
from megajax.errors import ConfigError, MeshError, UserError
from megajax.mesh import data_parallel_size
from megajax.models.trainable import frozen_in_state
from megajax.perf import analytic, gemm
from megajax.perf.device_kinds import DEVICE_KINDS, DeviceKind, load_device_kinds, parse_cluster  # noqa: F401
from megajax.plan import RunPlan, make_plan, plan_layout
from megajax.train.flops import train_flops_per_token, vision_flops_per_token

GIB = 2**30
HEADROOM = 0.9  # the share of a device's memory a plan may fill
_DATA_PARALLEL = ("data", "fsdp")  # axes whose reductions overlap the backward
_PLACEMENT = ("tensor", "context", "expert", "fsdp", "data", "pipeline")  # innermost (inside a node) first


@dataclass
class Candidate:
    """One layout with its estimate."""
    sizes: dict[str, int]
    ici: dict[str, int]
    dcn: dict[str, int]
    parallel: dict[str, Any]
    micro_batch: int
    memory: dict[str, int]
    fits: bool
    step_seconds: float = math.inf
    parts: dict[str, float] = field(default_factory=dict)
    mfu: float = 0.0
    bubble: float = 0.0

    def label(self) -> str:
        axes = [f"{a} {self.sizes[a]}" for a in ("tensor", "context", "expert", "pipeline", "fsdp", "data")
                if self.sizes[a] > 1]
        extra = []
        if self.parallel.get("virtual_stages", 1) > 1:
            extra.append(f"{self.parallel['virtual_stages']} chunks/stage")
        if self.parallel.get("distributed_optimizer"):
            extra.append("distributed optimizer")
        extra.append(f"recompute {self.parallel['recompute']}")
        extra.append(f"micro batch {self.micro_batch}")
        return " x ".join(axes or ["1 device"]) + "; " + ", ".join(extra)


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending (in about sqrt(n) steps: a cluster may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _place(sizes: dict[str, int], node: int) -> tuple[dict[str, int], dict[str, int]] | None:
    """Per-node (ici) and inter-node (dcn) factors: tensor innermost, then context, expert, fsdp,
    data, pipeline outermost, each filling what is left of a node."""
    ici, dcn, left = {}, {}, node
    for a in _PLACEMENT:
        ici[a] = math.gcd(sizes[a], left)
        dcn[a] = sizes[a] // ici[a]
        left //= ici[a]
    if left != 1:
        return None
    return {a: ici[a] for a in MESH_AXES}, {a: dcn[a] for a in MESH_AXES}


def pinned_axes(cfg: Config) -> dict[str, int]:
    """Mesh sizes the config sets (other than 1, or data's -1): the plan keeps them, so
    `mesh.tensor=8 mesh.pipeline=4` estimates that layout family against the free choice."""
    pins = {a: getattr(cfg.mesh, a) * getattr(cfg.mesh.dcn, a) for a in MESH_AXES
            if getattr(cfg.mesh, a) not in (1, -1) or getattr(cfg.mesh.dcn, a) != 1}
    return pins


# Keys a command line may set that the plan then keeps instead of choosing (`megajax plan ...
# parallel.recompute=none` estimates only that policy); set in a config file they are one more choice.
KEEPABLE = ("train.micro_batch", "parallel.recompute", "parallel.distributed_optimizer",
            "parallel.virtual_stages", "parallel.pipeline_schedule", "parallel.sequence_parallel",
            "parallel.moe_all_to_all")


def kept_keys(overrides) -> tuple[str, ...]:
    """The KEEPABLE keys among `key=value` overrides, in KEEPABLE's order."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    return tuple(k for k in KEEPABLE if k in given)


def _layouts(cfg: Config, devices: int, node: int, keep: tuple[str, ...] = (), ragged: bool = False):
    """(sizes, parallel keys) of every layout worth estimating (those with the pinned sizes and the kept
    keys). A pinned pipeline or virtual stage count is planned even where it does not divide the layers:
    the run's own check then says why it is refused. `ragged`: a dropless MoE's expert exchange moves
    its rows only (parallel.moe_all_to_all=ragged: devices that have ragged_all_to_all)."""
    m, par = cfg.model, cfg.parallel
    exchange = {}
    if ragged and m.num_experts and m.moe_expert_capacity_factor is None and "parallel.moe_all_to_all" not in keep \
            and par.moe_token_dispatcher != "allgather":
        exchange = {"moe_all_to_all": "ragged"}
    pins = pinned_axes(cfg)
    seq = cfg.train.seq_len
    for t in _divisors(min(node, devices)):
        for c in (d for d in _divisors(devices // t) if d == 1 or (seq // d >= 1024 and seq % (2 * d) == 0)):
            experts = [e for e in _divisors(devices // (t * c)) if m.num_experts and m.num_experts % e == 0] or [1]
            for e in experts:
                stages = _divisors(devices // (t * c * e))
                for p in (d for d in stages if m.num_layers % d == 0 or pins.get("pipeline") == d):
                    if "parallel.virtual_stages" in keep:
                        chunks = [par.virtual_stages]
                    else:
                        chunks = [1] + [v for v in (2, 4) if p > 1 and m.num_layers % (p * v) == 0]
                    for v in chunks:
                        rest = devices // (t * c * e * p)
                        # plain data parallelism, with the distributed optimizer, FSDP, and FSDP inside
                        # data parallelism (hybrid sharding), with and without the distributed optimizer
                        splits = [(rest // f, f) for f in _divisors(rest)]
                        dps = [(d, f, o) for d, f in splits for o in ((False, True) if d > 1 else (False,))]
                        if "parallel.distributed_optimizer" in keep:
                            dps = [(d, f, o) for d, f, o in dps if o == par.distributed_optimizer or d == 1]
                        for data, fsdp, dist_opt in dps:
                            sizes = {"pipeline": p, "data": data, "fsdp": fsdp, "expert": e, "context": c, "tensor": t}
                            if any(sizes[a] != n for a, n in pins.items()):
                                continue
                            schedule = ("interleaved" if v > 1 else "1f1b")
                            if "parallel.pipeline_schedule" in keep:
                                schedule = par.pipeline_schedule
                            sp = par.sequence_parallel if "parallel.sequence_parallel" in keep else t > 1
                            yield sizes, {"sequence_parallel": sp, "distributed_optimizer": dist_opt,
                                          "pipeline_schedule": schedule, "virtual_stages": v, **exchange}


def _candidate_config(base: Config, ici, dcn, parallel: dict, recompute: str, micro: int) -> Config:
    cfg = copy.deepcopy(base)
    for a in MESH_AXES:
        setattr(cfg.mesh, a, ici[a])
        setattr(cfg.mesh.dcn, a, dcn[a])
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    cfg.parallel.recompute = recompute
    cfg.train.micro_batch = micro
    return cfg


_ENCODER = "encoder on stage 0"  # the part of a pipelined vision-language step its first stage adds


def _step_time(plan: RunPlan, spec, kind: DeviceKind, devices: int) -> tuple[float, dict[str, float], float, float]:
    """(step seconds, seconds by part, MFU, pipeline bubble) of a plan on `kind`."""
    cfg, sizes, m = plan.cfg, plan.sizes, plan.cfg.model
    precision = cfg.train.precision
    peak = kind.peak_tflops.get(precision) or kind.peak_tflops.get("bf16")
    # What FP8 leaves in 16 bits (attention's own products, the routers) runs at the 16-bit peak.
    peak16 = kind.peak_tflops.get(gemm.product_precisions(cfg)[0]) or kind.peak_tflops["bf16"]
    tokens = plan.batch.global_batch * plan.batch.seq_len
    per_token = train_flops_per_token(m, plan.batch.seq_len, plan.padded_vocab)
    attention = 6 * m.num_layers * plan.batch.seq_len * m.num_heads * m.head_dim
    layers = per_token - attention  # (with the output layer: a slight overcount of what recompute redoes)
    # (A pipeline's backward half runs the VJP its forward half took: it recomputes what the policy says.)
    policy = cfg.parallel.recompute
    extra_layers = layers / 3 if policy == "full" else 0.0
    extra_attention = attention / 3 if policy in ("selective", "full") else 0.0
    flops = tokens * per_token / devices
    compute = (tokens * (layers + extra_layers) / devices / (peak * 1e12 * kind.efficiency)
               + tokens * (attention + extra_attention) / devices / (peak16 * 1e12 * kind.efficiency))
    if kind.gemm_efficiency:  # each product at its shape's measured share; the rest at `efficiency`
        # (the experts' rows padded to whole tiles where the kind tiles them: their padding's time too)
        gemms = gemm.step_gemms(plan, spec)
        product_flops = sum(2.0 * g["m"] * g["k"] * g["n"] * g["count"] for g in gemms)
        products, _ = gemm.gemm_seconds(gemm.step_gemms(plan, spec, kind.grouped_gemm_tile)
                                        if kind.grouped_gemm_tile else gemms, kind)
        rest = max(0.0, tokens * (per_token + extra_layers + extra_attention) / devices - product_flops)
        compute = products + rest / (peak16 * 1e12 * kind.efficiency)
    platform = "cpu" if kind.shared_host else "gpu"
    rules = plan.rules
    # Memory-bound work: the element-wise ops on the activations, at the kind's memory bandwidth.
    bandwidth = kind.memory_gbps * 1e9 * kind.memory_efficiency
    memory = analytic.elementwise_bytes(plan, platform) / bandwidth
    compute += memory
    bubble, encoder = 0.0, 0.0
    if plan.pipeline is not None:
        c = plan.pipeline
        bubble = _bubble(c.schedule, c.stages, c.microbatches, c.virtual_stages)
        # A vision-language model's encoder and projector run on the first stage only: that stage's
        # devices do all of their work (the even split above gave them 1/stages of it), and the
        # slowest stage sets the pace of every microbatch.
        vision = vision_flops_per_token(m, plan.batch.seq_len)
        encoder = tokens * vision * (c.stages - 1) / devices / (peak * 1e12 * kind.efficiency)
    # Devices that share a host's cores (simulated CPU devices) lend an idle device's cores to the others,
    # unless the stages run in lockstep (collectives inside the chunks): then every device computes every
    # tick's halves, an idle stage on zeros.
    lost = bubble if not kind.shared_host or analytic.pipeline_lockstep(plan) else 0.0
    busy = (compute + encoder) / (1 - lost)
    # The optimizer's update of the device's shard of the Adam state, after the step's gradients.
    opt_state = analytic.state_bytes(spec.axes, spec.abstract_params, rules.params, rules.opt_state, sizes,
                                     frozen_in_state(m))["optimizer"]
    # (it streams the parameters, gradients and moments through main memory: at `optimizer_gbps` where measured)
    optimizer = analytic.optimizer_bytes(opt_state) / (kind.optimizer_gbps * 1e9 or bandwidth)
    local = analytic.tensor_shard_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    experts = analytic.expert_shard_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    shared = (analytic.stage_shared_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
              if plan.pipeline is not None else 0)
    parts = {"compute": compute - memory, "memory-bound": memory, "bubble": busy - compute - encoder,
             "optimizer": optimizer}
    if encoder:
        parts[_ENCODER] = encoder
    overlapped = ringed = 0.0
    hides_reductions = not kind.shared_host and _reductions_overlap_backward(plan)
    gathered = analytic.stage_gathered_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    scattered = analytic.stage_scattered_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    replicated = analytic.stage_tensor_reduced_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    for (kind_name, axis), nbytes in analytic.communication_by_axis(
            plan, local, experts, shared, platform, stage_gathered_param_bytes=gathered,
            stage_scattered_param_bytes=scattered, stage_tensor_reduced_bytes=replicated).items():
        n = sizes[axis]
        if n <= 1 or nbytes <= 0:
            continue
        seconds = transfer_seconds(kind, kind_name, nbytes, plan.ici[axis], plan.dcn[axis])
        # The data-parallel reductions overlap the backward (where the step reduces them as the backward
        # produces them), except on devices that share a host's cores: there a collective's copies and
        # sums are work for the cores that compute.
        if (axis in _DATA_PARALLEL or _is_gradient_reduction(axis, kind_name)) and hides_reductions:
            overlapped += seconds
            parts[f"{axis} (overlapped)"] = parts.get(f"{axis} (overlapped)", 0.0) + seconds
            continue
        if axis == "tensor" and kind_name in ("all-gather", "reduce-scatter"):
            ringed += seconds  # the sequence-parallel products' gathers and scatters
        parts[axis] = parts.get(axis, 0.0) + seconds
    # Collective matmuls (parallel.tp_comm_overlap, sequence parallelism; megajax/parallel/tensor.py)
    # run those transfers beside the partial products: the kind's share of them is hidden, at most the
    # products' own time.
    if cfg.parallel.tp_comm_overlap and cfg.parallel.sequence_parallel and kind.tp_overlap and ringed:
        hidden = min(kind.tp_overlap * ringed, compute - memory)
        parts["tensor"] -= hidden
        parts["tensor (overlapped)"] = hidden
    # Fixed costs: each collective call's latency on its axis (a ring's n - 1 steps: the kind's figure is
    # for a node's devices; a point-to-point transfer's is one call's whatever the group), and the stage
    # loop's ticks.
    node = max(2, min(kind.node_size, devices))
    for axis, calls in analytic.collective_calls(plan, platform).items():
        if sizes[axis] > 1 and calls > 0:
            hops = 1.0 if axis == "pipeline" or (axis == "context" and cfg.parallel.context_impl == "ring") \
                else (sizes[axis] - 1) / (node - 1)
            parts[axis] = parts.get(axis, 0.0) + calls * kind.collective_latency_us * 1e-6 * hops
    if plan.pipeline is not None:
        c = plan.pipeline
        ticks = _ticks(c.schedule, c.stages, c.microbatches, c.virtual_stages)
        parts["pipeline"] = parts.get("pipeline", 0.0) + ticks * kind.tick_overhead_us * 1e-6
    exposed = max(0.0, overlapped - compute * 2 / 3)
    critical = sum(v for k, v in parts.items()
                   if k not in ("compute", "memory-bound", "bubble", _ENCODER) and "overlapped" not in k)
    step = busy + critical + exposed
    return step, parts, flops / (step * peak * 1e12), bubble


def transfer_seconds(kind: DeviceKind, collective: str, nbytes: float, ici: int, dcn: int) -> float:
    """Seconds of one device's collective over an axis of `ici` devices per node x `dcn` nodes, `nbytes`
    its buffer: a ring inside a node moves (n - 1)/n of it per device (an all-reduce twice that) over the
    node's links; across nodes the collective is hierarchical, as NCCL's rings and trees run it: the
    node's part over its links, then each device's 1/ici share across the nodes over its own network
    port (the node's ports side by side). An all-to-all sends the (n - ici)/n of its buffer bound for
    other nodes over the port, the rest over the node's links; a collective-permute (a pipeline's
    transfer) all of it, over the network where the axis leaves the node."""
    intra = (kind.collective_gbps or kind.intra_node_gbps * kind.link_efficiency) * 1e9
    inter = kind.inter_node_gbps * kind.link_efficiency * 1e9
    n = ici * dcn
    if collective == "collective-permute":
        return nbytes / (inter if dcn > 1 else intra)
    if collective == "all-to-all":
        return nbytes * (ici - 1) / n / intra + nbytes * (n - ici) / n / inter
    ring = 2.0 if collective == "all-reduce" else 1.0
    return ring * (nbytes * (ici - 1) / ici / intra + nbytes / ici * (dcn - 1) / dcn / inter)


def _reductions_overlap_backward(plan: RunPlan) -> bool:
    """Whether the data-parallel collectives can run beside the backward: where the step reduces the
    gradients as its one microbatch's backward produces them (and FSDP gathers per layer), or once per
    microbatch (MoE, dropout: megajax/train/step.py). Gradients accumulated over several microbatches
    unreduced, or returned by a pipeline's stage loop, are reduced after the loop (FSDP's parameters
    gathered before it): nothing is left to compute beside those transfers."""
    m = plan.cfg.model
    if plan.pipeline is not None:
        return False
    return plan.batch.accumulation == 1 or bool(m.num_experts) or m.uses_dropout()


@functools.lru_cache(maxsize=None)
def _bubble(schedule: str, stages: int, microbatches: int, virtual: int) -> float:
    """The schedule's bubble, built once per shape (every recompute policy of a layout shares it)."""
    return analytic.schedule_of(schedule, stages, microbatches, virtual).bubble_fraction


@functools.lru_cache(maxsize=None)
def _ticks(schedule: str, stages: int, microbatches: int, virtual: int) -> int:
    return analytic.schedule_of(schedule, stages, microbatches, virtual).ticks


def _is_gradient_reduction(axis: str, kind_name: str) -> bool:
    """The all-reduces over expert (the other parameters' gradients) and context (the gradients,
    without a pipeline) are data-parallel reductions; context's other transfers are attention's."""
    return kind_name == "all-reduce" and axis in ("expert", "context")


def estimate(cfg: Config, cluster: str, device_kinds: str | None = None) -> Candidate:
    """One layout's estimate: `cfg`'s own mesh (all of it inside a node) planned on the cluster's
    devices as `megajax train` plans it, timed and sized as plan_cluster times and sizes each candidate."""
    from megajax.train.state import build_model_spec
    kinds = load_device_kinds(device_kinds)
    devices, _, kind = parse_cluster(cluster, kinds)
    plan = make_plan(cfg, devices)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
    mem = analytic.memory_estimate(plan, spec)
    c = Candidate(sizes=dict(plan.sizes), ici=dict(plan.ici), dcn=dict(plan.dcn),
                  parallel={k: getattr(plan.cfg.parallel, k) for k in ("sequence_parallel", "distributed_optimizer",
                                                                       "pipeline_schedule", "virtual_stages",
                                                                       "recompute")},
                  micro_batch=plan.batch.micro_batch, memory=mem,
                  fits=mem["total"] <= int(kind.memory_gib * GIB * HEADROOM))
    c.step_seconds, c.parts, c.mfu, c.bubble = _step_time(plan, spec, kind, devices)
    return c


def plan_cluster(cfg: Config, cluster: str, device_kinds: str | None = None, top: int = 5,
                 keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every layout of `cfg` on the cluster, estimated and ranked; the report `megajax plan` prints.
    `keep`: KEEPABLE keys whose values in `cfg` every layout keeps (those a command line sets)."""
    from megajax.train.state import build_model_spec
    if top < 1:
        raise ConfigError(f"--top {top}: must be >= 1 (the number of layouts to print).")
    kinds = load_device_kinds(device_kinds)
    devices, kind_name, kind = parse_cluster(cluster, kinds)
    node = min(kind.node_size, devices)
    pins = pinned_axes(cfg)
    # The resolved config, tokenizer and vocabulary, planned on one device: the candidates bring the batch
    # checks (a global batch that does not split over every device is no error here).
    ones = {a: 1 for a in MESH_AXES}
    one_stage = {"virtual_stages": 1, "pipeline_schedule": "1f1b"}  # (a kept chunk count needs a pipeline)
    base = make_plan(_candidate_config(cfg, ones, ones, one_stage, cfg.parallel.recompute, 1), 1)
    spec, _ = build_model_spec(base.cfg, base.padded_vocab)
    capacity = int(kind.memory_gib * GIB * HEADROOM)
    candidates: list[Candidate] = []
    refusals: collections.Counter[str] = collections.Counter()  # the checks' messages, by how many layouts
    base.cfg.mesh = copy.deepcopy(cfg.mesh)  # the pins
    base.cfg.parallel = copy.deepcopy(cfg.parallel)  # and the kept keys
    policies = (cfg.parallel.recompute,) if "parallel.recompute" in keep else ("none", "selective", "full")
    for sizes, parallel in _layouts(base.cfg, devices, node, keep, ragged=not kind.shared_host):
        placed = _place(sizes, node)
        if placed is None:
            continue
        ici, dcn = placed
        per_rank = base.cfg.train.global_batch // data_parallel_size(sizes)
        micros = [d for d in _divisors(max(per_rank, 1)) if d <= 16]
        if "train.micro_batch" in keep:
            micros = [cfg.train.micro_batch or per_rank]
        for recompute in policies:
            for micro in micros:
                c = _candidate_config(base.cfg, ici, dcn, parallel, recompute, micro)
                try:
                    plan = plan_layout(c, base.tokenizer, ici, dcn)
                except UserError as e:
                    refusals[str(e)] += 1
                    continue
                mem = analytic.memory_estimate(plan, spec)
                cand = Candidate(sizes=dict(plan.sizes), ici=ici, dcn=dcn, parallel=dict(parallel, recompute=recompute),
                                 micro_batch=plan.batch.micro_batch, memory=mem, fits=mem["total"] <= capacity)
                cand.step_seconds, cand.parts, cand.mfu, cand.bubble = _step_time(plan, spec, kind, devices)
                candidates.append(cand)
    if not candidates:
        raise _all_refused(cluster, devices, kind_name, node, pins, refusals)
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (round(c.step_seconds, 6), -c.micro_batch,
                                                                       c.memory["total"]))
    smallest = sorted(candidates, key=lambda c: c.memory["total"])[:top]
    alternatives = {}
    if fitting:  # the fastest layout using each axis the best leaves at 1
        for axis in ALTERNATIVE_AXES:
            if fitting[0].sizes[axis] == 1:
                using = next((c for c in fitting if c.sizes[axis] > 1), None)
                if using is not None:
                    alternatives[axis] = using
    return {"cluster": cluster, "devices": devices, "device_kind": kind_name, "kind": asdict(kind),
            "capacity": capacity, "evaluated": len(candidates), "refused": sum(refusals.values()),
            "model": {"parameters": sum(math.prod(x.shape) for x in _leaves(spec.abstract_params)),
                      "global_batch": base.cfg.train.global_batch, "seq_len": base.cfg.train.seq_len,
                      "precision": base.cfg.train.precision},
            "ranked": fitting, "smallest": smallest if not fitting else [], "pinned": pins,
            "kept": {k: _value(cfg, k) for k in keep},
            "alternatives": alternatives}


def _value(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _all_refused(cluster: str, devices: int, kind: str, node: int, pins: dict[str, int],
                 refusals: collections.Counter) -> MeshError:
    """Why no layout was estimated: the sizes the config pins fit none, or the checks `megajax train` runs
    refused every one (the two most frequent reasons, with how many layouts each refused)."""
    if not refusals:
        kept = " ".join(f"mesh.{a}={n}" for a, n in pins.items())
        return MeshError(f"--cluster {cluster}: no layout of {devices} {kind} has {kept} (the mesh sizes the config "
                         f"sets are kept): each size must divide {devices}, and tensor parallelism stays inside a "
                         f"node of {node}. Change or remove those keys to let the plan choose.")
    reasons = "; ".join(f"{n} of them: {text.rstrip('. ')}" for text, n in refusals.most_common(2))
    more = len(refusals) - 2
    return MeshError(f"--cluster {cluster}: the checks megajax train runs refuse every layout of {devices} {kind} "
                     f"({sum(refusals.values())} with their recompute and micro batch choices), so there is "
                     f"nothing to estimate; {reasons}" + (f"; and {more} other reasons" if more > 0 else "") + ".")


# The parallelisms the report explains when the best layout leaves them out.
ALTERNATIVE_AXES = ("tensor", "pipeline", "context", "expert", "fsdp")


def _leaves(tree):
    from megajax.checkpoint.source import flatten
    return [v for _, v in flatten(tree)]


def reasons(c: Candidate) -> str:
    """Where a candidate's estimated step time goes, largest part first."""
    parts = sorted(((k, v) for k, v in c.parts.items() if v > 0), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in parts)


def format_plan(report: dict[str, Any], top: int = 5) -> str:
    mod = report["model"]
    kept = ([f"mesh.{a}={n}" for a, n in report["pinned"].items()]
            + [f"{k}={v}" for k, v in report.get("kept", {}).items()])
    lines = [f"cluster    {report['cluster']}: {report['devices']} {report['device_kind']} "
             f"({report['kind']['memory_gib']:g} GiB, {report['kind']['node_size']} per node); model "
             f"{mod['parameters'] / 1e9:.2f}B parameters, global batch {mod['global_batch']} x seq "
             f"{mod['seq_len']}, {mod['precision']}",
             f"estimated  {report['evaluated']} layouts ({report['refused']} more refused by the run's own checks)"
             + (f" with {' '.join(kept)} kept" if kept else "")
             + f"; {len(report['ranked'])} fit in {report['capacity'] / GIB:.1f} GiB ({HEADROOM:.0%} of the device)"]
    if not report["ranked"]:
        lines.append("nothing fits; the smallest per-device memory:")
        for c in report["smallest"]:
            lines.append(f"  {c.memory['total'] / GIB:8.1f} GiB  {c.label()}")
        return "\n".join(lines)
    for i, c in enumerate(report["ranked"][:top], 1):
        lines.append(f"{i:>2}. {c.step_seconds:8.3f} s/step  MFU {c.mfu:5.1%}  {c.memory['total'] / GIB:6.1f} GiB  "
                     f"{c.label()}")
        lines.append(f"    {reasons(c)}" + (f"; bubble {c.bubble:.1%}" if c.bubble else ""))
    alternatives = report.get("alternatives") or {}
    if alternatives:
        best = report["ranked"][0]
        lines.append("not chosen (the fastest fitting layout with each parallelism the first leaves out):")
        for axis, c in alternatives.items():
            rank = next(i for i, r in enumerate(report["ranked"], 1) if r is c)
            lines.append(f"    {axis:<9} {c.step_seconds / best.step_seconds - 1:+6.1%}  {c.step_seconds:8.3f} s/step "
                         f"(#{rank})  {c.label()}")
            lines.append(f"              {reasons(c)}" + (f"; bubble {c.bubble:.1%}" if c.bubble else ""))
    return "\n".join(lines)


def mesh_yaml(c: Candidate, header: str) -> str:
    """The candidate as a mesh config (configs/mesh/*.yaml's form)."""
    mesh: dict[str, Any] = {a: c.ici[a] for a in MESH_AXES}
    dcn = {a: c.dcn[a] for a in MESH_AXES if c.dcn[a] > 1}
    if dcn:
        mesh["dcn"] = dcn
    doc = {"mesh": mesh, "parallel": dict(c.parallel), "train": {"micro_batch": c.micro_batch}}
    return "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(doc, sort_keys=False)
