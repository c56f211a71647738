"""Checkpoints: exact resume, crash safety, SIGTERM, restoring onto other meshes, fine-tuning loads,
vocabulary changes, and paths relative to the current directory (as users type them)."""

import json
import os
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.manager import CheckpointSource, find_step_dir, read_meta
from megajax.checkpoint.vocab import check_vocabulary
from megajax.cli import main
from megajax.errors import CheckpointError
from megajax.train.loop import build_trainer, train
from megajax.train.optimizer import update_count
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
FIXED_SCHEDULE = ["optim.decay_steps=6", "train.eval_every=0"]


def test_resume_is_bitwise_identical(small_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # every run directory below is relative
    full = train(small_config(*FIXED_SCHEDULE, "train.run_dir=full", steps=6))
    part = ["train.run_dir=part", "checkpoint.every=2", *FIXED_SCHEDULE]
    first = train(small_config(*part, steps=3))  # async save at 2 (then a step runs), final save at 3
    assert sorted(p.name for p in Path("part/checkpoints").iterdir()) == ["2", "3"]
    # The checkpoint written asynchronously at step 2 (while step 3 ran) is intact too: resume from it.
    shutil.copytree("part", "from2")
    shutil.rmtree("from2/checkpoints/3")
    second = train(small_config(*part, steps=6))
    np.testing.assert_array_equal(first.losses + second.losses, full.losses)
    assert read_meta(find_step_dir("part"))["consumed_samples"] == 6 * 8
    again = train(small_config(*FIXED_SCHEDULE, "train.run_dir=from2", steps=6))
    np.testing.assert_array_equal(again.losses, full.losses[2:])


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
    """(path, gathered host array) of every leaf."""
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


TENSOR2_DATA4 = ["mesh.tensor=2", "mesh.data=4"]


@pytest.mark.parametrize("source, target", [
    ([*TENSOR2_DATA4, "parallel.distributed_optimizer=true"], ["mesh.tensor=4", "mesh.fsdp=2", "mesh.data=1"]),
    (TENSOR2_DATA4, ["mesh.data=1"]),
    (["mesh.fsdp=8", "mesh.data=1", "parallel.distributed_optimizer=false"],
     ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true"]),
], ids=["tensor2_data4_zero1->tensor4_fsdp2", "tensor2_data4->one_device", "fsdp8->data2_tensor4_sp_zero1"])
def test_restore_onto_another_mesh(small_config, tmp_path, source, target):
    src = tmp_path / "src"
    saved = train(small_config(*source, f"train.run_dir={src}", *FIXED_SCHEDULE, steps=2)).state
    ref_dir, new_dir = tmp_path / "ref", tmp_path / "new"
    shutil.copytree(src, ref_dir)
    shutil.copytree(src, new_dir)
    devices = jax.devices()[:1] if target == ["mesh.data=1"] else None
    after = build_trainer(small_config(*target, f"train.run_dir={new_dir}", *FIXED_SCHEDULE, steps=3), devices)
    # Every leaf bitwise: parameters, both Adam moments, counters, step, RNG.
    a, b = _leaves(saved), _leaves(after.state)
    assert [p for p, _ in a] == [p for p, _ in b] and any(".mu" in p for p, _ in a)
    for (path, x), (_, y) in zip(a, b):
        assert x.shape == y.shape and np.array_equal(x, y), path
    assert int(after.state.step) == 2 and after.consumed_samples == 16
    next_before = train(small_config(*source, f"train.run_dir={ref_dir}", *FIXED_SCHEDULE, steps=3)).losses
    next_after = train(after.cfg, devices).losses
    np.testing.assert_allclose(next_after, next_before, rtol=1e-5)


def test_load_parameters_from_a_relative_directory_with_fresh_optimizer(small_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = train(small_config("train.run_dir=runs/src", steps=2))
    tr = build_trainer(small_config("train.run_dir=runs/ft", "checkpoint.load=runs/src"))
    for a, b in zip(jax.tree.leaves(src.state.params), jax.tree.leaves(tr.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(update_count(tr.state.opt_state)) == 0 and int(tr.state.step) == 0
    assert "optimizer state fresh" in tr.origin and "resize" not in tr.origin


def test_mismatched_or_missing_checkpoints_are_clear_errors(small_config, tmp_path):
    train(small_config(f"train.run_dir={tmp_path / 'a'}", steps=1))
    with pytest.raises(CheckpointError, match=r"params\.embed\.embedding has shape \(384, 64\) but this run expects \(384, 128\)"):
        build_trainer(small_config(f"train.run_dir={tmp_path / 'a'}", "model.hidden_size=128"))
    with pytest.raises(CheckpointError, match="no megajax checkpoint there"):
        build_trainer(small_config(f"train.run_dir={tmp_path / 'b'}", f"checkpoint.load={tmp_path / 'nope'}"))
    with pytest.raises(CheckpointError, match=r"has 384 \(padded\) vocabulary rows but this run has 512.*resize_vocab=true"):
        build_trainer(small_config(f"train.run_dir={tmp_path / 'a'}", "model.make_vocab_size_divisible_by=256"))


def test_another_vocabulary_is_refused_unless_resize_vocab(small_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = train(small_config("train.run_dir=byte", steps=1))  # 257 ids (byte tokenizer) -> 384 rows
    big = train(small_config("train.run_dir=big", "model.vocab_size=2000", steps=1))  # 2,048 rows
    # Resuming with another vocabulary, and loading a 2,000-id checkpoint into a byte run: refused.
    with pytest.raises(CheckpointError, match=r"257 ids \(data\.tokenizer='byte'.*2,000 ids .*resize_vocab=true"):
        build_trainer(small_config("train.run_dir=byte", "model.vocab_size=2000"))
    with pytest.raises(CheckpointError, match=r"checkpoint\.load reads \S*big\S*, .*2,000 ids.*257 ids.*resize_vocab"):
        build_trainer(small_config("train.run_dir=ft", "checkpoint.load=big"))

    # Explicit: the 2,000-id embedding cropped to the byte run's 384 rows, rows from 257 on zero.
    ft = build_trainer(small_config("train.run_dir=ft", "checkpoint.load=big", "checkpoint.resize_vocab=true"))
    assert "checkpoint.resize_vocab: vocabulary changed from 2,000 ids" in ft.origin
    stored, got = np.asarray(big.state.params["embed"]["embedding"]), np.asarray(ft.state.params["embed"]["embedding"])
    assert got.shape == (384, 64)
    np.testing.assert_array_equal(got[:257], stored[:257])
    assert not got[257:].any()
    np.testing.assert_array_equal(np.asarray(ft.state.params["output"])[:, :257],
                                  np.asarray(big.state.params["output"])[:, :257])

    # Resume 257 -> 2,000 ids: zero-padded rows, optimizer moments too, everything else unchanged.
    grown = build_trainer(small_config("train.run_dir=byte", "model.vocab_size=2000", "checkpoint.resize_vocab=true"))
    assert "and their optimizer state" in grown.origin and int(grown.state.step) == 1
    adam = grown.state.opt_state[0]
    for new, old in ((grown.state.params["embed"]["embedding"], small.state.params["embed"]["embedding"]),
                     (adam.mu["embed"]["embedding"], small.state.opt_state[0].mu["embed"]["embedding"]),
                     (adam.nu["output"].T, small.state.opt_state[0].nu["output"].T)):
        new, old = np.asarray(new), np.asarray(old)
        assert new.shape[0] == 2048 and old.shape[0] == 384
        np.testing.assert_array_equal(new[:257], old[:257])
        assert not new[257:].any() and old[:257].any()
    np.testing.assert_array_equal(np.asarray(grown.state.params["layers"]["mlp"]["up"]["kernel"]),
                                  np.asarray(small.state.params["layers"]["mlp"]["up"]["kernel"]))


def test_vocabulary_message_names_both_tokenizers(small_config):
    cfg = small_config("data.tokenizer=tok/tokenizer.json", "model.vocab_size=2000")
    stored = {"model": {"vocab_size": 257}, "data": {"tokenizer": "byte"}}
    with pytest.raises(CheckpointError) as e:
        check_vocabulary(Path("runs/a/checkpoints/5"), stored, cfg, "resume")
    assert ("resuming from runs/a/checkpoints/5, whose vocabulary has 257 ids (data.tokenizer='byte', "
            "model.vocab_size=257), but this run's has 2,000 ids (data.tokenizer='tok/tokenizer.json'") in str(e.value)
    assert check_vocabulary(Path("x"), {"model": {"vocab_size": 2000}}, cfg, "load") is None
    cfg.checkpoint.resize_vocab = True
    resize = check_vocabulary(Path("x"), stored, cfg, "load")
    assert (resize.keep_rows, resize.padded) == (257, 2048)


def test_export_from_a_relative_checkpoint_path(small_config, tmp_path, monkeypatch):
    from safetensors.numpy import load_file
    monkeypatch.chdir(tmp_path)
    run = train(small_config("train.run_dir=runs/a", steps=1))
    assert main(["export", "--format", "hf", "--checkpoint", "runs/a", "--output", "out/hf", "--dtype", "fp32"]) == 0
    weights = {}
    for f in Path("out/hf").glob("*.safetensors"):
        weights.update(load_file(f))
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"],
                                  np.asarray(run.state.params["embed"]["embedding"])[:257])
    # One layer of a stacked tensor, read alone, from a relative step directory.
    source = CheckpointSource("runs/a/checkpoints/1")
    np.testing.assert_array_equal(source.get("layers/mlp/up/kernel", layer=1),
                                  np.asarray(run.state.params["layers"]["mlp"]["up"]["kernel"][1]))
    assert main(["export", "--format", "megatron", "--ckpt-format", "torch", "--checkpoint", "runs/a/checkpoints/1",
                 "--output", "out/mcore"]) == 0
    assert any(Path("out/mcore").rglob("model_optim_rng.pt"))


# ----------------------------------------------------------------------------
# The `megajax train` command in a subprocess, in a relative run directory
# ----------------------------------------------------------------------------

RUN_DIR = "runs/a"


def _spawn(cwd: Path, *extra):
    env = dict(os.environ, XLA_FLAGS=xla_flags(), PYTHONPATH=str(ROOT))
    args = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "train.seq_len=32",
            "train.log_every=1", "train.sample_tokens=0", "train.eval_every=0", "logging.tensorboard=false",
            "data.corpus_max_mb=0.5", *extra]
    return subprocess.Popen([sys.executable, "-m", "megajax.cli", "train", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def _in_flight(ckpts: Path) -> list[Path]:
    """Orbax's temporary directories of saves not yet committed."""
    return [d for d in ckpts.iterdir() if d.is_dir() and "tmp" in d.name] if ckpts.is_dir() else []


def test_sigkill_during_async_save_keeps_the_last_good_checkpoint(tmp_path):
    ckpts = tmp_path / RUN_DIR / "checkpoints"
    for attempt in range(3):  # a save may commit between seeing its directory and the kill landing
        p = _spawn(tmp_path, f"train.run_dir={RUN_DIR}", "train.steps=1000", "checkpoint.every=2")
        try:
            assert _wait_for(lambda: find_step_dir(tmp_path / RUN_DIR) is not None and _in_flight(ckpts))
            p.send_signal(signal.SIGKILL)
            p.wait()
        finally:
            p.kill()
            p.communicate()
        # Proof that the kill landed mid-save: the save's temporary directory outlived the process.
        if _in_flight(ckpts):
            break
    else:
        pytest.fail("three SIGKILLs all landed after the save they aimed at had committed")
    last_good = find_step_dir(tmp_path / RUN_DIR)
    step = read_meta(last_good)["step"]
    interrupted = [int(m.group(1)) for d in _in_flight(ckpts) if (m := re.match(r"(\d+)", d.name))]
    assert interrupted and max(interrupted) > step, (interrupted, step)
    res = _spawn(tmp_path, f"train.run_dir={RUN_DIR}", f"train.steps={step + 2}", "checkpoint.every=2")
    out, _ = res.communicate(timeout=300)
    assert res.returncode == 0, out
    assert f"resumed from {tmp_path / RUN_DIR}/checkpoints/{step} (step {step})" in out, out
    assert f"step {step + 2}/{step + 2}" in out


def test_sigterm_checkpoints_and_exits_zero_then_the_printed_command_resumes(tmp_path):
    p = _spawn(tmp_path, f"train.run_dir={RUN_DIR}", "train.steps=1000")
    metrics = tmp_path / RUN_DIR / "metrics.jsonl"
    assert _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    rerun = re.search(r"SIGTERM received: saved a checkpoint at step (\d+) .*rerun with (train\.run_dir=\S+) to "
                      r"resume", out)
    assert rerun and rerun.group(2) == f"train.run_dir={tmp_path / RUN_DIR}", out  # works from any directory
    step = int(rerun.group(1))
    assert step == read_meta(find_step_dir(tmp_path / RUN_DIR))["step"]
    res = _spawn(tmp_path, rerun.group(2).rstrip("."), f"train.steps={step + 1}")
    out, _ = res.communicate(timeout=300)
    assert res.returncode == 0 and f"resumed from {tmp_path / RUN_DIR}/checkpoints/{step}" in out, out
    assert f"step {step + 1}/{step + 1}" in out
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == step + 1
