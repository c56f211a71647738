"""`megajax serve` with a vision-language model, through OpenAI's own client: chat content parts with
base64 images, answered by the continuous-batching engine (the image prefilled in chunks) exactly as
`megajax generate --image` answers the same prompt; bad images, remote URLs and images to a text-only
model are one clear 400."""

import base64
import json
import threading

import pytest

openai = pytest.importorskip("openai")

from megajax.checkpoint.manager import write_params_checkpoint  # noqa: E402
from megajax.cli import main  # noqa: E402
from megajax.data.tokenizer import byte_tokenizer_json  # noqa: E402
from megajax.inference.load import find_source, generation_config, load_model  # noqa: E402
from megajax.inference.server import CompletionServer  # noqa: E402
from test_vlm_generate import vlm_checkpoint, write_png  # noqa: E402,F401  (the fixture)

EOT = "<|endoftext|>"
# Roles in brackets, each turn on its line: the same bytes through the byte tokenizer's two forms.
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def tokenizer_dir(root):
    tok = root / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(byte_tokenizer_json())
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT, "bos_token": EOT,
                                                           "chat_template": TEMPLATE}))
    return tok


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def served(vlm_checkpoint, tmp_path_factory):
    """The tiny LLaVA behind the continuous engine, prefilling 16-token chunks (an image's
    placeholders straddle a chunk boundary)."""
    run, _ = vlm_checkpoint
    root = tmp_path_factory.mktemp("vlm-serve")
    tok = tokenizer_dir(root)
    source = find_source(str(run), None)
    loaded = load_model(generation_config(source, [f"data.tokenizer={tok}"]), source)
    (root / "media").mkdir()
    srv = CompletionServer(loaded, port=0, max_batch=4, quiet=True, prefill_chunk=16, limit_images=2,
                           allowed_local_media_path=str(root / "media")).start()
    yield srv, run, root
    srv.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0, timeout=300)


def generate_cli(run, image, prompt, tmp_path, n=10) -> dict:
    out = tmp_path / f"gen-{image.stem}.json"
    assert main(["generate", "--checkpoint", str(run), "--image", str(image), "--prompt", prompt,
                 "--max-new-tokens", str(n), "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    return result


def test_chat_with_an_image_equals_generate_image(served, client, tmp_path):
    """Two concurrent chats, each an image between text parts: their greedy answers, token counts and
    usage (image placeholders in prompt_tokens) equal `megajax generate --image` on the rendered prompt."""
    _, run, _ = served
    images = [write_png(tmp_path / f"img{k}.png", seed=k) for k in range(2)]
    lead = "describe:"  # "[user]describe:" is 15 bytes: the 4 placeholders cross the first 16-token chunk
    answers: dict = {}

    def ask(k):
        answers[k] = client.chat.completions.create(
            model="m", max_tokens=10, temperature=0,
            messages=[{"role": "user", "content": [{"type": "text", "text": lead},
                                                   {"type": "image_url", "image_url": {"url": data_url(images[k])}},
                                                   {"type": "text", "text": f" what is it? ({k})"}]}])

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        want = generate_cli(run, images[k], f"[user]{lead}<image> what is it? ({k})\n[assistant]", tmp_path)
        got = answers[k]
        assert got.choices[0].message.content == want["text"]
        assert got.usage.prompt_tokens == len(want["prompt_ids"]) and want["prompt_ids"].count(257) == 4
        assert got.usage.completion_tokens == len(want["completion_ids"])
    assert answers[0].choices[0].message.content != answers[1].choices[0].message.content


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, ["content[1]", "not a data URL"]),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}},
     ["content[1]", "not an image"]),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, ["content[1]", "base64"]),
    ({"type": "audio", "audio": {}}, ["content[1]", "image_url"]),
])
def test_bad_image_parts_are_one_clear_400(client, part, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    for w in words:
        assert w in message, message


def test_too_many_images_are_refused(client, tmp_path):
    url = data_url(write_png(tmp_path / "a.png"))
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3}])


def test_an_image_to_a_text_only_model_is_a_400(tmp_path):
    from random_model import random_model
    cfg, _, params = random_model("llama")
    write_params_checkpoint(params, cfg, tmp_path / "run")
    source = find_source(str(tmp_path / "run"), None)
    loaded = load_model(generation_config(source, [f"data.tokenizer={tokenizer_dir(tmp_path)}"]), source)
    srv = CompletionServer(loaded, port=0, quiet=True, batching="static").start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="no image encoder"):
            c.chat.completions.create(model="m", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {
                    "type": "image_url", "image_url": {"url": data_url(write_png(tmp_path / "a.png"))}}]}])
    finally:
        srv.close()


def test_static_batching_answers_an_image_chat_as_generate(served, tmp_path):
    """`--batching static` (whole prompts through the Generator's prefill) gives the same answer."""
    _, run, root = served
    source = find_source(str(run), None)
    loaded = load_model(generation_config(source, [f"data.tokenizer={root / 'tokenizer'}"]), source)
    srv = CompletionServer(loaded, port=0, quiet=True, batching="static").start()
    image = write_png(tmp_path / "img5.png", seed=5)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        got = c.chat.completions.create(model="m", max_tokens=10, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "and this?"}]}])
    finally:
        srv.close()
    want = generate_cli(run, image, "[user]<image>and this?\n[assistant]", tmp_path)
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == len(want["prompt_ids"])


def test_placeholders_without_their_images_are_a_400(client):
    """Prompt token ids holding the image placeholder (no image came with them) are refused, not run with
    empty features."""
    with pytest.raises(openai.BadRequestError, match="image placeholders") as e:
        client.completions.create(model="m", prompt=[104, 105, 257, 33], max_tokens=2)
    assert "0 image(s)" in str(e.value)


def test_file_urls_under_the_allowed_directory_and_streaming(served, client, tmp_path):
    """A file:// URL under --allowed-local-media-path reads that file (the same answer as its data URL,
    streamed too); one outside it is a 400 naming the part and the directory."""
    _, _, root = served
    image = write_png(root / "media" / "pic.png", seed=7)

    def ask(url, **kw):
        return client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what?"}]}], **kw)

    want = ask(data_url(image)).choices[0].message.content
    assert ask(image.as_uri()).choices[0].message.content == want
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in ask(image.as_uri(), stream=True)
                       if chunk.choices)
    assert streamed == want
    outside = write_png(tmp_path / "elsewhere.png")
    with pytest.raises(openai.BadRequestError, match="outside --allowed-local-media-path") as e:
        ask(outside.as_uri())
    assert "content[0]" in str(e.value)
