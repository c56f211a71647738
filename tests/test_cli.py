"""The `megajax` command end to end, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent


def megajax(*args, devices=1, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = xla_flags(devices)  # compiled as conftest.py's programs: several times faster
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def test_default_train_runs_end_to_end(tmp_path):
    """`megajax train` with the default config, shortened: logs, metrics.jsonl, TensorBoard, sample."""
    run = tmp_path / "run"
    p = megajax("train", "train.steps=6", "train.log_every=3", "train.seq_len=64", "model.num_layers=2",
                "data.corpus_max_mb=0.3", "train.eval_every=3", "data.split=90,10,0", "train.sample_tokens=12",
                f"train.run_dir={run}")
    assert p.returncode == 0, p.stderr
    assert "step 6/6" in p.stdout and "tok/s" in p.stdout and "MFU" in p.stdout
    # The first line names the run directory and the plan; the last says which losses it compares.
    first = p.stdout.splitlines()[0]
    assert first.startswith(f"megajax: run directory {run};") and "global batch 8 = micro 8 x accumulation 1" in first
    assert "precision fp32" in first and "mesh 1 device" in first
    assert "consumed samples 48" in p.stdout and "skipped 0" in p.stdout
    # The sample starts from a held-out document's first lines, is drawn (not greedy) and says how.
    head = "megajax: sample from the trained model (prompt: the first lines of a held-out document; "
    assert head + "temperature 0.8, top-p 0.95, seed 0):" in p.stdout
    assert "data: embedded corpus" in p.stdout and "_text_document" in p.stdout  # the indexed-dataset path
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [3, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "step_time"):
        assert all(key in r for r in records if "val_loss" not in r), key
    assert (run / "checkpoints" / "6" / "state").is_dir()
    logged = [r for r in records if "loss" in r]
    assert logged[-1]["loss"] < 5.6  # below the uniform byte-level loss ln(257) = 5.55 + noise
    assert [r["consumed_samples"] for r in logged] == [24, 48]
    assert (f"first logged loss {logged[0]['loss']:.4f} -> last {logged[-1]['loss']:.4f} "
            f"(validation {records[-1]['val_loss']:.4f})") in p.stdout
    assert (run / "config.yaml").read_text().startswith("model:")
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_cpu_mesh_preset_simulates_devices(tmp_path):
    p = megajax("train", "--config", "mesh/cpu-8", "train.steps=2", "train.seq_len=32", "model.num_layers=1",
                "data.corpus_max_mb=0.2", "train.sample_tokens=0", "train.eval_every=0", f"train.run_dir={tmp_path}",
                devices=None)
    assert p.returncode == 0, p.stderr
    assert "on 8 cpu devices" in p.stdout and "mesh data=2 x tensor=4" in p.stdout


@pytest.mark.parametrize("args, words", [
    (["model.num_hedas=4"], ["did you mean model.num_heads"]),
    (["mesh.tensor=3", "mesh.data=1"], ["mesh tensor=3", "devices"]),
    (["--config", "nope.yaml"], ["'nope.yaml' not found"]),
    # README's own example on a one-device CPU: the message says how to get 8 devices.
    (["mesh.data=2", "mesh.tensor=4"], ["uses 8 devices", "1 are available", "mesh.cpu_devices=8"]),
    (["mesh.data=2", "train.global_batch=3"], ["train.global_batch=3 does not split over the data-parallel size 2"]),
])
def test_user_errors_are_one_paragraph_without_traceback(args, words):
    p = megajax("train", *args, devices=1 if "mesh.tensor=4" in args else 2)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("megajax train: error:") and p.stderr.count("\n") == 1
    for w in words:
        assert w in p.stderr, p.stderr
    if "train.global_batch=3" in args:  # the user never set micro_batch: the message does not cite it
        assert "micro_batch" not in p.stderr, p.stderr


def test_options_and_overrides_in_any_order_and_start_up_progress(tmp_path):
    """An override before --config, options between overrides, relative paths from another directory."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    p = subprocess.run([sys.executable, "-m", "megajax.cli", "train", "train.steps=1", "--config", "model/tiny",
                        "train.seq_len=32", "model.num_layers=1", "--config", "mesh/gpu-1", "data.corpus_max_mb=0.2",
                        "train.sample_tokens=0", "train.eval_every=0", "logging.tensorboard=false",
                        "train.run_dir=runs/a"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.index("preparing data") < out.index("compiling the train step") < out.index("step 1/1")
    assert (tmp_path / "runs" / "a" / "checkpoints" / "1").is_dir()
    from megajax.cli import parse_args
    args = parse_args(["bench", "mesh.data=2", "--steps", "3", "train.seq_len=64", "--sweep", "train.x=1,2",
                       "--json", "b.json", "--config", "model/tiny"])
    assert (args.overrides, args.steps, args.sweep, args.json, args.config) == (
        ["mesh.data=2", "train.seq_len=64"], 3, "train.x=1,2", "b.json", ["model/tiny"])
