"""Conversations for supervised fine-tuning: jsonl files -> token ids and the mask of trained tokens.

A conversation is `{"messages": [{"role", "content"}, ...]}` or a `{"prompt", "completion"}` pair
(one user turn, one assistant answer). It is rendered with the tokenizer's chat template in the
sandbox the server renders prompts in (megajax.data.chat_template), the text is encoded with the
run's tokenizer, and each token is marked True when it belongs to an assistant's answer:

  - a template with `{% generation %}` blocks marks the answers itself; a token is an answer token
    when its characters overlap a block's output (transformers' `return_assistant_tokens_mask`
    rule, so the mask equals `apply_chat_template(..., return_assistant_tokens_mask=True)`'s);
  - a template without them is rendered turn by turn: assistant message i's answer is the text
    between the conversation up to message i with the generation prompt, and the conversation up to
    and with message i (both must be prefixes of the whole rendering, else a clear error asking
    for generation tags).

`tokenize_conversation(tokenizer, template, messages, loss_on)` returns (ids [T] int32, mask [T]
bool); `loss_on="all"` marks every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megajax.data.chat_template import (ChatTemplateError, TemplateLimit, chat_template_source, check_chat_template,
                                        find_chat_template, has_generation_tags, naming, render_chat,
                                        render_with_answers, special_token)
from megajax.data.text_files import json_line, text_lines
from megajax.data.user_files import kind_of
from megajax.errors import ConfigError, DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
LOSS_ON = ("assistant", "all")


@dataclass(frozen=True)
class Conversation:
    """One tokenized conversation: ids [T] int32, answer [T] bool (tokens of assistant answers), and
    answer_ends: the token index just past each answer, in order (the turn boundaries it may be cut at);
    answered: its messages hold a non-empty assistant message (whether the template wrote it or not)."""
    ids: np.ndarray
    answer: np.ndarray
    answer_ends: tuple[int, ...]
    answered: bool = False


def check_loss_on(loss_on: str, key: str = "data.loss_on") -> None:
    if loss_on not in LOSS_ON:
        raise ConfigError(f"{key} = {loss_on!r}: accepted values are {', '.join(map(repr, LOSS_ON))} (train "
                          f"on the assistants' answers only, or on every token).")


def check_messages(messages, where: str = "the conversation") -> list[dict]:
    """The messages as a list of {"role", "content", ...} dicts with known roles and text content."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects, "
                        f"got {json.dumps(messages)[:80]}.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: message {i} is {json.dumps(m)[:80]}; each message is an object with "
                            f"\"role\" and \"content\".")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {m['role']!r}; accepted roles are "
                            f"{', '.join(map(repr, ROLES))}.")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} ({m['role']}) has content {json.dumps(m.get('content'))[:80]}; "
                            f"content must be a string.")
    return messages


def _encode_with_offsets(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T] int32, offsets [T, 2]: the [begin, end) characters of text each token covers)."""
    raw = getattr(tokenizer, "_tok", None)
    if raw is not None:  # a Hugging Face tokenizer.json: its own offsets, as transformers reads them
        enc = raw.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)
    data = [c.encode("utf-8") for c in text]  # the byte tokenizer: each byte covers its character
    lengths = np.fromiter(map(len, data), np.int64, len(data))
    ids = np.frombuffer(b"".join(data), np.uint8).astype(np.int32)
    char = np.repeat(np.arange(len(text), dtype=np.int64), lengths)
    return ids, np.stack([char, char + 1], axis=1)


def _spans_to_tokens(offsets: np.ndarray, spans: list[tuple[int, int]]) -> tuple[np.ndarray, tuple[int, ...]]:
    """answer [T] bool (a token overlapping a span) and the token index just past each non-empty span."""
    answer = np.zeros(len(offsets), bool)
    ends = []
    for begin, end in spans:
        hit = (offsets[:, 0] < end) & (offsets[:, 1] > begin)
        answer |= hit
        if hit.any():
            ends.append(int(np.flatnonzero(hit)[-1]) + 1)
    return answer, tuple(sorted(set(ends)))


def _turn_spans(template: str, messages: list[dict], text: str, specials: dict) -> list[tuple[int, int]]:
    """Answer spans of a template without generation tags, from renderings of growing prefixes."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(template, messages[:i], add_generation_prompt=True, **specials) if i else ""
        upto = render_chat(template, messages[: i + 1], add_generation_prompt=False, **specials)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ChatTemplateError(
                f"the template does not render this conversation turn by turn (the text up to assistant "
                f"message {i} is not a prefix of the whole), so its answers cannot be located; mark them with "
                f"{{% generation %}} ... {{% endgeneration %}} in the template, or set data.loss_on=all")
        spans.append((len(before), len(upto)))
    return spans


