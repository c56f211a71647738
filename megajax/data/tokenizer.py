"""Tokenizers: the built-in byte-level tokenizer (no files, no downloads)."""

from __future__ import annotations

from megajax.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus an end-of-document id 256."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def load_tokenizer(spec: str):
    """`byte` for the built-in tokenizer."""
    if spec == "byte":
        return ByteTokenizer()
    raise ConfigError(f"data.tokenizer = {spec!r}: accepted values are 'byte' (the built-in byte-level "
                      f"tokenizer).")
