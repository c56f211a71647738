"""A PEFT LoRA adapter directory read and checked, before anything is matched to a model.

    read_peft_config(DIR) -> PeftConfig      adapter_config.json: every field megajax acts on, checked
    read_peft_tensors(DIR) -> {name: array}  adapter_model.safetensors: 2-D floating tensors, finite

Each refusal is one CheckpointError naming the file, the field or tensor, its value and what is
accepted. A setting that changes what the adapter computes and megajax does not reproduce (DoRA,
trained biases, modules_to_save, per-module rank or alpha patterns, an initialisation that rewrote
the base weights, ...) is refused rather than dropped: the adapter would not compute what it was
trained to. rsLoRA (scale alpha / sqrt(r)) is read as the plain LoRA with the same scale.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megajax.data.text_files import parse_json
from megajax.errors import CheckpointError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 24  # an adapter_config.json is a few KiB; a bigger file is not one
TENSOR_NAME = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

# Fields that describe the adapter without changing what it computes (or only act through a field
# checked below: the init configs through init_lora_weights, qalora_group_size through use_qalora).
METADATA = frozenset({"base_model_name_or_path", "revision", "task_type", "inference_mode", "peft_version",
                      "auto_mapping", "megatron_core", "qalora_group_size", "loftq_config", "eva_config",
                      "corda_config", "lora_ga_config", "ensure_weight_tying"})
READ = frozenset({"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "bias",
                  "use_rslora", "layers_to_transform", "layers_pattern", "init_lora_weights", "rank_pattern",
                  "alpha_pattern"})
# init_lora_weights values that leave the base weights as they are (the others, PiSSA, OLoRA, CorDA,
# LoftQ, LoRA-GA, rewrite them: such an adapter belongs to the rewritten base, not to the model named).
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
WHY = {  # what a refused feature does, for the message
    "use_dora": "DoRA rescales each adapted weight by a trained magnitude vector",
    "modules_to_save": "whole modules trained beside the adapters replace the base's",
    "fan_in_fan_out": "the base layers store their weights transposed (GPT-2's Conv1D)",
    "lora_bias": "the adapters' B carries a trained bias",
    "use_qalora": "QA-LoRA pools the inputs of quantized layers",
    "target_parameters": "adapters of bare parameters (a mixture of experts' stacked weights)",
    "trainable_token_indices": "trained rows of the embedding",
    "layer_replication": "layers of the base are repeated",
    "alora_invocation_tokens": "activated LoRA switches the adapters on after given tokens",
    "arrow_config": "Arrow routes among several adapters",
    "megatron_config": "the base layers are Megatron's parallel linears",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
}


@dataclass
class PeftConfig:
    """What megajax acts on in an adapter_config.json (checked)."""
    file: Path
    r: int
    lora_alpha: float
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    dropout: float
    target_modules: str | list[str]  # a regular expression (re.fullmatch) or names (a module or its last parts)
    exclude_modules: str | list[str] | None
    layers_to_transform: list[int] | None
    base: str  # base_model_name_or_path ('' when unset)

    @staticmethod
    def _matches(spec, module: str) -> bool:
        if isinstance(spec, str):
            return re.fullmatch(spec, module) is not None
        return any(module == t or module.endswith("." + t) for t in spec)

    def targets(self, module: str) -> bool:
        """Whether PEFT puts an adapter on `module` (a Hugging Face module name, `model.layers.0.mlp.up_proj`)."""
        if self.exclude_modules and self._matches(self.exclude_modules, module):
            return False
        return self.target_modules == "all-linear" or self._matches(self.target_modules, module)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _empty(x) -> bool:
    return x is None or x is False or x == {} or x == [] or x == ""


def _names(value, key: str, file: Path, required: bool):
    """target_modules / exclude_modules: a regular expression, or a list of module names."""
    if value is None and not required:
        return None
    if isinstance(value, str) and value:
        try:
            re.compile(value)
        except re.error as e:
            raise CheckpointError(f"{file}: {key} = {value!r} is not a regular expression ({e}); PEFT matches a "
                                  f"string against each module's whole name.") from None
        return value
    if isinstance(value, list) and value and all(isinstance(t, str) and t for t in value):
        return list(value)
    raise CheckpointError(f"{file}: {key} = {json.dumps(value)}: expected a non-empty list of module names "
                          f"(\"q_proj\", \"v_proj\", ...) or a regular expression string"
                          f"{'' if required else ', or null'}.")


def read_peft_config(in_dir) -> PeftConfig:
    """adapter_config.json of a PEFT LoRA adapter directory, checked (module docstring)."""
    d = Path(in_dir)
    file = d / PEFT_CONFIG
    if not file.is_file():
        raise CheckpointError(f"{d}: not a PEFT adapter directory (no {PEFT_CONFIG}).")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{file}: {file.stat().st_size:,} bytes, not a PEFT adapter config (a few KiB of "
                              f"JSON).")
    try:
        c = parse_json(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text ({e}); expected PEFT's JSON object.") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: not JSON ({e}); expected PEFT's JSON object (peft_type, r, lora_alpha, "
                              f"target_modules, ...).") from None
    if not isinstance(c, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(c).__name__}, not an object; expected PEFT's "
                              f"LoraConfig fields (peft_type, r, lora_alpha, target_modules, ...).")
    if c.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type = {json.dumps(c.get('peft_type'))}; megajax reads LoRA adapters "
                              f"(peft_type \"LORA\").")
    r = c.get("r")
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        raise CheckpointError(f"{file}: r = {json.dumps(r)}: the adapters' rank must be a whole number >= 1.")
    alpha = c.get("lora_alpha")
    if not _is_number(alpha) or alpha <= 0:
        raise CheckpointError(f"{file}: lora_alpha = {json.dumps(alpha)}: must be a number > 0 (the adapters "
                              f"scale by lora_alpha / r).")
    dropout = c.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise CheckpointError(f"{file}: lora_dropout = {json.dumps(dropout)}: must be a number in [0, 1).")
    targets = _names(c.get("target_modules"), "target_modules", file, required=True)
    exclude = _names(c.get("exclude_modules"), "exclude_modules", file, required=False)
    rslora = c.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise CheckpointError(f"{file}: use_rslora = {json.dumps(rslora)}: must be true or false.")
    layers = c.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise CheckpointError(f"{file}: layers_to_transform = {json.dumps(layers)}: expected a layer index, a list "
                              f"of them, or null.")
    if layers is not None and isinstance(targets, str):
        raise CheckpointError(f"{file}: layers_to_transform = {json.dumps(layers)} with target_modules a regular "
                              f"expression ({targets!r}): PEFT refuses the pair (name the modules in a list).")
    refused = []
    if c.get("bias", "none") != "none":
        refused.append(f"bias = {json.dumps(c['bias'])} (trained biases of the adapted layers; megajax's adapters "
                       f"have none)")
    init = c.get("init_lora_weights", True)
    if not any(init is v or (isinstance(v, str) and init == v) for v in PLAIN_INITS):
        refused.append(f"init_lora_weights = {json.dumps(init)} (an initialisation that rewrites the base weights, "
                       f"or one megajax does not know: the adapter belongs to the rewritten base; PEFT converts "
                       f"such an adapter to a plain one with path_initial_model_for_weight_conversion)")
    for key, value in c.items():
        if key in METADATA or key in READ and key not in WHY or _empty(value):
            continue
        refused.append(f"{key} = {json.dumps(value)[:80]} ({WHY.get(key, 'a setting megajax does not know')})")
    if refused:
        raise CheckpointError(f"{file}: megajax reads plain LoRA adapters (W + lora_alpha / r A B on linear layers, "
                              f"or rsLoRA's lora_alpha / sqrt(r)); this one has {'; '.join(refused)}, which would "
                              f"change what the model computes if dropped.")
    base = c.get("base_model_name_or_path") or ""
    return PeftConfig(file=file, r=r, lora_alpha=float(alpha), scale=alpha / (math.sqrt(r) if rslora else r),
                      dropout=float(dropout), target_modules=targets, exclude_modules=exclude,
                      layers_to_transform=layers, base=base if isinstance(base, str) else "")


def read_peft_tensors(in_dir) -> dict[str, np.ndarray]:
    """{tensor name: float32 array} of adapter_model.safetensors, checked: a safetensors file of 2-D
    floating-point tensors with finite values."""
    import ml_dtypes  # noqa: F401  (numpy learns bfloat16, which PEFT saves bf16 adapters in)
    from safetensors import SafetensorError, safe_open
    d = Path(in_dir)
    file = d / PEFT_WEIGHTS
    if not file.is_file():
        pickled = [p.name for p in d.glob("adapter_model*.bin")]
        hint = (f"; it holds {', '.join(pickled)} (a pickle, not read: re-save the adapter with "
                f"save_pretrained(..., safe_serialization=True))" if pickled else "")
        raise CheckpointError(f"{d}: a PEFT adapter directory without {PEFT_WEIGHTS}{hint}.")
    if file.stat().st_size == 0:
        raise CheckpointError(f"{file}: empty (0 bytes); expected the adapter's tensors in safetensors format.")
    out = {}
    try:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                view = f.get_slice(name)
                dtype, shape = view.get_dtype(), tuple(view.get_shape())
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; an adapter's tensors are "
                                          f"floating point ({', '.join(FLOAT_DTYPES)}).")
                if len(shape) != 2 or 0 in shape:
                    raise CheckpointError(f"{file}: tensor {name} has shape {list(shape)}; a LoRA tensor is a "
                                          f"matrix, lora_A [r, in] or lora_B [out, r].")
                x = np.asarray(f.get_tensor(name), np.float32)
                if not np.isfinite(x).all():
                    raise CheckpointError(f"{file}: tensor {name} holds {int((~np.isfinite(x)).sum())} values "
                                          f"that are NaN or infinite.")
                out[name] = x
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}).") from None
    if not out:
        raise CheckpointError(f"{file}: holds no tensors; expected the adapters' lora_A and lora_B weights.")
    return out
