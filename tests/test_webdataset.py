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
    assert "shard-000000.tar: member 'bad.png': not an image Pillow can decode" in warnings[0] and "BytesIO" not in warnings[0]
    assert "1 so far in the train split" in warnings[0]
    for s in rows:
        assert caption_of(ds, s) == colour_of(s["images"][0])
    _damaged(tmp_path / "strict", unpaired=False)
    _, strict = dataset(cfg, tmp_path / "strict", strict=True)
    with pytest.raises(DataError, match=r"shard-000000.tar: member 'bad.png': not an image Pillow can decode .*data.strict=true"):
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


def test_loader_image_batches_on_a_mesh(tmp_path):
    """The loader's batch at sample `start` on 2 data-parallel devices x 2 microbatches holds, in order,
    the dataset's samples start.. (tokens, labels, loss mask and images), read by the decoding threads;
    the images [accumulation, B, 1, 16, 16, 3] are split over the batch like the text."""
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    write_shards(solid_samples(12), tmp_path, shard_size=5)
    cfg = tiny(f"data.path={tmp_path}", "train.global_batch=8", "train.micro_batch=2", "mesh.data=2",
               "data.num_workers=3")
    setup = build_setup(make_plan(cfg, 2), jax.devices()[:2])
    from megajax.data.loader import build_run_datasets
    train_ds, valid, report = build_run_datasets(cfg, load_tokenizer("byte"))
    assert valid is None and "12 image-text samples in 3 shards" in report[0]
    loader = setup.loader(train_ds, prefetch=1)
    try:
        abstract = loader.abstract_batch()
        assert abstract["images"].shape == (2, 4, 1, 16, 16, 3) and abstract["tokens"].shape == (2, 4, 40)
        for start in (8, 0):
            batch = loader.batch(start)
            assert batch["images"].sharding.spec == abstract["images"].sharding.spec
            rows = [train_ds[start + k] for k in range(8)]
            want = np.stack([r["tokens"] for r in rows]).reshape(2, 4, 41)
            np.testing.assert_array_equal(np.asarray(batch["tokens"]), want[..., :-1])
            np.testing.assert_array_equal(np.asarray(batch["labels"]), want[..., 1:])
            np.testing.assert_array_equal(np.asarray(batch["loss_mask"]),
                                          np.stack([r["loss_mask"][:-1] for r in rows]).reshape(2, 4, 40))
            np.testing.assert_array_equal(np.asarray(batch["images"]),
                                          np.stack([r["images"] for r in rows]).reshape(2, 4, 1, 16, 16, 3))
        # The loader's rate, decoding included (printed, not asserted: shared CI machines vary).
        begin, n = time.perf_counter(), 0
        for start in range(0, 48, 8):
            jax.block_until_ready(loader.batch(start))
            n += 8
        print(f"loader: {n / (time.perf_counter() - begin):,.0f} images/s (16 x 16, 3 decoding threads)")
    finally:
        loader.close()


def test_preprocess_writes_shards_from_images_and_captions(tmp_path, capsys):
    """`megajax preprocess --format webdataset` stores the folder's pictures with their captions (and a
    conversation) as shards that the dataset reads back paired; a missing picture names the line."""
    from PIL import Image
    from megajax.cli import main
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    lines = []
    for k, name in enumerate(["red", "green", "blue", "green", "red"]):
        fmt = ("png", "jpg")[k % 2]
        Image.new("RGB", (30, 30), COLOURS[name]).save(pictures / f"p{k}.{fmt}")
        lines.append({"image": f"p{k}.{fmt}", "caption": name})
    lines.append({"image": "p0.png", "messages": [{"role": "user", "content": "<image> colour?"},
                                                   {"role": "assistant", "content": "red"}]})
    captions = tmp_path / "captions.jsonl"
    captions.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "shards"
    assert main(["preprocess", "--format", "webdataset", "--images", str(pictures), "--captions", str(captions),
                 "--output-dir", str(out), "--shard-size", "4"]) == 0
    assert "wrote 2 shards of 6 image-text samples" in capsys.readouterr().err
    index = index_shards(shard_files(str(out)))
    assert len(index.samples) == 6 and not index.problems
    assert [s.image.name for s in index.samples][:2] == ["000000001.png", "000000002.jpg"]
    _, ds = dataset(tiny(), out)
    for k in range(5):
        s = ds.load(k)
        assert caption_of(ds, s) == lines[k]["caption"] == colour_of(s["images"][0])
    captions.write_text(json.dumps({"image": "missing.png", "caption": "x"}) + "\n")
    assert main(["preprocess", "--format", "webdataset", "--images", str(pictures), "--captions", str(captions),
                 "--output-dir", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "captions.jsonl:1: image" in err and "missing.png" in err and "Traceback" not in err


def test_tiny_llava_learns_the_drawn_shapes(tmp_path):
    """tiny-llava (shrunk) trained on the embedded drawn shapes: the caption loss falls from ~5.5 (uniform
    over the bytes) below 0.14, the loss of a model that knew the caption's wording but not the picture
    (colour, shape and place: log 6 + log 3 + log 4 nats over ~30 labels); greedy continuation of held-out
    pictures' captions names the colour well above chance (1/6) and the place (1/2)."""
    from megajax.data.shapes import held_out_pictures
    from megajax.train.loop import train
    from megajax.train.state import build_model_spec
    cfg = tiny("train.steps=600", "train.global_batch=32", "optim.lr=3e-3", "optim.warmup_steps=10",
               "optim.weight_decay=0", "train.log_every=100", f"train.run_dir={tmp_path}")
    result = train(cfg, jax.devices()[:1])
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-20:])
    assert first > 4.5 and last < 0.12, (first, last)
    held = held_out_pictures(120)
    v = cfg.model.vision
    images = np.stack([process_image(data, v) for data, _ in held])[:, None]
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())

    def greedy_accuracy(words: int, truth) -> float:
        """How often the byte greedily chosen after the caption's first `words` words starts its next one."""
        rows = [[v.image_token_id] * v.image_seq_length + list((" ".join(c.split()[:words]) + " ").encode())
                for _, c in held]
        length = max(map(len, rows))
        tokens = np.asarray([r + [256] * (length - len(r)) for r in rows], np.int32)
        logits = np.asarray(spec.apply(result.state.params, tokens, images=images))
        chosen = logits[np.arange(len(rows)), [len(r) - 1 for r in rows], :256].argmax(-1)
        return float(np.mean([chr(b) == truth(c) for b, (_, c) in zip(chosen, held)]))

    colour = greedy_accuracy(1, lambda c: c.split()[1][0])  # red green blue yellow purple orange: first letters differ
    place = greedy_accuracy(5, lambda c: c.split()[-1][0])  # "on the" left / right, "at the" top / bottom
    print(f"held-out greedy accuracy: colour {colour:.2f} (chance 0.17), place {place:.2f} (chance 0.5)")
    # on an AVX2 host the same run reaches colour 0.68, place 0.75 (an AVX-512 host: place above 0.8)
    assert colour > 0.35 and place > 0.7, (colour, place)