def encode_conversation(tokenizer, template: str, messages: list[dict]) -> Conversation:
    """The conversation rendered by `template` and encoded by `tokenizer`, with its answer tokens."""
    messages = check_messages(messages)
    specials = dict(bos_token=special_token(tokenizer, "bos_token"), eos_token=special_token(tokenizer, "eos_token"))
    text, spans = render_with_answers(template, messages, **specials)
    if not has_generation_tags(template):
        spans = _turn_spans(template, messages, text, specials)
    ids, offsets = _encode_with_offsets(tokenizer, text)
    answer, ends = _spans_to_tokens(offsets, spans)
    return Conversation(ids, answer, ends, any(m["role"] == "assistant" and m["content"] for m in messages))


def tokenize_conversation(tokenizer, template: str, messages: list[dict],
                          loss_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
    """(token ids [T] int32, mask [T] bool): mask is True where the token is trained as a label (the
    assistants' answers with loss_on="assistant", every token with loss_on="all")."""
    check_loss_on(loss_on, "loss_on")
    conv = encode_conversation(tokenizer, template, messages)
    mask = conv.answer if loss_on == "assistant" else np.ones(len(conv.ids), bool)
    return conv.ids, mask


# The byte tokenizer has no tokenizer_config.json to hold a template: its conversations are rendered
# as plain question and answer lines, each answer ending at its newline.
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def trained_chat_template(tokenizer, data_format: str) -> str | None:
    """The chat template a model speaks: its tokenizer's own, else BYTE_CHAT_TEMPLATE for the byte tokenizer
    of a run fine-tuned on chat data (data.format=chat: the template it learned); None without one. What
    `megajax serve` and `generate --chat` render conversations with, and what an export carries."""
    template = find_chat_template(tokenizer)
    if template is None and data_format == "chat" and getattr(tokenizer, "name", "byte") == "byte":
        return BYTE_CHAT_TEMPLATE
    return template


def chat_template_of(tokenizer, key: str = "data.tokenizer") -> str:
    """The tokenizer's chat template (the byte tokenizer's: BYTE_CHAT_TEMPLATE), or a DataError saying
    where one is looked for."""
    try:
        template = find_chat_template(tokenizer)
    except ChatTemplateError as e:
        raise DataError(f"{key} = {getattr(tokenizer, 'name', 'byte')!r}: {e}.") from None
    if template is None and getattr(tokenizer, "name", "byte") == "byte":
        return BYTE_CHAT_TEMPLATE
    if template is None:
        name = getattr(tokenizer, "name", "byte")
        raise DataError(f"{key} = {name!r} has no chat template, which data.format=chat needs: give a Hugging Face "
                        f"tokenizer whose tokenizer_config.json holds \"chat_template\" (or with a "
                        f"chat_template.jinja beside its tokenizer.json).")
    return template


def checked_chat_template(tokenizer, key: str = "data.tokenizer") -> tuple[str, str]:
    """(template, where it comes from) of chat_template_of, checked to compile and to render a plain
    conversation (megajax.data.chat_template.check_chat_template): a DataError naming the template's file
    otherwise, before any data is read."""
    template = chat_template_of(tokenizer, key)
    source = chat_template_source(tokenizer) or "the byte tokenizer's built-in template"
    try:
        check_chat_template(template, source, bos_token=special_token(tokenizer, "bos_token"),
                            eos_token=special_token(tokenizer, "eos_token"))
    except ChatTemplateError as e:
        raise DataError(f"{key} = {getattr(tokenizer, 'name', 'byte')!r}: {e}. Fix the template, or give {key} a "
                        f"tokenizer whose chat template works.") from None
    return template, source


def conversation_error(e: ChatTemplateError, where: str, source: str = "") -> DataError:
    """A template's failure on the conversation at `where` ("FILE:LINE"): the line first when the template
    refused that conversation (its raise_exception) or cannot mark its answers; the template first otherwise
    (it fails on this conversation's content, or went past megajax's bounds on it)."""
    said = naming(e, source)
    if e.refused or not str(e).startswith("the chat template"):
        return DataError(f"{where}: {said}.")
    fix = ("shorten the conversation or fix the template" if isinstance(e, TemplateLimit) else "fix the template")
    return DataError(f"{said}, on the conversation at {where}; {fix}.")


# ----------------------------------------------------------------------------
# jsonl files
# ----------------------------------------------------------------------------

def chat_files(path: str, key: str = "data.path") -> list[Path]:
    """The jsonl files of data.path: one file, or every *.jsonl of a directory (sorted by name)."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".jsonl" and f.is_file())
        if not files:
            raise DataError(f"{key} = {path!r}: the directory holds no *.jsonl files; data.format=chat reads "
                            f"jsonl conversations.")
        return files
    indexed = str(p)[:-4] if p.suffix in (".bin", ".idx") else str(p)
    if Path(indexed + ".bin").is_file() and Path(indexed + ".idx").is_file():
        raise DataError(f"{key} = {path!r} is a Megatron indexed dataset ({indexed}.bin/.idx), which "
                        f"data.format=gpt reads (give its prefix, {indexed}); data.format=chat reads jsonl files of "
                        f"conversations.")
    if p.is_file():
        return [p]
    there = kind_of(p)
    raise DataError(f"{key} = {path!r}: {f'{there}, not a file' if there else 'no such file or directory'}; "
                    f"data.format=chat reads a jsonl file of conversations or a directory of *.jsonl files.")


def read_messages(record, where: str) -> list[dict]:
    """A jsonl record's messages: {"messages": [...]} or {"prompt", "completion"}, not both."""
    both = [f'"{k}"' for k in ("prompt", "completion") if k in record] if isinstance(record, dict) else []
    if isinstance(record, dict) and "messages" in record and both:
        raise DataError(f"{where}: the record holds both \"messages\" and {' and '.join(both)}; "
                        f"a conversation is either {{\"messages\": [...]}} or {{\"prompt\": ..., \"completion\": "
                        f"...}}, not both: keep the one meant.")
    if isinstance(record, dict) and "messages" in record:
        return check_messages(record["messages"], where)
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        if not (isinstance(record["prompt"], str) and isinstance(record["completion"], str)):
            raise DataError(f"{where}: \"prompt\" and \"completion\" must be strings.")
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]}]
    raise DataError(f"{where}: {json.dumps(record)[:80]} is neither {{\"messages\": [...]}} nor "
                    f"{{\"prompt\": ..., \"completion\": ...}}.")


