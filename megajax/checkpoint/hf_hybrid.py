"""Hybrid Mamba-2 models in Hugging Face's layout: NemotronHForCausalLM and Mamba2ForCausalLM.

Both name their tensors alike (`backbone.layers.N.norm`, `backbone.layers.N.mixer.*`), so one table
holds both; the architecture is a matter of config.json. A Mamba-2 mixer is one fused in_proj, rows
[z | x | B | C | dt] (d_inner, d_inner, G x N, G x N, H), one depthwise conv1d over the channels
[x | B | C] (weight [conv_dim, 1, K] and bias), A_log, D, dt_bias [H], the gated norm's weight
[d_inner] (RMSNorm over each of the G groups of d_inner / G channels, after the gate) and out_proj.

    model.hybrid_layer_pattern layer    Hugging Face backbone.layers.N.mixer
    M  Mamba-2 mixer                    in_proj, conv1d, A_log, D, dt_bias, norm, out_proj
    *  attention (no position embedding) q_proj, k_proj, v_proj, o_proj
    -  squared-ReLU MLP                 up_proj (fc1), down_proj (fc2)
    E  mixture of experts               gate (router, e_score_correction_bias), experts.{j}.up_proj/down_proj,
                                        shared_experts.up_proj/down_proj

A pattern of Mamba layers alone goes to Mamba2ForCausalLM where that class can hold it (the inner
size an integer multiple of hidden_size: its `expand`), any other to NemotronHForCausalLM.
"""

from __future__ import annotations

import math

from megajax.checkpoint.common import REQUIRED, read_fields
from megajax.checkpoint.mapping import Row, depthwise, flat, linear, same
from megajax.config import ModelConfig
from megajax.errors import CheckpointError
from megajax.models.layout import EXPERT_BIAS

NEMOTRON_H, MAMBA2 = "NemotronHForCausalLM", "Mamba2ForCausalLM"
HYBRID_ARCHITECTURES = (NEMOTRON_H, MAMBA2)
_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # layers_block_type's names
_B = "backbone.layers.{i}"


def _slot_rows(j: int) -> tuple[Row, ...]:
    """The rows of slot j of a hybrid group, for every kind of layer (a row applies where its
    parameters exist, so the slot's kind picks its own)."""
    p, mix = f"layers/layer{j}", f"layers/layer{j}/mixer"
    return (
        Row(f"{_B}.norm.weight", flat(f"{p}/norm/scale")),
        # M: the Mamba-2 mixer
        Row(f"{_B}.mixer.in_proj.weight", *(linear(f"{mix}/{x}/kernel") for x in ("z", "x", "B", "C", "dt"))),
        Row(f"{_B}.mixer.conv1d.weight", *(depthwise(f"{mix}/conv_{x}") for x in "xBC")),
        Row(f"{_B}.mixer.conv1d.bias", *(flat(f"{mix}/conv_{x}_bias") for x in "xBC")),
        Row(f"{_B}.mixer.A_log", same(f"{mix}/A_log")),
        Row(f"{_B}.mixer.D", same(f"{mix}/D")),
        Row(f"{_B}.mixer.dt_bias", same(f"{mix}/dt_bias")),
        Row(f"{_B}.mixer.norm.weight", flat(f"{mix}/norm")),
        Row(f"{_B}.mixer.out_proj.weight", linear(f"{mix}/out/kernel", n_in=2)),
        # *: attention
        Row(f"{_B}.mixer.q_proj.weight", linear(f"{mix}/q/kernel")),
        Row(f"{_B}.mixer.k_proj.weight", linear(f"{mix}/k/kernel")),
        Row(f"{_B}.mixer.v_proj.weight", linear(f"{mix}/v/kernel")),
        Row(f"{_B}.mixer.o_proj.weight", linear(f"{mix}/o/kernel", n_in=2)),
        # -: the squared-ReLU MLP
        Row(f"{_B}.mixer.up_proj.weight", linear(f"{mix}/fc1/kernel")),
        Row(f"{_B}.mixer.down_proj.weight", linear(f"{mix}/fc2/kernel")),
        # E: the mixture of experts (per-expert tensors as the Hub's files hold them; transformers stacks them)
        Row(f"{_B}.mixer.gate.weight", linear(f"{mix}/router")),
        Row(f"{_B}.mixer.experts.{{j}}.up_proj.weight", linear(f"{mix}/fc1", experts=True)),
        Row(f"{_B}.mixer.experts.{{j}}.down_proj.weight", linear(f"{mix}/fc2", experts=True)),
        Row(f"{_B}.mixer.shared_experts.up_proj.weight", linear(f"{mix}/shared_experts/fc1/kernel")),
        Row(f"{_B}.mixer.shared_experts.down_proj.weight", linear(f"{mix}/shared_experts/fc2/kernel")),
    )


