"""Image-text shards in the WebDataset form (data.format=webdataset; Megatron-Energon's and LLaVA's
training data): tar files whose members are grouped into samples by key.

A member's key is its path up to the first "." of its file name, its field the rest
(`000123.jpg` -> key `000123`, field `jpg`). A sample is one image (`jpg`, `jpeg`, `png` or `webp`)
and one `json` of the same key, holding either

    {"caption": "a red circle on the left"}                      the caption is trained
    {"messages": [{"role": "user", "content": "<image>\\nWhat is this?"},
                  {"role": "assistant", "content": "A red circle."}]}   rendered with the chat template

`<image>` marks where the image goes (a caption or conversation without one gets it at the start of
the caption / first user message); it becomes model.vision.image_seq_length copies of
model.vision.image_token_id, whose positions take the image's features and train nothing. Other
fields of a sample are ignored. An image without its json, a json without its image, or a key seen
twice is reported naming the shard and member, and left out (data.strict=true: an error); pairing is by
key only, so nothing is paired across samples.

Reading: every shard's tar headers are indexed once (names, data offsets and sizes; the file contents
are not read), and sample i is a pure function of (shards, seq_len, seed, i): epoch i // n of a seeded
permutation per epoch, so a resumed run reads the same samples and each process reads only the rows its
own devices hold (the loader asks for exactly those), seeking to their members. A damaged image (Pillow
cannot decode it), unreadable json, or text that does not fit a row is reported naming the shard and
member, and the next sample of the permutation is taken in its place, deterministically (data.strict:
an error). Images are decoded with Pillow, converted to RGB, resized to model.vision.image_size
(SigLIP form: the whole picture squashed to the square, bicubic; CLIP form: the shorter side to the
size, then the centre crop, as the two encoders' processors do) and normalised with the encoder's
mean and standard deviation (SigLIP 0.5 / 0.5; CLIP OpenAI's).

`dataset[i]` is a dict: tokens [seq_len + 1] int32 (padded with pad_id), loss_mask [seq_len + 1]
float32 (loss_mask[t] = 1 when the token at t + 1 is trained: a caption or answer token, not a
placeholder, not padding), images [1, image_size, image_size, 3] float32. With model.vision.max_num_tiles
> 1 the image is cut into tiles (megajax/data/tiles.py; squashed to the tile grid whatever the form)
and images is [max_tiles, image_size, image_size, 3]: the sample's tiles first, then zero pictures,
which no placeholder takes (the text holds the placeholders, and tags, of the sample's own tiles).
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megajax.config import VisionConfig
from megajax.data.chat import (_encode_with_offsets, _spans_to_tokens, _turn_spans, check_messages, conversation_error,
                                jsonl_records)
from megajax.data.chat_template import ChatTemplateError, has_generation_tags, render_with_answers, special_token
from megajax.data.tiles import cut_tiles, image_run
from megajax.data.text_files import parse_json
from megajax.data.user_files import MAX_IMAGE_BYTES, decode_image, kind_of, read_user_file
from megajax.errors import DataError
from megajax.paths import fresh_output_dir

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
MARKER = "<image>"
# The encoders' preprocessing: mean and standard deviation per RGB channel of pixels in [0, 1].
NORMALIZATION = {
    "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
}


# ----------------------------------------------------------------------------
# Shards and their index
# ----------------------------------------------------------------------------

def shard_files(path: str, key: str = "data.path") -> list[Path]:
    """The tar shards of data.path: one .tar file, or every *.tar of a directory (sorted by name)."""
    if not isinstance(path, str):
        raise DataError(f"{key} = {path!r}: data.format=webdataset reads one .tar shard or a directory of "
                        f"*.tar shards (a weighted list of datasets is not supported for image-text shards).")
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".tar" and f.is_file())
        if not files:
            raise DataError(f"{key} = {path!r}: the directory holds no *.tar shards; data.format=webdataset reads "
                            f"tar files of NNN.jpg/NNN.png + NNN.json samples (megajax preprocess --format "
                            f"webdataset writes them).")
        return files
    if p.is_file():
        return [p]
    there = kind_of(p)
    raise DataError(f"{key} = {path!r}: {f'{there}, not a file' if there else 'no such file or directory'}; "
                    f"data.format=webdataset reads a .tar shard or a directory of *.tar shards.")


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # of its data in the tar file
    size: int


@dataclass(frozen=True)
class Sample:
    shard: int  # index into the shard list
    key: str
    image: Member
    text: Member


@dataclass
class ShardIndex:
    shards: list[Path]
    samples: list[Sample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unpaired or repeated members, one line each


def split_name(name: str) -> tuple[str, str]:
    """(key, field) of a member name: the path up to the first '.' of its file name, and the rest."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1:].lower())


