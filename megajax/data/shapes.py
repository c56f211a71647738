"""The embedded image-text default (data.format=webdataset with data.path empty): simple drawn pictures
and their captions, generated on first use, so a vision-language run needs no download.

Each picture is a 64 x 64 PNG of one filled shape (circle, square, triangle) of one colour (red,
green, blue, yellow, purple, orange) on a white ground, placed on the left, right, top or bottom,
with a small seeded jitter of size and place; its caption names all three: "a red circle on the
left". Samples come from one seeded generator, so the shards are the same on every machine; they
are written once as WebDataset tar shards (megajax/data/webdataset.py) to the cache directory
(megajax.config.user_cache_dir) and read back through the same dataset and loader code as any
user's shards. `held_out_pictures` draws pictures from another seed for tests of what a model learnt.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from megajax.config import user_cache_dir

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 60, 220), "yellow": (235, 205, 20),
           "purple": (140, 40, 170), "orange": (245, 130, 20)}
POSITIONS = {"left": (0.27, 0.5), "right": (0.73, 0.5), "top": (0.5, 0.27), "bottom": (0.5, 0.73)}
PHRASE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
SIZE = 64
VERSION = 1  # bump when the drawing or captions change: a new cache entry


def caption(shape: str, colour: str, position: str) -> str:
    return f"a {colour} {shape} {PHRASE[position]}"


def draw(shape: str, colour: str, position: str, rng: np.random.RandomState) -> bytes:
    """One picture as PNG bytes."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    d = ImageDraw.Draw(img)
    cx, cy = POSITIONS[position]
    cx, cy = cx * SIZE + rng.uniform(-3, 3), cy * SIZE + rng.uniform(-3, 3)
    r = SIZE * rng.uniform(0.14, 0.2)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def pictures(count: int, seed: int):
    """(key, "png", bytes, {"caption": ...}) of `count` seeded pictures."""
    rng = np.random.RandomState(seed)
    colours = list(COLOURS)
    for k in range(count):
        shape, colour, position = (SHAPES[rng.randint(len(SHAPES))], colours[rng.randint(len(colours))],
                                   list(POSITIONS)[rng.randint(len(POSITIONS))])
        yield f"{k:06d}", "png", draw(shape, colour, position, rng), {"caption": caption(shape, colour, position)}


def held_out_pictures(count: int, seed: int = 12345) -> list[tuple[bytes, str]]:
    """(PNG bytes, caption) of pictures drawn from another seed than the embedded shards'."""
    return [(data, record["caption"]) for _, _, data, record in pictures(count, seed)]


def shapes_shards(count: int = 4096, shard_size: int = 1024) -> str:
    """The directory of the embedded shards, written on first use."""
    import os
    import shutil
    import tempfile
    from megajax.data.webdataset import write_shards
    out = user_cache_dir() / "shapes" / f"shapes-v{VERSION}-{count}-{shard_size}"
    if not out.is_dir():  # written beside it, then renamed: processes starting together never see half of it
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        write_shards(pictures(count, seed=0), scratch, shard_size=shard_size)
        try:
            os.rename(scratch, out)
        except OSError:  # another process renamed its copy first
            shutil.rmtree(scratch, ignore_errors=True)
    return str(out)