def hybrid_rows(m: ModelConfig) -> tuple[Row, ...]:
    """The table of a hybrid model: the embedding, each slot of its pattern's group, the final norm and
    the output layer (a tied model writes the embedding there too: NemotronH does not tie)."""
    return (Row("backbone.embeddings.weight", same("embed/embedding"), vocab=True),
            *(r for j in range(len(m.hybrid_group())) for r in _slot_rows(j)),
            Row(f"{_B}.mixer.gate.e_score_correction_bias", same(EXPERT_BIAS)),  # per MoE layer (mapping.py)
            Row("backbone.norm_f.weight", flat("final_norm/scale")),
            Row("lm_head.weight", linear("output"), vocab=True),
            Row("lm_head.weight", same("embed/embedding"), vocab=True, copy=True))


def hybrid_architecture(m: ModelConfig) -> str:
    """MAMBA2 or NEMOTRON_H for a hybrid model; CheckpointError naming every trait neither can hold."""
    pattern = m.hybrid_pattern()
    wrong = []
    if m.norm != "rmsnorm":
        wrong.append(f"norm={m.norm} (needs rmsnorm)")
    if m.use_bias:
        wrong.append("use_bias=true (needs false: NemotronH's attention and Mamba projections have no biases here)")
    if m.qk_norm:
        wrong.append("qk_norm=true (needs false: no q/k norms)")
    if m.position_embedding == "learned" or ("*" in pattern and m.position_embedding != "none"):
        wrong.append(f"position_embedding={m.position_embedding} (needs none: NemotronH's attention has no "
                     f"position embedding)")
    if ("-" in pattern or "E" in pattern) and m.activation != "squared_relu":
        wrong.append(f"activation={m.activation} (needs squared_relu: NemotronH's MLPs are relu2)")
    if "E" in pattern:
        wrong += _moe_wrong(m)
    if wrong:
        raise CheckpointError(f"model.hybrid_layer_pattern={m.hybrid_layer_pattern!r} exports to Hugging Face "
                              f"{NEMOTRON_H}, which cannot express {'; '.join(wrong)}.")
    if set(pattern) == {"M"} and m.mamba_inner_size() % m.hidden_size == 0:
        return MAMBA2
    return NEMOTRON_H


_INF = {"__float__": "Infinity"}  # how transformers writes an infinite float into config.json


def _moe_wrong(m: ModelConfig) -> list[str]:
    """What NemotronH's mixture of experts cannot hold of a model's: its router scores with a sigmoid and
    adds an expert bias (e_score_correction_bias) for the choice, renormalises the top-k weights
    (norm_topk_prob: megajax does when k > 1), and every MoE layer has one ungated shared expert."""
    wrong = []
    if m.moe_router_score_function != "sigmoid":
        wrong.append(f"moe_router_score_function={m.moe_router_score_function} (needs sigmoid)")
    if not m.moe_router_bias_update_rate > 0:
        wrong.append("moe_router_bias_update_rate=0 (needs > 0: the router's expert bias, e_score_correction_bias)")
    if not m.moe_shared_expert_ffn_size:
        wrong.append("moe_shared_expert_ffn_size=0 (needs a shared expert: every NemotronH MoE layer has one)")
    if m.moe_shared_expert_gate:
        wrong.append("moe_shared_expert_gate=true (needs false)")
    if (m.moe_router_num_groups or 1) != 1 and m.moe_router_group_topk != m.moe_router_num_groups:
        wrong.append(f"moe_router_num_groups={m.moe_router_num_groups} / moe_router_group_topk="
                     f"{m.moe_router_group_topk} (group-limited routing; needs one group)")
    return wrong


def _time_step_limit(m: ModelConfig) -> list | None:
    """config.json's time_step_limit, or None for transformers' default (0, inf)."""
    if m.mamba_time_step_min == 0.0 and m.mamba_time_step_max is None:
        return None
    return [m.mamba_time_step_min, _INF if m.mamba_time_step_max is None else m.mamba_time_step_max]


