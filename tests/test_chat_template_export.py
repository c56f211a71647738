"""A released chat model, end to end. Its template goes through every import and export, whichever way the
source keeps it (tokenizer_config.json's `chat_template`, a string or the list of named templates, or
transformers 5's chat_template.jinja): transformers is the judge (`AutoTokenizer.from_pretrained(export)
.apply_chat_template` equals the source's), and `megajax serve --hf <export>` answers a chat request with it.
An export keeps the run's precision; fine-tuning it starts from fine-tuning's optimizer defaults."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import xla_flags  # noqa: E402
from megajax.cli import main  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256  # 200 words, [UNK], three special tokens; the rest unused
# ChatML, as SmolLM2-Instruct and Qwen write it (bos_token is <|im_start|> here, so it shows).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OTHER = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}[assistant]"  # a fine-tuning's own
MESSAGES = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w1 w2 w3"}]
FORMS = ("config", "config-list", "jinja")
RUN = ["train.seq_len=16", "train.global_batch=2", "train.steps=1", "train.log_every=1", "train.sample_tokens=0",
       "logging.tensorboard=false", "logging.progress=false", "data.corpus_max_mb=0.1", "train.eval_every=0",
       "train.precision=fp32"]


def tokenizer_folder(out, form: str, template: str = TEMPLATE):
    """A Hugging Face tokenizer (word level, the `tokenizers` library: no download) in folder `out`, its
    chat template kept as `form` says: in tokenizer_config.json as a string ("config") or as the list of
    named templates ("config-list"), or in chat_template.jinja ("jinja", transformers 5's form)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    vocab = {f"w{k}": k for k in range(200)} | {"[UNK]": 200}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "model_max_length": 64}
    if form == "config":
        config["chat_template"] = template
    elif form == "config-list":
        config["chat_template"] = [{"name": "default", "template": template}, {"name": "tool_use", "template": "T"}]
    else:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def hf_model(out, form: str):
    """A tiny Llama saved by transformers with the tokenizer of `form` beside it."""
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)
    transformers.LlamaForCausalLM(c).save_pretrained(out)
    return tokenizer_folder(out, form)


