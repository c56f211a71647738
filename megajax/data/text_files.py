"""The user's text files (chat and caption jsonl, prompts files, chat templates) read as UTF-8 text.

    text_lines(path, name) -> (line number, line) of a UTF-8 file, a leading byte-order mark dropped
    json_line(line, where, hint) -> the line's JSON value, without lone surrogate escapes
    parse_json(text) -> json.loads, a value nested too deeply for the parser a ValueError as any bad JSON
    argument_text(text, what) -> a command-line text, refused when it holds bytes that are not UTF-8
    read_text(path, name) -> the whole file as text (the same rules)

Bytes that are not UTF-8 stop the reading with one DataError naming the file, the line, the byte and
its column. A UTF-8 byte-order mark (EF BB BF, as Windows editors write) at the start of a file is not
text and is dropped. JSON may escape any character, and `"\\ud800"` is valid JSON for half of a UTF-16
surrogate pair that is not a character and has no UTF-8 form (a tokenizer cannot encode it): a string
holding one is refused naming the file and line.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from pathlib import Path
from typing import Iterator

from megajax.errors import DataError

_SURROGATE = re.compile("[\ud800-\udfff]")


def undecodable(raw: bytes, where: str, error: UnicodeDecodeError, fix: str = "") -> DataError:
    """The DataError for bytes of `raw` (one line) that are not UTF-8."""
    fix = fix or " (convert it, e.g. iconv -f latin1 -t utf-8)"
    return DataError(f"{where}: byte 0x{raw[error.start]:02x} at column {error.start + 1} is not UTF-8 "
                     f"({error.reason}); the file must be UTF-8 text{fix}.")


MAX_LINE_BYTES = 64 * 2**20  # one line (a conversation, a caption record, a prompt): far beyond any context


def text_lines(path: str | Path, name: str | None = None) -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of the regular file `path` (named `name` in messages:
    FILE:LINE); a FIFO, a device or a directory is refused unread, and so is a line of more than
    MAX_LINE_BYTES bytes (user_files.open_regular)."""
    import os
    from megajax.data.user_files import open_regular
    name = str(path) if name is None else name
    with os.fdopen(open_regular(path, name), "rb") as f:
        for n in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{name}:{n}: a line of more than {MAX_LINE_BYTES:,} bytes; one record per line "
                                f"is accepted up to that size.")
            if n == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise undecodable(raw, f"{name}:{n}", e) from None
            yield n, line.rstrip("\r\n")


def read_text(path: str | Path, name: str | None = None) -> str:
    """The whole file as text (text_lines' rules; line ends kept as \\n)."""
    return "".join(line + "\n" for _, line in text_lines(path, name))


def parse_json(text: str | bytes):
    """json.loads(text), with a value nested too deeply for Python's parser (`[[[[...` a hundred thousand
    levels) a ValueError, as any other text that is not JSON, instead of a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("arrays or objects nested too deeply for the JSON parser") from None


def argument_text(text: str, what: str) -> str:
    """A text given on the command line (`what` names it: "--prompt 0"), checked for bytes that are not UTF-8:
    Python reads such a byte of the argument as a lone surrogate (U+DC80..U+DCFF), which no tokenizer can
    encode."""
    found = _SURROGATE.search(text)
    if found:
        byte = ord(found.group()) - 0xDC00
        shown = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else f"U+{ord(found.group()):04X}"
        raise DataError(f"{what}: {shown} at character {found.start() + 1} is not UTF-8 text; give the text in "
                        f"UTF-8 (the terminal's or script's encoding, e.g. iconv -f latin1 -t utf-8).")
    return text


def lone_surrogate(value) -> str | None:
    """The first lone surrogate in the strings of a JSON value (keys included), as its escape, or None
    (walked without recursion: a value may be nested as deeply as the parser allows)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return f"\\u{ord(found.group()):04x}"
        elif isinstance(item, dict):
            stack.extend(x for kv in reversed(item.items()) for x in reversed(kv))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return None


def without_surrogates(value):
    """The JSON value with each lone surrogate replaced by U+FFFD (a pair was joined by the JSON parser)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
    return value


def json_line(line: str, where: str, hint: str = "") -> object:
    """The JSON value of one line; a DataError naming `where` ("FILE:LINE") when it is not valid JSON
    (then `hint`) or holds a lone surrogate escape."""
    try:
        value = parse_json(line)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e}){hint}.") from None
    if "\\u" in line or "\\U" in line:
        found = lone_surrogate(value)
        if found:
            raise DataError(f"{where}: the JSON escape {found} is half of a UTF-16 surrogate pair without its "
                            f"other half: not a character, and not encodable as UTF-8; give the whole pair "
                            f"(e.g. \\ud83d\\ude00) or the character itself.")
    return value
