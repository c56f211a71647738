"""Wrong input on the LoRA surfaces, as a user types it: a PEFT adapter directory whose adapter_config.json
or adapter_model.safetensors is malformed, or whose two files disagree with each other or with the base
model (`import --format peft`, `generate --adapter`, `serve --adapter`); a LoRA checkpoint whose frozen base
was replaced since the adapters were trained (generate, serve, export); and export / import options that the
chosen format would ignore. Each is one paragraph on stderr naming the file, field or tensor and the bad
value, exit status 2, and nothing written. One command of each class runs as a subprocess; the rest of a
class runs the same `megajax.cli.main` in this process. (LoRA runs resumed with other adapters, the
exact-match score of a LoRA run and the Hugging Face base round trip: tests/test_lora_resume.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from random_model import random_model
from test_bad_input import megajax, paragraph
from test_bad_input_serve import refused, serve
from test_lora_export import lora_checkpoint
from megajax.checkpoint.manager import write_params_checkpoint
from megajax.cli import main

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A random base (megajax checkpoint), random adapters on it (a megajax LoRA checkpoint) and their PEFT
    export (rank 4, alpha 8; q, k, v, o, gate, up, down of 2 layers)."""
    tmp = tmp_path_factory.mktemp("bad-lora")
    base, lora, *_ = lora_checkpoint(tmp)
    assert main(["export", "--format", "peft", "--checkpoint", str(lora), "--output", str(tmp / "peft"),
                 "--dtype", "fp32"]) == 0
    return {"base": base, "lora": lora, "peft": tmp / "peft"}


