"""Vision-language models in Megatron's checkpoint formats (megajax/checkpoint/megatron_vision.py):
tiny-llava's SigLIP and CLIP forms exported as Megatron-Core LLaVAModel checkpoints, legacy at TP 1 and
2 and torch_dist; megatron-core's own modules (megatron_vision_worker.py) load them strictly and compute
megajax's image features; the import gives the logits on images + text back; bad checkpoints named."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megajax.checkpoint.megatron import export_megatron, export_torch_dist, import_megatron
from megajax.checkpoint.source import DictSource, flatten, unflatten
from megajax.config import load_config
from megajax.errors import CheckpointError
from megajax.train.state import build_model_spec
from random_model import random_weights
from test_export import free_port
from test_vision import TINY, VOCAB, image_batch

torch = pytest.importorskip("torch")
WORKER = str(Path(__file__).with_name("megatron_vision_worker.py"))
FORMS = {"siglip": [], "clip": ["model.vision.form=clip", "model.vision.feature_select=default"]}
# The names megatron-core 0.16.1 gives the encoder's layer tensors (TransformerLayer with the ViT spec,
# vit_layer_specs.py; legacy: the local spec's norms) and the projector's (multimodal_projector.py).
LAYER = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
         "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
         "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
         "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
TOP = {"siglip": ("conv1.weight", "conv1.bias", "position_embeddings.weight", "ln_post.weight", "ln_post.bias"),
       "clip": ("conv1.weight", "class_token", "position_embeddings.weight", "ln_pre.weight", "ln_pre.bias")}
PROJECTOR = {"mlp": ("encoder.linear_fc1.weight", "encoder.linear_fc1.bias", "encoder.linear_fc2.weight",
                     "encoder.linear_fc2.bias"), "affine": ("encoder.weight", "encoder.bias")}


def model(form: str, *extra: str):
    """(config, model spec, random weights with visible norms and biases) of tiny-llava in `form`."""
    cfg = load_config(["model/tiny-llava"], overrides=[*TINY, *FORMS[form], *extra])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    weights = {n: np.asarray(w) for n, w in random_weights(spec, 0.05, np.random.default_rng(5)).items()}
    return cfg, spec, weights


def rank_file(out: Path, t: int = 0) -> dict:
    return torch.load(out / "release" / f"mp_rank_{t:02d}" / "model_optim_rng.pt", weights_only=False)


def encoder_keys(sd: dict) -> dict:
    return {k: tuple(v.shape) for k, v in sd.items() if k.startswith(("vision_model.", "vision_projection."))
            and v is not None}


@pytest.mark.parametrize("form,projector", [("siglip", "mlp"), ("clip", "mlp"), ("siglip", "affine")])
def test_legacy_names_and_shapes_are_megatron_cores(form, projector, tmp_path):
    """The encoder's and projector's names and shapes at TP 1 are the list above (Dv 32, 3 layers, 8 x 8
    patches of 16 x 16 images, the language model's width 64); the language model's are its GPT names
    under language_model., and no other key."""
    cfg, _, w = model(form, f"model.vision.projector={projector}")
    sd = rank_file(export_megatron(DictSource(unflatten(w), cfg.model), tmp_path / "mg", dtype="fp32"))["model"]
    want = {f"vision_model.{k}" for k in TOP[form]} | {f"vision_projection.{k}" for k in PROJECTOR[projector]}
    want |= {f"vision_model.decoder.layers.{i}.{k}" for i in range(3) for k in LAYER}
    got = encoder_keys(sd)
    assert set(got) == want
    assert got["vision_model.conv1.weight"] == (32, 3, 8, 8)
    assert got["vision_model.position_embeddings.weight"] == ((5, 32) if form == "clip" else (4, 32))
    assert got["vision_model.decoder.layers.2.self_attention.linear_qkv.weight"] == (96, 32)
    assert got["vision_model.decoder.layers.0.mlp.linear_fc1.weight"] == (64, 32)
    assert got[f"vision_projection.{PROJECTOR[projector][0]}"] == (64, 32)
    if form == "clip":
        assert got["vision_model.class_token"] == (1, 1, 32)
    assert all(k.startswith(("language_model.", "vision_model.", "vision_projection.")) for k in sd)
    assert "language_model.embedding.word_embeddings.weight" in sd and "language_model.output_layer.weight" in sd
    args = rank_file(tmp_path / "mg")["args"]
    assert (args.vision_model_type, args.img_h, args.patch_dim, args.projector_type) == (form, 16, 8, projector)


def test_tp2_splits_the_encoder_per_head(tmp_path):
    """At TP 2 each rank holds its heads' q, k and v ([q_h; k_h; v_h] for its two heads: the first or
    second half of the TP-1 qkv rows), its half of linear_fc1 / the projector's fc1 rows and of
    linear_proj / linear_fc2's columns; norms, embeddings and row-parallel biases are on both ranks."""
    cfg, _, w = model("siglip")
    src = DictSource(unflatten(w), cfg.model)
    one = rank_file(export_megatron(src, tmp_path / "tp1", dtype="fp32"))["model"]
    out = export_megatron(src, tmp_path / "tp2", tensor_parallel=2, dtype="fp32")
    two = [rank_file(out, t)["model"] for t in range(2)]
    q = w["vision/layers/q/kernel"][1].reshape(32, 32).T  # layer 1's q [heads x head_dim, Dv]
    np.testing.assert_array_equal(one["vision_model.decoder.layers.1.self_attention.linear_qkv.weight"][:8].numpy(),
                                  q[:8])  # head 0's q first, then its k and v
    L = "vision_model.decoder.layers.1."
    for name, dim in ((L + "self_attention.linear_qkv.weight", 0), (L + "self_attention.linear_qkv.bias", 0),
                      (L + "mlp.linear_fc1.weight", 0), (L + "mlp.linear_fc1.bias", 0),
                      (L + "self_attention.linear_proj.weight", 1), (L + "mlp.linear_fc2.weight", 1),
                      ("vision_projection.encoder.linear_fc1.weight", 0),
                      ("vision_projection.encoder.linear_fc2.weight", 1)):
        np.testing.assert_array_equal(torch.cat([two[0][name], two[1][name]], dim).numpy(), one[name].numpy(),
                                      err_msg=name)
    for name in (L + "input_layernorm.weight", L + "mlp.linear_fc2.bias", "vision_model.conv1.weight",
                 "vision_model.ln_post.bias", "vision_projection.encoder.linear_fc2.bias"):
        for t in range(2):
            np.testing.assert_array_equal(two[t][name].numpy(), one[name].numpy(), err_msg=name)


