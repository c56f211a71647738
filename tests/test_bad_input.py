"""Wrong input on `megajax plan`, `megajax config from-megatron`, `train`, `import` and `generate`, as a user
types it: each class of mistake is one paragraph on stderr naming the option, key, file or flag, the bad
value and what is accepted, with exit status 2, and nothing wrong is accepted in silence. Every command
runs as a subprocess and stops before anything compiles. (`megajax serve`: tests/test_bad_input_serve.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "megatron_core_0_19"
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def megajax(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def paragraph(p: subprocess.CompletedProcess, command: str, *words: str) -> str:
    """The one-paragraph error of `megajax COMMAND` (exit status 2, no traceback), holding every word."""
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"megajax {command}: error:") and p.stderr.count("\n") == 1, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)
    return p.stderr


# ----------------------------------------------------------------------------------------------
# megajax plan

@pytest.mark.parametrize("kinds, words", [
    ("H100: {efficiency: 5}\n", ["kind 'H100': efficiency = 5", "(0, 1]"]),
    ("H100: {memory_gib: -5}\n", ["memory_gib = -5", "> 0"]),
    ("H100: {node_size: 2.5}\n", ["node_size = 2.5", "whole number"]),
    ("H100: {peak_tflops: {bf16: fast}}\n", ["peak_tflops = {'bf16': 'fast'}", "that holds bf16"]),
    ("- H100\n", ["expected a mapping of kind name", "got list"]),
    ("GB-200: {memory_gib: 186, peak_tflops: 2500}\n", ["kind name 'GB-200'", "letters and digits"]),
    ("GB200: {memory_gib: 186}\n", ["kind 'GB200'", "needs memory_gib and peak_tflops", "peak_tflops missing"]),
])
def test_device_kind_fields_are_checked(tmp_path, kinds, words):
    (tmp_path / "kinds.yaml").write_text(kinds)
    p = megajax("plan", "--config", "model/tiny", "--cluster", "8xH100", "--device-kinds", str(tmp_path / "kinds.yaml"))
    paragraph(p, "plan", f"--device-kinds {tmp_path / 'kinds.yaml'}", *words)


def test_a_plain_peak_is_the_peak_of_every_precision(tmp_path):
    (tmp_path / "kinds.yaml").write_text("H100: {peak_tflops: 989}\n")
    p = megajax("plan", "--config", "model/tiny", "--cluster", "8xH100", "--device-kinds", str(tmp_path / "kinds.yaml"),
                "--top", "1")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert " 1. " in p.stdout and "MFU" in p.stdout


def test_a_cluster_every_layout_of_which_is_refused_names_the_checks():
    """7 H100s for Llama 3 8B: tensor 7 does not divide the heads, and the global batch of 8 does not split
    over 7 data-parallel ranks; the report says so and exits 2 (it printed an empty ranking with 0)."""
    p = megajax("plan", "--config", "model/llama3-8b", "--cluster", "7xH100")
    paragraph(p, "plan", "--cluster 7xH100", "refuse every layout of 7 H100", "model.num_heads=32 is not divisible "
              "by mesh.tensor=7", "train.global_batch=8")
    assert p.stdout == ""


@pytest.mark.parametrize("args, words", [
    (["--top", "0"], ["--top 0: must be >= 1"]),
    (["--top", "-3"], ["--top -3: must be >= 1"]),
    (["--cluster", "0xH100"], ["--cluster '0xH100'", "COUNT in 1..1048576"]),
    (["--cluster", "100000000xH100"], ["--cluster '100000000xH100'", "COUNT in 1..1048576"]),
    (["mesh.tensor=3"], ["no layout of 8 H100 has mesh.tensor=3", "must divide 8"]),
    (["--json", "."], ["--json .: cannot write a file there: it is a directory"]),
    (["--output", "README.md/mesh.yaml"], ["--output README.md/mesh.yaml", "is a file, where a directory"]),
])
def test_plan_options(args, words):
    cluster = [] if "--cluster" in args else ["--cluster", "8xH100"]
    paragraph(megajax("plan", "--config", "model/tiny", *cluster, *args), "plan", *words)


def test_nothing_fitting_exits_1_and_says_so():
    p = megajax("plan", "--config", "model/llama3-70b", "--cluster", "8xA100")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "nothing fits; the smallest per-device memory:" in p.stdout
    assert "megajax plan: nothing fits 8xA100: every layout needs more than 72.0 GiB per device" in p.stderr


# ----------------------------------------------------------------------------------------------
# megajax config from-megatron: what Megatron's parse_args / validate_args refuse, and the plan

@pytest.mark.parametrize("args, words", [
    (["--num-layers", "abc", "--hidden-size", "64"], ["--num-layers abc: 'abc' is not an integer"]),
    (["--lr", "fast"], ["--lr fast: 'fast' is not a number"]),
    (["--normalization", "Foo"], ["--normalization Foo: 'Foo' is not one of Megatron's choices: LayerNorm, RMSNorm"]),
    (["--bf16", "yes"], ["--bf16 yes: a switch takes no value"]),
    (["--num-layers"], ["--num-layers: no value given"]),
    (["--num-layers", "2", "3"], ["--num-layers 2 3: one value, given 2", "unrecognized arguments: 3"]),
    (["32", "--num-layers", "2"], ["32: a value without a flag before it"]),
    (["--rotary-base", "1e6"], ["--rotary-base 1e6: '1e6' is not an integer"]),
])
def test_from_megatron_refuses_what_megatrons_argparse_refuses(args, words):
    p = megajax("config", "from-megatron", "--", *args)
    paragraph(p, "config", "Megatron-LM would refuse these arguments", *words)
    assert p.stdout == ""


@pytest.mark.parametrize("args, words", [
    (["--fp16", "--bf16"], ["--fp16 with --bf16"]),
    (["--train-iters", "10", "--train-samples", "100"], ["--train-iters with --train-samples",
                                                         "expected iteration-based training"]),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "10"], ["--lr-warmup-fraction with --lr-warmup-iters"]),
    (["--save", "ckpt"], ["--save without --save-interval"]),
    (["--seq-length", "100", "--max-position-embeddings", "50"], ["max_position_embeddings (50) must be greater"]),
    (["--expert-model-parallel-size", "4"], ["--expert-model-parallel-size 4 without --num-experts"]),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], ["accepted sizes: 1, 2, 3, 6"]),
])
def test_from_megatron_refuses_what_validate_args_refuses(args, words):
    p = megajax("config", "from-megatron", "--", *SMALL_MODEL, *args)
    paragraph(p, "config", "Megatron-LM would refuse these arguments", *words)


@pytest.mark.parametrize("options, args, words", [
    # The case: printed although the YAML was said to be checked.
    ([], ["--tensor-model-parallel-size", "3"], ["on 3 devices", "model.num_heads=4 is not divisible by mesh.tensor=3"]),
    (["--world-size", "6"], ["--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--micro-batch-size", "1"],
     ["on --world-size 6", "train.global_batch=8 is not a multiple", "data-parallel size 3"]),
    (["--world-size", "0"], [], ["--world-size 0: must be >= 1"]),
    ([], ["--world-size", "8"], ["--world-size is megajax's option, not a Megatron flag: put it before the --"]),
])
def test_from_megatron_runs_the_plan_checks_of_train(options, args, words):
    p = megajax("config", "from-megatron", *options, "--", *SMALL_MODEL, *args)
    paragraph(p, "config", *words)
    assert p.stdout == ""


def test_from_megatron_plans_on_the_world_size():
    p = megajax("config", "from-megatron", "--world-size", "8", "--", *SMALL_MODEL, "--tensor-model-parallel-size",
                "2", "--global-batch-size", "8", "--micro-batch-size", "1")
    assert p.returncode == 0, p.stderr
    assert ("planned as megajax train plans it on --world-size 8: mesh data=4 x tensor=2, global batch 8 = micro 1 x "
            "accumulation 2 x data-parallel 4") in p.stderr
    # --group-query-attention alone is Megatron's default of one query group, which tensor 2 cannot split.
    p = megajax("config", "from-megatron", "--", *SMALL_MODEL, "--group-query-attention")
    assert p.returncode == 0, p.stderr
    assert "  num_kv_heads: 1  # --group-query-attention (Megatron's --num-query-groups 1)\n" in p.stdout
    p = megajax("config", "from-megatron", "--", *SMALL_MODEL, "--group-query-attention", "--tensor-model-parallel-size",
                "2")
    paragraph(p, "config", "model.num_kv_heads=1 is not divisible by mesh.tensor=2")


# ----------------------------------------------------------------------------------------------
# megajax train: the run directory and the train.* ranges (refused before anything compiles)

TRAIN = ["--config", "model/tiny", "train.steps=1", "train.seq_len=32", "model.num_layers=1", "train.sample_tokens=0",
         "train.eval_every=0", "logging.tensorboard=false", "data.corpus_max_mb=0.2"]


def _unwritable(tmp_path: Path) -> Path:
    """A directory path this user cannot make: under a read-only directory, or (root writes anywhere) /proc."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked / "run" if not os.access(locked, os.W_OK) else Path("/proc/megajax-run")


