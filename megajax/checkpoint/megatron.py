"""Megatron-Core legacy (`torch` format) checkpoints: export and import.

    <dir>/latest_checkpointed_iteration.txt            the iteration, or `release`
    <dir>/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
         (or <dir>/release/... when no iteration is given)
    <dir>/tokenizer/                                   the tokenizer, named by args.tokenizer_model

Each `.pt` file is a torch.save'd dict {model, checkpoint_version 3.0, iteration,
args} where `model` is the state dict of Megatron-Core's GPTModel with the local
(non Transformer Engine) layer spec for that tensor/pipeline rank, and `args`
an argparse.Namespace with the hyper-parameters Megatron reads back
(`tokenizer_type=HuggingFaceTokenizer`, `tokenizer_model` the tokenizer folder).

MEGATRON_ROWS names every tensor both ways: `linear_qkv` grouped per query
group, SwiGLU's `linear_fc1` as [gate; up] per tensor rank, column/row/replicated
tensor-parallel splits, the vocabulary padded to make_vocab_size_divisible_by x TP.
A vision-language model is Megatron-Core's LLaVAModel: this table's names under `language_model.`
beside its encoder's and projector's (megatron_vision.py).
Pipeline stages hold consecutive layers numbered from 0 within the stage; the
first holds the embeddings, the last the final norm and the output layer (with
tied embeddings and PP > 1 a copy of the word embeddings, as Megatron keeps).

Memory: torch.save needs a rank file's whole state dict, so the export builds
one rank file at a time, reading the source one layer tensor at a time and
keeping only that rank's shard: peak host memory is about one rank file
(model / (TP x PP) in the output dtype) plus one full layer tensor. The price
is that each source tensor is read TP times.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from megajax.checkpoint.common import (REQUIRED, atomic_output_dir, check_source, check_tokenizer, model_overrides,
                                       read_fields, resolved_model, tokenizer_dir_spec)
from megajax.checkpoint import megatron_hybrid as hybrid
from megajax.checkpoint import megatron_vision as vision
from megajax.checkpoint.dtypes import numpy_dtype, torch_dtype
from megajax.checkpoint.hf_vision import language_shapes, vision_config_of
from megajax.checkpoint.mapping import (MTP_STACK, Row, flat, index, layer_rows, linear, linear_rows, norm_rows,
                                        rows_for, same, to_external, to_ours)
from megajax.checkpoint.source import unflatten
from megajax.checkpoint.torch_pickle import load as load_torch_file
from megajax.checkpoint.torch_dist import (COMMON_FILE, COMMON_KEY, MEGATRON_VERSIONS, METADATA, NEWEST_MEGATRON,
                                           DistCheckpoint, is_torch_dist, layer_keys, read_common)
from megajax.config import ModelConfig
from megajax.data.no_tokenizer import no_tokenizer
from megajax.errors import CheckpointError
from megajax.models.layout import EXPERT_BIAS, has_expert_bias, tensor_shapes

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
TOKENIZER_DIR = "tokenizer"
NULL_TOKENIZER = "NullTokenizer"  # Megatron's tokenizer_type for pre-tokenised data (no tokenizer at all)
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _torch():
    try:
        import torch
    except ImportError:
        raise CheckpointError("Megatron checkpoints need PyTorch: pip install 'megajax[torch]'.") from None
    return torch


def rank_dir(tp_rank: int, pp_rank: int, pipeline_parallel: int, ep_rank: int = 0, expert_parallel: int = 1) -> str:
    """Megatron's legacy rank folder: `mp_rank_TT`, `_PPP` with pipeline parallelism, `_EEE` with expert
    parallelism (so `mp_rank_00_001` is pipeline or expert rank 1, as the args say)."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pipeline_parallel > 1 else "")
            + (f"_{ep_rank:03d}" if expert_parallel > 1 else ""))


# ----------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------

_L = "decoder.layers.{i}"
_EXP = _L + ".mlp.experts.local_experts.{j}"
_SHARED = _L + ".mlp.shared_experts"
_MTP = "mtp.layers.{i}"  # {i}: the multi-token prediction depth

_DECODER_ROWS = (
    Row("embedding.word_embeddings.weight", same("embed/embedding"), vocab=True, split="column"),
    Row("embedding.position_embeddings.weight", same("pos_embed")),
    *norm_rows(f"{_L}.input_layernorm", "layers/attn_norm",  # aliases: Transformer Engine's fused norm
               aliases=(f"{_L}.self_attention.linear_qkv.layer_norm_weight",
                        f"{_L}.self_attention.linear_qkv.layer_norm_bias")),
    Row(f"{_L}.self_attention.linear_qkv.weight", *(linear(f"layers/attn/{x}/kernel") for x in "qkv"),
        groups="kv_heads", split="column"),
    Row(f"{_L}.self_attention.linear_qkv.bias", *(flat(f"layers/attn/{x}/bias") for x in "qkv"),
        groups="kv_heads", split="column"),
    *linear_rows(f"{_L}.self_attention.linear_proj", "layers/attn/o", n_in=2, split="row"),
    # Per-head q/k norms (qk_layernorm; model.qk_norm): one [head_dim] weight each, on every rank. With
    # multi-latent attention q_layernorm / kv_layernorm are the latent norms (megatron-core builds them
    # only with qk_layernorm=True); the aliases: Transformer Engine's norms fused into the up-projections.
    *norm_rows(f"{_L}.self_attention.q_layernorm", "layers/attn/q_norm",
               aliases=(f"{_L}.self_attention.linear_q_up_proj.layer_norm_weight",)),
    *norm_rows(f"{_L}.self_attention.k_layernorm", "layers/attn/k_norm"),
    # Multi-latent attention (MLASelfAttention): the down-projections are column-parallel linears whose
    # outputs megatron-core gathers ([q latent], [kv latent; rope key]), the up-projections are split
    # over heads (per head [q_nope; q_rope] and [k_nope; v]); linear_proj is the row above.
    Row(f"{_L}.self_attention.linear_q_proj.weight", linear("layers/attn/q/kernel"), split="column"),  # no q latent
    Row(f"{_L}.self_attention.linear_q_down_proj.weight", linear("layers/attn/q_down/kernel"), split="column"),
    Row(f"{_L}.self_attention.linear_q_up_proj.weight", linear("layers/attn/q_up/kernel"), split="column"),
    Row(f"{_L}.self_attention.linear_kv_down_proj.weight", linear("layers/attn/kv_down/kernel"), split="column"),
    Row(f"{_L}.self_attention.linear_kv_up_proj.weight", linear("layers/attn/kv_up/kernel"), split="column"),
    Row(f"{_L}.self_attention.kv_layernorm.weight", flat("layers/attn/kv_norm/scale"),
        aliases=(f"{_L}.self_attention.linear_kv_up_proj.layer_norm_weight",)),
    *norm_rows(f"{_L}.pre_mlp_layernorm", "layers/mlp_norm",
               aliases=(f"{_L}.mlp.linear_fc1.layer_norm_weight", f"{_L}.mlp.linear_fc1.layer_norm_bias")),
    Row(f"{_L}.mlp.linear_fc1.weight", linear("layers/mlp/gate/kernel"), linear("layers/mlp/up/kernel"),
        groups="tensor", split="column"),  # SwiGLU; else the GELU row below
    Row(f"{_L}.mlp.linear_fc1.bias", flat("layers/mlp/gate/bias"), flat("layers/mlp/up/bias"),
        groups="tensor", split="column"),
    *linear_rows(f"{_L}.mlp.linear_fc1", "layers/mlp/fc1", split="column"),
    *linear_rows(f"{_L}.mlp.linear_fc2", "layers/mlp/fc2", split="row"),
    # Mixture of experts (SequentialMLP: one linear_fc1 / linear_fc2 per expert, split like the dense ones).
    Row(f"{_L}.mlp.router.weight", linear("layers/mlp/router")),
    Row(f"{_L}.mlp.router.expert_bias", same(EXPERT_BIAS)),  # sigmoid routing with aux-loss-free balancing
    Row(f"{_EXP}.linear_fc1.weight", linear("layers/mlp/gate", experts=True), linear("layers/mlp/up", experts=True),
        groups="tensor", split="column"),
    Row(f"{_EXP}.linear_fc1.weight", linear("layers/mlp/fc1", experts=True), split="column"),
    Row(f"{_EXP}.linear_fc2.weight", linear("layers/mlp/fc2", experts=True), split="row"),
    # The shared expert (SharedExpertMLP): a dense MLP's linear_fc1 / linear_fc2, split like it.
    Row(f"{_SHARED}.linear_fc1.weight", linear("layers/mlp/shared_experts/gate/kernel"),
        linear("layers/mlp/shared_experts/up/kernel"), groups="tensor", split="column"),
    Row(f"{_SHARED}.linear_fc1.weight", linear("layers/mlp/shared_experts/fc1/kernel"), split="column"),
    Row(f"{_SHARED}.linear_fc2.weight", linear("layers/mlp/shared_experts/fc2/kernel"), split="row"),
    Row(f"{_SHARED}.gate_weight", linear("layers/mlp/shared_expert_gate")),  # [1, D]
    *norm_rows("decoder.final_layernorm", "final_norm",
               aliases=("decoder.final_norm.weight", "decoder.final_norm.bias")),
    Row("output_layer.weight", linear("output"), vocab=True, split="column"),
    Row("output_layer.weight", same("embed/embedding"), vocab=True, split="column", copy=True),  # tied
)


