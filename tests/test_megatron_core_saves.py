"""A small dense GPT saved by megatron-core itself with the args Megatron-LM's parse_args + validate_args
write, at Megatron's defaults: megatron-core 0.19.2's args of tests/fixtures/megatron_core_0_19/gpt-tp2-torch_dist
(a real run's 815 fields) with the flags that run changed set back to Megatron's defaults (fused bias-GELU,
bias-dropout and softmax fusion, dropout 0.1, 4 x hidden MLP) and `--tokenizer-type NullTokenizer --vocab-size
512`; the model built, initialised and saved (torch_dist) by the installed megatron-core 0.16.1 in a worker
process (megatron_core_gpt_worker.py), with its logits.

Megatron's default GELU is its fused bias-GELU, the tanh approximation (torch's exact GELU only with
--no-bias-gelu-fusion or without biases): the import reads model.activation=gelu_tanh and the Hugging Face
export is GPT-2's gelu_new; NullTokenizer's vocabulary is --vocab-size ids and its end-of-document id. Both
megajax's forward and transformers' on the export give megatron-core's logits in fp32 to 1e-5 (the exact
GELU in their place is 3e-4 off at this initialisation), and megajax's torch_dist export loads back into
megatron-core with the same logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from test_bad_input import FIXTURES, megajax, paragraph  # noqa: E402
from test_megatron_releases import logits_of, rewrite_common_state  # noqa: E402
from test_torch_dist import free_port  # noqa: E402

WORKER = str(Path(__file__).with_name("megatron_core_gpt_worker.py"))
VOCAB = 513  # --vocab-size 512 and NullTokenizer's end-of-document id 512
# Megatron-LM's defaults for what the fixture's run set otherwise (its --no-*-fusion flags, dropout 0,
# --ffn-hidden-size 128, TP 2, --vocab-size 200); init_method_std 0.05 as that run's, so that the MLP's
# inputs reach where the two GELUs differ.
DEFAULTS = dict(bias_gelu_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=True, hidden_dropout=0.1,
                attention_dropout=0.1, ffn_hidden_size=256, tensor_model_parallel_size=1, no_persist_layer_norm=False,
                vocab_size=512, padded_vocab_size=640, init_method_std=0.05, iteration=10)

pytest.importorskip("torch")


def release_args(**changes):
    """The fixture's megatron-core 0.19.2 args (Megatron's enums as their values), with `changes`."""
    from megajax.checkpoint.megatron import _args
    from megajax.checkpoint.torch_pickle import MegatronObject
    _, args = _args(FIXTURES / "gpt-tp2-torch_dist", False)
    for key, value in vars(args).items():
        if isinstance(value, MegatronObject):
            setattr(args, key, value.value)
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def run_worker(*argv: str, log: Path) -> None:
    with open(log, "w") as f:  # a file, not a pipe: no wait on what the worker spawned
        p = subprocess.run([sys.executable, WORKER, *argv, str(free_port())], stdout=f, stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert p.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(save directory, tokens with the end-of-document id among them, megatron-core's logits)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("mcore_gpt")
    torch.save(release_args(**DEFAULTS), root / "args.pt")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16)).astype(np.int64)
    tokens[1, 3] = 512
    np.save(root / "tokens.npy", tokens)
    run_worker("save", str(root / "args.pt"), str(root / "tokens.npy"), str(root / "save"), log=root / "worker.log")
    return root / "save", tokens, np.load(root / "save" / "logits.npy")


def test_the_import_reads_megatrons_defaults(saved):
    from megajax.checkpoint.megatron import import_megatron
    save, tokens, theirs = saved
    overrides, params = import_megatron(save)
    assert {k: overrides[k] for k in ("family", "norm", "activation", "position_embedding", "use_bias",
                                      "tie_embeddings", "norm_eps", "vocab_size", "ffn_hidden_size")} == dict(
        family="gpt", norm="layernorm", activation="gelu_tanh", position_embedding="learned", use_bias=True,
        tie_embeddings=True, norm_eps=1e-5, vocab_size=VOCAB, ffn_hidden_size=256)
    ours = logits_of(overrides, params, tokens)
    np.testing.assert_allclose(ours, theirs[..., :VOCAB], atol=1e-5, rtol=1e-5)
    exact = logits_of(dict(overrides, activation="gelu"), params, tokens)
    assert np.abs(exact - theirs[..., :VOCAB]).max() > 1e-4  # what reading it as the exact GELU costs


def test_hugging_face_export_gives_megatron_cores_logits(saved, tmp_path):
    import json
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    save, tokens, theirs = saved
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(save), "--output", str(out), "--dtype", "fp32")
    assert p.returncode == 0, p.stderr
    assert "no tokenizer carried" in p.stdout and "end of document 512" in p.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["activation_function"], config["vocab_size"], config["eos_token_id"]) == ("gelu_new", VOCAB, 512)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(logits, theirs[..., :VOCAB], atol=1e-5, rtol=1e-5)


def test_torch_dist_export_loads_back_into_megatron_core(saved, tmp_path):
    """megajax's export of the import writes bias_gelu_fusion (the tanh GELU) into its args; megatron-core,
    building the model from those args as Megatron-LM does, computes the same logits."""
    save, tokens, theirs = saved
    out = tmp_path / "mg"
    p = megajax("export", "--format", "megatron", "--checkpoint", str(save), "--output", str(out), "--dtype", "fp32",
                "--megatron-version", "0.16")
    assert p.returncode == 0, p.stderr
    np.save(tmp_path / "tokens.npy", tokens)
    step = sorted(p for p in out.iterdir() if p.is_dir())  # one step (a Megatron source's export: `release`)
    assert len(step) == 1, step
    run_worker("load", str(step[0]), str(tmp_path / "tokens.npy"), str(tmp_path / "logits.npy"),
               log=tmp_path / "worker.log")
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy")[..., :VOCAB], theirs[..., :VOCAB], atol=1e-5,
                               rtol=1e-5)


def test_an_unfused_gelu_is_the_exact_one():
    """--no-bias-gelu-fusion (the fixture's run) and --disable-bias-linear (validate_args then turns the fusion
    off) leave megatron-core's exact GELU."""
    from megajax.checkpoint.megatron import _activation, import_megatron
    assert import_megatron(FIXTURES / "gpt-tp2-torch_dist")[0]["activation"] == "gelu"
    assert _activation(release_args(bias_gelu_fusion=True, add_bias_linear=False)) == "gelu"
    assert _activation(release_args(bias_gelu_fusion=True, swiglu=True)) == "swiglu"
    from megajax import megatron_args as ma
    line = "--num-layers 2 --hidden-size 64 --num-attention-heads 4".split()
    for extra, want in (([], "gelu_tanh"), (["--no-bias-gelu-fusion"], "gelu"), (["--disable-bias-linear"], "gelu"),
                        (["--squared-relu"], "squared_relu")):
        assert ma.translate(line + extra).assignments["model.activation"][0] == want, extra


