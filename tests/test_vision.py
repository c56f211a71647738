"""Vision-language models (megajax/models/vision.py): the encoder and the whole LLaVA model against
transformers (SiglipVisionModel / CLIPVisionModel, LlavaForConditionalGeneration) on the same weights,
both ways through the Hugging Face export and import; the loss on image positions; frozen parameters;
layouts against one device; bad input named."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from megajax.checkpoint.hf import export_hf, import_hf  # noqa: E402
from megajax.checkpoint.source import DictSource, flatten  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.errors import ConfigError, DataError  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402
from random_model import random_weights  # noqa: E402

VOCAB, IMAGE_TOKEN = 258, 257  # the byte tokenizer's 257 ids and the image placeholder
SEQ = 24


def tiny_hf(form: str, seed: int = 0):
    """A random LlavaForConditionalGeneration: a 3-layer SigLIP or CLIP tower (16 x 16 images in 8 x 8
    patches: 4 patches), the MLP projector and a 2-layer Llama with grouped-query attention."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=16,
                  patch_size=8)
    if form == "siglip":
        vision, select = T.SiglipVisionConfig(vision_use_head=False, **common), "full"
    else:
        vision, select = T.CLIPVisionConfig(**common), "default"
    text = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    config = T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                           vision_feature_select_strategy=select, vision_feature_layer=-2, image_seq_length=4)
    model = T.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # visible norms and biases (transformers initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def image_batch(batch: int = 2, images: int = 1, seed: int = 1, seq: int = SEQ, per_image: int = 4):
    """(tokens [B, seq] with each image's placeholders at a row-dependent place, images [B, N, 16, 16, 3])."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, IMAGE_TOKEN, (batch, seq)).astype(np.int32)
    for b in range(batch):
        for n in range(images):
            # Several images: the last one near the row's end (under context parallelism its placeholders
            # then come before the others' in the load-balanced layout).
            last = n == images - 1 and n > 0
            start = seq - per_image - 1 - b % 2 if last else 1 + b + n * (per_image + 2)
            tokens[b, start:start + per_image] = IMAGE_TOKEN
    return tokens, rng.normal(size=(batch, images, 16, 16, 3)).astype(np.float32)


def hf_logits(model, tokens, images):
    import torch
    pixels = torch.from_numpy(images.reshape((-1,) + images.shape[2:]).transpose(0, 3, 1, 2).copy())
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens).long(), pixel_values=pixels).logits.numpy()


def megajax_model(overrides: dict, *extra: str):
    cfg = load_config(base={"model": overrides}, overrides=[f"train.seq_len={SEQ}", *extra])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    return cfg, spec


@functools.lru_cache(maxsize=None)
def imported(form: str, tmp: str):
    model = tiny_hf(form)
    model.save_pretrained(f"{tmp}/hf-{form}")
    overrides, params = import_hf(f"{tmp}/hf-{form}")
    return model, overrides, params


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vision"))


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_encoder_matches_transformers(form, tmp_dir):
    """Every hidden state of the tower (embeddings, each layer) and its output (post-layernormed:
    SigLIP's every patch, CLIP's class token) equal transformers' on the same weights and pixels."""
    import torch
    model, overrides, params = imported(form, tmp_dir)
    cfg, spec = megajax_model(overrides)
    ours = nnx.merge(spec.graphdef, params).vision
    images = np.random.default_rng(3).normal(size=(3, 16, 16, 3)).astype(np.float32)
    with torch.no_grad():
        out = model.model.vision_tower(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()),
                                       output_hidden_states=True)
    assert len(out.hidden_states) == 4
    for k, want in enumerate(out.hidden_states):
        np.testing.assert_allclose(np.asarray(ours.hidden_states(jnp.asarray(images), k)), want.numpy(),
                                   atol=1e-5, rtol=1e-5, err_msg=f"hidden state {k}")
    np.testing.assert_allclose(np.asarray(ours.last_hidden_state(jnp.asarray(images))),
                               out.last_hidden_state.numpy(), atol=1e-5, rtol=1e-5)
    if form == "clip":  # the post-layernorm over the class token
        np.testing.assert_allclose(np.asarray(ours.pooled(jnp.asarray(images))), out.pooler_output.numpy(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_llava_logits_match_transformers_both_ways(form, tmp_dir, tmp_path):
    """transformers' LLaVA imported computes its logits on images + text (1e-4, fp32); megajax's own
    random weights exported load in LlavaForConditionalGeneration (no missing or unexpected tensor) and
    compute megajax's logits; the import of that export gives the parameters back exactly."""
    import torch
    import transformers as T
    model, overrides, params = imported(form, tmp_dir)
    assert overrides["vision"]["form"] == form and overrides["vision"]["image_token_id"] == IMAGE_TOKEN
    cfg, spec = megajax_model(overrides)
    tokens, images = image_batch(images=2)
    ours = np.asarray(spec.apply(params, tokens, images=images))[..., :VOCAB]
    np.testing.assert_allclose(ours, hf_logits(model, tokens, images), atol=1e-4, rtol=1e-4)

    theirs = {n: np.asarray(w) for n, w in random_weights(spec, 0.05, np.random.default_rng(5)).items()}
    theirs["embed/embedding"][VOCAB:] = 0
    theirs["output"][:, VOCAB:] = 0
    from megajax.checkpoint.source import unflatten
    mine = unflatten(theirs)
    out = export_hf(DictSource(mine, cfg.model), tmp_path / "hf", tokenizer_spec="byte", dtype="fp32")
    loaded, info = T.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    np.testing.assert_allclose(hf_logits(loaded.eval(), tokens, images),
                               np.asarray(spec.apply(mine, tokens, images=images))[..., :VOCAB], atol=1e-4, rtol=1e-4)
    overrides_back, params_back = import_hf(out)
    assert overrides_back == overrides
    for name, want in flatten(mine):
        np.testing.assert_array_equal(dict(flatten(params_back))[name], want, err_msg=name)


# ----------------------------------------------------------------------------
# Training: the loss, frozen parameters, layouts
# ----------------------------------------------------------------------------

# tiny-llava shrunk: a 2-layer Llama of width 64, a 3-layer SigLIP tower of width 32 on 16 x 16 images.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vision.image_size=16", "model.vision.hidden_size=32",
        "model.vision.num_heads=4", "model.vision.ffn_hidden_size=64", f"train.seq_len={SEQ}",
        "train.global_batch=8", "train.micro_batch=4", "optim.warmup_steps=0", "optim.eps=1e-3", "optim.lr=3e-3"]


def tiny_llava(*overrides: str):
    return load_config(["model/tiny-llava"], overrides=[*TINY, *overrides])


def run_steps(cfg, devices, steps: int = 3):
    """(losses, grad norms, the state after the steps) of `steps` train steps of `cfg` on `devices` with one
    fixed image-text batch, the same each step: 2 microbatches of 4 rows (train.micro_batch per
    data-parallel rank), 2 images per row."""
    from megajax.mesh import load_balanced_order
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    setup = build_setup(make_plan(cfg, len(devices)), devices)
    state, step, ok = setup.fresh_state(), setup.train_step(images=True), setup.ok_flag()
    context = setup.plan.sizes["context"]
    losses, norms = [], []
    for k in range(steps):
        tokens, images = image_batch(batch=8, images=2, seed=10)
        labels = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        batch = {"tokens": tokens, "labels": labels, "loss_mask": np.ones_like(tokens, np.float32), "images": images}
        if context > 1:  # the sequence in context parallelism's load-balanced chunks, as the loader lays it out
            order = load_balanced_order(SEQ, context)
            batch = {key: v[:, order] if key != "images" else v for key, v in batch.items()}
            batch["positions"] = np.broadcast_to(order.astype(np.int32), tokens.shape)
        batch = {key: v.reshape((2, 4) + v.shape[1:]) for key, v in batch.items()}
        batch = jax.device_put(batch, setup.image_batch_shardings())
        state, metrics, ok = step(state, batch, ok)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.asarray(losses), np.asarray(norms), state


@functools.lru_cache(maxsize=None)
def one_device(*overrides: str):
    return run_steps(tiny_llava(*overrides, "mesh.data=1"), jax.devices()[:1])


@pytest.mark.parametrize("layout", [["mesh.data=2", "mesh.fsdp=2", "train.micro_batch=1"],
                                    ["mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                     "train.micro_batch=2"]],
                         ids=["data2-fsdp2", "data2-tp2-sp"])
def test_layouts_equal_one_device(layout):
    """Loss and grad norm of tiny-llava per step equal one device's (fp32, 1e-5 relative) on data x fsdp
    and on tensor parallelism with sequence parallelism."""
    ref_loss, ref_norm, _ = one_device()
    assert ref_loss[-1] < ref_loss[0]
    loss, norm, _ = run_steps(tiny_llava(*layout), jax.devices()[:4])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=0, err_msg="loss per step")
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5, atol=0, err_msg="grad norm per step")


def assert_same_steps(layout, *reference: str, devices: int = 4):
    """tiny-llava's loss and grad norm per step on `layout` (on `devices` devices) equal one device's
    (fp32, 1e-5 relative); returns the run's state."""
    ref_loss, ref_norm, _ = one_device(*reference)
    assert ref_loss[-1] < ref_loss[0]
    loss, norm, state = run_steps(tiny_llava(*reference, *layout), jax.devices()[:devices])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=0, err_msg="loss per step")
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5, atol=0, err_msg="grad norm per step")
    return state


