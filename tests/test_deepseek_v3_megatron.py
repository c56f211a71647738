"""DeepSeek-V3-style models (multi-latent attention, dense-first layers, sigmoid group-limited routing with
an expert bias, a shared expert, multi-token prediction) to and from Megatron-Core checkpoints, judged by
megatron-core 0.16's own GPTModel (MLATransformerConfig, MultiTokenPredictionBlock) on CPU: the legacy
export at TP 2 and the torch_dist export resharded to TP 2 compute megajax's logits; the torch_dist
export holds the keys and shapes of megatron-core's own save; imports give back the exact parameters."""

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from test_deepseek_v3 import (TOKS, VOCAB, YARN_OVERRIDES, logits_of, model, random_model,  # noqa: E402,F401
                              tiny)  # `model`: the fixture
from megajax.checkpoint.megatron import (_overrides_from_args, export_megatron, export_torch_dist,  # noqa: E402
                                         import_megatron)
from megajax.checkpoint.source import DictSource, flatten  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402
from megajax.models.layout import split_expert_bias  # noqa: E402

WORKER = str(Path(__file__).with_name("megatron_worker.py"))
DIST_WORKER = str(Path(__file__).with_name("megatron_dist_worker.py"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv_of_rank, world, log):
    """One gloo process per tensor rank (argv_of_rank(rank)); their output to `log`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:  # a file, not a pipe: no wait on what a worker spawned
        procs = [subprocess.Popen([sys.executable, *argv_of_rank(rank)], env=env, stdout=f,
                                  stderr=subprocess.STDOUT) for rank in range(world)]
        codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * world, Path(log).read_text()[-3000:]


def assert_same_params(got, want):
    got, want = dict(flatten(got)), dict(flatten(want))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def mtp_logits_of(spec, params, toks):
    """megajax's multi-token prediction logits (the objective's) [depths, B, L, vocab]."""
    weights, bias = split_expert_bias(params)
    _, _, mtp = spec.apply(weights, jnp.asarray(toks), expert_bias=bias, router_stats=True, mtp=True)
    return np.asarray(mtp)[..., :VOCAB]


@pytest.fixture(scope="module")
def yarn_model():
    """tiny-deepseek-v3 with YaRN rope scaling (toy sizes; rope and softmax gains both != 1), random weights."""
    return random_model(tiny(*YARN_OVERRIDES))


def test_legacy_export_at_tp2_computes_megajax_logits_in_megatron_core(yarn_model, tmp_path):
    """Legacy checkpoint at TP 2, loaded strictly (MTP depth included) into megatron-core's GPTModel: the
    logits are megajax's, and so are the MTP depth's (the last position, where megatron-core rolls in a
    zero token and megajax wraps the first, left out: the loss masks it); imported back, the
    parameters bit for bit. With YaRN rope scaling (megatron-core's rope_type=yarn: its frequencies, the
    cos/sin concentration and the softmax scale)."""
    pytest.importorskip("megatron.core")
    cfg, spec, params = yarn_model
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=2, dtype="fp32",
                          iteration=1)
    step = out / "iter_0000001"
    np.save(tmp_path / "tokens.npy", TOKS)
    port = free_port()
    run_ranks(lambda r: [WORKER, str(step), str(tmp_path / "tokens.npy"), str(tmp_path / "logits.npy"), str(r),
                         "2", str(port)], 2, tmp_path / "worker.log")
    logits = np.load(tmp_path / "logits.npy")
    np.testing.assert_allclose(logits[..., :VOCAB], logits_of(spec, params, TOKS), atol=1e-4, rtol=1e-4)
    mtp = np.load(tmp_path / "logits_mtp.npy")
    assert mtp.shape[0] == cfg.model.mtp_num_layers == 1
    np.testing.assert_allclose(mtp[:, :, :-1, :VOCAB], mtp_logits_of(spec, params, TOKS)[:, :, :-1],
                               atol=1e-4, rtol=1e-4)

    import torch
    saved = torch.load(step / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
    args = saved["args"]
    assert (args.multi_latent_attention, args.qk_layernorm, args.rope_type, args.moe_layer_freq,
            args.mtp_num_layers) == (True, True, "yarn", [0, 1, 1], 1)
    assert (args.rotary_scaling_factor, args.mscale, args.mscale_all_dim, args.beta_fast,
            args.original_max_position_embeddings) == (4.0, 0.8, 1.0, 4.0, 8)
    sd = saved["model"]
    assert sd["decoder.layers.0.self_attention.linear_q_up_proj.weight"].shape == (2 * (32 + 16), 64)  # 2 heads
    assert sd["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape == ((32 + 16) // 2, 128)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in sd and "decoder.layers.0.mlp.router.weight" not in sd
    assert sd["mtp.layers.0.eh_proj.weight"].shape == (64, 256)

    overrides, back = import_megatron(out)
    assert (overrides["moe_layer_freq"], overrides["mtp_num_layers"], overrides["multi_latent_attention"],
            overrides["qk_norm"]) == ([0, 1, 1], 1, True, False)
    assert (overrides["rope_scaling"], overrides["rope_mscale"], overrides["rope_original_max_position"]) == (
        "yarn", 0.8, 8)
    assert_same_params(back, params)

    # Transformer Engine's spec fuses the latent norms into the up-projections: those names import alike.
    fused = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
             "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight"}
    for rank in ("mp_rank_00", "mp_rank_01"):
        f = step / rank / "model_optim_rng.pt"
        saved = torch.load(f, weights_only=False)
        saved["model"] = {next((k.replace(a, b) for a, b in fused.items() if k.endswith(a)), k): v
                          for k, v in saved["model"].items()}
        assert "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight" in saved["model"]
        torch.save(saved, f)
    assert_same_params(import_megatron(out)[1], params)


def test_torch_dist_export_is_megatron_cores_layout_and_loads_at_tp2(model, tmp_path):
    """torch_dist export: the keys and global shapes of megatron-core's own dist_checkpointing.save of
    the same model (each layer under its own keys, as megatron-core keeps layers that differ; the MTP
    depth under mtp.layers.0); megatron-core's dist_checkpointing.load fills a TP-2 GPTModel from it
    with megajax's logits; imported back (ours and megatron-core's), the parameters bit for bit."""
    pytest.importorskip("megatron.core")
    from megajax.checkpoint.torch_dist import DistCheckpoint
    cfg, spec, params = model
    legacy = export_megatron(DictSource(params, cfg.model), tmp_path / "legacy", dtype="fp32", iteration=1)
    ours = export_torch_dist(DictSource(params, cfg.model), tmp_path / "dist", dtype="fp32", iteration=1,
                             megatron_version="0.16")
    np.save(tmp_path / "tokens.npy", TOKS)
    run_ranks(lambda r: [DIST_WORKER, "save", str(tmp_path / "tokens.npy"), "0", "1", str(free_port()),
                         str(legacy / "iter_0000001"), str(tmp_path / "theirs")], 1, tmp_path / "save.log")
    mine, theirs = DistCheckpoint(ours / "iter_0000001"), DistCheckpoint(tmp_path / "theirs" / "iter_0000001")
    assert {k: mine.shape(k) for k in mine.keys()} == {k: theirs.shape(k) for k in theirs.keys()}
    assert set(mine.byte_keys()) == set(theirs.byte_keys())
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in set(mine.keys())

    port = free_port()
    run_ranks(lambda r: [DIST_WORKER, "load", str(ours / "iter_0000001"), str(tmp_path / "tokens.npy"),
                         str(tmp_path / "logits.npy"), str(r), "2", str(port)], 2, tmp_path / "load.log")
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy")[..., :VOCAB], logits_of(spec, params, TOKS),
                               atol=1e-4, rtol=1e-4)
    for path in (ours, tmp_path / "theirs"):
        overrides, back = import_megatron(path, trust=True)
        assert overrides["moe_layer_freq"] == [0, 1, 1] and overrides["mtp_num_layers"] == 1
        assert_same_params(back, params)


def _args(**changes):
    """Megatron args of tiny-deepseek-v3 (as the export writes them), with `changes`."""
    from megajax.checkpoint.megatron import megatron_args
    m = tiny().model
    args = megatron_args(m, tensor_parallel=1, pipeline_parallel=1, padded_vocab_size=384, dtype="fp32",
                         iteration=1)
    return argparse.Namespace(**{**vars(args), **changes})


def test_megatron_import_reads_the_dense_first_list_and_refuses_what_megajax_cannot_hold():
    assert _overrides_from_args(_args())["moe_layer_freq"] == [0, 1, 1]
    assert _overrides_from_args(_args(moe_layer_freq="[0]*1+[1]*2"))["moe_layer_freq"] == [0, 1, 1]
    assert _overrides_from_args(_args(moe_layer_freq=[1, 1, 1]))["moe_layer_freq"] == 1
    with pytest.raises(CheckpointError, match=r"moe_layer_freq=\[1, 0, 1\].*dense layers first"):
        _overrides_from_args(_args(moe_layer_freq=[1, 0, 1]))
    with pytest.raises(CheckpointError, match=r"moe_layer_freq=\[0, 0, 0\]"):
        _overrides_from_args(_args(moe_layer_freq=[0, 0, 0]))
    with pytest.raises(CheckpointError, match=r"qk_layernorm=False.*latent norms"):
        _overrides_from_args(_args(qk_layernorm=False))
    with pytest.raises(CheckpointError, match=r"rope_type='llama3'.*rope or yarn"):
        _overrides_from_args(_args(rope_type="llama3"))
    # yarn: the args' fields (rotary_scaling_factor 1.0, mscale 1.0 here), megatron-core's defaults for the others
    yarn = _overrides_from_args(_args(rope_type="yarn", mscale_all_dim=0.5))
    assert (yarn["rope_scaling"], yarn["rope_scaling_factor"], yarn["rope_original_max_position"],
            yarn["rope_beta_fast"], yarn["rope_mscale_all_dim"]) == ("yarn", 1.0, 4096, 32.0, 0.5)


def test_megatron_export_refuses_latents_tensor_ranks_cannot_split(model, tmp_path):
    cfg, _, params = model
    with pytest.raises(CheckpointError, match=r"kv_lora_rank \+ qk_pos_emb_head_dim=48 is not divisible by "
                                              r"tensor_parallel=32"):
        export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=32, dtype="fp32")
    assert not (tmp_path / "mc").exists()


# Multi-token prediction over pipeline stages, as megatron-core places it: the depths on the last stage,
# which then holds the embeddings too. A mixture of experts (its MTP depth one too, like its last layer)
# at pipeline 2 x tensor 2, and a GPT with learned positions and tied embeddings (a dense depth) at
# pipeline 2.
PIPELINE_MTP = {
    "moe": (("llama", "model.num_experts=4", "model.moe_router_topk=2", "model.mtp_num_layers=1"), 2),
    "gpt": (("gpt", "model.mtp_num_layers=1", "model.mtp_loss_scaling_factor=0.2"), 1),
}


@pytest.mark.parametrize("kind", sorted(PIPELINE_MTP))
def test_mtp_over_pipeline_stages_loads_in_megatron_core(kind, tmp_path):
    """The legacy export at pipeline 2 loads strictly into megatron-core's GPTModel stages as
    pretrain_gpt.py builds them (the MTP block on the last stage, with the embeddings): its logits and
    MTP logits are megajax's; imported back, the parameters bit for bit."""
    pytest.importorskip("megatron.core")
    from random_model import random_model as small_model
    overrides, tp = PIPELINE_MTP[kind]
    cfg, spec, params = small_model(*overrides)
    assert cfg.model.mtp_moe() == (kind == "moe")
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=tp, pipeline_parallel=2,
                          dtype="fp32", iteration=1)
    step = out / "iter_0000001"
    import torch
    last = torch.load(step / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "embedding.word_embeddings.weight" in last and "mtp.layers.0.eh_proj.weight" in last
    assert ("mtp.layers.0.transformer_layer.mlp.router.weight" in last) == (kind == "moe")
    np.save(tmp_path / "tokens.npy", TOKS)
    port = free_port()
    run_ranks(lambda r: [WORKER, str(step), str(tmp_path / "tokens.npy"), str(tmp_path / "logits.npy"), str(r),
                         str(tp), str(port)], tp, tmp_path / "worker.log")
    weights, bias = split_expert_bias(params)
    want = np.asarray(spec.apply(weights, jnp.asarray(TOKS), expert_bias=bias))[..., :VOCAB]
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy")[..., :VOCAB], want, atol=1e-4, rtol=1e-4)
    mtp = np.load(tmp_path / "logits_mtp.npy")
    np.testing.assert_allclose(mtp[:, :, :-1, :VOCAB], mtp_logits_of(spec, params, TOKS)[:, :, :-1], atol=1e-4,
                               rtol=1e-4)
    overrides_back, back = import_megatron(out)
    assert overrides_back["mtp_num_layers"] == 1
    assert_same_params(back, params)


def test_megajax_import_and_export_commands_carry_the_model_through(model, tmp_path, capsys):
    """`megajax import --format megatron` of the legacy export, then `megajax export --format megatron` of
    the imported checkpoint (torch_dist): the same architecture and parameters bit for bit (the expert bias
    through the train state), and the export's note on the MTP depths."""
    from megajax.cli import main
    cfg, _, params = model
    legacy = export_megatron(DictSource(params, cfg.model), tmp_path / "legacy", dtype="fp32", iteration=1)
    assert main(["import", "--format", "megatron", "--input", str(legacy), "--output", str(tmp_path / "mj")]) == 0
    capsys.readouterr()
    assert main(["export", "--format", "megatron", "--checkpoint", str(tmp_path / "mj"), "--output",
                 str(tmp_path / "dist"), "--dtype", "fp32"]) == 0
    assert "note: model.mtp_block" not in capsys.readouterr().err  # the depth is built as Megatron-LM builds it
    overrides, back = import_megatron(tmp_path / "dist")
    assert (overrides["multi_latent_attention"], overrides["moe_layer_freq"], overrides["mtp_num_layers"],
            overrides["mtp_loss_scaling_factor"]) == (True, [0, 1, 1], 1, cfg.model.mtp_loss_scaling_factor)
    assert_same_params(back, params)
