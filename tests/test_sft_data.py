"""Chat data for fine-tuning: tokens and answer masks against transformers' apply_chat_template,
packing, the loader's resume and host sharding, bad input, and a short `megajax train` on chat data."""

import json
import random

import numpy as np
import pytest

from megajax.data.chat import encode_conversation, tokenize_conversation
from megajax.data.chat_template import find_chat_template
from megajax.data.tokenizer import load_tokenizer
from megajax.errors import DataError

# A Llama 3 style template (header tokens, <|eot_id|>, bos written by the template) and a Qwen3 style
# one (<|im_start|>/<|im_end|>, an empty think block before the last answer), with generation tags.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{% generation %}{%- if loop.last %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
WITHOUT_TAGS = {name: t.replace("{% generation %}", "").replace("{% endgeneration %}", "")
                for name, t in (("llama3", LLAMA3), ("qwen3", QWEN3))}
SPECIALS = {"llama3": ("<|begin_of_text|>", "<|eot_id|>",
                       ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
            "qwen3": (None, "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])}
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "what", "is", "two", "plus", "three", "five", "sum",
         "answer", "reverse", "word", "sort", "list", "hello", "world", "é", "日本"]


def make_tokenizer_dir(path, family: str, template: str | None):
    """A tiny byte-level BPE tokenizer trained here with the family's special tokens, saved with a
    tokenizer_config.json holding `template` as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    bos, eos, specials = SPECIALS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(100)], trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
              "clean_up_tokenization_spaces": False}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def conversations(rng: random.Random, n: int, turns=(1, 3), words=(1, 12)) -> list[list[dict]]:
    """Random conversations: an optional system turn, then user/assistant pairs."""
    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(*turns)):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append(messages)
    return out


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def family(request, tmp_path_factory):
    template = LLAMA3 if request.param == "llama3" else QWEN3
    return request.param, make_tokenizer_dir(tmp_path_factory.mktemp(request.param), request.param, template)


def test_tokens_and_mask_equal_transformers(family):
    from transformers import AutoTokenizer
    name, folder = family
    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(str(folder))
    template = find_chat_template(ours)
    rng = random.Random(1)
    for messages in conversations(rng, 12):
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = tokenize_conversation(ours, template, messages)
        assert ids.dtype == np.int32 and mask.dtype == bool
        assert ids.tolist() == list(ref["input_ids"])
        assert mask.astype(int).tolist() == list(ref["assistant_masks"])
        assert mask.any() and not mask.all()
        decoded = hf.decode(ids[mask].tolist())
        for m in messages:
            if m["role"] == "assistant":
                assert m["content"].strip() in decoded
        _, every = tokenize_conversation(ours, template, messages, loss_on="all")
        assert every.all()


def test_turn_by_turn_rendering_finds_the_same_answers_without_tags(family):
    name, folder = family
    ours = load_tokenizer(str(folder))
    rng = random.Random(2)
    for messages in conversations(rng, 8, turns=(1, 1) if name == "qwen3" else (1, 3)):
        tagged = encode_conversation(ours, LLAMA3 if name == "llama3" else QWEN3, messages)
        plain = encode_conversation(ours, WITHOUT_TAGS[name], messages)
        assert plain.ids.tolist() == tagged.ids.tolist()
        # Without tags an answer runs up to the next turn: Qwen's newline after <|im_end|> is in it.
        extra = plain.answer & ~tagged.answer
        assert not (tagged.answer & ~plain.answer).any()
        assert ours.decode(plain.ids[extra]).strip() == ""
        assert len(plain.answer_ends) == len(tagged.answer_ends)
        if name == "llama3":
            assert not extra.any() and plain.answer_ends == tagged.answer_ends


def test_a_template_that_is_not_prefix_stable_asks_for_generation_tags(tmp_path):
    folder = make_tokenizer_dir(tmp_path, "qwen3", QWEN3)  # an earlier answer loses its think block
    messages = conversations(random.Random(3), 1, turns=(2, 2))[0]
    with pytest.raises(ValueError, match="generation %}"):
        encode_conversation(load_tokenizer(str(folder)), WITHOUT_TAGS["qwen3"], messages)


def test_bad_messages_are_named():
    tok = load_tokenizer("byte")
    for messages, match in [([{"role": "robot", "content": "hi"}], "role 'robot'.*accepted roles"),
                            ([{"role": "user", "content": 3}], "content must be a string"),
                            ([], "non-empty list")]:
        with pytest.raises(DataError, match=match):
            tokenize_conversation(tok, LLAMA3, messages)
    with pytest.raises(Exception, match="loss_on = 'prompt'"):
        tokenize_conversation(tok, LLAMA3, [{"role": "user", "content": "hi"}], loss_on="prompt")