@pytest.mark.parametrize("where, words", [
    ("file", ["cannot use it as the run directory: it is a file, not a directory"]),
    ("under a file", ["is a file, where a directory of the path belongs"]),
    ("unwritable", ["cannot use it as the run directory"]),
])
def test_a_run_directory_that_cannot_be_one(tmp_path, where, words):
    (tmp_path / "notes.txt").write_text("x")
    run_dir = {"file": tmp_path / "notes.txt", "under a file": tmp_path / "notes.txt" / "run",
               "unwritable": _unwritable(tmp_path)}[where]
    paragraph(megajax("train", *TRAIN, f"train.run_dir={run_dir}"), "train", f"train.run_dir '{run_dir}'", *words)


@pytest.mark.parametrize("override, words", [
    ("train.seed=-1", ["train.seed = -1: must be in [0, 2^32)"]),
    ("train.seed=99999999999", ["train.seed = 99999999999"]),
    ("train.initial_loss_scale=0", ["train.initial_loss_scale = 0.0: must be a finite number > 0"]),
    ("optim.beta2=1.5", ["optim.beta2 = 1.5: must be in [0, 1)"]),
    ("optim.lr=.nan", ["optim.lr = nan: must be a finite number > 0"]),
    ("train.peak_tflops=-5", ["train.peak_tflops = -5.0"]),
])
def test_train_numbers_out_of_range(tmp_path, override, words):
    paragraph(megajax("train", *TRAIN, f"train.run_dir={tmp_path / 'run'}", override), "train", *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, words", [
    ("data.cache_dir={notes}", ["data.cache_dir: cannot write the sample-index cache in '{notes}'"]),
    ("data.corpus_max_mb=0.0001", ["data.corpus_max_mb = 0.0001: the embedded corpus's first file does not fit"]),
])
def test_data_settings_that_cannot_be_used(tmp_path, override, words):
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    p = megajax("train", *TRAIN, f"train.run_dir={tmp_path / 'run'}", override.format(notes=notes))
    paragraph(p, "train", *[w.format(notes=notes) for w in words])


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe model:", ["cannot read it as YAML text", "can't decode byte 0xff"]),
    (b"include: [5]\n", ["include = [5]: expected a file name or a list of them"]),
    (b"include:\n", ["include = None"]),
    (b"- 1\n", ["must hold a mapping of sections, got list"]),
])
def test_config_files_that_are_not_configs(tmp_path, content, words):
    (tmp_path / "c.yaml").write_bytes(content)
    paragraph(megajax("train", "--config", str(tmp_path / "c.yaml")), "train", f"config file {tmp_path / 'c.yaml'}",
              *words)


