"""The training loop behind `megajax train`: it loops and calls hooks.

    plan (megajax/plan.py) -> Trainer (megajax/train/setup.py) -> for each step:
        step -> health check -> log record -> ops -> validation -> checkpoint

Metrics are read one step late, so the device is never idle while the host
logs. Hooks: `MetricsLogger` (log lines, metrics.jsonl, TensorBoard),
`Health` (non-finite steps, skips, a loss that does not move), `Validation`,
`Saves` (checkpoints, including the last finite state when a run stops on a
non-finite step), `RunOps` (watchdog, Prometheus, profiler).

What the packages above this one add comes in through `train()`'s arguments
(this package imports neither megajax.perf nor megajax.inference):
`check_compiled(setup, compiled)` runs once the train step is compiled, before
the first step (`megajax train` passes megajax.perf.fit.fit_check), and each of
`on_end(trainer, result, say)` runs after a run that finished its steps
(`megajax train` passes megajax.inference.text.training_sample, the
end-of-training sample). `megajax.cli.run_training` is `train` with both.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from megajax import host_allocator
from megajax.checkpoint.manager import LOGICAL_SHAPES, Checkpointer, read_meta
from megajax.compile_cache import CompileWatch
from megajax.config import Config
from megajax.errors import TrainingError
from megajax.mesh import mesh_sizes
from megajax.precision.policy import precision_policy
from megajax.train.flops import peak_tflops_per_device
from megajax.train.metrics import MetricsLogger, device_memory_gib
from megajax.train.ops import MOE_RECORD_FIELDS, RunOps
from megajax.train.resume_changes import describe_changes
from megajax.train.run_lock import RunDirInUse, RunDirLock
from megajax.train.stop_signals import Interrupted, StopSignals
from megajax.plan import RunPlan, make_plan
from megajax.train.setup import Trainer, build_trainer  # noqa: F401  (build_trainer: public entry)


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # every step's loss (NaN for a non-finite one)
    grad_norms: list[float] = field(default_factory=list)  # every step's pre-clip gradient norm
    records: list[dict] = field(default_factory=list)  # the logged records (metrics.jsonl)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    compile_seconds: float = 0.0
    tokens_per_sec: float = float("nan")
    skipped_steps: int = 0
    sample: str | None = None  # set by an end hook (megajax.inference.text.training_sample): prompt + text
    sample_prompt: str | None = None  # that sample's prompt
    exact_match: dict[str, float] = field(default_factory=dict)  # 'before'/'after': set by the exact-match hooks
    state: Any = None
    stopped_by: str | None = None  # SIGTERM / SIGINT when the run checkpointed (or had not started) and stopped


def count_params(abstract_params: dict) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))


def describe(tr: Trainer, peak_source: str) -> str:
    """The line after compilation (the plan itself is the run's first line)."""
    ssd = " + the Mamba layers' chunked SSD" if tr.cfg.model.mamba_layers() else ""
    return (f"megajax: {count_params(tr.spec.abstract_params) / 1e6:.2f}M parameters on {jax.device_count()} "
            f"{jax.devices()[0].platform} devices; compiled in {tr.compile_seconds:.1f}s. MFU counts 6 x matmul "
            f"params + causal attention (lower triangle){ssd} per token, no recompute; peak from {peak_source}.")


# ----------------------------------------------------------------------------
# Hooks
# ----------------------------------------------------------------------------

class Health:
    """Watches each step's metrics: non-finite steps, runs of skipped steps, a loss that does not move.

    A non-finite step stops the run (after the last finite state is saved) unless steps may be
    skipped (train.skip_nonfinite, or fp16, where a skip lowers the loss scale); then more than
    train.max_skipped_steps consecutive skips stop it (with fp16 only those at the minimum loss
    scale count: before that, skipping is the scale settling)."""

    def __init__(self, cfg: Config, say):
        self.cfg, self.say = cfg, say
        self.fp16 = precision_policy(cfg).dynamic_loss_scale
        self.may_skip = cfg.train.skip_nonfinite or self.fp16
        self.skipped = 0  # in this process's part of the run
        self.consecutive = 0
        self.first_loss: float | None = None
        self.finite_steps = 0
        self.warned = False
        self.check_at = max(cfg.optim.warmup_steps, 10)

    def settling(self) -> bool:
        """fp16: no step has been applied yet while the loss scale falls from its initial value."""
        return self.fp16 and self.finite_steps == 0 and self.skipped > 0

    def check(self, step: int, m: dict) -> str | None:
        """Returns why the run must stop now (None: go on)."""
        loss, norm = float(m["loss"]), float(m["grad_norm"])
        if bool(m["skipped"]):
            self.skipped += 1
            if not self.may_skip:
                return (f"non-finite loss or gradients at step {step}: loss={loss}, grad_norm={norm}; the "
                        f"update was not applied. Lower optim.lr, check the data, or set "
                        f"train.skip_nonfinite=true to skip such steps.")
            at_floor = not self.fp16 or float(m["loss_scale"]) <= self.cfg.train.min_loss_scale
            self.consecutive = self.consecutive + 1 if at_floor else 0
            if self.consecutive > self.cfg.train.max_skipped_steps:
                return (f"{self.consecutive} consecutive steps up to step {step} had non-finite loss or "
                        f"gradients (train.max_skipped_steps={self.cfg.train.max_skipped_steps}"
                        f"{', at the minimum loss scale' if self.fp16 else ''}); the run is diverging. Lower "
                        f"optim.lr or check the data; raise train.max_skipped_steps to tolerate longer runs "
                        f"of skips.")
            return None
        self.consecutive = 0
        self.finite_steps += 1
        if self.first_loss is None:
            self.first_loss = loss
        if not self.warned and (self.finite_steps == self.check_at or norm == 0.0):
            self._check_moving(step, loss, norm)
        return None

    def _check_moving(self, step: int, loss: float, norm: float) -> None:
        self.warned = True
        if norm == 0.0 or abs(loss - self.first_loss) <= 1e-3 * max(abs(self.first_loss), 1.0):
            self.say(f"megajax: warning: after {step} steps the loss ({loss:.4f}) has not moved from its "
                     f"first value ({self.first_loss:.4f}) and the gradient norm is {norm:.3g}: the model is "
                     f"not learning. Check model.init_std (={self.cfg.model.init_std:g}), optim.lr "
                     f"(={self.cfg.optim.lr:g}) and the data.")


class Validation:
    """A validation pass every train.eval_every steps and at the end."""

    def __init__(self, tr: Trainer, log: MetricsLogger, result: RunResult, start: int):
        self.tr, self.log, self.result = tr, log, result
        every = tr.cfg.train.eval_every
        self.every = every
        self.count = start // every if every else 0
        self.compiled = False

    def due(self, step: int, last: bool) -> bool:
        return self.tr.valid_loader is not None and (step % self.every == 0 or last)

    def run(self, step: int, params, fp8=None, expert_bias=None, frozen=None) -> None:
        cfg, tr = self.tr.cfg, self.tr
        loss_sum, count = 0.0, 0.0
        for k in range(cfg.train.eval_steps):
            batch = tr.valid_loader.batch((self.count * cfg.train.eval_steps + k) * cfg.train.global_batch)
            if not self.compiled:  # the first call compiles the evaluation step
                with CompileWatch() as watch:
                    l, c = jax.device_get(tr.eval_fn(params, batch, fp8, expert_bias, frozen))
                self.compiled = True
                self.log.print(f"megajax: compiled and ran the first evaluation batch in {watch.seconds:.1f} s "
                               f"({watch.source()})")
            else:
                l, c = jax.device_get(tr.eval_fn(params, batch, fp8, expert_bias, frozen))
            loss_sum, count = loss_sum + float(l), count + float(c)
        self.count += 1
        val = loss_sum / max(count, 1.0)
        ppl = math.exp(min(val, 80.0))
        self.result.val_losses.append((step, val))
        self.log.log({"step": step, "val_loss": val, "val_ppl": ppl}, console=False)
        self.log.print(f"validation at step {step} | loss {val:.4f} | ppl {ppl:.3f} | {int(count):,} tokens")


class Saves:
    """Checkpoints: every checkpoint.every steps, at the end, on a stop signal, and the last finite state."""

    def __init__(self, tr: Trainer, run_dir: Path):
        cfg = tr.cfg
        self.tr, self.cfg = tr, cfg
        self.checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                         async_save=cfg.checkpoint.async_save)
        self.saved_step = tr.resumed_step

    @property
    def directory(self) -> Path:
        return self.checkpointer.directory

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        every = self.cfg.checkpoint.every
        return stopping or last or bool(every and step % every == 0)

    def save(self, step: int, state, consumed: int, wait: bool) -> None:
        if self.saved_step == step:
            return
        meta = {"step": step, "consumed_samples": consumed, "config": self.cfg.to_dict(),
                "mesh": mesh_sizes(self.tr.mesh), "padded_vocab_size": self.tr.plan.padded_vocab}
        padded = self.tr.setup.padding_record()  # arrays stored padded (their data-parallel split)
        if padded:
            meta[LOGICAL_SHAPES] = padded
        if state.frozen is not None:  # model.lora: the adapters and their optimizer state, and where the base is
            meta["lora_base"] = self.tr.lora_base
            state = state.replace(frozen=None)
        self.checkpointer.save(step, state, meta, wait=wait)
        self.saved_step = step

    def close(self) -> None:
        self.checkpointer.close()


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------

