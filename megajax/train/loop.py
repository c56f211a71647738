"""The training loop behind `megajax train`.

config -> mesh + rules -> model spec -> sharded train state -> compiled step
-> loop (log lines, metrics.jsonl, TensorBoard) -> greedy sample.
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from megajax.checkpoint.manager import (Checkpointer, find_step_dir, read_meta, require_step_dir,
                                        restore_params, restore_state)
from megajax.config import Config
from megajax.data.loader import Loader, batch_keys, build_run_datasets
from megajax.data.tokenizer import load_tokenizer
from megajax.errors import ConfigError, TrainingError
from megajax.mesh import data_parallel_size, make_mesh, make_rules, mesh_sizes, validate_for_model
from megajax.parallel.context import load_balanced_order
from megajax.perf.analytic import memory_estimate
from megajax.perf.fit import advice, check_fit, compiled_bytes, device_capacity_bytes
from megajax.train.flops import peak_tflops_per_device, train_flops_per_token
from megajax.train.metrics import MetricsLogger, device_memory_gib
from megajax.train.ops import RunOps
from megajax.train.optimizer import lr_schedule, make_optimizer
from megajax.train.state import (TrainState, build_model_spec, loss_scaler, make_init_fn,
                                 state_shardings)
from megajax.train.step import batch_shardings, jit_train_step, make_eval_step, make_train_step


@dataclass
class Trainer:
    """Everything built from a config, ready to run steps."""
    cfg: Config
    mesh: Any
    rules: Any
    spec: Any
    tokenizer: Any
    state: TrainState
    state_shardings: Any
    step_fn: Any  # compiled
    loader: Loader
    accumulation: int
    valid_loader: Loader | None
    eval_fn: Any  # jitted (params, batch) -> (loss sum, tokens)
    data_report: list
    consumed_samples: int  # data position of `state`
    origin: str  # where the state came from
    compile_seconds: float
    flops_per_step: float
    padded_vocab: int


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    compile_seconds: float = 0.0
    tokens_per_sec: float = float("nan")
    sample: str | None = None
    state: Any = None
    stopped_by: str | None = None  # SIGTERM / SIGINT when the run checkpointed and stopped early


def default_run_dir() -> str:
    return str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def initial_state(cfg: Config, init, abstract: TrainState, shardings: TrainState) -> tuple[TrainState, int, str]:
    """(state, consumed samples, description): the run directory's latest checkpoint if it has one
    (resume), else a fresh state, with checkpoint.load's parameters if given (fine-tuning)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    resume = find_step_dir(Path(cfg.train.run_dir) / "checkpoints") if cfg.train.run_dir else None
    if resume is not None:
        meta = read_meta(resume)
        state, note = restore_state(resume, target, cfg)
        return state, int(meta["consumed_samples"]), f"resumed from {resume} (step {meta['step']})" + \
            (f"; {note}" if note else "")
    state = jax.jit(init, out_shardings=shardings)()
    if cfg.checkpoint.load:
        source = require_step_dir(cfg.checkpoint.load, "checkpoint.load")
        params, note = restore_params(source, target.params, cfg)
        return state.replace(params=params), 0, f"parameters from {source}, optimizer state fresh" + \
            (f"; {note}" if note else "")
    return state, 0, "fresh initialisation"


def fit_check(cfg: Config, compiled, mesh, rules, spec, micro_batch: int) -> None:
    """Stops before the first step when the compiled step cannot fit in device memory."""
    memory = compiled_bytes(compiled)
    capacity, source = device_capacity_bytes(mesh.devices.flat[0], cfg.train.device_memory_gib)
    if memory is None or capacity is None or memory["total"] <= capacity:
        return
    sizes = mesh_sizes(mesh)
    estimate = memory_estimate(cfg, spec, rules, sizes, micro_batch, cfg.model.padded_vocab_size())
    check_fit(memory["total"], capacity, source, advice(cfg, sizes, micro_batch, estimate))


