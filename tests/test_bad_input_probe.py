"""An independent probe of bad and odd input on the fine-tuning, LoRA, vision and serving surfaces, as a new
user meets it: each class of problem the probe found is one test here, run as the user's command (a
subprocess) or as the user's request to a running `megajax serve`, asserting the one paragraph (or the 400
naming the field), the exit status, and that nothing was written or replaced. Commands stop before anything
compiles where they can; one server is started for the module."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import xla_flags
from test_bad_input import ROOT, megajax, paragraph
from test_bad_input_serve import run  # noqa: F401  (the checkpoint fixture: a random tiny Llama, byte tokenizer)

CHAT_TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"


# ----------------------------------------------------------------------------------------------
# megajax serve: request bodies

@pytest.fixture(scope="module")
def server(run, tmp_path_factory):  # noqa: F811
    """(host, port, process) of `megajax serve` on the random checkpoint with a chat template; its stderr is
    checked for tracebacks when the module ends."""
    template = tmp_path_factory.mktemp("probe-serve") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, "-m", "megajax.cli", "serve", "--checkpoint", str(run), "--port", "0",
                          "--chat-template", str(template)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "listening on" not in line:
            line = p.stderr.readline()
            assert line, "the server exited before listening"
        host, port = re.search(r"listening on http://([\d.]+):(\d+)", line).groups()
        yield host, int(port), p
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    assert "Traceback" not in err, err


def post(server, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    host, port, _ = server
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    c.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
              {"Content-Type": "application/json"})
    answer = c.getresponse()
    status, data = answer.status, json.loads(answer.read())
    c.close()
    return status, data


def bad_request(server, path, body, *words) -> str:
    status, data = post(server, path, body)
    assert status == 400, (status, data)
    message = data["error"]["message"]
    for w in words:
        assert w in message, (w, message)
    return message


@pytest.mark.parametrize("path, body, words", [
    # nested past the JSON parser's depth: was a 500 (RecursionError)
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     ["the body is not valid JSON", "nested too deeply"]),
    # "\ud800": JSON, but no character; was a 500 (the tokenizer's TypeError)
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', ["the JSON escape \\ud800", "surrogate pair"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
     ["the JSON escape \\udfff"]),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud83d"], "max_tokens": 1}', ["the JSON escape \\ud83d"]),
    # a role no template knows: was rendered as it came
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "hi"}], "max_tokens": 1},
     ["'messages'[0] has role 'bot'", "'system', 'developer', 'user', 'assistant', 'tool'"]),
])
def test_request_bodies_the_server_refuses(server, path, body, words):
    bad_request(server, path, body, *words)


def test_a_surrogate_pair_is_one_character(server):
    """The whole pair (an emoji) is a character: answered."""
    status, data = post(server, "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200, data


# ----------------------------------------------------------------------------------------------
# megajax generate: a prompt given on the command line

def test_a_prompt_argument_that_is_not_utf8(run, tmp_path):  # noqa: F811
    """Python reads a byte of an argument that is not UTF-8 as a lone surrogate: was a UnicodeEncodeError
    traceback in the tokenizer."""
    p = subprocess.run([sys.executable, "-m", "megajax.cli", "generate", "--checkpoint", str(run), "--prompt", "ok",
                        "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape"), "--json", str(tmp_path / "o.json")],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags()), timeout=300)
    paragraph(p, "generate", "--prompt 1: byte 0xe9 at character 4 is not UTF-8 text")
    assert not (tmp_path / "o.json").exists()


def test_json_nested_too_deeply_in_a_users_file(run, tmp_path):  # noqa: F811
    """A chat jsonl line and a PEFT adapter_config.json nested past the parser's depth: were RecursionError
    tracebacks."""
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "chat.jsonl").write_text(deep + "\n")
    p = megajax("train", "data.format=chat", f"data.path={tmp_path / 'chat.jsonl'}", "train.steps=1",
                f"train.run_dir={tmp_path / 'run'}")
    paragraph(p, "train", f"{tmp_path / 'chat.jsonl'}:1: not valid JSON", "nested too deeply")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(deep)
    p = megajax("import", "--format", "peft", "--input", str(tmp_path / "adapter"), "--base", str(run), "--output",
                str(tmp_path / "out"))
    paragraph(p, "import", "adapter_config.json: not JSON", "nested too deeply")
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# Allocations no machine can make, and the error that ends a program

def test_a_lora_rank_too_large_for_the_device_is_one_paragraph(run, tmp_path):  # noqa: F811
    """model.lora.rank=10^9 on a 32-wide model: the adapters' state cannot be allocated. Was exit 1 with
    nothing said at all (XLA's RESOURCE_EXHAUSTED, then dropped as a stray read error: next test)."""
    p = megajax("train", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
                "model.ffn_hidden_size=64", "train.seq_len=32", "train.global_batch=2", f"checkpoint.load={run}",
                "model.lora.rank=1000000000", "train.steps=1", f"train.run_dir={tmp_path / 'run'}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("megajax train: error: out of device memory: "), p.stderr
    assert not (tmp_path / "run").exists()


def test_the_error_ending_a_program_is_never_dropped_as_a_stray_one():
    """After a checkpoint read, errors that look like TensorStore's ('INTERNAL: ...') from stray callbacks are
    dropped; the one that ends the program still prints its traceback (it was dropped: exit 1, no word)."""
    p = subprocess.run([sys.executable, "-c", "from megajax.checkpoint.manager import _drop_closed_loop_errors\n"
                        "_drop_closed_loop_errors()\nraise RuntimeError('INTERNAL: the end of the program')"],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       timeout=120)
    assert p.returncode == 1 and "RuntimeError: INTERNAL: the end of the program" in p.stderr, p.stderr


# ----------------------------------------------------------------------------------------------
# A model described by another program's config: checked as a megajax config is, against its weights

@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory):  # noqa: F811
    """The random checkpoint exported as a Hugging Face directory (2 layers of a Llama, vocab 257)."""
    from megajax.cli import main
    out = tmp_path_factory.mktemp("probe-hf") / "hf"
    assert main(["export", "--format", "hf", "--checkpoint", str(run), "--output", str(out), "--dtype", "fp32"]) == 0
    return out


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 0}, ["model.num_layers = 0: must be > 0"]),  # was a ZeroDivisionError
    ({"num_hidden_layers": "two"}, ["model.num_layers = 'two': expected an integer"]),  # was a TypeError
    ({"num_hidden_layers": 10**9}, ["gives the model 1,000,000,000 layers", "layers 0 to 0"]),  # hung
    ({"vocab_size": 10**12}, ["model.embed_tokens.weight", "has shape [257, 32]",  # was a MemoryError
                              "config.json' implies [1000000000000, 32]"]),
    ({"num_attention_heads": 0}, ["model.num_heads = 0: must be > 0"]),
])
def test_a_hugging_face_config_describing_another_model(hf_dir, tmp_path, change, words):
    d = tmp_path / "hf"
    d.mkdir()
    for f in hf_dir.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(dict(json.loads((hf_dir / "config.json").read_text()), **change)))
    p = megajax("import", "--format", "hf", "--input", str(d), "--output", str(tmp_path / "out"))
    paragraph(p, "import", f"'{d / 'config.json'}'", *words)
    p = megajax("train", f"checkpoint.load={d}", "train.steps=1", f"train.run_dir={tmp_path / 'run'}")
    paragraph(p, "train", f"'{d / 'config.json'}'", *words)
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, words", [
    (["model.num_heads=0"], ["model.num_heads = 0: must be > 0"]),
    (["--config", "model/tiny-hybrid", "model.mamba_head_dim=0"], ["model.mamba_head_dim = 0: must be > 0"]),
])
def test_a_divisor_of_zero_in_the_config(tmp_path, args, words):
    """Were ZeroDivisionError tracebacks (the sizes are derived from them before the checks ran)."""
    paragraph(megajax("train", *args, f"train.run_dir={tmp_path / 'run'}"), "train", *words)


