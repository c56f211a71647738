"""Hugging Face `transformers` directories: export (streaming) and import.

    export_hf(source, out_dir, tokenizer_spec=...)  ->  config.json, generation_config.json,
        model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json),
        tokenizer.json, tokenizer_config.json, special_tokens_map.json
    import_hf(in_dir)  ->  (model overrides, parameter tree of float32 numpy arrays)

The llama family maps to `LlamaForCausalLM` (`MixtralForCausalLM` with experts; with model.qk_norm
`Qwen3ForCausalLM` or `Qwen3MoeForCausalLM`), the gpt family to `GPT2LMHeadModel`, a hybrid
(model.hybrid_layer_pattern) to `NemotronHForCausalLM` or `Mamba2ForCausalLM` (hf_hybrid.py);
LLAMA_ROWS and GPT2_ROWS (megajax/checkpoint/mapping.py) name each tensor both
ways. Hugging Face linear weights are [out, in]; GPT-2's Conv1D weights are
[in, out] and its q/k/v are one fused `c_attn` ([D, 3 x D], columns q | k | v).

The export reads one tensor (one layer of a stacked tensor) at a time from a
TensorSource, converts it and appends it to the current safetensors shard, so
peak host memory stays near the largest single tensor; it writes into a
temporary directory renamed at the end. The import reads with the
`safetensors` library.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from megajax.checkpoint.common import (REQUIRED, atomic_output_dir, check_source, check_tokenizer, model_overrides,
                                       read_fields, resolved_model, tokenizer_dir_spec)
from megajax.checkpoint.dtypes import export_dtype, numpy_dtype, safetensors_code
from megajax.checkpoint.hf_hybrid import (HYBRID_ARCHITECTURES, MAMBA2, NEMOTRON_H, hf_name_variants,
                                          hybrid_architecture, hybrid_config, hybrid_overrides, hybrid_rows)
from megajax.checkpoint.mapping import (Row, conv1d, external_shape, flat, in_layer_order, index, linear,
                                        linear_rows, norm_rows, rows_for, same, to_external, to_ours)
from megajax.checkpoint.hf_processor import check_processor, write_processor
from megajax.checkpoint.hf_vision import (LLAVA, check_exportable, from_hf, hf_names, hf_shape, ignored,
                                          language_row, language_shapes, llava_config, to_hf, vision_config_of,
                                          vision_entries, vision_overrides)
from megajax.checkpoint.source import flatten, unflatten
from megajax.config import ModelConfig
from megajax.data.text_files import parse_json
from megajax.errors import CheckpointError
from megajax.models.layout import EXPERT_BIAS, param_shapes, tensor_shapes

LLAMA, GPT2, MIXTRAL = "LlamaForCausalLM", "GPT2LMHeadModel", "MixtralForCausalLM"
QWEN3, QWEN3_MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default shard size (5 GB)


# ----------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------

_L, _H = "model.layers.{i}", "transformer.h.{i}"

LLAMA_ROWS = (
    Row("model.embed_tokens.weight", same("embed/embedding"), vocab=True),
    *norm_rows(f"{_L}.input_layernorm", "layers/attn_norm"),
    *linear_rows(f"{_L}.self_attn.q_proj", "layers/attn/q"),
    *linear_rows(f"{_L}.self_attn.k_proj", "layers/attn/k"),
    *linear_rows(f"{_L}.self_attn.v_proj", "layers/attn/v"),
    *linear_rows(f"{_L}.self_attn.o_proj", "layers/attn/o", n_in=2),
    *norm_rows(f"{_L}.post_attention_layernorm", "layers/mlp_norm"),
    *linear_rows(f"{_L}.mlp.gate_proj", "layers/mlp/gate"),
    *linear_rows(f"{_L}.mlp.up_proj", "layers/mlp/up"),
    *linear_rows(f"{_L}.mlp.down_proj", "layers/mlp/fc2"),
    *norm_rows("model.norm", "final_norm"),
    Row("lm_head.weight", linear("output"), vocab=True),
)

# Mixtral: Llama's attention and norms; per layer a router and per-expert SwiGLU MLPs in the Hub's
# layout (which transformers 5 fuses on load into [E, 2F, D] gate_up_proj and [E, D, F] down_proj).
_MOE = f"{_L}.block_sparse_moe"
MIXTRAL_ROWS = tuple(r for r in LLAMA_ROWS if ".mlp." not in r.name) + (
    Row(f"{_MOE}.gate.weight", linear("layers/mlp/router")),
    Row(f"{_MOE}.experts.{{j}}.w1.weight", linear("layers/mlp/gate", experts=True)),
    Row(f"{_MOE}.experts.{{j}}.w3.weight", linear("layers/mlp/up", experts=True)),
    Row(f"{_MOE}.experts.{{j}}.w2.weight", linear("layers/mlp/fc2", experts=True)),
)

# Qwen3: Llama's tensors and the per-head q/k norms (model.qk_norm), one [head_dim] weight each.
_QK_NORMS = (*norm_rows(f"{_L}.self_attn.q_norm", "layers/attn/q_norm"),
             *norm_rows(f"{_L}.self_attn.k_norm", "layers/attn/k_norm"))
QWEN3_ROWS = LLAMA_ROWS[:9] + _QK_NORMS + LLAMA_ROWS[9:]

# Qwen3-MoE: Qwen3's attention and norms; per MoE layer a router (`mlp.gate`) and per-expert SwiGLU
# MLPs in the Hub's layout; the dense layers between them (model.moe_layer_freq > 1, Qwen's
# mlp_only_layers) keep Llama's MLP rows, read from `dense_layers/`.
_QMOE = f"{_L}.mlp"
QWEN3_MOE_ROWS = QWEN3_ROWS[:-3] + (
    Row(f"{_QMOE}.gate.weight", linear("layers/mlp/router")),
    Row(f"{_QMOE}.experts.{{j}}.gate_proj.weight", linear("layers/mlp/gate", experts=True)),
    Row(f"{_QMOE}.experts.{{j}}.up_proj.weight", linear("layers/mlp/up", experts=True)),
    Row(f"{_QMOE}.experts.{{j}}.down_proj.weight", linear("layers/mlp/fc2", experts=True)),
) + QWEN3_ROWS[-3:]

GPT2_ROWS = (
    Row("transformer.wte.weight", same("embed/embedding"), vocab=True),
    Row("transformer.wpe.weight", same("pos_embed")),
    *norm_rows(f"{_H}.ln_1", "layers/attn_norm"),
    Row(f"{_H}.attn.c_attn.weight", *(conv1d(f"layers/attn/{x}/kernel") for x in "qkv"), axis=1),
    Row(f"{_H}.attn.c_attn.bias", *(flat(f"layers/attn/{x}/bias") for x in "qkv")),
    *linear_rows(f"{_H}.attn.c_proj", "layers/attn/o", n_in=2, kind=conv1d),
    *norm_rows(f"{_H}.ln_2", "layers/mlp_norm"),
    *linear_rows(f"{_H}.mlp.c_fc", "layers/mlp/fc1", kind=conv1d),
    *linear_rows(f"{_H}.mlp.c_proj", "layers/mlp/fc2", kind=conv1d),
    *norm_rows("transformer.ln_f", "final_norm"),
)  # lm_head is tied to wte

# DeepSeek-V3: multi-latent attention (q_a/q_b or q_proj, kv_a_proj_with_mqa = [latent; rope key],
# kv_b_proj = per head [k_nope; v]); dense MLPs in the first layers (`dense_layers/`), then a
# sigmoid router with its expert bias (`e_score_correction_bias`), per-expert SwiGLU MLPs in the Hub's
# layout and the shared experts as one MLP.
_ATT, _MLP = f"{_L}.self_attn", f"{_L}.mlp"
DEEPSEEK_V3_ROWS = (
    Row("model.embed_tokens.weight", same("embed/embedding"), vocab=True),
    *norm_rows(f"{_L}.input_layernorm", "layers/attn_norm"),
    Row(f"{_ATT}.q_proj.weight", linear("layers/attn/q/kernel")),
    Row(f"{_ATT}.q_a_proj.weight", linear("layers/attn/q_down/kernel")),
    *norm_rows(f"{_ATT}.q_a_layernorm", "layers/attn/q_norm"),
    Row(f"{_ATT}.q_b_proj.weight", linear("layers/attn/q_up/kernel")),
    Row(f"{_ATT}.kv_a_proj_with_mqa.weight", linear("layers/attn/kv_down/kernel")),
    *norm_rows(f"{_ATT}.kv_a_layernorm", "layers/attn/kv_norm"),
    Row(f"{_ATT}.kv_b_proj.weight", linear("layers/attn/kv_up/kernel")),
    Row(f"{_ATT}.o_proj.weight", linear("layers/attn/o/kernel", n_in=2)),
    *norm_rows(f"{_L}.post_attention_layernorm", "layers/mlp_norm"),
    Row(f"{_MLP}.gate_proj.weight", linear("layers/mlp/gate/kernel")),
    Row(f"{_MLP}.up_proj.weight", linear("layers/mlp/up/kernel")),
    Row(f"{_MLP}.down_proj.weight", linear("layers/mlp/fc2/kernel")),
    Row(f"{_MLP}.gate.weight", linear("layers/mlp/router")),
    Row(f"{_MLP}.gate.e_score_correction_bias", same(EXPERT_BIAS)),
    Row(f"{_MLP}.experts.{{j}}.gate_proj.weight", linear("layers/mlp/gate", experts=True)),
    Row(f"{_MLP}.experts.{{j}}.up_proj.weight", linear("layers/mlp/up", experts=True)),
    Row(f"{_MLP}.experts.{{j}}.down_proj.weight", linear("layers/mlp/fc2", experts=True)),
    Row(f"{_MLP}.shared_experts.gate_proj.weight", linear("layers/mlp/shared_experts/gate/kernel")),
    Row(f"{_MLP}.shared_experts.up_proj.weight", linear("layers/mlp/shared_experts/up/kernel")),
    Row(f"{_MLP}.shared_experts.down_proj.weight", linear("layers/mlp/shared_experts/fc2/kernel")),
    *norm_rows("model.norm", "final_norm"),
    Row("lm_head.weight", linear("output"), vocab=True),
)



def _deepseek_v3_mtp_rows() -> tuple[Row, ...]:
    """DeepSeek-V3's multi-token prediction depth k as the layer after the last (`model.layers.{N + k}`,
    N = num_hidden_layers): enorm and hnorm, eh_proj over [embedding; hidden], a decoder layer named as
    the others (a mixture of experts, or a dense MLP), shared_head.norm (its final norm), and copies of
    the embedding and the output head (embed_tokens, shared_head.head) as DeepSeek's files carry them."""
    def in_mtp(row: Row) -> Row:
        options = {f: getattr(row, f) for f in ("axis", "groups", "vocab", "split", "aliases")}
        return Row(row.name, *(dataclasses.replace(p, path="mtp/block/" + p.path.split("/", 1)[1])
                               for p in row.parts), **options)
    return (*norm_rows(f"{_L}.enorm", "mtp/embed_norm"), *norm_rows(f"{_L}.hnorm", "mtp/hidden_norm"),
            Row(f"{_L}.eh_proj.weight", linear("mtp/proj/kernel")),
            *(in_mtp(r) for r in DEEPSEEK_V3_ROWS if r.per_layer),
            *norm_rows(f"{_L}.shared_head.norm", "mtp/final_norm"),
            Row(f"{_L}.embed_tokens.weight", same("embed/embedding"), vocab=True, copy=True),
            Row(f"{_L}.shared_head.head.weight", linear("output"), vocab=True, copy=True),
            Row(f"{_L}.shared_head.head.weight", same("embed/embedding"), vocab=True, copy=True))  # tied


