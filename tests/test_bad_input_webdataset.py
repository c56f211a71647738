"""`megajax preprocess --format webdataset` given what it must not accept: an output directory that already
holds shards (they were overwritten, and fewer new ones left old ones to be mixed in), a caption with more
`<image>` markers than the sample's one image, captions that are not UTF-8, and a failure half-way (nothing
is left: no shard, no `.tmp`, no partial directory). Each command runs as a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_bad_input import megajax, paragraph


@pytest.fixture
def pictures(tmp_path) -> Path:
    from PIL import Image
    folder = tmp_path / "pictures"
    folder.mkdir()
    for k in range(6):
        Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(folder / f"p{k}.png")
    return folder


def captions(path: Path, records, raw: bytes = b"") -> str:
    path.write_bytes(raw + b"".join(json.dumps(r).encode() + b"\n" for r in records))
    return str(path)


def preprocess(pictures: Path, caption_file: str, out: Path, *more: str):
    return megajax("preprocess", "--format", "webdataset", "--images", str(pictures), "--captions", caption_file,
                   "--output-dir", str(out), *more)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_an_output_directory_with_shards_is_not_written_into(tmp_path, pictures):
    six = captions(tmp_path / "six.jsonl", [{"image": f"p{k}.png", "caption": "red"} for k in range(6)])
    out = tmp_path / "shards"
    p = preprocess(pictures, six, out, "--shard-size", "2")
    assert p.returncode == 0 and "wrote 3 shards of 6" in p.stderr, p.stderr
    before = {name: (out / name).read_bytes() for name in listing(out)}
    two = captions(tmp_path / "two.jsonl", [{"image": "p0.png", "caption": "blue"}] * 2)
    p = preprocess(pictures, two, out, "--shard-size", "2")
    paragraph(p, "preprocess", f"--output-dir {out}: the directory is not empty", "choose a new directory")
    assert {name: (out / name).read_bytes() for name in listing(out)} == before


def test_more_image_markers_than_images_are_refused(tmp_path, pictures):
    lines = captions(tmp_path / "c.jsonl", [
        {"image": "p0.png", "caption": "<image> a red square"},
        {"image": "p1.png", "messages": [{"role": "user", "content": "<image> and <image>?"},
                                         {"role": "assistant", "content": "one"}]}])
    p = preprocess(pictures, lines, tmp_path / "out")
    paragraph(p, "preprocess", f"{lines}:2: the conversation holds 2 \"<image>\" markers for the sample's one image",
              "p1.png")
    assert listing(tmp_path) == sorted(["c.jsonl", "pictures"] + [f"pictures/p{k}.png" for k in range(6)])


def test_a_failure_half_way_leaves_nothing(tmp_path, pictures):
    """Shards of 1 sample: three are complete when line 4 names a missing picture; none is left."""
    lines = captions(tmp_path / "c.jsonl", [{"image": f"p{k}.png", "caption": "x"} for k in range(3)]
                     + [{"image": "missing.png", "caption": "x"}])
    p = preprocess(pictures, lines, tmp_path / "out", "--shard-size", "1")
    paragraph(p, "preprocess", f"{lines}:4: image", "missing.png")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_captions_are_utf8_and_a_byte_order_mark_is_read(tmp_path, pictures):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps({"image": "p0.png", "caption": "x"}).encode() + b"\n"
                    + b'{"image": "p1.png", "caption": "caf\xe9"}\n')
    paragraph(preprocess(pictures, str(bad), tmp_path / "out"), "preprocess",
              f"{bad}:2: byte 0xe9 at column 36 is not UTF-8")
    assert not (tmp_path / "out").exists()
    bom = captions(tmp_path / "bom.jsonl", [{"image": "p0.png", "caption": "x"}], raw=b"\xef\xbb\xbf")
    p = preprocess(pictures, bom, tmp_path / "out")
    assert p.returncode == 0 and "of 1 image-text samples" in p.stderr, p.stderr