def _say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


CheckCompiled = Callable[[Any, Any], None]  # (Setup, compiled train step) -> None, or raises
EndHook = Callable[[Trainer, "RunResult", Callable[[str], None]], None]  # (trainer, result, say)


def train(cfg: Config | RunPlan, devices: list | None = None, *, check_compiled: CheckCompiled | None = None,
          on_start: Sequence[EndHook] = (), on_end: Sequence[EndHook] = ()) -> RunResult:
    """Trains as configured; resumes from train.run_dir's latest checkpoint when it has one.

    `check_compiled(setup, compiled)` runs before the first step (e.g. megajax.perf.fit.fit_check);
    the `on_start` hooks run, in order, before the first step with the trainer (its initial `state`),
    the result so far and the loop's print function; the `on_end` hooks after a run that finished its
    steps (not stopped by a signal), with the result holding the final `state`."""
    devices = list(devices if devices is not None else jax.devices())
    run_dir = None
    with StopSignals(_say) as stop:
        try:
            with stop.interruptible("during start-up, before the first step"):
                plan = cfg if isinstance(cfg, RunPlan) else make_plan(cfg, len(devices))
                run_dir = Path(plan.cfg.train.run_dir)
            with _hold_run_dir(run_dir) as lock:
                if lock is not None:
                    stop.at_exit.append(lock.release)
                with stop.interruptible("during start-up, before the first step"):
                    _say(f"megajax: run directory {run_dir}; {plan.describe()}")
                    tr = build_trainer(plan, devices, check_compiled=check_compiled, say=_say)
                    run_dir.mkdir(parents=True, exist_ok=True)
                    if jax.process_index() == 0:
                        (run_dir / "config.yaml").write_text(plan.cfg.to_yaml())
                    stop.started()
                return _loop(tr, run_dir, stop, on_end, on_start)
        except Interrupted as e:
            _say(f"megajax: {e.name} received {e.phase}: stopped; nothing to save"
                 + (f" (train.run_dir={run_dir} holds no new checkpoint)." if run_dir else "."))
            return RunResult(run_dir=run_dir, stopped_by=e.name)


