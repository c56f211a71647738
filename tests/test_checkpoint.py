"""Checkpoints: exact resume, crash safety, SIGTERM, restoring onto other meshes, fine-tuning loads."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.manager import find_step_dir, read_meta
from megajax.errors import CheckpointError
from megajax.train.loop import build_trainer, train
from megajax.train.optimizer import update_count

ROOT = Path(__file__).resolve().parent.parent
FIXED_SCHEDULE = ["optim.decay_steps=6", "train.eval_every=0"]


def test_resume_is_bitwise_identical(small_config, tmp_path):
    full = train(small_config(*FIXED_SCHEDULE, f"train.run_dir={tmp_path / 'full'}", steps=6))
    part = [f"train.run_dir={tmp_path / 'part'}", "checkpoint.every=2", *FIXED_SCHEDULE]
    first = train(small_config(*part, steps=3))  # async save at 2 (then a step runs), final save at 3
    assert sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir()) == ["2", "3"]
    # The checkpoint written asynchronously at step 2 (while step 3 ran) is intact too: resume from it.
    shutil.copytree(tmp_path / "part", tmp_path / "from2")
    shutil.rmtree(tmp_path / "from2" / "checkpoints" / "3")
    second = train(small_config(*part, steps=6))
    np.testing.assert_array_equal(first.losses + second.losses, full.losses)
    assert read_meta(find_step_dir(tmp_path / "part"))["consumed_samples"] == 6 * 8
    again = train(small_config(*FIXED_SCHEDULE, f"train.run_dir={tmp_path / 'from2'}", steps=6))
    np.testing.assert_array_equal(again.losses, full.losses[2:])


TENSOR2_DATA4 = ["mesh.tensor=2", "mesh.data=4"]


@pytest.mark.parametrize("source, target", [
    (TENSOR2_DATA4, ["mesh.tensor=4", "mesh.fsdp=2", "mesh.data=1"]),
    (TENSOR2_DATA4, ["mesh.data=1"]),
    (["mesh.fsdp=8", "mesh.data=1", "parallel.distributed_optimizer=false"],
     ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true"]),
], ids=["tensor2_data4->tensor4_fsdp2", "tensor2_data4->one_device", "fsdp8->data2_tensor4_sp_zero1"])
def test_restore_onto_another_mesh(small_config, tmp_path, source, target):
    src = tmp_path / "src"
    train(small_config(*source, f"train.run_dir={src}", *FIXED_SCHEDULE, steps=2))
    ref_dir, new_dir = tmp_path / "ref", tmp_path / "new"
    shutil.copytree(src, ref_dir)
    shutil.copytree(src, new_dir)
    devices = jax.devices()[:1] if target == ["mesh.data=1"] else None
    before = build_trainer(small_config(*source, f"train.run_dir={ref_dir}", *FIXED_SCHEDULE, steps=3))
    after = build_trainer(small_config(*target, f"train.run_dir={new_dir}", *FIXED_SCHEDULE, steps=3), devices)
    vocab = before.cfg.model.vocab_size
    for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(before.state.params)[0],
                                 jax.tree_util.tree_flatten_with_path(after.state.params)[0]):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:  # vocabulary padding follows the tensor size
            axis = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y][0]
            a, b = np.take(a, range(vocab), axis=axis), np.take(b, range(vocab), axis=axis)
        np.testing.assert_array_equal(a, b, err_msg=str(path))
    assert int(after.state.step) == 2 and after.consumed_samples == 16
    next_before = train(before.cfg).losses
    next_after = train(after.cfg, devices).losses
    np.testing.assert_allclose(next_after, next_before, rtol=1e-5)


def test_load_parameters_with_fresh_optimizer(small_config, tmp_path):
    src = train(small_config(f"train.run_dir={tmp_path / 'src'}", steps=2))
    tr = build_trainer(small_config(f"train.run_dir={tmp_path / 'ft'}", f"checkpoint.load={tmp_path / 'src'}"))
    for a, b in zip(jax.tree.leaves(src.state.params), jax.tree.leaves(tr.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(update_count(tr.state.opt_state)) == 0 and int(tr.state.step) == 0
    assert "optimizer state fresh" in tr.origin


def test_mismatched_or_missing_checkpoints_are_clear_errors(small_config, tmp_path):
    train(small_config(f"train.run_dir={tmp_path / 'a'}", steps=1))
    with pytest.raises(CheckpointError, match=r"params\.embed\.embedding has shape \(384, 64\) but this run expects \(384, 128\)"):
        build_trainer(small_config(f"train.run_dir={tmp_path / 'a'}", "model.hidden_size=128"))
    with pytest.raises(CheckpointError, match="no megajax checkpoint there"):
        build_trainer(small_config(f"train.run_dir={tmp_path / 'b'}", f"checkpoint.load={tmp_path / 'nope'}"))


def _spawn(run_dir, *extra):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=str(ROOT))
    args = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "train.seq_len=32",
            "train.log_every=1", "train.sample_tokens=0", "train.eval_every=0", "logging.tensorboard=false",
            "data.corpus_max_mb=0.5", f"train.run_dir={run_dir}", *extra]
    return subprocess.Popen([sys.executable, "-m", "megajax.cli", "train", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_sigkill_during_async_save_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    p = _spawn(run, "train.steps=1000", "checkpoint.every=2")
    try:
        assert _wait_for(lambda: (ckpts / "2" / "meta").is_dir() and find_step_dir(run) is not None)
        # Kill while a later save is still in flight (its temporary directory exists).
        assert _wait_for(lambda: any("tmp" in d.name for d in ckpts.iterdir() if d.is_dir()))
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.communicate()
    last_good = find_step_dir(run)
    assert last_good is not None and (last_good / "state" / "_METADATA").is_file()
    step = read_meta(last_good)["step"]
    res = _spawn(run, f"train.steps={step + 2}", "checkpoint.every=2")
    out, _ = res.communicate(timeout=300)
    assert res.returncode == 0, out
    assert f"resumed from {last_good}" in out and f"step {step + 2}/{step + 2}" in out


def test_sigterm_checkpoints_and_exits_zero_then_resumes(tmp_path):
    run = tmp_path / "run"
    p = _spawn(run, "train.steps=1000")
    assert _wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert "SIGTERM received: saved a checkpoint" in out
    step = read_meta(find_step_dir(run))["step"]
    res = _spawn(run, f"train.steps={step + 1}")
    out, _ = res.communicate(timeout=300)
    assert res.returncode == 0 and f"step {step + 1}/{step + 1}" in out, out
