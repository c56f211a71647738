"""The run plan: everything a run decides before touching a device, resolved once and then frozen.

    config + device count -> RunPlan(cfg, tokenizer, mesh sizes, rules, batch layout, pipeline, notes)

The plan owns a private, resolved copy of the config: the vocabulary comes
from the tokenizer when the config leaves it open, user paths (data, tokenizer,
run directory, checkpoint.load) are made absolute so the saved config works
from any directory. This module is the one home of the resolved sizes, the
data-parallel size and the batch arithmetic (`BatchLayout`), the pipeline
schedule choice (`RunPlan.pipeline`) and the pre-flight checks (`plan_layout`:
the model against the mesh, the batch, the pipeline); the train step, `perf/`
and `inference/` read a plan and do not check again. `megajax train`,
`megajax bench` (also for device kinds this machine does not have:
`--topology`), `megajax config from-megatron` (`plan_elsewhere`: for a
cluster's job, its tokenizer perhaps not readable here), the fit advice (one
plan per candidate change) and the tests build plans the same way.
"""

from __future__ import annotations

import copy
import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megajax.config import MESH_AXES, Config, ModelConfig, TrainConfig, expert_tensor_folded
from megajax.data.no_tokenizer import is_no_tokenizer, no_tokenizer_error
from megajax.data.tokenizer import load_tokenizer
from megajax.errors import ConfigError, MeshError
from megajax.mesh import ShardingRules, axis_sizes, data_parallel_size, make_rules, mesh_text, validate_for_model


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch splits: global = micro x accumulation x data-parallel size (Megatron's terms).

    `micro_batch` is per data-parallel rank; a step runs `accumulation` microbatches. The
    loader's arrays are [accumulation, micro_batch x data_parallel, seq_len]."""
    global_batch: int
    micro_batch: int
    data_parallel: int
    accumulation: int
    seq_len: int

    @classmethod
    def resolve(cls, train: TrainConfig, data_parallel: int, sizes_text: str = "") -> "BatchLayout":
        """From train.global_batch / train.micro_batch and the data-parallel size; MeshError if they do not fit."""
        g, dp = train.global_batch, data_parallel
        where = f" ({sizes_text})" if sizes_text else ""
        if train.micro_batch is None:
            if g % dp:
                raise MeshError(
                    f"train.global_batch={g} does not split over the data-parallel size {dp}{where}; "
                    f"use a multiple of {dp} (e.g. {dp * max(1, round(g / dp))}) or change the mesh.")
            micro = g // dp
        else:
            micro = train.micro_batch
            if g % (micro * dp):
                raise MeshError(
                    f"train.global_batch={g} is not a multiple of train.micro_batch={micro} x data-parallel "
                    f"size {dp}{where} = {micro * dp}; the global batch is micro_batch x accumulation steps "
                    f"x data-parallel size. Change train.global_batch or train.micro_batch.")
        return cls(global_batch=g, micro_batch=micro, data_parallel=dp, accumulation=g // (micro * dp),
                   seq_len=train.seq_len)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.accumulation, self.micro_batch * self.data_parallel, self.seq_len)

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class PipelineChoice:
    """The pipeline schedule of a run with mesh.pipeline > 1: what
    megajax.parallel.pipeline.build_schedule(schedule, stages, microbatches, virtual_stages) builds."""
    schedule: str  # parallel.pipeline_schedule
    stages: int  # the pipeline axis's total size (inter-node factor included)
    virtual_stages: int  # parallel.virtual_stages: model chunks per stage
    microbatches: int  # a step's microbatches (the batch layout's accumulation)