def _mtp_rows() -> tuple[Row, ...]:
    """Multi-token prediction (MultiTokenPredictionBlock, on the last stage): per depth the normed
    embedding and hidden state (enorm, hnorm), eh_proj over their concatenation [embedding; hidden]
    (column-parallel), a transformer layer named and split as a decoder layer (dense or a mixture of
    experts: its router, expert bias and experts as a MoE layer's), its final norm."""
    def in_mtp(row: Row) -> Row:
        options = {f: getattr(row, f) for f in ("axis", "groups", "vocab", "split")}
        rename = lambda n: n.replace(f"{_L}.", f"{_MTP}.transformer_layer.")  # noqa: E731
        return Row(rename(row.name), *(dataclasses.replace(p, path="mtp/block/" + p.path.split("/", 1)[1])
                                       for p in row.parts), aliases=tuple(map(rename, row.aliases)), **options)
    return (*norm_rows(f"{_MTP}.enorm", "mtp/embed_norm"), *norm_rows(f"{_MTP}.hnorm", "mtp/hidden_norm"),
            Row(f"{_MTP}.eh_proj.weight", linear("mtp/proj/kernel"), split="column"),
            *(in_mtp(r) for r in _DECODER_ROWS if r.per_layer),
            *norm_rows(f"{_MTP}.final_layernorm", "mtp/final_norm"))


MEGATRON_ROWS = _DECODER_ROWS + _mtp_rows()

# Megatron args <-> ModelConfig fields, and the default on import (REQUIRED: must be there).
_ARGS = (("num_layers", "num_layers", REQUIRED), ("hidden_size", "hidden_size", REQUIRED),
         ("num_attention_heads", "num_heads", REQUIRED), ("ffn_hidden_size", "ffn_hidden_size", None),
         ("kv_channels", "head_dim", None), ("max_position_embeddings", "max_position_embeddings", None),
         ("vocab_size", "vocab_size", None), ("norm_epsilon", "norm_eps", 1e-5),
         ("hidden_dropout", "hidden_dropout", 0.0), ("attention_dropout", "attention_dropout", 0.0),
         ("init_method_std", "init_std", 0.02), ("add_bias_linear", "use_bias", True))

# Linear modules whose (empty, local-spec) `_extra_state` entries a rank file carries.
_MOE_EXTRA_STATE = tuple(f"{_EXP}.{x}._extra_state" for x in ("linear_fc1", "linear_fc2"))
_SHARED_EXTRA_STATE = tuple(f"{_SHARED}.{x}._extra_state" for x in ("linear_fc1", "linear_fc2"))


def _attention_linears(m: ModelConfig) -> tuple[str, ...]:
    if not m.multi_latent_attention:
        return ("linear_qkv", "linear_proj")
    q = ("linear_q_proj",) if m.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


def _extra_state(m: ModelConfig, moe: bool, local: int, prefix: str = _L, experts: int | None = None,
                 attention: bool = True) -> list[str]:
    """The `_extra_state` keys (its Linear modules') of a layer (`moe`: a mixture of experts), numbered
    `local` on its stage, under `prefix`; `experts`: the experts a rank file holds (all by default);
    `attention` False: its MLP's alone (a hybrid's MoE layer)."""
    attn = tuple(f"{_L}.self_attention.{x}._extra_state" for x in _attention_linears(m)) if attention else ()
    if not moe:
        keys = attn + tuple(f"{_L}.mlp.{x}._extra_state" for x in ("linear_fc1", "linear_fc2"))
    else:
        keys = attn + _MOE_EXTRA_STATE + (_SHARED_EXTRA_STATE if m.moe_shared_expert_ffn_size else ())
    return [k.replace(_L, prefix).replace("{i}", str(local)).replace("{j}", str(j)) for k in keys
            for j in (range(experts or m.num_experts) if "{j}" in k else [0])]


def _mtp_extra_state(m: ModelConfig, experts: int | None = None) -> list[str]:
    """The `_extra_state` keys of the multi-token prediction depths (eh_proj and their layer's linears)."""
    return [key for k in range(m.mtp_num_layers)
            for key in (f"mtp.layers.{k}.eh_proj._extra_state",
                        *_extra_state(m, m.mtp_moe(), k, f"{_MTP}.transformer_layer", experts))]
_LAST_EXTRA_STATE = "output_layer._extra_state"


def _megatron_rows(shapes: dict, m: ModelConfig) -> list[Row]:
    """MEGATRON_ROWS for a model of layout `shapes`: linear_q_proj only for multi-latent attention
    (otherwise q is in linear_qkv); a hybrid model's rows (megatron_hybrid.py); a vision-language
    model's language model's (its encoder's and projector's: megatron_vision.py)."""
    if m.vision is not None:
        shapes = language_shapes(shapes)
    if m.hybrid_layer_pattern:
        return hybrid.hybrid_rows(shapes, m, _DECODER_ROWS)
    rows = rows_for(MEGATRON_ROWS, shapes, "Megatron-Core")
    return [r for r in rows if m.multi_latent_attention or not r.name.endswith(".linear_q_proj.weight")]


def _on_stage(rows: list[Row], m: ModelConfig, first: bool, last: bool, layers, offset: int):
    """(row, its names on this pipeline stage, the index in the row's stack of the layer or None) for
    every tensor the stage holds: its layers (numbered from 0 within the stage), the embeddings on the
    first, the rest on the last. With multi-token prediction the last stage, which runs its depths,
    holds the embeddings too (megatron-core's GPTModel builds them there): copies, read from the first."""
    for row in rows:
        if row.per_layer:
            pass
        elif row.name.startswith("embedding."):
            if first or (last and m.mtp_num_layers):
                yield (row if first else row.as_copy()), row.names(), None
        elif last and not (row.copy and first):
            yield row, row.names(), None
        if row.per_layer and row is next(r for r in rows if r.per_layer):  # the layers, each whole, in order
            for k in layers:
                yield from ((r, r.names(k), slot) for r, slot in _layer_rows(rows, m, offset + k))
    if last:  # multi-token prediction's depths, after the output layer
        for k in range(m.mtp_num_layers):
            yield from ((r, r.names(k), k) for r in rows if r.stack == MTP_STACK)


def _layer_rows(rows: list[Row], m: ModelConfig, layer: int):
    """(row, index in its stack) of the rows holding model layer `layer`."""
    return hybrid.layer_rows(rows, m, layer) if m.hybrid_layer_pattern else layer_rows(rows, m, layer)


# ----------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------

def _check_exportable(m: ModelConfig, tp: int, pp: int) -> None:
    problems = hybrid.check_exportable(m, tp) if m.hybrid_layer_pattern else []
    ffn = ("moe_ffn_hidden_size", m.moe_ffn_hidden_size) if m.num_experts else ("ffn_hidden_size", m.ffn_hidden_size)
    if m.hybrid_layer_pattern and m.num_experts and "-" in m.hybrid_pattern():  # both kinds of MLP
        ffn = ("ffn_hidden_size", m.ffn_hidden_size), ("moe_ffn_hidden_size", m.moe_ffn_hidden_size)
    else:
        ffn = (ffn,)
    shared = [("moe_shared_expert_ffn_size", m.moe_shared_expert_ffn_size)] if m.num_experts else []
    # multi-latent attention's down-projections and MTP's eh_proj are column-parallel linears in megatron-core
    latents = ([("q_lora_rank", m.q_lora_rank or 0), ("kv_lora_rank + qk_pos_emb_head_dim",
                                                      m.kv_lora_rank + m.qk_pos_emb_head_dim)]
               if m.multi_latent_attention else [])
    eh_proj = [("hidden_size", m.hidden_size)] if m.mtp_num_layers else []
    for name, value in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads), *ffn, *shared, *latents,
                        *eh_proj):
        if value % tp:
            problems.append(f"model.{name}={value} is not divisible by tensor_parallel={tp}")
    if m.num_layers % pp:
        problems.append(f"model.num_layers={m.num_layers} is not divisible by pipeline_parallel={pp}")
    if m.activation == "gelu_tanh" and not m.use_bias:
        problems.append("model.activation=gelu_tanh with model.use_bias=false: Megatron-Core computes the tanh GELU "
                        "only in its fused bias-GELU (bias_gelu_fusion), which needs the linear biases")
    if m.position_embedding == "rope" and m.rope_scaling == "llama3" and (
            m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_position) != (1.0, 4.0, 8192):
        problems.append(f"llama3 rope scaling with rope_low_freq_factor={m.rope_low_freq_factor}, "
                        f"rope_high_freq_factor={m.rope_high_freq_factor}, rope_original_max_position="
                        f"{m.rope_original_max_position}: Megatron-Core fixes them at 1, 4 and 8192")
    if m.multi_latent_attention and m.rope_scaling not in ("none", "yarn"):
        problems.append(f"model.multi_latent_attention=true with model.rope_scaling={m.rope_scaling}: megatron-core's "
                        f"multi-latent attention takes plain rope or yarn")
    if m.vision is not None:
        v = m.vision
        for name, value in (("num_heads", v.num_heads), ("ffn_hidden_size", v.ffn_hidden_size)):
            if value % tp:
                problems.append(f"model.vision.{name}={value} is not divisible by tensor_parallel={tp}")
        if pp > 1:
            problems.append(f"pipeline_parallel={pp} with a vision-language model (megajax writes LLaVA "
                            f"checkpoints at pipeline_parallel=1; Megatron-Core reshards a torch_dist one)")
    if problems:
        raise CheckpointError(f"cannot export to a Megatron checkpoint: {'; '.join(problems)}.")


def mtp_differs(m: ModelConfig) -> str | None:
    """What a Megatron export says of a model whose multi-token prediction block is not the kind
    Megatron-LM's training script builds (it builds the depths' layer like the last decoder layer:
    model.mtp_block=auto), or None."""
    if not m.mtp_num_layers or m.mtp_moe() == m.is_moe_layer(m.num_layers - 1):
        return None
    kind = "a mixture of experts" if m.mtp_moe() else "dense"
    last = "a mixture of experts" if m.is_moe_layer(m.num_layers - 1) else "dense"
    return (f"model.mtp_block = {m.mtp_block}: the multi-token prediction depths' layer is {kind} "
            f"(mtp.layers.*), but Megatron-LM's training script builds it like the last decoder layer, "
            f"{last} here; load the export with a {'MoE' if m.mtp_moe() else 'dense'} MTP layer spec")


