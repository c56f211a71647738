"""From a plan to things that run: mesh, model spec, state and its shardings, compiled steps.

    RunPlan --build_setup--> Setup (mesh, spec, optimizer, abstract state + shardings, jitted steps)
    Setup + data + checkpoints --build_trainer--> Trainer (initial state, loaders, compiled step)

`Setup` is what every command that needs the model builds (train, bench,
export/import where a model is needed, generation); `Trainer` is a training
run's starting point, what the loop in megajax/train/loop.py iterates.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.checkpoint.manager import (find_step_dir, leaf_names, read_meta, require_step_dir, restore_expert_bias,
                                       restore_params, set_aside_newer, verify_step)
from megajax.checkpoint.lora_base import base_reference, verified_base  # noqa: F401  (base_reference: re-exported)
from megajax.checkpoint.stored_model import is_hf_load, is_megatron_load
from megajax.compile_cache import CompileWatch
from megajax.config import Config
from megajax.data.loader import Loader, batch_keys, build_run_datasets, sample_loss_mask
from megajax.errors import CheckpointError, ConfigError
from megajax.mesh import ShardingRules, even_sharding, load_balanced_order, mesh_from_sizes, padded_struct
from megajax.precision.loss_scale import DynamicLossScale
from megajax.precision.policy import precision_policy
from megajax.models.trainable import frozen_in_state
from megajax.train.flops import train_flops_per_token
from megajax.train.master import load_target, restore_resume, with_params
from megajax.train.optimizer import lr_schedule, make_optimizer
from megajax.train.resume_changes import refuse_lora_changes
from megajax.plan import BatchLayout, RunPlan, make_plan
from megajax.train.state import (ModelSpec, TrainState, build_model_spec, initial_expert_bias, loss_scaler,
                                 make_init_fn, pad_state, place, state_shardings, unpad_state)
from megajax.train.step import batch_shardings, make_eval_step, make_train_step, metric_keys



@dataclass
class Setup:
    """The static part of a run on a mesh: no parameters are materialised by building it."""
    plan: RunPlan
    mesh: Mesh
    spec: ModelSpec
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    scaler: DynamicLossScale | None
    init: Callable[[], TrainState]
    abstract_state: TrainState
    state_shardings: TrainState
    batch_shardings: dict[str, NamedSharding]

    @property
    def cfg(self) -> Config:
        return self.plan.cfg

    @property
    def rules(self) -> ShardingRules:
        return self.plan.rules

    @property
    def batch(self) -> BatchLayout:
        return self.plan.batch

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of one step (megajax/train/flops.py's convention)."""
        return train_flops_per_token(self.plan.model, self.batch.seq_len, self.plan.padded_vocab) * self.batch.tokens

    def logical_target(self) -> TrainState:
        """The state at its logical shapes, as ShapeDtypeStructs carrying their shardings (what restores
        and loads read into: they return it as stored, `target`)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type),
                            self.abstract_state, self.state_shardings)

    def target(self) -> TrainState:
        """The state as stored between steps (what the train step takes): logical_target with the dims
        split over the data-parallel axes padded where their split does not divide them
        (megajax/mesh.py PADDED_AXES)."""
        return jax.tree.map(padded_struct, self.logical_target())

    def padded(self) -> bool:
        """Whether any array of the state is stored padded."""
        return any(a.shape != b.shape for a, b in zip(jax.tree.leaves(self.logical_target()),
                                                      jax.tree.leaves(self.target())))

    def padding_record(self) -> dict[str, list[int]]:
        """{Orbax storage name: logical shape} of the stored state's padded arrays (a checkpoint's
        metadata, `logical_shapes`: readers crop them; the frozen base of adapters is not saved)."""
        logical, stored = self.logical_target().replace(frozen=None), self.target().replace(frozen=None)
        return {name: list(a.shape) for name, a, b in zip(leaf_names(logical), jax.tree.leaves(logical),
                                                           jax.tree.leaves(stored)) if a.shape != b.shape}

    def fresh_state(self) -> TrainState:
        logical = self.logical_target()
        return jax.jit(lambda: pad_state(self.init(), logical), out_shardings=self.state_shardings)()

    def model_params(self, state: TrainState) -> dict:
        """The parameters of a stored state at their logical shapes, for generation on the run's mesh:
        as they are where nothing is padded, else the padded ones resharded whole over the axes that
        do not divide them (megajax/mesh.py even_sharding)."""
        logical = self.logical_target().params
        if not self.padded():
            return state.params
        even = jax.tree.map(lambda t: even_sharding(t.sharding, t.shape), logical)
        return jax.jit(lambda p: unpad_state(p, logical), out_shardings=even)(state.params)

    def image_batch_shardings(self) -> dict[str, NamedSharding]:
        """The shardings of a vision-language model's image-text batch: the text's and `images`
        [accumulation, B, N, H, W, 3] (split over the batch like the text)."""
        if self.cfg.model.vision is None:
            raise ConfigError("a batch with images needs model.vision (a vision-language model); this model reads "
                              "text only.")
        return batch_shardings(self.mesh, self.rules, tuple(self.batch_shardings) + ("images",))

    def train_step(self, images: bool = False) -> Callable:
        """jit of (state, batch, ok) -> (state, metrics, ok); state and ok donated. `images`: the batches
        carry images (image_batch_shardings), else text alone.

        `ok` is a device flag: once a step is non-finite and the run does not skip such steps
        (train.skip_nonfinite false, not fp16), that step and every later one leave the state
        as it was, so the loop, which checks metrics a step late to keep the device busy, still
        holds the last finite state when it notices."""
        cfg = self.cfg
        step = make_train_step(cfg, self.spec, self.tx, self.scaler, self.schedule, self.mesh, self.rules,
                               self.plan.pipeline)
        halt = not (cfg.train.skip_nonfinite or precision_policy(cfg).dynamic_loss_scale)
        logical = self.logical_target()

        def guarded(stored, batch, ok):
            state = unpad_state(stored, logical)  # the step sees logical shapes (padded between steps)
            new, metrics = step(state, batch, ok)  # parameters and optimizer state: kept unless ok
            accept = ok & ~metrics["skipped"] if halt else ok
            kept = dict(params=None, opt_state=None, frozen=None)
            rest = jax.tree.map(lambda n, o: jnp.where(accept, n, o), new.replace(**kept), state.replace(**kept))
            rest = rest.replace(params=new.params, opt_state=new.opt_state)
            return pad_state(rest, logical.replace(frozen=None)).replace(frozen=stored.frozen), metrics, accept

        replicated = NamedSharding(self.mesh, P())
        metric_sh = {k: replicated for k in metric_keys(cfg)}
        batch_sh = self.image_batch_shardings() if images else self.batch_shardings
        return jax.jit(guarded, in_shardings=(self.state_shardings, batch_sh, replicated),
                       out_shardings=(self.state_shardings, metric_sh, replicated), donate_argnums=(0, 2))

    def ok_flag(self) -> jax.Array:
        return jax.device_put(jnp.asarray(True), NamedSharding(self.mesh, P()))

    def eval_step(self, images: bool = False) -> Callable:
        """jit of (params, batch, fp8 scaling state or None, expert bias or None, frozen parameters or
        None) -> (sum of token losses, tokens); `images` as train_step's."""
        batch_sh = self.image_batch_shardings() if images else self.batch_shardings
        evaluate, logical = make_eval_step(self.spec, self.mesh, self.rules, self.cfg), self.logical_target()

        def stored_eval(params, batch, fp8, expert_bias, frozen):  # the stored parameters (padded)
            frozen = None if frozen is None else unpad_state(frozen, logical.frozen)
            return evaluate(unpad_state(params, logical.params), batch, fp8, expert_bias, frozen)

        return jax.jit(stored_eval,
                       in_shardings=(self.state_shardings.params, batch_sh, self.state_shardings.fp8,
                                     self.state_shardings.moe_expert_bias, self.state_shardings.frozen))

    def loader(self, dataset, prefetch: int) -> Loader:
        """The loader of `dataset`: image-text batches (image_batch_shardings) when its samples carry images."""
        context = self.plan.sizes["context"]
        order = load_balanced_order(self.batch.seq_len, context) if context > 1 else None
        images = getattr(dataset, "images_shape", None) is not None
        return Loader(dataset, layout=self.batch, shardings=self.image_batch_shardings() if images
                      else self.batch_shardings, eod_mask_loss=sample_loss_mask(self.cfg), prefetch=prefetch,
                      order=order, num_workers=self.cfg.data.num_workers)


