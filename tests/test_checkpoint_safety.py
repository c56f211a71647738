"""Damaged checkpoints and `checkpoint.step`, as a user meets them: `megajax` commands run from the
run's parent directory, on one tiny run (steps 2 and 4) trained once for the module. Also: an
imported checkpoint's model config is the model of a run that loads it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megajax.checkpoint.integrity import RECORD, damage
from megajax.checkpoint.manager import verify_step
from megajax.cli import main
from megajax.errors import CheckpointError
from megajax.inference.load import find_source, generation_config
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.ffn_hidden_size=128",
        "train.seq_len=32", "train.global_batch=4", "train.log_every=1", "train.sample_tokens=0",
        "train.eval_every=0", "logging.tensorboard=false", "logging.progress=false", "data.corpus_max_mb=0.2"]
RUN = "runs/a"


def megajax(cwd: Path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               XLA_FLAGS=xla_flags())
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def one_paragraph(p, command: str) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"megajax {command}: error:") and p.stderr.count("\n") == 1, p.stderr
    return p.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A directory holding runs/a with checkpoints at steps 2 and 4 (each with its record of files)."""
    where = tmp_path_factory.mktemp("trained")
    p = megajax(where, "train", *TINY, f"train.run_dir={RUN}", "train.steps=4", "checkpoint.every=2")
    assert p.returncode == 0, p.stdout + p.stderr
    return where


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    shutil.copytree(trained / RUN, tmp_path / RUN)
    return tmp_path


def _largest_state_file(step_dir: Path) -> Path:
    return max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_every_committed_step_records_its_files(trained):
    for step in (2, 4):
        step_dir = trained / RUN / "checkpoints" / str(step)
        files = json.loads((step_dir / RECORD).read_text())["files"]
        assert any(name.startswith("state/") for name in files) and "meta/metadata" in files
        assert all((step_dir / name).stat().st_size == size for name, size in files.items())
        assert damage(step_dir) is None


def test_missing_file_and_unverified_step(copy):
    step_dir = copy / RUN / "checkpoints" / "4"
    victim = _largest_state_file(step_dir)
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"step 4 .* is damaged: {victim} is missing .*checkpoint\.step=2"):
        verify_step(step_dir)
    (step_dir / RECORD).unlink()  # no record (e.g. a crash between the commit and the record): read as it is
    assert verify_step(step_dir) == step_dir
    two = copy / RUN / "checkpoints" / "2"
    _largest_state_file(two).unlink()
    with pytest.raises(CheckpointError, match="step 2 .* No older checkpoint .* is intact"):
        verify_step(two)