def _float(value) -> float:
    """A config.json float, transformers' {"__float__": "Infinity"} form included."""
    return float(value["__float__"] if isinstance(value, dict) and "__float__" in value else value)


def hybrid_config(m: ModelConfig, arch: str) -> dict:
    """The architecture's config.json keys (without architectures, token ids and dtype)."""
    mamba = dict(hidden_size=m.hidden_size, vocab_size=m.vocab_size, n_groups=m.mamba_num_groups,
                 conv_kernel=m.mamba_conv_kernel, chunk_size=m.mamba_chunk_size, use_conv_bias=True,
                 use_bias=False, time_step_min=m.mamba_dt_min, time_step_max=m.mamba_dt_max,
                 time_step_floor=1e-4, layer_norm_epsilon=m.norm_eps, initializer_range=m.init_std,
                 tie_word_embeddings=m.tie_embeddings, use_cache=True)
    if (limit := _time_step_limit(m)) is not None:
        mamba["time_step_limit"] = limit
    if arch == MAMBA2:
        return dict(mamba, model_type="mamba2", num_heads=m.mamba_num_heads, head_dim=m.mamba_head_dim,
                    state_size=m.mamba_state_dim, num_hidden_layers=m.num_layers, hidden_act="silu",
                    expand=m.mamba_inner_size() // m.hidden_size, residual_in_fp32=True,
                    rescale_prenorm_residual=False)
    pattern = m.hybrid_pattern()
    config = dict(mamba, model_type="nemotron_h", layers_block_type=[_KINDS[k] for k in pattern],
                  hybrid_override_pattern=pattern, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                  max_position_embeddings=m.max_position_embeddings, attention_bias=False,
                  attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
                  intermediate_size=m.ffn_hidden_size, mlp_hidden_act="relu2", mlp_bias=False,
                  ssm_state_size=m.mamba_state_dim, mamba_num_heads=m.mamba_num_heads,
                  mamba_head_dim=m.mamba_head_dim, mamba_hidden_act="silu", mamba_proj_bias=False,
                  residual_in_fp32=False, num_nextn_predict_layers=0)
    if m.mamba_inner_size() % m.hidden_size == 0:  # unused by NemotronH's mixer (its heads x head dim)
        config["expand"] = m.mamba_inner_size() // m.hidden_size
    if "E" in pattern:
        config.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                      moe_intermediate_size=m.moe_ffn_hidden_size, n_shared_experts=1,
                      moe_shared_expert_intermediate_size=m.moe_shared_expert_ffn_size, moe_latent_size=None,
                      routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0, n_group=1, topk_group=1,
                      norm_topk_prob=m.moe_router_topk > 1, output_router_logits=False)
    return config


def _check(c: dict, arch: str, wants: tuple) -> None:
    for key, want in wants:
        if c.get(key, want) != want:
            raise CheckpointError(f"config.json {key}={c[key]!r}: megajax's {arch} import needs {key}={want!r}.")


def _mamba_fields(c: dict, arch: str) -> dict:
    """The Mamba-2 mixers' ModelConfig fields of either architecture's config.json."""
    _check(c, arch, (("use_conv_bias", True), ("use_bias", False), ("mamba_proj_bias", False)))
    act = c.get("mamba_hidden_act" if arch == NEMOTRON_H else "hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json Mamba activation {act!r}: megajax's Mamba-2 mixer uses silu.")
    low, high = (_float(x) for x in (c.get("time_step_limit") or (0.0, math.inf)))
    return dict(mamba_num_groups=int(c.get("n_groups", 8)), mamba_conv_kernel=int(c.get("conv_kernel", 4)),
                mamba_chunk_size=int(c.get("chunk_size", 128 if arch == NEMOTRON_H else 256)),
                mamba_time_step_min=float(low), mamba_time_step_max=None if high == math.inf else float(high),
                mamba_dt_min=float(c.get("time_step_min", 0.001)), mamba_dt_max=float(c.get("time_step_max", 0.1)))