TABLES = {LLAMA: LLAMA_ROWS, GPT2: GPT2_ROWS, MIXTRAL: MIXTRAL_ROWS, QWEN3: QWEN3_ROWS, QWEN3_MOE: QWEN3_MOE_ROWS,
          DEEPSEEK_V3: DEEPSEEK_V3_ROWS + _deepseek_v3_mtp_rows()}
MTP_ARCHITECTURES = (DEEPSEEK_V3,)  # the Hugging Face formats that hold multi-token prediction


def table(arch: str, m: ModelConfig) -> tuple[Row, ...]:
    """The rows of architecture `arch` (a hybrid's depend on its pattern's group: hf_hybrid.py)."""
    return hybrid_rows(m) if arch in HYBRID_ARCHITECTURES else TABLES[arch]


def _ignored(name: str) -> bool:
    """Tensors a Hugging Face checkpoint may carry that are not parameters (or are tied copies)."""
    return (name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))
            or name == "lm_head.weight" or name.startswith("mtp."))  # NemotronH's MTP: transformers skips it


# ----------------------------------------------------------------------------
# Which Hugging Face architecture a model is, and what it cannot express
# ----------------------------------------------------------------------------

# Traits each architecture fixes (Llama's biases and tying are config options).
_ARCH_TRAITS = {
    LLAMA: dict(norm="rmsnorm", activation="swiglu", position_embedding="rope"),
    MIXTRAL: dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", use_bias=False),
    GPT2: dict(norm="layernorm", position_embedding="learned", use_bias=True, tie_embeddings=True),
    QWEN3: dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", use_bias=False),
    QWEN3_MOE: dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", use_bias=False),
}