def index_shards(shards: list[Path], strict: bool = False) -> ShardIndex:
    """The samples of the shards in order (tar headers only); unpaired members reported, or (strict)
    a DataError naming the first."""
    out = ShardIndex(list(shards))
    for s, path in enumerate(shards):
        groups: dict[str, dict[str, Member]] = {}
        try:
            with tarfile.open(path, "r:") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    key, fld = split_name(m.name)
                    if fld not in IMAGE_FIELDS and fld != "json":
                        continue
                    kind = "image" if fld in IMAGE_FIELDS else "json"
                    group = groups.setdefault(key, {})
                    if kind in group:
                        out.problems.append(f"shard {path}: member {m.name!r} repeats the {kind} of sample {key!r} "
                                            f"(already {group[kind].name!r}); the sample is left out")
                        group["bad"] = group[kind]
                        continue
                    group[kind] = Member(m.name, m.offset_data, m.size)
        except (tarfile.TarError, OSError) as e:
            raise DataError(f"shard {path}: not a readable tar file ({e}); data.format=webdataset reads "
                            f"uncompressed tar shards.") from None
        for key, group in groups.items():
            if "bad" in group:
                continue
            if "image" not in group or "json" not in group:
                have, missing = (group["json"], "image (jpg/png)") if "image" not in group else (group["image"], "json")
                out.problems.append(f"shard {path}: member {have.name!r} has no {missing} of the same key "
                                    f"{key!r}; the sample is left out")
                continue
            out.samples.append(Sample(s, key, group["image"], group["json"]))
        if strict and out.problems:
            raise DataError(out.problems[0].replace("; the sample is left out", "") +
                            " (data.strict=true; set it false to skip such samples and count them).")
    return out


# ----------------------------------------------------------------------------
# One sample: image and text
# ----------------------------------------------------------------------------

def process_image(data: bytes, v: VisionConfig, what: str = "the image") -> np.ndarray:
    """Encoded image bytes -> [image_size, image_size, 3] float32, resized and normalised as the encoder
    expects (module docstring). DataError naming `what` on an image that does not decode or is too large
    (megajax/data/user_files.py decode_image)."""
    return _resized(decode_image(data, what), v)


def process_tiles(data: bytes, v: VisionConfig, what: str = "the image") -> np.ndarray:
    """Encoded image bytes -> its tiles [tiles, image_size, image_size, 3] float32: with
    model.vision.max_num_tiles > 1 the image cut into tiles (megajax/data/tiles.py), each normalised,
    else the one resized image. DataError naming `what` as process_image."""
    img = decode_image(data, what)
    if not v.tiled:
        return _resized(img, v)[None]
    return np.stack([_normalised(t, v) for t in cut_tiles(img, v)])


def _resized(img, v: VisionConfig) -> np.ndarray:
    from PIL import Image
    size = v.image_size
    if v.form == "clip":  # shorter side to `size`, then the centre square
        w, h = img.size
        scale = size / min(w, h)
        img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BICUBIC)
        w, h = img.size
        left, top = (w - size) // 2, (h - size) // 2
        img = img.crop((left, top, left + size, top + size))
    elif img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return _normalised(img, v)


