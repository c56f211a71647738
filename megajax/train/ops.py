"""Operating a run: hang watchdog, Prometheus metrics, profiler window (the `ops` config section).

The loop calls `RunOps.step_begin(step)` before a step and `step_end(step, state)`
after it (evaluation and checkpointing happen in between steps, outside the
watched time), `publish(record)` for each logged record, and `close()` at the end.

- `StepWatchdog`: a thread that fires when one step runs longer than
  max(ops.hang_factor x median recent step time, ops.hang_timeout): it writes
  every thread's stack to `<run_dir>/logs/hang_process_<i>.txt` and exits the
  process with status 3 (in a multi-process run the others then stop on the
  runtime's heartbeat check), so a stuck collective becomes a restartable failure.
- `PrometheusExporter`: process 0 serves /metrics on ops.prometheus_port.
- `ProfileWindow`: a JAX profiler trace of steps [a, b] in `<run_dir>/profile/process_<i>`
  (open with TensorBoard's profile plugin or XProf); the file written is printed when it stops.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax

from megajax.config import Config
from megajax.errors import ConfigError

HANG_EXIT_STATUS = 3
MIN_STEPS_FOR_MEDIAN = 5  # steps timed before hang_factor applies


def hang_limit(durations: list[float] | deque, factor: float, timeout: float) -> float | None:
    """Seconds one step may take: max(factor x median duration, timeout), a 0 dropping its term."""
    terms = [timeout] if timeout > 0 else []
    if factor > 0 and len(durations) >= MIN_STEPS_FOR_MEDIAN:
        terms.append(factor * statistics.median(durations))
    return max(terms) if terms else None


def dump_stacks(path: Path, header: str) -> None:
    """Every Python thread's stack (with thread names) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(path, "w") as f:
        f.write(header + "\n\n")
        for ident, frame in sys._current_frames().items():
            f.write(f"Thread {names.get(ident, '?')} (id {ident}), most recent call last:\n")
            f.write("".join(traceback.format_stack(frame)) + "\n")
        f.write("faulthandler view of all threads:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)


class StepWatchdog:
    """Fires `on_hang(step, elapsed, limit)` when a step outlasts its limit (see `hang_limit`)."""

    def __init__(self, factor: float, timeout: float, on_hang: Callable[[int, float, float], None],
                 window: int = 100):
        self.factor, self.timeout, self.on_hang = factor, timeout, on_hang
        self.durations: deque[float] = deque(maxlen=window)
        self._cond = threading.Condition()
        self._step: int | None = None
        self._started = 0.0
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="megajax-step-watchdog", daemon=True)
        self._thread.start()

    def step_begin(self, step: int) -> None:
        limit = hang_limit(self.durations, self.factor, self.timeout)
        with self._cond:
            self._step, self._started = step, time.monotonic()
            self._deadline = None if limit is None else self._started + limit
            self._cond.notify()

    def step_end(self) -> None:
        with self._cond:
            if self._step is not None:
                self.durations.append(time.monotonic() - self._started)
            self._step, self._deadline = None, None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                step, elapsed = self._step, time.monotonic() - self._started
                limit = self._deadline - self._started
                self._deadline = None
            self.on_hang(step, elapsed, limit)