# GPT-2's activation_function for megajax's GELUs: the exact (erf) one, and the tanh approximation
# (transformers' gelu_new; gelu_pytorch_tanh computes the same function).
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
_GPT2_ACTIVATIONS_BACK = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def architecture(m: ModelConfig) -> str:
    """The Hugging Face class a model exports to; CheckpointError naming every trait it cannot express."""
    if m.hybrid_layer_pattern:
        return hybrid_architecture(m)
    if m.multi_latent_attention:
        return _deepseek_v3_architecture(m)
    if m.family == "llama" and m.qk_norm:  # per-head q/k norms: Qwen3
        arch = QWEN3_MOE if m.num_experts else QWEN3
    else:
        arch = {"llama": MIXTRAL if m.num_experts else LLAMA, "gpt": GPT2}[m.family]
    if m.qk_norm and arch not in (QWEN3, QWEN3_MOE):
        return _refuse(m, arch, [f"qk_norm={m.qk_norm} (needs false: {arch} has no q/k norms)"])
    wrong = [f"{k}={getattr(m, k)} (needs {v})" for k, v in _ARCH_TRAITS[arch].items() if getattr(m, k) != v]
    if arch == GPT2:
        if m.activation not in _GPT2_ACTIVATIONS:
            wrong.append(f"activation={m.activation} (needs gelu or gelu_tanh)")
        if m.num_kv_heads != m.num_heads:
            wrong.append(f"num_kv_heads={m.num_kv_heads} (needs num_kv_heads = num_heads = {m.num_heads}; "
                         f"GPT-2 has no grouped-query attention)")
        if m.head_dim * m.num_heads != m.hidden_size:
            wrong.append(f"head_dim={m.head_dim} (needs hidden_size / num_heads = "
                         f"{m.hidden_size // m.num_heads})")
    if m.num_experts and m.family != "llama":
        wrong.append(f"num_experts={m.num_experts} (Hugging Face's mixture of experts is {MIXTRAL}: family llama)")
    if m.moe_shared_expert_ffn_size:
        wrong.append(f"model.moe_shared_expert_ffn_size={m.moe_shared_expert_ffn_size} (needs 0: {arch} has no "
                     f"shared expert; a Megatron-Core export keeps it)")
    if arch == MIXTRAL and m.moe_router_pre_softmax:
        wrong.append(f"moe_router_pre_softmax={m.moe_router_pre_softmax} (needs false: {MIXTRAL} renormalises "
                     f"the top-k weights)")
    if m.num_experts:  # softmax over the top-k logits (or all, pre-softmax: Qwen3-MoE), no expert bias
        if m.moe_router_score_function != "softmax":
            wrong.append(f"moe_router_score_function={m.moe_router_score_function} (needs softmax)")
        if m.moe_router_topk_scaling_factor is not None:
            wrong.append(f"moe_router_topk_scaling_factor={m.moe_router_topk_scaling_factor} (needs null)")
        if m.moe_router_bias_update_rate > 0:
            wrong.append(f"moe_router_bias_update_rate={m.moe_router_bias_update_rate} (an expert bias; needs 0)")
        if m.moe_router_group_topk:
            wrong.append(f"moe_router_num_groups={m.moe_router_num_groups} / moe_router_group_topk="
                         f"{m.moe_router_group_topk} (group-limited routing; needs none)")
        if m.moe_layer_freq != 1 and arch == MIXTRAL:
            wrong.append(f"moe_layer_freq={m.moe_layer_freq} (needs 1: every {MIXTRAL} layer is a mixture of experts)")
    return _refuse(m, arch, wrong) if wrong else arch


def _refuse(m: ModelConfig, arch: str, wrong: list[str]):
    raise CheckpointError(f"model.family={m.family} exports to Hugging Face {arch}, which cannot express "
                          f"{'; '.join(wrong)}. Export this model with --format megatron instead, or "
                          f"train it with the family's traits.")


def _deepseek_v3_architecture(m: ModelConfig) -> str:
    """DEEPSEEK_V3 for a multi-latent attention model it can express (with transformers' numerics);
    CheckpointError naming every trait it cannot."""
    wrong = [f"{k}={getattr(m, k)} (needs {v})" for k, v in _ARCH_TRAITS[MIXTRAL].items() if getattr(m, k) != v]
    if m.norm_eps != 1e-6:
        wrong.append(f"norm_eps={m.norm_eps} (needs 1e-6: {DEEPSEEK_V3}'s q_a_layernorm and kv_a_layernorm use "
                     f"1e-6 whatever rms_norm_eps says)")
    if m.rope_scaling not in ("none", "yarn"):
        wrong.append(f"rope_scaling={m.rope_scaling} (needs none or yarn)")
    if m.rope_scaling == "yarn" and not m.rope_mscale_all_dim and m.rope_mscale != 1.0:
        wrong.append(f"rope_mscale={m.rope_mscale} with rope_mscale_all_dim=0 (transformers then scales cos/sin "
                     f"as with mscale 1)")
    if not m.num_experts:
        wrong.append("num_experts=0 (needs a mixture of experts)")
    else:
        if m.moe_router_score_function != "sigmoid":
            wrong.append(f"moe_router_score_function={m.moe_router_score_function} (needs sigmoid)")
        if not m.moe_router_bias_update_rate > 0:
            wrong.append("moe_router_bias_update_rate=0 (needs > 0: the router's expert bias, e_score_correction_bias)")
        shared, size = m.moe_shared_expert_ffn_size, m.moe_ffn_hidden_size
        if not shared or shared % size:
            wrong.append(f"moe_shared_expert_ffn_size={shared} (needs a positive multiple of moe_ffn_hidden_size="
                         f"{size}: n_shared_experts experts of that size)")
        if m.moe_shared_expert_gate:
            wrong.append("moe_shared_expert_gate=true (needs false)")
        if not isinstance(m.moe_layer_freq, list) and m.moe_layer_freq != 1:
            wrong.append(f"moe_layer_freq={m.moe_layer_freq} (needs 1 or the list form with the dense layers first: "
                         f"first_k_dense_replace)")
        groups, pick = m.moe_router_num_groups or 1, m.moe_router_group_topk or 1
        if m.num_experts // groups < 2:
            wrong.append(f"moe_router_num_groups={groups} (transformers scores a group by its best 2 experts: needs "
                         f"at least 2 experts per group)")
        elif pick < groups and m.moe_router_topk // pick != 2:
            wrong.append(f"moe_router_topk={m.moe_router_topk} / moe_router_group_topk={pick} (megajax and "
                         f"Megatron-Core score a group by its best topk // group_topk experts, transformers by its "
                         f"best 2: they agree when that ratio is 2 or every group is kept)")
    if wrong:
        raise CheckpointError(f"model.multi_latent_attention=true exports to Hugging Face {DEEPSEEK_V3}, which cannot "
                              f"express {'; '.join(wrong)}. Change these keys, or export with --format megatron "
                              f"where that format holds the model.")
    return DEEPSEEK_V3


# ----------------------------------------------------------------------------
# Configs: config.json key, ModelConfig field, default on import (REQUIRED: must be there)
# ----------------------------------------------------------------------------

_CONFIG_FIELDS = {
    LLAMA: (("num_hidden_layers", "num_layers", REQUIRED), ("hidden_size", "hidden_size", REQUIRED),
            ("num_attention_heads", "num_heads", REQUIRED), ("num_key_value_heads", "num_kv_heads", None),
            ("head_dim", "head_dim", None), ("intermediate_size", "ffn_hidden_size", REQUIRED),
            ("vocab_size", "vocab_size", REQUIRED), ("max_position_embeddings", "max_position_embeddings", 2048),
            ("rms_norm_eps", "norm_eps", 1e-6), ("attention_bias", "use_bias", False),
            ("tie_word_embeddings", "tie_embeddings", False), ("attention_dropout", "attention_dropout", 0.0),
            ("initializer_range", "init_std", 0.02)),
    GPT2: (("n_layer", "num_layers", REQUIRED), ("n_embd", "hidden_size", REQUIRED), ("n_head", "num_heads", REQUIRED),
           ("n_inner", "ffn_hidden_size", None), ("vocab_size", "vocab_size", REQUIRED),
           ("n_positions", "max_position_embeddings", REQUIRED), ("layer_norm_epsilon", "norm_eps", 1e-5),
           ("resid_pdrop", "hidden_dropout", 0.0), ("attn_pdrop", "attention_dropout", 0.0),
           ("initializer_range", "init_std", 0.02), ("tie_word_embeddings", "tie_embeddings", True)),
}
_CONFIG_FIELDS[QWEN3] = _CONFIG_FIELDS[LLAMA]
_CONFIG_FIELDS[QWEN3_MOE] = _CONFIG_FIELDS[LLAMA] + (
    ("moe_intermediate_size", "moe_ffn_hidden_size", REQUIRED), ("num_experts", "num_experts", REQUIRED),
    ("num_experts_per_tok", "moe_router_topk", REQUIRED))
