"""`megajax export` / `megajax import` on real run checkpoints (streamed from Orbax)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megajax.checkpoint.manager import CheckpointSource  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.train.loop import build_trainer, train  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402
from megajax.train.loss import cross_entropy  # noqa: E402


def test_export_import_round_trip_through_the_cli(small_config, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    run = train(small_config("mesh.tensor=2", "mesh.data=4", "model.num_kv_heads=2", steps=2))
    source = CheckpointSource(run.run_dir)
    assert source.model.vocab_size == 257 and "layers/attn/q/kernel" in source.names()
    # one layer at a time from the Orbax files
    np.testing.assert_array_equal(source.get("layers/attn/q/kernel", layer=1),
                                  np.asarray(run.state.params["layers"]["attn"]["q"]["kernel"][1]))

    assert main(["export", "--format", "hf", "--checkpoint", str(run.run_dir), "--output",
                 str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    tokens = np.random.default_rng(0).integers(0, 257, (2, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    cfg = small_config("model.num_kv_heads=2", "model.vocab_size=257")
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    ours = np.asarray(spec.apply(jax.device_get(run.state.params), tokens))[..., :257]
    np.testing.assert_allclose(theirs, ours, atol=2e-4)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("def f():")["input_ids"] == list(b"def f():")

    assert main(["export", "--format", "megatron", "--checkpoint", str(run.run_dir), "--output",
                 str(tmp_path / "mg"), "--ckpt-format", "torch", "--tensor-parallel", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "mg" / "iter_0000002").iterdir()) == ["mp_rank_00", "mp_rank_01"]

    for fmt, src in (("hf", tmp_path / "hf"), ("megatron", tmp_path / "mg")):
        out = tmp_path / f"imported-{fmt}"
        assert main(["import", "--format", fmt, "--input", str(src), "--output", str(out)]) == 0
        tr = build_trainer(small_config("model.num_kv_heads=2", f"checkpoint.load={out}"))
        tol = 0 if fmt == "hf" else 1e-2  # megatron export was bf16
        for a, b in zip(jax.tree.leaves(run.state.params), jax.tree.leaves(tr.state.params)):
            a, b = np.asarray(a), np.asarray(b)
            rows = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
            np.testing.assert_allclose(b[rows], a[rows], atol=tol, rtol=tol)


def test_export_errors_are_one_paragraph(tmp_path, capsys):
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no megajax checkpoint there" in err and err.count("\n") == 1


def test_megatron_import_without_a_tokenizer_then_export_with_tokenizer(tmp_path, capsys):
    """A Megatron checkpoint that names no tokenizer, with a 300-id vocabulary: the import says what to
    pass instead of calling it byte, and exporting it needs --tokenizer."""
    pytest.importorskip("torch")
    from megajax.checkpoint.manager import read_meta
    from megajax.checkpoint.megatron import export_megatron
    from megajax.checkpoint.source import DictSource, flatten, unflatten
    from megajax.config import load_config
    from test_export import word_tokenizer_dir
    cfg = load_config(overrides=["model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
                                 "model.ffn_hidden_size=128", "model.vocab_size=300", "train.seq_len=32"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = unflatten({n: np.full(x.shape, 0.01, np.float32) for n, x in flatten(spec.abstract_params)})
    export_megatron(DictSource(params, cfg.model), tmp_path / "mg")
    capsys.readouterr()

    assert main(["import", "--format", "megatron", "--input", str(tmp_path / "mg"),
                 "--output", str(tmp_path / "imported")]) == 0
    err = capsys.readouterr().err
    assert "300 ids" in err and "data.tokenizer=PATH" in err
    source = CheckpointSource(tmp_path / "imported")
    assert read_meta(source.step_dir)["config"]["data"]["tokenizer"] != "byte"

    hf = ["export", "--format", "hf", "--checkpoint", str(tmp_path / "imported"), "--output", str(tmp_path / "hf")]
    assert main(hf) == 2
    err = capsys.readouterr().err
    assert "pass --tokenizer TOK" in err and err.count("\n") == 1
    tok = word_tokenizer_dir(tmp_path / "tok", size=300)
    assert main(hf + ["--tokenizer", str(tok)]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tok / "tokenizer.json").read_text()


def test_run_with_a_relative_tokenizer_exports_from_another_directory(small_config, tmp_path, monkeypatch, capsys):
    """data.tokenizer=tok (relative) at training time; `megajax export` run from elsewhere still finds it."""
    pytest.importorskip("transformers")
    from test_export import word_tokenizer_dir
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    word_tokenizer_dir(tmp_path / "a" / "tok", size=300)
    run = train(small_config("data.tokenizer=tok", "train.run_dir=runs/r", steps=1))
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--format", "hf", "--checkpoint", "a/runs/r", "--output", "hf"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tmp_path / "a/tok/tokenizer.json").read_text()
    assert run.run_dir == tmp_path / "a/runs/r"


def test_trained_mixture_of_experts_exports_with_its_loss(small_config, tmp_path, capsys):
    """A MoE trained on expert 2 x data 4 exports through the CLI to a MixtralForCausalLM whose logits
    and loss on a batch are megajax's, and imports back to the same parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    moe = ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64",
           "model.moe_aux_loss_coeff=0.01"]
    run = train(small_config(*moe, "mesh.data=4", "mesh.expert=2", steps=3))
    assert main(["export", "--format", "hf", "--checkpoint", str(run.run_dir), "--output",
                 str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    assert type(model).__name__ == "MixtralForCausalLM"
    tokens = np.random.default_rng(1).integers(0, 257, (2, 32))
    with torch.no_grad():
        out = model(torch.tensor(tokens), labels=torch.tensor(tokens))
    cfg = small_config(*moe, "model.vocab_size=257")
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    logits = spec.apply(jax.device_get(run.state.params), tokens)
    np.testing.assert_allclose(out.logits.numpy(), np.asarray(logits)[..., :257], atol=1e-4)
    # The training loss (megajax's cross entropy of each next token) is transformers' loss.
    loss = np.mean(np.asarray(cross_entropy(logits[:, :-1], tokens[:, 1:])))
    np.testing.assert_allclose(float(out.loss), loss, rtol=1e-5)

    out_dir = tmp_path / "imported"
    assert main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(out_dir)]) == 0
    tr = build_trainer(small_config(*moe, f"checkpoint.load={out_dir}"))
    for a, b in zip(jax.tree.leaves(run.state.params), jax.tree.leaves(tr.state.params)):
        a, b = np.asarray(a), np.asarray(b)
        rows = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
        np.testing.assert_array_equal(b[rows], a[rows])