def check_kernel_platform(impl: str, platform: str) -> None:
    """A kernel on devices that cannot run it: one clear error naming the key."""
    if impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention_impl = 'cudnn' needs an NVIDIA GPU; this run's devices are "
                          f"{platform}. Use model.attention_impl=flash or xla.")


def build_setup(plan: RunPlan, devices: list | None = None) -> Setup:
    devices = list(devices if devices is not None else jax.devices())
    cfg = plan.cfg
    check_kernel_platform(cfg.model.attention_impl, devices[0].platform)
    mesh = mesh_from_sizes(plan.ici, plan.dcn, devices)
    spec, init_params = build_model_spec(cfg, plan.padded_vocab, mesh=mesh, rules=plan.rules)
    policy = precision_policy(cfg)
    tx = make_optimizer(cfg.optim, cfg.train.steps, frozen_in_state(cfg.model), policy.master_dtype is not None)
    scaler = loss_scaler(cfg)
    init = make_init_fn(init_params, tx, scaler, cfg.train.seed, spec.init_fp8,
                        lambda: initial_expert_bias(cfg.model), spec.split, policy.param_dtype)
    abstract = jax.eval_shape(init)
    return Setup(plan=plan, mesh=mesh, spec=spec, tx=tx, schedule=lr_schedule(cfg.optim, cfg.train.steps),
                 scaler=scaler, init=init, abstract_state=abstract,
                 state_shardings=state_shardings(mesh, plan.rules, spec, tx, abstract),
                 batch_shardings=batch_shardings(mesh, plan.rules, batch_keys(cfg, plan.sizes["context"])))


