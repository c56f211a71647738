"""The documented path from the preset the docs start from: `megajax train --config model/tiny-hybrid` for a
few steps, then `megajax export --format hf` and `--format megatron`. Its MoE layers route as Nemotron-3's
(sigmoid scores, an expert bias the training moves, a shared expert), so the Hugging Face export is a
NemotronHForCausalLM whose logits in transformers (its PyTorch path, use_mamba_kernels=False) equal
megajax's forward on the trained checkpoint in fp32, and the Megatron export reads back to the same
parameters, expert bias included. Commands run as subprocesses."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from test_bad_input import megajax  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("tiny_hybrid") / "run"
    p = megajax("train", "--config", "model/tiny-hybrid", "train.steps=2", f"train.seq_len={SEQ}",
                "train.global_batch=2", "train.micro_batch=2", "mesh.cpu_devices=1", "train.log_every=1",
                "checkpoint.every=2", f"train.run_dir={run}", "train.sample_tokens=0")
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def checkpoint_logits(run, tokens: np.ndarray) -> np.ndarray:
    """megajax's forward of the run's latest checkpoint (its expert bias too), fp32, the real vocabulary."""
    from megajax.checkpoint.manager import CheckpointSource
    from megajax.checkpoint.source import unflatten
    from megajax.config import load_config
    from megajax.models.layout import split_expert_bias
    from megajax.train.state import build_model_spec
    source = CheckpointSource(run / "checkpoints")
    params, bias = split_expert_bias(unflatten({n: np.asarray(source.get(n), np.float32) for n in source.names()}))
    assert bias is not None and np.abs(bias).max() > 0  # two steps moved it
    cfg = load_config(["model/tiny-hybrid"], [f"train.seq_len={SEQ}", f"model.vocab_size={source.model.vocab_size}"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    return np.asarray(spec.apply(params, tokens.astype(np.int32), expert_bias=bias))[..., :cfg.model.vocab_size]


def test_tiny_hybrid_exports_to_nemotron_h(trained, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(trained), "--output", str(out), "--dtype", "fp32")
    assert p.returncode == 0, p.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert (config["n_routed_experts"], config["moe_shared_expert_intermediate_size"],
            config["routed_scaling_factor"]) == (4, 128, 2.5)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                              use_mamba_kernels=False).eval()
    assert type(model).__name__ == "NemotronHForCausalLM"
    tokens = np.random.default_rng(0).integers(0, 257, (2, SEQ)).astype(np.int64)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, checkpoint_logits(trained, tokens), atol=1e-5, rtol=1e-5)  # 5.4e-7 measured


def test_tiny_hybrid_exports_to_megatron(trained, tmp_path):
    pytest.importorskip("torch")
    from megajax.checkpoint.manager import CheckpointSource
    from megajax.checkpoint.megatron import import_megatron
    from megajax.checkpoint.source import flatten
    out = tmp_path / "mg"
    p = megajax("export", "--format", "megatron", "--checkpoint", str(trained), "--output", str(out), "--dtype",
                "fp32")
    assert p.returncode == 0, p.stderr
    overrides, params = import_megatron(out)
    assert (overrides["moe_router_score_function"], overrides["moe_shared_expert_ffn_size"],
            overrides["moe_router_topk_scaling_factor"]) == ("sigmoid", 128, 2.5)
    source = CheckpointSource(trained / "checkpoints")
    got = dict(flatten(params))
    assert sorted(got) == sorted(source.names())
    for name in source.names():
        np.testing.assert_array_equal(got[name], np.asarray(source.get(name), np.float32), err_msg=name)


@pytest.mark.parametrize("fmt", ["torch-tp2", "torch_dist"])
def test_a_hybrids_expert_bias_and_shared_expert_round_trip_through_megatron(fmt, tmp_path):
    """Nemotron-3-style MoE layers in a hybrid: the routers' expert bias (`mlp.router.expert_bias`, one row
    per MoE layer) and the shared experts go out and come back exactly, at TP 2 (legacy) and in torch_dist."""
    torch = pytest.importorskip("torch")
    from random_model import random_model
    from megajax.checkpoint.megatron import export_megatron, export_torch_dist, import_megatron
    from megajax.checkpoint.source import DictSource, flatten, unflatten
    cfg, _, params = random_model(
        "llama", "model.num_layers=null", "model.hybrid_layer_pattern=M*-EM*-E", "model.activation=squared_relu",
        "model.position_embedding=none", "model.mamba_state_dim=8", "model.mamba_head_dim=8",
        "model.mamba_num_groups=2", "model.mamba_num_heads=8", "model.num_experts=4", "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=32", "model.moe_shared_expert_ffn_size=48",
        "model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=1e-3")
    flat = dict(flatten(params), **{"layers/mlp/expert_bias": np.arange(8, dtype=np.float32).reshape(2, 4) / 8})
    source = DictSource(unflatten(flat), cfg.model)
    if fmt == "torch_dist":
        out = export_torch_dist(source, tmp_path / "mg", dtype="fp32")
    else:
        out = export_megatron(source, tmp_path / "mg", tensor_parallel=2, dtype="fp32")
        rank = torch.load(out / "release" / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)["model"]
        np.testing.assert_array_equal(rank["decoder.layers.7.mlp.router.expert_bias"].numpy(), flat[
            "layers/mlp/expert_bias"][1])  # the second MoE layer's row, whole on every rank
        assert rank["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"].shape == (24, 64)
    _, back = import_megatron(out)
    back = dict(flatten(back))
    assert sorted(back) == sorted(flat)
    for name, x in flat.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)