IMAGES = np.random.default_rng(2).normal(size=(3, 16, 16, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def megatron_core(tmp_path_factory):
    """{form: (megatron-core's projected image features, its sharded_state_dict keys)} of each form's
    TP-2 legacy export, from one run of two gloo processes (megatron_vision_worker.py)."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("megatron-core")
    steps = [export_megatron(DictSource(unflatten(model(form)[2]), model(form)[0].model), tmp / form,
                             tensor_parallel=2, dtype="fp32") / "release" for form in FORMS]
    np.save(tmp / "images.npy", IMAGES)
    out, port, tp = str(tmp / "mc"), free_port(), 2
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, WORKER, ",".join(map(str, steps)), str(tmp / "images.npy"), out,
                               str(rank), str(tp), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(tp)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return {form: (np.load(f"{out}{k}_features.npy"), json.load(open(f"{out}{k}_keys.json")))
            for k, form in enumerate(FORMS)}


@pytest.mark.parametrize("form", FORMS)
def test_megatron_core_loads_the_export_and_computes_megajax_features(form, megatron_core, tmp_path):
    """megatron-core's CLIPViTModel, MultimodalProjector and GPTModel (LLaVAModel's modules), two tensor
    ranks, load the TP-2 legacy export with strict=True and project megajax's image features (every encoder
    layer, SigLIP's ln_post, CLIP's class token dropped) to 1e-5; the torch_dist export holds their
    sharded_state_dict's keys and global shapes (the encoder's norms under Transformer Engine's fused names;
    the vocabulary padded for TP 1 there, for TP 2 in megatron-core's). TP 1's rank file is TP 2's joined
    (test_tp2_splits_the_encoder_per_head)."""
    import jax.numpy as jnp
    from flax import nnx
    cfg, spec, w = model(form)
    src = DictSource(unflatten(w), cfg.model)
    images = IMAGES
    feats, keys = megatron_core[form]
    enc = nnx.merge(spec.graphdef, unflatten(w))
    x = enc.vision.hidden_states(jnp.asarray(images), 3)
    x = x[:, 1:] if form == "clip" else enc.vision.post_norm(x)
    np.testing.assert_allclose(feats, np.asarray(enc.projector(x)), atol=1e-5, rtol=1e-5)

    from megajax.checkpoint.torch_dist import DistCheckpoint
    ckpt = DistCheckpoint(export_torch_dist(src, tmp_path / "dist", dtype="fp32") / "release")
    ours = {k: list(ckpt.shape(k)) for k in ckpt.keys()}
    te = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
          "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    for local, fused in te.items():
        keys = {(k.replace(local, fused) if k.startswith("vision_model.") else k): s for k, s in keys.items()}
    assert set(ours) == set(keys)
    vocab = {"language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"}
    for k, shape in keys.items():
        if shape is not None:
            assert ours[k][1:] == shape[1:] and (k in vocab or ours[k][0] == shape[0]), (k, ours[k], shape)


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_round_trip_gives_the_logits_back(form, tmp_path):
    """Legacy at TP 1 and 2 and torch_dist, imported: the same model config, every parameter back
    exactly (CLIP's post-layernorm, which Megatron-Core's CLIP encoder has not and LLaVA never runs, the
    identity), and the logits on two images per row + text equal the original's to 1e-5 (fp32)."""
    cfg, spec, w = model(form)
    src = DictSource(unflatten(w), cfg.model)
    tokens, images = image_batch(images=2)
    want = np.asarray(spec.apply(unflatten(w), tokens, images=images))[..., :VOCAB]
    outs = [export_megatron(src, tmp_path / "tp1", dtype="fp32"),
            export_megatron(src, tmp_path / "tp2", tensor_parallel=2, dtype="fp32"),
            export_torch_dist(src, tmp_path / "dist", dtype="fp32")]
    for out in outs:
        overrides, params = import_megatron(out)
        assert overrides["vision"]["form"] == form
        back = load_config(base={"model": overrides}, overrides=[f"train.seq_len={cfg.train.seq_len}"]).model
        assert back.vision == cfg.model.vision and back.num_layers == cfg.model.num_layers
        got = dict(flatten(params))
        assert set(got) == set(w)
        for name, x in w.items():
            if form == "clip" and name.startswith("vision/post_norm/"):
                np.testing.assert_array_equal(got[name], np.ones_like(x) if name.endswith("scale") else 0 * x)
                got[name] = x  # the original's, for the logits (post_norm does not take part in them)
            else:
                np.testing.assert_array_equal(got[name], x, err_msg=f"{out.name}: {name}")
        np.testing.assert_allclose(np.asarray(spec.apply(unflatten(got), tokens, images=images))[..., :VOCAB], want,
                                   atol=1e-5, rtol=1e-5, err_msg=out.name)