_CONFIG_FIELDS[MIXTRAL] = tuple(
    ("intermediate_size", "moe_ffn_hidden_size", REQUIRED) if key == "intermediate_size" else (key, field, default)
    for key, field, default in _CONFIG_FIELDS[LLAMA] if key != "attention_bias") + (
    ("num_local_experts", "num_experts", REQUIRED), ("num_experts_per_tok", "moe_router_topk", REQUIRED))


def _rope(m: ModelConfig) -> tuple[dict | None, dict]:
    """(legacy `rope_scaling`, `rope_parameters`) of a Llama config.json."""
    if m.rope_scaling == "none":
        return None, {"rope_type": "default", "rope_theta": m.rope_theta}
    scaling = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
               "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
               "original_max_position_embeddings": m.rope_original_max_position}
    return scaling, dict(scaling, rope_theta=m.rope_theta)


def _hf_config(m: ModelConfig, arch: str, dtype: str, bos: int | None, eos: int | None) -> dict:
    if arch in HYBRID_ARCHITECTURES:
        return dict(architectures=[arch], bos_token_id=bos, eos_token_id=eos, torch_dtype=export_dtype(dtype).full_name,
                    dtype=export_dtype(dtype).full_name, **hybrid_config(m, arch))
    config = {key: getattr(m, field) for key, field, _ in _CONFIG_FIELDS[LLAMA if arch == DEEPSEEK_V3 else arch]}
    config.update(architectures=[arch], bos_token_id=bos, eos_token_id=eos, use_cache=True,
                  torch_dtype=export_dtype(dtype).full_name, dtype=export_dtype(dtype).full_name)
    if arch == GPT2:
        return dict(config, model_type="gpt2", activation_function=_GPT2_ACTIVATIONS[m.activation],
                    embd_pdrop=m.hidden_dropout,
                    scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)
    if arch == DEEPSEEK_V3:
        config = {k: v for k, v in config.items() if k not in ("head_dim", "num_key_value_heads")}
        return dict(config, **_deepseek_v3_config(m))
    scaling, parameters = _rope(m)
    if arch == MIXTRAL:
        config.update(model_type="mixtral", hidden_act="silu", rope_theta=m.rope_theta, rope_parameters=parameters,
                      sliding_window=None, router_aux_loss_coef=m.moe_aux_loss_coeff, output_router_logits=False,
                      router_jitter_noise=0.0)
        return dict(config, rope_scaling=scaling) if scaling else config
    if arch in (QWEN3, QWEN3_MOE):
        config.update(model_type="qwen3" if arch == QWEN3 else "qwen3_moe", hidden_act="silu",
                      rope_theta=m.rope_theta, rope_parameters=parameters, use_sliding_window=False,
                      sliding_window=None, max_window_layers=m.num_layers,
                      layer_types=["full_attention"] * m.num_layers)
        if arch == QWEN3_MOE:  # the dense layers by name; every other layer is MoE
            config.update(decoder_sparse_step=1, norm_topk_prob=not m.moe_router_pre_softmax,
                          mlp_only_layers=[i for i in range(m.num_layers) if not m.is_moe_layer(i)],
                          router_aux_loss_coef=m.moe_aux_loss_coeff, output_router_logits=False)
        return dict(config, rope_scaling=scaling) if scaling else config
    config.update(model_type="llama", hidden_act="silu", mlp_bias=m.use_bias, rope_theta=m.rope_theta,
                  rope_parameters=parameters, pretraining_tp=1)
    return dict(config, rope_scaling=scaling) if scaling else config


def _deepseek_v3_config(m: ModelConfig) -> dict:
    """DeepseekV3Config's keys of a model _deepseek_v3_architecture accepts. norm_topk_prob is k > 1:
    megajax (as Megatron-Core) renormalises sigmoid weights over the top-k whenever k > 1."""
    return dict(
        model_type="deepseek_v3", hidden_act="silu", num_key_value_heads=m.num_heads,
        moe_intermediate_size=m.moe_ffn_hidden_size, n_routed_experts=m.num_experts,
        num_experts_per_tok=m.moe_router_topk, n_shared_experts=m.moe_shared_expert_ffn_size // m.moe_ffn_hidden_size,
        first_k_dense_replace=m.dense_first_layers(), routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
        n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
        norm_topk_prob=m.moe_router_topk > 1, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        rope_interleave=True, rope_theta=m.rope_theta, attention_bias=False,
        num_nextn_predict_layers=m.mtp_num_layers, pretraining_tp=1, **_deepseek_v3_rope(m))


def _deepseek_v3_rope(m: ModelConfig) -> dict:
    """DeepseekV3Config's rope keys: plain, or YaRN (transformers' rope_parameters, and the legacy rope_scaling)."""
    if m.rope_scaling != "yarn":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
    yarn = {"factor": m.rope_scaling_factor, "original_max_position_embeddings": m.rope_original_max_position,
            "beta_fast": m.rope_beta_fast, "beta_slow": m.rope_beta_slow, "mscale": m.rope_mscale,
            "mscale_all_dim": m.rope_mscale_all_dim}
    return {"rope_parameters": {"rope_type": "yarn", "rope_theta": m.rope_theta, **yarn},
            "rope_scaling": {"type": "yarn", "rope_type": "yarn", **yarn}}


def _deepseek_v3_yarn(rope: dict) -> dict:
    """ModelConfig's YaRN keys from a DeepseekV3Config's rope parameters (transformers' defaults);
    CheckpointError for the forms megajax computes otherwise."""
    for key, want in (("truncate", True), ("partial_rotary_factor", 1.0)):
        if rope.get(key, want) not in (want, None):
            raise CheckpointError(f"config.json rope {key}={rope[key]!r}: megajax's YaRN needs {key}={want}.")
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        raise CheckpointError("config.json yarn rope parameters need factor and original_max_position_embeddings.")
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:
        raise CheckpointError(f"config.json yarn mscale={mscale!r} with mscale_all_dim={all_dim}: transformers then "
                              f"scales cos/sin by the factor alone, megajax (as Megatron-Core) by "
                              f"mscale / mscale_all_dim; give both.")
    out = dict(rope_scaling="yarn", rope_scaling_factor=float(rope["factor"]),
               rope_original_max_position=int(rope["original_max_position_embeddings"]),
               rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
               rope_mscale=float(mscale) if mscale and all_dim else 1.0, rope_mscale_all_dim=float(all_dim or 0.0))
    if rope.get("attention_factor") is not None:
        from megajax.models.layers import yarn_mscale
        ours = yarn_mscale(out["rope_scaling_factor"], out["rope_mscale"]) / yarn_mscale(
            out["rope_scaling_factor"], out["rope_mscale_all_dim"])
        if abs(float(rope["attention_factor"]) - ours) > 1e-6:
            raise CheckpointError(f"config.json yarn attention_factor={rope['attention_factor']}: megajax derives it "
                                  f"from factor, mscale and mscale_all_dim ({ours:.6g} here).")
    return out