# ----------------------------------------------------------------------------
# A training run's starting point
# ----------------------------------------------------------------------------

@dataclass
class Trainer:
    """Everything a training run starts from, ready to run steps."""
    setup: Setup
    state: TrainState
    step_fn: jax.stages.Compiled  # (state, batch, ok) -> (state, metrics, ok)
    loader: Loader
    valid_loader: Loader | None
    eval_fn: Callable  # jitted (params, batch, fp8, expert bias) -> (loss sum, tokens)
    consumed_samples: int  # data position of `state`
    origin: str  # where the state came from
    resumed_step: int | None  # the checkpoint step a resumed run starts from
    compile_seconds: float
    data_report: list[str] = field(default_factory=list)
    # model.lora: the frozen base the adapters belong to (base_reference), recorded in every checkpoint.
    lora_base: dict | None = None

    @property
    def plan(self) -> RunPlan:
        return self.setup.plan

    @property
    def cfg(self) -> Config:
        return self.setup.plan.cfg

    @property
    def mesh(self) -> Mesh:
        return self.setup.mesh

    @property
    def rules(self) -> ShardingRules:
        return self.setup.plan.rules

    @property
    def spec(self) -> ModelSpec:
        return self.setup.spec

    @property
    def tokenizer(self):
        return self.setup.plan.tokenizer

    @property
    def accumulation(self) -> int:
        return self.setup.batch.accumulation