def test_damaged_step_is_one_paragraph_and_checkpoint_step_uses_an_older_one(copy):
    """The user's sequence: truncate a data file of the newest step, then resume, generate, export."""
    victim = _largest_state_file(copy / RUN / "checkpoints" / "4")
    size = victim.stat().st_size
    os.truncate(victim, size // 2)
    train = ["train", *TINY, f"train.run_dir={RUN}", "train.steps=6", "checkpoint.every=2"]
    generate = ["generate", "--checkpoint", RUN, "--prompt", "def", "--max-new-tokens", "2"]
    export = ["export", "--format", "hf", "--checkpoint", RUN, "--output", "hf", "--dtype", "fp32"]
    for args in (train, generate, export):
        err = one_paragraph(megajax(copy, *args), args[0])
        assert "checkpoint step 4" in err and victim.name in err, err
        assert f"has {size // 2:,} bytes, recorded with {size:,}" in err, err
        assert "newest intact checkpoint is step 2" in err and "checkpoint.step=2" in err, err

    p = megajax(copy, *train, "checkpoint.step=2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resumed from {copy / RUN}/checkpoints/2 (step 2)" in p.stdout, p.stdout
    assert "the newer checkpoints (step 4) are moved to" in p.stdout and "step 6/6" in p.stdout, p.stdout
    assert sorted(d.name for d in (copy / RUN / "checkpoints").iterdir() if d.name.isdigit()) == ["2", "4", "6"]
    assert (copy / RUN / "checkpoints.superseded" / "4" / "state").is_dir()  # kept, not deleted
    assert damage(copy / RUN / "checkpoints" / "4") is None  # the run's own step 4
    steps = [json.loads(line)["step"] for line in (copy / RUN / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the abandoned records after step 2 were dropped

    p = megajax(copy, *generate, "checkpoint.step=4", "--json", "out.json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads((copy / "out.json").read_text())[0]["completion_ids"]) == 2
    p = megajax(copy, *export, "checkpoint.step=2")
    assert p.returncode == 0 and "checkpoints/2 -> hf" in p.stdout, p.stdout + p.stderr


def test_unverified_damaged_step_read_error_is_one_paragraph(copy):
    """A step without a record (saved before records existed, or a crash right after its commit) is read
    as it is; TensorStore's error while reading it becomes the same paragraph."""
    step_dir = copy / RUN / "checkpoints" / "4"
    (step_dir / RECORD).unlink()
    for f in (step_dir / "state").glob("ocdbt.process_*/d/*"):  # whichever holds the parameters
        os.truncate(f, 0)
    err = one_paragraph(megajax(copy, "generate", "--checkpoint", RUN, "--prompt", "def", "--max-new-tokens", "2"),
                        "generate")
    assert "checkpoint step 4" in err and "reading it failed" in err and "checkpoint.step=2" in err, err


def test_a_step_that_does_not_exist_lists_those_that_do(trained, monkeypatch, capsys):
    p = megajax(trained, "train", *TINY, f"train.run_dir={RUN}", "train.steps=6", "checkpoint.step=999")
    err = one_paragraph(p, "train")
    assert "checkpoint.step=999" in err and "has steps 2, 4" in err, err
    monkeypatch.chdir(trained)  # the quick refusals in this process
    export = ["export", "--format", "hf", "--checkpoint", RUN, "--output", "hf"]
    for extra, words in ((["checkpoint.step=999"], ["checkpoint.step=999", "has steps 2, 4"]),
                         (["train.steps=3"], ["train.steps", "checkpoint.step=N"])):
        assert main([*export, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), err
    with pytest.raises(CheckpointError, match="a Hugging Face directory"):
        find_source(None, "hf", step=2)
    assert find_source(RUN, None, step=2).step_dir.name == "2"  # generate and serve read step 2
    cfg = generation_config(find_source(RUN, None, step=2), ["checkpoint.step=2"])
    assert cfg.model.num_layers == 2 and cfg.checkpoint.load == ""


def test_imported_checkpoint_gives_its_model_to_the_run_that_loads_it(trained, tmp_path):
    """`megajax import` records the model config; `checkpoint.load` needs no model.* key, and one that
    contradicts the checkpoint is named with both values."""
    assert megajax(tmp_path, "export", "--format", "hf", "--checkpoint", str(trained / RUN), "--output", "hf",
                   "--dtype", "fp32").returncode == 0
    p = megajax(tmp_path, "import", "--format", "hf", "--input", "hf", "--output", "imported")
    assert p.returncode == 0, p.stderr
    base = ["train", "checkpoint.load=imported", "train.steps=1", "train.seq_len=32", "train.global_batch=2",
            "train.sample_tokens=0", "train.eval_every=0", "logging.tensorboard=false", "data.corpus_max_mb=0.2"]
    p = megajax(tmp_path, *base, "train.run_dir=ft")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(2 layers, hidden 64, 4 heads / 4 kv, ffn 128" in p.stdout and "parameters from" in p.stdout, p.stdout
    err = one_paragraph(megajax(tmp_path, *base, "train.run_dir=ft2", "model.num_layers=3", "model.hidden_size=64",
                                "model.hidden_dropout=0.1"), "train")
    assert "model.num_layers=3 but the checkpoint has model.num_layers=2" in err, err
    assert "hidden_size" not in err and "dropout" not in err, err  # agreeing and training-only keys pass
