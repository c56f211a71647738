"""Wrong input on `megajax serve`, as a user starts it: start-up options that cannot work stop it with one
paragraph and exit status 2 before it listens (a chat template that is not Jinja, a port out of range, an
address that is not this machine's, a KV cache larger than the device), and a client that leaves in the
middle of its request is one log line, not a traceback. Each `megajax serve` runs as a subprocess on a
small checkpoint written once for the module."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from megajax.checkpoint.manager import write_params_checkpoint
from megajax.config import load_config
from megajax.data.tokenizer import byte_tokenizer_json
from megajax.train.state import build_model_spec
from conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
NOT_JINJA = "{% for m in messages %}{{ m.content }"  # the block's closing tag is missing


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    cfg = load_config(overrides=["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                 "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.vocab_size=257",
                                 "train.seq_len=32"])
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    out = tmp_path_factory.mktemp("bad-serve") / "run"
    write_params_checkpoint(jax.jit(init)(), cfg, out)
    return out


def serve(run: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`megajax serve` expected to stop by itself (a minute at most)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    return subprocess.run([sys.executable, "-m", "megajax.cli", "serve", "--checkpoint", str(run), *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def refused(p: subprocess.CompletedProcess, *words: str) -> str:
    """The start-up error: exit status 2 (not an abort), one paragraph as the last line, no traceback, and
    the server never listened."""
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "listening on" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("megajax serve: error:"), p.stderr
    for w in words:
        assert w in last, (w, last)
    return last


@pytest.mark.parametrize("template, words", [
    (NOT_JINJA, ["is not valid Jinja: line 1", "give a Jinja chat template file"]),
    ("", ["is empty"]),
    (None, ["cannot read it", "No such file"]),
])
def test_chat_template_is_checked_at_start_up(run, tmp_path, template, words):
    path = tmp_path / "chat.jinja"
    if template is not None:
        path.write_text(template)
    refused(serve(run, "--chat-template", str(path), "--port", "0"), f"--chat-template '{path}'", *words)


def test_the_tokenizers_own_chat_template_is_checked_at_start_up(run, tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text(byte_tokenizer_json())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"chat_template": NOT_JINJA}))
    last = refused(serve(run, f"data.tokenizer={tokenizer}", "--port", "0"), "the tokenizer's", "not valid Jinja",
                   "pass --chat-template FILE")
    assert str(tokenizer) in last


@pytest.mark.parametrize("args, words", [
    (["--port", "70000"], ["--port 70000: must be a TCP port, 1..65535, or 0"]),
    (["--port", "-1"], ["--port -1"]),
    (["--host", "not a host", "--port", "0"], ["cannot listen on not a host:0"]),
    (["--max-batch", "1000000000000", "--port", "0"], ["--max-batch 1000000000000",
                                                       "GiB per device, more than the device's"]),
    (["--num-kv-blocks", "1000000000000000", "--port", "0"], ["--num-kv-blocks 1000000000000000"]),
])
def test_start_up_options_that_cannot_work(run, args, words):
    refused(serve(run, *args), *words)


def test_a_port_in_use(run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused(serve(run, "--port", str(port)), f"cannot listen on 127.0.0.1:{port}", "choose another --port")


def test_a_client_that_leaves_mid_body_is_one_log_line(run, tmp_path):
    """A body cut short by the client (it sends 10 of the 100 bytes it announced, then closes): one log line
    (client_gone), no traceback, and the server answers the next requests (a chat message without content
    is a 400 naming it); a kept-alive connection reset between requests ends quietly."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]")
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, "-m", "megajax.cli", "serve", "--checkpoint", str(run), "--port", "0",
                          "--chat-template", str(template)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "listening on" not in line:
            line = p.stderr.readline()
            assert line, "the server exited before listening"
        host, port = re.search(r"listening on http://([\d.]+):(\d+)", line).groups()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + b'{"prompt":')
        with socket.create_connection((host, int(port))) as s:  # no prompt: the server answers 400
            s.sendall(head.replace(b"100", b"2") + b"{}")
            assert b" 400 " in s.recv(4096).split(b"\r\n")[0]
            time.sleep(0.2)  # then the kept-alive connection is reset while the server waits for its next request
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        chat = http.client.HTTPConnection(host, int(port), timeout=60)
        chat.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user"}], "max_tokens": 1}),
                     {"Content-Type": "application/json"})
        answer = chat.getresponse()
        assert answer.status == 400
        assert "'messages'[0] (role 'user') has no 'content'" in json.loads(answer.read())["error"]["message"]
        chat.close()
        time.sleep(0.5)
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    gone = [x for x in err.splitlines() if "client_gone" in x]
    assert len(gone) == 1 and "POST /v1/completions" in gone[0], err
    assert gone[0].endswith("client_gone: sent 10 of 100 body bytes"), err