def hybrid_overrides(c: dict, arch: str) -> dict:
    """ModelConfig fields of a NemotronH or Mamba-2 config.json; CheckpointError for what megajax cannot
    run alike."""
    common = (("hidden_size", "hidden_size", REQUIRED), ("vocab_size", "vocab_size", REQUIRED),
              ("layer_norm_epsilon", "norm_eps", 1e-5), ("tie_word_embeddings", "tie_embeddings", False),
              ("initializer_range", "init_std", 0.02))
    traits = dict(family="llama", norm="rmsnorm", activation="squared_relu", position_embedding="none",
                  use_bias=False, **_mamba_fields(c, arch))
    if arch == MAMBA2:
        out = read_fields(c.get, common + (("num_hidden_layers", "num_layers", REQUIRED),
                                           ("num_heads", "mamba_num_heads", REQUIRED),
                                           ("head_dim", "mamba_head_dim", REQUIRED),
                                           ("state_size", "mamba_state_dim", REQUIRED)), "config.json")
        # No attention: megajax's attention fields are unused; 4 heads as its default where they divide.
        heads = {} if out["hidden_size"] % 4 == 0 else {"num_heads": 1}
        return dict(out, **traits, **heads, hybrid_layer_pattern="M" * out.pop("num_layers"))
    types = c.get("layers_block_type") or c.get("layer_types")
    if types is None and c.get("hybrid_override_pattern"):
        pattern = c["hybrid_override_pattern"]
    else:
        names = {v: k for k, v in _KINDS.items()} | {"mamba": "M", "attention": "*"}
        unknown = sorted(set(types or ()) - set(names))
        if not types or unknown:
            raise CheckpointError(f"config.json layers_block_type={types!r}: needs a list of "
                                  f"{', '.join(_KINDS.values())}.")
        pattern = "".join(names[t] for t in types)
    _check(c, arch, (("mlp_hidden_act", "relu2"), ("attention_bias", False), ("mlp_bias", False),
                     ("sliding_window", None)))
    out = read_fields(c.get, common + (
        ("num_attention_heads", "num_heads", REQUIRED), ("num_key_value_heads", "num_kv_heads", None),
        ("head_dim", "head_dim", None), ("intermediate_size", "ffn_hidden_size", REQUIRED),
        ("max_position_embeddings", "max_position_embeddings", 4096), ("attention_dropout", "attention_dropout", 0.0),
        ("hidden_dropout", "hidden_dropout", 0.0), ("ssm_state_size", "mamba_state_dim", REQUIRED),
        ("mamba_num_heads", "mamba_num_heads", REQUIRED), ("mamba_head_dim", "mamba_head_dim", REQUIRED)),
        "config.json")
    return dict(out, **traits, hybrid_layer_pattern=pattern, **(_moe_overrides(c) if "E" in pattern else {}))


def _moe_overrides(c: dict) -> dict:
    """The mixture-of-experts fields of a NemotronH config.json with MoE layers; CheckpointError for the
    routing megajax computes otherwise."""
    k = int(c.get("num_experts_per_tok", 2))
    if c.get("moe_latent_size") is not None:
        raise CheckpointError(f"config.json moe_latent_size={c['moe_latent_size']}: megajax's experts read the "
                              f"hidden state itself; accepted: null.")
    groups, keep = c.get("n_group", 1) or 1, c.get("topk_group", 1) or 1
    if keep < groups:
        raise CheckpointError(f"config.json n_group={groups}, topk_group={keep}: transformers scores a group by its "
                              f"best 2 experts, megajax by its best top-k / group_topk; accepted: every group kept.")
    if bool(c.get("norm_topk_prob", True)) != (k > 1):
        raise CheckpointError(f"config.json norm_topk_prob={c.get('norm_topk_prob')} with num_experts_per_tok={k}: "
                              f"megajax renormalises the sigmoid weights exactly when top-k > 1.")
    scale = float(c.get("routed_scaling_factor", 1.0))
    return dict(read_fields(c.get, (
        ("n_routed_experts", "num_experts", REQUIRED), ("moe_intermediate_size", "moe_ffn_hidden_size", REQUIRED),
        ("moe_shared_expert_intermediate_size", "moe_shared_expert_ffn_size", REQUIRED)), "config.json"),
        moe_router_topk=k, moe_router_score_function="sigmoid",
        # transformers has no bias update rate: Nemotron's 1e-3 (the bias itself is imported)
        moe_router_bias_update_rate=1e-3, moe_router_topk_scaling_factor=None if scale == 1.0 else scale)


def hf_name_variants(name: str) -> tuple[str, ...]:
    """A hybrid tensor's name and the one transformers' NemotronH keeps in memory (`model.` for `backbone.`)."""
    return (name, "model." + name.removeprefix("backbone.")) if name.startswith("backbone.") else (name,)

