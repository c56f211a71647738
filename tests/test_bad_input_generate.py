"""Wrong input on `megajax generate` (and the image files `megajax serve` reads), as a user types it: each
class is one paragraph on stderr naming the flag, the file (or line) and the bound, exit status 2, nothing
written, before the model loads. Special files (/dev/zero, a FIFO, a directory) and huge files are refused
without being read; an image too large in pixels says so with its size and the limit."""

from __future__ import annotations

import json
import os
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from megajax.checkpoint.manager import write_params_checkpoint
from megajax.checkpoint.source import unflatten
from megajax.config import load_config
from megajax.data.user_files import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from megajax.train.state import build_model_spec
from random_model import random_weights
from test_bad_input import megajax, paragraph
from test_vlm_generate import TINY, write_png

RAISING = "{{ raise_exception('only one user turn, please') }}"


def checkpoint(out, cfg):
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    write_params_checkpoint(unflatten(random_weights(spec, 0.05, np.random.default_rng(0))), cfg, out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(a text model, a vision-language model): random tiny checkpoints with the byte tokenizer (no chat template)."""
    root = tmp_path_factory.mktemp("bad-generate")
    text = load_config(overrides=["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                  "model.ffn_hidden_size=64", "model.vocab_size=257", "train.seq_len=32"])
    vlm = load_config(["model/tiny-llava"], overrides=TINY)
    return checkpoint(root / "text", text), checkpoint(root / "vlm", vlm)


def generate(tmp_path, model, *args):
    """`megajax generate` refused: the paragraph; the --json it was given is not written."""
    out = tmp_path / "out.json"
    p = megajax("generate", "--checkpoint", str(model), "--json", str(out), *args)
    assert not out.exists()
    return p


def png_header(width: int, height: int) -> bytes:
    """A PNG that says it is width x height (its pixel data empty): Pillow reads the size off the header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


# ----------------------------------------------------------------------------------------------
# Flags: each names itself alone

@pytest.mark.parametrize("args, words, absent", [
    (["--max-new-tokens", "0"], ["--max-new-tokens 0: must be >= 1"], "--batch-size"),
    (["--batch-size", "0"], ["--batch-size 0: must be >= 1"], "--max-new-tokens"),
    (["--batch-size", "-3", "--max-new-tokens", "5"], ["--batch-size -3: must be >= 1"], "--max-new-tokens"),
])
def test_each_flag_names_only_itself(tmp_path, args, words, absent):
    err = paragraph(generate(tmp_path, "nowhere", "--prompt", "hi", *args), "generate", *words)
    assert absent not in err


# ----------------------------------------------------------------------------------------------
# Image files: special and huge files refused unread; sizes and names in the messages

def _special(tmp_path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe.png")  # nobody writes it: reading it would wait for ever
        return str(tmp_path / "pipe.png")
    if kind == "directory":
        (tmp_path / "dir.png").mkdir()
        return str(tmp_path / "dir.png")
    if kind == "huge":
        with open(tmp_path / "huge.png", "wb") as f:  # sparse: no disk used
            f.truncate(MAX_IMAGE_BYTES + 1)
        return str(tmp_path / "huge.png")
    return "/dev/zero"


@pytest.mark.parametrize("kind, words", [
    ("/dev/zero", ["a character device, not a regular file"]),
    ("fifo", ["a FIFO (named pipe), not a regular file"]),
    ("directory", ["a directory, not a regular file"]),
    ("huge", [f"{MAX_IMAGE_BYTES + 1:,} bytes, more than the {MAX_IMAGE_BYTES:,} bytes accepted"]),
])
def test_image_files_that_are_not_images_are_refused_unread(tmp_path, models, kind, words):
    path = _special(tmp_path, kind)
    paragraph(generate(tmp_path, models[1], "--image", path, "--prompt", "hi"), "generate", f"--image {path!r}",
              *words)


@pytest.mark.parametrize("size, words", [
    ((9000, 8000), ["9000 x 8000 = 72,000,000 pixels", f"more than the {MAX_IMAGE_PIXELS:,} accepted"]),
    ((20000, 20000), ["400,000,000 pixels", f"more than the {MAX_IMAGE_PIXELS:,} accepted"]),  # Pillow's own bomb
])
def test_an_image_too_large_in_pixels_says_so(tmp_path, models, size, words):
    (tmp_path / "big.png").write_bytes(png_header(*size))
    err = paragraph(generate(tmp_path, models[1], "--image", str(tmp_path / "big.png"), "--prompt", "hi"),
                    "generate", f"--image '{tmp_path / 'big.png'}'", *words)
    assert "not an image" not in err


def test_an_undecodable_image_names_the_file_not_a_memory_buffer(tmp_path, models):
    (tmp_path / "notes.png").write_text("not an image at all")
    err = paragraph(generate(tmp_path, models[1], "--image", str(tmp_path / "notes.png"), "--prompt", "hi"),
                    "generate", f"--image '{tmp_path / 'notes.png'}'", "not an image Pillow can decode",
                    "recognises no image format")
    assert "BytesIO" not in err and "0x" not in err


def test_served_local_images_are_read_within_the_same_bounds(tmp_path):
    """`megajax serve --allowed-local-media-path`: a file:// URL of a FIFO or a directory under the root is a 400
    naming the request's part, not a read that never ends."""
    from megajax.inference.openai_api import OpenAIDialect
    from megajax.inference.request import RequestError
    fake = SimpleNamespace(service=SimpleNamespace(allowed_media=tmp_path.resolve()))
    for kind, words in (("fifo", "a FIFO"), ("directory", "a directory"), ("huge", "bytes accepted")):
        path = _special(tmp_path, kind)
        with pytest.raises(RequestError, match=words) as e:
            OpenAIDialect._local_image(fake, f"file://{path}", "'messages'[0].content[1]")
        assert "'messages'[0].content[1]" in str(e.value)


# ----------------------------------------------------------------------------------------------
# <image> markers and images

@pytest.mark.parametrize("prompt, images, words", [
    ("a <image> b", 0, ["--prompt 0 holds 1 <image> marker(s) but 0 image(s) came with --image"]),
    ("<image> and <image>", 1, ["--prompt 0 holds 2 <image> marker(s) but 1 image(s)"]),
])
def test_markers_and_images_must_agree(tmp_path, models, prompt, images, words):
    files = [a for k in range(images) for a in ("--image", str(write_png(tmp_path / f"{k}.png")))]
    paragraph(generate(tmp_path, models[1], "--prompt", prompt, *files), "generate", *words)


def test_an_image_for_a_text_model_is_refused(tmp_path, models):
    paragraph(generate(tmp_path, models[0], "--prompt", "hi", "--image", str(write_png(tmp_path / "a.png"))),
              "generate", "no image encoder", "a.png")


# ----------------------------------------------------------------------------------------------
# Conversations and prompts files

@pytest.mark.parametrize("line, words", [
    ({"messages": "hi"}, ["line 1", "\"messages\" must be a non-empty list"]),
    ({"messages": []}, ["line 1", "\"messages\" must be a non-empty list"]),
    ({"messages": [{"role": "bot", "content": "x"}]}, ["line 1", "message 0 has role 'bot'", "accepted roles"]),
    ({"messages": [{"role": "user", "content": 3}]}, ["line 1", "content must be a string"]),
    ({"messages": ["hi"]}, ["line 1", "message 0 is \"hi\""]),
    ({"text": "hi"}, ["line 1", "an object with \"messages\""]),
    ("{not json", ["line 1: not valid JSON"]),
])
def test_bad_conversations_are_named_by_line(tmp_path, line, words):
    (tmp_path / "p.jsonl").write_text(line if isinstance(line, str) else json.dumps(line))
    paragraph(generate(tmp_path, "nowhere", "--prompts-file", str(tmp_path / "p.jsonl")), "generate",
              f"--prompts-file '{tmp_path / 'p.jsonl'}'", *words)


def test_a_conversation_for_a_model_without_a_template(tmp_path, models):
    paragraph(generate(tmp_path, models[0], "--chat", "--prompt", "hi"), "generate", "--prompt 0 is a conversation",
              "has no chat template", "pass --chat-template FILE")


def test_a_template_that_refuses_the_messages(tmp_path, models):
    (tmp_path / "t.jinja").write_text(RAISING)
    paragraph(generate(tmp_path, models[0], "--chat", "--prompt", "hi", "--chat-template", str(tmp_path / "t.jinja")),
              "generate", "--prompt 0: the chat template refused the messages: only one user turn")


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory"])
def test_prompt_and_template_files_that_are_not_files(tmp_path, kind):
    path = _special(tmp_path, kind)
    paragraph(generate(tmp_path, "nowhere", "--prompts-file", path), "generate", f"--prompts-file {path!r}",
              "not a regular file")
    paragraph(generate(tmp_path, "nowhere", "--chat", "--prompt", "hi", "--chat-template", path), "generate",
              f"--chat-template {path!r}", "not a regular file")


def test_a_chat_template_for_plain_prompts(tmp_path):
    (tmp_path / "t.jinja").write_text(RAISING)
    paragraph(generate(tmp_path, "nowhere", "--prompt", "hi", "--chat-template", str(tmp_path / "t.jinja")),
              "generate", "renders conversations, and these prompts are plain text", "add --chat")


# ----------------------------------------------------------------------------------------------
# `plan --cluster` and `bench --topology`: one list of device kinds (megajax/perf/device_kinds.py)

def test_plan_and_bench_know_the_same_device_kinds(tmp_path):
    import re

    from megajax.perf.bench import parse_topology
    from megajax.perf.device_kinds import load_device_kinds, parse_cluster
    from megajax.perf.fit import CAPACITY_GIB
    kinds = load_device_kinds(None)
    assert {"H100", "H200", "A100", "MI300X", "MI250", "CPU"} <= set(kinds)
    for name, kind in kinds.items():
        assert parse_topology(f"8x{name.lower()}") == (8, name, kind.memory_gib)
        assert parse_cluster(f"8x{name}", kinds)[:2] == (8, name)
        assert name == "CPU" or CAPACITY_GIB[name] == kind.memory_gib
    plan = paragraph(megajax("plan", "--config", "model/tiny", "--cluster", "8xTPU"), "plan", "--cluster '8xTPU'",
                     "unknown device kind 'TPU'")
    bench = paragraph(megajax("bench", "--config", "model/tiny", "--topology", "8xTPU"), "bench",
                      "--topology '8xTPU'", "unknown device kind 'TPU'")
    listed = [re.search(r"known kinds: ([A-Z0-9, ]+)", err).group(1).strip() for err in (plan, bench)]
    assert listed[0] == listed[1] == ", ".join(kinds)
    paragraph(megajax("bench", "--config", "model/tiny", "--topology", "12xH100"), "bench",
              "--topology '12xH100': 12 devices are not whole nodes of 8 H100")


# ----------------------------------------------------------------------------------------------
# README's synopsis of preprocess: --images goes with --format webdataset only (the text forms with indexed)

@pytest.mark.parametrize("args, words", [
    (["--format", "indexed", "--images", "pics", "--captions", "c.jsonl", "--output-dir", "out"],
     ["--images, --captions and --output-dir write image-text shards; add --format webdataset"]),
    (["--format", "webdataset", "--input", "a.jsonl", "--images", "pics", "--captions", "c.jsonl", "--output-dir",
      "out"], ["--input, --merge and --output-prefix are for text datasets"]),
])
def test_preprocess_forms_are_those_of_the_synopsis(tmp_path, args, words):
    from test_docs import synopsis
    lines = synopsis()["preprocess"]
    assert any(line.startswith("megajax preprocess --format webdataset --images") for line in lines)
    assert not any("indexed|webdataset" in line for line in lines)
    paragraph(megajax("preprocess", *args, cwd=tmp_path), "preprocess", *words)
    assert not (tmp_path / "out").exists()