def _deepseek_v3_overrides(c: dict) -> dict:
    """ModelConfig fields of a DeepseekV3Config; CheckpointError for what megajax cannot run alike."""
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("rope_interleave", True)):
        if c.get(key, want) != want:
            raise CheckpointError(f"config.json {key}={c[key]!r}: megajax's DeepSeek-V3 needs {key}={want}.")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise CheckpointError(f"config.json rope type {rope_type!r} is not supported for DeepSeek-V3; accepted: "
                              f"default, yarn.")
    if c.get("rms_norm_eps", 1e-6) != 1e-6:
        raise CheckpointError(f"config.json rms_norm_eps={c['rms_norm_eps']}: megajax's latent norms use "
                              f"model.norm_eps like the others, transformers' use 1e-6; accepted: 1e-6.")
    n = c.get("num_hidden_layers")
    k = c.get("first_k_dense_replace", 0) or 0
    shared, size = c.get("n_shared_experts", 0) or 0, c.get("moe_intermediate_size")
    routed, pick = c.get("num_experts_per_tok", 1), c.get("topk_group", 1) or 1
    groups = c.get("n_group", 1) or 1
    if not shared:
        raise CheckpointError("config.json n_shared_experts=0: megajax's DeepSeek-V3 needs a shared expert.")
    if pick < groups and routed // pick != 2:
        raise CheckpointError(f"config.json num_experts_per_tok={routed} / topk_group={pick}: transformers scores a "
                              f"group by its best 2 experts, megajax by its best topk // group_topk; they agree only "
                              f"when that ratio is 2 or every group is kept.")
    if bool(c.get("norm_topk_prob", True)) != (routed > 1):
        raise CheckpointError(f"config.json norm_topk_prob={c.get('norm_topk_prob')} with num_experts_per_tok={routed}: "
                              f"megajax renormalises the sigmoid weights exactly when top-k > 1.")
    if c.get("num_key_value_heads") not in (None, c.get("num_attention_heads")):
        raise CheckpointError("config.json num_key_value_heads differs from num_attention_heads: multi-latent "
                              "attention has one k and v per head.")
    scale = c.get("routed_scaling_factor", 1.0)
    out = read_fields(c.get, (
        ("num_hidden_layers", "num_layers", REQUIRED), ("hidden_size", "hidden_size", REQUIRED),
        ("num_attention_heads", "num_heads", REQUIRED), ("intermediate_size", "ffn_hidden_size", REQUIRED),
        ("vocab_size", "vocab_size", REQUIRED), ("max_position_embeddings", "max_position_embeddings", 2048),
        ("tie_word_embeddings", "tie_embeddings", False), ("attention_dropout", "attention_dropout", 0.0),
        ("initializer_range", "init_std", 0.02), ("moe_intermediate_size", "moe_ffn_hidden_size", REQUIRED),
        ("n_routed_experts", "num_experts", REQUIRED), ("num_experts_per_tok", "moe_router_topk", REQUIRED),
        ("kv_lora_rank", "kv_lora_rank", REQUIRED), ("q_lora_rank", "q_lora_rank", None),
        ("qk_nope_head_dim", "qk_head_dim", REQUIRED), ("qk_rope_head_dim", "qk_pos_emb_head_dim", REQUIRED),
        ("v_head_dim", "v_head_dim", REQUIRED)), "config.json")
    return dict(out, family="llama", norm_eps=1e-6, use_bias=False, multi_latent_attention=True,
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta") or 10000.0)),
                moe_shared_expert_ffn_size=shared * size, moe_router_score_function="sigmoid",
                # transformers has no bias update rate: DeepSeek-V3's 1e-3 (the bias itself is imported)
                moe_router_bias_update_rate=1e-3,
                moe_router_topk_scaling_factor=None if scale == 1.0 else float(scale),
                moe_router_num_groups=None if groups == 1 else groups,
                moe_router_group_topk=None if groups == 1 else pick,
                moe_layer_freq=[0] * k + [1] * (n - k) if k else 1,
                **(_deepseek_v3_yarn(rope) if rope_type == "yarn" else {}))


def _deepseek_v3_mtp(c: dict, overrides: dict, weights) -> dict:
    """`overrides` with DeepSeek-V3's multi-token prediction depths (config.json num_nextn_predict_layers;
    their layers after the last, model.layers.{N + k}) where the weights hold them: mtp_num_layers, and
    mtp_block as the first depth's MLP is (`mlp.gate`: a mixture of experts). Without those weights (a
    copy with them removed) none."""
    depths, n = int(c.get("num_nextn_predict_layers") or 0), overrides["num_layers"]
    if not depths or f"model.layers.{n}.eh_proj.weight" not in weights:
        return overrides
    return dict(overrides, mtp_num_layers=depths,
                mtp_block="moe" if f"model.layers.{n}.mlp.gate.weight" in weights else "dense")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ----------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------

_WRITE_BLOCK = 1 << 22  # elements converted to the output dtype at a time (16 MiB of fp32)


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]],
                       dtype: np.dtype) -> int:
    """Writes one safetensors file from (name, shape, producer) entries, calling each producer just
    before its bytes are written; returns the data size.

    The format: an 8-byte little-endian header length, the JSON header ({name: {dtype, shape,
    data_offsets}}, padded to 8 bytes), the raw tensors. The safetensors library's writers take
    every tensor's buffer in one call (the whole shard in memory); this needs one tensor at a time.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": safetensors_code(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, produce in tensors:
            x = produce()  # the only live tensor
            assert x.shape == tuple(shape), (name, x.shape, shape)
            x = x.reshape((1,) if x.ndim == 0 else x.shape)
            rows = max(1, _WRITE_BLOCK // max(1, math.prod(x.shape[1:])))
            for start in range(0, x.shape[0], rows):  # converted a row block at a time: no full copy
                block = np.ascontiguousarray(x[start:start + rows], dtype=dtype)
                f.write(block.reshape(-1).view(np.uint8).data)
            del x
    return offset


def _write_shards(out: Path, source, rows: list[Row], shapes: dict, m: ModelConfig, dtype: np.dtype,
                  max_shard_bytes: int, extra: list | None = None) -> None:
    """Writes the tensors in table order (then the `extra` (name, shape, producer) entries) into as few
    shards of at most max_shard_bytes as possible, producing each one (from one layer of each of its
    parts) just before it is written."""
    shards: list[list] = [[]]
    size = 0
    entries = [(row.names(i)[0], external_shape(row, shapes, m), lambda row=row, slot=slot: to_external(
        row, lambda path: source.get(path, layer=slot), m)) for row, i, slot in in_layer_order(rows, m)]
    for name, shape, produce in entries + list(extra or ()):
        if shards[-1] and size + math.prod(shape) * dtype.itemsize > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, produce))
        size += math.prod(shape) * dtype.itemsize
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    total = sum(_write_safetensors(out / file, shard, dtype) for file, shard in zip(files, shards))
    if n > 1:
        weight_map = {name: file for file, shard in zip(files, shards) for name, _, _ in shard}
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})


def mtp_left_out(m: ModelConfig) -> str | None:
    """What a Hugging Face export says of a model with multi-token prediction its architecture cannot
    hold (left out), or None. DeepSeek-V3's holds it (the layers after the last, as DeepSeek writes them;
    transformers' model does not run them)."""
    if not m.mtp_num_layers or architecture(m) in MTP_ARCHITECTURES:
        return None
    return (f"model.mtp_num_layers = {m.mtp_num_layers}: {architecture(m)} has no multi-token prediction; the "
            f"export leaves its layers out (the model's own logits are unchanged)")