def megatron_args(m: ModelConfig, *, tensor_parallel: int, pipeline_parallel: int, padded_vocab_size: int,
                  dtype: str, iteration: int, tokenizer_model: str | None = None,
                  null_eod: int | None = None) -> argparse.Namespace:
    """The `args` Namespace Megatron-LM saves with a checkpoint (the fields its loader and converters read).

    `tokenizer_model` is a Hugging Face tokenizer folder (recorded as Megatron's HuggingFaceTokenizer),
    or None when the export carries no tokenizer. `null_eod` (a model trained without a
    tokenizer, as an import of a NullTokenizer run is) records Megatron's NullTokenizer again: its
    --vocab-size is the ids before the end-of-document one, which the model's vocabulary counts."""
    torch = _torch()
    rope = m.position_embedding == "rope"
    args = argparse.Namespace(
        **{arg: getattr(m, field) for arg, field, _ in _ARGS},
        num_query_groups=m.num_kv_heads, group_query_attention=m.num_kv_heads != m.num_heads,
        seq_length=m.max_position_embeddings, padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        normalization={"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[m.norm],
        apply_layernorm_1p=False, swiglu=m.activation == "swiglu", openai_gelu=False,
        squared_relu=m.activation == "squared_relu",
        # Megatron's fused bias-GELU is the tanh approximation, its unfused GELU the exact one
        bias_gelu_fusion=m.activation == "gelu_tanh",
        position_embedding_type={"rope": "rope", "learned": "learned_absolute", "none": "none"}[m.position_embedding],
        add_position_embedding=m.position_embedding == "learned", use_rotary_position_embeddings=rope,
        rotary_base=int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta,
        rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=rope and m.rope_scaling == "llama3", rope_scaling_factor=m.rope_scaling_factor,
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        add_qkv_bias=m.use_bias, qk_layernorm=m.qk_norm or m.multi_latent_attention, **_mla_args(m),
        mtp_num_layers=m.mtp_num_layers or None, mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        apply_residual_connection_post_layernorm=False, **_moe_args(m),
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        sequence_parallel=False, use_legacy_models=False, ckpt_format="torch",
        # the hybrid model's spec is Transformer Engine's (megatron_hybrid.py)
        transformer_impl="transformer_engine" if m.hybrid_layer_pattern else "local",
        bf16=torch_dtype(dtype) == torch.bfloat16, fp16=torch_dtype(dtype) == torch.float16,
        params_dtype=torch_dtype(dtype),
        iteration=iteration, consumed_train_samples=0, consumed_valid_samples=0,
        tokenizer_type="HuggingFaceTokenizer" if tokenizer_model else None, tokenizer_model=tokenizer_model,
        vocab_file=None, merge_file=None, tokenizer_hf_use_fast=True, tokenizer_hf_include_special_tokens=False,
        trust_remote_code=False, tokenizer_special_tokens=None, tokenizer_metadata=None,
        **(hybrid.hybrid_args(m) if m.hybrid_layer_pattern else {}),
        **(vision.megatron_args(m) if m.vision is not None else {}),
    )
    if tokenizer_model is None and null_eod is not None:
        args.tokenizer_type, args.vocab_size = NULL_TOKENIZER, m.vocab_size - 1
        if null_eod != m.vocab_size - 1:
            args.null_tokenizer_eod_id = null_eod
    return args


def _mla_args(m: ModelConfig) -> dict:
    """Megatron's multi-latent attention args: plain rope or yarn (rope_type and yarn's fields; for plain
    rope at values that leave the softmax scale 1 / sqrt(N + P)), its latent norms (qk_layernorm, set by
    the caller)."""
    if not m.multi_latent_attention:
        return dict(multi_latent_attention=False)
    dims = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim)
    if m.rope_scaling != "yarn":
        return dict(dims, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(dims, rope_type="yarn", rotary_scaling_factor=m.rope_scaling_factor, mscale=m.rope_mscale,
                mscale_all_dim=m.rope_mscale_all_dim, beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow,
                original_max_position_embeddings=m.rope_original_max_position)


def _moe_args(m: ModelConfig) -> dict:
    """Megatron's mixture-of-experts args (num_experts None: dense)."""
    if not m.num_experts:
        return dict(num_experts=None)
    return dict(num_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_z_loss_coeff=m.moe_z_loss_coeff or None,
                moe_router_load_balancing_type="aux_loss", moe_router_pre_softmax=m.moe_router_pre_softmax, moe_grouped_gemm=False,
                moe_layer_freq=m.moe_layer_freq, moe_router_score_function=m.moe_router_score_function,
                moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
                moe_router_num_groups=m.moe_router_num_groups, moe_router_group_topk=m.moe_router_group_topk,
                moe_router_enable_expert_bias=has_expert_bias(m),
                moe_router_bias_update_rate=m.moe_router_bias_update_rate,
                expert_model_parallel_size=1,
                moe_expert_capacity_factor=m.moe_expert_capacity_factor, moe_token_dispatcher_type="alltoall",
                moe_shared_expert_intermediate_size=m.moe_shared_expert_ffn_size or None,
                moe_shared_expert_gate=m.moe_shared_expert_gate, moe_shared_expert_overlap=False)


def _rank_state_dict(source, rows: list[Row], m: ModelConfig, tp: int, pp: int, t: int, s: int, padded: int,
                     dtype, ep: int = 1, e: int = 0, vision_rows: list[Row] | None = None,
                     experts_whole: bool = False) -> dict:
    """The state dict of tensor rank t, pipeline stage s (and expert rank e of ep: its experts, numbered
    from 0; `experts_whole`: expert tensor size 1, each expert unsplit), reading the source one layer
    tensor at a time; `vision_rows`: a vision-language model's encoder and projector (megatron_vision.py)."""
    torch = _torch()
    per_stage, local = m.num_layers // pp, (m.num_experts or 1) // ep
    sd: dict = {}
    for row, names, slot in _on_stage(rows, m, s == 0, s == pp - 1, range(per_stage), s * per_stage):
        name = names[0]
        if row.expert is not None and ep > 1:
            if row.expert // local != e:
                continue
            match = _LOCAL_EXPERT.match(name)
            name = f"{match.group(1)}{row.expert % local}{match.group(3)}"
        whole = experts_whole and row.expert is not None
        x = to_external(row, lambda path: source.get(path, layer=slot), m, tensor=1 if whole else tp,
                        rank=None if whole else t, vocab_rows=padded)
        # a fresh tensor: never a view holding the whole source tensor
        # The expert bias stays fp32 as Megatron-Core keeps it (a bf16 bias would change the routing).
        to = torch.float32 if row.parts[0].path == EXPERT_BIAS else dtype
        sd[name] = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dtype=to, copy=True)
    if m.hybrid_layer_pattern:
        sd.update({key: None for k in range(per_stage) for key in hybrid.extra_state(
            m, s * per_stage + k, k, lambda i: _extra_state(m, True, i, experts=local, attention=False))})
    else:
        sd.update({key: None for k in range(per_stage)
                   for key in _extra_state(m, m.is_moe_layer(s * per_stage + k), k, experts=local)})
    if s == pp - 1:
        sd[_LAST_EXTRA_STATE] = None
        sd.update({key: None for key in _mtp_extra_state(m, local)})
    if m.vision is not None:  # LLaVAModel: the language model under language_model., the encoder, the projector
        sd = {vision.LANGUAGE + k: x for k, x in sd.items()}
        sd.update({k: torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dtype=dtype, copy=True)
                   for k, x in vision.rank_tensors(source, vision_rows, m, tp, t).items()})
        sd.update({k: None for k in vision.extra_state(m)})
    return sd


def folded_expert_ranks(tp: int, ep: int) -> list[tuple[int, int]]:
    """(tensor rank, expert rank) of each file a legacy checkpoint with expert tensor size 1 has per pipeline
    stage: Megatron's writers are the expert-data-parallel rank 0s, ranks i < ep of a stage (tensor rank
    i mod tp, expert rank i)."""
    return [(i % tp, i) for i in range(ep)]


