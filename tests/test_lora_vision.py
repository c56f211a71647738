"""LoRA on a vision-language model (model.lora with model.vision): the adapters are the language model's;
they and the projector train (the encoder too unless model.vision.freeze), everything else is frozen
(outside the train state, no optimizer state), by the one predicate of megajax/models/trainable.py; a
layout equals one device; what cannot be exported is refused by name."""

import functools

import jax
import numpy as np
import optax
import pytest

from megajax.checkpoint.source import flatten
from megajax.errors import ConfigError
from megajax.models.trainable import frozen_parameters
from test_vision import run_steps, tiny_llava

LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def names(tree) -> set[str]:
    return {name for name, _ in flatten(tree)}


def moments(opt_state) -> dict[str, tuple]:
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    return {name: x.shape for name, x in flatten(adam.mu) if hasattr(x, "shape")}


@pytest.mark.parametrize("freeze", [True, False], ids=["encoder-frozen", "encoder-trains"])
def test_lora_on_a_vision_language_model_trains_the_adapters_and_the_projector(freeze):
    """The train state's parameters are the adapters and the projector (and the encoder when it is not
    frozen), each with Adam moments; the language model's base (and the frozen encoder) are
    TrainState.frozen, untouched by a step; the adapters' B and the projector move."""
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    cfg = tiny_llava(*LORA, f"model.vision.freeze={str(freeze).lower()}", "mesh.data=1")
    setup = build_setup(make_plan(cfg, 1), jax.devices()[:1])
    state = setup.fresh_state()
    trained, frozen = names(state.params), names(state.frozen)
    is_frozen = frozen_parameters(cfg.model)
    assert trained and frozen and not trained & frozen
    assert all(not is_frozen(n) for n in trained) and all(is_frozen(n) for n in frozen)
    adapters = {n for n in trained if n.rsplit("/", 2)[-2].endswith("lora")}
    projector = {n for n in trained if n.startswith("projector/")}
    encoder = {n for n in trained if n.startswith("vision/")}
    assert adapters and projector and bool(encoder) != freeze
    assert trained == adapters | projector | encoder
    assert any(n.startswith("vision/") for n in frozen) == freeze
    assert any(n.startswith("layers/") and n.endswith("/kernel") for n in frozen)
    assert moments(state.opt_state) == {n: x.shape for n, x in flatten(state.params)}  # trainable ones only

    before = dict(flatten(jax.device_get(state.params)))
    before_frozen = dict(flatten(jax.device_get(state.frozen)))
    losses, _, after_state = run_steps(cfg, jax.devices()[:1], steps=2)
    assert losses[-1] < losses[0]
    after = dict(flatten(jax.device_get(after_state.params)))
    for name, x in dict(flatten(jax.device_get(after_state.frozen))).items():
        np.testing.assert_array_equal(x, before_frozen[name], err_msg=name)
    for name in [n for n in adapters if n.endswith("/b")] + sorted(projector):
        assert not np.array_equal(after[name], before[name]), name
    # the encoder's layers move (its post-norm does not: LLaVA takes the features of a layer before it)
    assert not freeze == any(not np.array_equal(after[n], before[n]) for n in encoder if "/layers/" in n)


@pytest.mark.parametrize("layout", [["mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                     "train.micro_batch=2"],
                                    ["mesh.pipeline=2", "mesh.data=2", "train.micro_batch=2"]],
                         ids=["data2-tp2-sp", "pp2-data2"])
def test_lora_on_a_vision_language_model_layout_equals_one_device(layout):
    """tiny-llava with adapters on data 2 x tensor 2 with sequence parallelism, and on 2 pipeline stages
    (the encoder and projector on the first) x data 2: one device's loss and grad norm per step (fp32,
    1e-5 relative)."""
    ref_loss, ref_norm, _ = one_device_lora()
    loss, norm, _ = run_steps(tiny_llava(*LORA, *layout), jax.devices()[:4])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=0, err_msg="loss per step")
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5, atol=0, err_msg="grad norm per step")


@functools.lru_cache(maxsize=None)
def one_device_lora():
    return run_steps(tiny_llava(*LORA, "mesh.data=1"), jax.devices()[:1])


def test_lora_with_a_frozen_language_model_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.lora with model.freeze_language_model = true"):
        tiny_llava(*LORA, "model.freeze_language_model=true")


