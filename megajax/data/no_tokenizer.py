"""The data.tokenizer value of a model trained without any tokenizer: Megatron's NullTokenizer runs read
pre-tokenised data, and their checkpoints name no tokenizer because there is none.

    no_tokenizer(known, eod) -> "none (<what the source says>; end of document <eod>)"

An import records it (checkpoint/common.py); an export then carries no tokenizer (`--tokenizer` adds
one); a run that would read text with it stops with no_tokenizer_error.
"""

from __future__ import annotations

import re

from megajax.errors import ConfigError

_PREFIX = "none ("


def no_tokenizer(known: str, eod: int | None) -> str:
    """The value for a model trained without a tokenizer: `known` what its source says, `eod` its
    end-of-document id (if known)."""
    return f"{_PREFIX}{known}{'' if eod is None else f'; end of document {eod}'})"


def is_no_tokenizer(spec) -> bool:
    """Whether a data.tokenizer value is no_tokenizer's."""
    return isinstance(spec, str) and spec.startswith(_PREFIX) and spec.endswith(")")


def no_tokenizer_eod(spec: str) -> int | None:
    """The end-of-document id no_tokenizer recorded in `spec`, or None."""
    found = re.search(r"; end of document (\d+)\)$", spec)
    return int(found.group(1)) if found else None


def no_tokenizer_error(spec: str, key: str = "data.tokenizer") -> ConfigError:
    return ConfigError(f"{key} = {spec!r}: the model was trained without a tokenizer (pre-tokenised data), so "
                       f"there is none to read or write text with; set {key} to 'byte' or a Hugging Face "
                       f"tokenizer.json (file or directory) that fits its vocabulary.")