def export_megatron(source, out_dir, *, tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                    dtype: str = "bf16", iteration: int | None = None, tokenizer_spec: str | None = None,
                    expert_tensor_parallel: int | None = None, chat_template: str | None = None,
                    null_eod: int | None = None) -> Path:
    """Writes `source` (a TensorSource) as a Megatron-Core legacy checkpoint directory `out_dir`.

    `iteration` None writes a `release` checkpoint (what Megatron loads for
    fine-tuning), else `iter_{iteration:07d}` (iteration >= 1; Megatron's
    loader rejects 0). `dtype` is 'bf16', 'fp16' or 'fp32'. `tokenizer_spec` ('byte' or a
    tokenizer.json / its directory) is written as a Hugging Face tokenizer in
    `<out_dir>/tokenizer/` and named in args; without one, `null_eod` (the end-of-document id of a model
    trained without a tokenizer) names Megatron's NullTokenizer in args. `expert_parallel` > 1 splits a mixture of experts'
    experts over that many expert ranks (`mp_rank_TT[_PPP]_EEE`, each with the dense tensors of its
    tensor and pipeline rank). `expert_tensor_parallel` (None: `tensor_parallel`) 1 with
    tensor_parallel > 1 is Megatron's MoE parallel folding: each expert unsplit, and the files are those
    Megatron writes, `mp_rank_{i mod TP}[_PPP]_{i}` for i < expert_parallel (folded_expert_ranks).
    Returns the directory.
    """
    from megajax.data.tokenizer import save_hf_tokenizer
    torch = _torch()
    m = source.model
    numpy_dtype(dtype)  # checks the name
    if tensor_parallel < 1 or pipeline_parallel < 1 or expert_parallel < 1:
        raise CheckpointError(f"tensor_parallel={tensor_parallel}, pipeline_parallel={pipeline_parallel} and "
                              f"expert_parallel={expert_parallel} must be >= 1.")
    if expert_parallel > 1 and m.vision is not None:
        raise CheckpointError(f"cannot export to a Megatron checkpoint: expert_parallel={expert_parallel} with a "
                              f"vision-language model (megajax writes LLaVA checkpoints at expert_parallel=1).")
    if expert_parallel > 1 and (not m.num_experts or m.num_experts % expert_parallel):
        raise CheckpointError(f"cannot export to a Megatron checkpoint: expert_parallel={expert_parallel} needs a "
                              f"mixture of experts whose model.num_experts={m.num_experts} it divides.")
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    folded = etp != tensor_parallel
    if folded and (etp != 1 or not m.num_experts or expert_parallel % tensor_parallel):
        raise CheckpointError(f"cannot export to a Megatron checkpoint: expert_tensor_parallel={etp} with "
                              f"tensor_parallel={tensor_parallel}; accepted: the tensor size, or 1 for a mixture of "
                              f"experts with expert_parallel (here {expert_parallel}) a multiple of tensor_parallel.")
    if iteration is not None and iteration < 1:
        raise CheckpointError(f"iteration={iteration}: Megatron's loader needs an iteration >= 1 "
                              f"(or none, for a release checkpoint).")
    _check_exportable(m, tensor_parallel, pipeline_parallel)
    shapes = tensor_shapes(m, check_source(source))
    rows = _megatron_rows(shapes, m)
    vrows = vision.vision_rows(shapes, m) if m.vision is not None else None
    tok = check_tokenizer(tokenizer_spec, m) if tokenizer_spec is not None else None
    padded = m.megatron_padded_vocab_size(tensor_parallel)
    stored = torch_dtype(dtype)
    tokenizer_model = str(Path(out_dir).expanduser().absolute() / TOKENIZER_DIR) if tok is not None else None
    args = megatron_args(m, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                         padded_vocab_size=padded, dtype=dtype, iteration=iteration or 0,
                         tokenizer_model=tokenizer_model, null_eod=null_eod)
    if m.num_experts:
        args.expert_model_parallel_size, args.expert_tensor_parallel_size = expert_parallel, etp
    step_dir = "release" if iteration is None else f"iter_{iteration:07d}"
    ranks = (folded_expert_ranks(tensor_parallel, expert_parallel) if folded else
             [(t, e) for t in range(tensor_parallel) for e in range(expert_parallel)])
    with atomic_output_dir(out_dir) as tmp:
        if tok is not None:
            save_hf_tokenizer(tok, tmp / TOKENIZER_DIR, max_length=m.max_position_embeddings,
                              chat_template=chat_template)
        for s in range(pipeline_parallel):
            for t, e in ranks:
                sd = _rank_state_dict(source, rows, m, tensor_parallel, pipeline_parallel, t, s, padded,
                                      stored, expert_parallel, e, vrows, experts_whole=folded)
                path = tmp / step_dir / rank_dir(t, s, pipeline_parallel, e, expert_parallel) / CHECKPOINT_FILE
                path.parent.mkdir(parents=True)
                torch.save({"model": sd, "checkpoint_version": CHECKPOINT_VERSION,
                            "iteration": iteration or 0, "args": args}, path)
                del sd
        (tmp / TRACKER).write_text("release" if iteration is None else str(iteration))
    return Path(out_dir)


def common_state_form(version: str) -> str:
    """Where megatron-core `version` keeps a torch_dist checkpoint's common state: 'common.pt' (<= 0.18)
    or 'common_state' (an object in the shards, 0.19)."""
    if version not in MEGATRON_VERSIONS:
        raise CheckpointError(f"--megatron-version {version}: megajax writes torch_dist checkpoints for "
                              f"megatron-core {', '.join(MEGATRON_VERSIONS)}.")
    return COMMON_KEY if version == "0.19" else COMMON_FILE


# The names megatron-core's GPTModel gives its layer norms in a sharded state dict (those of Transformer
# Engine's fused norm + linear, whichever spec built it).
_DIST_NORMS = {"input_layernorm": "self_attention.linear_qkv", "pre_mlp_layernorm": "mlp.linear_fc1"}


def _per_layer_dist(m: ModelConfig) -> bool:
    """Whether megatron-core keeps each decoder layer under its own torch_dist keys (`decoder.layers.{i}.X`,
    no layer dim): when its layers differ (moe_layer_freq > 1 or its list form; a hybrid's)."""
    return bool(m.hybrid_layer_pattern) or bool(m.num_experts) and (isinstance(m.moe_layer_freq, list) or m.moe_layer_freq > 1)


def _dist_state_dict(sd: dict, m: ModelConfig) -> dict:
    """torch_dist's global tensors from a TP-1 legacy state dict: `decoder.layers.{i}.X` stacked into
    `decoder.layers.X [L, ...]` (or, when the layers differ, kept per layer: _per_layer_dist), the
    experts' `local_experts.{j}.Y` into `mlp.experts.experts.Y [(L,) E, ...]`, and each layer's
    `_extra_state` as the object Megatron-Core stores per layer (and expert): `KEY/shard_{i}_{L}`,
    `KEY/shard_{i}.{j}_{L}.{E}` (per layer: `KEY/shard_0_1`, `KEY/shard_{j}_{E}`). Multi-token
    prediction's `mtp.layers.{k}.*` are kept per depth, each depth's layer as a layer of its own, as
    megatron-core keeps them. A vision-language model's language model as that under `language_model.`,
    its encoder and projector as megatron_vision.py keeps them."""
    torch = _torch()
    if m.vision is not None:
        lm, rest, _ = vision.split(sd)
        out = {vision.LANGUAGE + k: x for k, x in _dist_state_dict(lm, vision.language_model(m)).items()}
        return dict(out, **vision.dist_state_dict(rest, m))
    out: dict = {}
    stacks: dict[str, dict] = {}
    L, E = m.num_layers, m.num_experts
    per_layer = _per_layer_dist(m)

    def renamed(rest: str) -> str:
        """The layer norms under the linear they precede, as GPTModel's local spec names them (its
        multi-latent attention spec keeps the names)."""
        norm, _, part = rest.partition(".")
        if norm in _DIST_NORMS and not m.multi_latent_attention and not m.hybrid_layer_pattern:
            return f"{_DIST_NORMS[norm]}.layer_norm_{part}"
        return rest

    for name, x in sd.items():
        mtp = re.match(r"(mtp\.layers\.\d+\.transformer_layer\.)(.*)$", name)
        decoder = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
        if not mtp and not decoder:
            if x is not None:
                out[name] = x
            elif name.startswith("mtp."):  # eh_proj's
                out[f"{name}/shard_0_1"] = [None]
            continue
        # A depth's layer is kept under its own keys, as a layer of a model whose layers differ.
        i, rest = (0, mtp.group(2)) if mtp else (int(decoder.group(1)), decoder.group(2))
        own = bool(mtp) or per_layer
        layer = mtp.group(1) if mtp else f"decoder.layers.{i}." if per_layer else "decoder.layers."
        rest = renamed(rest)
        expert = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
        if x is None:  # an _extra_state: one object per layer (and expert)
            if own:
                key = (f"{layer}mlp.experts.experts.{expert.group(2)}/shard_{expert.group(1)}_{E}" if expert
                       else f"{layer}{rest}/shard_0_1")
            else:
                key = (f"{layer}mlp.experts.experts.{expert.group(2)}/shard_{i}.{expert.group(1)}_{L}.{E}"
                       if expert else f"{layer}{rest}/shard_{i}_{L}")
            out[key] = [None]  # PyTorch DCP stores an object as its torch.save bytes
            continue
        if expert:
            stacks.setdefault(f"{layer}mlp.experts.experts.{expert.group(2)}", {})[(i, int(expert.group(1)))] = x
        elif own:  # a Mamba mixer's in_proj and conv1d as their parts' keys
            out.update({f"{layer}{k}": v for k, v in (hybrid.split_parts(rest, x, m) or {rest: x}).items()})
        else:
            stacks.setdefault(f"{layer}{rest}", {})[i] = x
    for key, parts in stacks.items():
        if per_layer or key.startswith("mtp."):  # one layer's experts
            out[key] = torch.stack([parts[k] for k in sorted(parts, key=lambda ij: ij[1])])
            continue
        if len(parts) != (L * E if "experts.experts." in key else L):
            raise CheckpointError(f"cannot export to torch_dist: {key} is on {len(parts)} of the layers.")
        if "experts.experts." in key:
            out[key] = torch.stack([torch.stack([parts[(i, j)] for j in range(E)]) for i in range(L)])
        else:
            out[key] = torch.stack([parts[i] for i in range(L)])
    return out


def _writer(dcp, step: Path):
    """PyTorch DCP's file writer, recording the checkpoint's place as a string (as Megatron-Core does;
    a pathlib object in .metadata is outside what readers with an allow-list unpickle)."""
    class Writer(dcp.FileSystemWriter):
        def storage_meta(self):
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = str(meta.checkpoint_id)
            return meta
    return Writer(str(step), thread_count=1)


def _dist_adam(adam, source, rows: list[Row], m: ModelConfig, padded: int, dtype: str) -> dict:
    """megatron-core's optimizer tensors for `adam` (megatron_optimizer.AdamState): each moment (and,
    for bf16/fp16 weights, the fp32 main parameters) laid out as the parameters are, under
    `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<parameter key>`, in float32."""
    from megajax.checkpoint.megatron_optimizer import FP32_PARAM, PREFIX, STATES
    torch = _torch()
    params = sorted(n for n in source.names() if n != EXPERT_BIAS)
    for what, moment in zip(STATES, (adam.mu, adam.nu)):
        if sorted(moment.names()) != params:
            raise CheckpointError(f"--with-optimizer: the checkpoint's Adam {what} holds {len(moment.names())} "
                                  f"tensors, its parameters {len(params)}: not the optimizer of these parameters.")
    moment_rows = [r for r in rows if all(p.path != EXPERT_BIAS for p in r.parts)]  # a buffer: no Adam state
    parts = list(zip(STATES, (adam.mu, adam.nu))) + ([(FP32_PARAM, source)] if dtype != "fp32" else [])
    out = {}
    for what, tensors in parts:
        sd = _dist_state_dict(_rank_state_dict(tensors, moment_rows, m, 1, 1, 0, 0, padded, torch.float32), m)
        out.update({f"{PREFIX}{what}.{k}": v for k, v in sd.items() if isinstance(v, torch.Tensor)})
    return out


