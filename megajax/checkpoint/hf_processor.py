"""A LLaVA export's processor: the files `AutoProcessor.from_pretrained` reads to turn a picture and a
prompt into the model's inputs as `megajax generate --image` does (megajax/inference/images.py; the
forms' normalisation is config.VISION_NORMALISATION), and the
import's check that a Hugging Face LLaVA directory's processor preprocesses as megajax would.

    preprocessor_config.json  the image processor: SigLIP's (resize to image_size x image_size, bicubic) or
                              CLIP's (shorter side to image_size, bicubic, center crop), pixels / 255, the
                              form's mean and std (SigLIP 0.5, CLIP OpenAI's)
    processor_config.json     LlavaProcessor: its image token, patch_size, vision_feature_select_strategy and
                              num_additional_image_tokens (CLIP's class token), so an `<image>` in the text
                              becomes model.vision.image_seq_length image tokens
    chat_template.jinja       the tokenizer's chat template, where it has one (the processor's own copy)

The image token is the tokenizer's token of model.vision.image_token_id; a tokenizer one id short of it (the
byte tokenizer's 257 ids before tiny-llava's 257) gets `<image>` there as an added special token. Both files
are flat (transformers 4's layout), which transformers 5 reads as well. transformers 5 with torchvision
installed picks its torchvision backend by default, whose resize differs from PIL's in the last bits:
`AutoProcessor.from_pretrained(dir, backend="pil")` gives megajax's pixels exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megajax.config import VISION_NORMALISATION as NORMALISATION, VisionConfig
from megajax.data.text_files import parse_json
from megajax.errors import CheckpointError

IMAGE_TOKEN = "<image>"  # the token added where a tokenizer has none at the image id
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as image processors name it
_IMAGE_PROCESSOR = {"siglip": "SiglipImageProcessor", "clip": "CLIPImageProcessor"}


def image_processor_config(v: VisionConfig) -> dict:
    """preprocessor_config.json of the encoder's form at its image size."""
    mean, std = NORMALISATION[v.form]
    s = v.image_size
    out = dict(image_processor_type=_IMAGE_PROCESSOR[v.form], processor_class="LlavaProcessor", do_convert_rgb=True,
               do_resize=True, resample=BICUBIC, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
               image_mean=list(mean), image_std=list(std))
    if v.form == "clip":
        return dict(out, size={"shortest_edge": s}, do_center_crop=True, crop_size={"height": s, "width": s})
    return dict(out, size={"height": s, "width": s})


def _processor_tokens(v: VisionConfig) -> tuple[int, str]:
    """(num_additional_image_tokens, vision_feature_select_strategy): LlavaProcessor's image token count is
    (image_size / patch_size)^2 + additional, less one under `default`."""
    return int(v.class_token), v.feature_select


def image_token(tok, v: VisionConfig) -> tuple[str | None, str]:
    """(the image token's text, or None; what was found) of a `tokenizers` Tokenizer for
    model.vision.image_token_id: its token there when that encodes to the id alone; `<image>` when the
    tokenizer ends just before the id (then added); else None, saying why."""
    token_id, size = v.image_token_id, tok.get_vocab_size(with_added_tokens=True)
    text = tok.id_to_token(token_id)
    if text is None:
        if token_id == size and tok.token_to_id(IMAGE_TOKEN) is None:
            return IMAGE_TOKEN, "added"
        return None, (f"the tokenizer has {size} ids and no token at model.vision.image_token_id={token_id}, so an "
                      f"image token cannot be named for it")
    if tok.encode(text, add_special_tokens=False).ids != [token_id]:
        return None, (f"the tokenizer's token {text!r} at model.vision.image_token_id={token_id} does not encode "
                      f"to that id alone")
    return text, "found"


def write_processor(out: Path, v: VisionConfig) -> str | None:
    """Writes the processor files into the export directory `out` (its tokenizer.json already there);
    returns why it could not (nothing written), or None."""
    tokenizer_file = out / "tokenizer.json"
    if not tokenizer_file.is_file():
        return _left_out("the export carries no tokenizer (--tokenizer TOK adds one, and the processor)")
    from tokenizers import AddedToken, Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    token, found = image_token(tok, v)
    if token is None:
        return _left_out(found)
    if found == "added":
        tok.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        assert tok.token_to_id(token) == v.image_token_id, (token, v.image_token_id)
        tokenizer_file.write_text(tok.to_str())
    additional, strategy = _processor_tokens(v)
    _write_json(out / "preprocessor_config.json", image_processor_config(v))
    _write_json(out / "processor_config.json", dict(
        processor_class="LlavaProcessor", image_token=token, patch_size=v.patch_size,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=additional))
    template = _chat_template(out)
    if template is not None and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)
    return None


def _left_out(why: str) -> str:
    return f"{why}; the export has no processor (AutoProcessor), only the model and its tokenizer"


