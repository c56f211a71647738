"""Run safety as a user meets it: `make test ARGS=...`, busy run directories, what a run says."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--config", "model/tiny", "train.seq_len=32", "model.num_layers=1", "data.corpus_max_mb=0.2",
        "train.sample_tokens=0", "train.eval_every=0", "logging.tensorboard=false"]


def _env(devices=1):
    return dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(devices))  # None: mesh.cpu_devices


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
    # The killed run saved no checkpoint, so the third starts over at step 1, after whatever records
    # the killed run logged before its kill (every 10 steps, in order).
    steps = [r["step"] for r in records]
    assert steps[-2:] == [1, 2] and steps[:-2] == sorted(steps[:-2]) and all(s % 10 == 0 for s in steps[:-2])
    assert lock.read_text() == ""  # released


def test_a_failed_start_up_leaves_no_directory(tmp_path):
    p = megajax("train", *TINY, "train.run_dir=new/run", "mesh.tensor=3", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args", [
    ["mesh.cpu_devices=4", "mesh.pipeline=4", "train.global_batch=2", "train.micro_batch=1"],
    ["mesh.cpu_devices=4", "mesh.pipeline=4", "train.global_batch=8", "train.micro_batch=4"],
    ["mesh.cpu_devices=8", "mesh.pipeline=2", "model.num_layers=3"],
    ["mesh.cpu_devices=8", "mesh.pipeline=4", "model.num_layers=6"],
])
def test_advice_offers_only_changes_that_differ_and_fit(tmp_path, args):
    """Each change the message offers differs from the config and plans on the same devices."""
    from megajax.config import load_config
    from megajax.plan import make_plan
    p = megajax("train", "--config", "model/tiny", *args, cwd=tmp_path, devices=None)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    problems = p.stderr.split("error: ", 1)[1].split(" Also: ")
    chosen = []
    for problem in problems:
        fixes = problem.split("; use ")[-1].rstrip(".\n").split(" or ")
        assert fixes, p.stderr
        for fix in fixes:
            for change in fix.split():
                assert re.fullmatch(r"[a-z_]+\.[a-z_]+=\d+", change) and change not in args, (change, p.stderr)
        chosen.append(fixes[0].split())
    for pick in [[c for fix in chosen for c in fix]] + ([[c for c in f.split()] for f in problems[0]
                                                         .split("; use ")[-1].rstrip(".\n").split(" or ")]
                                                        if len(problems) == 1 else []):
        keys = {c.split("=")[0] for c in pick}
        kept = [a for a in args if a.split("=")[0] not in keys and not a.startswith("mesh.cpu_devices")]
        make_plan(load_config(["model/tiny"], kept + pick), int(args[0].split("=")[1]))  # raises if it does not fit


def test_a_resume_that_changes_steps_schedule_or_batch_says_so(tmp_path):
    args = [*TINY, "train.run_dir=runs/r", "optim.warmup_steps=1", "train.log_every=1"]
    assert megajax("train", *args, "train.steps=2", cwd=tmp_path).returncode == 0
    p = megajax("train", *args, "train.steps=4", "optim.lr=1e-3", "train.global_batch=4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    [note] = [line for line in p.stdout.splitlines() if "this resume changes" in line]
    for words in ("step 2 was saved with", "train.steps 2 -> 4", "reaches its minimum at step 4 instead of 2",
                  "optim.lr 0.002 -> 0.001", "learning rate of step 3 is", "train.global_batch 8 -> 4",
                  "continues from sample 16"):
        assert words in note, note
    assert "micro_batch" not in note and "mesh" not in note, note  # only what changed