def test_a_lora_vision_language_model_merges_with_its_projector_and_refuses_peft(tmp_path, capsys):
    """A LoRA checkpoint of tiny-llava (random adapters and projector, naming its base): serving's merge
    (merge_adapter) and the Hugging Face export with --merge-lora, imported back, compute the logits of
    the adapters on the frozen base with the checkpoint's projector (fp32, 1e-5); PEFT's format is
    refused naming model.vision."""
    import re
    from megajax.checkpoint.hf import import_hf
    from megajax.checkpoint.lora import merge_adapter
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.checkpoint.source import unflatten
    from megajax.cli import main
    from megajax.config import load_config
    from megajax.train.setup import base_reference
    from megajax.train.state import build_model_spec
    from random_model import random_weights
    from test_vision import image_batch, megajax_model
    cfg = tiny_llava("train.precision=fp32")
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = unflatten(random_weights(spec, 0.05, np.random.default_rng(0)))
    base = write_params_checkpoint(params, cfg, tmp_path / "base")
    lcfg = load_config(base={**cfg.to_dict(), "checkpoint": {"load": str(base)}}, overrides=list(LORA))
    lspec, _ = build_model_spec(lcfg, lcfg.model.padded_vocab_size())
    rng = np.random.default_rng(3)
    trained = unflatten({k: rng.normal(0, 0.1, x.shape).astype(np.float32) for k, x in flatten(lspec.abstract_params)})
    assert any(k.startswith("projector/") for k, _ in flatten(trained))
    lora = write_params_checkpoint(trained, lcfg, tmp_path / "lora", meta={"lora_base": base_reference(lcfg)})
    tokens, images = image_batch()
    want = np.asarray(lspec.apply(trained, tokens, images=images, frozen=params))
    assert np.abs(want - np.asarray(spec.apply(params, tokens, images=images))).max() > 0.05

    merged, _ = merge_adapter(jax.device_put(params), lora, cfg.model)
    np.testing.assert_allclose(np.asarray(spec.apply(merged, tokens, images=images)), want, rtol=1e-5, atol=1e-5)

    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(lora), "--output",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    overrides, hf_params = import_hf(tmp_path / "merged")
    _, hf_spec = megajax_model(overrides)
    got = np.asarray(hf_spec.apply(unflatten(dict(flatten(hf_params))), tokens, images=images))
    np.testing.assert_allclose(got[..., :want.shape[-1]], want[..., :got.shape[-1]], rtol=1e-5, atol=1e-5)

    capsys.readouterr()
    assert main(["export", "--format", "peft", "--checkpoint", str(lora), "--output", str(tmp_path / "no")]) == 2
    assert re.search(r"model.vision: the adapters of a vision-language model are not exported in PEFT's format.*"
                     r"--merge-lora", capsys.readouterr().err)


def test_one_predicate_for_every_way_of_freezing():
    """frozen_parameters over paths: LoRA's base, model.vision.freeze's encoder, model.freeze_language_model's
    language model; None when everything trains."""
    from megajax.config import load_config
    text = load_config(overrides=["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                  "model.vocab_size=258", "train.seq_len=16", *LORA]).model
    paths = ["layers/attn/qkv/kernel", "layers/attn/qkv_lora/a", "layers/mlp/fc2/lora/b", "embed/embedding",
             "vision/layers/attn/qkv/kernel", "projector/fc1/kernel"]

    def frozen(m):
        f = frozen_parameters(m)
        return None if f is None else [p for p in paths if f(p)]
    # a text model's params named like a vision model's count as its base
    assert frozen(text) == ["layers/attn/qkv/kernel", "embed/embedding", "vision/layers/attn/qkv/kernel",
                            "projector/fc1/kernel"]
    assert frozen(tiny_llava().model) is None
    assert frozen(tiny_llava("model.vision.freeze=true").model) == ["vision/layers/attn/qkv/kernel"]
    assert frozen(tiny_llava("model.vision.freeze=true", "model.freeze_language_model=true").model) == paths[:-1]
    assert frozen(tiny_llava(*LORA).model) == ["layers/attn/qkv/kernel", "embed/embedding"]
    assert frozen(tiny_llava(*LORA, "model.vision.freeze=true").model) == [
        "layers/attn/qkv/kernel", "embed/embedding", "vision/layers/attn/qkv/kernel"]