def edited(out: Path, edit) -> Path:
    f = out / "release" / "mp_rank_00" / "model_optim_rng.pt"
    ckpt = torch.load(f, weights_only=False)
    edit(ckpt)
    torch.save(ckpt, f)
    return out


def test_bad_checkpoints_are_named(tmp_path):
    """A missing encoder tensor, a misshapen one, an unknown one, a key of no LLaVA module, args without
    the encoder's config, a pipeline-parallel export: one error each, naming the key and what is accepted."""
    cfg, _, w = model("siglip")
    src = DictSource(unflatten(w), cfg.model)

    def fresh(name):
        return export_megatron(src, tmp_path / name, dtype="fp32")

    qkv = "vision_model.decoder.layers.1.self_attention.linear_qkv.weight"
    cases = [
        (lambda c: c["model"].pop("vision_model.ln_post.weight"), "has no vision_model.ln_post.weight"),
        (lambda c: c["model"].__setitem__(qkv, c["model"][qkv][:48]),
         rf"{qkv} \(q\) has shape \[16, 32\].*imply \[32, 32\]"),
        (lambda c: c["model"].__setitem__("vision_model.extra.weight", torch.zeros(2)),
         "encoder tensors megajax does not know: vision_model.extra.weight"),
        (lambda c: c["model"].__setitem__("image_newline", torch.zeros(2)),
         "neither the language model.*image_newline"),
        (lambda c: delattr(c["args"], "megajax_vision"), "vision_model_type='siglip' without megajax_vision"),
    ]
    for k, (edit, match) in enumerate(cases):
        with pytest.raises(CheckpointError, match=match):
            import_megatron(edited(fresh(f"c{k}"), edit))
    with pytest.raises(CheckpointError, match="pipeline_parallel=2 with a vision-language model"):
        export_megatron(src, tmp_path / "pp", pipeline_parallel=2)
    cfg3, _, w3 = model("siglip", "model.vision.num_heads=2", "model.vision.hidden_size=32")
    with pytest.raises(CheckpointError, match=r"model.vision.num_heads=2 is not divisible by tensor_parallel=4"):
        export_megatron(DictSource(unflatten(w3), cfg3.model), tmp_path / "tp4", tensor_parallel=4)