@pytest.mark.parametrize("key, value", [("layernorm_zero_centered_gamma", True), ("qk_l2_norm", True),
                                        ("softmax_type", "learnable"), ("window_size", [128, 0])])
def test_args_megajax_cannot_compute_are_refused(key, value, tmp_path):
    """A 0.19 run's args that change the model's function without a megajax counterpart: one paragraph naming
    the arg, nothing written."""
    import shutil
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "gpt-tp2-torch_dist", save)

    def changed(common):
        setattr(common["args"], key, value)
        return common
    rewrite_common_state(save / "iter_0000010", changed)
    p = megajax("import", "--format", "megatron", "--input", str(save), "--output", str(tmp_path / "out"))
    paragraph(p, "import", f"Megatron args {key}={value!r} cannot be represented in megajax")
    assert not (tmp_path / "out").exists()


def test_transformers_gpt2_with_its_default_gelu_new_imports(tmp_path):
    """GPT-2's own activation (gelu_new, transformers' default for GPT2Config) is model.activation=gelu_tanh:
    a GPT-2 saved by transformers imports with transformers' logits."""
    from megajax.checkpoint.hf import import_hf
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=32,
                                     initializer_range=0.2)
    assert config.activation_function == "gelu_new"
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "gpt2")
    overrides, params = import_hf(tmp_path / "gpt2")
    assert overrides["activation"] == "gelu_tanh"
    tokens = np.random.default_rng(0).integers(0, 300, (2, 16))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(logits_of(overrides, params, tokens), theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(logits_of(dict(overrides, activation="gelu"), params, tokens) - theirs).max() > 1e-3
