"""Run safety as a user meets it: `make test ARGS=...`, busy run directories, what a run says."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--config", "model/tiny", "train.seq_len=32", "model.num_layers=1", "data.corpus_max_mb=0.2",
        "train.sample_tokens=0", "train.eval_every=0", "logging.tensorboard=false"]


def _env(devices=1):
    return dict(os.environ, PYTHONPATH=str(ROOT),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")


def megajax(*args, cwd, devices=1, timeout=600):
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True,
                          env=_env(devices), cwd=cwd, timeout=timeout)


def test_make_test_args_select_what_they_name(tmp_path):
    """`make test ARGS="tests/x.py"` collects that file only; ARGS without a path keep all of tests/."""
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml: make does not reinstall

    def collect(args):
        p = subprocess.run(["make", "-s", "-C", str(ROOT), "test", f"PY={sys.executable}", f"STAMP={stamp}",
                            f"ARGS=--collect-only -q -p no:cacheprovider {args}"],
                           capture_output=True, text=True, env=_env(8), timeout=600)
        assert p.returncode in (0, 5), p.stdout + p.stderr  # 5: everything deselected
        return p.stdout

    # With make's -q and this -q pytest prints one "file: count" line per file collected.
    files = [line.split(":")[0] for line in collect("tests/test_config.py").splitlines() if ": " in line]
    assert files == ["tests/test_config.py"]
    files = [line.split(":")[0] for line in collect("").splitlines() if line.startswith("tests/")]
    assert len(files) > 40 and "tests/test_config.py" in files and "tests/test_pipeline.py" in files


def test_a_busy_run_directory_is_refused_and_a_dead_holders_lock_taken_over(tmp_path):
    run_args = [*TINY, "train.run_dir=runs/shared"]
    lock = tmp_path / "runs" / "shared" / "run.lock"
    first = subprocess.Popen([sys.executable, "-m", "megajax.cli", "train", *run_args, "train.steps=100000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=tmp_path)
    try:
        deadline = time.time() + 300
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None and time.time() < deadline, "the first run never took the lock"
            time.sleep(0.2)
        holder = json.loads(lock.read_text())
        assert holder["pid"] == first.pid

        second = megajax("train", *run_args, "train.steps=2", cwd=tmp_path)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        for words in ("runs/shared", "in use by another run", f"PID {first.pid}", holder["host"], "since"):
            assert words in second.stderr, second.stderr
        assert first.poll() is None  # the refused run did not disturb the first
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()

    third = megajax("train", *run_args, "train.steps=2", "train.log_every=1", cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert "took over" in third.stdout and f"PID {first.pid}" in third.stdout, third.stdout
    records = [json.loads(line) for line in (tmp_path / "runs/shared/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert lock.read_text() == ""  # released


def test_a_failed_start_up_leaves_no_directory(tmp_path):
    p = megajax("train", *TINY, "train.run_dir=new/run", "mesh.tensor=3", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert not (tmp_path / "new").exists()