# ----------------------------------------------------------------------------------------------
# megajax import: where it writes

def test_import_does_not_write_into_a_directory_holding_files(hf_dir, tmp_path):
    """--output a directory of other files, or the Hugging Face input itself: the import's checkpoints/ was
    written in among them."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    p = megajax("import", "--format", "hf", "--input", str(hf_dir), "--output", str(tmp_path / "mine"))
    paragraph(p, "import", f"--output {tmp_path / 'mine'}: the directory is not empty (it holds notes.txt)")
    assert sorted(x.name for x in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    before = sorted(x.name for x in hf_dir.iterdir())
    p = megajax("import", "--format", "hf", "--input", str(hf_dir), "--output", str(hf_dir))
    paragraph(p, "import", f"--output {hf_dir}: the directory is not empty", "config.json")
    assert sorted(x.name for x in hf_dir.iterdir()) == before


# ----------------------------------------------------------------------------------------------
# Chat data and its tokenizer's template: what is at the path, and what the template writes

PAIR = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
TRAIN = ["train.steps=1", "train.seq_len=64", "model.num_layers=1", "train.eval_every=0", "logging.tensorboard=false"]


def test_a_path_that_is_not_a_file_is_not_called_missing(tmp_path):
    """A FIFO named as data (chat, image-text shards), as a tokenizer, or a directory as --captions: was 'no
    such file or directory' / 'no such tokenizer'."""
    os.mkfifo(tmp_path / "fifo")
    fifo = tmp_path / "fifo"
    paragraph(megajax("train", "data.format=chat", f"data.path={fifo}", *TRAIN, f"train.run_dir={tmp_path / 'r'}"),
              "train", f"data.path = '{fifo}': a FIFO (named pipe), not a file")
    paragraph(megajax("train", "--config", "model/tiny-llava", "data.format=webdataset", f"data.path={fifo}", *TRAIN,
                      f"train.run_dir={tmp_path / 'r'}"), "train", f"data.path = '{fifo}': a FIFO (named pipe), not a file")
    paragraph(megajax("train", f"data.tokenizer={fifo}", *TRAIN, f"train.run_dir={tmp_path / 'r'}"), "train",
              f"'{fifo}' is a FIFO (named pipe), not a tokenizer.json file")
    paragraph(megajax("preprocess", "--format", "webdataset", "--images", str(tmp_path), "--captions", str(tmp_path),
                      "--output-dir", str(tmp_path / "out")), "preprocess", f"--captions '{tmp_path}': a directory, not a file")
    assert not (tmp_path / "r").exists() and not (tmp_path / "out").exists()


