"""A Megatron run made with `--tokenizer-type NullTokenizer` (pre-tokenised data: no tokenizer anywhere),
here megatron-core 0.19.2's own save (tests/fixtures/megatron_core_0_19/gpt-tp2-torch_dist, --vocab-size
200): its vocabulary is the 200 ids and NullTokenizer's end-of-document id 200; it imports and exports to
Hugging Face without a tokenizer (one line says none was carried; config.json's eos_token_id is the
end-of-document id), transformers computing megatron-core's logits, and --tokenizer still adds one. Every
command runs as a subprocess."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from test_bad_input import FIXTURES, megajax, paragraph  # noqa: E402
from test_export import word_tokenizer_dir  # noqa: E402

SAVE = FIXTURES / "gpt-tp2-torch_dist"
VOCAB = 201  # --vocab-size 200 and the end-of-document id 200
NO_TOKENIZER = "no tokenizer carried: trained without one (Megatron args tokenizer_type='NullTokenizer'"

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("null") / "imported"
    p = megajax("import", "--format", "megatron", "--input", str(SAVE), "--output", str(out))
    assert p.returncode == 0, p.stderr
    assert "tokenizer none (Megatron args tokenizer_type='NullTokenizer'; end of document 200)" in p.stdout
    assert "trained without a tokenizer" in p.stderr and "--tokenizer PATH adds one" in p.stderr
    return out


def transformers_logits(hf: Path, tokens: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


@pytest.mark.parametrize("source", ["imported", "megatron"])
def test_hf_export_without_a_tokenizer(source, imported, tmp_path):
    """From the imported checkpoint or straight from the Megatron save: weights and config, no tokenizer
    files, one line saying so; the end-of-document id (200) is a token of the model and its eos."""
    checkpoint = imported if source == "imported" else SAVE
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(checkpoint), "--output", str(out), "--dtype", "fp32")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1 and NO_TOKENIZER in p.stdout and "--tokenizer TOK adds one" in p.stdout
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["activation_function"]) == (VOCAB, 200, "gelu")
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 200}
    tokens, theirs = np.load(SAVE / "tokens.npy"), np.load(SAVE / "logits.npy")
    np.testing.assert_allclose(transformers_logits(out, tokens), theirs[..., :VOCAB], atol=1e-5, rtol=1e-5)
    # the end-of-document id is a row of the model like any other: megajax's own forward on it
    from megajax.checkpoint.megatron import import_megatron
    from test_megatron_releases import logits_of
    tokens[0, 5] = 200
    overrides, params = import_megatron(SAVE)
    assert overrides["vocab_size"] == VOCAB
    np.testing.assert_allclose(transformers_logits(out, tokens), logits_of(overrides, params, tokens), atol=1e-5,
                               rtol=1e-5)


def test_tokenizer_adds_one(imported, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = word_tokenizer_dir(tmp_path / "tok", size=VOCAB)
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(imported), "--output", str(out), "--tokenizer",
                str(tok))
    assert p.returncode == 0, p.stderr
    assert f"tokenizer {tok}" in p.stdout and "no tokenizer" not in p.stdout
    assert transformers.AutoTokenizer.from_pretrained(out)("w3 w7")["input_ids"] == [3, 7]


def test_a_tokenizer_larger_than_the_vocabulary_is_one_paragraph(imported, tmp_path):
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(imported), "--output", str(out), "--tokenizer", "byte")
    paragraph(p, "export", "tokenizer 'byte' has 257 ids", f"vocab_size={VOCAB}")
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_megatron_export_without_a_tokenizer_reads_back(imported, tmp_path):
    """The legacy export of the import names NullTokenizer again, --vocab-size the ids before the
    end-of-document one (a Megatron run resuming from it builds the same vocabulary)."""
    from megajax.checkpoint.megatron import _args, import_megatron
    out = tmp_path / "mg"
    p = megajax("export", "--format", "megatron", "--checkpoint", str(imported), "--output", str(out), "--dtype",
                "fp32")
    assert p.returncode == 0, p.stderr
    assert NO_TOKENIZER in p.stdout and not (out / "tokenizer").exists()
    overrides, params = import_megatron(out)
    _, theirs = import_megatron(SAVE)
    args = _args(out, False)[1]
    assert overrides["vocab_size"] == VOCAB and (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 200)
    assert not hasattr(args, "null_tokenizer_eod_id")
    np.testing.assert_array_equal(params["embed"]["embedding"], theirs["embed"]["embedding"])
    again = tmp_path / "again"  # and imported from there: the same tokenizer line, the same vocabulary
    p = megajax("import", "--format", "megatron", "--input", str(out), "--output", str(again))
    assert p.returncode == 0, p.stderr
    assert "tokenizer none (Megatron args tokenizer_type='NullTokenizer'; end of document 200)" in p.stdout


def test_training_on_text_from_it_names_the_missing_tokenizer(imported):
    """checkpoint.load of the import: the run has no tokenizer to read text with; one paragraph says so."""
    p = megajax("train", f"checkpoint.load={imported}", "train.steps=1", "mesh.cpu_devices=1", "train.seq_len=16")
    paragraph(p, "train", "data.tokenizer = \"none (Megatron args tokenizer_type='NullTokenizer'", "trained without a tokenizer")


def test_from_megatron_counts_the_end_of_document_id():
    from megajax import megatron_args as ma
    t = ma.translate("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --tokenizer-type NullTokenizer "
                     "--vocab-size 512".split())
    assert t.assignments["model.vocab_size"] == (513, "--vocab-size 512 and NullTokenizer's end-of-document id 512")
    t = ma.translate("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 512".split())
    assert t.assignments["model.vocab_size"][0] == 512
