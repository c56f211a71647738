"""What the exporters and importers share: the checks of a source against its model's layout
(megajax/models/layout.py), the architecture as config overrides, output dtypes, the
tokenizer an export carries, and crash-safe output directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Iterator


from megajax.config import ModelConfig, VisionConfig, _build, validate_model_sizes
from megajax.data.no_tokenizer import is_no_tokenizer
from megajax.errors import CheckpointError, ConfigError
from megajax.models.layout import tensor_shapes

# ModelConfig fields that describe the architecture (what an importer hands back).
ARCH_FIELDS = (
    "family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "ffn_hidden_size",
    "vocab_size", "max_position_embeddings", "norm", "activation", "position_embedding", "use_bias",
    "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position",
    "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",  # yarn only
    "hidden_dropout", "attention_dropout", "init_std",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size",  # mixture of experts only
    "moe_shared_expert_ffn_size",  # only when > 0
    "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_bias_update_rate",
    "moe_layer_freq", "moe_shared_expert_gate", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_pre_softmax",
)
YARN_FIELDS = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim")
MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_ffn_size",
              "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_bias_update_rate",
              "moe_layer_freq", "moe_shared_expert_gate", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_pre_softmax")
# A hybrid's fields (only when model.hybrid_layer_pattern is set).
HYBRID_FIELDS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
                 "mamba_chunk_size", "mamba_conv_kernel", "mamba_time_step_min", "mamba_time_step_max",
                 "mamba_dt_min", "mamba_dt_max")
# Multi-latent attention's fields (only when model.multi_latent_attention).
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim")


REQUIRED = object()  # a config field an importer cannot do without


def read_fields(get, table: tuple, where: str) -> dict:
    """ModelConfig fields from an external config: for each (key, field, default) of `table`, `get(key)`
    (None: absent, the default applies; REQUIRED: an error naming `where`); a bool or float default
    gives the value its type."""
    out = {}
    for key, field, default in table:
        value = get(key)
        if value is None and default is REQUIRED:
            raise CheckpointError(f"{where} has no {key!r}.")
        value = default if value is None else value
        out[field] = type(default)(value) if isinstance(default, (bool, float)) else value
    return out


def check_source(source) -> int:
    """Checks that `source` holds exactly the parameters (and expert bias) its model config implies;
    returns its padded vocab.

    Raises CheckpointError naming missing or unknown tensors, or the first shape that differs.
    """
    m = source.model
    names = set(source.names())
    if "embed/embedding" not in names:
        raise CheckpointError("the checkpoint has no tensor 'embed/embedding' (the token embedding); "
                              f"it holds: {', '.join(sorted(names)) or 'nothing'}.")
    padded = source.shape("embed/embedding")[0]
    if padded < m.vocab_size:
        raise CheckpointError(f"embed/embedding has {padded} rows, fewer than model.vocab_size="
                              f"{m.vocab_size}.")
    want = tensor_shapes(m, padded)
    parts = [f"{what} {', '.join(sorted(x))}" for what, x in (("missing tensors", set(want) - names),
                                                             ("tensors the exporter does not know", names - set(want))) if x]
    if parts:
        raise CheckpointError(f"the checkpoint does not match its model config (family={m.family}, "
                              f"norm={m.norm}, activation={m.activation}, position_embedding="
                              f"{m.position_embedding}, use_bias={m.use_bias}, tie_embeddings="
                              f"{m.tie_embeddings}): {'; '.join(parts)}.")
    for name, shape in want.items():
        got = tuple(source.shape(name))
        if got != shape:
            raise CheckpointError(f"tensor {name} has shape {list(got)}, but the model config implies "
                                  f"{list(shape)} (num_layers={m.num_layers}, hidden_size={m.hidden_size}, "
                                  f"num_heads={m.num_heads}, num_kv_heads={m.num_kv_heads}, head_dim="
                                  f"{m.head_dim}, ffn_hidden_size={m.ffn_hidden_size}).")
    return padded


def model_overrides(m: ModelConfig) -> dict:
    """The architecture fields of a resolved ModelConfig, as `model.<field>` values."""
    out = {k: getattr(m, k) for k in ARCH_FIELDS}
    if m.rope_scaling == "none" or m.position_embedding != "rope":
        for k in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_original_max_position"):
            out.pop(k)
    if m.rope_scaling != "yarn" or m.position_embedding != "rope":
        for k in YARN_FIELDS:
            out.pop(k)
    else:
        for k in ("rope_low_freq_factor", "rope_high_freq_factor"):
            out.pop(k)
    if not m.num_experts:
        for k in MOE_FIELDS:
            out.pop(k)
    elif not m.moe_shared_expert_ffn_size:
        out.pop("moe_shared_expert_ffn_size")
        out.pop("moe_shared_expert_gate")
    if m.multi_latent_attention:
        out.update({k: getattr(m, k) for k in MLA_FIELDS})
    if m.hybrid_layer_pattern:
        out.update({k: getattr(m, k) for k in HYBRID_FIELDS})
    if m.vision is not None:  # a vision-language model's encoder and projector (all but `freeze`, a training choice)
        out["vision"] = {k: v for k, v in dataclasses.asdict(m.vision).items() if k != "freeze"}
    if m.mtp_num_layers:  # multi-token prediction's depths (Megatron's and DeepSeek-V3's checkpoints hold them)
        out.update(mtp_num_layers=m.mtp_num_layers, mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
                   mtp_block=m.mtp_block)
    return out


def resolved_model(overrides: dict, source: str | None = None) -> ModelConfig:
    """ModelConfig from importer overrides (model.vision a VisionConfig or, as model_overrides gives it,
    a dict of its fields), resolved (without a train config) and checked as a config file's model is:
    each value of its type, the sizes > 0 (a CheckpointError naming the model.* key, and `source`, the file the
    values came from, when given)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    overrides = {k: v for k, v in overrides.items() if k in fields}
    if isinstance(overrides.get("vision"), VisionConfig):
        overrides["vision"] = dataclasses.asdict(overrides["vision"])
    try:
        m = _build(ModelConfig, overrides, "model")
        m.resolve(seq_len=m.max_position_embeddings or 1)
        validate_model_sizes(m)
    except ConfigError as e:
        raise CheckpointError(f"{source} describes a model megajax cannot build: {e}" if source else str(e)) from None
    return m


