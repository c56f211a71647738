"""Images for a vision-language model's generation: decoded, resized and normalised as its encoder
expects, and the prompt's `<image>` markers expanded to the placeholder tokens.

    read_image(path) -> PIL image (RGB)                       --image FILE, bounded (megajax/data/user_files.py)
    decode_image(data, what) -> PIL image (RGB)               one clear error naming `what` otherwise
    preprocess(image, vision) -> float32 [image_size, image_size, 3]
    preprocess_tiles(image, vision) -> float32 [tiles, image_size, image_size, 3]   (one tile untiled)
    image_prompt_ids(tokenizer, text, images, vision, tiles) -> token ids with image_seq_length
                                                               placeholders per image (per tile when tiled)

The encoder forms' preprocessing (what their checkpoints were trained with):

    siglip: resize to image_size x image_size (bicubic), pixels / 255, then (x - 0.5) / 0.5
    clip:   resize the shorter side to image_size (bicubic), center crop image_size x image_size,
            pixels / 255, then (x - mean) / std with OpenAI's CLIP mean and std

With model.vision.max_num_tiles > 1 an image is cut into tiles as the training data's are
(megajax/data/tiles.py: resized to its tile grid, no crop, whatever the form), each normalised as above.
"""

from __future__ import annotations

import numpy as np

from megajax.config import VISION_NORMALISATION, VisionConfig
from megajax.data.tiles import cut_tiles, image_run
from megajax.data.user_files import MAX_IMAGE_BYTES, decode_image, read_user_file  # noqa: F401 (the server's too)
from megajax.errors import DataError

IMAGE_MARKER = "<image>"  # where a prompt's image goes (prepended when the prompt has none)
NORMALISATION = VISION_NORMALISATION  # each form's (mean, std)


def read_image(path: str):
    """`--image FILE`, read (a regular file of at most MAX_IMAGE_BYTES) and decoded (DataError naming the
    file when it cannot be: megajax/data/user_files.py)."""
    what = f"--image {path!r}"
    return decode_image(read_user_file(path, what, MAX_IMAGE_BYTES), what)


def preprocess(image, v: VisionConfig) -> np.ndarray:
    """A PIL image as the encoder's input: float32 [image_size, image_size, 3] (the form's resize,
    crop and normalisation, module docstring)."""
    from PIL import Image
    size = v.image_size
    image = image.convert("RGB")
    if v.form == "clip":
        w, h = image.size
        short, long = min(w, h), max(w, h)
        new_long = int(size * long / short)
        image = image.resize((size, new_long) if w <= h else (new_long, size), Image.Resampling.BICUBIC)
        w, h = image.size
        top, left = (h - size) // 2, (w - size) // 2
        pixels = np.asarray(image)[top:top + size, left:left + size]
    else:
        pixels = np.asarray(image.resize((size, size), Image.Resampling.BICUBIC))
    return _normalised(pixels, v)


def _normalised(pixels, v: VisionConfig) -> np.ndarray:
    mean, std = (np.asarray(x, np.float32) for x in NORMALISATION[v.form])
    x = (np.asarray(pixels).astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x - mean) / std


def preprocess_tiles(image, v: VisionConfig) -> np.ndarray:
    """A PIL image as the encoder's pictures [tiles, image_size, image_size, 3]: its tiles with
    model.vision.max_num_tiles > 1 (megajax/data/tiles.py), else the one preprocess'd image."""
    if not v.tiled:
        return preprocess(image, v)[None]
    return np.stack([_normalised(t, v) for t in cut_tiles(image.convert("RGB"), v)])


def image_prompt_ids(tokenizer, text: str, images: int, v: VisionConfig, tiles: list[int] | None = None) -> list[int]:
    """The ids of `text` with each `<image>` marker replaced by image_seq_length placeholder ids
    (model.vision.image_token_id), for each of its image's `tiles` (one each when None; their tags with
    model.vision.tile_tags, megajax/data/tiles.py); without a marker, the images' placeholders come
    first, one marker per image (Hugging Face's LLaVA processors' form). DataError when the markers are
    not the images."""
    tiles = [1] * images if tiles is None else list(tiles)
    markers = text.count(IMAGE_MARKER)
    if markers == 0 and images:
        text = IMAGE_MARKER * images + "\n" + text
        markers = images
    if markers != images:
        raise DataError(f"the prompt holds {markers} {IMAGE_MARKER} marker(s) but {images} image(s) came with it; "
                        f"give one marker per image (or none: the images then come first).")
    pieces = text.split(IMAGE_MARKER)
    ids: list[int] = []
    for n, piece in enumerate(pieces):
        if n:
            ids += image_run(tokenizer, tiles[n - 1], v)[0].tolist()
        if piece:
            ids += list(tokenizer.encode(piece))
    stray = sum(1 for t in ids if t == v.image_token_id) - sum(tiles) * v.image_seq_length
    if stray:
        raise DataError(f"the prompt's text encodes to the image placeholder id {v.image_token_id} "
                        f"(model.vision.image_token_id) {stray} time(s) outside its {IMAGE_MARKER} markers; "
                        f"remove that text.")
    return ids