def jsonl_records(path, name=None, hint: str = ""):
    """(line number, where "NAME:LINE", record) of every non-blank line of the UTF-8 jsonl file `path` (named
    `name` in messages, default the path; megajax.data.text_files' rules: a leading byte-order mark is
    dropped); a DataError naming file and line (then `hint`) for bytes that are not UTF-8, invalid JSON, or
    a lone surrogate escape."""
    for n, line in text_lines(path, name):
        if not line.strip():
            continue
        where = f"{path if name is None else name}:{n}"
        yield n, where, json_line(line, where, hint)


def read_conversations(files: list[Path]):
    """(where, messages) of every non-blank line of the files, in order; a DataError naming file and
    line for a line that is not a conversation."""
    for f in files:
        for _, where, record in jsonl_records(f, hint="; each line of a chat jsonl file is one conversation object"):
            yield where, read_messages(record, where)


def tokenize_files(tokenizer, template: str, files: list[Path], source: str = "") -> list[Conversation]:
    """Every conversation of the files, encoded (errors name the file and line, and the template's `source`)."""
    out = []
    for where, messages in read_conversations(files):
        try:
            out.append(encode_conversation(tokenizer, template, messages))
        except ChatTemplateError as e:
            raise conversation_error(e, where, source) from None
    return out
