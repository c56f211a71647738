"""`megajax preprocess`: jsonl/text -> Megatron datasets, byte and Hugging Face tokenizers, flat memory."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megajax.cli import main
from megajax.data.indexed import IndexedDataset
from megajax.data.preprocess import preprocess
from megajax.data.tokenizer import ByteTokenizer, load_tokenizer
from megajax.errors import ConfigError, DataError

TEXTS = ["Hello world.", "", "Ünïcödé ✓ and more text here", "line one\nline two", "x" * 300]


def _jsonl(path, texts=TEXTS):
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "title": f"doc {i}"}) + "\n")
        f.write("\n")  # a trailing blank line is ignored
    return path


def _documents(prefix):
    ds = IndexedDataset(prefix).verify()
    return [np.concatenate([ds[s] for s in ds.document_sequences(d)] or [np.zeros(0, ds.dtype)])
            for d in range(ds.num_documents)]


def test_byte_tokenizer_jsonl_two_keys(tmp_path):
    s = preprocess([_jsonl(tmp_path / "in.jsonl")], ["text", "title"], "byte", str(tmp_path / "out"),
                   append_eod=True, progress=False)
    assert s.prefixes == {"text": f"{tmp_path}/out_text_document", "title": f"{tmp_path}/out_title_document"}
    assert s.documents == len(TEXTS) and s.dtype == "uint16"
    tok = ByteTokenizer()
    docs = _documents(s.prefixes["text"])
    assert len(docs) == len(TEXTS)
    for doc, text in zip(docs, TEXTS):
        expected = tok.encode(text) + [tok.eod_id] if text else []   # an empty document gets no eod
        assert doc.tolist() == expected
    assert [tok.decode(d) for d in _documents(s.prefixes["title"])] == [f"doc {i}" for i in range(len(TEXTS))]
    assert s.tokens["text"] == sum(len(d) for d in docs)


def test_plain_text_lines_and_files(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\nthird doc\r\n")
    (tmp_path / "b.txt").write_text("fourth")
    s = preprocess([tmp_path / "a.txt", tmp_path / "b.txt"], ["text"], "byte", str(tmp_path / "l"),
                   progress=False)
    tok = ByteTokenizer()
    assert [tok.decode(d) for d in _documents(s.prefixes["text"])] == ["first doc", "", "third doc", "fourth"]
    s = preprocess([tmp_path / "a.txt", tmp_path / "b.txt"], ["text"], "byte", str(tmp_path / "f"),
                   input_format="files", progress=False)
    assert [tok.decode(d) for d in _documents(s.prefixes["text"])] == ["first doc\n\nthird doc\r\n", "fourth"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A tiny byte-level BPE tokenizer trained here (no downloads), saved as dir/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choice(["the", "cat", "sat", "on", "mat", "a", "dog"])
                                      for _ in range(50)) for _ in range(200)] + TEXTS, trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    return d


def test_hf_tokenizer_and_workers(tmp_path, bpe_dir):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    ours = load_tokenizer(str(bpe_dir))
    assert ours.eod_id == ref.token_to_id("<|endoftext|>") and ours.vocab_size == ref.get_vocab_size()
    texts = [f"the cat {i} sat on the mat " * (i % 5) for i in range(300)] + TEXTS
    src = _jsonl(tmp_path / "in.jsonl", texts)
    one = preprocess([src], ["text", "title"], str(bpe_dir), str(tmp_path / "one"), append_eod=True,
                     progress=False)
    docs = _documents(one.prefixes["text"])
    for doc, text in zip(docs, texts):
        ids = ref.encode(text, add_special_tokens=False).ids
        assert doc.tolist() == (ids + [ours.eod_id] if ids else [])
        assert ours.decode(doc[:-1]) == text or not ids
    two = preprocess([src], ["text", "title"], str(bpe_dir / "tokenizer.json"), str(tmp_path / "two"),
                     append_eod=True, workers=2, progress=False)
    for key in ("text", "title"):
        for ext in ("bin", "idx"):
            a, b = (open(f"{s.prefixes[key]}.{ext}", "rb").read() for s in (one, two))
            assert a == b


def test_large_vocabulary_uses_int32_and_config_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "w69999"}}))
    src = _jsonl(tmp_path / "in.jsonl", ["w1 w65600", "w7"])
    s = preprocess([src], ["text"], str(tmp_path), str(tmp_path / "o"), append_eod=True, progress=False)
    assert s.dtype == "int32"
    assert [d.tolist() for d in _documents(s.prefixes["text"])] == [[1, 65600, 69999], [7, 69999]]


def test_errors(tmp_path, bpe_dir):
    src = _jsonl(tmp_path / "in.jsonl")
    with pytest.raises(DataError, match="no such file"):
        preprocess([tmp_path / "missing.jsonl"], ["text"], "byte", str(tmp_path / "o"), progress=False)
    with pytest.raises(DataError, match=r"in.jsonl, line 1: no key 'body'"):
        preprocess([src], ["body"], "byte", str(tmp_path / "o"), progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: not valid JSON"):
        preprocess([tmp_path / "bad.jsonl"], ["text"], "byte", str(tmp_path / "o"), progress=False)
    with pytest.raises(ConfigError, match="no such tokenizer"):
        preprocess([src], ["text"], str(tmp_path / "nope"), str(tmp_path / "o"), progress=False)
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "noeos.json"))
    with pytest.raises(ConfigError, match="--append-eod: .* has no end-of-document token"):
        preprocess([src], ["text"], str(tmp_path / "noeos.json"), str(tmp_path / "o"), append_eod=True,
                   progress=False)
    assert not list(tmp_path.glob("o*"))  # nothing half-written


def test_cli(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl")
    assert main(["preprocess", "--input", str(src), "--tokenizer", "byte", "--output-prefix",
                 str(tmp_path / "c"), "--append-eod"]) == 0
    assert "wrote" in capsys.readouterr().err
    assert IndexedDataset(tmp_path / "c_text_document").num_documents == len(TEXTS)
    assert main(["preprocess", "--merge", str(tmp_path / "c_text_document"), str(tmp_path / "c_text_document"),
                 "--output-prefix", str(tmp_path / "m")]) == 0
    assert IndexedDataset(tmp_path / "m").num_documents == 2 * len(TEXTS)
    assert main(["preprocess", "--input", str(src), "--json-keys", "body", "--tokenizer", "byte",
                 "--output-prefix", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "megajax preprocess: error:" in err and "no key 'body'" in err and "Traceback" not in err


MEMORY_PROBE = textwrap.dedent("""
    import json, multiprocessing, resource, sys, tqdm
    from megajax.data.preprocess import preprocess
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    preprocess([sys.argv[1]], ["text"], "byte", sys.argv[2], append_eod=True, progress=False)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
""")


def _write_jsonl(path, megabytes):
    rng = random.Random(0)
    block = " ".join("".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(2, 9)))
                     for _ in range(40000))
    size, target = 0, int(megabytes * 1e6)
    with open(path, "w") as f:
        while size < target:
            a, n = rng.randrange(len(block) - 4000), rng.randint(100, 4000)
            line = json.dumps({"text": block[a:a + n]}) + "\n"
            f.write(line)
            size += len(line)
    return size


def test_memory_stays_flat(tmp_path):
    """Peak RSS growth does not scale with the input: 50 MB costs about what 5 MB costs."""
    growth = {}
    for mb in (5, 50):
        size = _write_jsonl(tmp_path / f"in{mb}.jsonl", mb)
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / f"in{mb}.jsonl"),
                              str(tmp_path / f"o{mb}")], capture_output=True, text=True, check=True)
        growth[mb] = int(out.stdout.split()[-1])
        assert IndexedDataset(tmp_path / f"o{mb}_text_document").num_tokens > 0.9 * size
    assert growth[50] < 0.5 * 50e6, growth
    assert growth[50] - growth[5] < 8 * 2**20, growth


ROOT = Path(__file__).resolve().parent.parent


def _megajax(*args, cwd):
    """`python -m megajax.cli ...` as a user runs it, from `cwd`."""
    return subprocess.run([sys.executable, "-m", "megajax.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


@pytest.mark.parametrize("name, content, words", [
    ("empty.jsonl", b"", ["no documents found", "read as JSON lines", "empty or holds only blank lines"]),
    ("blank.jsonl", b"\n\n  \n", ["no documents found"]),
    ("empty.txt", b"", ["no documents found", "read as lines"]),
    ("blank_lines.txt", b"\n\n", ["all 2 documents are empty", "0 tokens"]),
])
def test_empty_input_is_an_error_at_preprocess_time(tmp_path, name, content, words):
    (tmp_path / name).write_bytes(content)
    p = _megajax("preprocess", "--input", name, "--json-keys", "text", "--tokenizer", "byte",
                 "--output-prefix", "data/out", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"megajax preprocess: error: --input {name}: ") and "Traceback" not in p.stderr
    for w in words:
        assert w in p.stderr, p.stderr
    assert not list(tmp_path.glob("data/out*"))  # nothing written


LATIN1 = "ok line\nsecond line\ncaf\u00e9 au lait\n".encode("latin-1")


@pytest.mark.parametrize("fmt", ["lines", "files"])
def test_bytes_that_are_not_utf8_stop_with_file_and_line(tmp_path, fmt):
    (tmp_path / "latin1.txt").write_bytes(LATIN1)
    p = _megajax("preprocess", "--input", "latin1.txt", "--input-format", fmt, "--json-keys", "text",
                 "--tokenizer", "byte", "--output-prefix", "out", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert ("megajax preprocess: error: latin1.txt, line 3: byte 0xe9 at column 4 is not UTF-8" in p.stderr
            and "--errors replace" in p.stderr), p.stderr
    assert not list(tmp_path.glob("out*"))


def test_bytes_that_are_not_utf8_in_jsonl_and_in_a_later_chunk(tmp_path, monkeypatch):
    import megajax.data.preprocess as pp
    monkeypatch.setattr(pp, "CHUNK_DOCS", 2)  # the bad line is in the second chunk
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"in.jsonl, line 4: byte 0xff at column 11 is not UTF-8"):
        preprocess([tmp_path / "in.jsonl"], ["text"], "byte", str(tmp_path / "o"), progress=False)


def test_errors_replace_substitutes_u_fffd(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(LATIN1)
    p = _megajax("preprocess", "--input", "latin1.txt", "--input-format", "lines", "--json-keys", "text",
                 "--tokenizer", "byte", "--output-prefix", "out", "--errors", "replace", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    tok = ByteTokenizer()
    assert [tok.decode(d) for d in _documents(tmp_path / "out_text_document")] == [
        "ok line", "second line", "caf\ufffd au lait"]
