"""NVLM-style image tiles (model.vision.max_num_tiles > 1; InternVL's and NVLM's dynamic tiling,
Megatron-LM's --use-tiling --max-num-tiles N --use-thumbnail --use-tile-tags).

    tile_grid(width, height, max_num_tiles, image_size) -> (columns, rows)
    cut_tiles(image, vision) -> [PIL images of image_size x image_size]   tiles row-major, then the thumbnail
    image_run(tokenizer, tiles, vision) -> (ids, placeholder)             the tokens one image's marker becomes

The grid: among the (columns, rows) with columns x rows <= max_num_tiles, the one whose ratio
columns / rows is closest to the image's width / height; the candidates are taken by tile count, then
columns, ascending, and an equally close later candidate (a larger grid) replaces the best one when the
image holds more than half of that grid's pixels (columns x rows x image_size^2 / 2), as InternVL's
rule does. The image is resized (bicubic, aspect ratio not kept) to columns x image_size by
rows x image_size and cut into the tiles, left to right, top to bottom; with use_thumbnail and more
than one tile, the whole image resized to image_size x image_size follows as the last tile.

Each tile is a picture to the encoder: it takes image_seq_length placeholders in the text, the tiles
of an image one after another. With tile_tags, each tile's placeholders follow a text tag: NVLM's
`<tile_1>`, `<tile_2>`, ... and `<tile_global_thumbnail>` for a tile that shows the whole image (the
thumbnail, or the lone tile of a 1 x 1 grid). The tags are encoded by the tokenizer like any text and
train nothing.
"""

from __future__ import annotations

import numpy as np

from megajax.config import VisionConfig

THUMBNAIL_TAG = "<tile_global_thumbnail>"


def tile_grid(width: int, height: int, max_num_tiles: int, image_size: int) -> tuple[int, int]:
    """(columns, rows) of the tiles an image of width x height pixels is cut into (module docstring)."""
    aspect = width / height
    grids = sorted(((c, r) for c in range(1, max_num_tiles + 1) for r in range(1, max_num_tiles + 1)
                    if c * r <= max_num_tiles), key=lambda g: (g[0] * g[1], g[0]))
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and width * height > 0.5 * image_size * image_size * c * r:
            best = (c, r)
    return best


def cut_tiles(image, v: VisionConfig) -> list:
    """A PIL image's tiles (image_size x image_size PIL images, module docstring): one per grid cell,
    row-major, then the thumbnail when use_thumbnail and the grid has several cells."""
    from PIL import Image
    size = v.image_size
    cols, rows = tile_grid(image.size[0], image.size[1], v.max_num_tiles, size)
    resized = image.resize((cols * size, rows * size), Image.Resampling.BICUBIC)
    tiles = [resized.crop((c * size, r * size, (c + 1) * size, (r + 1) * size))
             for r in range(rows) for c in range(cols)]
    if v.use_thumbnail and len(tiles) > 1:
        tiles.append(image.resize((size, size), Image.Resampling.BICUBIC))
    return tiles


def tile_tags(tiles: int, v: VisionConfig) -> list[str]:
    """The text tag of each of an image's `tiles` tiles (module docstring)."""
    whole = tiles == 1 or (v.use_thumbnail and tiles > 1)  # the last tile shows the whole image
    return [THUMBNAIL_TAG if whole and k == tiles - 1 else f"<tile_{k + 1}>" for k in range(tiles)]


def image_run(tokenizer, tiles: int, v: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T] int32, placeholder [T] bool): the tokens an image of `tiles` tiles takes in the text,
    each tile's image_seq_length placeholders (model.vision.image_token_id), after its tag with
    tile_tags; `placeholder` False at the tags' tokens."""
    run = np.full(v.image_seq_length, v.image_token_id, np.int32)
    if not v.tile_tags:
        return np.tile(run, tiles), np.ones(tiles * v.image_seq_length, bool)
    from megajax.data.chat import _encode_with_offsets
    ids, placeholder = [], []
    for tag in tile_tags(tiles, v):
        t = _encode_with_offsets(tokenizer, tag)[0].astype(np.int32)
        ids += [t, run]
        placeholder += [np.zeros(len(t), bool), np.ones(len(run), bool)]
    return np.concatenate(ids), np.concatenate(placeholder)
