"""Bad chat data and bad chat templates, as a user meets them in `megajax train` (data.format=chat),
`megajax preprocess`, `megajax generate --prompts-file` and `megajax serve`: one paragraph naming the file
and line (or the template's file), exit status 2, no traceback, nothing written; a template that loops or
writes without end stops at megajax's bounds (2 s, 16 Mi characters) while normal templates render
exactly as Jinja's plain sandbox renders them. The `megajax` commands run as subprocesses and stop before
anything compiles."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from megajax.data import template_sandbox
from megajax.data.chat_template import ChatTemplateError, TemplateLimit, render_chat, render_with_answers
from megajax.data.instruct_tasks import read_prompts
from megajax.errors import DataError
from test_bad_input import ROOT, megajax, paragraph
from test_bad_input_serve import refused, run, serve  # noqa: F401  (run: the checkpoint fixture)
from test_sft_data import LLAMA3, QWEN3, WITHOUT_TAGS, conversations, make_tokenizer_dir

TRAIN = ["train.steps=1", "train.seq_len=64", "model.num_layers=1", "train.eval_every=0",
         "logging.tensorboard=false"]
PAIR = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def jsonl(path, *records, raw: bytes = b"") -> str:
    path.write_bytes(raw + b"".join(json.dumps(r).encode() + b"\n" for r in records))
    return str(path)


def train(tmp_path, *overrides):
    return megajax("train", *TRAIN, f"train.run_dir={tmp_path / 'run'}", *overrides)


def nothing_written(tmp_path):
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# Chat data files

def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_bytes(json.dumps(PAIR).encode() + b"\n" + b'{"prompt": "caf\xe9", "completion": "x"}\n')
    p = train(tmp_path, "data.format=chat", f"data.path={data}")
    paragraph(p, "train", f"{data}:2: byte 0xe9 at column 16 is not UTF-8", "iconv")
    nothing_written(tmp_path)


def test_a_lone_surrogate_escape_names_the_file_and_line(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(PAIR) + "\n" + '{"prompt": "a \\ud800 b", "completion": "x"}\n')
    p = train(tmp_path, "data.format=chat", f"data.path={data}")
    paragraph(p, "train", f"{data}:2: the JSON escape \\ud800 is half of a UTF-16 surrogate pair")


def test_a_byte_order_mark_is_read_as_nothing(tmp_path):
    """The first line (after the BOM) is read as a conversation: the error is the second line's."""
    data = jsonl(tmp_path / "chat.jsonl", PAIR, {"text": "not a conversation"}, raw=b"\xef\xbb\xbf")
    p = train(tmp_path, "data.format=chat", f"data.path={data}")
    paragraph(p, "train", f"{data}:2:", "neither")


def test_a_record_with_messages_and_a_prompt_is_refused(tmp_path):
    data = jsonl(tmp_path / "chat.jsonl", PAIR, {**PAIR, "prompt": "a", "completion": "b"})
    p = train(tmp_path, "data.format=chat", f"data.path={data}")
    paragraph(p, "train", f"{data}:2: the record holds both \"messages\" and \"prompt\" and \"completion\"",
              "{\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...}")


