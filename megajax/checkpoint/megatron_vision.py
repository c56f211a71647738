"""Vision-language models in Megatron's checkpoint formats: Megatron-Core's LLaVAModel
(megatron/core/models/multimodal/llava_model.py) with a CLIPViTModel encoder
(megatron/core/models/vision/clip_vit_model.py, model_subtype clip or siglip) and a
MultimodalProjector (megatron/core/models/vision/multimodal_projector.py).

The language model's tensors are the GPT model's (megatron.py's table) under `language_model.`; the
encoder's and the projector's (Dv the encoder's width, P its patches, D the language model's
width):

    vision_model.conv1.weight                     [Dv, 3, p, p]   vision/patch_embed/kernel (.bias: SigLIP)
    vision_model.class_token                      [1, 1, Dv]      vision/class_embedding (CLIP)
    vision_model.position_embeddings.weight       [P (+1), Dv]    vision/pos_embed
    vision_model.ln_pre.weight|bias               [Dv]            vision/pre_norm (CLIP)
    vision_model.decoder.layers.{i}.
        input_layernorm.weight|bias               [Dv]            ln1 (torch_dist: linear_qkv.layer_norm_*)
        self_attention.linear_qkv.weight|bias     [3 Dv, Dv]      q, k, v per head: [q_h; k_h; v_h] (column-parallel)
        self_attention.linear_proj.weight|bias    [Dv, Dv]        o (row-parallel)
        pre_mlp_layernorm.weight|bias             [Dv]            ln2 (torch_dist: linear_fc1.layer_norm_*)
        mlp.linear_fc1.weight|bias, mlp.linear_fc2.weight|bias    fc1 (column-), fc2 (row-parallel)
    vision_model.ln_post.weight|bias              [Dv]            vision/post_norm (SigLIP)
    vision_projection.encoder.linear_fc1|linear_fc2.weight|bias   projector/fc1|fc2 (mlp; column-, row-parallel)
    vision_projection.encoder.weight|bias         [D, Dv]         projector/fc1 (affine: one column-parallel linear)

Under model.vision.pixel_shuffle (Megatron-LM's --pixel-shuffle, written to the args as pixel_shuffle)
the projector's first linear takes 4 Dv inputs ([.., 4 Dv]), as Megatron-LM's LLaVA builds it.

A legacy checkpoint names the layer norms as the local layer spec builds them (Megatron-LM's multimodal
example's ViT spec without Transformer Engine); torch_dist as Transformer Engine's spec does (the norms
fused into linear_qkv and linear_fc1, megatron-core's get_vit_layer_with_transformer_engine_spec); either
name is read on import. The qkv rows are grouped per head exactly as the language model's per query
group (`groups="vision_heads"`), so a tensor rank holds its heads' q, k and v.

Megatron-Core's CLIP-form encoder has no post-layernorm (CLIPViTModel builds ln_post for SigLIP only):
megajax's CLIP `vision/post_norm`, which LLaVA's features never use (only the pooled class token does),
is not written, and is the identity (scale 1, bias 0) on import. Megatron-Core's LLaVAModel runs every
encoder layer its config holds and, for SigLIP, ln_post after them; megajax takes the features of layer
model.vision.feature_layer without ln_post. The checkpoint holds every layer (a lossless round trip);
Megatron-LM computes megajax's CLIP features with its vision num_layers cut to the feature layer's, but
always applies SigLIP's ln_post (megatron-core has no switch for it).

The args carry Megatron-LM's multimodal fields (vision_model_type, img_h, img_w, patch_dim,
disable_vision_class_token, pixel_shuffle, and the tiling: use_tiling, max_num_tiles, use_thumbnail,
use_tile_tags) and model.vision whole (`megajax_vision`), which import reads back. Megatron-LM's
tiling lives in its data pipeline, not in the weights: the checkpoint is the same tiled or not.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from megajax.checkpoint.mapping import Row, flat, index, linear, linear_rows, norm_rows, patch, same, to_external, \
    to_ours, token
from megajax.config import ModelConfig
from megajax.errors import CheckpointError

LANGUAGE, VISION, PROJECTION = "language_model.", "vision_model.", "vision_projection."
ARG = "megajax_vision"  # the args field holding model.vision
_V = VISION + "decoder.layers.{i}"
# A vision layer's norms: the local spec's name -> Transformer Engine's (torch_dist's).
_TE_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def language_model(m: ModelConfig) -> ModelConfig:
    """The language model of a vision-language model (megatron.py's rows and args are of it)."""
    return dataclasses.replace(m, vision=None, freeze_language_model=False)


def _te(name: str) -> str:
    return VISION + "decoder.layers.{i}." + _TE_NORMS[name]


_TABLE = (
    Row(f"{VISION}conv1.weight", patch("vision/patch_embed/kernel")),
    Row(f"{VISION}conv1.bias", flat("vision/patch_embed/bias")),
    Row(f"{VISION}class_token", token("vision/class_embedding")),
    Row(f"{VISION}position_embeddings.weight", same("vision/pos_embed")),
    *norm_rows(f"{VISION}ln_pre", "vision/pre_norm"),
    *norm_rows(f"{_V}.input_layernorm", "vision/layers/ln1",
               aliases=(_te("input_layernorm.") + "weight", _te("input_layernorm.") + "bias")),
    Row(f"{_V}.self_attention.linear_qkv.weight", *(linear(f"vision/layers/{x}/kernel") for x in "qkv"),
        groups="vision_heads", split="column"),
    Row(f"{_V}.self_attention.linear_qkv.bias", *(flat(f"vision/layers/{x}/bias") for x in "qkv"),
        groups="vision_heads", split="column"),
    *linear_rows(f"{_V}.self_attention.linear_proj", "vision/layers/o", n_in=2, split="row"),
    *norm_rows(f"{_V}.pre_mlp_layernorm", "vision/layers/ln2",
               aliases=(_te("pre_mlp_layernorm.") + "weight", _te("pre_mlp_layernorm.") + "bias")),
    *linear_rows(f"{_V}.mlp.linear_fc1", "vision/layers/fc1", split="column"),
    *linear_rows(f"{_V}.mlp.linear_fc2", "vision/layers/fc2", split="row"),
    *norm_rows(f"{VISION}ln_post", "vision/post_norm"),
)


def vision_rows(shapes: dict, m: ModelConfig) -> list[Row]:
    """The encoder's and projector's rows for a model of layout `shapes` (its vision/ and projector/
    parameters); CheckpointError for one no row holds."""
    v = m.vision
    rows = [r for r in _TABLE if all(p.path in shapes for p in r.parts)
            and not (v.class_token and r.name.startswith(f"{VISION}ln_post"))]  # CLIP's: no place (see above)
    if v.projector == "mlp":
        rows += [*linear_rows(f"{PROJECTION}encoder.linear_fc1", "projector/fc1", split="column"),
                 *linear_rows(f"{PROJECTION}encoder.linear_fc2", "projector/fc2", split="row")]
    else:
        rows += linear_rows(f"{PROJECTION}encoder", "projector/fc1", split="column")
    held = {p.path for r in rows for p in r.parts} | ({"vision/post_norm/scale", "vision/post_norm/bias"}
                                                      if v.class_token else set())
    mine = {k for k in shapes if k.startswith(("vision/", "projector/"))}
    if mine - held:
        raise CheckpointError(f"the Megatron-Core LLaVA format has no place for the parameters "
                              f"{', '.join(sorted(mine - held))}.")
    return rows


def layer_shapes(shapes: dict) -> dict:
    """One encoder layer's shapes (the `vision/layers/` stack's dim 0 dropped), the rest as they are."""
    return {k: (s[1:] if k.startswith("vision/layers/") else s) for k, s in shapes.items()
            if k.startswith(("vision/", "projector/"))}


def _entries(rows: list[Row], m: ModelConfig):
    """(row, its names, the encoder layer or None) for every tensor, in the order Megatron-Core's modules
    hold them (conv, embeddings, layers, ln_post, projector)."""
    for row in rows:
        if not row.per_layer:
            yield row, row.names(), None
        elif row is next(r for r in rows if r.per_layer):
            for i in range(m.vision.num_layers):
                yield from ((r, r.names(i), i) for r in rows if r.per_layer)


def extra_state(m: ModelConfig) -> list[str]:
    """The (empty) `_extra_state` keys of the encoder's and projector's Linear modules."""
    layers = [f"{VISION}decoder.layers.{i}.{x}._extra_state" for i in range(m.vision.num_layers) for x in _LINEARS]
    proj = ([f"{PROJECTION}encoder.{x}._extra_state" for x in ("linear_fc1", "linear_fc2")]
            if m.vision.projector == "mlp" else [f"{PROJECTION}encoder._extra_state"])
    return layers + proj


def rank_tensors(source, rows: list[Row], m: ModelConfig, tp: int, t: int) -> dict:
    """{name: float32 array} of tensor rank `t`'s encoder and projector tensors, one layer read at a time."""
    out = {}
    for row, names, i in _entries(rows, m):
        out[names[0]] = to_external(row, lambda path: source.get(path, layer=i if path.startswith("vision/layers/")
                                                                 else None), m, tensor=tp, rank=t)
    return out


def fill(dicts: list[dict], where: str, rows: list[Row], shapes: dict, m: ModelConfig, out: dict) -> None:
    """Fills `out` (megajax paths -> zeros of the whole shapes) from the tensor ranks' state dicts (the
    encoder's and projector's keys, TP-1 names); CheckpointError for a missing, misshapen or unknown
    tensor. CLIP's post-layernorm, which Megatron-Core's encoder has not, is the identity."""
    def mismatch(name, got, want):
        return CheckpointError(f"Megatron checkpoint {where}: {name} has shape {list(got)} (tensor shards "
                               f"merged), but its args imply {list(want)}.")

    per_layer = layer_shapes(shapes)
    used = set()
    for row, names, i in _entries(rows, m):
        key = next((k for k in names if k in dicts[0]), None)
        if key is None:
            raise CheckpointError(f"Megatron checkpoint {where} has no {names[0]} (a vision-language model's "
                                  f"{m.vision.form} encoder and {m.vision.projector} projector, per its args).")
        used.add(key)
        shards = [d.get(key) for d in (dicts[:1] if row.split == "replicated" else dicts)]
        if any(x is None for x in shards):
            raise CheckpointError(f"Megatron checkpoint {where}: tensor rank {shards.index(None)} has no {key}.")
        y = np.concatenate([np.asarray(x.float().numpy()) for x in shards], axis=int(row.split == "row"))
        for path, x in to_ours(row, key, y, per_layer, m, tensor=len(dicts), mismatch=mismatch).items():
            out[path][index(i, row) if path.startswith("vision/layers/") else ...] = x
    left = sorted(k for k in dicts[0] if not k.endswith("_extra_state") and k not in used)
    if left:
        raise CheckpointError(f"Megatron checkpoint {where} holds encoder tensors megajax does not know: "
                              f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}.")
    if m.vision.class_token:
        out["vision/post_norm/scale"][...] = 1.0


def split(sd: dict) -> tuple[dict, dict, list[str]]:
    """(the language model's keys without `language_model.`, the encoder's and projector's, the keys of
    neither) of a LLaVA state dict."""
    lm, vision, other = {}, {}, []
    for k, x in sd.items():
        if k.startswith(LANGUAGE):
            lm[k[len(LANGUAGE):]] = x
        elif k.startswith((VISION, PROJECTION)):
            vision[k] = x
        else:
            other.append(k)
    return lm, vision, other


def dist_state_dict(sd: dict, m: ModelConfig) -> dict:
    """torch_dist's global tensors of the encoder and projector from their TP-1 legacy tensors (and None
    `_extra_state`s): the layers' `vision_model.decoder.layers.{i}.X` stacked into
    `vision_model.decoder.layers.X [Lv, ...]`, the norms under Transformer Engine's names, each layer's
    `_extra_state` the object `KEY/shard_{i}_{Lv}`, the projector's `KEY/shard_0_1`."""
    import torch
    n = m.vision.num_layers
    out, stacks = {}, {}
    for name, x in sd.items():
        match = re.match(re.escape(VISION) + r"decoder\.layers\.(\d+)\.(.*)$", name)
        if not match:
            out[name if x is not None else f"{name}/shard_0_1"] = x if x is not None else [None]
            continue
        i, rest = int(match.group(1)), match.group(2)
        for local, te in _TE_NORMS.items():
            if rest.startswith(local):
                rest = te + rest[len(local):]
        key = f"{VISION}decoder.layers.{rest}"
        if x is None:
            out[f"{key}/shard_{i}_{n}"] = [None]
        else:
            stacks.setdefault(key, {})[i] = x
    for key, layers in stacks.items():
        out[key] = torch.stack([layers[i] for i in range(n)])
    return out


def megatron_args(m: ModelConfig) -> dict:
    """The args of a LLaVA checkpoint beside the language model's: Megatron-LM's multimodal fields and
    model.vision whole."""
    v = m.vision
    fields = {k: val for k, val in dataclasses.asdict(v).items() if k != "freeze"}
    return dict(vision_model_type=v.form, img_h=v.image_size, img_w=v.image_size, patch_dim=v.patch_size,
                disable_vision_class_token=v.feature_select == "full", encoder_num_layers=v.num_layers,
                projector_type=v.projector, freeze_ViT=v.freeze, pixel_shuffle=v.pixel_shuffle,
                use_tiling=v.tiled, max_num_tiles=v.max_num_tiles, use_thumbnail=v.use_thumbnail,
                use_tile_tags=v.tile_tags, **{ARG: fields})


def vision_overrides(args) -> dict | None:
    """model.vision from a checkpoint's args (None: no vision-language model); CheckpointError for a
    LLaVA checkpoint whose args do not carry the encoder whole."""
    fields = getattr(args, ARG, None)
    if fields is None:
        if getattr(args, "vision_model_type", None) is not None:
            raise CheckpointError(f"Megatron args vision_model_type={args.vision_model_type!r} without {ARG}: megajax "
                                  f"reads vision-language checkpoints whose args carry the encoder's config "
                                  f"(width, heads, layers, projector), as `megajax export --format megatron` "
                                  f"writes them; Megatron-LM's args do not hold the encoder's sizes.")
        return None
    if not isinstance(fields, dict):
        raise CheckpointError(f"Megatron args {ARG}={fields!r}: expected a dict of model.vision fields.")
    fields = dict(fields)
    if "pixel_shuffle" not in fields:  # model.vision written before the field existed: Megatron-LM's arg
        fields["pixel_shuffle"] = bool(getattr(args, "pixel_shuffle", False))
    if "max_num_tiles" not in fields and getattr(args, "use_tiling", False):  # likewise the tiling
        fields["max_num_tiles"] = int(getattr(args, "max_num_tiles", 1))
        fields["use_thumbnail"] = bool(getattr(args, "use_thumbnail", False))
        fields["tile_tags"] = bool(getattr(args, "use_tile_tags", False))
    return fields
