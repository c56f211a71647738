"""`megajax generate` with conversations: `--chat` (each --prompt a user message) and "messages" lines of a
.jsonl prompts file are rendered with the model's chat template, token for token as transformers'
`apply_chat_template(..., add_generation_prompt=True)` renders them, and complete as transformers' greedy
generate does; `--chat-template FILE` chooses another template."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from megajax.cli import main  # noqa: E402
from test_chat_template_export import OTHER, hf_model  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("chat") / "hf", "jinja")


def hf_greedy(model_dir, messages, template=None):
    """(prompt ids, greedy completion ids) by transformers: the template's rendering, then generate."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


def generate(tmp_path, *args):
    out = tmp_path / "out.json"
    assert main(["generate", *args, "--max-new-tokens", str(NEW), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_chat_flag_renders_each_prompt_as_a_user_message(model_dir, tmp_path):
    results = generate(tmp_path, "--hf", str(model_dir), "--chat", "--prompt", "w1 w2", "--prompt", "w9")
    for r, text in zip(results, ("w1 w2", "w9")):
        messages = [{"role": "user", "content": text}]
        ids, completion = hf_greedy(model_dir, messages)
        assert r["messages"] == messages and r["prompt_ids"] == ids
        assert r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["completion_ids"] == completion


def test_prompts_file_mixes_conversations_and_plain_prompts(model_dir, tmp_path):
    conversation = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w4 w5"},
                    {"role": "assistant", "content": "w6"}, {"role": "user", "content": "w7"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": conversation}) + "\n\n" + json.dumps({"prompt": "w1 w2"}) + "\n")
    first, plain = generate(tmp_path, "--hf", str(model_dir), "--prompts-file", str(prompts))
    assert first["prompt_ids"] == hf_greedy(model_dir, conversation)[0] and first["messages"] == conversation
    assert plain["prompt"] == "w1 w2" and plain["prompt_ids"] == [1, 2] and "messages" not in plain


def test_chat_template_file_wins(model_dir, tmp_path):
    (tmp_path / "chat.jinja").write_text(OTHER)
    [r] = generate(tmp_path, "--hf", str(model_dir), "--chat", "--prompt", "w8", "--chat-template",
                   str(tmp_path / "chat.jinja"))
    assert r["prompt"] == "[user] w8 [assistant]"
    assert r["prompt_ids"] == hf_greedy(model_dir, [{"role": "user", "content": "w8"}], OTHER)[0]


def test_a_byte_tokenizer_chat_run_speaks_its_training_template(tmp_path):
    """A run fine-tuned on chat data with the byte tokenizer: --chat renders with the template it learned
    (megajax.data.chat.BYTE_CHAT_TEMPLATE), as `megajax serve` does."""
    import jax

    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.config import load_config
    from megajax.train.state import build_model_spec
    cfg = load_config(overrides=["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                 "model.ffn_hidden_size=64", "model.vocab_size=257", "train.seq_len=32",
                                 "data.format=chat"])
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    write_params_checkpoint(jax.jit(init)(), cfg, tmp_path / "run")
    [r] = generate(tmp_path, "--checkpoint", str(tmp_path / "run"), "--chat", "--prompt", "add: 1 + 2")
    assert r["prompt"] == "user: add: 1 + 2\nassistant: " and r["prompt_ids"] == list(r["prompt"].encode())