def export_hf(source, out_dir, *, tokenizer_spec: str | None, dtype: str = "bf16",
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, chat_template: str | None = None,
              eos_id: int | None = None) -> Path:
    """Writes `source` (a TensorSource) as a Hugging Face model directory `out_dir`; returns its path.

    `tokenizer_spec` is 'byte' or a tokenizer.json (or its directory), or None for a model trained
    without a tokenizer (pre-tokenised data): no tokenizer files, config.json's eos_token_id `eos_id`
    (its end-of-document id, if known); `dtype` ('bf16', 'fp16' or 'fp32', megajax/checkpoint/dtypes.py)
    the stored weight dtype; `chat_template` the template to carry when the tokenizer has none of its own
    (save_hf_tokenizer). Raises CheckpointError for a model the architecture cannot express or a source
    that does not match its
    config; the directory appears only when complete.
    """
    from megajax.data.tokenizer import save_hf_tokenizer
    m = whole = source.model
    np_dtype = numpy_dtype(dtype)
    if whole.vision is not None:  # LLaVA: the language model's tables under language_model. (hf_vision.py)
        check_exportable(whole)
        m = dataclasses.replace(whole, vision=None, freeze_language_model=False)
    arch = architecture(m)
    shapes = tensor_shapes(whole, check_source(source))  # DeepSeek-V3's routers keep their expert bias
    vision = [] if whole.vision is None else [
        (name, hf_shape(kind, path, shapes[path][1:] if layer is not None else shapes[path]),
         lambda path=path, layer=layer, kind=kind: to_hf(kind, path, source.get(path, layer=layer)))
        for name, path, layer, kind in vision_entries(whole)]
    shapes = language_shapes(shapes)
    if arch not in MTP_ARCHITECTURES:  # no place for multi-token prediction's depths (mtp_left_out)
        shapes = {k: v for k, v in shapes.items() if not k.startswith("mtp/")}
    rows = rows_for(table(arch, m), shapes, "Hugging Face " + arch)
    if whole.vision is not None:
        rows = [language_row(r) for r in rows]
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes} must be positive.")
    tok = check_tokenizer(tokenizer_spec, m) if tokenizer_spec is not None else None
    with atomic_output_dir(out_dir) as tmp:
        bos, eos = (None, eos_id) if tok is None else save_hf_tokenizer(
            tok, tmp, max_length=m.max_position_embeddings, chat_template=chat_template)
        if whole.vision is not None:  # LLaVA's processor beside the tokenizer (hf_processor.py; processor_left_out)
            write_processor(tmp, whole.vision)
        config = _hf_config(m, arch, dtype, bos, eos)
        if whole.vision is not None:
            config = llava_config(whole, config, export_dtype(dtype).full_name)
        _write_json(tmp / "config.json", config)
        generation = {"bos_token_id": bos, "eos_token_id": eos}
        _write_json(tmp / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
        _write_shards(tmp, source, rows, shapes, m, np_dtype, max_shard_bytes, vision)
    return Path(out_dir)


# ----------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------

def _llama_overrides(c: dict, arch: str = LLAMA) -> dict:
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act={c['hidden_act']!r}: megajax's gated MLP uses silu "
                              f"(SwiGLU); accepted: silu.")
    if bool(c.get("attention_bias")) != bool(c.get("mlp_bias")):
        raise CheckpointError(f"config.json attention_bias={c.get('attention_bias')} and mlp_bias="
                              f"{c.get('mlp_bias')} differ; megajax has one model.use_bias for both.")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"config.json rope type {rope_type!r} is not supported; accepted: default, llama3.")
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"config.json partial_rotary_factor={partial}: megajax rotates the whole head; "
                              f"accepted: 1.0.")
    out = dict(read_fields(c.get, _CONFIG_FIELDS[arch], "config.json"), family="llama",
               rope_theta=float(rope.get("rope_theta", c.get("rope_theta") or 10000.0)))
    if rope_type == "llama3":
        out.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                   rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)))
    return out


def _mixtral_overrides(c: dict) -> dict:
    if c.get("sliding_window") is not None:
        raise CheckpointError(f"config.json sliding_window={c['sliding_window']}: megajax's attention is full "
                              f"causal; accepted: null.")
    out = _llama_overrides(dict(c, mlp_bias=False, attention_bias=False), MIXTRAL)
    # Every layer is a MoE layer: the dense size is unused; megajax's default for it is the expert size.
    return dict(out, ffn_hidden_size=out["moe_ffn_hidden_size"], use_bias=False)


def _qwen3_overrides(c: dict, arch: str) -> dict:
    if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or ()):
        raise CheckpointError(f"config.json use_sliding_window={c.get('use_sliding_window')} (layer_types "
                              f"{c.get('layer_types')}): megajax's attention is full causal; accepted: "
                              f"use_sliding_window=false.")
    # Qwen3's MLPs have no biases: attention_bias=true is refused as a mismatch with the MLP's.
    # transformers writes num_experts as num_local_experts (its attribute map).
    c = dict(c, mlp_bias=False, num_experts=c.get("num_experts", c.get("num_local_experts")))
    out = _llama_overrides(c, arch)
    out["qk_norm"] = True
    if arch == QWEN3:
        return out
    n, step, dense = out["num_layers"], int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
    moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    freq = next((f for f in range(1, n + 1) if n % f == 0 and moe == list(range(0, n, f))), None)
    if freq is None:
        raise CheckpointError(f"config.json decoder_sparse_step={step}, mlp_only_layers={sorted(dense)} make layers "
                              f"{moe} mixtures of experts; megajax's model.moe_layer_freq F makes every layer i "
                              f"with i % F == 0 one (F dividing num_hidden_layers={n}).")
    return dict(out, moe_layer_freq=freq, moe_router_pre_softmax=not c.get("norm_topk_prob", False))


def _gpt2_overrides(c: dict) -> dict:
    act = c.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS_BACK:
        raise CheckpointError(f"config.json activation_function={act!r}: megajax has the exact (erf) GELU and its "
                              f"tanh approximation; accepted: {', '.join(_GPT2_ACTIVATIONS_BACK)}.")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if c.get(key, want) != want:
            raise CheckpointError(f"config.json {key}={c[key]}: megajax's GPT-2 needs {key}={want}.")
    out = dict(read_fields(c.get, _CONFIG_FIELDS[GPT2], "config.json"), family="gpt",
               activation=_GPT2_ACTIVATIONS_BACK[act])
    if out["hidden_size"] % out["num_heads"]:
        raise CheckpointError(f"config.json n_embd={out['hidden_size']} is not divisible by n_head={out['num_heads']}.")
    return dict(out, ffn_hidden_size=out["ffn_hidden_size"] or 4 * out["hidden_size"])