@contextlib.contextmanager
def _hold_run_dir(run_dir: Path):
    """Process 0 holds the run directory's lock for the whole run (see run_lock.py); every process
    stops when it is refused. A start-up that fails before writing anything leaves no directory."""
    lock = RunDirLock(run_dir) if jax.process_index() == 0 else None
    refused: RunDirInUse | None = None
    try:
        note = lock.acquire() if lock else None
    except RunDirInUse as e:
        refused, note = e, None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        if int(multihost_utils.broadcast_one_to_all(np.int32(refused is not None))) and refused is None:
            refused = RunDirInUse(f"train.run_dir {str(run_dir)!r} is in use by another run (process 0 "
                                  f"was refused the directory's lock).")
    if refused is not None:
        raise refused
    if note:
        _say(note)
    try:
        yield lock
    finally:
        if lock:
            lock.release()


def _loop(tr: Trainer, run_dir: Path, stop: StopSignals, on_end: Sequence[EndHook] = (),
          on_start: Sequence[EndHook] = ()) -> RunResult:
    cfg, plan = tr.cfg, tr.plan
    total, G = cfg.train.steps, plan.batch.global_batch
    state, consumed = tr.state, tr.consumed_samples
    start = int(jax.device_get(state.step))
    log, peak = _open_log(tr, run_dir, start)
    result = RunResult(run_dir=run_dir, compile_seconds=tr.compile_seconds)
    saves = Saves(tr, run_dir)
    ops = RunOps(cfg, run_dir)
    health = Health(cfg, log.print)
    validation = Validation(tr, log, result, start)
    ok = tr.setup.ok_flag()
    try:
        with stop.interruptible("during start-up, before the first step"):
            for hook in on_start:
                hook(tr, result, log.print)
    except BaseException:
        ops.close()
        log.close()
        tr.loader.close()
        saves.close()
        raise

    pending: tuple[int, dict, int] | None = None  # (step, device metrics, consumed samples before it)
    last_good = (start, consumed)  # step and data position of the last finite step
    dispatched = start  # the step `state` is the result of

    halt: str | None = None  # why the run must stop, once a settled step says so

    def settle() -> dict | None:
        """Reads the pending step's metrics (None if nothing is pending)."""
        nonlocal pending, last_good, halt
        if pending is None:
            return None
        step, metrics, before = pending
        pending = None
        host = jax.device_get(metrics)
        result.losses.append(float(host["loss"]))
        result.grad_norms.append(float(host["grad_norm"]))
        why = health.check(step, host)
        if not bool(host["skipped"]):
            last_good = (step, before + G)
        halt = halt or why
        return host

    def stop_if_unhealthy() -> None:
        """Saves the last good state and stops the run when a settled step said so."""
        if halt is None:
            return
        # Skipping steps: `state` carries every dispatched step (the skipped ones changed nothing).
        # Otherwise `ok` went down at the bad step, so `state` is still the last finite one (see
        # Setup.train_step) although a later step may have been dispatched.
        good_step, good_consumed = (dispatched, consumed) if health.may_skip else last_good
        saves.save(good_step, state, good_consumed, wait=True)
        raise TrainingError(f"{halt} The last good state (step {good_step}) is saved in "
                            f"{saves.directory / str(good_step)}; rerun with train.run_dir={run_dir} "
                            f"to resume from it.")

    interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
    interval_wait = tr.loader.wait_seconds  # the loader's blocked time when the interval began
    interval_rates: list[float] = []
    try:
        for step_index in range(start, total):
            step, last = step_index + 1, step_index + 1 == total
            ops.step_begin(step)
            before = consumed
            state, metrics, ok = tr.step_fn(state, tr.loader.batch(consumed), ok)
            consumed, dispatched = consumed + G, step
            stopping = stop.should_stop(step)
            settle()  # the previous step's metrics, while this step runs
            stop_if_unhealthy()
            pending = (step, metrics, before)
            interval_steps += 1
            log.advance()
            if step % cfg.train.log_every == 0 or last or stopping:
                host = settle()
                step_time = (time.perf_counter() - interval_start - paused) / interval_steps
                waited = (tr.loader.wait_seconds - interval_wait) / (step_time * interval_steps)
                record = _record(tr, step, consumed, host, result.losses[-interval_steps:], step_time, peak, health)
                record["data_wait"] = min(max(waited, 0.0), 1.0)
                result.records.append(record)
                log.log(record)
                ops.publish(record)
                interval_rates.append(record["tokens_per_sec"])
                interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
                interval_wait = tr.loader.wait_seconds
                stop_if_unhealthy()
            ops.step_end(step, state)
            t0 = time.perf_counter()  # evaluation and saving are kept out of the throughput figures
            if validation.due(step, last):
                settle()
                stop_if_unhealthy()
                validation.run(step, state.params, state.fp8, state.moe_expert_bias, state.frozen)
            if saves.due(step, last, stopping):
                settle()
                stop_if_unhealthy()
                saves.save(step, state, consumed, wait=bool(stopping or last))
            paused += time.perf_counter() - t0
            if stopping:
                result.stopped_by = signal.Signals(stop.received).name
                log.print(f"megajax: {result.stopped_by} received: saved a checkpoint at step {step} "
                          f"in {saves.directory}; rerun with train.run_dir={run_dir} to resume.")
                break
        settle()
        stop_if_unhealthy()
    finally:
        ops.close()
        log.close()
        tr.loader.close()
        saves.close()

    result.state = state
    result.skipped_steps = health.skipped
    return _summary(tr, result, interval_rates, log, run_dir, on_end, stop)


