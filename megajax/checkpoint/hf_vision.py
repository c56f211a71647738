"""Vision-language models in Hugging Face's layout: LlavaForConditionalGeneration with a SigLIP
(`siglip_vision_model`) or CLIP (`clip_vision_model`) vision tower.

The language model's tensors are its own architecture's (hf.py's tables) under `language_model.`
(`language_model.model.layers.N...`, `language_model.lm_head.weight`), the names transformers writes;
the tower's and the projector's:

    vision_tower.embeddings.patch_embedding.weight [Dv, 3, p, p]   vision/patch_embed/kernel [p, p, 3, Dv]
    vision_tower.embeddings.class_embedding        [Dv]            vision/class_embedding (CLIP)
    vision_tower.embeddings.position_embedding.weight              vision/pos_embed
    vision_tower.pre_layrnorm.weight|bias                          vision/pre_norm (CLIP)
    vision_tower.encoder.layers.N.layer_norm1|2, self_attn.q|k|v|out_proj, mlp.fc1|fc2
    vision_tower.post_layernorm.weight|bias                        vision/post_norm
    multi_modal_projector.linear_1|linear_2.weight|bias            projector/fc1|fc2

On import the names of transformers' state dict (`model.vision_tower...`, `model.language_model...`)
and of older LLaVA checkpoints (`vision_tower.vision_model...`) are read too. A SigLIP tower's pooling
head (vision_use_head), which LLaVA never runs, is not kept.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from megajax.checkpoint.mapping import Row
from megajax.config import ModelConfig, VisionConfig
from megajax.errors import CheckpointError

LLAVA = "LlavaForConditionalGeneration"
_TOWER = {"siglip": "siglip_vision_model", "clip": "clip_vision_model"}
_ACT = {"gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu", "gelu": "gelu"}
_ACT_BACK = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "quick_gelu": "quick_gelu", "gelu": "gelu"}


def language_row(row: Row) -> Row:
    """A language model's row under LLaVA's `language_model.` (its `model.` stays: `language_model.model.`)."""
    options = {f.name: getattr(row, f.name) for f in dataclasses.fields(Row) if f.name not in ("name", "parts")}
    options["aliases"] = tuple(f"language_model.{a}" for a in row.aliases)
    return Row(f"language_model.{row.name}", *row.parts, **options)


def language_shapes(shapes: dict) -> dict:
    """The language model's part of a layout (no vision/, projector/)."""
    return {k: v for k, v in shapes.items() if not k.startswith(("vision/", "projector/"))}