def initial_state(setup: Setup) -> tuple[TrainState, int, str, int | None]:
    """(state, consumed samples, description, resumed step): the run directory's latest checkpoint (or
    checkpoint.step) if it has one (resume), else a fresh state, with checkpoint.load's parameters if
    given (fine-tuning). Resuming from a step older than the run's newest moves the newer steps aside
    (set_aside_newer), so the run saves its own steps in their place."""
    cfg = setup.cfg
    target = setup.logical_target()  # restores and loads return it as stored (padded)
    step = cfg.checkpoint.step
    resume = find_step_dir(Path(cfg.train.run_dir) / "checkpoints", step)
    if resume is not None:
        meta = read_meta(verify_step(resume))
        refuse_lora_changes(meta.get("config", {}), cfg.model, resume)  # before a restore would drop adapters
        if setup.spec.frozen_axes is not None:
            _same_base(cfg, meta.get("lora_base") or {}, resume)
        state, note = restore_resume(resume, target, setup.state_shardings, cfg)  # (with or without a master copy)
        if setup.spec.frozen_axes is not None:  # adapters: the base comes from where the checkpoint says
            frozen, _ = frozen_base(setup, target, meta.get("lora_base"), str(resume))
            state = state.replace(frozen=frozen)
        origin = f"resumed from {resume} (step {meta['step']})" + (f"; {note}" if note else "")
        if step is not None:
            newer, aside = set_aside_newer(resume)
            if newer:
                origin += (f"; checkpoint.step={step}: the newer checkpoints (step{'s' if len(newer) > 1 else ''} "
                           f"{', '.join(map(str, newer))}) are moved to {aside}, and metrics.jsonl's records "
                           f"after step {step} are dropped")
        return state, int(meta["consumed_samples"]), origin, int(meta["step"])
    if setup.spec.frozen_axes is not None and step is not None:
        raise CheckpointError(f"checkpoint.step={step}: train.run_dir={cfg.train.run_dir} has no checkpoints; with "
                              f"model.lora, checkpoint.load names the base model's step directory itself.")
    if cfg.checkpoint.load and setup.spec.frozen_axes is not None:
        frozen, ref = frozen_base(setup, target, base_reference(cfg), "checkpoint.load")
        state = setup.fresh_state().replace(frozen=frozen)
        bias = (restore_expert_bias(Path(ref["path"]), cfg) if ref.get("format") == "megajax" else
                _hf_expert_bias(ref["path"]) if ref.get("format") == "hf" else None)
        if bias is not None:
            state = state.replace(moe_expert_bias=jax.device_put(bias, setup.state_shardings.moe_expert_bias))
        return (state, 0,
                f"adapters fresh on the frozen base {ref.get('path', cfg.checkpoint.load)}", None)
    if cfg.checkpoint.load and is_megatron_load(str(cfg.checkpoint.load)):
        if step is not None:
            raise CheckpointError(f"checkpoint.step={step}: train.run_dir={cfg.train.run_dir} has no checkpoints, "
                                  f"and checkpoint.load={cfg.checkpoint.load} is a Megatron checkpoint, whose "
                                  f"iteration its tracker file names (or name one iter_NNNNNNN directory); drop "
                                  f"checkpoint.step.")
        state, optimizer = _megatron_state(setup, target, str(cfg.checkpoint.load))
        return state, 0, f"parameters from the Megatron checkpoint {cfg.checkpoint.load}, {optimizer}", None
    if cfg.checkpoint.load and is_hf_load(str(cfg.checkpoint.load)):
        if step is not None:
            raise CheckpointError(f"checkpoint.step={step}: train.run_dir={cfg.train.run_dir} has no checkpoints, "
                                  f"and checkpoint.load={cfg.checkpoint.load} is a Hugging Face model directory, "
                                  f"which has no steps; drop checkpoint.step.")
        return _hf_state(setup, target, str(cfg.checkpoint.load)), 0, (
            f"parameters from the Hugging Face model {cfg.checkpoint.load} (read onto the mesh tensor by tensor), "
            f"optimizer state fresh"), None
    if cfg.checkpoint.load:
        source = require_step_dir(cfg.checkpoint.load, "checkpoint.load", step)
        params, note = restore_params(source, load_target(target), cfg)
        state = with_params(setup.fresh_state(), params, target, setup.state_shardings)
        bias = restore_expert_bias(source, cfg)  # routing depends on it as on the router's weights
        if bias is not None:
            state = state.replace(moe_expert_bias=jax.device_put(bias, setup.state_shardings.moe_expert_bias))
        return state, 0, f"parameters from {source}, optimizer state fresh" + (f"; {note}" if note else ""), None
    if step is not None:
        raise CheckpointError(f"checkpoint.step={step}: train.run_dir={cfg.train.run_dir} has no checkpoints and "
                              f"checkpoint.load is not set; drop checkpoint.step to start afresh.")
    return setup.fresh_state(), 0, "fresh initialisation", None