def inproc(capsys, *args: str) -> subprocess.CompletedProcess:
    """`megajax ARGS` through megajax.cli.main in this process (what the subprocess runs)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def adapter_copy(made, tmp_path, config=None, tensors=None) -> Path:
    """A copy of the PEFT export with adapter_config.json replaced by `config` (text, or a function of the
    config dict) and the tensors by `tensors` (a function of the tensor dict)."""
    d = tmp_path / "adapter"
    shutil.copytree(made["peft"], d)
    if isinstance(config, str):
        (d / CONFIG).write_text(config)
    elif config is not None:
        c = json.loads((d / CONFIG).read_text())
        config(c)
        (d / CONFIG).write_text(json.dumps(c))
    if tensors is not None:
        t = load_file(str(d / WEIGHTS))
        tensors(t)
        save_file(t, str(d / WEIGHTS))
    return d


def peft_import(run, made, tmp_path, adapter: Path) -> subprocess.CompletedProcess:
    p = run("import", "--format", "peft", "--input", adapter, "--base", made["base"], "--output", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    return p


# ----------------------------------------------------------------------------------------------
# adapter_config.json

def _set(**kw):
    return lambda c: c.update(kw)


def _drop(key):
    return lambda c: c.pop(key)


CONFIGS = {
    "not-json": ('{"r": 4,', ["not JSON"]),
    "a-list": ("[1, 2]", ["holds a JSON list, not an object"]),
    "not-utf8": ("\udcff", ["not UTF-8"]),
    "r-zero": (_set(r=0), ["r = 0", "whole number >= 1"]),
    "r-negative": (_set(r=-4), ["r = -4"]),
    "r-fraction": (_set(r=2.5), ["r = 2.5"]),
    "r-missing": (_drop("r"), ["r = null"]),
    "r-true": (_set(r=True), ["r = true"]),
    "peft-type": (_set(peft_type="IA3"), ['peft_type = "IA3"', "LoRA adapters"]),
    "peft-type-missing": (_drop("peft_type"), ["peft_type = null"]),
    "alpha-text": (_set(lora_alpha="eight"), ['lora_alpha = "eight"', "number > 0"]),
    "alpha-missing": (_drop("lora_alpha"), ["lora_alpha = null"]),
    "dropout": (_set(lora_dropout=1.5), ["lora_dropout = 1.5", "[0, 1)"]),
    "targets-number": (_set(target_modules=5), ["target_modules = 5", "list of module names"]),
    "targets-empty": (_set(target_modules=[]), ["target_modules = []"]),
    "targets-bad-regex": (_set(target_modules="(q_proj"), ["target_modules = '(q_proj'", "regular expression"]),
    "dora": (_set(use_dora=True), ["use_dora = true", "magnitude"]),
    "modules-to-save": (_set(modules_to_save=["lm_head"]), ['modules_to_save = ["lm_head"]', "replace the base"]),
    "bias": (_set(bias="all"), ['bias = "all"', "trained biases"]),
    "pissa": (_set(init_lora_weights="pissa"), ['init_lora_weights = "pissa"', "rewrites the base weights"]),
    "rank-pattern": (_set(rank_pattern={"q_proj": 8}), ["rank_pattern", "per-module ranks"]),
    "fan-in-fan-out": (_set(fan_in_fan_out=True), ["fan_in_fan_out = true"]),
    "unknown-feature": (_set(warp_factor=9), ["warp_factor = 9", "does not know"]),
    "rslora-text": (_set(use_rslora="yes"), ['use_rslora = "yes"']),
    "layers-text": (_set(layers_to_transform="0"), ['layers_to_transform = "0"', "a layer index"]),
    "layers-with-regex": (_set(target_modules=".*q_proj", layers_to_transform=[0]), ["PEFT refuses the pair"]),
}


def test_a_bad_adapter_config_is_one_paragraph_as_a_subprocess(made, tmp_path):
    d = adapter_copy(made, tmp_path, _set(r=0))
    paragraph(peft_import(lambda *a: megajax(*map(str, a)), made, tmp_path, d), "import",
              f"{d / CONFIG}: r = 0")


@pytest.mark.parametrize("case", list(CONFIGS))
def test_adapter_config_is_checked(made, tmp_path, capsys, case):
    change, words = CONFIGS[case]
    if case == "not-utf8":
        d = adapter_copy(made, tmp_path)
        (d / CONFIG).write_bytes(b'{"r": "\xff"}')
    else:
        d = adapter_copy(made, tmp_path, change)
    paragraph(peft_import(lambda *a: inproc(capsys, *a), made, tmp_path, d), "import", str(d / CONFIG), *words)


def test_a_missing_config_names_the_directory(made, tmp_path, capsys):
    d = adapter_copy(made, tmp_path)
    (d / CONFIG).unlink()
    paragraph(peft_import(lambda *a: inproc(capsys, *a), made, tmp_path, d), "import", "no adapter_config.json")


def test_rslora_is_read_as_the_plain_adapter_of_the_same_scale(made, tmp_path, capsys):
    """use_rslora: scale lora_alpha / sqrt(r) = 8 / 2 = 4, the plain LoRA of alpha 16 at rank 4."""
    from megajax.checkpoint.manager import CheckpointSource
    d = adapter_copy(made, tmp_path, _set(use_rslora=True))
    assert inproc(capsys, "import", "--format", "peft", "--input", d, "--base", made["base"], "--output",
                  tmp_path / "out").returncode == 0
    lora = CheckpointSource(tmp_path / "out").model.lora
    assert lora.alpha / lora.rank == pytest.approx(8 / 2)


# ----------------------------------------------------------------------------------------------
# adapter_model.safetensors

def _write(data: bytes):
    def change(d: Path):
        (d / WEIGHTS).write_bytes(data)
    return change


def _tensor(name, value):
    def change(d: Path):
        t = load_file(str(d / WEIGHTS))
        t[name] = value(t[name]) if callable(value) else value
        save_file(t, str(d / WEIGHTS))
    return change


WEIGHT_CASES = {
    "garbage": (_write(b"this is not a safetensors file at all"), ["not a readable safetensors file"]),
    "empty": (_write(b""), ["empty (0 bytes)"]),
    "missing": (lambda d: (d / WEIGHTS).unlink(), ["without adapter_model.safetensors"]),
    "pickle-only": (lambda d: ((d / WEIGHTS).rename(d / "adapter_model.bin")), ["adapter_model.bin", "pickle"]),
    "int-dtype": (_tensor(Q_A, lambda x: x.astype(np.int32)), [Q_A, "dtype I32", "floating point"]),
    "3d": (_tensor(Q_A, lambda x: x[None]), [Q_A, "shape [1, 4, 64]", "a matrix"]),
    "nan": (_tensor(Q_A, lambda x: np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x)),
            [Q_A, "1 values that are NaN or infinite"]),
}


def test_bad_adapter_weights_are_one_paragraph_as_a_subprocess(made, tmp_path):
    d = adapter_copy(made, tmp_path)
    _write(b"garbage")(d)
    paragraph(peft_import(lambda *a: megajax(*map(str, a)), made, tmp_path, d), "import",
              f"{d / WEIGHTS}: not a readable safetensors file")


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_adapter_weights_are_checked(made, tmp_path, capsys, case):
    change, words = WEIGHT_CASES[case]
    d = adapter_copy(made, tmp_path)
    change(d)
    paragraph(peft_import(lambda *a: inproc(capsys, *a), made, tmp_path, d), "import", *words)


# ----------------------------------------------------------------------------------------------
# the two files against each other and against the base model

def _drop_tensors(word):
    return lambda t: [t.pop(k) for k in list(t) if word in k]


MISMATCHES = {
    # r declared 8, tensors of rank 4
    "rank": (_set(r=8), None, ["layers.0.mlp.down_proj.lora_A.weight has rank 4 (shape [4, 128])",
                               "declares r = 8"]),
    # tensors for o_proj, which target_modules does not name
    "unnamed": (lambda c: c.update(target_modules=[t for t in c["target_modules"] if t != "o_proj"]), None,
                ["o_proj", "does not name", "do not belong together"]),
    # target_modules names down_proj; no down_proj tensors
    "named-without-tensors": (None, _drop_tensors("down_proj"), ["names", "down_proj", "are not in "
                                                                 "adapter_model.safetensors"]),
    # a name that is no module of the base
    "unknown-module": (lambda c: c["target_modules"].append("qq_proj"), None, ["qq_proj", "no module"]),
    # a regular expression that leaves out the second layer, whose tensors are there
    "regex": (_set(target_modules=r"model\.layers\.0\..*_proj"), None, ["model.layers.1.", "does not name"]),
    # lora_A without its lora_B
    "half-pair": (None, lambda t: t.pop(Q_A.replace("lora_A", "lora_B")),
                  [Q_A, "no lora_B.weight beside it"]),
    # lora_A and lora_B of different ranks
    "pair-ranks": (None, lambda t: t.update({Q_A.replace("lora_A", "lora_B"): np.zeros((64, 3), np.float32)}),
                   ["q_proj's lora_A has shape [4, 64] and its lora_B [64, 3]"]),
    # an input size the base does not have
    "in-shape": (None, lambda t: t.update({Q_A: np.zeros((4, 32), np.float32)}),
                 ["self_attn.q_proj's lora_A has shape [4, 32]", "maps 64 inputs"]),
    # a layer the 2-layer base does not have
    "extra-layer": (None, lambda t: t.update({Q_A.replace("layers.0", "layers.7"): t[Q_A],
                                              Q_A.replace("layers.0", "layers.7").replace("lora_A", "lora_B"):
                                              t[Q_A.replace("lora_A", "lora_B")]}),
                    ["model.layers.7.self_attn.q_proj", "no linear of the base model"]),
    # not a LoRA tensor at all (a DoRA magnitude)
    "dora-magnitude": (None, lambda t: t.update({Q_A.replace("lora_A.weight", "lora_magnitude_vector"):
                                                 np.ones((1, 64), np.float32)}),
                       ["lora_magnitude_vector", "not LoRA weights"]),
}


def test_config_and_weights_that_disagree_as_a_subprocess(made, tmp_path):
    d = adapter_copy(made, tmp_path, _set(r=8))
    paragraph(peft_import(lambda *a: megajax(*map(str, a)), made, tmp_path, d), "import", str(d / WEIGHTS),
              ".lora_A.weight has rank 4", "declares r = 8")


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_config_weights_and_base_must_agree(made, tmp_path, capsys, case):
    config, tensors, words = MISMATCHES[case]
    d = adapter_copy(made, tmp_path, config, tensors)
    paragraph(peft_import(lambda *a: inproc(capsys, *a), made, tmp_path, d), "import", *words)


def test_generate_and_serve_refuse_a_bad_adapter_at_start(made, tmp_path):
    """--adapter with a bad config: generate exits 2 before the model loads; serve exits 2 at start-up,
    never listening."""
    d = adapter_copy(made, tmp_path, _set(use_dora=True))
    paragraph(megajax("generate", "--checkpoint", str(made["base"]), "--adapter", str(d), "--prompt", "hi"),
              "generate", f"{d / CONFIG}", "use_dora = true")
    e = adapter_copy(made, tmp_path / "e", _set(r=8))
    refused(serve(made["base"], "--adapter", str(e), "--port", "0"), str(e / WEIGHTS), "declares r = 8")


# ----------------------------------------------------------------------------------------------
# a frozen base replaced since the adapters were trained

@pytest.fixture
def replaced(made, tmp_path) -> Path:
    """A LoRA checkpoint on a base that is then saved over with other weights, at the same place."""
    base, lora, *_ = lora_checkpoint(tmp_path)
    shutil.rmtree(tmp_path / "base")
    cfg, _, params = random_model("llama", seed=1)
    write_params_checkpoint(params, cfg, tmp_path / "base")
    return lora


def test_generate_refuses_a_replaced_base_as_a_subprocess(replaced, tmp_path):
    paragraph(megajax("generate", "--checkpoint", str(replaced), "--prompt", "hi"), "generate",
              "frozen base model", "has changed since the adapters were trained")


@pytest.mark.parametrize("command", [
    ["export", "--format", "hf", "--merge-lora", "--output", "{out}"],
    ["export", "--format", "megatron", "--merge-lora", "--output", "{out}"],
    ["export", "--format", "peft", "--output", "{out}"],
], ids=["export-hf-merged", "export-megatron-merged", "export-peft"])
def test_export_refuses_a_replaced_base(replaced, tmp_path, capsys, command):
    out = tmp_path / "out"
    p = inproc(capsys, *[c.format(out=out) for c in command], "--checkpoint", replaced)
    paragraph(p, "export", "frozen base model", "has changed since the adapters were trained")
    assert not out.exists()


def test_an_adapter_merged_into_its_replaced_base_is_refused(replaced, tmp_path, capsys):
    """--adapter LORA_CHECKPOINT onto the --checkpoint it records as its base, since saved over."""
    p = inproc(capsys, "generate", "--checkpoint", tmp_path / "base", "--adapter", replaced, "--prompt", "hi")
    paragraph(p, "generate", f"--adapter {replaced}", "has changed since the adapters were trained")


def test_serve_refuses_a_replaced_base_at_start(replaced, tmp_path):
    refused(serve(replaced, "--port", "0"), "has changed since the adapters were trained")


# ----------------------------------------------------------------------------------------------
# options the chosen format would ignore

EXPORT_OPTIONS = {
    "peft-merge": (["--format", "peft", "--merge-lora"], ["--format peft writes a LoRA run's adapters alone",
                                                          "--merge-lora writes the base"]),
    "hf-tensor-parallel": (["--format", "hf", "--merge-lora", "--tensor-parallel", "2"],
                           ["--tensor-parallel 2", "applies to --format megatron, not to --format hf"]),
    "peft-pipeline": (["--format", "peft", "--pipeline-parallel", "2"], ["--pipeline-parallel 2", "--format peft"]),
    "hf-ckpt-format": (["--format", "hf", "--merge-lora", "--ckpt-format", "torch"], ["--ckpt-format torch"]),
    "hf-megatron-version": (["--format", "hf", "--merge-lora", "--megatron-version", "0.16"],
                            ["--megatron-version 0.16", "not to --format hf"]),
    "peft-optimizer": (["--format", "peft", "--with-optimizer"], ["--with-optimizer", "not to --format peft"]),
    "torch-version": (["--format", "megatron", "--merge-lora", "--ckpt-format", "torch", "--megatron-version",
                       "0.16"], ["--megatron-version 0.16", "--ckpt-format torch"]),
    "trust-megajax": (["--format", "peft", "--trust-checkpoint"], ["--trust-checkpoint", "not a Megatron checkpoint"]),
    "merged-optimizer": (["--format", "megatron", "--merge-lora", "--with-optimizer"],
                         ["--with-optimizer with --merge-lora", "adapters'"]),
    "lora-unmerged": (["--format", "megatron"], ["holds LoRA adapters, not a whole model",
                                                 "--format megatron --merge-lora"]),
}


def test_export_peft_with_merge_lora_is_one_paragraph_as_a_subprocess(made, tmp_path):
    p = megajax("export", "--format", "peft", "--merge-lora", "--checkpoint", str(made["lora"]), "--output",
                str(tmp_path / "out"))
    paragraph(p, "export", "--format peft writes a LoRA run's adapters alone", "Choose one")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(EXPORT_OPTIONS))
def test_export_refuses_options_its_format_ignores(made, tmp_path, capsys, case):
    args, words = EXPORT_OPTIONS[case]
    p = inproc(capsys, "export", *args, "--checkpoint", made["lora"], "--output", tmp_path / "out")
    paragraph(p, "export", *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, words", [
    (["--format", "hf", "--base", "x"], ["--base x", "--format hf imports a whole model"]),
    (["--format", "megatron", "--base", "x"], ["--base x"]),
    (["--format", "hf", "--trust-checkpoint"], ["--trust-checkpoint", "--format hf reads no pickle"]),
    (["--format", "peft", "--trust-checkpoint"], ["--trust-checkpoint", "--format peft"]),
], ids=["hf-base", "megatron-base", "hf-trust", "peft-trust"])
def test_import_refuses_options_its_format_ignores(made, tmp_path, capsys, args, words):
    p = inproc(capsys, "import", *args, "--input", made["peft"], "--output", tmp_path / "out")
    paragraph(p, "import", *words)
    assert not (tmp_path / "out").exists()


def test_merged_megatron_export_holds_the_merged_weights(made, tmp_path, capsys):
    """--merge-lora applies to --format megatron too: imported back, its weights are the Hugging Face merged
    export's (both written from the one merged source)."""
    from megajax.checkpoint.hf import import_hf
    from megajax.checkpoint.megatron import import_megatron
    from megajax.checkpoint.source import flatten
    for fmt in ("hf", "megatron"):
        assert inproc(capsys, "export", "--format", fmt, "--merge-lora", "--checkpoint", made["lora"], "--output",
                      tmp_path / fmt, "--dtype", "fp32").returncode == 0
    hf, meg = dict(flatten(import_hf(tmp_path / "hf")[1])), dict(flatten(import_megatron(str(tmp_path / "megatron"))[1]))
    base = dict(flatten(random_model("llama")[2]))
    assert sorted(hf) == sorted(meg)
    for name in hf:
        np.testing.assert_allclose(meg[name], hf[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.abs(hf["layers/attn/q/kernel"] - base["layers/attn/q/kernel"]).max() > 1e-3  # merged, not the base