def check_tokenizer(spec: str, m: ModelConfig):
    """The tokenizer `spec` names, loaded; CheckpointError if it is missing or has more ids than the model."""
    from megajax.data.tokenizer import load_tokenizer
    try:
        tok = load_tokenizer(spec, key="tokenizer")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if tok.vocab_size > m.vocab_size:
        raise CheckpointError(f"tokenizer {spec!r} has {tok.vocab_size} ids, more than the model's "
                              f"vocab_size={m.vocab_size}; export with the tokenizer the model was trained with.")
    return tok


def tokenizer_dir_spec(d: Path) -> str | None:
    """The data.tokenizer value for a Hugging Face tokenizer folder (or tokenizer.json) `d`: 'byte' for
    an exported byte tokenizer without a chat template, else its absolute path (a byte tokenizer with a
    chat template stays a folder, so that the template goes with it); None if it holds no tokenizer.json."""
    from megajax.data.chat_template import folder_chat_template
    from megajax.data.tokenizer import is_byte_tokenizer_file
    d = Path(d).expanduser()
    file = d / "tokenizer.json" if d.is_dir() else d
    if not file.is_file():
        return None
    byte = (is_byte_tokenizer_file(file) or _byte_with_image_token(file)) and folder_chat_template(file.parent) is None
    return "byte" if byte else str(d.absolute())


def _byte_with_image_token(file: Path) -> bool:
    """Whether a tokenizer.json is the exported byte tokenizer with a LLaVA export's `<image>` added after its
    257 ids (hf_processor.py): the byte tokenizer, whose ids a vision-language model's placeholder follows."""
    import json
    from megajax.data.tokenizer import byte_tokenizer_json
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or not isinstance(data.get("added_tokens"), list):
        return False
    extra = [t for t in data["added_tokens"] if isinstance(t, dict) and t.get("content") == "<image>"]
    if len(extra) != 1 or extra[0].get("id") != 257:
        return False
    data["added_tokens"] = [t for t in data["added_tokens"] if t is not extra[0]]
    return data == json.loads(byte_tokenizer_json())


def imported_tokenizer(found: str | None, vocab_size: int, known: str) -> tuple[str, str | None]:
    """(data.tokenizer to record for an imported model, a warning or None), from the tokenizer the import
    `found` and what its source says (`known`). Without one, only a 257-id vocabulary is called 'byte';
    any other is recorded as unknown (its export then asks for --tokenizer). A model trained without a
    tokenizer (`found` is data/no_tokenizer.py's value) keeps that."""
    from megajax.data.tokenizer import ByteTokenizer
    if is_no_tokenizer(found):
        return found, (f"the imported model was trained without a tokenizer ({known}: pre-tokenised data), so "
                       f"none is recorded; pass data.tokenizer=PATH when fine-tuning on text; `megajax export` "
                       f"writes it without one, and --tokenizer PATH adds one.")
    if found is not None or vocab_size == ByteTokenizer.vocab_size:
        return found or "byte", None
    return f"unknown ({known})", (
        f"the imported model names no tokenizer megajax can read ({known}) and its vocabulary has "
        f"{vocab_size} ids, so it is not the byte tokenizer's; pass data.tokenizer=PATH (the tokenizer.json "
        f"it was trained with, or its directory) when fine-tuning, and --tokenizer PATH when exporting it.")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary directory beside `out_dir` that becomes `out_dir` only on success.

    A crash never leaves a half-written export under the final name. `out_dir`
    may exist only if it is empty.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output directory {str(out)!r} already exists and is not empty; "
                              f"choose a new directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