@dataclass(frozen=True)
class RunPlan:
    """A resolved, immutable description of a run (nothing here holds a device)."""
    cfg: Config  # private resolved copy: do not mutate
    tokenizer: Any
    ici: dict[str, int]  # per-node axis sizes
    dcn: dict[str, int]  # inter-node factors
    rules: ShardingRules
    batch: BatchLayout
    notes: tuple[str, ...] = ()

    @property
    def model(self) -> ModelConfig:
        return self.cfg.model

    @property
    def padded_vocab(self) -> int:
        return self.cfg.model.padded_vocab_size()

    @property
    def sizes(self) -> dict[str, int]:
        """Total size of every mesh axis."""
        return {a: self.ici[a] * self.dcn[a] for a in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def pipeline(self) -> PipelineChoice | None:
        """The pipeline schedule choice; None without pipeline parallelism (mesh.pipeline 1)."""
        stages = self.sizes["pipeline"]
        if stages == 1:
            return None
        p = self.cfg.parallel
        return PipelineChoice(schedule=p.pipeline_schedule, stages=stages, virtual_stages=p.virtual_stages,
                              microbatches=self.batch.accumulation)

    def mesh_text(self) -> str:
        return mesh_text(self.sizes)

    def describe(self) -> str:
        """The plan in one line: model, mesh, batch arithmetic, precision, recompute, pipeline schedule."""
        m, b, par = self.model, self.batch, self.cfg.parallel
        experts = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else ""
        flags = "".join(f", {name}" for name, on in (("sequence parallel", par.sequence_parallel),
                                                     ("distributed optimizer", par.distributed_optimizer)) if on)
        if m.num_experts and expert_tensor_folded(self.cfg):  # MoE parallel folding: the experts' own layout
            group = [a for a in self.rules.params["experts"] if self.sizes.get(a, 1) > 1]
            ep = math.prod(self.sizes[a] for a in group)
            flags += f", experts whole over {' x '.join(group) or 'one device'} (expert parallel {ep}, expert tensor 1)"
        parts = [f"{m.family} model ({m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / "
                 f"{m.num_kv_heads} kv, ffn {m.ffn_hidden_size}{experts}, vocab {m.vocab_size} padded to "
                 f"{self.padded_vocab})",
                 f"mesh {self.mesh_text()}{flags}",
                 f"global batch {b.global_batch} = micro {b.micro_batch} x accumulation {b.accumulation} x "
                 f"data-parallel {b.data_parallel}, seq {b.seq_len}",
                 f"precision {self.cfg.train.precision}", f"recompute {par.recompute}"]
        pipe = self.pipeline
        if pipe is not None:
            parts.append(f"pipeline schedule {pipe.schedule} ({pipe.stages} stages x {pipe.virtual_stages} "
                         f"chunks, {pipe.microbatches} microbatches)")
        return "; ".join(parts)

    def variant(self, cfg: Config, ici: dict[str, int] | None = None) -> "RunPlan":
        """The plan of `cfg` (a changed copy of this plan's resolved config) on the same devices, per
        node laid out as `ici` (default: this plan's), with this plan's tokenizer and inter-node
        factors; every check of `plan_layout` runs again (ConfigError / MeshError)."""
        return plan_layout(copy.deepcopy(cfg), self.tokenizer, dict(ici or self.ici), dict(self.dcn), self.notes)


def default_run_dir() -> str:
    return str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute()) if path else path


def resolve_paths(cfg: Config) -> None:
    """User paths made absolute (relative to the current directory), so the saved config works anywhere."""
    d = cfg.data
    if d.tokenizer != "byte" and not is_no_tokenizer(d.tokenizer):
        d.tokenizer = _absolute(d.tokenizer)
    if isinstance(d.path, str):
        d.path = _absolute(d.path)
    else:  # [weight, prefix, weight, prefix, ...]
        d.path = [p if i % 2 == 0 else _absolute(str(p)) for i, p in enumerate(d.path)]
    if d.cache_dir:
        d.cache_dir = _absolute(d.cache_dir)
    cfg.train.run_dir = _absolute(cfg.train.run_dir or default_run_dir())
    cfg.checkpoint.load = _absolute(cfg.checkpoint.load)


def resolve_vocabulary(cfg: Config, tokenizer) -> list[str]:
    """model.vocab_size from the tokenizer when unset; notes for the user when they differ."""
    m, t = cfg.model, tokenizer
    if m.vocab_size is None:
        m.vocab_size = t.vocab_size
        return []
    if m.vocab_size < t.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({t.vocab_size} ids, data.tokenizer={cfg.data.tokenizer!r}); remove model.vocab_size "
                          f"to take the tokenizer's, or use the tokenizer the model was built for.")
    if m.vocab_size > t.vocab_size:
        return [f"note: model.vocab_size={m.vocab_size:,} (from the config) but the tokenizer "
                f"(data.tokenizer={cfg.data.tokenizer!r}) has {t.vocab_size:,} ids; the {m.vocab_size - t.vocab_size:,} "
                f"extra embedding rows are never used. Leave model.vocab_size unset (null) to take the "
                f"tokenizer's vocabulary."]
    return []