def _same_base(cfg, recorded: dict, resume: Path) -> None:
    """CheckpointError when a LoRA run is resumed with a checkpoint.load other than the base its adapters were
    trained on (the resume would read the recorded base, not the one named: silently another model)."""
    if not cfg.checkpoint.load or not recorded:  # the base is read from the record (none: verified_base refuses)
        return
    try:
        named = base_reference(cfg).get("path")
    except CheckpointError:  # nothing there: the recorded base's own check says what is missing
        return
    was = recorded.get("path")
    if was is None or Path(named).resolve() != Path(was).resolve():  # the same directory by a link: the same
        was = was or f"a base initialised from train.seed={recorded.get('seed')}"
        raise CheckpointError(f"checkpoint.load = {cfg.checkpoint.load!r} names another base than the one the adapters "
                              f"of {resume} were trained on ({was}); a resume continues on that base. Drop "
                              f"checkpoint.load (the base is read from the checkpoint's record), or, to train "
                              f"adapters on {cfg.checkpoint.load}, start another train.run_dir.")


def frozen_base(setup: Setup, target: TrainState, ref: dict | None, where: str) -> tuple[dict, dict]:
    """(the frozen base parameters laid out like target.frozen, the reference read) of a run with
    adapters: read from the base checkpoint `ref` names, once verified_base has found it there and
    unchanged (megajax/checkpoint/lora_base.py), or initialised from its seed."""
    cfg = setup.cfg
    ref = verified_base(ref, where, seed_ok=True)
    if "seed" in ref:
        init = setup.init if ref["seed"] == cfg.train.seed else make_init_fn(
            build_model_spec(cfg, setup.plan.padded_vocab, mesh=setup.mesh, rules=setup.plan.rules,
                             seed=ref["seed"])[1], setup.tx, setup.scaler, ref["seed"], split=setup.spec.split)
        frozen = jax.jit(lambda: pad_state(init().frozen, target.frozen), out_shardings=setup.state_shardings.frozen)()
        return frozen, ref
    path = Path(ref["path"])
    if ref["format"] == "megatron":
        from megajax.checkpoint.megatron import import_megatron
        from megajax.models.layout import split_expert_bias
        params, _ = split_expert_bias(import_megatron(str(path), trust=cfg.checkpoint.trust_load)[1])
        frozen = jax.tree.map(place, params, target.frozen)
        return frozen, ref
    if ref["format"] == "hf":
        from flax import traverse_util
        from megajax.checkpoint.hf import open_hf
        from megajax.checkpoint.hf_stream import stream_hf
        like = traverse_util.flatten_dict(target.frozen, sep="/")
        with open_hf(str(path)) as hf:
            frozen = traverse_util.unflatten_dict(stream_hf(hf, like), sep="/")
        return frozen, ref
    frozen, _ = restore_params(path, target.frozen, cfg)
    return frozen, ref


