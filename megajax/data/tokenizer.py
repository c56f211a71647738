"""Tokenizers: the built-in byte-level tokenizer (no files, no downloads) and Hugging Face `tokenizer.json`.

Every tokenizer exposes `vocab_size`, `eod_id` (end-of-document id, or None),
`encode(text) -> list[int]`, `decode(ids) -> str`, and
`encode_packed(texts) -> (ids [T] int32, lengths [N] int64)` for bulk
preprocessing (all texts' ids concatenated, and each text's length).

`save_hf_tokenizer` writes either as a Hugging Face tokenizer directory
(`AutoTokenizer.from_pretrained` loads it with the same ids); checkpoint
exports put one beside the weights.
"""

from __future__ import annotations

import json
import shutil
from itertools import chain
from pathlib import Path

import numpy as np

from megajax.data.user_files import kind_of
from megajax.errors import ConfigError

# End-of-document candidates, most common first, when the tokenizer's config names no eos token.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|eod|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus an end-of-document id 256."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_packed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        data = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, data), np.int64, len(data))
        return np.frombuffer(b"".join(data), np.uint8).astype(np.int32), lengths

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file.

    Text is encoded without the tokenizer's post-processor specials (no BOS/EOS
    per call); documents are separated by `eod_id`, taken from the eos token of
    a `tokenizer_config.json` beside the file, else the first of EOD_CANDIDATES
    in the vocabulary, else None.
    """

    def __init__(self, file: Path, key: str = "data.tokenizer"):
        from tokenizers import Tokenizer
        self.name = str(file)
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception for unreadable files
            raise ConfigError(f"{key} = {str(file)!r}: not a readable Hugging Face tokenizer.json "
                              f"({e}).") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        try:
            config = json.loads((file.parent / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        config = config if isinstance(config, dict) else {}
        self.eod_id = self._first_id([config.get("eos_token"), *EOD_CANDIDATES])
        self.bos_id = self._first_id([config.get("bos_token")])  # only as the config names it

    def _first_id(self, names: list) -> int | None:
        """The id of the first of `names` (strings, or {"content": ...} entries) in the vocabulary."""
        for name in names:
            name = name.get("content") if isinstance(name, dict) else name
            token_id = self._tok.token_to_id(name) if isinstance(name, str) else None
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_packed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(chain.from_iterable(ids), np.int32, int(lengths.sum())), lengths

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str, key: str = "data.tokenizer"):
    """`byte` for the built-in tokenizer, or a Hugging Face tokenizer.json file / a directory holding one.

    `key` names the setting in error messages (a config key or a command-line flag).
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path, key)
    there = kind_of(path)
    if there:
        raise ConfigError(f"{key} = {spec!r}: {str(path)!r} is {there}, not a tokenizer.json file; accepted values "
                          f"are 'byte' (the built-in byte-level tokenizer), a Hugging Face tokenizer.json file, or a "
                          f"directory containing one.")
    raise ConfigError(f"{key} = {spec!r}: no such tokenizer (looked for {str(path)!r}); accepted values "
                      f"are 'byte' (the built-in byte-level tokenizer), a Hugging Face tokenizer.json "
                      f"file, or a directory containing one.")


# ----------------------------------------------------------------------------
# As a Hugging Face tokenizer directory
# ----------------------------------------------------------------------------

EOD_TOKEN = "<|endoftext|>"  # the byte tokenizer's end-of-document token in its Hugging Face form


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: each byte as one printable character (printable bytes as themselves,
    the others shifted above U+0100), so that any byte string is a string of vocabulary symbols."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + k) for k, b in enumerate(others)}}


def byte_tokenizer_json() -> str:
    """A `tokenizers` tokenizer with ByteTokenizer's ids: 0..255 the UTF-8 bytes, 256 end-of-document."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    chars = _byte_to_char()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOD_TOKEN) == 256
    return tok.to_str()


def is_byte_tokenizer_file(path: Path) -> bool:
    """Whether a tokenizer.json is byte_tokenizer_json() (an exported byte tokenizer, read back as 'byte')."""
    try:
        return json.loads(Path(path).read_text()) == json.loads(byte_tokenizer_json())
    except (OSError, ValueError):
        return False


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# What transformers reads beside a tokenizer.json, besides the special tokens: tokenizer_config.json (its
# `chat_template` key a string or a list of named templates), and transformers 5's chat templates as files:
# the default one in chat_template.jinja, named others in additional_chat_templates/<name>.jinja.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", CHAT_TEMPLATE_FILE)


def save_hf_tokenizer(tok, out: Path, *, max_length: int,
                      chat_template: str | None = None) -> tuple[int | None, int | None]:
    """Writes `tok` (a loaded tokenizer) into directory `out` as a Hugging Face tokenizer that
    `AutoTokenizer.from_pretrained(out)` loads with the same ids and the same chat template; returns
    its (bos, eos) ids. Every export writes its tokenizer with this function (the Hugging Face
    directory, a Megatron checkpoint's tokenizer/ folder, a PEFT adapter directory).

    A Hugging Face tokenizer.json is copied with the files of its folder that transformers reads
    beside it, unchanged: tokenizer_config.json (with its `chat_template`, a string or the list of
    named templates), special_tokens_map.json, chat_template.jinja and
    additional_chat_templates/*.jinja; without a tokenizer_config.json, one naming its eos token is
    written. The byte tokenizer becomes byte_tokenizer_json() with `<|endoftext|>` as bos and eos.

    `chat_template`: a template for a tokenizer that carries none of its own (the byte tokenizer,
    or a folder without one), written as chat_template.jinja; a tokenizer's own template wins.
    """
    from megajax.data.chat_template import folder_chat_template
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        specials = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN}
        _write_json(out / "tokenizer_config.json", dict(
            specials, tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_length,
            clean_up_tokenization_spaces=False, add_prefix_space=False))
        _write_json(out / "special_tokens_map.json", specials)
        bos_eos = tok.eod_id, tok.eod_id
    else:
        src = Path(tok.name).parent
        shutil.copyfile(tok.name, out / "tokenizer.json")
        for extra in TOKENIZER_SIDE_FILES:
            if (src / extra).is_file():
                shutil.copyfile(src / extra, out / extra)
        if (src / CHAT_TEMPLATE_DIR).is_dir():
            for named in sorted((src / CHAT_TEMPLATE_DIR).glob("*.jinja")):
                (out / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
                shutil.copyfile(named, out / CHAT_TEMPLATE_DIR / named.name)
        if not (src / "tokenizer_config.json").is_file():
            eos = {} if tok.eod_id is None else {"eos_token": tok._tok.id_to_token(tok.eod_id)}
            _write_json(out / "tokenizer_config.json", dict(eos, tokenizer_class="PreTrainedTokenizerFast",
                                                            model_max_length=max_length,
                                                            clean_up_tokenization_spaces=False))
        bos_eos = tok.bos_id, tok.eod_id
    if chat_template and folder_chat_template(out) is None:
        (out / CHAT_TEMPLATE_FILE).write_text(chat_template)
    return bos_eos
