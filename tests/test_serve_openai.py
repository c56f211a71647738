"""`megajax serve` against OpenAI's own client and lm-evaluation-harness's request bodies: completions
(stop, n, logprobs, echo, penalties, streaming), chat with the tokenizer's template, the tokenizer
endpoints, and errors that leave a kept-alive connection usable. Log-probabilities are checked against
a full forward pass of the same model (its log-softmax, computed directly)."""

import http.client
import json

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from megajax.checkpoint.manager import write_params_checkpoint  # noqa: E402
from megajax.config import load_config  # noqa: E402
from megajax.data.tokenizer import byte_tokenizer_json  # noqa: E402
from megajax.inference.load import find_source, generation_config, load_model  # noqa: E402
from megajax.inference.server import CompletionServer  # noqa: E402
from megajax.train.state import build_model_spec  # noqa: E402

CONTEXT = 64
VOCAB = 257
EOT = "<|endoftext|>"  # the byte tokenizer's end-of-document token (id 256) in its Hugging Face form
# A chat template in Hugging Face's dialect: roles in brackets, each turn ended by the eos token.
TEMPLATE = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns here') }}{% endif %}"
            "[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, reference) on one device: a small random model behind a Hugging Face tokenizer directory
    (the byte tokenizer with a chat template); `reference(ids)` is the full forward's log-softmax [L, V]."""
    root = tmp_path_factory.mktemp("serve-openai")
    tok = root / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(byte_tokenizer_json())
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT, "bos_token": EOT,
                                                           "chat_template": TEMPLATE}))
    cfg = load_config(overrides=["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                 "model.num_kv_heads=2", "model.ffn_hidden_size=128", f"model.vocab_size={VOCAB}",
                                 f"train.seq_len={CONTEXT}", "model.init_std=0.1"])
    spec, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    params = jax.jit(init)()
    write_params_checkpoint(params, cfg, root / "run")
    source = find_source(str(root / "run"), None)
    loaded = load_model(generation_config(source, [f"data.tokenizer={tok}"]), source, devices=jax.devices()[:1])
    apply = jax.jit(spec.apply)

    def reference(ids):
        buf = np.zeros((1, CONTEXT), np.int32)
        buf[0, :len(ids)] = ids
        return np.asarray(jax.nn.log_softmax(apply(params, buf)[0, :len(ids), :VOCAB].astype(np.float32)))

    srv = CompletionServer(loaded, port=0, max_batch=4, quiet=True).start()
    yield srv, reference
    srv.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0, timeout=300)


def greedy(reference, ids, n, frequency=0.0, presence=0.0):
    """The greedy continuation of `ids` by full forward passes (OpenAI's penalties on the new tokens) and
    the log p of each chosen token (the model's own distribution)."""
    ids, new, logprobs = list(ids), [], []
    for _ in range(n):
        logp = reference(ids)[-1]
        counts = np.bincount(new, minlength=VOCAB)[:VOCAB].astype(np.float32)
        token = int(np.argmax(logp - frequency * counts - presence * (counts > 0)))
        new.append(token)
        logprobs.append(float(logp[token]))
        ids.append(token)
        if token == 256:
            break
    return new, logprobs


def text_of(ids):
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


PROMPT = "The quick brown fox"
IDS = list(PROMPT.encode())


