"""A vision-language model's Hugging Face export carries its processor: `AutoProcessor.from_pretrained` on
the export turns a picture and a prompt into the pixel values and prompt ids `megajax generate --image` uses
(SigLIP and CLIP forms), LlavaForConditionalGeneration fed the processor's output generates megajax's tokens,
the tokenizer's chat template comes along, and the import refuses a LLaVA directory whose processor
preprocesses otherwise than megajax would (naming what differs). Nothing is fetched (HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megajax.checkpoint.manager import write_params_checkpoint  # noqa: E402
from megajax.checkpoint.source import unflatten  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.data.tokenizer import byte_tokenizer_json  # noqa: E402
from megajax.inference.images import preprocess  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402
from random_model import random_weights  # noqa: E402
from test_bad_input import megajax, paragraph  # noqa: E402
from test_vlm_generate import PROMPT, TINY, write_png  # noqa: E402

T = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def vlm_run(root, form: str):
    """A megajax checkpoint of a random tiny LLaVA of encoder `form` (CLIP: a class token, dropped)."""
    cfg = load_config(["model/tiny-llava"], overrides=TINY + [f"model.vision.form={form}"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    flat = random_weights(spec, 0.08, np.random.default_rng(0))
    flat["embed/embedding"][258:] = 0
    flat["output"][:, 258:] = 0
    write_params_checkpoint(unflatten(flat), cfg, root / form)
    return root / form, cfg


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{form: (run, cfg, its `megajax export --format hf` directory)}."""
    root = tmp_path_factory.mktemp("vlm_processor")
    out = {}
    for form in ("siglip", "clip"):
        run, cfg = vlm_run(root, form)
        hf = root / f"hf-{form}"
        p = megajax("export", "--format", "hf", "--checkpoint", str(run), "--output", str(hf), "--dtype", "fp32")
        assert p.returncode == 0 and "note:" not in p.stderr, p.stderr
        out[form] = run, cfg, hf
    return out


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_auto_processor_gives_megajax_generates_inputs(form, exports, tmp_path, capsys):
    from PIL import Image
    run, cfg, hf = exports[form]
    assert {"preprocessor_config.json", "processor_config.json"} <= {f.name for f in hf.iterdir()}
    processor = T.AutoProcessor.from_pretrained(hf)
    assert type(processor).__name__ == "LlavaProcessor"
    image = write_png(tmp_path / "x.png", size=(37, 23), seed=3)  # not square: CLIP's crop shows
    inputs = processor(images=Image.open(image), text=PROMPT, return_tensors="np")
    want = preprocess(Image.open(image), cfg.model.vision)
    np.testing.assert_allclose(inputs["pixel_values"][0].transpose(1, 2, 0), want, atol=1e-6)
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", str(run), "--image", str(image), "--prompt", PROMPT,
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert inputs["input_ids"][0].tolist() == result["prompt_ids"]
    assert result["prompt_ids"].count(257) == cfg.model.vision.image_seq_length == 4
    if form == "siglip":  # the whole path: the processor's output into transformers' LLaVA
        model = T.LlavaForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
        batch = processor(images=Image.open(image), text=PROMPT, return_tensors="pt")
        with torch.no_grad():
            got = model.generate(**batch, do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=256)
        assert got[0, batch["input_ids"].shape[1]:].tolist() == result["completion_ids"]


@pytest.mark.parametrize("form", ["siglip", "clip"])
def test_the_export_imports_back_with_the_byte_tokenizer(form, exports, tmp_path):
    """Its processor agrees with megajax's preprocessing; the byte tokenizer with `<image>` added reads as byte."""
    _, cfg, hf = exports[form]
    p = megajax("import", "--format", "hf", "--input", str(hf), "--output", str(tmp_path / "back"))
    assert p.returncode == 0, p.stderr
    assert "(tokenizer byte)" in p.stdout


def test_the_tokenizers_chat_template_comes_along(exports, tmp_path):
    """A tokenizer with a chat template (in its tokenizer_config.json): the processor has it too."""
    run, _, _ = exports["siglip"]
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(byte_tokenizer_json())
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": CHAT}))
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(run), "--output", str(out), "--tokenizer", str(tok))
    assert p.returncode == 0, p.stderr
    processor = T.AutoProcessor.from_pretrained(out)
    assert processor.chat_template == CHAT
    text = processor.apply_chat_template([{"role": "user", "content": "hi <image>"}], tokenize=False)
    assert text == "<|user|>hi <image>\n"
    assert processor(text=text, images=np.zeros((16, 16, 3), np.uint8))["input_ids"][0].count(257) == 4


def test_a_tokenizer_without_room_for_the_image_token_exports_without_a_processor(exports, tmp_path):
    from test_export import word_tokenizer_dir
    run, _, _ = exports["siglip"]
    tok = word_tokenizer_dir(tmp_path / "tok", size=200)
    out = tmp_path / "hf"
    p = megajax("export", "--format", "hf", "--checkpoint", str(run), "--output", str(out), "--tokenizer", str(tok))
    assert p.returncode == 0, p.stderr
    assert "note: the tokenizer has 200 ids and no token at model.vision.image_token_id=257" in p.stderr
    assert not (out / "processor_config.json").exists() and (out / "tokenizer.json").exists()


@pytest.mark.parametrize("form, key, value, words", [
    ("siglip", "image_mean", [0.48145466, 0.4578275, 0.40821073], ["image_mean=[0.48145466", "megajax's siglip"]),
    ("siglip", "size", {"height": 32, "width": 32}, ["size={'height': 32, 'width': 32}", "image_size=16"]),
    ("clip", "do_center_crop", False, ["do_center_crop=False"]),
    ("siglip", "resample", 2, ["resample=2 (megajax: 3)"]),
])
def test_an_import_refuses_a_processor_megajax_would_not_follow(form, key, value, words, exports, tmp_path):
    _, _, hf = exports[form]
    changed = tmp_path / "hf"
    shutil.copytree(hf, changed)
    config = json.loads((changed / "preprocessor_config.json").read_text())
    (changed / "preprocessor_config.json").write_text(json.dumps(dict(config, **{key: value})))
    p = megajax("import", "--format", "hf", "--input", str(changed), "--output", str(tmp_path / "out"))
    paragraph(p, "import", "the LLaVA processor preprocesses images otherwise than megajax does", *words)
    assert not (tmp_path / "out").exists()


def test_an_import_refuses_another_image_token_count(exports, tmp_path):
    _, _, hf = exports["clip"]
    changed = tmp_path / "hf"
    shutil.copytree(hf, changed)
    config = json.loads((changed / "processor_config.json").read_text())
    (changed / "processor_config.json").write_text(json.dumps(dict(config, vision_feature_select_strategy="full")))
    p = megajax("import", "--format", "hf", "--input", str(changed), "--output", str(tmp_path / "out"))
    paragraph(p, "import", "5 image tokens per image (megajax's model: 4)")