def _open_log(tr: Trainer, run_dir: Path, start: int) -> tuple[MetricsLogger, float]:
    """(the run's logger, the device's peak TFLOP/s) after the run's opening lines."""
    cfg, dev = tr.cfg, jax.devices()[0]
    peak, peak_source = peak_tflops_per_device(dev.device_kind, dev.platform, precision_policy(cfg).peak_flops_key,
                                               jax.local_device_count(), cfg.train.peak_tflops)
    log = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                        total_steps=cfg.train.steps, start_step=start, resumed=tr.resumed_step is not None)
    log.print(describe(tr, peak_source))
    host = [f"host allocator: {host_allocator.described()}"] if dev.platform == "cpu" else []
    for line in list(tr.plan.notes) + tr.data_report + host + [f"state: {tr.origin}"]:
        log.print(line)
    if tr.resumed_step is not None:
        meta = read_meta(run_dir / "checkpoints" / str(tr.resumed_step))
        changes = describe_changes(meta.get("config", {}), meta.get("mesh"), cfg, tr.plan.sizes, start,
                                   tr.consumed_samples)
        if changes:
            log.print(changes)
    return log, peak


def _record(tr: Trainer, step: int, consumed: int, host: dict, losses: list[float], step_time: float,
            peak: float, health: Health) -> dict:
    """The logged record of an interval of steps ending at `step` (`host`: its metrics; `losses`:
    the interval's)."""
    plan = tr.plan
    tflops = tr.setup.flops_per_step / step_time / jax.device_count() / 1e12
    mem, mem_kind = device_memory_gib()
    record = {
        # Like Megatron's log line: the mean loss over the steps since the last log.
        "step": step, "consumed_samples": consumed, "loss": float(np.mean(losses)),
        "lr": float(host["lr"]), "grad_norm": float(host["grad_norm"]),
        "tokens_per_sec": plan.batch.tokens / step_time, "tflops_per_device": tflops,
        "mfu": tflops / peak if math.isfinite(peak) else None, "step_time": step_time,
        "memory_gib": mem, "memory_kind": mem_kind, "skipped_steps": health.skipped,
        "loss_scale": float(host["loss_scale"]) if health.fp16 else None,
    }
    record.update({k: float(host[k]) for k in MOE_RECORD_FIELDS if k in host})
    if "mtp_loss" in host:
        record["mtp_loss"] = float(host["mtp_loss"])
    if health.settling():
        record["note"] = "loss scale settling"
    return record


