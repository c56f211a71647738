"""A vision-language model's generation: images preprocessed as transformers' image processors do,
`megajax generate --image` greedy tokens equal to LlavaForConditionalGeneration.generate on the
`megajax export --format hf` of the same checkpoint, and bad input named."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megajax.checkpoint.manager import write_params_checkpoint  # noqa: E402
from megajax.checkpoint.source import unflatten  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.config import VisionConfig, load_config  # noqa: E402
from megajax.data.tokenizer import ByteTokenizer  # noqa: E402
from megajax.inference.images import image_prompt_ids, preprocess  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402
from random_model import random_weights  # noqa: E402

# tiny-llava shrunk: a 2-layer Llama of width 64, a 3-layer SigLIP tower of width 32 on 16 x 16 images
# (4 image features), a 64-token context.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vision.image_size=16", "model.vision.hidden_size=32",
        "model.vision.num_heads=4", "model.vision.ffn_hidden_size=64", "train.seq_len=64"]
PROMPT = "What is in <image> this picture?"


def write_png(path, size=(28, 20), seed=0):
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    """A megajax checkpoint of a random tiny LLaVA (weights N(0, 0.08): clear argmax margins)."""
    cfg = load_config(["model/tiny-llava"], overrides=TINY)
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    flat = random_weights(spec, 0.08, np.random.default_rng(0))
    flat["embed/embedding"][258:] = 0
    flat["output"][:, 258:] = 0
    out = tmp_path_factory.mktemp("vlm") / "run"
    write_params_checkpoint(unflatten(flat), cfg, out)
    return out, cfg


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_preprocessing_equals_transformers_image_processors(form, tmp_path):
    """A non-square PNG through megajax's preprocessing equals transformers' processor of the form
    (SigLIP: resize to the square; CLIP: shorter side, center crop, OpenAI's mean and std)."""
    T = pytest.importorskip("transformers")
    from PIL import Image
    image = Image.open(write_png(tmp_path / "x.png", size=(37, 23), seed=4))
    if form == "siglip":
        processor = T.SiglipImageProcessorPil(size={"height": 16, "width": 16})
    else:
        processor = T.CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    want = processor(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    got = preprocess(image, VisionConfig(form=form, image_size=16))
    assert got.shape == (16, 16, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_image_markers_expand_to_placeholders():
    v = VisionConfig(image_size=16, patch_size=8, image_token_id=257)
    v.resolve()
    tok = ByteTokenizer()
    assert image_prompt_ids(tok, "a<image>b", 1, v) == [97] + [257] * 4 + [98]
    assert image_prompt_ids(tok, "hi", 1, v) == [257] * 4 + list(b"\nhi")  # no marker: the image first
    with pytest.raises(Exception, match="2 <image> marker"):
        image_prompt_ids(tok, "<image><image>", 1, v)


def test_generate_image_greedy_equals_transformers_llava_generate(vlm_checkpoint, tmp_path, capsys):
    """`megajax generate --image F --prompt P` on a checkpoint: its greedy tokens equal
    LlavaForConditionalGeneration.generate on the checkpoint's Hugging Face export, fed the ids with
    image_seq_length placeholders and the pixels of transformers' own SigLIP processor."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from PIL import Image
    run, cfg = vlm_checkpoint
    image = write_png(tmp_path / "cat.png")
    assert main(["export", "--format", "hf", "--checkpoint", str(run), "--output", str(tmp_path / "hf"),
                 "--dtype", "fp32"]) == 0
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", str(run), "--image", str(image), "--prompt", PROMPT,
                 "--max-new-tokens", "12", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    ids = image_prompt_ids(ByteTokenizer(), PROMPT, 1, cfg.model.vision)
    assert result["prompt_ids"] == ids and ids.count(257) == 4

    hf = T.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    pixels = T.SiglipImageProcessorPil(size={"height": 16, "width": 16})(images=Image.open(image),
                                                                          return_tensors="pt")["pixel_values"]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels, do_sample=False,
                           max_new_tokens=12, pad_token_id=0, eos_token_id=256)[0, len(ids):].tolist()
    assert result["completion_ids"] == want
    assert len(want) > 1
    other = T.SiglipImageProcessorPil(size={"height": 16, "width": 16})(
        images=Image.open(write_png(tmp_path / "dog.png", seed=1)), return_tensors="pt")["pixel_values"]
    with torch.no_grad():  # the image matters to these tokens
        assert hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=other, do_sample=False,
                           max_new_tokens=12, pad_token_id=0, eos_token_id=256)[0, len(ids):].tolist() != want


def test_generate_image_errors_are_named(vlm_checkpoint, tmp_path, capsys):
    run, _ = vlm_checkpoint
    bad = tmp_path / "notes.png"
    bad.write_text("not an image at all")
    assert main(["generate", "--checkpoint", str(run), "--image", str(bad), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "notes.png" in err and "not an image" in err and err.count("\n") == 1
    assert main(["generate", "--checkpoint", str(run), "--image", str(tmp_path / "missing.png"),
                 "--prompt", "hi"]) == 2
    assert "missing.png" in capsys.readouterr().err


def test_image_to_a_text_only_model_is_refused(tmp_path, capsys):
    from random_model import random_model
    cfg, _, params = random_model("llama")
    write_params_checkpoint(params, cfg, tmp_path / "run")
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--image", str(write_png(tmp_path / "a.png")),
                 "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no image encoder" in err and "a.png" in err