def test_conversations_without_an_answer_say_so_not_seq_len(tmp_path):
    data = jsonl(tmp_path / "chat.jsonl", *[{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    p = train(tmp_path, "data.format=chat", f"data.path={data}")
    out = paragraph(p, "train", "none of the train split's 3 conversations holds an assistant answer",
                    "data.loss_on=all")
    assert "seq_len" not in out


def test_a_megatron_prefix_given_to_chat_names_data_format_gpt(tmp_path):
    src = jsonl(tmp_path / "docs.jsonl", {"text": "some text"})
    assert megajax("preprocess", "--input", src, "--tokenizer", "byte", "--output-prefix",
                   str(tmp_path / "ds")).returncode == 0
    for given in ("ds_text_document", "ds_text_document.bin"):
        p = train(tmp_path, "data.format=chat", f"data.path={tmp_path / given}")
        paragraph(p, "train", "is a Megatron indexed dataset", "data.format=gpt reads",
                  f"give its prefix, {tmp_path / 'ds_text_document'}")


def test_a_jsonl_given_to_gpt_names_data_format_chat(tmp_path):
    data = jsonl(tmp_path / "chat.jsonl", PAIR)
    paragraph(train(tmp_path, f"data.path={data}"), "train", "data.format=chat reads conversations",
              "megajax preprocess", "data.format=gpt (the default)")


def test_a_chat_blend_speaks_of_chat_files(tmp_path):
    data = jsonl(tmp_path / "chat.jsonl", PAIR)
    out = paragraph(train(tmp_path, "data.format=chat", f"data.path=[0.5,{data},0.5]"), "train",
                    "a blend alternates weight and path", "data/math.jsonl")
    assert "text_document" not in out


def test_preprocess_reads_a_byte_order_mark_and_refuses_a_lone_surrogate(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", {"text": "first"}, {"text": "second \\ud83d\\ude00"}, raw=b"\xef\xbb\xbf")
    p = megajax("preprocess", "--input", src, "--tokenizer", "byte", "--output-prefix", str(tmp_path / "a"))
    assert p.returncode == 0 and "2 documents" in p.stderr, p.stderr
    (tmp_path / "lone.jsonl").write_text('{"text": "a \\ud800"}\n')
    p = megajax("preprocess", "--input", str(tmp_path / "lone.jsonl"), "--tokenizer", "byte", "--output-prefix",
                str(tmp_path / "b"))
    paragraph(p, "preprocess", f"{tmp_path / 'lone.jsonl'}, line 1: the JSON escape \\ud800", "--errors replace")
    assert not list(tmp_path.glob("b_*"))


def test_prompts_and_exact_match_files_are_read_by_the_same_rules(tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"one\n\xff two\n")
    p = megajax("generate", "--checkpoint", str(tmp_path / "none"), "--prompts-file", str(bad))
    paragraph(p, "generate", f"--prompts-file '{bad}':2: byte 0xff at column 1 is not UTF-8")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_bytes(b"\xef\xbb\xbf" + json.dumps(PAIR).encode() + b"\n" + b'{"messages": "\xc3("}\n')
    with pytest.raises(DataError, match="held_out.jsonl':2: byte 0xc3 at column 15 is not UTF-8"):
        read_prompts(held_out)
    held_out.write_bytes(b"\xef\xbb\xbf" + json.dumps(PAIR).encode() + b"\n")
    assert read_prompts(held_out) == [([PAIR["messages"][0]], "hello")]


# ----------------------------------------------------------------------------------------------
# Chat templates: the bounds

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MALICIOUS = {
    "nested loops": LOOPS,
    "nested loops over a list": "{% set x = range(100000)|list %}{% for i in x %}{% for j in x %}{% endfor %}"
                                "{% endfor %}",
    "string times a number": "{{ 'x' * 100000000 }}",
    "list times a number": "{{ ([1] * 100000000)|length }}",
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
                     "{% endfor %}",
    "doubling by +": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "join of a huge range": "{{ range(100000)|join('-' * 1000) }}",
    "join of references": "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|join }}",
    "macro recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "macro branching": "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "nested lists printed": "{% set ns = namespace(l=[]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}"
                            "{% endfor %}{{ ns.l }}",
    "repeated replace": "{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
                        "{% set ns.s = ns.s|replace('x', 'xxxxxxxxxx') %}{% endfor %}",
    "padding": "{{ 'x'.ljust(1000000000) }}{{ 'x'|center(1000000000) }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "printf width": "{{ '%*d' % (1000000000, 1) }}",
    "power": "{{ 7 ** 1000000 }}",
    "lorem ipsum": "{{ lipsum(100000000) }}",
    "output in a loop": "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 64 }}{% endfor %}"
                        "{% endfor %}",
    "set block": "{% set s = 'x' * 10000000 %}{% set t %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}",
    "kept allocations": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% for j in range(100000) %}"
                        "{% set ns.l = [ns.l, 'x' * 1000 ~ j] %}{% endfor %}{% endfor %}",
    "sum of lists": "{{ (range(100000)|map('string')|map('list')|list)|sum(start=[]) }}",
}


@pytest.mark.parametrize("name", MALICIOUS)
def test_a_template_without_end_stops_at_the_bounds(name):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        render_with_answers(MALICIOUS[name], PAIR["messages"])
    seconds = time.monotonic() - start
    assert seconds < template_sandbox.RENDER_SECONDS + 2.0, (name, seconds)
    assert str(e.value).startswith("the chat template "), str(e.value)


def test_the_bounds_hold_memory_down():
    """Every template above, rendered in a process allowed 1 GiB of address space: each stops at a bound
    (none with MemoryError, none killed)."""
    script = textwrap.dedent(f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from megajax.data.chat_template import ChatTemplateError, render_with_answers
        out = {{}}
        for name, template in json.loads(sys.argv[1]).items():
            try:
                render_with_answers(template, {PAIR['messages']!r})
                out[name] = "rendered"
            except ChatTemplateError as e:
                out[name] = str(e)
        print(json.dumps(out))
        """)
    p = subprocess.run([sys.executable, "-c", script, json.dumps(MALICIOUS)], capture_output=True, text=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for name, said in json.loads(p.stdout).items():
        assert said.startswith("the chat template") and "MemoryError" not in said, (name, said)


def test_the_bounds_apply_in_server_threads():
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(render_chat, LOOPS, PAIR["messages"]) for _ in range(3)]
        for f in futures:
            with pytest.raises(TemplateLimit, match="ran longer than 2 s"):
                f.result(timeout=template_sandbox.RENDER_SECONDS + 10)
    assert render_chat("{{ messages[0].content }}", PAIR["messages"]) == "hi"  # the thread is usable again


FILTERS = ("{{ messages|tojson(indent=2) }}{{ messages|map(attribute='content')|join(', ') }}"
           "{{ '%-8s|' % 'x' }}{{ '{:>5}'.format(3) }}{{ ('ab' * 3)|replace('a', 'c') }}")


@pytest.mark.parametrize("template", [LLAMA3, QWEN3, WITHOUT_TAGS["llama3"], WITHOUT_TAGS["qwen3"], FILTERS])
def test_normal_templates_render_as_the_plain_sandbox_renders(template):
    """The bounded sandbox writes the same text as Jinja's own immutable sandbox (transformers' renderer),
    also for a conversation of a few megabytes."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from megajax.data.chat_template import _generation_extension
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[loopcontrols, _generation_extension()])
    plain.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    compiled = plain.from_string(template)
    rng = random.Random(0)
    long = [{"role": "user", "content": "é 日本 " * 500_000}, {"role": "assistant", "content": "ok"}]
    for messages in conversations(rng, 20) + [long]:
        for prompt in (False, True):
            want = compiled.render(messages=messages, add_generation_prompt=prompt, bos_token="<s>", eos_token="</s>")
            assert render_chat(template, messages, add_generation_prompt=prompt, bos_token="<s>",
                               eos_token="</s>") == want


# ----------------------------------------------------------------------------------------------
# Chat templates in `megajax train`

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Tokenizer directories whose chat templates fail: on every conversation (looping, huge, undefined names),
    or only on conversations of more than two messages."""
    root = tmp_path_factory.mktemp("templates")
    head = "{{- bos_token }}"
    made = {}
    for name, extra in {"loops": LOOPS, "huge": "{{ 'x' * 100000000 }}", "undefined": "{{ foo.bar }}",
                        "long conversations": "{% if messages|length > 2 %}" + LOOPS + "{% endif %}",
                        "refuses": "{% if messages|length > 2 %}{{ raise_exception('one turn only') }}{% endif %}"
                        }.items():
        made[name] = make_tokenizer_dir(root / name.replace(" ", "_"), "llama3", LLAMA3.replace(head, head + extra))
    return made


@pytest.mark.parametrize("name, words", [
    ("loops", ["ran longer than 2 s on one conversation", "so on every one"]),
    ("huge", ["would build a string repeated 100,000,000 times", "16,777,216"]),
    ("undefined", ["failed (UndefinedError: 'foo' is undefined)", "so on every one"]),
])
def test_a_template_failing_everywhere_is_named_before_the_data(tmp_path, tokenizers, name, words):
    data = jsonl(tmp_path / "chat.jsonl", PAIR)
    start = time.monotonic()
    p = train(tmp_path, "data.format=chat", f"data.path={data}", f"data.tokenizer={tokenizers[name]}",
              "model.vocab_size=384")
    config = tokenizers[name] / "tokenizer_config.json"
    out = paragraph(p, "train", f"the chat template (\"chat_template\" in {config})", *words)
    assert f"{data}:" not in out  # not blamed on line 1 of the data
    assert time.monotonic() - start < 120
    nothing_written(tmp_path)


def test_a_template_failing_on_one_conversation_names_it_and_the_template(tmp_path, tokenizers):
    two = {"messages": PAIR["messages"] * 2}
    data = jsonl(tmp_path / "chat.jsonl", PAIR, PAIR, two)
    config = tokenizers["long conversations"] / "tokenizer_config.json"
    p = train(tmp_path, "data.format=chat", f"data.path={data}", f"data.tokenizer={tokenizers['long conversations']}",
              "model.vocab_size=384")
    paragraph(p, "train", f"the chat template (\"chat_template\" in {config}) ran longer than 2 s",
              f"on the conversation at {data}:3", "shorten the conversation or fix the template")
    p = train(tmp_path, "data.format=chat", f"data.path={data}", f"data.tokenizer={tokenizers['refuses']}",
              "model.vocab_size=384")
    paragraph(p, "train", f"{data}:3: the chat template (", "refused the messages: one turn only")


# ----------------------------------------------------------------------------------------------
# Chat templates in `megajax serve`

def test_serve_refuses_a_template_that_fails_on_every_conversation(run, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(LOOPS + "{% for m in messages %}{{ m.content }}{% endfor %}")
    start = time.monotonic()
    refused(serve(run, "--chat-template", str(path), "--port", "0"), f"the chat template (--chat-template {path}) "
            f"ran longer than 2 s", "so on every one", "pass --chat-template FILE")
    assert time.monotonic() - start < 120


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizers):
    """A small model served in this process with the template that loops on conversations of more than two
    messages and fails on a user turn saying 'undefined'."""
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.config import load_config
    from megajax.inference.load import find_source, generation_config, load_model
    from megajax.inference.server import CompletionServer
    from megajax.train.state import build_model_spec
    cfg = load_config(overrides=["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                 "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.vocab_size=384",
                                 "train.seq_len=64"])
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    run = tmp_path_factory.mktemp("serve-template") / "run"
    write_params_checkpoint(jax.jit(init)(), cfg, run)
    source = find_source(str(run), None)
    template = ("{% if messages[0].content == 'undefined' %}{{ foo.bar }}{% endif %}"
                "{% if messages|length > 2 %}" + LOOPS + "{% endif %}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]")
    path = run.parent / "chat.jinja"
    path.write_text(template)
    loaded = load_model(generation_config(source, [f"data.tokenizer={tokenizers['loops']}"]), source,
                        devices=jax.devices()[:1])
    srv = CompletionServer(loaded, port=0, max_batch=2, quiet=True, chat_template=template,
                           chat_template_source=f"--chat-template {path}").start()
    yield srv
    srv.close()


def test_serve_answers_a_failing_template_with_an_error_and_keeps_serving(server):
    from test_serve_openai import _post
    long = {"messages": PAIR["messages"] + [{"role": "user", "content": "more"}], "max_tokens": 2}
    start = time.monotonic()
    status, body = _post(server.url, "/v1/chat/completions", long)
    assert status == 400 and "ran longer than 2 s" in body["error"]["message"], body
    assert "--chat-template" in body["error"]["message"]
    assert time.monotonic() - start < template_sandbox.RENDER_SECONDS + 10
    status, body = _post(server.url, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "undefined"}], "max_tokens": 2})
    assert status == 500 and body["error"]["code"] == "chat_template_error", body
    assert "'foo' is undefined" in body["error"]["message"]
    status, body = _post(server.url, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body


def test_the_time_bound_holds_when_its_first_raise_is_swallowed(monkeypatch):
    """The watchdog's exception lands at the rendering thread's next Python step, which may be a callback
    that swallows it (a gc callback: JAX registers one); the watchdog raises again, the rendering stops
    within the bound plus one repeat, and nothing is raised in the thread after `bounded` returns."""
    from megajax.data import template_sandbox as ts
    monkeypatch.setattr(ts, "RENDER_SECONDS", 0.3)
    swallowed = []

    def work():
        while True:
            try:
                while True:
                    pass
            except ts._Overtime:
                if swallowed:
                    raise
                swallowed.append(time.monotonic())  # as a callback would: printed, and the loop goes on

    start = time.monotonic()
    with pytest.raises(ts.TemplateLimit, match="ran longer than 0.3 s"):
        ts.bounded(work)
    took = time.monotonic() - start
    assert len(swallowed) == 1 and took < 0.3 + ts.REFIRE_SECONDS + 1.0, took
    deadline = time.monotonic() + 2 * ts.REFIRE_SECONDS  # no stray raise once bounded has returned
    while time.monotonic() < deadline:
        pass
    assert ts.bounded(lambda: "done") == "done"