def _weight_files(d: Path, files: ExitStack) -> dict[str, tuple[Path, object]]:
    """Tensor name -> (file, open safetensors handle) of a directory's single or sharded weights."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise CheckpointError("reading Hugging Face weights needs the safetensors library: "
                              "pip install 'megajax[torch]'.") from None
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(parse_json(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{str(index)!r} is not a safetensors index ({e!r}).") from None
    elif (d / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        other = [p.name for p in d.glob("pytorch_model*.bin")]
        hint = (f" It holds {', '.join(other)}: only safetensors weights are read; re-save the model "
                f"with save_pretrained(..., safe_serialization=True).") if other else ""
        raise CheckpointError(f"{str(d)!r} holds no model.safetensors or model.safetensors.index.json.{hint}")
    out = {}
    for name in names:
        if not (d / name).is_file():
            raise CheckpointError(f"{str(d)!r}: shard {name} named by the index is missing.")
        try:
            f = files.enter_context(safe_open(str(d / name), framework="numpy"))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{str(d / name)!r} is not a readable safetensors file ({e}).") from None
        out.update({key: (d / name, f) for key in f.keys()})
    return out


def is_hf_dir(path) -> bool:
    """Whether `path` is a Hugging Face model directory (a config.json beside safetensors weights)."""
    d = Path(path).expanduser()
    return (d / "config.json").is_file() and ((d / "model.safetensors").is_file()
                                             or (d / "model.safetensors.index.json").is_file())


def _read_config(d: Path) -> dict:
    config_file = d / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{str(d)!r} is not a Hugging Face model directory (no config.json).")
    try:
        return parse_json(config_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{str(config_file)!r} is not valid JSON ({e}).") from None


def _is_llava(c: dict) -> bool:
    arch = (c.get("architectures") or [None])[0]
    return arch == LLAVA or (arch is None and c.get("model_type") == "llava")


def _architecture(d: Path) -> tuple[str, dict, dict]:
    """(architecture, config.json, model overrides) of a Hugging Face directory of a language model."""
    c = _read_config(d)
    if _is_llava(c):
        raise CheckpointError(f"{str(d)!r} holds a LLaVA (vision-language) model: `megajax import --format hf` reads "
                              f"it; checkpoint.load and streaming take language models only.")
    arch, overrides = _architecture_overrides(c, d)
    return arch, c, overrides


def _architecture_overrides(c: dict, d: Path) -> tuple[str, dict]:
    """(architecture, model overrides) of a language model's config.json."""
    arch = (c.get("architectures") or [None])[0]
    model_type = c.get("model_type")
    if arch == LLAMA or (arch is None and model_type == "llama"):
        arch, overrides = LLAMA, _llama_overrides(c)
    elif arch == MIXTRAL or (arch is None and model_type == "mixtral"):
        arch, overrides = MIXTRAL, _mixtral_overrides(c)
    elif arch == DEEPSEEK_V3 or (arch is None and model_type == "deepseek_v3"):
        arch, overrides = DEEPSEEK_V3, _deepseek_v3_overrides(c)
    elif arch == GPT2 or (arch is None and model_type == "gpt2"):
        arch, overrides = GPT2, _gpt2_overrides(c)
    elif arch in HYBRID_ARCHITECTURES or (arch is None and model_type in ("nemotron_h", "mamba2")):
        arch = arch or {"nemotron_h": NEMOTRON_H, "mamba2": MAMBA2}[model_type]
        overrides = hybrid_overrides(c, arch)
    elif arch in (QWEN3, QWEN3_MOE) or (arch is None and model_type in ("qwen3", "qwen3_moe")):
        arch = arch or {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}[model_type]
        overrides = _qwen3_overrides(c, arch)
    else:
        raise CheckpointError(f"{str(d)!r}: architecture {arch!r} (model_type {model_type!r}) is not supported; "
                              f"megajax imports {LLAMA}, {MIXTRAL}, {QWEN3}, {QWEN3_MOE}, {DEEPSEEK_V3}, {GPT2}, "
                              f"{NEMOTRON_H}, {MAMBA2} and {LLAVA}.")
    return arch, overrides


@dataclasses.dataclass
class HfTensors:
    """A Hugging Face directory opened for reading (its weight files' headers, no tensor yet).

    model: the resolved ModelConfig of its config.json; shapes: megajax's tensor shapes for it
    (tensor_shapes); plan: (row, layer, slot, tensor name) for every tensor read, in layer order
    (a row that is a copy of another's tensor left out)."""
    dir: Path
    arch: str
    model: ModelConfig
    shapes: dict[str, tuple[int, ...]]
    plan: list[tuple[Row, int | None, int | None, str]]
    weights: dict[str, tuple[Path, object]]

    def overrides(self) -> dict:
        """The ModelConfig field values of the model (what an import records in its meta)."""
        out = model_overrides(self.model)
        out.pop("mtp_loss_scaling_factor", None)  # config.json has no MTP loss weight: the run's applies
        if self.arch == MAMBA2:  # no position limit: the run's train.seq_len applies
            out.pop("max_position_embeddings")
        return out

    def read(self, row: Row, name: str) -> dict[str, np.ndarray]:
        """{megajax path: one layer (one expert) of it} from the tensor `name` of `row`, float32."""
        path, f = self.weights[name]

        def mismatch(what, got, want):
            return CheckpointError(f"tensor {what} in {path.name} has shape {list(got)}, but config.json "
                                   f"implies {list(want)}.")

        return to_ours(row, name, np.asarray(f.get_tensor(name), np.float32), self.shapes, self.model,
                       mismatch=mismatch)


@contextmanager
def open_hf(in_dir) -> Iterator[HfTensors]:
    """The Hugging Face directory `in_dir` opened (config.json read and checked, every tensor the model
    needs found, none left over); its safetensors files stay open inside the `with`."""
    d = Path(in_dir).expanduser()
    arch, c, overrides = _architecture(d)
    with ExitStack() as files:
        yield _open_weights(d, arch, c, overrides, _weight_files(d, files))