def test_plain_and_streamed_completions_are_the_greedy_completion(served, client):
    _, reference = served
    want, _ = greedy(reference, IDS, 12)
    answer = client.completions.create(model="megajax", prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.choices[0].text == text_of(want)
    assert answer.usage.prompt_tokens == len(IDS) and answer.usage.completion_tokens == len(want)
    stream = client.completions.create(model="megajax", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(want)
    assert chunks[-1].usage.completion_tokens == len(want)


def _stop_in(text: str) -> tuple[str, int]:
    """A two-character stop sequence of `text` (ASCII, first seen after its third character) and where it is."""
    for i in range(3, len(text) - 1):
        s = text[i:i + 2]
        if s.isascii() and s.isprintable() and text.find(s) == i:
            return s, i
    raise AssertionError(f"no usable stop sequence in {text!r}")


def test_stop_sequences_cut_the_text_across_tokens(served, client):
    _, reference = served
    want, _ = greedy(reference, IDS, 24)
    full = text_of(want)
    stop, at = _stop_in(full)
    body = dict(model="megajax", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never seen"])
    answer = client.completions.create(**body)
    assert answer.choices[0].text == full[:at] and answer.choices[0].finish_reason == "stop"
    through = min(k for k in range(len(want) + 1) if stop in text_of(want[:k]))
    assert answer.usage.completion_tokens == through  # the tokens through the stop sequence
    streamed = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:at]
    assert streamed[-1].choices[0].finish_reason == "stop"
    # A string stop; one that never occurs leaves the completion whole.
    assert client.completions.create(**{**body, "stop": stop}).choices[0].text == full[:at]
    assert client.completions.create(**{**body, "stop": "never seen"}).choices[0].text == full


def test_n_seeds_and_penalties(served, client):
    _, reference = served
    body = dict(model="megajax", prompt=["ab", "cd"], max_tokens=8, temperature=1.0, n=3, seed=5)
    first = client.completions.create(**body)
    assert sorted(c.index for c in first.choices) == list(range(6))
    again = client.completions.create(**body)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    want, _ = greedy(reference, IDS, 10, frequency=1.5, presence=0.5)
    got = client.completions.create(model="megajax", prompt=PROMPT, max_tokens=10, temperature=0,
                                    frequency_penalty=1.5, presence_penalty=0.5)
    assert got.choices[0].text == text_of(want)
    assert want != greedy(reference, IDS, 10)[0]  # the penalties changed the greedy path


def test_logprobs_equal_the_full_forward_log_softmax(served, client):
    _, reference = served
    want, want_lp = greedy(reference, IDS, 6)
    answer = client.completions.create(model="megajax", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    lp = answer.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, want_lp, atol=1e-4)
    assert lp.tokens == [text_of([t]) for t in want]
    assert lp.text_offset[0] == len(PROMPT)  # offsets count from the prompt's start
    logp = reference(IDS + want)
    for i, top in enumerate(lp.top_logprobs):
        row = logp[len(IDS) - 1 + i]
        want_top = {}  # the 5 likeliest by text (bytes >= 128 alone all read U+FFFD: the likelier is kept)
        for t in np.argsort(-row)[:5]:
            want_top.setdefault(text_of([t]), float(row[t]))
        assert top.keys() == want_top.keys()
        np.testing.assert_allclose([top[k] for k in want_top], list(want_top.values()), atol=1e-4)
        assert max(top.values()) == lp.token_logprobs[i]  # greedy: the chosen token is the likeliest


def _post(url, path, body, content_type="application/json"):
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": content_type})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_lm_eval_loglikelihood_request(served):
    """local-completions' loglikelihood body (token ids, echo, max_tokens 1, logprobs 1), read as lm-eval reads
    it: sum(token_logprobs[ctxlen:-1]) and greediness from max(top_logprobs[i].values())."""
    srv, reference = served
    contexts = [list(b"Question: 2+2=? Answer:"), list(b"Hello")]
    continuations = [list(b" 4"), greedy(reference, list(b"Hello"), 3)[0]]  # the second one greedy
    prompts = [c + x for c, x in zip(contexts, continuations)]
    status, answer = _post(srv.url, "/v1/completions", {"model": "megajax", "prompt": prompts, "temperature": 0,
                                                        "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200, answer
    for choice, ctx, prompt in zip(sorted(answer["choices"], key=lambda c: c["index"]), contexts, prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        logp = reference(prompt)
        want = [float(logp[j - 1, prompt[j]]) for j in range(1, len(prompt))]
        np.testing.assert_allclose(lp["token_logprobs"][1:len(prompt)], want, atol=1e-4)
        got_sum = sum(lp["token_logprobs"][len(ctx):-1])
        np.testing.assert_allclose(got_sum, sum(want[len(ctx) - 1:]), atol=1e-4)
        is_greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][len(ctx):-1],
                                                                  lp["top_logprobs"][len(ctx):-1]))
        want_greedy = all(int(np.argmax(logp[j - 1])) == prompt[j] for j in range(len(ctx), len(prompt)))
        assert is_greedy == want_greedy
        assert choice["text"].startswith(text_of(prompt))  # echo: the prompt, then the new token
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 2
    # max_tokens 0 with echo: the prompt scored, nothing generated.
    status, scored = _post(srv.url, "/v1/completions", {"prompt": prompts[0], "max_tokens": 0, "echo": True,
                                                        "logprobs": 0, "temperature": 0})
    assert status == 200 and scored["choices"][0]["text"] == text_of(prompts[0])
    assert len(scored["choices"][0]["logprobs"]["tokens"]) == len(prompts[0])
    assert scored["usage"]["completion_tokens"] == 0


def test_lm_eval_generate_until_request(served):
    srv, reference = served
    want, _ = greedy(reference, IDS, 24)
    stop, at = _stop_in(text_of(want))
    body = {"prompt": [PROMPT, PROMPT[:9]], "model": "megajax", "max_tokens": 24, "temperature": 0,
            "stop": ["\n\n", "Question:", stop, EOT], "seed": 1234}
    status, answer = _post(srv.url, "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == text_of(want)[:at]


def test_streamed_echo_and_logprobs_match_the_answer(served):
    srv, _ = served
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "logprobs": 2, "echo": True}
    _, whole = _post(srv.url, "/v1/completions", body)
    conn = http.client.HTTPConnection(srv.url.removeprefix("http://"), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    frames = [f for f in conn.getresponse().read().decode().split("\n\n") if f]
    events = [json.loads(f[6:]) for f in frames[:-1]]
    choice = whole["choices"][0]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    lps = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((x[key] for x in lps), []) == choice["logprobs"][key], key


def test_chat_with_the_tokenizers_template(served, client):
    srv, reference = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "[system]Be brief.<|endoftext|>[user]Hi<|endoftext|>[assistant]"
    ids = [t for part in rendered.split(EOT) for t in [*part.encode(), 256]][:-1]  # the eos text is one token
    status, tokens = _post(srv.url, "/tokenize", {"messages": messages})
    assert status == 200 and tokens["tokens"] == ids and tokens["count"] == len(ids)
    want, want_lp = greedy(reference, ids, 10)
    answer = client.chat.completions.create(model="megajax", messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=2)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text_of(want)
    assert answer.object == "chat.completion" and answer.usage.prompt_tokens == len(ids)
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], want_lp, atol=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    stream = client.chat.completions.create(model="megajax", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text_of(want)
    with pytest.raises(openai.BadRequestError, match="no tool turns here"):  # raise_exception in the template
        client.chat.completions.create(model="megajax", messages=[{"role": "tool", "content": "x"}])


def test_chat_without_a_template_says_how_to_give_one(served, client, monkeypatch):
    srv, _ = served
    monkeypatch.setattr(srv.service, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="--chat-template FILE"):
        client.chat.completions.create(model="megajax", messages=[{"role": "user", "content": "Hi"}])


def test_tokenizer_endpoints_in_vllms_shapes(served, client):
    srv, _ = served
    conn = http.client.HTTPConnection(srv.url.removeprefix("http://"), timeout=60)
    conn.request("GET", "/tokenizer_info")
    info = json.loads(conn.getresponse().read())
    assert info["eos_token"] == EOT and info["chat_template"] == TEMPLATE and info["model_max_length"] == CONTEXT
    status, tokens = _post(srv.url, "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert status == 200 and tokens == {"tokens": list(b"test"), "count": 4, "max_model_len": CONTEXT}
    assert _post(srv.url, "/tokenize", {"prompt": EOT, "add_special_tokens": False})[1]["tokens"] == [256]
    assert _post(srv.url, "/detokenize", {"tokens": list(b"test")}) == (200, {"prompt": "test"})
    assert [m.id for m in client.models.list()] == [srv.service.model_name]


@pytest.mark.parametrize("body,content_type,param,words", [
    ({"prompt": "x", "frobnicate": 1}, "application/json", "frobnicate", "unknown field 'frobnicate'"),
    ({"prompt": "x"}, "text/plain", None, "Content-Type 'text/plain'"),
    ({"prompt": ""}, "application/json", "prompt", "prompt 0 is empty"),
    ({"prompt": "x" * CONTEXT, "max_tokens": 1}, "application/json", "prompt", "leaves no room for a new token"),
    ({"prompt": "x" * 60, "max_tokens": 9}, "application/json", "max_tokens", "ask for at most 4 new tokens"),
    ({"prompt": "x" * 63, "max_tokens": 9}, "application/json", "max_tokens", "at most 1 new token."),
    ({"prompt": "x", "max_tokens": 0}, "application/json", "max_tokens", "needs 'echo': true"),
    ({"prompt": "x", "logprobs": 21}, "application/json", "logprobs", "[0, 20]"),
    ({"prompt": "x", "stop": [1]}, "application/json", "stop", "list of strings"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "application/json", "logit_bias", "not supported"),
    ({"prompt": "x", "best_of": 3}, "application/json", "best_of", "best_of = n"),
    ({"prompt": ["a", "b"], "n": 200}, "application/json", "n", "400 sequences (prompts x n) in one request; at most"),
])
def test_errors_name_the_field(served, body, content_type, param, words):
    status, answer = _post(served[0].url, "/v1/completions", body, content_type)
    error = answer["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_errors_leave_a_kept_alive_connection_usable(served):
    """404, 405, 400 and 413 read the request's body, as does an endpoint that wants none: the connection's
    next request is answered."""
    srv, _ = served
    conn = http.client.HTTPConnection(srv.url.removeprefix("http://"), timeout=300)
    ok = json.dumps({"prompt": "ok", "max_tokens": 2, "temperature": 0})
    refused = [("POST", "/nowhere", ok, 404), ("DELETE", "/v1/completions", ok, 405),
               ("POST", "/v1/completions", "{not json", 400),
               ("POST", "/v1/completions", " " * (16 * 2**20 + 1), 413), ("GET", "/v1/completions", ok, 405),
               ("GET", "/health", ok, 200)]
    for method, path, body, status in refused:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == status and r.getheader("Content-Type") == "application/json"
        assert status == 200 or "message" in json.loads(r.read())["error"]
        r.read()
        conn.request("POST", "/v1/completions", ok, {"Content-Type": "application/json"})  # the same connection
        r = conn.getresponse()
        assert r.status == 200, (method, path, r.read())
        assert json.loads(r.read())["choices"][0]["finish_reason"] in ("stop", "length")
