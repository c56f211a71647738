"""Operating a run: the hang watchdog, the Prometheus endpoint, profiler traces, bad `ops` keys."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megajax.config import load_config
from megajax.errors import ConfigError
from megajax.train.ops import HANG_EXIT_STATUS, MIN_STEPS_FOR_MEDIAN, StepWatchdog, hang_limit

from conftest import SMALL, xla_flags

ROOT = Path(__file__).resolve().parent.parent


def test_hang_limit_is_the_larger_of_factor_x_median_and_timeout():
    assert hang_limit([], factor=10, timeout=0) is None  # no median yet, no timeout: no limit
    assert hang_limit([], factor=10, timeout=60) == 60
    steps = [1.0, 2.0, 100.0, 2.0, 1.5]
    assert len(steps) == MIN_STEPS_FOR_MEDIAN
    assert hang_limit(steps, factor=10, timeout=5) == 20.0  # 10 x median 2.0: one slow step does not count
    assert hang_limit(steps, factor=10, timeout=60) == 60
    assert hang_limit(steps, factor=0, timeout=0) is None


def test_watchdog_fires_once_on_the_slow_step():
    fired = []
    dog = StepWatchdog(factor=5, timeout=0, on_hang=lambda *a: fired.append(a))
    try:
        for step in range(1, MIN_STEPS_FOR_MEDIAN + 1):
            dog.step_begin(step)
            time.sleep(0.02)
            dog.step_end()
        assert not fired
        dog.step_begin(99)
        time.sleep(1.0)  # > 5 x ~0.02 s
        dog.step_end()
    finally:
        dog.close()
    assert len(fired) == 1
    step, elapsed, limit = fired[0]
    assert step == 99 and 0.09 < limit < 0.5 and elapsed >= limit


@pytest.mark.parametrize("override, words", [
    ("ops.hang_factor=-1", ["ops.hang_factor = -1", ">= 0"]),
    ("ops.prometheus_port=70000", ["ops.prometheus_port = 70000", "0 for no endpoint"]),
    ("ops.profile_steps=[5]", ["ops.profile_steps = [5]", "[first, last]"]),
    ("ops.profile_steps=[4,2]", ["ops.profile_steps = [4, 2]", "first <= last"]),
    ("ops.profile_step=[1,2]", ["did you mean ops.profile_steps"]),
])
def test_bad_ops_keys(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    for w in words:
        assert w in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu",
                PYTHONPATH=str(ROOT))


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("megajax_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_prometheus_endpoint_and_profile_during_a_run(tmp_path):
    run, port = tmp_path / "run", _free_port()
    p = subprocess.Popen([sys.executable, "-m", "megajax.cli", "train", *SMALL, "train.steps=100000",
                          "checkpoint.every=0", f"train.run_dir={run}", f"ops.prometheus_port={port}",
                          "ops.profile_steps=[2,3]"], env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline, metrics = time.monotonic() + 180, {}
        while metrics.get("megajax_step", 0) < 5:
            assert time.monotonic() < deadline and p.poll() is None, "no metrics served"
            try:
                metrics = _scrape(port)
            except OSError:
                pass
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, out
    for name in ("megajax_loss", "megajax_learning_rate", "megajax_grad_norm", "megajax_tokens_per_second",
                 "megajax_tflops_per_device", "megajax_mfu", "megajax_step_time_seconds"):
        assert metrics[name] > 0, name
    assert 0 < metrics["megajax_loss"] < 10 and metrics["megajax_mfu"] < 1
    assert metrics['megajax_memory_bytes{kind="host_peak_rss"}'] > 2**20  # CPU: the process's peak RSS
    traces = list((run / "profile" / "process_0").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    assert f"megajax: profiler trace of steps 2 to 3 written to {traces[0]}; open it with" in out


STALL = """
import sys, time
from megajax.cli import main
from megajax.data.loader import Loader

batch = Loader.batch
def stalled_in_the_data_pipeline():
    time.sleep(600)
def stalling_batch(self, consumed):
    if consumed == 8 * 8:  # step 9
        stalled_in_the_data_pipeline()
    return batch(self, consumed)
Loader.batch = stalling_batch
sys.exit(main(sys.argv[1:]))
"""


def test_watchdog_dumps_every_stack_and_exits_on_a_stalled_step(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", STALL, "train", *SMALL, "train.steps=100", f"train.run_dir={run}",
                        "ops.hang_factor=10", "ops.hang_timeout=2"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == HANG_EXIT_STATUS, p.stdout + p.stderr
    assert time.monotonic() - t0 < 120
    dump = run / "logs" / "hang_process_0.txt"
    assert f"wrote every thread's stack to {dump}" in p.stderr and "step 9 has run" in p.stderr
    assert "ops.hang_timeout=2 s" in p.stderr
    text = dump.read_text()
    assert "step 9 has run" in text
    assert "stalled_in_the_data_pipeline" in text and "Thread MainThread" in text  # the stuck thread ...
    assert "megajax-step-watchdog" in text  # ... and every other one
    assert " 8/100 | consumed samples" in p.stdout and " 9/100 | consumed samples" not in p.stdout


def test_logged_records_use_the_one_list_of_field_names(small_config):
    """RECORD_FIELDS names every field a logged record has (and the Prometheus gauges come from it);
    its MoE fields are the train step's MoE metrics."""
    import jax
    from megajax.train.loop import train
    from megajax.train.ops import GAUGES, MOE_RECORD_FIELDS, RECORD_FIELDS
    assert set(GAUGES) <= set(RECORD_FIELDS) and all(name.startswith("megajax_") for name, _ in GAUGES.values())
    result = train(small_config("model.num_experts=4", "model.moe_ffn_hidden_size=32", steps=1), jax.devices()[:1])
    [record] = result.records
    assert set(MOE_RECORD_FIELDS) <= set(record) <= set(RECORD_FIELDS), set(record) - set(RECORD_FIELDS)
