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


# ----------------------------------------------------------------------------
# Fitting and packing
# ----------------------------------------------------------------------------

def byte_conversations(n: int, seed: int = 0, **kw) -> list:
    """Encoded random conversations (the byte tokenizer with the Llama 3 style template)."""
    tok = load_tokenizer("byte")
    return [encode_conversation(tok, LLAMA3, m) for m in conversations(random.Random(seed), n, **kw)]


def check_rows(ds, kept: list) -> list[int]:
    """Every row is well formed; returns the kept-conversation index of each document of the rows, in order."""
    by_ids = {}
    for k, (ids, _) in enumerate(kept):
        by_ids.setdefault(ids.tobytes(), []).append(k)
    seen = []
    for i in range(len(ds)):
        s = ds[i]
        assert all(v.shape == (ds.limit,) for v in s.values())
        seg, pos, tokens, mask = s["segment_ids"], s["positions"], s["tokens"], s["loss_mask"]
        assert seg[0] == 0 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 1)
        for k in np.unique(seg):
            where = np.flatnonzero(seg == k)
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))  # restart at 0, contiguous
            candidates = by_ids.get(tokens[where].astype(np.int32).tobytes(), [])
            if not candidates:  # the padding: one segment at the end, untrained
                assert k == seg[-1] and np.all(tokens[where] == ds.pad_id) and not mask[where].any()
                continue
            seen.append(candidates[0])
            np.testing.assert_array_equal(mask[where], kept[candidates[0]][1])
            assert mask[where[-1]] == 0  # a conversation's last token predicts nothing
    return seen


def test_fit_cuts_at_an_answer_end_and_counts():
    from megajax.data.sft_dataset import fit_conversations
    convs = byte_conversations(60, turns=(1, 4), words=(1, 10))
    limit = 200
    kept, counts = fit_conversations(convs, limit, "assistant")
    assert counts.conversations == 60 and counts.kept + counts.cut + counts.dropped_long == 60
    assert counts.cut > 0 and counts.dropped_long > 0 and counts.kept > 0  # the sizes exercise all three
    it = iter(kept)
    for conv in convs:
        n = len(conv.ids)
        if n <= limit:
            ids, mask = next(it)
            assert ids.tolist() == conv.ids.tolist()
            np.testing.assert_array_equal(mask[:-1], conv.answer[1:])
        elif any(e <= limit for e in conv.answer_ends):
            ids, mask = next(it)
            cut = len(ids)
            assert cut <= limit and cut in conv.answer_ends
            assert conv.answer[cut - 1] and not conv.answer[cut]  # after a whole answer, before the next turn
            assert ids.tolist() == conv.ids[:cut].tolist()
    assert next(it, None) is None
    assert counts.cut_tokens == sum(len(c.ids) - max(e for e in c.answer_ends if e <= limit)
                                    for c in convs if len(c.ids) > limit and min(c.answer_ends) <= limit)
    # loss_on=all trains every prediction inside a conversation, none across its end
    everything, _ = fit_conversations(convs, limit, "all")
    assert all(m[:-1].all() and m[-1] == 0 for _, m in everything)
    # no answer at all: nothing to train, dropped and counted
    tok = load_tokenizer("byte")
    silent = encode_conversation(tok, LLAMA3, [{"role": "user", "content": "hello"}])
    kept, counts = fit_conversations([silent] + convs[:3], 10_000, "assistant")
    assert counts.dropped_no_answer == 1 and len(kept) == 3
    assert len(fit_conversations([silent], 10_000, "all")[0]) == 1


@pytest.mark.parametrize("packing", [True, False])
def test_rows_segments_positions_masks_and_epochs(packing):
    from megajax.data.sft_dataset import ChatDataset, fit_conversations
    convs = byte_conversations(60, turns=(1, 3), words=(1, 8))  # 100 to 400 tokens each
    seq_len = 1023
    kept, _ = fit_conversations(convs, seq_len + 1, "assistant")
    ds = ChatDataset(convs, seq_len=seq_len, seed=3, packing=packing, pad_id=7)
    first = check_rows(ds, kept)
    assert sorted(first) == list(range(len(kept)))  # one epoch: every conversation exactly once
    real = sum(len(ids) for ids, _ in kept)
    assert ds.efficiency == pytest.approx(real / (len(ds) * (seq_len + 1)))
    if packing:
        assert ds.efficiency > 0.9 and len(ds) < len(kept) / 2
    else:
        assert len(ds) == len(kept)
    assert "packing efficiency" in ds.report() and "cut at a turn boundary" in ds.report()
    # more samples than an epoch: whole epochs, each a fresh permutation, each holding every conversation
    more = ChatDataset(convs, seq_len=seq_len, seed=3, packing=packing, pad_id=7, num_samples=2 * len(ds) + 1)
    assert more.epochs == 3 and len(more) >= 2 * len(ds) + 1
    seen = check_rows(more, kept)
    assert sorted(seen) == sorted(list(range(len(kept))) * 3)
    for i in range(len(ds)):  # the first epoch is the one-epoch dataset's
        for k, v in ds[i].items():
            np.testing.assert_array_equal(more[i][k], v)
    other = ChatDataset(convs, seq_len=seq_len, seed=4, packing=packing, pad_id=7)
    assert any(not np.array_equal(other[i]["tokens"], ds[i]["tokens"]) for i in range(min(len(ds), len(other))))