def test_cli_round_trip(tmp_path):
    """`megajax import --format megatron` of a TP-2 LLaVA export, `megajax export --format megatron` of
    that megajax checkpoint (torch_dist) and of the Megatron checkpoint itself (legacy): every parameter
    back exactly (fp32)."""
    from megajax.cli import main
    cfg, _, w = model("clip")
    legacy = export_megatron(DictSource(unflatten(w), cfg.model), tmp_path / "tp2", tensor_parallel=2, dtype="fp32")
    assert main(["import", "--format", "megatron", "--input", str(legacy), "--output", str(tmp_path / "run")]) == 0
    for src, extra in ((tmp_path / "run", []), (legacy, ["--ckpt-format", "torch"])):
        out = tmp_path / f"out-{src.name}"
        assert main(["export", "--format", "megatron", "--checkpoint", str(src), "--output", str(out), "--dtype",
                     "fp32", "--tokenizer", "byte", *extra]) == 0
        overrides, params = import_megatron(out)
        assert overrides["vision"]["form"] == "clip"
        got = dict(flatten(params))
        for name, x in w.items():
            if not name.startswith("vision/post_norm/"):
                np.testing.assert_array_equal(got[name], x, err_msg=f"{out.name}: {name}")


def test_pixel_shuffle_round_trip(tmp_path):
    """model.vision.pixel_shuffle exported: Megatron-LM's args pixel_shuffle, the projector's first linear
    [D, 4 Dv]; the import (TP 2) gives the config, the parameters and the logits back."""
    cfg, spec, w = model("siglip", "model.vision.patch_size=4", "model.vision.pixel_shuffle=true")
    src = DictSource(unflatten(w), cfg.model)
    out = export_megatron(src, tmp_path / "tp1", dtype="fp32")
    ckpt = rank_file(out)
    assert ckpt["args"].pixel_shuffle is True
    assert tuple(ckpt["model"]["vision_projection.encoder.linear_fc1.weight"].shape) == (64, 128)
    overrides, params = import_megatron(export_megatron(src, tmp_path / "tp2", tensor_parallel=2, dtype="fp32"))
    back = load_config(base={"model": overrides}, overrides=[f"train.seq_len={cfg.train.seq_len}"]).model
    assert back.vision == cfg.model.vision and back.vision.image_seq_length == 4
    got = dict(flatten(params))
    for name, x in w.items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)
    tokens, images = image_batch(images=2)
    np.testing.assert_allclose(np.asarray(spec.apply(unflatten(got), tokens, images=images)),
                               np.asarray(spec.apply(unflatten(w), tokens, images=images)), atol=1e-5, rtol=1e-5)