def test_resumed_image_text_run_is_bitwise_identical(tmp_path):
    """A run stopped at step 2 and resumed reads the same image-text batches: its losses equal an
    uninterrupted run's bitwise (a damaged picture in the shards included: skipped the same way). The
    uninterrupted run validates on image-text batches too."""
    from megajax.train.loop import train
    _damaged(tmp_path / "shards", unpaired=True)
    common = [f"data.path={tmp_path / 'shards'}", "optim.decay_steps=4", "train.global_batch=4",
              "train.log_every=1", "data.num_workers=2", "data.split=5,2,0"]
    full = train(tiny(*common, "train.steps=4", f"train.run_dir={tmp_path / 'full'}", "train.eval_every=2",
                      "train.eval_steps=1"), jax.devices()[:1])
    assert [s for s, _ in full.val_losses] == [2, 4] and all(2 < v < 6 for _, v in full.val_losses)
    part = [*common, f"train.run_dir={tmp_path / 'part'}"]
    first = train(tiny(*part, "train.steps=2"), jax.devices()[:1])
    second = train(tiny(*part, "train.steps=4"), jax.devices()[:1])
    assert second.losses and len(first.losses + second.losses) == 4
    np.testing.assert_array_equal(first.losses + second.losses, full.losses)


@pytest.mark.parametrize("overrides, error, message", [
    (["data.format=webdataset"], "ConfigError",
     r"data.format = 'webdataset' \(image-text shards\) needs model.vision"),
    (["data.num_workers=0"], "ConfigError", r"data.num_workers = 0: must be > 0"),
])
def test_bad_config(overrides, error, message):
    from megajax import errors
    with pytest.raises(getattr(errors, error), match=message):
        load_config(["model/tiny"] if "data.format=webdataset" in overrides else ["model/tiny-llava"],
                    overrides=overrides)


def test_bad_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "not.tar").write_text("hello")
    for path, message in ((tmp_path / "nowhere", "no such file or directory; data.format=webdataset reads a .tar"),
                          (tmp_path / "empty", "the directory holds no \\*.tar shards"),
                          (tmp_path / "not.tar", "not.tar: not a readable tar file")):
        with pytest.raises(DataError, match=message):
            index_shards(shard_files(str(path)))
    with pytest.raises(DataError, match=r"a weighted list of datasets is not supported for image-text shards"):
        shard_files([0.5, "a", 0.5, "b"])


def test_text_longer_than_a_row_is_cut_and_placeholders_past_it_are_reported(tmp_path):
    """A long caption is cut at seq_len + 1 tokens; a marker whose placeholders would not all be inputs of
    the row is reported naming the member (the sample skipped), never a row with part of an image."""
    long = "x" * 100
    write_shards([("0", "png", png((255, 0, 0)), {"caption": long}),
                  ("1", "png", png((255, 0, 0)), {"caption": "y" * 38 + "<image>"})], tmp_path)
    warnings = []
    _, ds = dataset(tiny(), tmp_path, warn=warnings.append)
    rows = [ds[i] for i in range(2)]
    for s in rows:  # sample 1 skipped: sample 0 in its place
        assert list(s["tokens"]) == [257] * 4 + [ord("x")] * 37 and s["loss_mask"][3:40].all()
    assert len(warnings) == 1 and ("member '1.json': the image's placeholders end at token 42, beyond the "
                                   "train.seq_len = 40 inputs of a row" in warnings[0])


def test_bench_times_the_image_step_on_image_text_shards(tmp_path):
    """`megajax bench` of a vision-language model on image-text shards compiles and times the step with
    images (the encoder and projector in it), not the text-only one."""
    from megajax.perf.bench import compiled_step
    write_shards(solid_samples(12), tmp_path / "shards", shard_size=6)
    step = compiled_step(tiny(f"data.path={tmp_path / 'shards'}", "train.global_batch=8", "mesh.data=-1"))
    try:
        assert step.batch["images"].shape[:3] == (1, 8, 1)
        step.run()  # a step compiled for text alone refuses a batch that holds `images`
    finally:
        step.loader.close()