def rendered(folder) -> str:
    """transformers' own rendering of MESSAGES with the folder's tokenizer (the generation prompt added)."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    text = rendered(tokenizer_folder(tmp_path_factory.mktemp("ref") / "tok", "config"))
    assert text.startswith("<|im_start|><|im_start|>system\nw7 w8<|im_end|>") and text.endswith("assistant\n")
    return text


@pytest.mark.parametrize("form", FORMS)
def test_import_and_every_export_carry_the_template(tmp_path, form, expected, capsys):
    """HF dir -> import -> export hf / megatron (legacy and torch_dist) -> import of the Megatron checkpoint ->
    export hf again: each tokenizer renders the conversation as the source does, and the export line says so."""
    src = hf_model(tmp_path / "src", form)
    assert rendered(src) == expected
    assert main(["import", "--format", "hf", "--input", str(src), "--output", str(tmp_path / "imp")]) == 0
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "imp"), "--output",
                 str(tmp_path / "hf")]) == 0
    assert "with its chat template" in capsys.readouterr().out
    assert rendered(tmp_path / "hf") == expected
    for ckpt_format in ("torch", "torch_dist"):
        mg = tmp_path / f"mg-{ckpt_format}"
        assert main(["export", "--format", "megatron", "--ckpt-format", ckpt_format, "--checkpoint",
                     str(tmp_path / "imp"), "--output", str(mg)]) == 0
        assert rendered(mg / "tokenizer") == expected
        # the Megatron checkpoint imported back, then exported: the template still goes with it
        assert main(["import", "--format", "megatron", "--input", str(mg), "--output", str(tmp_path / f"i-{ckpt_format}")]) == 0
        assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / f"i-{ckpt_format}"), "--output",
                     str(tmp_path / f"hf-{ckpt_format}")]) == 0
        assert rendered(tmp_path / f"hf-{ckpt_format}") == expected


def test_named_templates_travel_as_transformers_saves_them(tmp_path, expected):
    """transformers 5 keeps further named templates in additional_chat_templates/; they travel too, and
    chat_template.jinja wins over a tokenizer_config.json key as it does in transformers."""
    src = hf_model(tmp_path / "src", "jinja")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text(OTHER)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER}))
    assert rendered(src) == expected  # transformers: the file's template is the default
    assert main(["export", "--format", "hf", "--checkpoint", str(_imported(src, tmp_path)), "--output",
                 str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == expected
    assert theirs.chat_template["tool_use"] == OTHER

    from megajax.data.chat_template import find_chat_template
    from megajax.data.tokenizer import load_tokenizer
    assert find_chat_template(load_tokenizer(str(src))) == TEMPLATE  # megajax reads it as transformers does


def _imported(src, tmp_path):
    assert main(["import", "--format", "hf", "--input", str(src), "--output", str(tmp_path / "imp")]) == 0
    return tmp_path / "imp"


def test_a_byte_tokenizer_with_a_template_keeps_it(tmp_path):
    """The byte tokenizer's Hugging Face form with a chat template is read as that folder (not as 'byte',
    which has no template), so an import and its export keep the template."""
    from megajax.data.tokenizer import ByteTokenizer, save_hf_tokenizer
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(c).save_pretrained(src)
    save_hf_tokenizer(ByteTokenizer(), src, max_length=64, chat_template=OTHER)
    text = rendered(src)
    assert text == "[system] w7 w8 [user] w1 w2 w3 [assistant]"
    assert main(["export", "--format", "hf", "--checkpoint", str(_imported(src, tmp_path)), "--output",
                 str(tmp_path / "hf")]) == 0
    assert rendered(tmp_path / "hf") == text
    from megajax.checkpoint.common import tokenizer_dir_spec
    save_hf_tokenizer(ByteTokenizer(), tmp_path / "plain", max_length=64)
    assert tokenizer_dir_spec(tmp_path / "plain") == "byte" and tokenizer_dir_spec(src) == str(src)


def test_fine_tuning_from_the_directory_and_lora_exports_keep_the_template(tmp_path, expected):
    """checkpoint.load=<HF dir>: one training step (fp32), then the export; with LoRA the PEFT adapter
    directory carries the tokenizer (as transformers' Trainer saves one), the merged export too, and an
    adapter directory's own tokenizer (another template) is the one generation uses."""
    from megajax.checkpoint.stored_model import train_config
    from megajax.inference.load import find_source, generation_config
    from megajax.train.loop import train
    src = hf_model(tmp_path / "src", "jinja")
    for name, extra in (("full", []), ("lora", ["model.lora.rank=2", "model.lora.targets=[qkv]"])):
        cfg = train_config(overrides=RUN + extra + [f"checkpoint.load={src}", f"train.run_dir={tmp_path / name}"])
        assert np.isfinite(train(cfg, devices=jax.devices()[:1]).losses).all()
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "full"), "--output",
                 str(tmp_path / "hf")]) == 0
    assert rendered(tmp_path / "hf") == expected
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"  # an fp32 run
    assert main(["export", "--format", "peft", "--checkpoint", str(tmp_path / "lora"), "--output",
                 str(tmp_path / "peft")]) == 0
    assert rendered(tmp_path / "peft") == expected
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(tmp_path / "lora"), "--output",
                 str(tmp_path / "merged")]) == 0
    assert rendered(tmp_path / "merged") == expected

    # An adapter directory whose tokenizer has the fine-tuning's template: generation and import use it.
    tokenizer_folder(tmp_path / "own", "jinja", OTHER)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "peft" / f).write_bytes((tmp_path / "own" / f).read_bytes())
    cfg = generation_config(find_source(None, str(src), adapter=str(tmp_path / "peft")))
    assert cfg.data.tokenizer == str(tmp_path / "peft")
    assert main(["import", "--format", "peft", "--input", str(tmp_path / "peft"), "--base", str(_imported(src, tmp_path)),
                 "--output", str(tmp_path / "adapters")]) == 0
    assert main(["export", "--format", "hf", "--merge-lora", "--checkpoint", str(tmp_path / "adapters"), "--output",
                 str(tmp_path / "merged-own")]) == 0
    assert rendered(tmp_path / "merged-own") == "[system] w7 w8 [user] w1 w2 w3 [assistant]"