def make_plan(cfg: Config, num_devices: int, tokenizer=None) -> RunPlan:
    """The plan of `cfg` on `num_devices` devices (ConfigError / MeshError naming keys and values);
    `tokenizer`: one to plan with instead of loading data.tokenizer (a config for another machine)."""
    cfg = copy.deepcopy(cfg)
    resolve_paths(cfg)
    if tokenizer is None and is_no_tokenizer(cfg.data.tokenizer):
        raise no_tokenizer_error(cfg.data.tokenizer)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.data.tokenizer, key="data.tokenizer")
    notes = resolve_vocabulary(cfg, tokenizer)
    ici, dcn = axis_sizes(cfg, num_devices)
    return plan_layout(cfg, tokenizer, ici, dcn, notes)


def plan_elsewhere(cfg: Config, num_devices: int | None = None) -> RunPlan:
    """The plan of a config written for another machine (`megajax config from-megatron`): on `num_devices`
    devices, else the fewest its fixed mesh sizes take; a tokenizer this machine cannot read (a path of the
    cluster's, a shell variable) stands in by the vocabulary the config gives (else the byte tokenizer's)."""
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer, key="data.tokenizer")
    except ConfigError:
        tokenizer = SimpleNamespace(vocab_size=cfg.model.vocab_size or load_tokenizer("byte").vocab_size)
    return make_plan(cfg, num_devices or fewest_devices(cfg), tokenizer=tokenizer)


def fewest_devices(cfg: Config) -> int:
    """The device count of the config's fixed mesh sizes (an axis of -1 taking one device)."""
    return math.prod(max(getattr(cfg.mesh, a), 1) * getattr(cfg.mesh.dcn, a) for a in MESH_AXES)


def plan_layout(cfg: Config, tokenizer, ici: dict[str, int], dcn: dict[str, int], notes=()) -> RunPlan:
    """The plan of a resolved config (vocabulary and paths filled in) laid out as per-node sizes `ici`
    x inter-node factors `dcn`, after every pre-flight check: the model's dims against the mesh
    (megajax.mesh.validate_for_model), the batch (BatchLayout.resolve) and the pipeline."""
    sizes = {a: ici[a] * dcn[a] for a in MESH_AXES}
    rules = make_rules(cfg, sizes)
    validate_for_model(cfg, sizes, rules)
    where = " x ".join(f"mesh.{a}={sizes[a]}" for a in rules.activations["batch"]
                       if sizes[a] > 1 or a in ("data", "fsdp"))
    batch = BatchLayout.resolve(cfg.train, data_parallel_size(sizes), where)
    validate_pipeline(cfg, sizes, batch)
    return RunPlan(cfg=cfg, tokenizer=tokenizer, ici=ici, dcn=dcn, rules=rules, batch=batch, notes=tuple(notes))


def validate_hybrid_stages(m, p: int, v: int) -> None:
    """A hybrid's pipeline stages hold whole repeats of its pattern's group (model.hybrid_group()), every
    stage the same layers; a '|' in the pattern fixes the stage count, and its stages must be equal
    (mesh.pipeline=1 ignores the '|': any placement is accepted there)."""
    pattern, group = m.hybrid_layer_pattern, m.hybrid_group()
    groups = m.num_layers // len(group)
    stages = pattern.split("|")
    if len(set(stages)) > 1:
        raise MeshError(f"model.hybrid_layer_pattern = {pattern!r} marks pipeline stages {stages} that differ, and "
                        f"mesh.pipeline={p} x parallel.virtual_stages={v}: the pipeline is one program that every "
                        f"stage runs over its share of the stacked layer groups ({group!r}), so every stage must "
                        f"hold the same layers (e.g. 'M*-E|M*-E'); leave the '|' out to split the pattern's "
                        f"repeats evenly, or run without pipeline parallelism (mesh.pipeline=1 reads any '|' and "
                        f"ignores it).")
    if "|" in pattern and pattern.count("|") + 1 != p * v:
        raise MeshError(f"model.hybrid_layer_pattern = {pattern!r} marks {pattern.count('|') + 1} pipeline stages "
                        f"('|') but this run has mesh.pipeline={p} x parallel.virtual_stages={v} = {p * v}; make them "
                        f"agree, or leave the '|' out.")
    if groups % (p * v):
        ok = [d for d in range(1, groups + 1) if groups % (d * v) == 0]
        raise MeshError(f"model.hybrid_layer_pattern = {pattern!r} is {groups} repeat(s) of {group!r}, and every "
                        f"pipeline stage runs the same layers: mesh.pipeline={p} x parallel.virtual_stages={v} must "
                        f"divide {groups}; accepted mesh.pipeline: {', '.join(map(str, ok))} (or a pattern whose "
                        f"group repeats a multiple of {p * v} times).")


