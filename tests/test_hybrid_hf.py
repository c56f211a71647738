"""Hybrid Mamba-2 models to and from Hugging Face (NemotronHForCausalLM, Mamba2ForCausalLM), judged by
transformers: its model computes megajax's logits from the export, the import gives back exactly the
parameters, and a checkpoint transformers wrote imports and trains."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from random_model import VOCAB, random_model  # noqa: E402
from megajax.checkpoint.common import model_overrides  # noqa: E402
from megajax.checkpoint.hf import export_hf, import_hf  # noqa: E402
from megajax.checkpoint.source import DictSource, flatten, unflatten  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Mamba-2 mixers of 16 heads of 8 in 2 groups (so the in_proj order, the grouped gated norm and the
# conv's channel order all show), state 8, chunks of 8; attention with 8 query and 4 kv heads.
MAMBA = ["model.num_layers=null", "model.mamba_state_dim=8", "model.mamba_head_dim=8", "model.mamba_num_groups=2",
         "model.mamba_chunk_size=8", "model.activation=squared_relu", "model.position_embedding=none"]
HYBRID = MAMBA + ["model.hybrid_layer_pattern=M*-M*-"]
SEQ = 16


def hybrid_model(*overrides):
    """(config, spec, params): the shared random model with the Mamba mixers' gated-norm weights near 1."""
    cfg, spec, params = random_model("llama", *overrides)
    flat = {name: x + 1.0 if name.endswith("mixer/norm") else x for name, x in flatten(params)}
    return cfg, spec, unflatten(flat)


def tokens(batch=2, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ)).astype(np.int32)


def megajax_logits(spec, params, toks):
    return np.asarray(spec.apply(params, toks))[..., :VOCAB]


def hf_model(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.from_numpy(toks).long()).logits.numpy()


def assert_imports_back(out, cfg, params, ignore=()):
    """The import gives back the model's fields (but `ignore`: what the architecture has no place for)
    and exactly its parameters."""
    overrides, params_back = import_hf(out)
    want = {k: v for k, v in model_overrides(cfg.model).items() if k not in ignore}
    assert {k: v for k, v in overrides.items() if k in want} == want
    got, want = dict(flatten(params_back)), dict(flatten(params))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    return overrides, params_back


def test_nemotron_h_export_matches_transformers_and_imports_back(tmp_path):
    cfg, spec, params = hybrid_model(*HYBRID)
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["hybrid_override_pattern"] == "M*-M*-" and config["n_groups"] == 2
    model = hf_model(out)
    assert type(model).__name__ == "NemotronHForCausalLM" and model.config.hybrid_override_pattern == "M*-M*-"
    toks = tokens()
    np.testing.assert_allclose(hf_logits(model, toks), megajax_logits(spec, params, toks), atol=1e-4, rtol=1e-4)

    overrides, params_back = assert_imports_back(out, cfg, params)
    back = load_config(base={"model": overrides}, overrides=["train.seq_len=32"])
    spec_back, _ = build_model_spec(back, back.model.padded_vocab_size())
    np.testing.assert_array_equal(megajax_logits(spec_back, params_back, toks), megajax_logits(spec, params, toks))


