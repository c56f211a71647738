"""Hybrid (Mamba-2) models in Megatron-Core's checkpoint formats (megajax/checkpoint/megatron_hybrid.py).

megatron-core's Mamba mixer needs CUDA (and mamba_ssm) to be built, so its names and shapes are
judged against a list read off megatron-core 0.16.1's sources (cited below), and its numbers by
round trips: a tensor-parallel export whose in_proj / conv1d were cut as contiguous blocks instead of
part by part would reassemble wrongly, which the TP 2 comparisons with TP 1 catch (2 B/C groups, so
each rank holds one group).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

from random_model import random_model  # noqa: E402
from megajax.checkpoint.common import model_overrides  # noqa: E402
from megajax.checkpoint.megatron import export_megatron, export_torch_dist, import_megatron  # noqa: E402
from megajax.checkpoint.source import DictSource, flatten  # noqa: E402
from megajax.checkpoint.torch_dist import DistCheckpoint  # noqa: E402
from megajax.errors import CheckpointError  # noqa: E402

# Two groups 'M*-E' (8 layers): a Mamba-2 mixer of 8 heads of 8 (d_in 64) in 2 groups of state 8,
# attention (8 query heads, 4 kv heads of 8) without position embedding, a squared-ReLU MLP (128),
# a mixture of 4 experts (32 each). Hidden 64, vocabulary 257 (padded to 384 at TP 1).
HYBRID = ("model.num_layers=null", "model.hybrid_layer_pattern=M*-EM*-E", "model.activation=squared_relu",
          "model.position_embedding=none", "model.mamba_state_dim=8", "model.mamba_head_dim=8",
          "model.mamba_num_groups=2", "model.mamba_num_heads=8", "model.mamba_chunk_size=8",
          "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32")

# megatron-core 0.16.1's names and shapes at TP 1 (mamba_layer_specs.py's mamba_stack_spec):
# MambaMixer.__init__ builds in_proj [2 d_in + 2 G N + H, D] ("z x B C dt"), conv1d = nn.Conv1d(conv_dim,
# conv_dim, groups=conv_dim) [conv_dim, 1, d_conv] with conv_dim = d_in + 2 G N ("x B C"), dt_bias,
# A_log, D [H] (D_has_hdim=False), norm = ExtendedRMSNorm(d_in), out_proj [D, d_in]; in_proj is a
# TELayerNormColumnParallelLinear (the layer's norm: layer_norm_weight), MambaLayer.norm is IdentityOp.
# The attention layer: linear_qkv (TELayerNormColumnParallelLinear), linear_proj; the MLP layer:
# linear_fc1 (TELayerNormColumnParallelLinear), linear_fc2; the MoE layer: pre_mlp_layernorm (TENorm),
# mlp.router, the experts; MambaStack.final_norm (TENorm); MambaModel.output_layer, embedding.
MAMBA = {"mixer.in_proj.layer_norm_weight": (64,), "mixer.in_proj.weight": (168, 64),
         "mixer.conv1d.weight": (96, 1, 4), "mixer.conv1d.bias": (96,), "mixer.A_log": (8,), "mixer.D": (8,),
         "mixer.dt_bias": (8,), "mixer.norm.weight": (64,), "mixer.out_proj.weight": (64, 64)}
ATTENTION = {"self_attention.linear_qkv.layer_norm_weight": (64,), "self_attention.linear_qkv.weight": (128, 64),
             "self_attention.linear_proj.weight": (64, 64)}
MLP = {"mlp.linear_fc1.layer_norm_weight": (64,), "mlp.linear_fc1.weight": (128, 64), "mlp.linear_fc2.weight": (64, 128)}
MOE = {"pre_mlp_layernorm.weight": (64,), "mlp.router.weight": (4, 64),
       **{f"mlp.experts.local_experts.{j}.linear_fc{k}.weight": s for j in range(4)
          for k, s in ((1, (32, 64)), (2, (64, 32)))}}
EXPECTED = {"embedding.word_embeddings.weight": (384, 64), "decoder.final_norm.weight": (64,),
            "output_layer.weight": (384, 64),
            **{f"decoder.layers.{i}.{k}": s for i in range(8) for k, s in (MAMBA, ATTENTION, MLP, MOE)[i % 4].items()}}


@pytest.fixture(scope="module")
def model():
    cfg, _, params = random_model("llama", *HYBRID)
    return cfg, params


def rank_file(out, tp: int, pp: int = 1, t: int = 0, s: int = 0) -> dict:
    name = f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "")
    return torch.load(out / "release" / name / "model_optim_rng.pt", weights_only=False)


def assert_same(got: dict, want: dict):
    got, want = dict(flatten(got)), dict(flatten(want))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_legacy_names_and_shapes_are_megatron_cores(model, tmp_path):
    cfg, params = model
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", dtype="fp32")
    sd = rank_file(out, 1)["model"]
    assert {k: tuple(v.shape) for k, v in sd.items() if v is not None} == EXPECTED
    assert "decoder.layers.0.mixer.in_proj._extra_state" in sd and "output_layer._extra_state" in sd


def megatron_view(m) -> dict:
    """The model's config as a Megatron checkpoint gives it back: Megatron's mixer fixes the chunk at 128."""
    return model_overrides(m) | {"mamba_chunk_size": 128}


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_legacy_round_trip(model, tp, pp, tmp_path):
    cfg, params = model
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=tp, pipeline_parallel=pp,
                          dtype="fp32")
    overrides, back = import_megatron(out)
    assert overrides == megatron_view(cfg.model)
    assert_same(back, params)
    if pp > 1:  # each stage numbers its layers from 0 (MambaStack's module list)
        assert "decoder.layers.0.mixer.in_proj.weight" in rank_file(out, tp, pp, 0, 1)["model"]


def test_tp2_is_tp1_split_part_by_part(model, tmp_path):
    """Rank r of TP 2 holds [z_r; x_r; B_r; C_r; dt_r] of in_proj and [x_r; B_r; C_r] of conv1d
    (MambaMixer.__init__: each rank's d_inner_local_tp, ngroups_local_tp x d_state, nheads_local_tp)."""
    cfg, params = model
    src = DictSource(params, cfg.model)
    one = rank_file(export_megatron(src, tmp_path / "tp1", dtype="fp32"), 1)["model"]
    out = export_megatron(src, tmp_path / "tp2", tensor_parallel=2, dtype="fp32")
    two = [rank_file(out, 2, t=t)["model"] for t in range(2)]
    d_in, gn, h = 64, 16, 8
    for name, sizes in (("mixer.in_proj.weight", (d_in, d_in, gn, gn, h)), ("mixer.conv1d.weight", (d_in, gn, gn)),
                        ("mixer.conv1d.bias", (d_in, gn, gn))):
        key = f"decoder.layers.4.{name}"
        halves = [torch.split(sd[key], [n // 2 for n in sizes]) for sd in two]
        np.testing.assert_array_equal(torch.cat([torch.cat(p) for p in zip(*halves)]), one[key], err_msg=name)
        assert not torch.equal(torch.cat([sd[key] for sd in two]), one[key])  # not a contiguous split
    for name, dim in (("mixer.A_log", 0), ("mixer.D", 0), ("mixer.dt_bias", 0), ("mixer.norm.weight", 0),
                      ("mixer.out_proj.weight", 1), ("mixer.in_proj.layer_norm_weight", None)):
        key = f"decoder.layers.0.{name}"
        want = one[key] if dim is None else torch.cat([sd[key] for sd in two], dim)
        assert torch.equal(two[0][key] if dim is None else want, one[key]), name


def test_torch_dist_round_trip_and_keys(model, tmp_path):
    """torch_dist: each layer under its own keys, no layer dim (MambaStack.sharded_state_dict), in_proj
    and conv1d as their parts' keys (MambaMixer.sharded_state_dict's _split_tensor_factory)."""
    cfg, params = model
    src = DictSource(params, cfg.model)
    out = export_torch_dist(src, tmp_path / "td", dtype="fp32")
    overrides, back = import_megatron(out)
    assert overrides == megatron_view(cfg.model)
    assert_same(back, params)
    ckpt = DistCheckpoint(out / "release")
    layer0 = {k[len("decoder.layers.0."):]: ckpt.shape(k) for k in ckpt.keys() if k.startswith("decoder.layers.0.")}
    assert layer0 == {"mixer.in_proj.layer_norm_weight": (64,), "mixer.in_proj.weight.z": (64, 64),
                      "mixer.in_proj.weight.x": (64, 64), "mixer.in_proj.weight.B": (16, 64),
                      "mixer.in_proj.weight.C": (16, 64), "mixer.in_proj.weight.dt": (8, 64),
                      "mixer.conv1d.weight.x": (64, 1, 4), "mixer.conv1d.weight.B": (16, 1, 4),
                      "mixer.conv1d.weight.C": (16, 1, 4), "mixer.conv1d.bias.x": (64,), "mixer.conv1d.bias.B": (16,),
                      "mixer.conv1d.bias.C": (16,), "mixer.A_log": (8,), "mixer.D": (8,), "mixer.dt_bias": (8,),
                      "mixer.norm.weight": (64,), "mixer.out_proj.weight": (64, 64)}
    assert ckpt.shape("decoder.layers.3.mlp.experts.experts.linear_fc1.weight") == (4, 32, 64)
    assert "decoder.layers.3.pre_mlp_layernorm.weight" in ckpt.keys()
    # The TP 1 legacy export's tensors, part by part.
    one = rank_file(export_megatron(src, tmp_path / "tp1", dtype="fp32"), 1)["model"]
    parts = [ckpt.read(f"decoder.layers.4.mixer.in_proj.weight.{p}") for p in ("z", "x", "B", "C", "dt")]
    np.testing.assert_array_equal(np.concatenate(parts), one["decoder.layers.4.mixer.in_proj.weight"])


def test_args_carry_the_hybrid_and_import_reads_either_pattern(model, tmp_path):
    cfg, params = model
    out = export_megatron(DictSource(params, cfg.model), tmp_path / "mc", dtype="fp32")
    path = out / "release" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(path, weights_only=False)
    args = saved["args"]
    assert (args.hybrid_override_pattern, args.hybrid_layer_pattern, args.is_hybrid_model) == ("M*-EM*-E", "M*-EM*-E", True)
    assert (args.mamba_state_dim, args.mamba_head_dim, args.mamba_num_groups, args.mamba_num_heads) == (8, 8, 2, 8)
    assert (args.squared_relu, args.swiglu, args.position_embedding_type, args.add_position_embedding) == (
        True, False, "none", False)
    assert args.spec == ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    args.hybrid_layer_pattern = "M*-EM*|-E"  # a Megatron run's pipeline stages of other layers
    torch.save(saved, path)
    overrides, back = import_megatron(out)
    assert overrides["hybrid_layer_pattern"] == "M*-EM*|-E"  # read and kept; it moves no layer
    assert_same(back, params)
    from megajax.config import load_config
    assert load_config(base=cfg.to_dict(), overrides=["model.hybrid_layer_pattern=M*-EM*|-E"]).model.num_layers == 8
    del args.hybrid_layer_pattern  # megatron-core 0.16's args: the override pattern alone
    torch.save(saved, path)
    assert import_megatron(out)[0]["hybrid_layer_pattern"] == "M*-EM*-E"
    args.hybrid_override_pattern = None  # a hybrid whose layers Megatron allocated from ratios
    torch.save(saved, path)
    with pytest.raises(CheckpointError, match="hybrid_override_pattern=None"):
        import_megatron(out)


@pytest.mark.parametrize("override,match", [("model.mamba_num_groups=1", "mamba_num_groups=1 is not divisible"),
                                            ("model.mamba_conv_kernel=3", "mamba_conv_kernel=3")])
def test_what_megatron_cannot_hold_is_refused_by_name(override, match, tmp_path):
    cfg, _, params = random_model("llama", *HYBRID, override)
    with pytest.raises(CheckpointError, match=match):
        export_megatron(DictSource(params, cfg.model), tmp_path / "mc", tensor_parallel=2)
