"""Image-text shards (data.format=webdataset): pairing by key, damaged and unpaired members (skipped and
counted, or fatal with data.strict), deterministic resumable samples, the encoders' image preprocessing
against transformers' processors, the loader's image batches, `megajax preprocess --format webdataset`,
and tiny-llava learning the embedded drawn shapes."""

import io
import json
import tarfile
import time

import jax
import numpy as np
import pytest

from megajax.config import load_config
from megajax.data.tokenizer import load_tokenizer
from megajax.data.webdataset import (ImageTextDataset, index_shards, process_image, shard_files, write_shards)
from megajax.errors import DataError

# tiny-llava shrunk (as tests/test_vision.py's): 16 x 16 pictures in 8 x 8 patches, 4 placeholders each.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vision.image_size=16", "model.vision.hidden_size=32",
        "model.vision.num_heads=4", "model.vision.ffn_hidden_size=64", "train.seq_len=40",
        "data.format=webdataset", "data.split=100,0,0", "train.eval_every=0", "train.sample_tokens=0",
        "logging.tensorboard=false"]
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def tiny(*overrides):
    return load_config(["model/tiny-llava"], overrides=[*TINY, *overrides])


def png(rgb, size=(20, 12)) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def solid_samples(n):
    """(key, field, bytes, record): plain pictures of a colour, captioned with its name."""
    names = list(COLOURS)
    return [(f"{k:04d}", "png", png(COLOURS[names[k % 3]]), {"caption": names[k % 3]}) for k in range(n)]


def caption_of(ds, sample) -> str:
    return bytes(int(t) for t in sample["tokens"] if t < 256).decode()


def colour_of(image) -> str:
    mean = image.reshape(-1, 3).mean(0)  # SigLIP normalisation: the colour's channel is +1, the others -1
    return list(COLOURS)[int(np.argmax(mean))]


def dataset(cfg, path, **kw):
    index = index_shards(shard_files(str(path)), strict=kw.get("strict", False))
    return index, ImageTextDataset(index, index.samples, tokenizer=load_tokenizer("byte"), template=None,
                                   vision=cfg.model.vision, seq_len=cfg.train.seq_len, seed=3, **kw)


def test_samples_pair_by_key_and_are_deterministic(tmp_path):
    """Every sample's caption names its own picture's colour (members are paired by key, across shard
    boundaries and whatever the member order), the placeholders precede the trained caption, and sample i
    is the same whatever was read before (a resumed run reads the same samples)."""
    samples = solid_samples(10)
    write_shards(samples[:7], tmp_path, shard_size=4)
    with tarfile.open(tmp_path / "late.tar", "w") as tar:  # json before image, keys out of order
        for key, fld, data, record in reversed(samples[7:]):
            for name, blob in ((f"{key}.json", json.dumps(record).encode()), (f"{key}.{fld}", data)):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    cfg = tiny()
    index, ds = dataset(cfg, tmp_path, num_samples=25)
    assert [p.name for p in index.shards] == ["late.tar", "shard-000000.tar", "shard-000001.tar"]
    assert len(index.samples) == 10 and not index.problems and len(ds) == 30
    first = [ds[i] for i in range(len(ds))]
    for s in first:
        caption = caption_of(ds, s)
        assert caption == colour_of(s["images"][0]), caption
        assert list(s["tokens"][:4]) == [257] * 4 and s["tokens"][4 + len(caption)] == 256  # then end of document
        want = np.zeros(41, np.float32)
        want[3:4 + len(caption)] = 1  # the labels: the caption's tokens and the end-of-document token
        np.testing.assert_array_equal(s["loss_mask"], want)
    assert sorted(caption_of(ds, s) for s in first[:10]) == sorted(r["caption"] for *_, r in samples)
    _, again = dataset(cfg, tmp_path, num_samples=25)
    for i in (29, 3, 17, 0):
        for k in first[i]:
            np.testing.assert_array_equal(again[i][k], first[i][k])


def _damaged(tmp_path, unpaired=True):
    """Shards of 6 good samples and one whose png is cut (third), and (`unpaired`) one image without its
    json and one json without its image."""
    samples = solid_samples(6)
    samples.insert(2, ("bad", "png", png((0, 0, 255))[:40], {"caption": "blue"}))
    write_shards(samples, tmp_path, shard_size=100)
    if not unpaired:
        return
    with tarfile.open(tmp_path / "shard-000001.tar", "w") as tar:
        for name, blob in (("lonely.png", png((255, 0, 0))), ("orphan.json", b'{"caption": "red"}')):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def test_unpaired_members_are_named_and_left_out(tmp_path):
    _damaged(tmp_path)
    index = index_shards(shard_files(str(tmp_path)))
    assert len(index.samples) == 7 and len(index.problems) == 2
    assert any("shard-000001.tar: member 'lonely.png' has no json of the same key 'lonely'" in p
               for p in index.problems)
    assert any("member 'orphan.json' has no image (jpg/png)" in p for p in index.problems)
    with pytest.raises(DataError, match=r"shard-000001.tar: member '(lonely.png|orphan.json)' has no .*data.strict"):
        index_shards(shard_files(str(tmp_path)), strict=True)