def build_trainer(cfg: Config, devices: list | None = None, check_memory: bool = True) -> Trainer:
    tokenizer = load_tokenizer(cfg.data.tokenizer, key="data.tokenizer")
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer.vocab_size
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer.vocab_size} ids, data.tokenizer={cfg.data.tokenizer!r}).")
    mesh = make_mesh(cfg, devices)
    validate_for_model(cfg, mesh)
    rules = make_rules(cfg)
    sizes = mesh_sizes(mesh)
    dp = data_parallel_size(mesh)
    micro = cfg.train.micro_batch or cfg.train.global_batch // dp
    accumulation = cfg.train.global_batch // (micro * dp)
    padded_vocab = cfg.model.padded_vocab_size()

    spec, init_params = build_model_spec(cfg, padded_vocab, mesh=mesh, rules=rules)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    scaler = loss_scaler(cfg)
    init = make_init_fn(init_params, tx, scaler, cfg.train.seed)
    abstract = jax.eval_shape(init)
    st_sh = state_shardings(mesh, rules, spec, tx, abstract)
    state, consumed, origin = initial_state(cfg, init, abstract, st_sh)

    b_sh = batch_shardings(mesh, rules, batch_keys(cfg, sizes["context"]))
    train_ds, valid_ds, report = build_run_datasets(cfg, tokenizer)
    order = load_balanced_order(cfg.train.seq_len, sizes["context"]) if sizes["context"] > 1 else None
    common = dict(global_batch=cfg.train.global_batch, accumulation=accumulation, seq_len=cfg.train.seq_len,
                  shardings=b_sh, eod_mask_loss=cfg.data.eod_mask_loss, order=order)
    loader = Loader(train_ds, prefetch=cfg.data.prefetch, **common)
    valid_loader = Loader(valid_ds, prefetch=0, **common) if valid_ds is not None and cfg.train.eval_every else None
    step = make_train_step(cfg, spec, tx, scaler, lr_schedule(cfg.optim, cfg.train.steps), mesh, rules)
    jitted = jit_train_step(step, st_sh, b_sh, mesh)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, loader.batch(consumed)).compile()
    compile_seconds = time.perf_counter() - t0
    if check_memory:
        fit_check(cfg, compiled, mesh, rules, spec, micro)
    eval_fn = jax.jit(make_eval_step(spec, mesh, rules), in_shardings=(st_sh.params, b_sh))
    flops = train_flops_per_token(cfg.model, cfg.train.seq_len, padded_vocab) * \
        cfg.train.global_batch * cfg.train.seq_len
    return Trainer(cfg=cfg, mesh=mesh, rules=rules, spec=spec, tokenizer=tokenizer, state=state,
                   state_shardings=st_sh, step_fn=compiled, loader=loader, accumulation=accumulation,
                   valid_loader=valid_loader, eval_fn=eval_fn, data_report=report,
                   consumed_samples=consumed, origin=origin,
                   compile_seconds=compile_seconds, flops_per_step=flops, padded_vocab=padded_vocab)


def count_params(abstract_params: dict) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))


def _describe(tr: Trainer, peak_source: str) -> str:
    cfg, sizes = tr.cfg, mesh_sizes(tr.mesh)
    m = cfg.model
    mesh_txt = " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 device"
    par = [k for k, on in (("sequence parallel", cfg.parallel.sequence_parallel),
                           ("distributed optimizer", cfg.parallel.distributed_optimizer)) if on]
    return (f"megajax: {m.family} model, {count_params(tr.spec.abstract_params) / 1e6:.2f}M parameters "
            f"({m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / {m.num_kv_heads} kv, "
            f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size} padded to {tr.padded_vocab}); "
            f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh {mesh_txt}"
            f"{'; ' + ', '.join(par) if par else ''}; recompute {cfg.parallel.recompute}; "
            f"precision {cfg.train.precision}; global batch {cfg.train.global_batch} = micro "
            f"{cfg.train.global_batch // tr.accumulation // data_parallel_size(tr.mesh)} x accumulation "
            f"{tr.accumulation} x data-parallel {data_parallel_size(tr.mesh)}; seq {cfg.train.seq_len}; "
            f"compiled in {tr.compile_seconds:.1f}s. MFU counts 6 x matmul params + causal attention "
            f"(lower triangle) per token, no recompute; peak from {peak_source}.")