def test_pipeline_runs_the_encoder_on_the_first_stage_only(monkeypatch):
    """Two pipeline stages x data 2 on the GPipe schedule with a frozen encoder: one device's loss and
    grad norm; the encoder and projector run on stage 0 only (recorded from inside the stage loop:
    without collectives in the stages each stage runs only its own work)."""
    from megajax.models.vision import VisionLanguageModel
    one_device("model.vision.freeze=true")  # the reference, before the encoder is wrapped
    stages = []
    embed = VisionLanguageModel.image_embeddings

    def recorded(self, images):
        jax.debug.callback(lambda s: stages.append(int(s)), jax.lax.axis_index("pipeline"))
        return embed(self, images)

    monkeypatch.setattr(VisionLanguageModel, "image_embeddings", recorded)
    assert_same_steps(["mesh.pipeline=2", "mesh.data=2", "parallel.pipeline_schedule=gpipe", "train.micro_batch=2"],
                      "model.vision.freeze=true")
    assert stages and set(stages) == {0}, sorted(set(stages))


@pytest.mark.parametrize("layout", [
    ["mesh.pipeline=2", "mesh.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline_schedule=1f1b",
     "train.micro_batch=4"],
    ["mesh.context=2", "mesh.data=2", "parallel.context_impl=ring", "train.micro_batch=2"],
    ["mesh.context=2", "mesh.tensor=2", "parallel.sequence_parallel=true", "parallel.context_impl=allgather",
     "train.micro_batch=4"],
], ids=["pp2-tp2-sp-1f1b", "cp2-ring-data2", "cp2-allgather-tp2-sp"])
def test_pipeline_and_context_layouts_equal_one_device(layout):
    """Pipeline parallelism (the encoder on stage 0) with tensor and sequence parallelism on 1F1B, and
    context parallelism (the placeholders counted in the sequence's natural order; the batch laid out
    in load-balanced chunks) alone and with tensor + sequence parallelism: one device's loss and grad norm."""
    assert_same_steps(layout)