def exit_on_hang(run_dir: Path, cfg: Config) -> Callable[[int, float, float], None]:
    """The production hang handler: stack dump, message on stderr, exit status 3."""
    def fire(step: int, elapsed: float, limit: float) -> None:
        index = jax.process_index()
        path = run_dir / "logs" / f"hang_process_{index}.txt"
        why = (f"max({cfg.ops.hang_factor:g} x median step time, ops.hang_timeout={cfg.ops.hang_timeout:g} s)")
        message = (f"megajax: process {index}: step {step} has run {elapsed:.1f} s, over the hang limit "
                   f"{limit:.1f} s = {why}; wrote every thread's stack to {path} and exiting with status "
                   f"{HANG_EXIT_STATUS}. Restart with the same train.run_dir to resume from the last checkpoint.")
        try:
            dump_stacks(path, message)
        finally:
            print(message, file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(HANG_EXIT_STATUS)
    return fire


@dataclass(frozen=True)
class RecordField:
    help: str
    gauge: str | None = None  # its Prometheus gauge (None: not exported as one)


# The fields of a logged record (console line, metrics.jsonl, TensorBoard, Prometheus): the one list of
# their names. The MoE fields are the train step's MoE metrics (train/step.py's MOE_METRIC_KEYS are these),
# copied into the record when the step returns them.
RECORD_FIELDS = {
    "step": RecordField("last logged training step", "megajax_step"),
    "consumed_samples": RecordField("samples consumed so far (the data position)", "megajax_consumed_samples"),
    "loss": RecordField("training loss (mean over the last log interval)", "megajax_loss"),
    "lr": RecordField("learning rate", "megajax_learning_rate"),
    "grad_norm": RecordField("global gradient norm", "megajax_grad_norm"),
    "tokens_per_sec": RecordField("training throughput, tokens per second", "megajax_tokens_per_second"),
    "tflops_per_device": RecordField("model TFLOP/s per device", "megajax_tflops_per_device"),
    "mfu": RecordField("model FLOPs utilisation (0..1)", "megajax_mfu"),
    "step_time": RecordField("mean step time over the last log interval", "megajax_step_time_seconds"),
    "data_wait": RecordField("fraction of the interval's wall time the step loop waited for the data loader "
                             "(0: the loader kept ahead)", "megajax_data_wait_fraction"),
    "memory_gib": RecordField("memory in use (GiB): device bytes in use, or host peak RSS on CPU"),
    "memory_kind": RecordField("what memory_gib measures: device, or host peak RSS"),
    "skipped_steps": RecordField("steps skipped for non-finite loss or gradients so far"),
    "loss_scale": RecordField("fp16 dynamic loss scale (null without fp16)"),
    "note": RecordField("a remark on the interval (e.g. the fp16 loss scale settling)"),
    "mtp_loss": RecordField("multi-token prediction's cross entropy (mean over its depths; model.mtp_num_layers)",
                            "megajax_mtp_loss"),
    "moe_aux_loss": RecordField("MoE load-balancing loss (mean over MoE layers)", "megajax_moe_aux_loss"),
    "moe_z_loss": RecordField("MoE router z-loss (mean over MoE layers)", "megajax_moe_z_loss"),
    "moe_max_expert_share": RecordField("busiest expert's share of token assignments",
                                        "megajax_moe_max_expert_share"),
    "moe_min_expert_share": RecordField("idlest expert's share of token assignments",
                                        "megajax_moe_min_expert_share"),
    "moe_dropped_fraction": RecordField("fraction of token assignments dropped by capacity",
                                        "megajax_moe_dropped_fraction"),
}
MOE_RECORD_FIELDS = tuple(k for k in RECORD_FIELDS if k.startswith("moe_"))
GAUGES = {key: (f.gauge, f.help) for key, f in RECORD_FIELDS.items() if f.gauge}  # record key -> (name, help)


class PrometheusExporter:
    """Serves the latest logged metrics at http://<host>:port/metrics (its own registry)."""

    def __init__(self, port: int):
        try:
            from prometheus_client import CollectorRegistry, Gauge, start_http_server
        except ImportError:
            raise ConfigError(f"ops.prometheus_port = {port} needs the prometheus-client package: "
                              f"pip install 'megajax[ops]' (or prometheus-client), or set ops.prometheus_port=0.") from None
        self.registry = CollectorRegistry()
        self.gauges = {key: Gauge(name, doc, registry=self.registry) for key, (name, doc) in GAUGES.items()}
        self.memory = Gauge("megajax_memory_bytes", "memory in use: device bytes in use, or host peak RSS on CPU",
                            ["kind"], registry=self.registry)
        try:
            self.server, self.thread = start_http_server(port, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"ops.prometheus_port = {port}: cannot serve metrics there ({e}); choose a free "
                              f"port or set ops.prometheus_port=0.") from None

    def update(self, record: dict) -> None:
        for key, gauge in self.gauges.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and value == value:
                gauge.set(value)
        if record.get("memory_gib") is not None:
            kind = "device" if record.get("memory_kind") == "device" else "host_peak_rss"
            self.memory.labels(kind=kind).set(record["memory_gib"] * 2**30)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ProfileWindow:
    """Traces steps first..last (1-based, inclusive) with the JAX profiler."""

    def __init__(self, first: int, last: int, directory: Path):
        self.first, self.last, self.directory = first, last, directory
        self.active = False

    def step_begin(self, step: int) -> None:
        if not self.active and self.first <= step <= self.last:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def step_end(self, step: int, state: Any) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """Where the trace went: the newest .xplane.pb under the directory (the profiler adds
        plugins/profile/<timestamp>/), and how to open it."""
        traces = sorted(self.directory.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        where = traces[-1] if traces else self.directory
        root = self.directory.parent
        return (f"megajax: profiler trace of steps {self.first} to {self.last} written to {where}; open it with "
                f"`tensorboard --logdir {root}` (profile plugin) or `xprof --logdir {root}`.")


class RunOps:
    """Watchdog, metrics endpoint and profiler of one run, as configured by `cfg.ops`."""

    def __init__(self, cfg: Config, run_dir: Path, on_hang: Callable[[int, float, float], None] | None = None):
        o = cfg.ops
        self.watchdog = None
        if o.hang_factor > 0 or o.hang_timeout > 0:
            self.watchdog = StepWatchdog(o.hang_factor, o.hang_timeout, on_hang or exit_on_hang(run_dir, cfg))
        self.exporter = PrometheusExporter(o.prometheus_port) if o.prometheus_port and jax.process_index() == 0 \
            else None
        self.profile = None
        if o.profile_steps:
            self.profile = ProfileWindow(*o.profile_steps, run_dir / "profile" / f"process_{jax.process_index()}")

    def step_begin(self, step: int) -> None:
        if self.profile is not None:
            self.profile.step_begin(step)
        if self.watchdog is not None:
            self.watchdog.step_begin(step)

    def step_end(self, step: int, state: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.step_end()
        if self.profile is not None:
            self.profile.step_end(step, state)

    def publish(self, record: dict) -> None:
        if self.exporter is not None:
            self.exporter.update(record)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.profile is not None:
            self.profile.stop()
        if self.exporter is not None:
            self.exporter.close()