def _hf_state(setup: Setup, target: TrainState, load: str) -> TrainState:
    """A fresh state with the parameters (and MoE expert bias) of the Hugging Face directory `load`,
    streamed onto the mesh with the run's shardings (megajax/checkpoint/hf_stream.py)."""
    from flax import traverse_util
    from megajax.checkpoint.hf import open_hf
    from megajax.checkpoint.hf_stream import hf_expert_bias, stream_hf
    like = traverse_util.flatten_dict(load_target(target), sep="/")
    with open_hf(load) as hf:
        state = setup.fresh_state().replace(params=None)  # its initial parameters freed before the reads
        state = with_params(state, traverse_util.unflatten_dict(stream_hf(hf, like), sep="/"), target,
                            setup.state_shardings)
        bias = hf_expert_bias(hf)
    if bias is not None and target.moe_expert_bias is not None:
        state = state.replace(moe_expert_bias=jax.device_put(bias, setup.state_shardings.moe_expert_bias))
    return state


def _hf_expert_bias(path: str):
    from megajax.checkpoint.hf import open_hf
    from megajax.checkpoint.hf_stream import hf_expert_bias
    with open_hf(path) as hf:
        return hf_expert_bias(hf)


def _megatron_state(setup: Setup, target: TrainState, load: str) -> tuple[TrainState, str]:
    """(a fresh state with the parameters (and MoE expert bias) of the Megatron checkpoint `load`, read
    by import_megatron (either format) and placed with the run's shardings, and with its Adam state
    (import_megatron_adam: the moments and the step count, which the schedule's count follows, as on
    a resume; its fp32 main parameters where it stores them) when it has one; what became of the
    optimizer state, in words)."""
    from megajax.checkpoint.megatron import import_megatron, import_megatron_adam
    from megajax.models.layout import split_expert_bias
    trust = setup.cfg.checkpoint.trust_load
    _, imported = import_megatron(load, trust=trust)
    params, bias = split_expert_bias(imported)
    adam = import_megatron_adam(load, trust=trust)
    if not isinstance(adam, str) and adam["params"] is not None:
        params = adam["params"]  # the fp32 main parameters of bf16/fp16 weights

    def placed(tree, like, what):
        want = jax.tree_util.tree_flatten_with_path(like)[0]
        got = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
        mismatched = [(jax.tree_util.keystr(p), tuple(t.shape), None if p not in got else tuple(got[p].shape))
                      for p, t in want if p not in got or tuple(got[p].shape) != tuple(t.shape)]
        if mismatched or len(got) != len(want):
            listed = "; ".join(f"{n}: the run expects {w}, the checkpoint has {g}" for n, w, g in mismatched[:4])
            raise CheckpointError(f"checkpoint.load = {load!r}: the Megatron checkpoint's {what} do not fit this "
                                  f"run's model ({listed or 'another set of tensors'}).")
        return jax.tree.map(place, tree, like)

    state = with_params(setup.fresh_state(), placed(params, load_target(target), "tensors"), target,
                        setup.state_shardings)
    if bias is not None:
        state = state.replace(moe_expert_bias=jax.device_put(np.asarray(bias, np.float32),
                                                             setup.state_shardings.moe_expert_bias))
    if isinstance(adam, str):
        return state, "optimizer state fresh" + ("" if adam == "the checkpoint holds none" else f" ({adam})")

    def count(c):
        return jax.device_put(np.asarray(adam["count"], c.dtype), c.sharding)
    opt = []
    # optax adamw: (Adam's moments and count, weight decay, the schedule's count)
    for part, like in zip(state.opt_state, target.opt_state):
        fields = getattr(part, "_fields", ())
        if "mu" in fields:
            part = part._replace(count=count(part.count), mu=placed(adam["mu"], like.mu, "Adam moments"),
                                 nu=placed(adam["nu"], like.nu, "Adam moments"))
        elif "count" in fields:
            part = part._replace(count=count(part.count))
        opt.append(part)
    state = state.replace(opt_state=type(state.opt_state)(opt))
    fp32 = ", fp32 main parameters" if adam["params"] is not None else ""
    return state, f"optimizer state from it (Adam moments{fp32}, step count {adam['count']})"


