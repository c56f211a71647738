"""Files a user names for one command (`generate --image`, `--prompts-file`, `--chat-template`, a served
request's local image, `preprocess --images`), read within bounds, and images decoded within bounds.

    read_user_file(path, what, limit) -> bytes       a regular file of at most `limit` bytes, else DataError
    decode_image(data, what) -> PIL image (RGB)      at most MAX_IMAGE_PIXELS pixels, else DataError

A FIFO, a character device (/dev/zero, /dev/stdin) or a directory is refused before anything is read:
open() does not wait for a FIFO's writer (O_NONBLOCK), and the kind of file is read off the opened
descriptor, so a path swapped after a check cannot slip through. A file that grows while it is read is
cut at `limit` + 1 bytes and refused. Every error names `what` (the option and the file, or a request's
image) and the bound.
"""

from __future__ import annotations

import io
import os
import re
import stat

from megajax.errors import DataError

MAX_IMAGE_BYTES = 64 * 2**20  # an image file (4x a 16 MiB served request's body)
MAX_IMAGE_PIXELS = 2**26  # width x height of one image (8192 x 8192); the encoder resizes it to image_size
MAX_TEXT_BYTES = 64 * 2**20  # a prompts file or a chat template


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def kind_of(path) -> str | None:
    """What is at `path` when it is neither a regular file nor a directory ("a FIFO (named pipe)", "a
    character device", ...), else None (a file, a directory, or nothing there)."""
    try:
        mode = os.stat(os.fspath(path)).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else _kind(mode)


def open_regular(path, what: str, limit: int | None = None) -> int:
    """A descriptor (blocking) of the regular file at `path`; DataError naming `what` when it cannot be
    opened, is not a regular file, or holds more than `limit` bytes (None: any size)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise DataError(f"{what}: cannot read it ({e.strerror or e}).") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DataError(f"{what}: {_kind(info.st_mode)}, not a regular file; give a file.")
        if limit is not None and info.st_size > limit:
            raise DataError(f"{what}: {info.st_size:,} bytes, more than the {limit:,} bytes accepted.")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_file(path, what: str, limit: int) -> bytes:
    """The bytes of the regular file at `path`; DataError naming `what` when it cannot be opened, is not a
    regular file, or holds more than `limit` bytes."""
    fd = open_regular(path, what, limit)
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise DataError(f"{what}: cannot read it ({e.strerror or e}).") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise DataError(f"{what}: more than the {limit:,} bytes accepted (it grew while being read).")
    return data


def decode_image(data: bytes, what: str):
    """The image in `data` (PNG, JPEG, ... anything Pillow reads) as RGB; DataError naming `what` when it
    is not one, or has more than MAX_IMAGE_PIXELS pixels (read off its header, before it is decoded)."""
    import warnings
    from PIL import Image, UnidentifiedImageError
    accepted = "expected PNG, JPEG, WebP, GIF or another common image format"
    try:
        with warnings.catch_warnings():  # Pillow's own size warning: the bound below says more
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # past twice Pillow's limit, refused before its size is known
        pixels = re.search(r"\((\d+) pixels\)", str(e))
        raise DataError(f"{what}: {int(pixels.group(1)) if pixels else 'too many':,} pixels, more than the "
                        f"{MAX_IMAGE_PIXELS:,} accepted; give a smaller image.") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        if isinstance(e, UnidentifiedImageError):  # Pillow's text names its in-memory file object
            e = "Pillow recognises no image format in it"
        raise DataError(f"{what}: not an image Pillow can decode ({len(data):,} bytes starting {data[:8]!r}: "
                        f"{e}); {accepted}.") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise DataError(f"{what}: {width} x {height} = {width * height:,} pixels, more than the "
                        f"{MAX_IMAGE_PIXELS:,} accepted; give a smaller image (the encoder resizes it anyway).")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:
        raise DataError(f"{what}: a damaged {image.format or 'image'} file ({width} x {height}, {len(data):,} "
                        f"bytes: {e}); {accepted}.") from None
    return image.convert("RGB")