def processor_left_out(m, tokenizer_spec: str | None) -> str | None:
    """What an export of model `m` with tokenizer `tokenizer_spec` says when it can write no processor for
    it (a vision-language model whose tokenizer has no token for the image id), or None."""
    if m.vision is None:
        return None
    if tokenizer_spec is None:
        return _left_out("the export carries no tokenizer (--tokenizer TOK adds one, and the processor)")
    from tokenizers import Tokenizer
    from megajax.data.tokenizer import ByteTokenizer, byte_tokenizer_json, load_tokenizer
    tok = load_tokenizer(tokenizer_spec, key="--tokenizer")
    tok = Tokenizer.from_str(byte_tokenizer_json()) if isinstance(tok, ByteTokenizer) else tok._tok
    token, why = image_token(tok, m.vision)
    return None if token is not None else _left_out(why)


def _chat_template(out: Path) -> str | None:
    """The exported tokenizer's chat template (tokenizer_config.json's, when one string), or None."""
    try:
        config = json.loads((out / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ----------------------------------------------------------------------------
# Import: the directory's processor against megajax's preprocessing
# ----------------------------------------------------------------------------

def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        out = parse_json(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({e}).") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{str(path)!r} holds {type(out).__name__}, not a JSON object.")
    return out


def _square(value) -> tuple | None:
    """An image processor's size as (height, width), (shortest_edge,) or the raw value."""
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, dict):
        if "height" in value and "width" in value:
            return (value["height"], value["width"])
        if set(value) == {"shortest_edge"}:
            return (value["shortest_edge"],)
    return value


def processor_differences(d: Path, v: VisionConfig) -> list[str]:
    """What a Hugging Face LLaVA directory's preprocessor_config.json / processor_config.json (either, or
    processor_config.json's `image_processor`) set otherwise than megajax's preprocessing of model.vision
    (module docstring); [] when they agree or are absent."""
    processor = _read(d / "processor_config.json") or {}
    images = _read(d / "preprocessor_config.json") or processor.get("image_processor") or {}
    want = image_processor_config(v)
    wrong = []
    for key in ("do_resize", "do_rescale", "do_normalize", "resample"):
        if key in images and images[key] != want[key]:
            wrong.append(f"{key}={images[key]!r} (megajax: {want[key]!r})")
    if "rescale_factor" in images and not math.isclose(float(images["rescale_factor"]), want["rescale_factor"]):
        wrong.append(f"rescale_factor={images['rescale_factor']!r} (megajax: 1/255)")
    for key in ("image_mean", "image_std"):
        got = images.get(key)
        if got is not None and (not isinstance(got, list) or len(got) != 3
                                or any(abs(float(a) - b) > 1e-6 for a, b in zip(got, want[key]))):
            wrong.append(f"{key}={got!r} (megajax's {v.form}: {want[key]})")
    if "size" in images and _square(images["size"]) != _square(want["size"]):
        wrong.append(f"size={images['size']!r} (megajax's {v.form} at model.vision.image_size={v.image_size}: "
                     f"{want['size']})")
    crop = images.get("do_center_crop")  # absent: the class's default (CLIP's True, SigLIP's none)
    if crop is not None and bool(crop) != want.get("do_center_crop", False):
        wrong.append(f"do_center_crop={crop} (megajax's {v.form}: {want.get('do_center_crop', False)})")
    elif crop and "crop_size" in images and _square(images["crop_size"]) != _square(want["crop_size"]):
        wrong.append(f"crop_size={images.get('crop_size')!r} (megajax: {want['crop_size']})")
    if "patch_size" in processor or "num_additional_image_tokens" in processor:
        patch = processor.get("patch_size", v.patch_size) or v.patch_size
        count = (v.image_size // patch) ** 2 + int(processor.get("num_additional_image_tokens", 0) or 0) - (
            processor.get("vision_feature_select_strategy", v.feature_select) == "default")
        if count != v.image_seq_length:
            wrong.append(f"patch_size={patch}, num_additional_image_tokens="
                         f"{processor.get('num_additional_image_tokens', 0)}, vision_feature_select_strategy="
                         f"{processor.get('vision_feature_select_strategy', v.feature_select)!r}: {count} image "
                         f"tokens per image (megajax's model: {v.image_seq_length})")
    return wrong


def check_processor(d: Path, v: VisionConfig) -> None:
    """CheckpointError naming every setting of the directory's processor that megajax's preprocessing of
    model.vision does not follow (megajax preprocesses by the encoder's form and image size alone, so a
    model trained on other pixels would be fed wrong ones)."""
    wrong = processor_differences(d, v)
    if wrong:
        raise CheckpointError(
            f"{str(d)!r}: the LLaVA processor preprocesses images otherwise than megajax does for its "
            f"{v.form} encoder: {'; '.join(wrong)}. megajax resizes, rescales and normalises by the encoder's "
            f"form and model.vision.image_size alone, so this model would see other pixels than it was trained "
            f"on; megajax reads LLaVA models whose processor is the {_IMAGE_PROCESSOR[v.form]} of their form.")