def test_serve_hf_export_answers_chat(tmp_path, expected):
    """`megajax serve --hf <export>`: POST /v1/chat/completions is answered (200), its prompt the
    transformers rendering of the messages, token for token."""
    src = hf_model(tmp_path / "src", "jinja")
    assert main(["export", "--format", "hf", "--checkpoint", str(_imported(src, tmp_path)), "--output",
                 str(tmp_path / "hf")]) == 0
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, "-m", "megajax.cli", "serve", "--hf", str(tmp_path / "hf"), "--port", "0",
                          "--max-batch", "1"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "listening on" not in line:
            line = p.stderr.readline()
            assert line, "the server exited before listening"
        assert "(no chat template)" not in line
        host, port = re.search(r"listening on http://([\d.]+):(\d+)", line).groups()
        chat = http.client.HTTPConnection(host, int(port), timeout=300)
        chat.request("POST", "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 1}),
                     {"Content-Type": "application/json"})
        answer = chat.getresponse()
        body = json.loads(answer.read())
        assert answer.status == 200, body
        assert body["usage"]["prompt_tokens"] == len(ids)
        chat.close()
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    assert "Traceback" not in err, err


@pytest.mark.parametrize("precision, stored", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                               ("fp8", "bfloat16")])
def test_the_export_keeps_the_runs_precision(tmp_path, capsys, precision, stored):
    """Without --dtype an export stores the weights as the run trained them (train.precision; fp8 keeps
    bf16 weights), says so, and a Megatron checkpoint's export follows its own --bf16 / --fp16; --dtype
    chooses."""
    from safetensors import safe_open

    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.config import load_config
    from megajax.train.state import build_model_spec
    cfg = load_config(overrides=["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                 "model.ffn_hidden_size=64", "model.vocab_size=257", "train.seq_len=16",
                                 f"train.precision={precision}"])
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    write_params_checkpoint(jax.jit(init)(), cfg, tmp_path / "run")

    def dtype_of(hf):
        with safe_open(hf / "model.safetensors", "np" if stored != "bfloat16" else "pt") as f:
            return str(f.get_tensor(next(iter(f.keys()))).dtype).removeprefix("torch.")
    name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[stored]
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "hf")]) == 0
    assert f"{name} weights, as the run's train.precision={precision}" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == stored == dtype_of(tmp_path / "hf")
    assert main(["export", "--format", "megatron", "--ckpt-format", "torch", "--checkpoint", str(tmp_path / "run"),
                 "--output", str(tmp_path / "mg")]) == 0
    args = torch.load(tmp_path / "mg" / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"]
    assert (args.bf16, args.fp16, str(args.params_dtype)) == (name == "bf16", name == "fp16", f"torch.{stored}")
    capsys.readouterr()
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "mg"), "--output", str(tmp_path / "back")]) == 0
    assert f"{name} weights, as the checkpoint's {name}" in capsys.readouterr().out
    assert dtype_of(tmp_path / "back") == stored
    assert main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "f32"),
                 "--dtype", "fp32"]) == 0
    assert "fp32 weights (--dtype)" in capsys.readouterr().out and dtype_of(tmp_path / "f32") == "float32"


