"""NVLM-style image tiles (model.vision.max_num_tiles, use_thumbnail, tile_tags; megajax/data/tiles.py):
the grid choice against hand-computed cases, the tiles' pixels, tags and placeholders, the loader's
padded tile axis, each tile's features in its own placeholders, a layout against one device, generation
and serving of a tiled image, the Megatron flags and export, and the Hugging Face export refused."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megajax.config import VisionConfig, load_config
from megajax.data.tiles import THUMBNAIL_TAG, cut_tiles, image_run, tile_grid
from megajax.data.tokenizer import ByteTokenizer, load_tokenizer
from megajax.errors import ConfigError, DataError
from megajax.train.state import build_model_spec

IMAGE_TOKEN, SEQ = 257, 40
# tiny-llava shrunk: a 2-layer Llama of width 64, a 3-layer SigLIP tower of width 32 on 16 x 16 tiles
# (8 x 8 patches: 4 placeholders a tile), up to 4 tiles and a thumbnail.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vision.image_size=16", "model.vision.hidden_size=32",
        "model.vision.num_heads=4", "model.vision.ffn_hidden_size=64", f"train.seq_len={SEQ}",
        "train.global_batch=8", "train.micro_batch=4", "optim.warmup_steps=0", "optim.eps=1e-3", "optim.lr=3e-3"]
TILED = ("model.vision.max_num_tiles=4", "model.vision.use_thumbnail=true")


def tiny_llava(*overrides: str):
    return load_config(["model/tiny-llava"], overrides=[*TINY, *TILED, *overrides])


def picture(size, seed=0):
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# ----------------------------------------------------------------------------
# The grid, the tiles, the tags
# ----------------------------------------------------------------------------

def test_tile_grid_matches_hand_computed_cases():
    """800 x 300 (ratio 2.67) with 6 tiles: 3 x 1 is closest (|2.67 - 3| = 0.33; 2 x 1: 0.67, 5 x 1: 2.3).
    A square ties 1 x 1 with 2 x 2 (both ratio 1): 2 x 2 wins only when the picture holds more than half
    of its pixels (500^2 = 250,000 > 0.5 x 4 x 224^2 = 100,352, but < 0.5 x 4 x 448^2 = 401,408).
    Portrait 300 x 900 with 6: 1 x 3; a long strip is capped at max_num_tiles (6 x 1); max 1: 1 x 1."""
    assert tile_grid(800, 300, 6, 448) == (3, 1)
    assert tile_grid(500, 500, 6, 448) == (1, 1)
    assert tile_grid(500, 500, 6, 224) == (2, 2)
    assert tile_grid(300, 900, 6, 448) == (1, 3)
    assert tile_grid(2000, 100, 6, 448) == (6, 1)
    assert tile_grid(640, 480, 1, 448) == (1, 1)
    # 640 x 480 (1.33) with 4: 1 x 1 (0.33) against 2 x 1 (0.67), 1 x 2 (0.83), 3 x 1, 2 x 2 (0.33, a tie
    # that 2 x 2 wins at 224: 307,200 > 100,352), 4 x 1, 1 x 4.
    assert tile_grid(640, 480, 4, 224) == (2, 2)
    assert tile_grid(640, 480, 4, 448) == (1, 1)


def test_tiles_are_the_resized_grid_row_major_then_the_thumbnail():
    """A 40 x 18 picture (ratio 2.2) with 4 tiles of 16: a 2 x 1 grid, the picture resized to 32 x 16 and cut
    left, right, then the whole picture at 16 x 16; the loader's and generation's preprocessing give the
    same normalised tiles; untiled, one picture."""
    from PIL import Image

    from megajax.data.webdataset import process_image, process_tiles
    from megajax.inference.images import preprocess, preprocess_tiles
    v = tiny_llava().model.vision
    image = picture((40, 18), seed=1)
    tiles = cut_tiles(image, v)
    assert len(tiles) == 3 and all(t.size == (16, 16) for t in tiles)
    grid = np.asarray(image.resize((32, 16), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(np.asarray(tiles[0]), grid[:, :16])
    np.testing.assert_array_equal(np.asarray(tiles[1]), grid[:, 16:])
    np.testing.assert_array_equal(np.asarray(tiles[2]), np.asarray(image.resize((16, 16), Image.Resampling.BICUBIC)))
    ours = process_tiles(png_bytes(image), v)
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_allclose(ours, preprocess_tiles(image, v), atol=1e-6)
    np.testing.assert_allclose(ours[0], (grid[:, :16] / 255.0 - 0.5) / 0.5, atol=1e-6)
    no_thumb = VisionConfig(image_size=16, max_num_tiles=4)
    assert len(cut_tiles(image, no_thumb)) == 2
    assert len(cut_tiles(picture((16, 16)), v)) == 1  # a square at this size: one tile, no thumbnail
    plain = tiny_llava("model.vision.max_num_tiles=1", "model.vision.use_thumbnail=false").model.vision
    np.testing.assert_allclose(process_tiles(png_bytes(image), plain)[0], process_image(png_bytes(image), plain))
    np.testing.assert_allclose(preprocess_tiles(image, plain)[0], preprocess(image, plain))


def test_placeholders_and_tags_per_tile():
    """Each tile takes image_seq_length placeholders; with tile_tags NVLM's tag first (<tile_1>, <tile_2>,
    <tile_global_thumbnail> on the thumbnail or a lone tile), the tags trained on nothing."""
    from megajax.data.webdataset import encode_with_images
    from megajax.inference.images import image_prompt_ids
    tok = ByteTokenizer()
    v = tiny_llava().model.vision
    ids, placeholder = image_run(tok, 3, v)
    assert ids.tolist() == [IMAGE_TOKEN] * 12 and placeholder.all()
    tagged = tiny_llava("model.vision.tile_tags=true").model.vision
    ids, placeholder = image_run(tok, 3, tagged)
    run = [IMAGE_TOKEN] * 4
    want = list(b"<tile_1>") + run + list(b"<tile_2>") + run + list(THUMBNAIL_TAG.encode()) + run
    assert ids.tolist() == want and placeholder.tolist() == [t == IMAGE_TOKEN for t in want]
    assert image_run(tok, 1, tagged)[0].tolist() == list(THUMBNAIL_TAG.encode()) + run
    no_thumb = tiny_llava("model.vision.tile_tags=true", "model.vision.use_thumbnail=false").model.vision
    assert image_run(tok, 2, no_thumb)[0].tolist() == list(b"<tile_1>") + run + list(b"<tile_2>") + run
    # a prompt's two images of 2 and 1 tiles, and the loader's caption: the tags are not trained
    assert image_prompt_ids(tok, "a<image>b<image>", 2, v, [2, 1]) == [97] + [IMAGE_TOKEN] * 8 + [98] + run
    text = "<image>red"
    ids, trained, n = encode_with_images(tok, text, [(0, len(text))], IMAGE_TOKEN, 4, image_run(tok, 3, tagged)[0])
    assert n == 1 and ids.tolist() == want + list(b"red") and trained.tolist() == [False] * len(want) + [True] * 3


def test_loader_pads_the_tile_axis(tmp_path):
    """An image-text sample of a wide and of a square picture: images [max_tiles, 16, 16, 3], its own tiles
    first and zeros after; the text holds its tiles' placeholders (and tags), none trained."""
    from megajax.data.webdataset import ImageTextDataset, index_shards, process_tiles, shard_files, write_shards
    cfg = load_config(["model/tiny-llava"], overrides=[*TINY[:-5], *TILED, "model.vision.tile_tags=true",
                                                       "train.seq_len=80", "data.format=webdataset"])
    wide, square = png_bytes(picture((40, 18), seed=2)), png_bytes(picture((16, 16), seed=3))
    write_shards([("0000", "png", wide, {"caption": "wide"}), ("0001", "png", square, {"caption": "square"})],
                 tmp_path)
    index = index_shards(shard_files(str(tmp_path)))
    ds = ImageTextDataset(index, index.samples, tokenizer=load_tokenizer("byte"), template=None,
                          vision=cfg.model.vision, seq_len=80, seed=0)
    assert ds.images_shape == (5, 16, 16, 3)
    seen = {}
    for i in range(2):
        s = ds[i]
        text = bytes(int(t) for t in s["tokens"] if t < 256).decode()
        seen[text.split(">")[-1]] = s
        tiles = int(np.sum(s["tokens"] == IMAGE_TOKEN)) // 4
        assert s["images"].shape == (5, 16, 16, 3)
        assert not s["images"][tiles:].any() and s["images"][:tiles].any()
        assert s["loss_mask"][np.flatnonzero(s["tokens"] == IMAGE_TOKEN) - 1].sum() == 0
    np.testing.assert_allclose(seen["wide"]["images"][:3], process_tiles(wide, cfg.model.vision))
    assert int(np.sum(seen["wide"]["tokens"] == IMAGE_TOKEN)) == 12
    assert int(np.sum(seen["square"]["tokens"] == IMAGE_TOKEN)) == 4
    wide_text = bytes(int(t) for t in seen["wide"]["tokens"] if t < 256).decode()
    assert wide_text.startswith("<tile_1><tile_2><tile_global_thumbnail>wide")
    mask, tokens = seen["wide"]["loss_mask"], seen["wide"]["tokens"]
    trained = bytes(int(tokens[t + 1]) for t in np.flatnonzero(mask) if tokens[t + 1] < 256).decode()
    assert trained == "wide"  # and the end-of-document token: not a tag, not a placeholder


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------