def _open_weights(d: Path, arch: str, c: dict, overrides: dict, weights: dict) -> HfTensors:
    """HfTensors of a language model's tensors `weights` (name -> (file, handle)) under config.json `c`."""
    used = set()
    if arch == DEEPSEEK_V3:
        overrides = _deepseek_v3_mtp(c, overrides, weights)
    m = resolved_model(overrides, source=f"{str(d / 'config.json')!r}")
    _check_layers(m, weights, d)
    shapes = tensor_shapes(m)  # with DeepSeek-V3's expert bias (layers/mlp/expert_bias)
    plan = []
    for row, i, slot in in_layer_order(rows_for(table(arch, m), shapes, "Hugging Face " + arch), m):
        names = row.names(i) + tuple(n.removeprefix("transformer.") for n in row.names(i))  # GPT2Model's
        names += tuple(v for n in row.names(i) for v in hf_name_variants(n)[1:])  # NemotronH's `model.`
        name = next((n for n in names if n in weights), None)
        used.add(name)
        if row.copy:  # a copy of a tensor another row reads (DeepSeek-V3's MTP embed_tokens, shared_head.head)
            continue
        if name is None:
            raise CheckpointError(f"the Hugging Face checkpoint has no tensor {names[0]}.")
        path, f = weights[name]
        stored, want = tuple(f.get_slice(name).get_shape()), external_shape(row, shapes, m)
        if stored != want:  # before any parameter is allocated from config.json's sizes
            raise CheckpointError(f"tensor {name} in {str(path)!r} has shape {list(stored)}, but "
                                  f"{str(d / 'config.json')!r} implies {list(want)}.")
        plan.append((row, i, slot, name))
    left = sorted(n for n in set(weights) - used if not _ignored(n))
    mtp = [n for n in left if re.match(rf"model\.layers\.{m.num_layers}\.", n)]
    if mtp and not m.mtp_num_layers and arch == DEEPSEEK_V3:
        raise CheckpointError(f"the Hugging Face checkpoint holds layer {m.num_layers} ({', '.join(mtp[:3])} ...) "
                              f"after its num_hidden_layers={m.num_layers}; a multi-token prediction layer is "
                              f"read when config.json says num_nextn_predict_layers.")
    if left:
        raise CheckpointError(f"the Hugging Face checkpoint holds tensors megajax does not know: "
                              f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}.")
    return HfTensors(d, arch, m, shapes, plan, weights)


def _check_layers(m: ModelConfig, weights: dict, d: Path) -> None:
    """CheckpointError when config.json gives more layers than the weights hold (checked before the layers
    are walked: a count of 10^9 would be walked for ever)."""
    found = (re.search(r"(?:^|\.)(?:layers|h)\.(\d+)\.", name) for name in weights)
    held = max((int(x.group(1)) + 1 for x in found if x), default=0)
    if m.num_layers > held:
        holds = f"layers 0 to {held - 1}" if held else "no layer (no tensor named ...layers.N...)"
        raise CheckpointError(f"{str(d / 'config.json')!r} gives the model {m.num_layers:,} layers (model.num_layers), "
                              f"but its weights hold {holds}; config.json and the weights must be of one model.")


def hf_model_overrides(in_dir) -> dict:
    """The ModelConfig field values of a Hugging Face directory's model (its config.json; the weight
    files' headers checked against it), reading no tensor."""
    with open_hf(in_dir) as hf:
        return hf.overrides()


def _read_all(hf: HfTensors) -> tuple[dict, dict]:
    """(model overrides, parameters): each parameter allocated once its first tensor has been read and its
    shape checked against config.json (a vocab_size of 10^12 is refused, not allocated)."""
    flat_params = {}
    for row, _, slot, name in hf.plan:
        for ours, x in hf.read(row, name).items():
            if ours not in flat_params:
                flat_params[ours] = np.zeros(hf.shapes[ours], np.float32)
            flat_params[ours][index(slot, row)] = x
    for ours, shape in hf.shapes.items():  # those no tensor is read into (none in the tables' models)
        flat_params.setdefault(ours, np.zeros(shape, np.float32))
    return hf.overrides(), unflatten(dict(sorted(flat_params.items())))


def import_hf(in_dir) -> tuple[dict, dict]:
    """Reads a Hugging Face model directory of one of the architectures above.

    Returns (model overrides, params): the ModelConfig field values of the
    architecture, and the parameter tree as float32 numpy arrays with the
    vocabulary padded to model.padded_vocab_size() with zero rows.
    """
    d = Path(in_dir).expanduser()
    if _is_llava(_read_config(d)):
        return _import_llava(d, _read_config(d))
    with open_hf(d) as hf:
        return _read_all(hf)


class _Renamed:
    """A safetensors handle read under another name (a LLaVA language model's tensor by its own table's)."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name

    def get_tensor(self, _):
        return self.handle.get_tensor(self.name)

    def get_slice(self, _):
        return self.handle.get_slice(self.name)


def _import_llava(d: Path, c: dict) -> tuple[dict, dict]:
    """import_hf of a LlavaForConditionalGeneration directory: the language model's tensors under
    `language_model.`, then the vision tower's and the projector's (hf_vision.py)."""
    text = dict(c.get("text_config") or {})
    text.setdefault("model_type", "llama")
    text.setdefault("tie_word_embeddings", c.get("tie_word_embeddings", False))
    arch, overrides = _architecture_overrides(dict(text, architectures=None), d)
    vision = vision_overrides(c)
    check_processor(d, vision_config_of(vision))  # its pixels are megajax's (or refused, naming what differs)
    with ExitStack() as files:
        weights = _weight_files(d, files)
        language = {}  # the language model's tensors by the names its own table has
        for name, (file, f) in weights.items():
            for prefix, plain in (("language_model.", ""), ("model.language_model.", "model."), ("lm_head.", "lm_head.")):
                if name.startswith(prefix):
                    language[plain + name[len(prefix):]] = (file, _Renamed(f, name))
        out, params = _read_all(_open_weights(d, arch, text, overrides, language))
        m = resolved_model(dict(out, vision=vision_config_of(vision)))
        flat = dict(flatten(params))
        shapes = tensor_shapes(m)
        for name, path, layer, kind in vision_entries(m):
            found = next((n for n in hf_names(name) if n in weights), None)
            if found is None:
                raise CheckpointError(f"the Hugging Face LLaVA checkpoint has no tensor {name}.")
            file, f = weights[found]
            want = shapes[path][1:] if layer is not None else shapes[path]
            y = np.asarray(f.get_tensor(found), np.float32)
            if path == "projector/fc1/kernel" and y.ndim == 2 and y.shape[1] == 4 * want[0]:
                raise CheckpointError(f"tensor {found} in {file.name} has shape {list(y.shape)}: a projector of "
                                      f"4 x {want[0]} inputs, pixel-shuffled image features, which Hugging Face's "
                                      f"LLaVA cannot express (model.vision.pixel_shuffle: accepted false on import; "
                                      f"Megatron checkpoints carry it).")
            if tuple(y.shape) != hf_shape(kind, path, want):
                raise CheckpointError(f"tensor {found} in {file.name} has shape {list(y.shape)}, but config.json "
                                      f"implies {list(hf_shape(kind, path, want))}.")
            x = from_hf(kind, y, want)
            if layer is None:
                flat[path] = x
            else:
                flat.setdefault(path, np.zeros(shapes[path], np.float32))[layer] = x
        known = {n for name, *_ in vision_entries(m) for n in hf_names(name)}
        left = sorted(n for n in weights if n not in known and not n.startswith(("language_model.",
                      "model.language_model.")) and n != "lm_head.weight" and not ignored(n))
        if left:
            raise CheckpointError(f"the Hugging Face LLaVA checkpoint holds tensors megajax does not know: "
                                  f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}.")
    out = model_overrides(m)
    out.pop("mtp_loss_scaling_factor", None)
    return out, unflatten(dict(sorted(flat.items())))


def hf_tokenizer(in_dir) -> tuple[str | None, str]:
    """(data.tokenizer for a Hugging Face directory's tokenizer, or None; what the directory says of it)."""
    d = Path(in_dir).expanduser()
    return tokenizer_dir_spec(d), f"no tokenizer.json in {str(d)!r}"