def _normalised(img, v: VisionConfig) -> np.ndarray:
    mean, std = NORMALIZATION[v.form]
    x = np.asarray(img, np.float32) / 255.0
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def encode_with_images(tokenizer, text: str, spans: list[tuple[int, int]], image_token_id: int,
                       image_seq_length: int, run: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids [T] int32, trained [T] bool, images): the text encoded piece by piece around its `<image>`
    markers, each marker replaced by image_seq_length placeholders (or the ids `run`: a tiled image's
    tiles' placeholders and tags, megajax/data/tiles.py); a token is trained when it overlaps one of
    the character spans and is not part of an image."""
    if run is None:
        run = np.full(image_seq_length, image_token_id, np.int32)
    ids, offsets, is_image = [], [], []
    at, images = 0, 0
    while True:
        k = text.find(MARKER, at)
        piece = text[at:] if k < 0 else text[at:k]
        if piece:
            p_ids, p_off = _encode_with_offsets(tokenizer, piece)
            ids.append(p_ids)
            offsets.append(p_off + at)
            is_image.append(np.zeros(len(p_ids), bool))
        if k < 0:
            break
        ids.append(run)
        offsets.append(np.tile(np.asarray([[k, k + len(MARKER)]], np.int64), (len(run), 1)))
        is_image.append(np.ones(len(run), bool))
        images += 1
        at = k + len(MARKER)
    ids_ = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    off = np.concatenate(offsets) if offsets else np.zeros((0, 2), np.int64)
    trained, _ = _spans_to_tokens(off, spans)
    return ids_.astype(np.int32), trained & ~np.concatenate(is_image), images


def sample_text(record, where: str, tokenizer, template: str | None, loss_on: str, image_token_id: int,
                image_seq_length: int, run: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of a sample's json: its caption (trained, then the end-of-document token) or its
    conversation (its answers, or every token with loss_on=all); one image marker, placed first when
    absent, becoming `run` (encode_with_images)."""
    if isinstance(record, dict) and isinstance(record.get("caption"), str):
        caption = record["caption"]
        text = caption if MARKER in caption else MARKER + caption
        ids, trained, images = encode_with_images(tokenizer, text, [(0, len(text))], image_token_id,
                                                  image_seq_length, run)
        eod = getattr(tokenizer, "eod_id", None)
        if eod is not None:
            ids, trained = np.append(ids, np.int32(eod)), np.append(trained, True)
    elif isinstance(record, dict) and "messages" in record:
        messages = [dict(m) for m in check_messages(record["messages"], where)]
        if not any(MARKER in m["content"] for m in messages):
            first = next((m for m in messages if m["role"] == "user"), None)
            if first is None:
                raise DataError(f"{where}: the conversation has no user message to put the image in; add "
                                f"\"{MARKER}\" to a message's content.")
            first["content"] = MARKER + "\n" + first["content"]
        if template is None:
            raise DataError(f"{where}: a conversation needs the tokenizer's chat template, and data.tokenizer "
                            f"has none.")
        specials = dict(bos_token=special_token(tokenizer, "bos_token"), eos_token=special_token(tokenizer, "eos_token"))
        try:
            text, spans = render_with_answers(template, messages, **specials)
            if not has_generation_tags(template):
                spans = _turn_spans(template, messages, text, specials)
        except ChatTemplateError as e:
            raise conversation_error(e, where) from None
        if loss_on == "all":
            spans = [(0, len(text))]
        ids, trained, images = encode_with_images(tokenizer, text, spans, image_token_id, image_seq_length, run)
    else:
        raise DataError(f"{where}: {json.dumps(record)[:80]} holds neither a \"caption\" string nor a "
                        f"\"messages\" conversation.")
    if images != 1:
        raise DataError(f"{where}: the text holds {images} \"{MARKER}\" markers for the sample's one image; give "
                        f"exactly one.")
    return ids, trained


# ----------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------

class ImageTextDataset:
    """Samples of indexed image-text shards (module docstring). len() covers at least num_samples
    (whole epochs of the samples given)."""

    def __init__(self, index: ShardIndex, samples: list[Sample], *, tokenizer, template: str | None,
                 vision: VisionConfig, seq_len: int, seed: int, num_samples: int | None = None,
                 loss_on: str = "assistant", strict: bool = False, split_name: str = "train", warn=None):
        if not samples:
            raise DataError(f"data.path: the {split_name} split holds no image-text samples.")
        self.shards, self.samples, self.tokenizer, self.template = index.shards, samples, tokenizer, template
        self.vision, self.seq_len, self.limit, self.seed = vision, seq_len, seq_len + 1, seed
        self.loss_on, self.strict, self.split_name = loss_on, strict, split_name
        self.pad_id = getattr(tokenizer, "eod_id", None) or 0
        n = len(samples)
        self.epochs = max(1, -(-(num_samples or n) // n))
        # A sample's tiles, the tile axis padded to max_tiles with zero pictures that no placeholder takes.
        self.images_shape = (vision.max_tiles, vision.image_size, vision.image_size, 3)
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.skipped: dict[int, str] = {}  # sample -> why it was passed over
        self._warn = warn or (lambda line: print(f"megajax: {line}", file=sys.stderr, flush=True))

    def __len__(self) -> int:
        return self.epochs * len(self.samples)

    def report(self) -> str:
        return (f"{self.split_name}: {len(self.samples):,} image-text samples in {len(self.shards)} shard"
                f"{'s' if len(self.shards) > 1 else ''}, {self.epochs} epoch{'s' if self.epochs > 1 else ''}")

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                self._perms[epoch] = np.random.RandomState([self.seed, epoch]).permutation(len(self.samples))
            return self._perms[epoch]

    def _read(self, member: Member, shard: Path) -> bytes:
        with open(shard, "rb") as f:
            f.seek(member.offset)
            data = f.read(member.size)
        if len(data) != member.size:
            raise DataError(f"shard {shard}: member {member.name!r} is cut short ({len(data)} of {member.size} bytes).")
        return data

    def load(self, k: int) -> dict[str, np.ndarray]:
        """Sample k of `samples` as a row, or a DataError naming its shard and member."""
        s = self.samples[k]
        shard = self.shards[s.shard]
        where = f"shard {shard}: member {s.text.name!r}"
        try:
            record = parse_json(self._read(s.text, shard))
        except ValueError as e:
            raise DataError(f"{where}: not valid JSON ({e}).") from None
        v = self.vision
        try:
            tiles = process_tiles(self._read(s.image, shard), v, f"shard {shard}: member {s.image.name!r}")
        except DataError:  # not an image, a damaged one or one too large, named (data/user_files.py)
            raise
        except Exception as e:  # any other error of Pillow's on damaged data
            raise DataError(f"shard {shard}: member {s.image.name!r} is not a readable image "
                            f"({type(e).__name__}: {e}).") from None
        run = image_run(self.tokenizer, len(tiles), v)[0]
        ids, trained = sample_text(record, where, self.tokenizer, self.template, self.loss_on, v.image_token_id,
                                   v.image_seq_length, run)
        last = int(np.flatnonzero(ids == v.image_token_id)[-1])
        if last >= self.seq_len:  # every placeholder must be an input (row[:-1]) of the model
            raise DataError(f"{where}: the image's placeholders end at token {last + 1}, beyond the "
                            f"train.seq_len = {self.seq_len} inputs of a row; raise train.seq_len.")
        answered = bool(trained.any())
        ids, trained = ids[:self.limit], trained[:self.limit]
        tokens = np.full(self.limit, self.pad_id, np.int32)
        tokens[:len(ids)] = ids
        mask = np.zeros(self.limit, np.float32)
        mask[:len(ids) - 1] = trained[1:]
        if not mask.any():  # a row that trains nothing: skipped and counted like a damaged sample
            why = (f"its answer begins beyond the train.seq_len = {self.seq_len} inputs of a row; raise train.seq_len"
                   if answered else "the conversation holds no assistant answer, and data.loss_on=assistant trains "
                   "the answers only (data.loss_on=all trains every token)")
            raise DataError(f"{where}: no token of the sample is trained: {why}.")
        images = np.zeros(self.images_shape, np.float32)
        images[:len(tiles)] = tiles
        return {"tokens": tokens, "loss_mask": mask, "images": images}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a {self.split_name} split of {len(self)} samples")
        i %= len(self)
        n = len(self.samples)
        epoch, j = divmod(i, n)
        perm = self._perm(epoch)
        for step in range(n):
            k = int(perm[(j + step) % n])
            if k in self.skipped:
                continue
            try:
                return self.load(k)
            except DataError as e:
                if self.strict:
                    raise DataError(f"{e} (data.strict=true; set it false to skip such samples and count them)") \
                        from None
                with self._lock:
                    new = k not in self.skipped
                    self.skipped[k] = str(e)
                    count = len(self.skipped)
                if new:
                    self._warn(f"data: skipped ({count} so far in the {self.split_name} split): {e}")
        raise DataError(f"data.path: none of the {self.split_name} split's {n} image-text samples could be read "
                        f"(first: {next(iter(self.skipped.values()))}).")


# ----------------------------------------------------------------------------
# Writing shards
# ----------------------------------------------------------------------------

def write_shards(samples, output: str | Path, *, shard_size: int = 1000, prefix: str = "shard") -> list[Path]:
    """Writes (key, image field, image bytes, json record) samples as tar shards
    <output>/<prefix>-000000.tar, ... of `shard_size` samples each (members <key>.<field> and
    <key>.json, adjacent, in order); returns the shard paths. Each shard is written to a temporary name
    and renamed when complete; a failure (an error in the samples, Ctrl-C) removes the shard it was writing."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    tar = None
    count = 0

    def add(name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        tar.addfile(info, io.BytesIO(data))

    def close() -> None:
        tar.close()
        paths[-1].with_suffix(".tar.tmp").rename(paths[-1])

    try:
        for key, fld, image, record in samples:
            if count % shard_size == 0:
                if tar is not None:
                    close()
                paths.append(out / f"{prefix}-{len(paths):06d}.tar")
                tar = tarfile.open(paths[-1].with_suffix(".tar.tmp"), "w", format=tarfile.USTAR_FORMAT)
            add(f"{key}.{fld}", image)
            add(f"{key}.json", json.dumps(record, ensure_ascii=False).encode("utf-8"))
            count += 1
        if tar is not None:
            close()
    except BaseException:
        if tar is not None and not tar.closed:
            tar.close()
            paths[-1].with_suffix(".tar.tmp").unlink(missing_ok=True)
        raise
    return paths


def preprocess_images(images: str, captions: str, output: str, *, shard_size: int = 1000) -> tuple[list[Path], int]:
    """`megajax preprocess --format webdataset`: the images of the folder `images` named by the jsonl
    `captions` (one {"image": file relative to the folder, "caption": ...} or {"image": ..., "messages": [...]}
    per line) as tar shards in `output`; (shards, samples). The image files are stored as they are
    (regular files within MAX_IMAGE_BYTES, checked to decode: megajax/data/user_files.py), keyed by their
    line number. `output` must be new or empty (an earlier run's shards are never replaced or mixed with
    new ones); the shards are written beside it under a temporary name and moved there when all are
    complete."""
    folder, lines = Path(images), Path(captions)
    if not folder.is_dir():
        raise DataError(f"--images {images!r}: not a directory; give the folder the captions' \"image\" paths "
                        f"are relative to.")
    if not lines.is_file():
        there = "a directory" if lines.is_dir() else kind_of(lines) or "no such file"
        raise DataError(f"--captions {captions!r}: {there}{', not a file' if there != 'no such file' else ''}; give "
                        f"a jsonl of {{\"image\", \"caption\"}} lines.")

    def samples():
        for n, where, record in jsonl_records(lines, name=captions):
            if not isinstance(record, dict) or not isinstance(record.get("image"), str) or not (
                    isinstance(record.get("caption"), str) or "messages" in record):
                raise DataError(f"{where}: each line is {{\"image\": FILE, \"caption\": TEXT}} (or \"messages\" "
                                f"instead of \"caption\"); got {json.dumps(record)[:80]}.")
            if "caption" in record and "messages" in record:  # the loader would read the caption alone
                raise DataError(f"{where}: the line holds both \"caption\" and \"messages\"; a sample is an image "
                                f"with either a caption or a conversation, not both: keep the one meant.")
            if "caption" in record and not record["caption"].replace(MARKER, "").strip():
                raise DataError(f"{where}: the caption {json.dumps(record['caption'])} is empty, so the sample "
                                f"trains nothing; give the image's caption text.")
            path = folder / record.pop("image")
            fld = path.suffix.lower().lstrip(".")
            if fld not in IMAGE_FIELDS:
                raise DataError(f"{where}: image {str(path)!r} is not one of {', '.join(IMAGE_FIELDS)}.")
            what = f"{where}: image {str(path)!r}"
            data = read_user_file(path, what, MAX_IMAGE_BYTES)
            decode_image(data, what)  # it decodes (a named error otherwise)
            if "messages" in record:
                check_messages(record["messages"], where)
            texts = [m["content"] for m in record["messages"]] if "messages" in record else [record["caption"]]
            markers = sum(t.count(MARKER) for t in texts)
            if markers > 1:
                what = "conversation" if "messages" in record else "caption"
                raise DataError(f"{where}: the {what} holds {markers} \"{MARKER}\" markers for the sample's one image "
                                f"({str(path)!r}); give one marker where the image goes, or none to put it first.")
            yield f"{n:09d}", "jpg" if fld == "jpeg" else fld, data, record

    count = 0

    def counted():
        nonlocal count
        for s in samples():
            count += 1
            yield s

    with fresh_output_dir("--output-dir", output) as partial:  # the shards appear together, complete, or not at all
        names = [p.name for p in write_shards(counted(), partial, shard_size=shard_size)]
        if not count:
            raise DataError(f"--captions {captions!r} holds no samples (every line is blank).")
    return [Path(output) / name for name in names], count