def _summary(tr: Trainer, result: RunResult, interval_rates: list[float], log: MetricsLogger, run_dir: Path,
             on_end: Sequence[EndHook], stop: StopSignals) -> RunResult:
    """The run's closing line, its mean throughput, and the end hooks (after a run that finished)."""
    if not result.losses:
        log.print(f"megajax: nothing to do; {tr.origin} is already at train.steps={tr.cfg.train.steps}.")
        return result
    steady = interval_rates[1:] or interval_rates
    result.tokens_per_sec = float(np.mean(steady)) if steady else float("nan")
    skipped = f" ({result.skipped_steps} skipped)" if result.skipped_steps else ""
    logged = [r["loss"] for r in result.records]
    losses = (f"first logged loss {logged[0]:.4f} -> last {logged[-1]:.4f}" if len(logged) > 1 else
              f"logged loss {logged[0]:.4f} (one logged step)" if logged else "no step logged")
    if result.val_losses:
        losses += f" (validation {result.val_losses[-1][1]:.4f})"
    log.print(f"megajax: done, {len(result.losses)} steps{skipped}; compile {tr.compile_seconds:.1f}s; "
              f"{result.tokens_per_sec:,.0f} tokens/s (mean of logged intervals after the first); "
              f"{losses}; run directory {run_dir}")
    if result.stopped_by is None:
        try:
            with stop.interruptible("after the last step"):
                for hook in on_end:
                    hook(tr, result, log.print)
        except Interrupted as e:
            log.print(f"megajax: {e.name} received {e.phase} (its checkpoint is saved): the end-of-training "
                      f"sample and scores are left out.")
            result.stopped_by = e.name
    return result