def tiled_batch(batch=8, seed=10, pad=7.0):
    """(tokens [B, SEQ], pictures [B, 5, 16, 16, 3]): row b holds 1 + b % 5 tiles (placeholders at a
    row-dependent place), its padding pictures filled with `pad`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, IMAGE_TOKEN, (batch, SEQ)).astype(np.int32)
    images = rng.normal(size=(batch, 5, 16, 16, 3)).astype(np.float32)
    for b in range(batch):
        n = 1 + b % 5
        start = 1 + b % 3
        tokens[b, start:start + 4 * n] = IMAGE_TOKEN
        images[b, n:] = pad
    return tokens, images


def test_each_tile_lands_in_its_placeholders():
    """The first layer's input at a row's k-th tile's placeholders is the projector of the encoder run on
    that tile alone; elsewhere the token embeddings; the padding pictures change nothing."""
    cfg = tiny_llava()
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    model = nnx.merge(spec.graphdef, jax.jit(init)())
    tokens, images = tiled_batch(batch=5)
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    embed = jax.jit(lambda t, i: model.embed_input(t, positions, None, images_BxNxHxWxC=i))
    one_tile = jax.jit(lambda tile: model.projector(model.vision.features(tile))[0])  # [1, 16, 16, 3]: alone
    x = np.asarray(embed(tokens, images))
    text = np.asarray(model.embed_tokens(jnp.asarray(tokens), positions))
    for b in range(5):
        where = np.flatnonzero(tokens[b] == IMAGE_TOKEN)
        n = len(where) // 4
        for k in range(n):
            alone = np.asarray(one_tile(images[b, k:k + 1]))
            np.testing.assert_allclose(x[b, where[4 * k:4 * k + 4]], alone, atol=1e-5, rtol=1e-5,
                                       err_msg=f"row {b} tile {k}")
        others = np.setdiff1d(np.arange(SEQ), where)
        np.testing.assert_array_equal(x[b, others], text[b, others])
    _, other_pad = tiled_batch(batch=5, pad=-3.0)
    np.testing.assert_array_equal(np.asarray(embed(tokens, other_pad)), x)
    with pytest.raises(DataError, match=r"row 0 of the batch holds 6 image placeholders .* a multiple of it and "
                                        r"at most 20"):
        bad = tokens.copy()
        bad[0, 30:32] = IMAGE_TOKEN
        model.embed_input(jnp.asarray(bad), positions, None, images_BxNxHxWxC=jnp.asarray(images))


def run_steps(cfg, devices, steps=2):
    """(losses, grad norms) of `steps` train steps of `cfg` on `devices`, one fixed tiled batch: 2
    microbatches of 4 rows, each row 1 to 5 tiles."""
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    setup = build_setup(make_plan(cfg, len(devices)), devices)
    state, step, ok = setup.fresh_state(), setup.train_step(images=True), setup.ok_flag()
    tokens, images = tiled_batch()
    labels = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": np.ones_like(tokens, np.float32), "images": images}
    batch = jax.device_put({k: v.reshape((2, 4) + v.shape[1:]) for k, v in batch.items()},
                           setup.image_batch_shardings())
    losses, norms = [], []
    for _ in range(steps):
        state, metrics, ok = step(state, batch, ok)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.asarray(losses), np.asarray(norms)


def test_tiled_layout_equals_one_device():
    """Tiled tiny-llava (rows of 1 to 5 tiles): a falling loss; data 2 x tensor 2 with sequence
    parallelism gives one device's loss and grad norm per step (fp32, 1e-5 relative)."""
    ref_loss, ref_norm = run_steps(tiny_llava("mesh.data=1"), jax.devices()[:1])
    assert np.isfinite(ref_norm).all() and ref_loss[-1] < ref_loss[0]
    loss, norm = run_steps(tiny_llava("mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                      "train.micro_batch=2"), jax.devices()[:4])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=0, err_msg="loss per step")
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5, atol=0, err_msg="grad norm per step")


def test_flops_and_memory_count_every_picture_of_a_sample():
    """The encoder's FLOPs per token and its activation memory: max_tiles (4 + the thumbnail) pictures per
    sample, 5x the untiled model's."""
    from megajax.perf.analytic import vision_activation_bytes
    from megajax.plan import make_plan
    from megajax.train.flops import vision_flops_per_token
    tiled, plain = tiny_llava(), tiny_llava("model.vision.max_num_tiles=1", "model.vision.use_thumbnail=false")
    assert tiled.model.vision.max_tiles == 5 and plain.model.vision.max_tiles == 1
    assert vision_flops_per_token(tiled.model, SEQ) == pytest.approx(5 * vision_flops_per_token(plain.model, SEQ))
    memory = [vision_activation_bytes(make_plan(c, 1)) for c in (tiled, plain)]
    assert memory[1] > 0 and memory[0] == pytest.approx(5 * memory[1], rel=1e-6)


# ----------------------------------------------------------------------------
# Configuration, Megatron, Hugging Face
# ----------------------------------------------------------------------------

def test_config_megatron_flags_and_exports(tmp_path):
    from megajax.checkpoint.hf import export_hf
    from megajax.checkpoint.megatron_vision import megatron_args, vision_overrides
    from megajax.checkpoint.source import DictSource
    from megajax.errors import CheckpointError
    from megajax.megatron_args import translate
    with pytest.raises(ConfigError, match="model.vision.max_num_tiles = 0: must be > 0"):
        tiny_llava("model.vision.max_num_tiles=0")
    with pytest.raises(ConfigError, match="use_thumbnail = true with model.vision.max_num_tiles = 1"):
        tiny_llava("model.vision.max_num_tiles=1")
    with pytest.raises(ConfigError, match="tile_tags = true with model.vision.max_num_tiles = 1"):
        tiny_llava("model.vision.max_num_tiles=1", "model.vision.use_thumbnail=false", "model.vision.tile_tags=true")
    t = translate(["--use-tiling", "--max-num-tiles", "6", "--use-thumbnail", "--use-tile-tags"], defaults=False)
    assert t.tree()["model"]["vision"] == {"max_num_tiles": 6, "use_thumbnail": True, "tile_tags": True}
    assert [flag for flag, _ in t.needless] == ["--use-tiling"] and not t.unmapped and not t.refused
    cfg = tiny_llava("model.vision.tile_tags=true")
    args = megatron_args(cfg.model)
    assert (args["use_tiling"], args["max_num_tiles"], args["use_thumbnail"], args["use_tile_tags"]) == \
        (True, 4, True, True)
    back = vision_overrides(type("Args", (), args)())
    assert (back["max_num_tiles"], back["use_thumbnail"], back["tile_tags"]) == (4, True, True)
    old = {k: v for k, v in args["megajax_vision"].items() if k not in ("max_num_tiles", "use_thumbnail", "tile_tags")}
    back = vision_overrides(type("Args", (), {**args, "megajax_vision": old})())  # Megatron-LM's own args
    assert (back["max_num_tiles"], back["use_thumbnail"], back["tile_tags"]) == (4, True, True)
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    with pytest.raises(CheckpointError, match="model.vision.max_num_tiles=4: Hugging Face's LLaVA .* no tiles"):
        export_hf(DictSource(jax.device_get(jax.jit(init)()), cfg.model), tmp_path / "hf", tokenizer_spec="byte",
                  dtype="fp32")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------
# Generation and serving
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiled_checkpoint(tmp_path_factory):
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.checkpoint.source import unflatten
    from random_model import random_weights
    cfg = tiny_llava("model.vision.tile_tags=true", "train.seq_len=128")
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    flat = random_weights(spec, 0.08, np.random.default_rng(0))
    flat["embed/embedding"][258:] = 0
    flat["output"][:, 258:] = 0
    out = tmp_path_factory.mktemp("tiles") / "run"
    write_params_checkpoint(unflatten(flat), cfg, out)
    return out, cfg


def test_generate_and_serve_a_tiled_image(tiled_checkpoint, tmp_path):
    """`megajax generate --image` of a wide picture prompts its 3 tiles' placeholders after their tags; a
    chat request with the same picture (continuous batching, prefill in chunks) gives the same answer and
    counts those tokens in usage.prompt_tokens."""
    import base64
    import urllib.request

    from megajax.cli import main
    from megajax.data.tokenizer import byte_tokenizer_json
    from megajax.inference.load import find_source, generation_config, load_model
    from megajax.inference.server import CompletionServer
    run, cfg = tiled_checkpoint
    path = tmp_path / "wide.png"
    picture((40, 18), seed=5).save(path)
    prompt = "[user]<image>what?\n[assistant]"
    out = tmp_path / "gen.json"
    assert main(["generate", "--checkpoint", str(run), "--image", str(path), "--prompt", prompt,
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    (want,) = json.loads(out.read_text())
    ids = want["prompt_ids"]
    assert ids.count(IMAGE_TOKEN) == 12
    assert bytes(t for t in ids if t < 256).decode() == \
        "[user]<tile_1><tile_2><tile_global_thumbnail>what?\n[assistant]"

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(byte_tokenizer_json())
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                                                           "chat_template": template}))
    source = find_source(str(run), None)
    loaded = load_model(generation_config(source, [f"data.tokenizer={tok}"]), source)
    srv = CompletionServer(loaded, port=0, max_batch=2, quiet=True, prefill_chunk=16).start()
    try:
        url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        body = {"model": "m", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]}]}
        req = urllib.request.Request(srv.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            got = json.loads(r.read())
    finally:
        srv.close()
    assert got["choices"][0]["message"]["content"] == want["text"]
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert got["usage"]["completion_tokens"] == len(want["completion_ids"])