def export_torch_dist(source, out_dir, *, dtype: str = "bf16", iteration: int | None = None,
                      tokenizer_spec: str | None = None, megatron_version: str = NEWEST_MEGATRON,
                      adam=None, chat_template: str | None = None, null_eod: int | None = None) -> Path:
    """Writes `source` as a Megatron-Core torch_dist checkpoint directory `out_dir`: the tracker file and
    `release/` or `iter_{iteration:07d}/` with `.metadata`, `__0_0.distcp` (written by PyTorch Distributed
    Checkpoint, no process group) and `metadata.json`; global tensors (reshardable: megatron-core loads
    them at any TP), the common state (args, checkpoint_version, iteration) as megatron-core
    `megatron_version` keeps it (common.pt up to 0.18, a `common_state` object in the shards from 0.19).
    The whole model is held in memory once (float32 source tensors cast to `dtype`).

    `adam` (megatron_optimizer.AdamState) adds the optimizer state megatron-core's optimizer loads:
    Adam's moments (and fp32 main parameters for bf16/fp16 weights) as global tensors, its step
    count, param groups and LR scheduler in the common state (megatron_optimizer.py); the model and
    its optimizer state then take about three (four) times the model's float32 size in memory."""
    import json
    from megajax.data.tokenizer import save_hf_tokenizer
    torch = _torch()
    import torch.distributed.checkpoint as dcp
    form = common_state_form(megatron_version)
    m = source.model
    numpy_dtype(dtype)
    if iteration is not None and iteration < 1:
        raise CheckpointError(f"iteration={iteration}: Megatron's loader needs an iteration >= 1 "
                              f"(or none, for a release checkpoint).")
    _check_exportable(m, 1, 1)
    if adam is not None and m.num_experts:
        raise CheckpointError("--with-optimizer: megajax writes megatron-core's optimizer state for dense models; "
                              "megatron-core keeps a mixture-of-experts model's expert parameters in a second "
                              "(chained) optimizer, which megajax does not write. Export without --with-optimizer.")
    if adam is not None and m.vision is not None:
        raise CheckpointError("--with-optimizer: megajax writes megatron-core's optimizer state for text models, "
                              "not a vision-language model's. Export without --with-optimizer.")
    if adam is not None and iteration is None:
        raise CheckpointError("--with-optimizer: the checkpoint is of step 0; Megatron-LM loads no optimizer state "
                              "from a release checkpoint (written for step 0). Export without --with-optimizer.")
    shapes = tensor_shapes(m, check_source(source))
    rows = _megatron_rows(shapes, m)
    vrows = vision.vision_rows(shapes, m) if m.vision is not None else None
    tok = check_tokenizer(tokenizer_spec, m) if tokenizer_spec is not None else None
    padded = m.megatron_padded_vocab_size(1)
    tokenizer_model = str(Path(out_dir).expanduser().absolute() / TOKENIZER_DIR) if tok is not None else None
    args = megatron_args(m, tensor_parallel=1, pipeline_parallel=1, padded_vocab_size=padded, dtype=dtype,
                         iteration=iteration or 0, tokenizer_model=tokenizer_model,
                         null_eod=null_eod)
    args.ckpt_format = "torch_dist"
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0}
    if adam is not None:
        from megajax.checkpoint.megatron_optimizer import adam_args, common_optimizer, scheduler_state
        adam_args(args, adam)
        common.update(optimizer=common_optimizer(adam, torch), opt_param_scheduler=scheduler_state(adam))
    step_dir = "release" if iteration is None else f"iter_{iteration:07d}"
    with atomic_output_dir(out_dir) as tmp:
        if tok is not None:
            save_hf_tokenizer(tok, tmp / TOKENIZER_DIR, max_length=m.max_position_embeddings,
                              chat_template=chat_template)
        state = _dist_state_dict(_rank_state_dict(source, rows, m, 1, 1, 0, 0, padded, torch_dtype(dtype),
                                                  vision_rows=vrows), m)
        if adam is not None:
            state.update(_dist_adam(adam, source, rows, m, padded, dtype))
        step = tmp / step_dir
        step.mkdir()
        backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        if form == COMMON_FILE:
            torch.save(common, step / COMMON_FILE)
            backend.update(common_backend="torch", common_backend_version=1)
        else:
            state[f"{COMMON_KEY}/shard_0_1"] = [common]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on saving without a process group
            # Unflattened: each object (a list, as Megatron-Core's ShardedObjects are) is one bytes entry.
            dcp.save(state, storage_writer=_writer(dcp, step), no_dist=True,
                     planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
        (step / "metadata.json").write_text(json.dumps(backend))
        (tmp / TRACKER).write_text("release" if iteration is None else str(iteration))
    return Path(out_dir)


# ----------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------

def _step_dir(d: Path) -> Path:
    """The directory holding the mp_rank_* folders: d itself, or the one its tracker file names."""
    if any(_RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir()):
        return d
    tracker = d / TRACKER
    if not tracker.is_file():
        if is_torch_dist(d):
            return d
        raise CheckpointError(f"{str(d)!r} is not a Megatron checkpoint: no {TRACKER}, no mp_rank_* folders "
                              f"and no torch_dist files (.metadata, *.distcp).")
    text = tracker.read_text().strip()
    if text == "release":
        step = d / "release"
    elif text.isdigit():
        step = d / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{str(tracker)!r} holds {text!r}; expected an iteration number or 'release'.")
    if not step.is_dir():
        raise CheckpointError(f"{str(tracker)!r} names {step.name}, but {str(step)!r} does not exist.")
    return step


# Megatron args (newer releases' names among them) that change the function the model computes, with the
# value under which they do not; megajax's model has no counterpart, so the import refuses any other.
_UNREPRESENTED = (
    ("layernorm_zero_centered_gamma", False),  # --apply-layernorm-1p as megatron-core 0.19 saves it
    ("qk_l2_norm", False), ("softmax_type", "vanilla"), ("window_size", None), ("no_rope_freq", None),
    ("attention_output_gate", False), ("activation_func_clamp_value", None), ("glu_linear_offset", 0.0),
    ("rotary_seq_len_interpolation_factor", None), ("mrope_section", None),
    ("experimental_attention_variant", None), ("heterogeneous_layers_config_path", None),
    ("heterogeneous_layers_config_encoded_json", None), ("linear_attention_freq", None),
)


def _arg(args, name: str, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def _overrides_from_args(args) -> dict:
    """ModelConfig fields from a Megatron `args`; CheckpointError for what megajax cannot represent."""
    def reject(name, value, accepted):
        raise CheckpointError(f"Megatron args {name}={value!r} cannot be represented in megajax; accepted: {accepted}.")

    for name in ("apply_layernorm_1p", "openai_gelu", "rotary_interleaved", "apply_residual_connection_post_layernorm"):
        if _arg(args, name, False):
            reject(name, getattr(args, name), "False")
    for name, neutral in _UNREPRESENTED:
        if _arg(args, name, neutral) != neutral:
            reject(name, getattr(args, name), repr(neutral))
    moe = {}
    if _arg(args, "num_experts"):
        score = _arg(args, "moe_router_score_function", "softmax")
        if score not in ("softmax", "sigmoid"):
            reject("moe_router_score_function", score, "softmax, sigmoid")
        pre_softmax = bool(_arg(args, "moe_router_pre_softmax", False))
        if pre_softmax and score != "softmax":
            reject("moe_router_pre_softmax", True, "True only with moe_router_score_function=softmax")
        rate = 0.0
        if _arg(args, "moe_router_enable_expert_bias", False):
            rate = float(_arg(args, "moe_router_bias_update_rate", 1e-3))
            if score != "sigmoid" or not rate > 0:
                reject("moe_router_enable_expert_bias", True, "an expert bias only with moe_router_score_function="
                       "sigmoid and moe_router_bias_update_rate > 0")
        freq = _moe_layer_freq(getattr(args, "moe_layer_freq", None), int(args.num_layers), reject)
        scaling = _arg(args, "moe_router_topk_scaling_factor")
        moe = dict(num_experts=int(args.num_experts), moe_router_topk=int(_arg(args, "moe_router_topk", 2)),
                   moe_ffn_hidden_size=_arg(args, "moe_ffn_hidden_size"), moe_router_score_function=score,
                   moe_router_topk_scaling_factor=None if scaling is None else float(scaling),
                   moe_router_bias_update_rate=rate, moe_layer_freq=freq,
                   moe_router_num_groups=_arg(args, "moe_router_num_groups"),
                   moe_router_group_topk=_arg(args, "moe_router_group_topk"),
                   moe_shared_expert_ffn_size=int(_arg(args, "moe_shared_expert_intermediate_size", 0)),
                   moe_shared_expert_gate=bool(_arg(args, "moe_shared_expert_gate", False)),
                   moe_router_pre_softmax=pre_softmax)
    if _arg(args, "virtual_pipeline_model_parallel_size"):
        reject("virtual_pipeline_model_parallel_size", args.virtual_pipeline_model_parallel_size, "None")
    if _arg(args, "rotary_percent", 1.0) != 1.0:
        reject("rotary_percent", args.rotary_percent, "1.0")
    position = _arg(args, "position_embedding_type")
    if position is None:
        position = "rope" if _arg(args, "use_rotary_position_embeddings", False) else "learned_absolute"
    if position not in ("rope", "learned_absolute", "none"):
        reject("position_embedding_type", position, "rope, learned_absolute, none")
    if _arg(args, "swiglu", False) and _arg(args, "squared_relu", False):
        reject("squared_relu", True, "False with swiglu=True")
    normalization = _arg(args, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        reject("normalization", normalization, "LayerNorm, RMSNorm")
    qk_norm = bool(_arg(args, "qk_layernorm", False))
    mla = _mla_overrides(args, qk_norm, reject)
    if mla:
        qk_norm = False  # the latent norms, not per-head q/k norms
    if qk_norm and normalization != "RMSNorm":
        reject("qk_layernorm", True, "True only with normalization=RMSNorm (megajax's q/k norms are RMSNorms)")
    out = read_fields(lambda key: getattr(args, key, None), _ARGS, "Megatron args")
    if out["use_bias"] is False and _arg(args, "add_qkv_bias", False):
        reject("add_qkv_bias", True, "add_qkv_bias only together with add_bias_linear (one model.use_bias)")
    hidden, heads = out["hidden_size"], out["num_heads"]
    hybrid_fields = hybrid.hybrid_overrides(args, lambda name, default=None: _arg(args, name, default), reject)
    if hybrid_fields and hybrid_fields["num_layers"] != out["num_layers"]:
        reject("num_layers", out["num_layers"], f"the hybrid pattern's {hybrid_fields['num_layers']} layers")
    out.update(family="llama" if position == "rope" or hybrid_fields else "gpt",
               num_kv_heads=_arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention") else heads,
               ffn_hidden_size=out["ffn_hidden_size"] or 4 * hidden,
               vocab_size=_vocab_size(args),
               max_position_embeddings=out["max_position_embeddings"] or _arg(args, "seq_length"),
               norm="rmsnorm" if normalization == "RMSNorm" else "layernorm",
               activation=_activation(args),
               position_embedding={"rope": "rope", "learned_absolute": "learned", "none": "none"}[position],
               tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False),
               norm_eps=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
               rope_theta=float(_arg(args, "rotary_base", 10000)), qk_norm=qk_norm)
    if moe:
        moe["moe_ffn_hidden_size"] = moe["moe_ffn_hidden_size"] or out["ffn_hidden_size"]
        out.update(moe)
    out.update(mla)
    out.update(hybrid_fields)
    if _arg(args, "mtp_num_layers"):
        out.update(mtp_num_layers=int(args.mtp_num_layers),
                   mtp_loss_scaling_factor=float(_arg(args, "mtp_loss_scaling_factor", 0.1)))
    if position == "rope" and _arg(args, "use_rope_scaling", False):
        out.update(rope_scaling="llama3", rope_scaling_factor=float(_arg(args, "rope_scaling_factor", 8.0)),
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192)
    if out["vocab_size"] is None or out["max_position_embeddings"] is None:
        raise CheckpointError("Megatron args give neither vocab_size nor padded_vocab_size, or no "
                              "max_position_embeddings / seq_length.")
    fields = vision.vision_overrides(args)
    if fields is not None:
        try:
            out["vision"] = vision_config_of(fields)
        except TypeError as e:
            raise CheckpointError(f"Megatron args {vision.ARG}={fields!r}: {e}; expected model.vision's "
                                  f"fields.") from None
    return out


def _activation(args) -> str:
    """model.activation of Megatron args. Without --swiglu or --squared-relu Megatron-Core's MLP runs GELU:
    with bias_gelu_fusion (Megatron-LM's default; validate_args turns it off without biases) its fused
    bias-GELU, the tanh approximation; otherwise torch's exact (erf) GELU. Args without the field (older
    megajax exports) mean the exact one."""
    if _arg(args, "swiglu", False):
        return "swiglu"
    if _arg(args, "squared_relu", False):
        return "squared_relu"
    fused = _arg(args, "bias_gelu_fusion", False) and _arg(args, "add_bias_linear", True)
    return "gelu_tanh" if fused else "gelu"


def _vocab_size(args) -> int | None:
    """The model's vocabulary from Megatron args: --vocab-size, which for a NullTokenizer run is the size
    before its end-of-document id (that tokenizer has vocab_size + 1 ids, the last one end-of-document),
    else padded_vocab_size (the tokenizer's ids are not in the args)."""
    vocab = _arg(args, "vocab_size")
    if vocab is not None and _arg(args, "tokenizer_type") == NULL_TOKENIZER:
        return int(vocab) + 1
    return vocab if vocab is not None else _arg(args, "padded_vocab_size")


def null_tokenizer_eod(args) -> int | None:
    """The end-of-document id of a NullTokenizer run's args (its vocab_size, or null_tokenizer_eod_id where
    the args name one); None for another tokenizer."""
    if _arg(args, "tokenizer_type") != NULL_TOKENIZER or _arg(args, "vocab_size") is None:
        return None
    return int(_arg(args, "null_tokenizer_eod_id", args.vocab_size))


def _mla_overrides(args, qk_layernorm: bool, reject) -> dict:
    """Multi-latent attention's ModelConfig fields from Megatron args ({} without it)."""
    if not _arg(args, "multi_latent_attention", False):
        return {}
    if not qk_layernorm:
        reject("qk_layernorm", False, "True with multi_latent_attention (megatron-core has the q and kv latent "
               "norms only with qk_layernorm; megajax's multi-latent attention always normalises its latents)")
    rope = _arg(args, "rope_type", "yarn")  # megatron-core's MLATransformerConfig default
    if rope not in ("rope", "yarn"):
        reject("rope_type", rope, "rope or yarn with multi_latent_attention")
    lora = _arg(args, "q_lora_rank")
    out = dict(multi_latent_attention=True, q_lora_rank=None if lora is None else int(lora),
               **{k: int(_arg(args, k, d)) for k, d in (("kv_lora_rank", 512), ("qk_head_dim", 128),
                                                        ("qk_pos_emb_head_dim", 64), ("v_head_dim", 128))})
    if rope == "yarn":  # megatron-core's MLATransformerConfig defaults where the args leave a field out
        out.update(rope_scaling="yarn", rope_scaling_factor=float(_arg(args, "rotary_scaling_factor", 40.0)),
                   rope_original_max_position=int(_arg(args, "original_max_position_embeddings", 4096)),
                   rope_beta_fast=float(_arg(args, "beta_fast", 32.0)),
                   rope_beta_slow=float(_arg(args, "beta_slow", 1.0)),
                   rope_mscale=float(_arg(args, "mscale", 1.0)),
                   rope_mscale_all_dim=float(_arg(args, "mscale_all_dim", 0.0)))
    return out


_MTP_ROUTER = "mtp.layers.0.transformer_layer.mlp.router.weight"


def _with_mtp_block(overrides: dict, names) -> dict:
    """`overrides` with model.mtp_block as the checkpoint's tensor names say (a router in the first depth:
    a mixture of experts), for a mixture-of-experts model with multi-token prediction."""
    if not overrides.get("mtp_num_layers") or not overrides.get("num_experts"):
        return overrides
    return dict(overrides, mtp_block="moe" if _MTP_ROUTER in names else "dense")


def _moe_layer_freq(value, num_layers: int, reject) -> int | list[int]:
    """model.moe_layer_freq from Megatron's moe_layer_freq: an int N (layer i is MoE when i % N == 0), a
    0/1 list per layer or its string (e.g. "[1,0]*2"), accepted when it is such a pattern or the dense
    layers first ([0] * k + [1] * (num_layers - k), kept as that list)."""
    if value is None:
        return 1
    pattern = _list_expression(value) if isinstance(value, str) else value
    if isinstance(pattern, int) and pattern >= 1 and num_layers % pattern == 0:
        return pattern
    if isinstance(pattern, (list, tuple)) and len(pattern) == num_layers and pattern and pattern[0] == 0:
        k = num_layers - sum(1 for x in pattern if x == 1)
        if list(pattern) == [0] * k + [1] * (num_layers - k) and k < num_layers:
            return list(pattern)
    if isinstance(pattern, (list, tuple)) and len(pattern) == num_layers and pattern and pattern[0] == 1:
        n = next((k for k in range(1, num_layers + 1) if list(pattern) == [int(i % k == 0) for i in range(num_layers)]),
                 None)
        if n is not None and num_layers % n == 0:
            return n
    reject("moe_layer_freq", value, f"one MoE layer every N layers starting with layer 0 (an int N dividing "
                                    f"num_layers={num_layers}, or that pattern as a 0/1 list), or the dense "
                                    f"layers first (a list [0, ..., 0, 1, ..., 1])")


def _list_expression(text: str):
    """The value of a Megatron list expression such as "([1]*1+[0]*3)*2" (int lists, + and *), or None
    when the text is anything else (it is never executed)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(x) for x in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and max(len(x) if isinstance(x, list) else abs(x) for x in (left, right)) * \
                    min(len(x) if isinstance(x, list) else abs(x) for x in (left, right)) > 1 << 20:
                raise ValueError(text)  # no layer pattern is this long
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, MemoryError):
        return None


def _fill_stage(dicts: list[dict], where: str, rows: list[Row], shapes: dict, m: ModelConfig, first: bool,
                last: bool, layers: list[int], offset: int, vocab_padded: int, out: dict,
                experts_whole: bool = False) -> None:
    """Fills `out` from one pipeline stage's state dicts (one per tensor rank), merging the shards;
    `experts_whole` (expert tensor size 1): the experts unsplit, all in the first dict."""
    def mismatch(name, got, want):
        return CheckpointError(f"Megatron checkpoint {where}: {name} has shape {list(got)} (tensor shards "
                               f"merged), but its args imply {list(want)}.")

    used = set()
    for row, names, slot in _on_stage(rows, m, first, last, layers, offset):
        key = next((k for k in names if k in dicts[0]), None)  # local spec name, or an alias
        if key is None:
            raise CheckpointError(f"Megatron checkpoint {where} has no {names[0]}.")
        used.add(key)
        if row.copy:  # the last stage's copy of the tied word embeddings
            continue
        whole = row.split == "replicated" or (experts_whole and row.expert is not None)
        shards = [d.get(key) for d in (dicts[:1] if whole else dicts)]
        if any(x is None for x in shards):
            raise CheckpointError(f"Megatron checkpoint {where}: tensor rank {shards.index(None)} has no {key}.")
        y = np.concatenate([x.float().numpy() for x in shards], axis=int(row.split == "row"))
        for path, x in to_ours(row, key, y, shapes, m, tensor=1 if whole else len(dicts), vocab_rows=vocab_padded,
                               mismatch=mismatch).items():
            out[path][index(slot, row)] = x
    left = sorted(k for k in dicts[0] if not k.endswith("_extra_state") and k not in used)
    if left:
        raise CheckpointError(f"Megatron checkpoint {where} holds tensors megajax does not know: "
                              f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}.")


def import_megatron(in_dir, *, trust: bool = False) -> tuple[dict, dict]:
    """Reads a Megatron-Core legacy checkpoint (the tracker's iteration, or `release`), merging TP/PP shards.

    `in_dir` is the save directory (with latest_checkpointed_iteration.txt) or
    one iteration's directory. Returns (model overrides, params) like
    import_hf: the architecture from `args`, the vocabulary padded to
    model.padded_vocab_size(). Files are read with torch's weights-only
    unpickler, Megatron's own classes as stand-ins (torch_pickle.py); `trust=True`
    (--trust-checkpoint) unpickles them fully, for checkpoints you trust.
    """
    d = Path(in_dir).expanduser()
    if d.is_dir() and is_torch_dist(_step_dir(d)):
        return _import_torch_dist(_step_dir(d), trust)
    step, ranks, first = _open(in_dir, trust)
    args = first["args"]
    tp, pp, ep = _rank_sizes(args, step)
    folded = _expert_tensor_size(args, tp) != tp
    files = {(0, 0, 0): first["model"]}
    if pp > 1:  # the last stage's names say what its multi-token prediction block is
        files[0, pp - 1, 0] = load_torch_file(ranks[rank_dir(0, pp - 1, pp, 0, ep)], trust)["model"]
    m = resolved_model(_with_mtp_block(_overrides_from_args(args), _language_names(files[0, pp - 1, 0])),
                       source=f"{str(in_dir)!r} (its args)")
    if m.vision is not None and (pp > 1 or ep > 1):
        raise CheckpointError(f"{str(step)!r}: args say pipeline_model_parallel_size={pp}, expert_model_parallel_"
                              f"size={ep} for a vision-language model; megajax reads legacy LLaVA checkpoints "
                              f"of one pipeline stage and expert rank (or torch_dist ones).")
    if ep > 1 and (not m.num_experts or m.num_experts % ep):
        raise CheckpointError(f"{str(step)!r}: args say expert_model_parallel_size={ep} with num_experts="
                              f"{m.num_experts}; expert parallelism needs a number of experts it divides.")
    vocab_padded = int(_arg(args, "padded_vocab_size", m.vocab_size))
    shapes = tensor_shapes(m)
    rows = _megatron_rows(shapes, m)
    vrows = vision.vision_rows(shapes, m) if m.vision is not None else None
    flat_params = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    offset = 0
    for s in range(pp):
        if folded:  # tensor rank t's dense tensors from expert rank t's file; every expert, whole, in dict 0
            held = {e: files.pop((t, s, e), None) or load_torch_file(ranks[rank_dir(t, s, pp, e, ep)], trust)["model"]
                    for t, e in folded_expert_ranks(tp, ep)}
            dicts = [_expert_ranks_merged([held[e] for e in range(ep)], m.num_experts // ep,
                                          f"{step.name}/{rank_dir(0, s, pp, 0, ep)}")] + [held[t] for t in range(1, tp)]
        else:
            dicts = [_expert_ranks_merged([files.pop((t, s, e), None) or
                                           load_torch_file(ranks[rank_dir(t, s, pp, e, ep)], trust)["model"]
                                           for e in range(ep)], (m.num_experts or 1) // ep,
                                          f"{step.name}/{rank_dir(t, s, pp, 0, ep)}") for t in range(tp)]
        vdicts = None
        if vrows is not None:  # LLaVAModel: the language model's keys under language_model.
            parts = [vision.split(d) for d in dicts]
            _no_other_keys(parts[0][2], f"{step.name}/{rank_dir(0, s, pp, 0, ep)}")
            dicts, vdicts = [p[0] for p in parts], [p[1] for p in parts]
        layers = sorted({int(k.split(".")[2]) for k in dicts[0] if k.startswith("decoder.layers.")})
        if layers != list(range(len(layers))):
            raise CheckpointError(f"Megatron checkpoint stage {s}: layer numbers {layers} are not 0..n-1.")
        if offset + len(layers) > m.num_layers:
            raise CheckpointError(f"Megatron checkpoint holds more layers than args num_layers={m.num_layers}.")
        more = tp * ep - 1
        where = f"{step.name}/{rank_dir(0, s, pp, 0, ep)}" + (f" (and {more} more tensor or expert ranks)" if more else "")
        _fill_stage(dicts, where, rows, shapes, m, s == 0, s == pp - 1, layers, offset, vocab_padded, flat_params,
                    experts_whole=folded)
        if vdicts is not None:
            vision.fill(vdicts, where, vrows, shapes, m, flat_params)
        offset += len(layers)
        del dicts
    if offset != m.num_layers:
        raise CheckpointError(f"Megatron checkpoint holds {offset} layers, but args num_layers={m.num_layers}.")
    return model_overrides(m), unflatten(dict(sorted(flat_params.items())))


def _language_names(names) -> set[str]:
    """A checkpoint's tensor names, a vision-language model's language model's without `language_model.`."""
    return {n[len(vision.LANGUAGE):] if n.startswith(vision.LANGUAGE) else n for n in names}


def _no_other_keys(keys: list[str], where: str) -> None:
    """CheckpointError for a LLaVA checkpoint's keys of neither its language model nor its encoder."""
    if keys:
        raise CheckpointError(f"Megatron checkpoint {where} holds tensors of neither the language model "
                              f"({vision.LANGUAGE}*) nor the encoder ({vision.VISION}*, {vision.PROJECTION}*): "
                              f"{', '.join(sorted(keys)[:6])}{' ...' if len(keys) > 6 else ''}.")


class _DistStateDict(Mapping):
    """A torch_dist checkpoint's model tensors under their legacy TP-1 names, each read when asked for
    (one layer, one expert); SwiGLU's `_w` / `_v` halves as one [w; v] tensor, a Mamba mixer's in_proj
    and conv1d parts as one [z; x; B; C; dt] / [x; B; C] tensor."""

    def __init__(self, ckpt: DistCheckpoint, num_layers: int):
        self._ckpt, self._names = ckpt, layer_keys(ckpt, num_layers)
        joined = {name[:-2]: (name, name[:-1] + "v") for name in self._names
                  if name.endswith("_w") and name[:-1] + "v" in self._names}
        joined.update(hybrid.joined_parts(self._names))  # a Mamba mixer's in_proj and conv1d parts
        self._parts = {}  # where a joined tensor's parts are
        for name, parts in joined.items():
            self._parts.update({part: self._names.pop(part) for part in parts})
            self._names[name] = parts
        self._last = (None, None)

    def _layer(self, key: str, i: int | None) -> np.ndarray:
        if self._last[0] != (key, i):  # the experts of one layer come from one read
            self._last = ((key, i), self._ckpt.read(key, i))
        return self._last[1]

    def __getitem__(self, name: str):
        torch = _torch()
        where = self._names[name] if name in self._names else self._parts[name]
        if all(isinstance(w, str) for w in where):  # the halves of a SwiGLU linear_fc1, a Mamba in_proj's parts
            return torch.cat([self[h] for h in where])
        key, i, j = where
        x = self._layer(key, i)
        return torch.from_numpy(np.ascontiguousarray(x if j is None else x[j]))

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def _import_torch_dist(step: Path, trust: bool) -> tuple[dict, dict]:
    ckpt = DistCheckpoint(step)
    common = _torch_dist_common(step, ckpt, trust)
    try:
        m = resolved_model(_with_mtp_block(_overrides_from_args(common["args"]), _language_names(ckpt.keys())))
    except CheckpointError as e:
        where = step / COMMON_FILE if (step / COMMON_FILE).is_file() else step / METADATA
        raise CheckpointError(f"{str(where)!r}: {e}") from None
    shapes = tensor_shapes(m)
    rows = _megatron_rows(shapes, m)
    lm = ckpt
    if m.vision is not None:  # LLaVAModel: the language model's keys under language_model.
        from megajax.checkpoint.megatron_optimizer import PrefixedCheckpoint
        from megajax.checkpoint.torch_dist import NOT_MODEL
        _no_other_keys([k for k in ckpt.keys() if not k.startswith((vision.LANGUAGE, vision.VISION, vision.PROJECTION)
                                                                   + NOT_MODEL)], str(step))
        lm = PrefixedCheckpoint(ckpt, vision.LANGUAGE)
    embedding = "embedding.word_embeddings.weight"
    vocab_padded = lm.shape(embedding)[0] if embedding in lm.meta else m.vocab_size
    flat_params = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    state = _DistStateDict(lm, m.num_layers)
    _fill_stage([state], str(step), rows, shapes, m, True, True, list(range(m.num_layers)), 0, vocab_padded,
                flat_params)
    if m.vision is not None:
        encoder = {}
        for prefix, layers in ((vision.VISION, m.vision.num_layers), (vision.PROJECTION, 0)):
            part = _DistStateDict(PrefixedCheckpoint(ckpt, prefix), layers)
            encoder.update({prefix + k: part[k] for k in part})
        vision.fill([encoder], str(step), vision.vision_rows(shapes, m), shapes, m, flat_params)
    return model_overrides(m), unflatten(dict(sorted(flat_params.items())))


def import_megatron_adam(in_dir, *, trust: bool = False) -> dict | str:
    """The Adam state of a Megatron checkpoint in megajax's layout: {"mu", "nu": parameter trees,
    "count": the step count, "params": the fp32 main parameters or None}; or, when it has none megajax
    reads, a few words saying why (megatron_optimizer.py: the torch_dist keys read)."""
    from megajax.checkpoint.megatron_optimizer import FP32_PARAM, PREFIX, STATES, PrefixedCheckpoint, common_step
    d = Path(in_dir).expanduser()
    step = _step_dir(d) if d.is_dir() else d
    if not is_torch_dist(step):
        return "megajax reads optimizer state from torch_dist checkpoints, not legacy ones"
    ckpt = DistCheckpoint(step)
    keys = set(ckpt.keys())
    held = [s for s in (*STATES, FP32_PARAM) if any(k.startswith(f"{PREFIX}{s}.") for k in keys)]
    if not set(STATES) <= set(held):
        if any(k.startswith("optimizer.") for k in ckpt.meta):
            return (f"its optimizer state has no {PREFIX}exp_avg.* / exp_avg_sq.* tensors (a distributed "
                    f"optimizer's per-rank form, which megajax does not read)")
        return "the checkpoint holds none"
    common = _torch_dist_common(step, ckpt, trust)
    count = common_step(common)
    if count is None:
        return "its common state has no optimizer step (optimizer.state.common_step)"
    m = resolved_model(_with_mtp_block(_overrides_from_args(common["args"]), set(ckpt.keys())))
    if m.vision is not None:
        return "megajax reads the optimizer state of text models, not a vision-language model's"
    shapes = {k: v for k, v in tensor_shapes(m).items() if k != EXPERT_BIAS}  # a buffer: no Adam state
    rows = _megatron_rows(shapes, m)
    embedding = "embedding.word_embeddings.weight"
    vocab_padded = ckpt.shape(embedding)[0] if embedding in ckpt.meta else m.vocab_size
    out = {"count": count, "params": None}
    for what, name in zip((*STATES, FP32_PARAM), ("mu", "nu", "params")):
        if what not in held:
            continue
        flat = {n: np.zeros(shape, np.float32) for n, shape in shapes.items()}
        state = _DistStateDict(PrefixedCheckpoint(ckpt, f"{PREFIX}{what}."), m.num_layers)
        _fill_stage([state], f"{step} ({PREFIX}{what}.*)", rows, shapes, m, True, True, list(range(m.num_layers)),
                    0, vocab_padded, flat)
        out[name] = unflatten(dict(sorted(flat.items())))
    return out


def _torch_dist_common(step: Path, ckpt: DistCheckpoint, trust: bool) -> dict:
    common = read_common(step, ckpt, lambda f, name=None: load_torch_file(f, trust, name))
    if not isinstance(common.get("args"), argparse.Namespace):
        raise CheckpointError(f"{str(step)!r}: its common state holds no args Namespace (the architecture is "
                              f"read from the saved args).")
    return common


def _args(in_dir, trust: bool) -> tuple[Path, argparse.Namespace]:
    """(step directory, saved args) of a Megatron checkpoint of either format."""
    d = Path(in_dir).expanduser()
    if d.is_dir() and is_torch_dist(_step_dir(d)):
        step = _step_dir(d)
        return step, _torch_dist_common(step, DistCheckpoint(step), trust)["args"]
    step, _, first = _open(in_dir, trust)
    return step, first["args"]


def _rank_sizes(args, step: Path) -> tuple[int, int, int]:
    """(tensor, pipeline, expert) parallel sizes of a legacy checkpoint's args; CheckpointError for an expert
    tensor-parallel size other than the tensor one or 1 (MoE parallel folding, expert_model_parallel_size a
    multiple of the tensor size: folded_expert_ranks)."""
    tp, pp = int(_arg(args, "tensor_model_parallel_size", 1)), int(_arg(args, "pipeline_model_parallel_size", 1))
    ep = int(_arg(args, "expert_model_parallel_size", 1))
    etp = _expert_tensor_size(args, tp)
    if etp != tp and (etp != 1 or ep % tp):
        raise CheckpointError(f"{str(step)!r}: args say expert_tensor_parallel_size={etp} with "
                              f"tensor_model_parallel_size={tp} and expert_model_parallel_size={ep}; megajax reads "
                              f"legacy checkpoints whose experts are split like the dense layers "
                              f"(expert_tensor_parallel_size = tensor_model_parallel_size) or whole "
                              f"(expert_tensor_parallel_size 1, expert_model_parallel_size a multiple of "
                              f"tensor_model_parallel_size); save it as torch_dist (global tensors) instead.")
    return tp, pp, ep


def _expert_tensor_size(args, tp: int) -> int:
    return int(_arg(args, "expert_tensor_parallel_size", tp) or tp)


def _expert_ranks_merged(dicts: list[dict], local: int, where: str) -> dict:
    """One tensor rank's state dict of a stage from its expert ranks' files (expert rank e's local experts
    0..local-1 are experts e x local + j); the dense tensors, held by every file, come from the first."""
    if len(dicts) == 1:
        return dicts[0]
    out = {}
    for e, sd in enumerate(dicts):
        held = set()
        for key, x in sd.items():
            match = _LOCAL_EXPERT.match(key)
            if match:
                held.add(int(match.group(2)))
                out[f"{match.group(1)}{e * local + int(match.group(2))}{match.group(3)}"] = x
            elif e == 0:
                out[key] = x
        if held and held != set(range(local)):
            raise CheckpointError(f"Megatron checkpoint {where}: expert rank {e} holds local experts {sorted(held)}; "
                                  f"its args imply {local} per expert rank (0..{local - 1}).")
    return out


def _open(in_dir, trust: bool) -> tuple[Path, dict[str, Path], dict]:
    """(step directory, rank files by folder name, rank 0's loaded file) of a Megatron checkpoint; every
    rank file its args imply is there."""
    d = Path(in_dir).expanduser()
    if not d.is_dir():
        raise CheckpointError(f"{str(d)!r} is not a directory (expected a Megatron checkpoint directory).")
    step = _step_dir(d)
    ranks = {p.name: p / CHECKPOINT_FILE for p in step.iterdir() if p.is_dir() and _RANK_DIR.match(p.name)
             and (p / CHECKPOINT_FILE).is_file()}
    zero = next((n for n in sorted(ranks) if not any(int(g or 0) for g in _RANK_DIR.match(n).groups())), None)
    first = load_torch_file(ranks[zero], trust) if zero is not None else None
    if first is None or "args" not in first or "model" not in first:
        what = "no mp_rank_00 file" if first is None else f"no {'args' if 'args' not in first else 'model'} entry"
        raise CheckpointError(f"{str(step)!r} is not a Megatron checkpoint megajax can read ({what}; the "
                              f"architecture is read from the saved args).")
    tp, pp, ep = _rank_sizes(first["args"], step)
    pairs = (folded_expert_ranks(tp, ep) if _expert_tensor_size(first["args"], tp) != tp else
             [(t, e) for t in range(tp) for e in range(ep)])
    want = {rank_dir(t, s, pp, e, ep) for t, e in pairs for s in range(pp)}
    if set(ranks) != want:
        raise CheckpointError(f"{str(step)!r}: args say tensor_model_parallel_size={tp}, "
                              f"pipeline_model_parallel_size={pp}, expert_model_parallel_size={ep}, so its rank "
                              f"files are {sorted(want)}, but the rank files present are {sorted(ranks)}.")
    return step, ranks, first


def is_megatron_checkpoint(path) -> bool:
    """Whether `path` is a Megatron save directory (its tracker file) or one step's directory (legacy
    mp_rank_* folders, or torch_dist files)."""
    d = Path(path).expanduser()
    return d.is_dir() and ((d / TRACKER).is_file() or is_torch_dist(d) or
                           any(_RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir()))


def megatron_source(path, *, trust: bool = False):
    """A TensorSource over a Megatron checkpoint of either format (for `megajax export`): its
    parameters imported into memory (float32), then handed out tensor by tensor."""
    from megajax.checkpoint.source import DictSource
    overrides, params = import_megatron(path, trust=trust)
    return DictSource(params, resolved_model(overrides))


def megatron_dtype(in_dir, *, trust: bool = False) -> str:
    """The export dtype of a Megatron checkpoint's own training precision (its args' --bf16 / --fp16,
    else fp32): what `megajax export` of it stores by default."""
    _, args = _args(in_dir, trust)
    return "bf16" if _arg(args, "bf16", False) else "fp16" if _arg(args, "fp16", False) else "fp32"


def megatron_tokenizer(in_dir, *, trust: bool = False) -> tuple[str | None, str]:
    """(data.tokenizer for a Megatron checkpoint's tokenizer, or None; what its args say of it): the
    HuggingFaceTokenizer folder `tokenizer/` beside the iterations (export_megatron's) or at tokenizer_model;
    for a NullTokenizer run (pre-tokenised data) with no such folder, data/no_tokenizer.py's value."""
    step, args = _args(in_dir, trust)
    said = {k: _arg(args, k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
    places = [step.parent / TOKENIZER_DIR] if said["tokenizer_type"] in (None, "HuggingFaceTokenizer") else []
    if said["tokenizer_type"] == "HuggingFaceTokenizer" and said["tokenizer_model"]:
        places.append(Path(str(said["tokenizer_model"])))
    found = next((spec for spec in map(tokenizer_dir_spec, places) if spec is not None), None)
    known = "Megatron args " + (", ".join(f"{k}={v!r}" for k, v in said.items() if v) or "no tokenizer_type")
    if found is None and said["tokenizer_type"] == NULL_TOKENIZER:  # pre-tokenised data: there is no tokenizer
        found = no_tokenizer(known, null_tokenizer_eod(args))
    return found, known


def megatron_config(in_dir, *, trust: bool = False) -> tuple[dict, str | None]:
    """(the model's `model.*` values from a Megatron checkpoint's saved args, the tokenizer they name or
    None: a run then keeps the checkpoint's vocabulary with the data.tokenizer it sets), what
    `checkpoint.load` of a Megatron checkpoint takes as the run's model. No tensor is read."""
    step, args = _args(in_dir, trust)
    try:
        m = resolved_model(_overrides_from_args(args))
    except CheckpointError as e:
        raise CheckpointError(f"{str(step)!r}: {e}") from None
    from megajax.data.tokenizer import ByteTokenizer
    found, _ = megatron_tokenizer(in_dir, trust=trust)
    if found is None and m.vocab_size == ByteTokenizer.vocab_size:  # as `megajax import` records it
        found = "byte"
    return model_overrides(m), found