def validate_pipeline(cfg: Config, sizes: dict[str, int], batch: BatchLayout) -> None:
    """mesh.pipeline and the parallel.pipeline_* keys against the model, the batch and the other axes."""
    p, v, name = sizes["pipeline"], cfg.parallel.virtual_stages, cfg.parallel.pipeline_schedule
    m = cfg.model
    if p == 1:
        if v != 1:
            raise ConfigError(f"parallel.virtual_stages = {v} needs pipeline parallelism (mesh.pipeline > 1; "
                              f"this run has mesh.pipeline=1); set parallel.virtual_stages=1.")
        return
    if m.interleaves_dense_layers() and (m.num_layers // m.moe_layer_freq) % (p * v):
        f, groups = m.moe_layer_freq, m.num_layers // m.moe_layer_freq
        raise MeshError(f"model.num_layers={m.num_layers} with model.moe_layer_freq={f} is {groups} groups of one MoE "
                        f"and {f - 1} dense layers, and a pipeline stage holds whole groups: mesh.pipeline={p} x "
                        f"parallel.virtual_stages={v} must divide {groups}.")
    if m.hybrid_layer_pattern:
        validate_hybrid_stages(m, p, v)
    k = m.dense_first_layers()
    if k and (m.num_layers - k) % (p * v):
        moe = m.num_layers - k
        ok = [d for d in range(2, moe + 1) if moe % (d * v) == 0]
        raise MeshError(f"model.moe_layer_freq={m.moe_layer_freq}: the {k} dense layers run on the first stage with "
                        f"the embedding, and the pipeline splits the {moe} MoE layers: mesh.pipeline={p} x "
                        f"parallel.virtual_stages={v} must divide {moe}; accepted mesh.pipeline: "
                        f"{', '.join(map(str, ok)) or 'none (use mesh.pipeline=1)'}.")
    problems = []  # each names its fixes: changes that differ from this run and fit its devices
    micro, dp, acc, G = batch.micro_batch, batch.data_parallel, batch.accumulation, batch.global_batch

    def batch_fits(stages: int, data_parallel: int) -> bool:
        mb = micro if cfg.train.micro_batch is not None else G // data_parallel  # unset: no accumulation
        if not mb or G % (mb * data_parallel):
            return False
        n = G // (mb * data_parallel)
        return n >= stages and (name != "interleaved" or n % stages == 0)

    if not k and not m.hybrid_layer_pattern and m.num_layers % (p * v):
        fixes = []
        for d in range(2, m.num_layers + 1):  # another pipeline size, the data axis taking the rest
            if d == p or m.num_layers % (d * v) or (sizes["data"] * p) % d or not batch_fits(d, dp * p // d):
                continue
            data = "" if cfg.mesh.data == -1 else f" mesh.data={sizes['data'] * p // d}"
            fixes.append(f"mesh.pipeline={d}{data}")
        below, above = (m.num_layers // (p * v)) * p * v, -(-m.num_layers // (p * v)) * p * v
        fixes = fixes[:4] + [f"model.num_layers={n}" for n in (below, above) if n]
        problems.append(f"model.num_layers={m.num_layers} does not split into mesh.pipeline={p} stages x "
                        f"parallel.virtual_stages={v} chunks of whole layers ({p * v} must divide it); use "
                        f"{' or '.join(fixes)}.")
    if not batch_fits(p, dp):
        need = p if acc < p else p * -(-acc // p)
        why = ("at least as many microbatches as stages" if acc < p else
               f"a multiple of mesh.pipeline={p} microbatches (it runs them in groups of {p})")
        smaller = [d for d in range(micro - 1, 0, -1) if (G // dp) % d == 0 and G // dp // d >= need
                   and (name != "interleaved" or (G // dp // d) % p == 0)]
        keep_micro = "" if cfg.train.micro_batch is not None else f" train.micro_batch={micro}"
        fixes = [f"train.global_batch={need * micro * dp}{keep_micro}"] + [f"train.micro_batch={d}"
                                                                           for d in smaller[:1]]
        problems.append(f"parallel.pipeline_schedule={name} needs {why}; this run has {acc} (train.global_batch="
                        f"{G} / (train.micro_batch={micro} x data-parallel size {dp})); use "
                        f"{' or '.join(fixes)}.")
    if problems:
        raise MeshError(" Also: ".join(problems))