def test_a_data_path_with_spaces_is_one_file(tmp_path):
    """'my chats.jsonl' was read as a blend ('weight ... is not a positive number'); its second line is named."""
    data = tmp_path / "my chats.jsonl"
    data.write_text(json.dumps(PAIR) + "\n{\"text\": 1}\n")
    p = megajax("train", "data.format=chat", f"data.path={data}", *TRAIN, f"train.run_dir={tmp_path / 'r'}")
    paragraph(p, "train", f"{data}:2:", "neither")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from test_sft_data import LLAMA3, make_tokenizer_dir
    return make_tokenizer_dir(tmp_path_factory.mktemp("probe-tok") / "tok", "llama3", LLAMA3)


@pytest.mark.parametrize("case, words", [
    ("config-not-json", ["tokenizer_config.json is not a readable JSON file", "\"chat_template\" cannot be read"]),
    ("template-a-number", ["\"chat_template\" is 5; expected the template's text"]),
    ("templates-without-default", ["a list of templates named 'tool_use', none of them \"default\""]),
    ("jinja-a-directory", ["chat_template.jinja is a directory, not a file"]),
    ("template-writes-nothing", ["8 of the train split's 8 conversations hold an assistant answer",
                                 "the chat template writes none of them"]),
])
def test_a_chat_template_that_cannot_be_read_or_writes_no_answer(chat_tokenizer, tmp_path, case, words):
    """Each was 'has no chat template' (the first three), silently the other template (a directory named
    chat_template.jinja), or blamed the data ('none of the conversations holds an assistant answer')."""
    import shutil
    tok = tmp_path / "tok"
    shutil.copytree(chat_tokenizer, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    if case == "config-not-json":
        (tok / "tokenizer_config.json").write_text("{\"chat_template\": ")
    elif case == "jinja-a-directory":
        (tok / "chat_template.jinja").mkdir()
    else:
        config["chat_template"] = {"template-a-number": 5, "template-writes-nothing": "{% for m in messages %}{% endfor %}",
                                   "templates-without-default": [{"name": "tool_use", "template": "x"}]}[case]
        (tok / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat.jsonl").write_text((json.dumps(PAIR) + "\n") * 8)
    p = megajax("train", "data.format=chat", f"data.path={tmp_path / 'chat.jsonl'}", f"data.tokenizer={tok}",
                "data.split=100,0,0", *TRAIN, f"train.run_dir={tmp_path / 'r'}")
    paragraph(p, "train", *words)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("data", [[], ["data.format=chat"]])
def test_more_samples_than_the_host_can_index(tmp_path, data):
    """train.steps=10^20: the embedded corpus's index was a MemoryError traceback, chat data's packing ran
    on for ever; both are refused before any data is read."""
    chat = []
    if data:
        (tmp_path / "chat.jsonl").write_text((json.dumps(PAIR) + "\n") * 8)
        chat = [*data, f"data.path={tmp_path / 'chat.jsonl'}"]
    p = megajax("train", *chat, *TRAIN[1:], "train.steps=100000000000000000000", f"train.run_dir={tmp_path / 'r'}")
    paragraph(p, "train", "train.steps x train.global_batch = 100,000,000,000,000,000,000 x", "GiB of host memory",
              "lower train.steps")
    assert not (tmp_path / "r").exists()


def test_a_mamba_chunk_longer_than_the_sequence(tmp_path):
    """model.mamba_chunk_size=10^6 on 32-token rows: the scan's [chunk, chunk] mask was a MemoryError
    traceback; the chunk is the sequence (the same scan) and the step runs."""
    p = megajax("train", "model.hybrid_layer_pattern=M", "model.mamba_chunk_size=1000000", "model.hidden_size=32",
                "model.num_heads=2", "model.ffn_hidden_size=32", "model.mamba_state_dim=16", "model.mamba_head_dim=16",
                "model.mamba_num_groups=1", "train.steps=1", "train.seq_len=32", "train.global_batch=1",
                "train.eval_every=0", "train.sample_tokens=0", "logging.tensorboard=false",
                f"train.run_dir={tmp_path / 'r'}")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "megajax: done, 1 steps" in p.stderr + p.stdout


# ----------------------------------------------------------------------------------------------
# Options: given twice, or doing nothing where they are given

@pytest.mark.parametrize("args, words", [
    (["generate", "--checkpoint", "RUN", "--adapter", "a", "--adapter", "b", "--prompt", "hi"],
     ["--adapter a and --adapter b: --adapter takes one value and is given twice"]),
    (["export", "--format", "hf", "--checkpoint", "RUN", "--format", "peft", "--output", "OUT"],
     ["--format hf and --format peft"]),
    (["serve", "--checkpoint", "RUN", "--enable-prefix-caching", "--no-enable-prefix-caching"],
     ["--enable-prefix-caching and --no-enable-prefix-caching"]),
    (["serve", "--checkpoint", "RUN", "--batching", "static", "--enable-prefix-caching", "--block-size", "8"],
     ["--block-size, --enable-prefix-caching with --batching static", "drop them"]),
    (["serve", "--checkpoint", "RUN", "--max-batch", "1000000000", "--num-kv-blocks", "8"],  # was a MemoryError
     ["--max-batch 1000000000 with --num-kv-blocks 8", "at most 8 run at once"]),
    (["serve", "--checkpoint", "RUN", "--limit-images-per-prompt", "2", "--allowed-local-media-path", "."],
     ["--limit-images-per-prompt and --allowed-local-media-path: this model has no image encoder"]),
])
def test_options_given_twice_or_doing_nothing(run, tmp_path, args, words):  # noqa: F811
    """Each was accepted in silence: the last of a repeated option won, the static batcher ignored the
    continuous engine's options, a text model the image options."""
    args = [str(run) if a == "RUN" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    p = megajax(*args, "--port", "0") if args[0] == "serve" else megajax(*args)
    assert "listening on" not in p.stderr
    paragraph(p, args[0], *words)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# Image-text shards: what a sample trains, and the options of the other form

@pytest.fixture
def pictures(tmp_path):
    from PIL import Image
    (tmp_path / "pictures").mkdir()
    Image.new("RGB", (32, 32), "red").save(tmp_path / "pictures" / "p0.png")
    return tmp_path / "pictures"


ASK = [{"role": "user", "content": "<image>\nWhat is it?"}]


@pytest.mark.parametrize("record, words", [
    ({"image": "p0.png", "caption": "red", "messages": ASK + [{"role": "assistant", "content": "red"}]},
     ["the line holds both \"caption\" and \"messages\""]),  # the loader read the caption alone
    ({"image": "p0.png", "caption": ""}, ["the caption \"\" is empty"]),
    ({"image": "p0.png", "caption": "<image> "}, ["the caption \"<image> \" is empty"]),
])
def test_image_text_lines_that_train_nothing_or_mean_two_things(tmp_path, pictures, record, words):
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    p = megajax("preprocess", "--format", "webdataset", "--images", str(pictures), "--captions",
                str(tmp_path / "c.jsonl"), "--output-dir", str(tmp_path / "shards"))
    paragraph(p, "preprocess", f"{tmp_path / 'c.jsonl'}:1:", *words)
    assert not (tmp_path / "shards").exists()


def test_image_text_samples_without_an_answer_are_not_trained_as_zero_loss(tmp_path, pictures):
    """Shards of conversations without an assistant answer trained with loss 0.0000 and a warning about
    model.init_std and optim.lr; such a sample is now skipped and counted, and with none left the run says
    why."""
    (tmp_path / "c.jsonl").write_text(json.dumps({"image": "p0.png", "messages": ASK}) + "\n")
    assert megajax("preprocess", "--format", "webdataset", "--images", str(pictures), "--captions",
                   str(tmp_path / "c.jsonl"), "--output-dir", str(tmp_path / "shards")).returncode == 0
    p = megajax("train", "--config", "model/tiny-llava", "data.format=webdataset", f"data.path={tmp_path / 'shards'}",
                "data.split=100,0,0", "model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=128",
                "model.vision.num_layers=1", "train.steps=1", "train.global_batch=1", "train.seq_len=64",
                "train.eval_every=0", f"train.run_dir={tmp_path / 'r'}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "no token of the sample is trained: the conversation holds no assistant answer" in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, words", [
    (["--format", "webdataset", "--images", "PICS", "--captions", "CAPS", "--output-dir", "OUT", "--tokenizer", "byte",
      "--workers", "4"], ["--tokenizer, --workers: options of text datasets"]),
    (["--input", "CAPS", "--tokenizer", "byte", "--output-prefix", "OUT", "--shard-size", "5"],
     ["--shard-size 5 sets the samples per image-text shard"]),
    (["--merge", "a", "b", "--output-prefix", "OUT", "--tokenizer", "byte"], ["--tokenizer with --merge"]),
])
def test_preprocess_options_of_the_other_form(tmp_path, pictures, args, words):
    """Each option was ignored in silence by the form it does not belong to."""
    (tmp_path / "c.jsonl").write_text(json.dumps({"image": "p0.png", "caption": "red", "text": "red"}) + "\n")
    args = [{"PICS": str(pictures), "CAPS": str(tmp_path / "c.jsonl"), "OUT": str(tmp_path / "out")}.get(a, a)
            for a in args]
    paragraph(megajax("preprocess", *args), "preprocess", *words)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == []


# ----------------------------------------------------------------------------------------------
# Resuming a LoRA run with another base named

def test_a_lora_run_resumed_with_another_base_named(run, hf_dir, tmp_path):  # noqa: F811
    """A LoRA run's adapters (trained on a random megajax base), resumed with checkpoint.load = another model
    (hf_dir): the resume read the recorded base and said nothing of the one named. The recorded base named by
    a link to it is the same base."""
    from test_lora_export import LORA, lora_checkpoint
    base, lora, *_ = lora_checkpoint(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    os.rename(lora, tmp_path / "run" / "checkpoints" / lora.name)
    before = sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    p = megajax("train", f"train.run_dir={tmp_path / 'run'}", f"checkpoint.load={hf_dir}", *LORA, "train.steps=5")
    paragraph(p, "train", f"checkpoint.load = '{hf_dir}' names another base than the one the adapters",
              f"were trained on ({base})", "Drop checkpoint.load")
    assert sorted(str(p) for p in (tmp_path / "run").rglob("*") if p.name != "run.lock") == before  # lock: kept
    from megajax.config import load_config
    from megajax.checkpoint.manager import read_meta
    from megajax.train.setup import _same_base
    recorded = read_meta(tmp_path / "run" / "checkpoints" / lora.name)["lora_base"]
    os.symlink(base, tmp_path / "link")  # the same base by another path: not refused
    _same_base(load_config(overrides=[*LORA, f"checkpoint.load={tmp_path / 'link'}"]), recorded, lora)


def test_a_full_run_resumed_with_another_load_says_it_is_not_read():
    from megajax.config import load_config
    from megajax.train.resume_changes import describe_changes
    cfg = load_config(overrides=["checkpoint.load=/models/other"])
    saved = {"train": cfg.to_dict()["train"], "optim": cfg.to_dict()["optim"], "checkpoint": {"load": None}}
    note = describe_changes(saved, None, cfg, {}, 7, 70)
    assert "checkpoint.load None -> '/models/other': not read, the run continues from its own step 7" in note
    saved["checkpoint"]["load"] = "/models/other"
    assert describe_changes(saved, None, cfg, {}, 7, 70) is None  # the same load: nothing to say