class _StopSignals:
    """Records SIGTERM/SIGINT (a scheduler's preemption notice, Ctrl-C) so the loop can checkpoint and stop.

    With several processes, SIGTERM is left to the distributed runtime, which relays it to every
    process; `should_stop(step)` is then true on all of them at the same step (SIGINT is turned
    into a SIGTERM to this process to take the same path)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}
        self.multiprocess = jax.process_count() > 1

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT,) if self.multiprocess else self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum
        if self.multiprocess and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        """Called once per step by every process."""
        if not self.multiprocess:
            return self.received is not None
        from megajax.distributed import preemption_sync_point
        if preemption_sync_point(step):
            self.received = self.received or signal.SIGTERM
            return True
        return False

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(cfg: Config, devices: list | None = None) -> RunResult:
    if not cfg.train.run_dir:
        cfg.train.run_dir = default_run_dir()
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    tr = build_trainer(cfg, devices)
    if jax.process_index() == 0:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    dev = jax.devices()[0]
    peak, peak_source = peak_tflops_per_device(dev.device_kind, dev.platform, cfg.train.precision,
                                               jax.local_device_count(), cfg.train.peak_tflops)
    total, G = cfg.train.steps, cfg.train.global_batch
    state, consumed = tr.state, tr.consumed_samples
    start = int(jax.device_get(state.step))
    log = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                        total_steps=total, start_step=start)
    log.print(_describe(tr, peak_source))
    for line in tr.data_report + [f"state: {tr.origin}"]:
        log.print(line)
    result = RunResult(run_dir=run_dir, compile_seconds=tr.compile_seconds)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                async_save=cfg.checkpoint.async_save)
    saved_step = start if tr.origin.startswith("resumed") else None
    ops = RunOps(cfg, run_dir)
    evaluations = start // cfg.train.eval_every if cfg.train.eval_every else 0

    def save(step: int, wait: bool) -> None:
        nonlocal saved_step
        if saved_step == step:
            return
        meta = {"step": step, "consumed_samples": consumed, "config": cfg.to_dict(),
                "mesh": mesh_sizes(tr.mesh), "padded_vocab_size": tr.padded_vocab}
        checkpointer.save(step, state, meta, wait=wait)
        saved_step = step

    def evaluate(step: int) -> None:
        nonlocal evaluations
        loss_sum, count = 0.0, 0.0
        for k in range(cfg.train.eval_steps):
            batch = tr.valid_loader.batch((evaluations * cfg.train.eval_steps + k) * G)
            l, c = jax.device_get(tr.eval_fn(state.params, batch))
            loss_sum, count = loss_sum + float(l), count + float(c)
        evaluations += 1
        val = loss_sum / max(count, 1.0)
        ppl = math.exp(min(val, 80.0))
        result.val_losses.append((step, val))
        log.log({"step": step, "val_loss": val, "val_ppl": ppl}, console=False)
        log.print(f"validation at step {step} | loss {val:.4f} | ppl {ppl:.3f} | {int(count):,} tokens")

    skipped = 0

    def check(step_index: int, m: dict) -> None:
        nonlocal skipped
        result.losses.append(float(m["loss"]))
        if bool(m["skipped"]):
            skipped += 1
            if cfg.train.precision != "fp16" and not cfg.train.skip_nonfinite:
                raise TrainingError(
                    f"non-finite loss or gradients at step {step_index + 1}: loss={float(m['loss'])}, "
                    f"grad_norm={float(m['grad_norm'])}; the update was not applied. Lower optim.lr, "
                    f"check the data, or set train.skip_nonfinite=true to skip such steps.")

    interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
    interval_rates: list[float] = []
    pending: tuple[int, dict] | None = None
    try:
        with _StopSignals() as stop:
            for step_index in range(start, total):
                ops.step_begin(step_index + 1)
                state, metrics = tr.step_fn(state, tr.loader.batch(consumed))
                stopping = stop.should_stop(step_index + 1)
                consumed += G
                if pending is not None:  # one step behind, so the device stays busy
                    check(pending[0], jax.device_get(pending[1]))
                pending = (step_index, metrics)
                interval_steps += 1
                log.advance()
                step, last = step_index + 1, step_index + 1 == total
                if step % cfg.train.log_every == 0 or last or stopping:
                    host = jax.device_get(metrics)
                    check(step_index, host)
                    pending = None
                    step_time = (time.perf_counter() - interval_start - paused) / interval_steps
                    tflops = tr.flops_per_step / step_time / jax.device_count() / 1e12
                    mem, mem_kind = device_memory_gib()
                    record = {
                        # Like Megatron's log line: the mean loss over the steps since the last log.
                        "step": step, "loss": float(np.mean(result.losses[-interval_steps:])),
                        "lr": float(host["lr"]), "grad_norm": float(host["grad_norm"]),
                        "tokens_per_sec": G * cfg.train.seq_len / step_time, "tflops_per_device": tflops,
                        "mfu": tflops / peak if math.isfinite(peak) else None, "step_time": step_time,
                        "memory_gib": mem, "memory_kind": mem_kind, "skipped_steps": skipped,
                        "loss_scale": float(host["loss_scale"]) if cfg.train.precision == "fp16" else None,
                    }
                    result.records.append(record)
                    log.log(record)
                    ops.publish(record)
                    interval_rates.append(record["tokens_per_sec"])
                    interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
                ops.step_end(step, state)
                t0 = time.perf_counter()  # evaluation and saving are kept out of the throughput figures
                if tr.valid_loader is not None and (step % cfg.train.eval_every == 0 or last):
                    evaluate(step)
                if stopping or last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    save(step, wait=bool(stopping or last))
                paused += time.perf_counter() - t0
                if stopping:
                    result.stopped_by = signal.Signals(stop.received).name
                    log.print(f"megajax: {result.stopped_by} received: saved a checkpoint at step {step} "
                              f"in {checkpointer.directory}; rerun with train.run_dir={run_dir} to resume.")
                    break
    finally:
        ops.close()
        log.close()
        tr.loader.close()
        checkpointer.close()

    result.state = state
    if not result.losses:
        log.print(f"megajax: nothing to do; {tr.origin} is already at train.steps={total}.")
        return result
    steady = interval_rates[1:] or interval_rates
    result.tokens_per_sec = float(np.mean(steady)) if steady else float("nan")
    log.print(f"megajax: done, {len(result.losses)} steps; compile {tr.compile_seconds:.1f}s; "
              f"{result.tokens_per_sec:,.0f} tokens/s (mean of logged intervals after the first); "
              f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; run directory {run_dir}")
    if cfg.train.sample_tokens > 0 and result.stopped_by is None and jax.process_count() == 1:
        from megajax.inference.generate import greedy_generate
        prompt = tr.tokenizer.encode(cfg.train.sample_prompt)
        plain, _ = build_model_spec(cfg, tr.padded_vocab)  # no mesh-specific collectives: any batch size
        ids = greedy_generate(plain.apply, state.params, prompt, cfg.train.sample_tokens,
                              cfg.train.seq_len, eod_id=getattr(tr.tokenizer, "eod_id", None))
        result.sample = tr.tokenizer.decode(ids)
        log.print("megajax: greedy sample from the trained model:\n" + result.sample)
    return result