@pytest.mark.parametrize("layout", [
    ["mesh.pipeline=2", "mesh.context=2", "mesh.data=2", "parallel.context_impl=ring", "train.micro_batch=2"],
    ["mesh.pipeline=2", "mesh.context=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
     "parallel.context_impl=allgather", "parallel.pipeline_schedule=gpipe", "train.micro_batch=4"],
], ids=["pp2-cp2-ring-data2", "pp2-cp2-allgather-tp2-sp-gpipe"])
def test_pipeline_with_context_parallelism_equals_one_device(layout):
    """Pipeline x context parallelism on 8 devices: the first stage gathers its context shard's tokens
    over `context` to count the placeholders in the row's natural order (the batch's last image near the
    row's end, so its placeholders come first in the load-balanced layout), and each shard (and, under
    sequence parallelism, each tensor rank's part) takes its own features: one device's loss and grad norm."""
    assert_same_steps(layout, devices=8)


def device_bytes(tree, device, keep=lambda name: True) -> int:
    """Bytes of the arrays of `tree` (named by keep) that `device` holds."""
    return sum(shard.data.nbytes for name, x in flatten(tree) if keep(name)
               for shard in x.addressable_shards if shard.device == device)


def test_pipeline_stages_share_one_copy_of_the_encoder():
    """Under pipeline parallelism only the first stage runs the encoder and projector, so their weights and
    Adam moments are kept split over `pipeline`: a device of either stage holds half of what one copy takes
    (less the patch and position embeddings, norms and some biases: whole on every stage), where every device held
    a whole copy before. The analytic memory counts each device's parameter and Adam bytes exactly, and the
    run equals one device (test_pipeline_runs_the_encoder_on_the_first_stage_only and the PP x CP test)."""
    from megajax.perf.analytic import memory_estimate
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    plan = make_plan(tiny_llava("mesh.pipeline=2", "mesh.data=2", "train.micro_batch=2"), 4)
    assert plan.rules.params["vision_heads"] == plan.rules.params["vision_mlp"] == ("tensor", "pipeline")
    setup = build_setup(plan, jax.devices()[:4])
    state = setup.fresh_state()
    encoder = lambda name: name.startswith(("vision/", "projector/"))
    whole = sum(x.nbytes for name, x in flatten(state.params) if encoder(name))
    vectors = sum(x.nbytes for name, x in flatten(state.params)  # what no vision_heads / vision_mlp dim splits
                  if encoder(name) and "pipeline" not in str(x.sharding.spec))
    assert 0 < vectors < 0.2 * whole  # the patch embedding most (tiny here: 8 x 8 x 3 x 32)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    est = memory_estimate(plan, setup.spec)
    for stage in range(2):
        for device in setup.mesh.devices[stage].flat:
            assert device_bytes(state.params, device, encoder) == (whole - vectors) // 2 + vectors
            moments = device_bytes(adam.mu, device, encoder) + device_bytes(adam.nu, device, encoder)
            assert moments == 2 * ((whole - vectors) // 2 + vectors)
            assert device_bytes(state.params, device) == est["params"]
            assert device_bytes(adam.mu, device) + device_bytes(adam.nu, device) == est["optimizer"]
    # The step gathers the split weights over `pipeline` (what `megajax bench` measures in the HLO: 13 all-gathers
    # of these bytes on this layout), and the stages all-reduce the whole encoder's gradient.
    from megajax.perf import analytic
    args = (setup.spec.axes, setup.spec.abstract_params, plan.rules.params, plan.sizes)
    text = sum(x.nbytes for name, x in flatten(state.params) if not encoder(name) and not name.startswith("layers/"))
    ends = sum(x.nbytes for name, x in flatten(state.params) if name in ("embed/embedding", "output"))
    assert analytic.stage_gathered_param_bytes(*args) == whole - vectors + ends  # the ends too (vocab_storage_axes)
    assert analytic.stage_shared_param_bytes(*args) == whole + text
    # A split the dims do not divide keeps the encoder whole on every stage (vision heads 4 over tensor 2 x 4 stages).
    from megajax.mesh import make_rules
    cfg = tiny_llava("mesh.pipeline=4", "mesh.tensor=2", "model.num_layers=4")
    rules = make_rules(cfg, {"pipeline": 4, "tensor": 2})
    assert rules.params["vision_heads"] == ("tensor",) and rules.params["vision_mlp"] == ("tensor", "pipeline")
    assert rules.activations["vision_heads"] == ("tensor",)


def test_encoder_tensor_parallel_one_keeps_the_encoder_whole():
    """parallel.encoder_tensor_parallel=1 on tensor 2: the encoder's and projector's weights are whole on
    every tensor rank (the language model's split), and the run equals one device's."""
    state = assert_same_steps(["mesh.tensor=2", "mesh.data=2", "parallel.encoder_tensor_parallel=1",
                               "train.micro_batch=2"])
    split = {name: "tensor" in str(x.sharding.spec) for name, x in flatten(state.params)}
    encoder = [name for name in split if name.startswith(("vision/", "projector/"))]
    assert encoder and not any(split[name] for name in encoder)
    assert any(split[name] for name in split if name.startswith("layers/"))
    from megajax.mesh import make_rules  # by default (0) the encoder splits like the language model
    assert make_rules(tiny_llava("mesh.tensor=2")).params["vision_heads"] == ("tensor",)


def test_loss_masks_image_positions():
    """The evaluated loss counts text labels only: the positions whose label is an image placeholder are
    neither scored nor counted, and the sum is the cross entropy of the others (computed here in float64)."""
    from megajax.train.loss import mask_image_labels
    from megajax.train.step import make_eval_step
    cfg = tiny_llava()
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = jax.jit(init)()
    tokens, images = image_batch(batch=2, images=1)
    labels = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    batch = {"tokens": tokens[None], "labels": labels[None], "loss_mask": np.ones((1,) + tokens.shape, np.float32),
             "images": images[None]}
    total, count = jax.jit(make_eval_step(spec, cfg=cfg))(params, batch)
    placeholders = int(np.sum(labels == IMAGE_TOKEN))
    assert placeholders == 2 * 4 and float(count) == tokens.size - placeholders
    masked = mask_image_labels(cfg, batch)["loss_mask"][0]
    logits = np.asarray(spec.apply(params, tokens, images=images), np.float64)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = -np.sum(np.take_along_axis(logp, labels[..., None], -1)[..., 0] * masked)
    np.testing.assert_allclose(float(total), want, rtol=1e-5)


def test_frozen_encoder_takes_no_gradient_and_no_optimizer_state():
    """model.vision.freeze: the encoder's parameters keep their values and have no Adam moments; the
    projector and the language model train. freeze_language_model too: only the projector moves."""
    cfg = tiny_llava("model.vision.freeze=true", "mesh.data=1")
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    setup = build_setup(make_plan(cfg, 1), jax.devices()[:1])
    adam = [s for s in jax.tree.leaves(setup.abstract_state.opt_state,
                                       is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    moments = {"/".join(str(getattr(k, "key", k)) for k in path) for path, leaf in
               jax.tree_util.tree_flatten_with_path(adam.mu)[0] if hasattr(leaf, "shape")}
    assert moments and not any(n.startswith("vision/") for n in moments)
    assert any(n.startswith("projector/") for n in moments) and any(n.startswith("layers/") for n in moments)
    for overrides, moving in ((("model.vision.freeze=true",), lambda n: not n.startswith("vision/")),
                              (("model.vision.freeze=true", "model.freeze_language_model=true"),
                               lambda n: n.startswith("projector/"))):
        before = dict(flatten(jax.device_get(build_setup(make_plan(tiny_llava(*overrides, "mesh.data=1"), 1),
                                                         jax.devices()[:1]).fresh_state().params)))
        after = dict(flatten(jax.device_get(run_steps(tiny_llava(*overrides, "mesh.data=1"), jax.devices()[:1],
                                                      steps=1)[2].params)))
        for name, x in before.items():
            changed = not np.array_equal(x, after[name])
            assert changed == moving(name), (overrides, name)


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------

def test_bad_config_and_batches_are_named():
    with pytest.raises(ConfigError, match=r"model.vision.patch_size=32 is larger than model.vision.image_size=16"):
        tiny_llava("model.vision.patch_size=32")
    with pytest.raises(ConfigError, match=r"image_token_id=300 is outside the vocabulary \[0, 258\)"):
        tiny_llava("model.vision.image_token_id=300")
    with pytest.raises(ConfigError, match="feature_select = default drops the class token"):
        tiny_llava("model.vision.feature_select=default")
    from megajax.errors import MeshError
    from megajax.plan import make_plan
    with pytest.raises(MeshError, match=r"parallel.encoder_tensor_parallel=2 with mesh.tensor=4: .* accepted: 1 "
                                        r"\(whole on every tensor rank\) or 4"):
        make_plan(tiny_llava("mesh.tensor=4", "mesh.data=1", "model.num_kv_heads=4", "parallel.encoder_tensor_parallel=2"), 4)
    with pytest.raises(ConfigError, match="parallel.encoder_tensor_parallel = -1: must be >= 0"):
        tiny_llava("parallel.encoder_tensor_parallel=-1")
    cfg = tiny_llava()
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = jax.jit(init)()
    tokens, images = image_batch(batch=2, images=2)
    with pytest.raises(DataError, match=r"row 0 of the batch holds 8 image placeholders .* but 1 image\(s\) x 4 "
                                        r"features = 4"):
        spec.apply(params, tokens, images=images[:, :1])
    with pytest.raises(DataError, match=r"images have shape \[2, 2, 16, 8, 3\]; expected \[batch, images per row, "
                                        r"16, 16, 3\]"):
        spec.apply(params, tokens, images=images[:, :, :, :8])


# ----------------------------------------------------------------------------
# Pixel shuffle (model.vision.pixel_shuffle)
# ----------------------------------------------------------------------------

SHUFFLE = ("model.vision.patch_size=4", "model.vision.pixel_shuffle=true")  # 16 x 16 images: a 4 x 4 grid


def test_pixel_shuffle_matches_a_numpy_reference():
    """Feature (i, j) of a 4 x 6 grid is patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1) concatenated,
    row-major; and the encoder's features under pixel_shuffle are that regrouping of its plain ones."""
    from megajax.models.vision import VisionEncoder, pixel_shuffle
    grid = np.arange(2 * 6 * 6 * 3, dtype=np.float32).reshape(2, 6 * 6, 3)
    want = np.empty((2, 9, 12), np.float32)
    for img in range(2):
        for i in range(3):
            for j in range(3):
                parts = [grid[img, r * 6 + c] for r, c in ((2 * i, 2 * j), (2 * i, 2 * j + 1),
                                                           (2 * i + 1, 2 * j), (2 * i + 1, 2 * j + 1))]
                want[img, i * 3 + j] = np.concatenate(parts)
    np.testing.assert_array_equal(np.asarray(pixel_shuffle(jnp.asarray(grid))), want)

    plain, shuffled = tiny_llava(SHUFFLE[0]).model.vision, tiny_llava(*SHUFFLE).model.vision
    images = np.random.default_rng(3).normal(size=(3, 16, 16, 3)).astype(np.float32)
    feats = [np.asarray(VisionEncoder(v, dtype=jnp.float32, rngs=nnx.Rngs(0)).features(images))
             for v in (plain, shuffled)]
    assert feats[0].shape == (3, 16, 32) and feats[1].shape == (3, 4, 128)
    ref = feats[0].reshape(3, 2, 2, 2, 2, 32).transpose(0, 1, 3, 2, 4, 5).reshape(3, 4, 128)
    np.testing.assert_array_equal(feats[1], ref)


def test_pixel_shuffle_takes_a_quarter_of_the_placeholders():
    """image_seq_length, the one count (the webdataset loader's too): a quarter of the patches, in the
    prompt expansion, the model's placeholder check and the FLOPs; the projector's input 4x as wide."""
    from megajax.inference.images import image_prompt_ids
    from megajax.models.vision import encoder_forward_flops
    from megajax.data.tokenizer import ByteTokenizer
    plain, cfg = tiny_llava(SHUFFLE[0]), tiny_llava(*SHUFFLE)
    v = cfg.model.vision
    assert (plain.model.vision.image_seq_length, v.image_seq_length, v.feature_width) == (16, 4, 128)
    ids = image_prompt_ids(ByteTokenizer(), "<image>a photo", 1, v)
    assert ids.count(IMAGE_TOKEN) == 4
    _, projector = encoder_forward_flops(v, cfg.model.hidden_size)
    assert projector == 2 * 4 * 128 * 64 + 2 * 4 * 64 * 64
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = jax.jit(init)()
    assert params["projector"]["fc1"]["kernel"].shape == (128, 64)
    tokens, images = image_batch(batch=2, images=2)  # 4 placeholders per image
    assert np.isfinite(np.asarray(spec.apply(params, tokens, images=images))).all()
    with pytest.raises(DataError, match=r"but 1 image\(s\) x 4 features = 4"):
        spec.apply(params, tokens, images=images[:, :1])


def test_pixel_shuffle_layout_equals_one_device():
    """tiny-llava with pixel_shuffle: a finite, falling loss; loss and grad norm per step on data 2 x
    tensor 2 (sequence parallel) equal one device's (fp32, 1e-5 relative)."""
    ref_loss, ref_norm, _ = one_device(*SHUFFLE)
    assert np.isfinite(ref_loss).all() and np.isfinite(ref_norm).all()
    assert_same_steps(["mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2"],
                      *SHUFFLE)


def test_pixel_shuffle_bad_config_and_hf_export_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"pixel_shuffle = true needs an even patch grid side, but "
                                          r"model.vision.image_size=24 // model.vision.patch_size=8 = 3"):
        tiny_llava("model.vision.pixel_shuffle=true", "model.vision.image_size=24")
    with pytest.raises(ConfigError, match="pixel_shuffle = true regroups the patch grid, which a kept class token"):
        tiny_llava(*SHUFFLE, "model.vision.form=clip", "model.vision.feature_select=full")
    from megajax.errors import CheckpointError
    cfg = tiny_llava(*SHUFFLE)
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    with pytest.raises(CheckpointError, match="model.vision.pixel_shuffle=true: Hugging Face's LLaVA .* no pixel "
                                              "shuffle"):
        export_hf(DictSource(jax.device_get(jax.jit(init)()), cfg.model), tmp_path / "hf", tokenizer_spec="byte",
                  dtype="fp32")
    assert not (tmp_path / "hf").exists()
    torch = pytest.importorskip("torch")
    model = tiny_hf("siglip")  # a LLaVA whose projector takes 2 x 2 patches' features: refused on import
    model.model.multi_modal_projector.linear_1 = torch.nn.Linear(4 * 32, 64)
    model.save_pretrained(tmp_path / "shuffled")
    with pytest.raises(CheckpointError, match=r"multi_modal_projector.linear_1.weight in .* has shape \[64, 128\]: "
                                              r"a projector of 4 x 32 inputs, pixel-shuffled"):
        import_hf(tmp_path / "shuffled")