def test_loader_labels_are_the_answers_and_resume_is_bitwise():
    """Through the loader: loss_mask[t] trains labels[t] exactly where labels[t] is an answer token of the
    conversation input t belongs to; a fresh loader at a later start gives the same bits."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from megajax.data.loader import Loader
    from megajax.data.sft_dataset import ChatDataset
    from megajax.plan import BatchLayout
    convs = byte_conversations(80, seed=5, turns=(1, 2), words=(1, 6))
    keys = ("tokens", "labels", "loss_mask", "positions", "segment_ids")

    def loader(prefetch):
        ds = ChatDataset(convs, seq_len=127, seed=1, num_samples=64)  # rebuilt: a new process
        mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        sh = NamedSharding(mesh, P(None, "data", None))
        layout = BatchLayout(global_batch=8, micro_batch=1, data_parallel=4, accumulation=2, seq_len=127)
        return ds, Loader(ds, layout=layout, shardings={k: sh for k in keys}, eod_mask_loss=True, prefetch=prefetch)

    ds, first = loader(2)
    for start in (0, 8, 16, 24):
        a = first.batch(start)
    first.close()
    _, resumed = loader(0)
    b = resumed.batch(24)
    for k in keys:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    # the answer tokens of every conversation in the batch, by token value and place
    tokens, labels, mask = (np.asarray(a[k]).reshape(8, 127) for k in ("tokens", "labels", "loss_mask"))
    seg = np.asarray(a["segment_ids"]).reshape(8, 127)
    for r in range(8):
        row = ds[24 + r]
        answer = np.zeros(128, bool)  # which row tokens are answers (from the conversations themselves)
        for k in np.unique(row["segment_ids"]):
            where = np.flatnonzero(row["segment_ids"] == k)
            doc = row["tokens"][where].astype(np.int32).tobytes()  # a conversation, or the start of a cut one
            conv = next((c for c in convs if c.ids[:len(where)].tobytes() == doc), None)
            if conv is not None:
                answer[where] = conv.answer[:len(where)]
        same = np.append(row["segment_ids"][1:] == row["segment_ids"][:-1], False)[:-1]
        np.testing.assert_array_equal(mask[r] > 0, answer[1:] & same)
        np.testing.assert_array_equal(labels[r], row["tokens"][1:])
        np.testing.assert_array_equal(tokens[r], row["tokens"][:-1])
        np.testing.assert_array_equal(seg[r], row["segment_ids"][:-1])
        assert mask[r].sum() > 0


# ----------------------------------------------------------------------------
# Hosts, bad input, a run
# ----------------------------------------------------------------------------

def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def chat_dataset(path: str):
    """The train split of a jsonl file as data.format=chat builds it (byte tokenizer, LLAMA3 template)."""
    from megajax.data.chat import chat_files, tokenize_files
    from megajax.data.sft_dataset import ChatDataset
    convs = tokenize_files(load_tokenizer("byte"), LLAMA3, chat_files(path))
    return ChatDataset(convs, seq_len=255, seed=1, num_samples=32, pad_id=256)


def test_two_processes_read_disjoint_rows_and_form_the_one_process_batch(tmp_path):
    """2 processes x 4 CPU devices: each builds the packed rows itself, reads only its own rows, and
    together they hold the batch one process builds."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from conftest import xla_flags
    from megajax.data.loader import Loader
    from megajax.plan import BatchLayout
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in
                                                conversations(random.Random(7), 60, turns=(1, 1), words=(1, 4))])
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    procs = [subprocess.Popen([sys.executable, str(root / "tests" / "multiprocess_loader_worker.py"), str(i),
                               str(port), data, str(tmp_path / f"p{i}.json"), "chat"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    reads = [set(r["reads"]) for r in results]
    assert not reads[0] & reads[1] and reads[0] | reads[1] == set(range(16, 24))
    assert all(r["num_reads"] == len(r["reads"]) for r in results)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sh = NamedSharding(mesh, P(None, "data", None))
    ds = chat_dataset(data)
    layout = BatchLayout(global_batch=8, micro_batch=2, data_parallel=4, accumulation=1, seq_len=ds.seq_len)
    keys = ("tokens", "labels", "loss_mask", "positions", "segment_ids")
    want = Loader(ds, layout=layout, shardings={k: sh for k in keys}, prefetch=0, eod_mask_loss=True).batch(16)
    for key in keys:
        got = np.full(want[key].shape, -1.0)
        for r in results:
            for (a, b), part in r["shards"][key]:
                part = np.asarray(part)
                got[a:a + part.shape[0], b:b + part.shape[1]] = part
        np.testing.assert_array_equal(got, np.asarray(want[key]))


def chat_config(small_config, tok_dir, data, *overrides):
    return small_config("data.format=chat", f"data.tokenizer={tok_dir}", f"data.path={data}",
                        "model.vocab_size=384", *overrides)


def test_bad_input_is_named(small_config, tmp_path):
    from megajax.config import load_config
    from megajax.data.loader import build_run_datasets
    from megajax.errors import ConfigError
    for key, value, accepted in [("data.format", "sharegpt", "gpt"), ("data.loss_on", "prompt", "assistant")]:
        with pytest.raises(ConfigError, match=f"{key}.*{value}.*{accepted}"):
            load_config(overrides=[f"{key}={value}"])
    tok_dir = make_tokenizer_dir(tmp_path / "tok", "llama3", LLAMA3)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    cases = [
        ('{"messages": [}\n', r"bad\.jsonl:2: not valid JSON"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n", r"bad\.jsonl:2: .*role 'wizard'"),
        (json.dumps({"text": "plain"}) + "\n", r"bad\.jsonl:2: .*neither"),
    ]
    for line, match in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(good) + "\n" + line)
        with pytest.raises(DataError, match=match):
            build_run_datasets(chat_config(small_config, tok_dir, bad), load_tokenizer(str(tok_dir)))
    data = write_jsonl(tmp_path / "ok.jsonl", [good] * 20)
    plain = make_tokenizer_dir(tmp_path / "plain", "llama3", None)
    with pytest.raises(DataError, match="has no chat template"):
        build_run_datasets(chat_config(small_config, plain, data), load_tokenizer(str(plain)))
    with pytest.raises(DataError, match="no such file or directory"):
        build_run_datasets(chat_config(small_config, tok_dir, tmp_path / "nothing.jsonl"),
                           load_tokenizer(str(tok_dir)))
    with pytest.raises(DataError, match="model.vocab_size = 100"):
        build_run_datasets(chat_config(small_config, tok_dir, data, "model.vocab_size=100"),
                           load_tokenizer(str(tok_dir)))


def test_megajax_train_on_chat_data(tmp_path):
    """`megajax train` with data.format=chat: runs, evaluates on held-out conversations, and logs the
    counts and the packing efficiency."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from conftest import xla_flags
    root = Path(__file__).resolve().parent.parent
    tok_dir = make_tokenizer_dir(tmp_path / "tok", "qwen3", QWEN3)
    rng = random.Random(11)
    long = {"messages": [{"role": "user", "content": "cat " * 60}, {"role": "assistant", "content": "dog " * 200}]}
    records = [long] + [{"messages": m} for m in conversations(rng, 150, turns=(1, 2), words=(1, 8))]
    records += [{"prompt": " ".join(rng.choice(WORDS) for _ in range(4)), "completion": "five"} for _ in range(50)]
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", records[:100])
    write_jsonl(tmp_path / "data" / "b.jsonl", records[100:])
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "megajax.cli", "train", "--config", "model/tiny", "model.num_layers=2",
         "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=384", "train.seq_len=128",
         "train.global_batch=4", "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_steps=1",
         "train.sample_tokens=0", "logging.tensorboard=false", "data.format=chat", f"data.path={tmp_path / 'data'}",
         f"data.tokenizer={tok_dir}", "data.split=90,10,0", f"train.run_dir={run}"],
        capture_output=True, text=True, cwd=root, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(root), XLA_FLAGS=xla_flags(1)))
    assert p.returncode == 0, p.stderr
    assert "chat data" in p.stdout and "packing efficiency" in p.stdout, p.stdout
    line = next(l for l in p.stdout.splitlines() if "chat data" in l and "train:" in l)
    assert "1 dropped (no answer ends within seq_len + 1 = 129 tokens)" in line
    assert float(line.split("packing efficiency ")[1].split("%")[0]) > 80
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [2, 4]
    assert any("val_loss" in m and np.isfinite(m["val_loss"]) for m in metrics)
