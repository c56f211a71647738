"""What a run does when things go wrong: non-finite steps, runs of skipped steps, a loss that does not
move, a resumed run's metrics, stop signals during start-up, and failed start-ups."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.manager import find_step_dir, read_meta
from megajax.config import load_config
from megajax.errors import CheckpointError, TrainingError
from megajax.train.loop import train
from megajax.plan import make_plan
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
ONE = jax.devices()[:1]
# A first step so large that the next one overflows: step 1 is finite, step 2 is not.
EXPLODE = ["optim.lr=1e30", "optim.warmup_steps=0", "optim.decay_style=constant", "optim.clip_grad=0"]


def strict_json_lines(path: Path) -> list[dict]:
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")
    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_non_finite_step_stops_and_saves_the_last_finite_state(small_config, tmp_path):
    run = tmp_path / "run"
    # No metrics are read before step 4's log: the loop learns of step 2 while later steps are queued.
    cfg = small_config(*EXPLODE, "train.log_every=4", f"train.run_dir={run}", steps=4)
    with pytest.raises(TrainingError, match=r"non-finite loss or gradients at step 2.*last good state "
                                            r"\(step 1\) is saved in .*checkpoints/1; rerun with train.run_dir"):
        train(cfg, ONE)
    step_dir = find_step_dir(run)
    assert step_dir.name == "1" and read_meta(step_dir)["consumed_samples"] == 8
    # It is exactly the state after step 1: the same run stopped after one step.
    one = train(small_config(*EXPLODE, f"train.run_dir={tmp_path / 'one'}", steps=1), ONE)
    from megajax.train.setup import build_trainer
    resumed = build_trainer(small_config(*EXPLODE, f"train.run_dir={run}", steps=4), ONE)
    resumed.loader.close()
    assert int(resumed.state.step) == 1 and resumed.consumed_samples == 8
    for a, b in zip(jax.tree.leaves(one.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_skipped_steps_stop_a_diverging_run_and_metrics_stay_json(small_config, tmp_path):
    run = tmp_path / "run"
    cfg = small_config(*EXPLODE, "train.skip_nonfinite=true", "train.max_skipped_steps=2",
                       f"train.run_dir={run}", steps=8)
    with pytest.raises(TrainingError, match=r"3 consecutive steps up to step 4 had non-finite .*"
                                            r"train.max_skipped_steps=2"):
        train(cfg, ONE)
    records = strict_json_lines(run / "metrics.jsonl")  # NaN is written as null
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["grad_norm"] is not None and [r["grad_norm"] for r in records[1:]] == [None] * 3
    assert [r["skipped_steps"] for r in records] == [0, 1, 2, 3]
    assert find_step_dir(run).name == "4"  # the state after the skipped steps (their updates were not applied)


def test_skip_count_in_final_line_and_fp16_settling_note(small_config, tmp_path, capsys):
    cfg = small_config("train.precision=fp16", f"train.run_dir={tmp_path / 'run'}", steps=3)
    result = train(cfg, ONE)
    out = capsys.readouterr().out
    assert result.skipped_steps == 3  # the scale falls from 2^32: nothing is applied in 3 steps
    assert "(loss scale settling)" in out and "done, 3 steps (3 skipped)" in out


def test_warning_when_the_loss_does_not_move(small_config, tmp_path, capsys):
    train(small_config("model.init_std=1e6", "optim.warmup_steps=1", f"train.run_dir={tmp_path / 'a'}",
                       steps=11), ONE)
    assert "has not moved from its first value" in capsys.readouterr().out
    train(small_config("optim.warmup_steps=1", f"train.run_dir={tmp_path / 'b'}", steps=11), ONE)
    assert "has not moved" not in capsys.readouterr().out


def test_resume_drops_metrics_of_steps_after_the_checkpoint(small_config, tmp_path):
    run = tmp_path / "run"
    cfg = small_config("checkpoint.every=2", "train.eval_every=0", f"train.run_dir={run}", steps=4)
    train(cfg, ONE)
    # As if killed after logging step 4 but before its checkpoint was written.
    import shutil
    shutil.rmtree(run / "checkpoints" / "4")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0')  # and a line cut short by the kill
    train(cfg, ONE)
    steps = [r["step"] for r in strict_json_lines(run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]


def test_failed_start_leaves_no_run_directory(small_config, tmp_path):
    run = tmp_path / "never"
    with pytest.raises(CheckpointError, match="checkpoint.load"):
        train(small_config(f"checkpoint.load={tmp_path / 'nope'}", f"train.run_dir={run}"), ONE)
    assert not run.exists()


def test_plan_notes_a_vocabulary_larger_than_the_tokenizer(small_config, tmp_path):
    plan = make_plan(small_config("model.vocab_size=50257"), 8)
    assert plan.padded_vocab == 50304
    assert any("model.vocab_size=50,257" in n and "257 ids" in n for n in plan.notes)
    assert make_plan(small_config(), 8).notes == ()
    # The preset a user reaches for, on the default byte data.
    preset = load_config(["model/gpt2-125m"], ["train.seq_len=64"])
    assert any("50,257" in n and "257 ids" in n for n in make_plan(preset, 1).notes)


def test_saved_config_holds_absolute_paths(small_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = small_config("train.run_dir=runs/rel", "checkpoint.load=ckpt", "data.path=data/corpus_text_document",
                       "data.cache_dir=cache")
    c = make_plan(cfg, 8).cfg
    assert (c.train.run_dir, c.checkpoint.load, c.data.path, c.data.cache_dir) == tuple(
        str(tmp_path / p) for p in ("runs/rel", "ckpt", "data/corpus_text_document", "cache"))
    blend = make_plan(small_config("data.path=[0.3, a/x, 0.7, b/y]"), 8).cfg.data.path
    assert blend == [0.3, str(tmp_path / "a/x"), 0.7, str(tmp_path / "b/y")]
    with pytest.raises(Exception, match=str(tmp_path / "tok" / "tokenizer.json")):
        make_plan(small_config("data.tokenizer=tok/tokenizer.json"), 8)  # names the absolute path it looked for


def test_sigterm_during_start_up_exits_zero(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, "-m", "megajax.cli", "train", "train.steps=2", "train.seq_len=32",
                          "model.num_layers=1", "data.corpus_max_mb=0.2", "logging.tensorboard=false",
                          "train.eval_every=0", f"train.run_dir={tmp_path / 'run'}"], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:  # the handler is in place once start-up reports progress
        lines.append(line)
        if "preparing data" in line:
            p.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + p.stdout.read()
    assert p.wait(timeout=300) == 0, out
    assert "SIGTERM received during start-up" in out


def test_default_run_directory_resumes_by_its_relative_name(tmp_path, monkeypatch):
    """`megajax train` without train.run_dir writes runs/<date>-<time> under the current directory;
    the user resumes it by that relative name (README's own flow)."""
    from conftest import SMALL
    monkeypatch.chdir(tmp_path)
    train(load_config(overrides=SMALL + ["train.steps=2"]), ONE)
    [run] = list((tmp_path / "runs").iterdir())
    assert find_step_dir(run).name == "2"
    again = train(load_config(overrides=SMALL + ["train.steps=3", f"train.run_dir=runs/{run.name}"]), ONE)
    assert int(again.state.step) == 3 and len(again.losses) == 1 and again.run_dir == run  # resumed at step 2
    assert [r["step"] for r in strict_json_lines(run / "metrics.jsonl")] == [1, 2, 3]