def test_damaged_image_is_skipped_and_counted_or_fatal_when_strict(tmp_path):
    """The cut png is reported once, naming shard and member, and the next sample of the order takes its
    place (the same one each time); with data.strict it is an error."""
    _damaged(tmp_path)
    cfg = tiny()
    warnings = []
    _, ds = dataset(cfg, tmp_path, warn=warnings.append)
    rows = [ds[i] for i in range(len(ds))] + [ds[i] for i in range(len(ds))]
    assert len(warnings) == 1 and list(ds.skipped) == [2]
    assert "shard-000000.tar: member 'bad.png' is not a readable image" in warnings[0]
    assert "1 so far in the train split" in warnings[0]
    for s in rows:
        assert caption_of(ds, s) == colour_of(s["images"][0])
    _damaged(tmp_path / "strict", unpaired=False)
    _, strict = dataset(cfg, tmp_path / "strict", strict=True)
    with pytest.raises(DataError, match=r"shard-000000.tar: member 'bad.png' is not a readable image .*data.strict=true"):
        [strict[i] for i in range(len(strict))]


def test_conversation_with_image_marker(tmp_path):
    """A messages sample: the marker becomes the placeholders where it stands, and only the answer trains."""
    record = {"messages": [{"role": "user", "content": "What colour? <image>"},
                           {"role": "assistant", "content": "green"}]}
    write_shards([("0", "png", png((0, 255, 0)), record)], tmp_path)
    cfg = tiny("train.seq_len=64")
    from megajax.data.chat import BYTE_CHAT_TEMPLATE
    index = index_shards(shard_files(str(tmp_path)))
    ds = ImageTextDataset(index, index.samples, tokenizer=load_tokenizer("byte"), template=BYTE_CHAT_TEMPLATE,
                          vision=cfg.model.vision, seq_len=64, seed=0)
    s = ds[0]
    text = "user: What colour? <image>\nassistant: green\n"
    before = len("user: What colour? ")
    tokens = list(s["tokens"][:len(text) - len("<image>") + 4])
    assert tokens[before:before + 4] == [257] * 4
    assert bytes(t for t in tokens if t < 256).decode() == text.replace("<image>", "")
    trained = bytes(int(t) for t, m in zip(s["tokens"][1:], s["loss_mask"][:-1]) if m).decode()
    assert trained == "green\n"
    bad = {"messages": [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}]}
    write_shards([("1", "png", png((0, 255, 0)), bad)], tmp_path / "two")
    index = index_shards(shard_files(str(tmp_path / "two")))
    two = ImageTextDataset(index, index.samples, tokenizer=load_tokenizer("byte"), template=BYTE_CHAT_TEMPLATE,
                           vision=cfg.model.vision, seq_len=64, seed=0, strict=True)
    with pytest.raises(DataError, match=r"member '1.json': the text holds 2 \"<image>\" markers"):
        two[0]


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_image_preprocessing_equals_transformers(form):
    """Resize and normalisation equal transformers' SiglipImageProcessor / CLIPImageProcessor on a
    non-square picture (pixels within one 8-bit step: both resize with Pillow's bicubic)."""
    from PIL import Image
    from transformers import CLIPImageProcessor, SiglipImageProcessor
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (45, 70, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    cfg = load_config(["model/tiny-llava"], overrides=[f"model.vision.form={form}", "model.vision.image_size=24"]
                      + (["model.vision.feature_select=full"] if form == "siglip" else []))
    ours = process_image(buf.getvalue(), cfg.model.vision)
    if form == "siglip":
        proc = SiglipImageProcessor(size={"height": 24, "width": 24})
    else:
        proc = CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    want = proc(images=Image.fromarray(pixels), return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    assert ours.shape == want.shape == (24, 24, 3)
    step = 1 / 255 / min(proc.image_std)
    np.testing.assert_allclose(ours, want, atol=1.01 * step)
    assert np.mean(np.abs(ours - want)) < 0.05 * step