# ----------------------------------------------------------------------------------------------
# megajax import --format megatron, megajax generate

@pytest.mark.parametrize("output, words", [
    ("README.md", ["--output README.md: cannot write a directory there: it is a file"]),
    ("README.md/out", ["'README.md' is a file, where a directory of the path belongs"]),
])
def test_import_output_that_cannot_be_a_directory(output, words, tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    p = megajax("import", "--format", "megatron", "--input", str(FIXTURES / "gpt-tp2-torch"), "--output", output,
                cwd=tmp_path)
    paragraph(p, "import", *[w.replace("'README.md'", repr(str(tmp_path / "README.md"))) for w in words])


@pytest.mark.parametrize("tracker, words", [
    ("garbage\n", ["holds 'garbage'; expected an iteration number or 'release'"]),
    ("99\n", ["names iter_0000099", "does not exist"]),
    (None, ["no latest_checkpointed_iteration.txt"]),
])
def test_import_a_megatron_directory_with_a_bad_tracker(tmp_path, tracker, words):
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "gpt-tp2-torch", save)
    if tracker is None:
        shutil.rmtree(save / "iter_0000010")
        (save / "latest_checkpointed_iteration.txt").unlink()
    else:
        (save / "latest_checkpointed_iteration.txt").write_text(tracker)
    paragraph(megajax("import", "--format", "megatron", "--input", str(save), "--output", str(tmp_path / "out")),
              "import", *words)


@pytest.mark.parametrize("args, words", [
    (["--json", "."], ["--json .: cannot write a file there: it is a directory"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0"]),
    (["--top-p", "2", "--temperature", "1"], ["--top-p=2.0: must be in (0, 1]"]),
    (["--temperature", "nan"], ["--temperature=nan"]),
])
def test_generate_options_before_the_model_loads(args, words):
    paragraph(megajax("generate", "--checkpoint", "nowhere", "--prompt", "hi", *args), "generate", *words)