def _starts_fresh(cfg: Config) -> bool:
    """The run initialises its state (no checkpoint to resume, checkpoint.load or checkpoint.step)."""
    return (cfg.checkpoint.step is None and not cfg.checkpoint.load
            and find_step_dir(Path(cfg.train.run_dir) / "checkpoints", None) is None)


def _quiet(_: str) -> None:
    pass


def build_trainer(cfg: Config | RunPlan, devices: list | None = None,
                  check_compiled: Callable[[Setup, jax.stages.Compiled], None] | None = None,
                  say: Callable[[str], None] = _quiet) -> Trainer:
    """Plan (when given a config), setup, initial state, data and the compiled step of a run.

    `say` receives one line per slow stage (data, compile), so a user sees what is happening."""
    devices = list(devices if devices is not None else jax.devices())
    plan = cfg if isinstance(cfg, RunPlan) else make_plan(cfg, len(devices))
    setup = build_setup(plan, devices)
    say("megajax: preparing data (a first run indexes the dataset) ...")
    train_ds, valid_ds, report = build_run_datasets(plan.cfg, plan.tokenizer)
    loader = setup.loader(train_ds, plan.cfg.data.prefetch)
    valid_loader = (setup.loader(valid_ds, 0) if valid_ds is not None and plan.cfg.train.eval_every else None)

    def make_state() -> tuple[tuple, CompileWatch]:
        with CompileWatch() as watch:
            made = initial_state(setup)
            jax.block_until_ready(made[0])
        return made, watch

    # A fresh state is initialised on a second thread while this one compiles the train step: XLA
    # compiles each program on one core, outside Python's lock. (A restore stays ahead of the compile,
    # so a checkpoint that does not fit says so at once; several processes keep one order.)
    fresh = jax.process_count() == 1 and _starts_fresh(setup.cfg)
    pool = ThreadPoolExecutor(1, thread_name_prefix="megajax-init") if fresh else None
    try:
        pending = pool.submit(make_state) if pool else None
        if pending is None:
            made, state_watch = make_state()
            say(f"megajax: train state ready in {state_watch.seconds:.1f} s ({state_watch.source()})")
        say(f"megajax: compiling the train step for mesh {plan.mesh_text()} ...")
        ok = setup.ok_flag()
        with CompileWatch() as watch:
            compiled = setup.train_step(images=loader.images_shape is not None).lower(setup.target(), loader.abstract_batch(), ok).compile()
        compile_seconds = watch.seconds
        say(f"megajax: compiled the train step in {compile_seconds:.1f} s ({watch.source()})")
        if pending is not None:
            made, state_watch = pending.result()
            say(f"megajax: train state ready in {state_watch.seconds:.1f} s ({state_watch.source()})")
    finally:
        if pool:
            pool.shutdown(wait=True)
    state, consumed, origin, resumed = made
    lora_base = None
    if setup.spec.frozen_axes is not None:
        lora_base = (read_meta(find_step_dir(Path(plan.cfg.train.run_dir) / "checkpoints", resumed))["lora_base"]
                     if resumed is not None else base_reference(plan.cfg))
    if check_compiled is not None:  # e.g. megajax.perf.fit.fit_check, handed down by the CLI
        check_compiled(setup, compiled)
    return Trainer(setup=setup, state=state, step_fn=compiled, loader=loader, valid_loader=valid_loader,
                   eval_fn=setup.eval_step(images=loader.images_shape is not None), consumed_samples=consumed, origin=origin, resumed_step=resumed,
                   compile_seconds=compile_seconds, data_report=report, lora_base=lora_base)