def test_mamba2_round_trip_with_tied_embeddings(tmp_path):
    """A pattern of Mamba layers alone is a Mamba2ForCausalLM (its gated norm grouped by n_groups too)."""
    cfg, spec, params = hybrid_model(*MAMBA, "model.hybrid_layer_pattern=MMM", "model.tie_embeddings=true")
    out = export_hf(DictSource(params, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32")
    model = hf_model(out)
    assert type(model).__name__ == "Mamba2ForCausalLM" and model.config.n_groups == 2
    toks = tokens()
    np.testing.assert_allclose(hf_logits(model, toks), megajax_logits(spec, params, toks), atol=1e-4, rtol=1e-4)
    # Mamba2 has no attention, MLP nor position limit: those fields are the defaults on import.
    overrides, _ = assert_imports_back(out, cfg, params, ignore=("num_heads", "num_kv_heads", "head_dim",
                                                                 "ffn_hidden_size", "max_position_embeddings"))
    assert "max_position_embeddings" not in overrides  # the run's train.seq_len applies


# Mixture-of-experts layers as Nemotron-3's: sigmoid scores with an expert bias for the choice, top-2
# weights renormalised and scaled, a shared expert; two groups, so the bias rows follow the MoE layers.
MOE = ["model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
       "model.moe_shared_expert_ffn_size=48", "model.moe_router_score_function=sigmoid",
       "model.moe_router_topk_scaling_factor=2.5", "model.moe_router_bias_update_rate=1e-3"]


def test_nemotron_h_mixture_of_experts_matches_transformers(tmp_path):
    cfg, spec, params = hybrid_model(*MAMBA, "model.hybrid_layer_pattern=M*-EM*-E", *MOE)
    bias = np.random.default_rng(5).normal(0.0, 0.2, (2, 4)).astype(np.float32)  # [MoE layers, E]
    with_bias = unflatten({**dict(flatten(params)), "layers/mlp/expert_bias": bias})
    toks = tokens()
    want = np.asarray(spec.apply(params, toks, expert_bias=bias))[..., :VOCAB]
    assert np.abs(want - np.asarray(spec.apply(params, toks, expert_bias=0 * bias))[..., :VOCAB]).max() > 1e-3
    out = export_hf(DictSource(with_bias, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32")
    np.testing.assert_allclose(hf_logits(hf_model(out), toks), want, atol=1e-4, rtol=1e-4)
    assert_imports_back(out, cfg, with_bias)


def test_hybrid_exports_refuse_what_transformers_cannot_hold(tmp_path):
    cfg, _, params = random_model("llama", *MAMBA, "model.hybrid_layer_pattern=M*-E", "model.num_experts=4",
                                  "model.moe_ffn_hidden_size=32")
    with pytest.raises(CheckpointError, match=r"NemotronHForCausalLM.*moe_router_score_function=softmax "
                                              r"\(needs sigmoid\).*moe_shared_expert_ffn_size=0"):
        export_hf(DictSource(params, cfg.model), tmp_path / "moe", tokenizer_spec="byte")
    cfg, _, params = random_model("llama", *MAMBA, "model.hybrid_layer_pattern=M-", "model.activation=swiglu")
    with pytest.raises(CheckpointError, match=r"activation=swiglu \(needs squared_relu"):
        export_hf(DictSource(params, cfg.model), tmp_path / "swiglu", tokenizer_spec="byte")
    assert not (tmp_path / "moe").exists() and not (tmp_path / "swiglu").exists()


def nemotron_h_config(**changes):
    return transformers.NemotronHConfig(**{**dict(
        vocab_size=300, hidden_size=64, layers_block_type=["linear_attention", "full_attention", "mlp",
                                                            "linear_attention"],
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=128, mamba_num_heads=16,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8, max_position_embeddings=64,
        initializer_range=0.05, tie_word_embeddings=False), **changes})


def test_transformers_saved_nemotron_h_experts_import_with_their_logits(tmp_path):
    """A NemotronH with MoE layers as transformers saves it (per-expert tensors, the expert bias) imports
    with its logits; its latent MoE (experts in a smaller space, moe_latent_size) is refused."""
    from megajax.models.layout import split_expert_bias
    moe = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
               routed_scaling_factor=2.5)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(nemotron_h_config(**moe)).eval()
    with torch.no_grad():
        for layer in (1, 3):
            model.model.layers[layer].mixer.gate.e_score_correction_bias.copy_(0.2 * torch.randn(4))
    model.save_pretrained(tmp_path / "hf")
    overrides, params = import_hf(tmp_path / "hf")
    assert overrides["hybrid_layer_pattern"] == "ME*E" and overrides["moe_router_topk_scaling_factor"] == 2.5
    cfg = load_config(base={"model": overrides}, overrides=["train.seq_len=32"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params, bias = split_expert_bias(params)
    toks = np.random.default_rng(1).integers(0, 300, (2, SEQ)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(spec.apply(params, toks, expert_bias=bias))[..., :300],
                               hf_logits(model, toks), atol=1e-4, rtol=1e-4)

    transformers.NemotronHForCausalLM(nemotron_h_config(**moe, moe_latent_size=16)).save_pretrained(tmp_path / "latent")
    with pytest.raises(CheckpointError, match=r"moe_latent_size=16"):
        import_hf(tmp_path / "latent")


def test_transformers_nemotron_h_imports_and_trains(small_config, tmp_path, capsys):
    """A NemotronH transformers wrote imports with `megajax import` and trains; the first step's loss is
    the one transformers computes on that batch."""
    from megajax.data.loader import build_run_datasets
    from megajax.data.tokenizer import load_tokenizer
    from megajax.train.loop import train
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(nemotron_h_config()).eval()
    with torch.no_grad():  # norm weights away from 1, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")

    assert main(["import", "--format", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mj")]) == 0
    capsys.readouterr()
    overrides, _ = import_hf(tmp_path / "hf")
    assert overrides["hybrid_layer_pattern"] == "M*-M" and overrides["mamba_num_groups"] == 2
    cfg = small_config(*MAMBA, "model.hybrid_layer_pattern=M*-M", "model.vocab_size=300",
                       "model.max_position_embeddings=64", "model.head_dim=8", "model.mamba_num_heads=16",
                       "mesh.data=4", "mesh.tensor=2", f"checkpoint.load={tmp_path / 'mj'}", steps=2)
    result = train(cfg)
    assert len(result.losses) == 2 and np.all(np.isfinite(result.losses))

    dataset, _, _ = build_run_datasets(cfg, load_tokenizer(cfg.data.tokenizer))
    samples = np.stack([np.asarray(dataset[i]["tokens"] if isinstance(dataset[i], dict) else dataset[i])
                        for i in range(cfg.train.global_batch)])
    logits = torch.from_numpy(hf_logits(model, samples[:, :-1].astype(np.int32)))
    hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), torch.from_numpy(samples[:, 1:]).long().reshape(-1))
    np.testing.assert_allclose(result.losses[0], float(hf_loss), rtol=1e-5)