def vision_entries(m: ModelConfig) -> list[tuple[str, str, int | None, str]]:
    """(Hugging Face name, megajax path, layer of the stacked path or None, kind) of every tower and
    projector tensor; kind: same, linear (ours [in..., out...], theirs [out, in]), patch (a conv)."""
    v = m.vision
    t = "vision_tower"
    out = [(f"{t}.embeddings.patch_embedding.weight", "vision/patch_embed/kernel", None, "patch"),
           (f"{t}.embeddings.position_embedding.weight", "vision/pos_embed", None, "same")]
    if not v.class_token:  # SigLIP's patch embedding has a bias, CLIP's not
        out.append((f"{t}.embeddings.patch_embedding.bias", "vision/patch_embed/bias", None, "same"))
    if v.class_token:
        out += [(f"{t}.embeddings.class_embedding", "vision/class_embedding", None, "same"),
                (f"{t}.pre_layrnorm.weight", "vision/pre_norm/scale", None, "same"),
                (f"{t}.pre_layrnorm.bias", "vision/pre_norm/bias", None, "same")]
    for i in range(v.num_layers):
        layer = f"{t}.encoder.layers.{i}"
        for theirs, ours in (("layer_norm1", "ln1"), ("layer_norm2", "ln2")):
            out += [(f"{layer}.{theirs}.weight", f"vision/layers/{ours}/scale", i, "same"),
                    (f"{layer}.{theirs}.bias", f"vision/layers/{ours}/bias", i, "same")]
        for theirs, ours in (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
                             ("self_attn.out_proj", "o"), ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
            out += [(f"{layer}.{theirs}.weight", f"vision/layers/{ours}/kernel", i, "linear"),
                    (f"{layer}.{theirs}.bias", f"vision/layers/{ours}/bias", i, "same")]
    out += [(f"{t}.post_layernorm.weight", "vision/post_norm/scale", None, "same"),
            (f"{t}.post_layernorm.bias", "vision/post_norm/bias", None, "same")]
    for k in (1, 2) if v.projector == "mlp" else (1,):
        out += [(f"multi_modal_projector.linear_{k}.weight", f"projector/fc{k}/kernel", None, "linear"),
                (f"multi_modal_projector.linear_{k}.bias", f"projector/fc{k}/bias", None, "same")]
    return out


def _n_in(path: str) -> int:
    return 2 if path.endswith("/o/kernel") else 1


def to_hf(kind: str, path: str, x: np.ndarray) -> np.ndarray:
    if kind == "patch":  # [p, p, 3, Dv] -> [Dv, 3, p, p]
        return np.transpose(x, (3, 2, 0, 1))
    if kind == "linear":
        n = _n_in(path)
        return x.reshape(math.prod(x.shape[:n]), -1).T
    return x.reshape(-1) if x.ndim > 1 and path.endswith("/bias") else x


def from_hf(kind: str, y: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "patch":
        return np.transpose(y, (2, 3, 1, 0)).reshape(shape)
    if kind == "linear":
        return y.T.reshape(shape)
    return y.reshape(shape)


def hf_shape(kind: str, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of one layer `shape` of a megajax tensor."""
    if kind == "patch":
        return (shape[3], shape[2], shape[0], shape[1])
    if kind == "linear":
        n = _n_in(path)
        return (math.prod(shape[n:]), math.prod(shape[:n]))
    return (math.prod(shape),) if path.endswith("/bias") else tuple(shape)


def check_exportable(m: ModelConfig) -> None:
    v = m.vision
    if v.projector != "mlp":
        raise CheckpointError(f"model.vision.projector={v.projector}: Hugging Face's LLaVA projector is an MLP "
                              f"(linear_1, GELU, linear_2); accepted: mlp. A Megatron export keeps the affine one.")
    if v.pixel_shuffle:
        raise CheckpointError("model.vision.pixel_shuffle=true: Hugging Face's LLaVA feeds every patch feature to "
                              "its projector and has no pixel shuffle (accepted: false); a Megatron export "
                              "(--format megatron) keeps it.")
    if v.tiled:
        raise CheckpointError(f"model.vision.max_num_tiles={v.max_num_tiles}: Hugging Face's LLaVA takes one "
                              f"picture per image and has no tiles (accepted: 1, untiled); a Megatron export "
                              f"(--format megatron) keeps the tiling (use_tiling, max_num_tiles, use_thumbnail, "
                              f"use_tile_tags).")


def llava_config(m: ModelConfig, text_config: dict, dtype: str) -> dict:
    """config.json of LlavaForConditionalGeneration around the language model's config.json."""
    v = m.vision
    text = {k: val for k, val in text_config.items() if k not in ("architectures", "torch_dtype")}
    vision = dict(model_type=_TOWER[v.form], hidden_size=v.hidden_size, intermediate_size=v.ffn_hidden_size,
                  num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads, num_channels=3,
                  image_size=v.image_size, patch_size=v.patch_size, hidden_act=_ACT[v.activation],
                  layer_norm_eps=v.norm_eps, attention_dropout=0.0)
    if v.form == "siglip":
        vision["vision_use_head"] = False
    return dict(architectures=[LLAVA], model_type="llava", image_token_index=v.image_token_id,
                image_token_id=v.image_token_id, image_seq_length=v.image_seq_length, projector_hidden_act="gelu",
                vision_feature_select_strategy=v.feature_select, vision_feature_layer=v.feature_layer,
                multimodal_projector_bias=True, tie_word_embeddings=m.tie_embeddings, dtype=dtype,
                torch_dtype=dtype, text_config=text, vision_config=vision)


def vision_overrides(c: dict) -> dict:
    """model.vision from a LLaVA config.json (CheckpointError for what megajax cannot build)."""
    vc = c.get("vision_config") or {}
    kind = vc.get("model_type")
    form = {"siglip_vision_model": "siglip", "clip_vision_model": "clip"}.get(kind)
    if form is None:
        raise CheckpointError(f"config.json vision_config.model_type={kind!r}: megajax reads the "
                              f"siglip_vision_model and clip_vision_model towers.")
    act = vc.get("hidden_act", "gelu_pytorch_tanh" if form == "siglip" else "quick_gelu")
    layer = c.get("vision_feature_layer", -2)
    problems = []
    if act not in _ACT_BACK:
        problems.append(f"vision_config.hidden_act={act!r} (accepted: {', '.join(_ACT_BACK)})")
    if not isinstance(layer, int):
        problems.append(f"vision_feature_layer={layer} (one layer; accepted: an integer)")
    if c.get("projector_hidden_act", "gelu") != "gelu":
        problems.append(f"projector_hidden_act={c['projector_hidden_act']!r} (accepted: gelu)")
    if c.get("multimodal_projector_bias", True) is not True:
        problems.append("multimodal_projector_bias=false (accepted: true)")
    if vc.get("num_channels", 3) != 3:
        problems.append(f"vision_config.num_channels={vc['num_channels']} (accepted: 3)")
    if problems:
        raise CheckpointError("the Hugging Face LLaVA checkpoint has " + "; ".join(problems) + ".")
    defaults = {"siglip": (768, 3072, 12, 12, 224, 16, 1e-6), "clip": (768, 3072, 12, 12, 224, 32, 1e-5)}[form]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
            "patch_size", "layer_norm_eps")
    h, f, n, heads, size, patch, eps = (vc.get(k, d) for k, d in zip(keys, defaults))
    return dict(form=form, image_size=size, patch_size=patch, hidden_size=h, num_layers=n, num_heads=heads,
                ffn_hidden_size=f, activation=_ACT_BACK[act], norm_eps=float(eps), projector="mlp",
                image_token_id=c.get("image_token_id", c.get("image_token_index", 32000)), feature_layer=layer,
                feature_select=c.get("vision_feature_select_strategy", "default"))


def hf_names(name: str) -> tuple[str, ...]:
    """The names a tensor may have in a LLaVA checkpoint: as written, in transformers' state dict, in older
    checkpoints (`vision_tower.vision_model.`, `language_model.lm_head` as `lm_head`)."""
    out = [name, f"model.{name}"]
    if name.startswith("vision_tower."):
        out.append(name.replace("vision_tower.", "vision_tower.vision_model.", 1))
    if name.startswith("language_model.model."):
        out.append(name.replace("language_model.model.", "model.language_model.", 1))
    if name == "language_model.lm_head.weight":
        out.append("lm_head.weight")
    return tuple(out)


def ignored(name: str) -> bool:
    """A LLaVA checkpoint's tensors LLaVA does not use: a SigLIP tower's pooling head."""
    return ".head." in name and "vision_tower" in name


def vision_config_of(overrides: dict) -> VisionConfig:
    v = VisionConfig(**overrides)
    v.resolve()
    return v