def test_a_released_model_fine_tunes_with_fine_tuning_defaults(tmp_path):
    """checkpoint.load of a released model (a Hugging Face directory, a `megajax import`) and no optim.* key:
    lr 2e-5 (LoRA 2e-4), no weight decay, no warm-up, said in one line; a key the run sets wins; a megajax
    run's own checkpoint (continued pretraining) keeps pretraining's defaults."""
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.checkpoint.stored_model import train_config
    from megajax.config import load_config
    src = hf_model(tmp_path / "src", "jinja")
    imported = _imported(src, tmp_path)
    for load in (src, imported):
        notes = []
        cfg = train_config(overrides=RUN + [f"checkpoint.load={load}"], notes=notes)
        assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_steps) == (2e-5, 0, 0)
        assert cfg.optim.min_lr == pytest.approx(2e-6)  # lr / 10, derived from the fine-tuning lr
        [note] = notes
        assert "fine-tuning defaults optim.lr=2e-05, optim.weight_decay=0, optim.warmup_steps=0" in note
        assert "pretraining's 0.002, 0.1, 20" in note and "set any of them to choose" in note
    notes = []
    lora = train_config(overrides=RUN + ["model.lora.rank=2", f"checkpoint.load={src}"], notes=notes)
    assert lora.optim.lr == 2e-4 and "optim.lr=0.0002" in notes[0] and "(LoRA)" in notes[0]
    notes = []
    mine = train_config(overrides=RUN + ["optim.lr=1e-3", "optim.warmup_steps=5", f"checkpoint.load={src}"], notes=notes)
    assert (mine.optim.lr, mine.optim.warmup_steps, mine.optim.weight_decay) == (1e-3, 5, 0)
    assert notes == ["checkpoint.load names a released model (a Hugging Face model directory): fine-tuning defaults "
                     "optim.weight_decay=0 in place of pretraining's 0.1; set any of them to choose."]
    (tmp_path / "all.yaml").write_text("optim: {lr: 3.0e-4, weight_decay: 0.05, warmup_steps: 2}\n")
    notes = []
    assert train_config([str(tmp_path / "all.yaml")], RUN + [f"checkpoint.load={src}"], notes).optim.lr == 3e-4
    assert notes == []
    base = load_config(overrides=RUN + ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                        "model.ffn_hidden_size=64", "model.vocab_size=257"])
    from megajax.train.state import build_model_spec
    _, init = build_model_spec(base, base.model.padded_vocab_size())
    write_params_checkpoint(jax.jit(init)(), base, tmp_path / "pretrained", meta={"imported": False})
    notes = []
    cfg = train_config(overrides=RUN + [f"checkpoint.load={tmp_path / 'pretrained'}"], notes=notes)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_steps, notes) == (2e-3, 0.1, 20, [])


def test_a_byte_tokenizer_chat_fine_tuning_exports_its_template(tmp_path):
    """A run trained on chat data with the byte tokenizer speaks megajax's built-in byte template
    (data/chat.py BYTE_CHAT_TEMPLATE): its exports carry it, so transformers renders its conversations as
    training did; a pretraining run's export has none."""
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.config import load_config
    from megajax.data.chat import BYTE_CHAT_TEMPLATE
    from megajax.data.chat_template import render_chat
    from megajax.train.state import build_model_spec
    for data_format in ("chat", "gpt"):
        cfg = load_config(overrides=["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                     "model.ffn_hidden_size=64", "model.vocab_size=257", "train.seq_len=16",
                                     f"data.format={data_format}"])
        _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
        write_params_checkpoint(jax.jit(init)(), cfg, tmp_path / data_format)
        for fmt in ("hf", "megatron"):
            out = tmp_path / f"{data_format}-{fmt}"
            assert main(["export", "--format", fmt, "--checkpoint", str(tmp_path / data_format), "--output",
                         str(out)]) == 0
            folder = out / "tokenizer" if fmt == "megatron" else out
            if data_format == "gpt":
                assert transformers.AutoTokenizer.from_pretrained(folder).chat_template is None
            else:
                assert rendered(folder) == render_chat(BYTE_CHAT_TEMPLATE, MESSAGES) == \
                    "system: w7 w8\nuser: w1 w2 w3\nassistant: "