def test_expert_bias_run_exports_to_megatron_and_back_and_refuses_hf(small_config, tmp_path, capsys):
    """A sigmoid-routed run with aux-loss-free balancing: `--format hf` refuses it in one paragraph naming
    the keys and Megatron; `--format megatron` carries the trained bias, and an import and
    checkpoint.load give it back."""
    pytest.importorskip("torch")
    moe = ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
           "model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=0.01"]
    run = train(small_config(*moe, steps=2), devices=jax.devices()[:1])
    bias = np.asarray(run.state.moe_expert_bias)
    assert np.abs(bias).max() > 0
    assert main(["export", "--format", "hf", "--checkpoint", str(run.run_dir), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moe_router_score_function=sigmoid" in err and "--format megatron" in err
    assert main(["export", "--format", "megatron", "--checkpoint", str(run.run_dir), "--output",
                 str(tmp_path / "mg")]) == 0
    out = tmp_path / "imported"
    assert main(["import", "--format", "megatron", "--input", str(tmp_path / "mg"), "--output", str(out)]) == 0
    np.testing.assert_array_equal(CheckpointSource(out).get("layers/mlp/expert_bias"), bias)
    tr = build_trainer(small_config(*moe, f"checkpoint.load={out}"), devices=jax.devices()[:1])
    np.testing.assert_array_equal(np.asarray(tr.state.moe_expert_bias), bias)


def test_export_dtypes_are_one_table(capsys):
    """--dtype's choices, the numpy dtypes, safetensors' codes and torch's dtypes all come from
    megajax/checkpoint/dtypes.py; a name outside it is refused naming the accepted ones."""
    from megajax.checkpoint.dtypes import EXPORT_DTYPES, export_dtype, numpy_dtype, safetensors_code, torch_dtype
    from megajax.errors import CheckpointError
    assert list(EXPORT_DTYPES) == ["bf16", "fp32", "fp16"]
    for name, d in EXPORT_DTYPES.items():
        assert numpy_dtype(name).name == d.full_name and safetensors_code(numpy_dtype(name)) == d.safetensors
    with pytest.raises(CheckpointError, match=r"export dtype='fp8' is not supported; accepted: bf16, fp32, fp16"):
        export_dtype("fp8")
    torch = pytest.importorskip("torch")
    assert torch_dtype("bf16") == torch.bfloat16 and torch_dtype("fp32") == torch.float32
    assert torch_dtype("fp16") == torch.float16
    with pytest.raises(SystemExit):
        main(["export", "--format", "hf", "--checkpoint", "x", "--output", "y", "--dtype", "fp8"])
    err = capsys.readouterr().err.replace("'bf16', 'fp32', 'fp16'", "bf16, fp32, fp16")
    assert "invalid choice: 'fp8' (choose from bf16, fp32, fp16)" in err
