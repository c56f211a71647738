"""What `megajax generate` completes: prompt texts, or conversations rendered with the model's chat
template as `megajax serve` renders /v1/chat/completions, and the `<image>` markers they hold, each
checked before the model loads.

    read_prompts(prompt, prompts_file, chat) -> [Prompt]        --prompt / --prompts-file (--chat)
    prompt_texts(prompts, tokenizer, template) -> [str]         the conversations rendered
    check_markers(texts, prompts, image_paths, vision)          <image> markers against --image

A prompts file is one prompt per line; a .jsonl file holds per line a JSON string, an object with
"prompt" (a string), or an object with "messages" (a conversation: {"role", "content"} objects, roles
and content as for fine-tuning data, megajax/data/chat.py). With --chat each plain prompt is the one
user message of a conversation. A conversation is rendered with the generation prompt, and its text is
encoded without added special tokens (the template writes them), as transformers'
`apply_chat_template(messages, add_generation_prompt=True)` renders it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

from megajax.data.chat import check_messages
from megajax.data.text_files import argument_text, json_line, undecodable
from megajax.data.user_files import MAX_TEXT_BYTES, read_user_file
from megajax.errors import DataError, UserError
from megajax.inference.chat import ChatTemplateError, render_chat, special_token
from megajax.inference.images import IMAGE_MARKER


@dataclass
class Prompt:
    where: str  # the option (and line) it came from, for messages
    text: str | None = None  # a plain prompt
    messages: list[dict] | None = None  # a conversation


def _lines(path: Path) -> list[str]:
    """The file's lines (at most MAX_TEXT_BYTES in all), as UTF-8 text (megajax.data.text_files' rules:
    a leading byte-order mark dropped, a byte that is not UTF-8 named with its line)."""
    what = f"--prompts-file {str(path)!r}"
    raw = read_user_file(path, what, MAX_TEXT_BYTES).removeprefix(codecs.BOM_UTF8)
    lines = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        try:
            lines.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise undecodable(line, f"{what}:{n}", e) from None
    return lines


def _jsonl_prompt(line: str, where: str, chat: bool) -> Prompt:
    item = json_line(line, where)
    if isinstance(item, dict) and "messages" in item:
        return Prompt(where, messages=check_messages(item["messages"], where))
    item = item.get("prompt") if isinstance(item, dict) else item
    if not isinstance(item, str):
        raise UserError(f"{where}: expected a JSON string, an object with a \"prompt\" string, or an object "
                        f"with \"messages\" (a list of {{\"role\", \"content\"}} objects).")
    return _plain(item, where, chat)


def _plain(text: str, where: str, chat: bool) -> Prompt:
    return Prompt(where, messages=[{"role": "user", "content": text}]) if chat else Prompt(where, text=text)


def read_prompts(prompt: list[str], prompts_file: str | None, chat: bool) -> list[Prompt]:
    """--prompt values or --prompts-file's prompts (module docstring); UserError naming the option, the
    file and the line for anything else."""
    if bool(prompt) == bool(prompts_file):
        raise UserError("megajax generate needs --prompt TEXT (repeatable) or --prompts-file FILE, one of them.")
    if prompt:
        return [_plain(argument_text(p, f"--prompt {i}"), f"--prompt {i}", chat) for i, p in enumerate(prompt)]
    path = Path(prompts_file)
    lines = [(n, line) for n, line in enumerate(_lines(path), 1) if line.strip()]
    where = f"--prompts-file {str(path)!r}"
    if path.suffix == ".jsonl":
        prompts = [_jsonl_prompt(line, f"{where}, line {n}", chat) for n, line in lines]
    else:
        prompts = [_plain(line, f"{where}, line {n}", chat) for n, line in lines]
    if not prompts:
        raise UserError(f"{where} holds no prompts.")
    return prompts


def prompt_texts(prompts: list[Prompt], tokenizer, template: str | None, images: int = 0) -> list[str]:
    """Each prompt's text: a plain prompt as it is, a conversation rendered with `template` (the model's
    or --chat-template's). With images and a conversation without `<image>` markers, the markers go at the
    start of its first user message (where LLaVA-style templates expect them)."""
    chats = [p for p in prompts if p.messages is not None]
    if chats and template is None:
        raise UserError(f"{chats[0].where} is a conversation, but the model's tokenizer "
                        f"({getattr(tokenizer, 'name', tokenizer)}) has no chat template (none in its "
                        f"tokenizer_config.json or a chat_template.jinja beside it); pass --chat-template FILE (a "
                        f"Jinja chat template), or give plain prompts without --chat.")
    bos, eos = special_token(tokenizer, "bos_token"), special_token(tokenizer, "eos_token")
    texts = []
    for p in prompts:
        if p.messages is None:
            texts.append(p.text)
            continue
        messages = p.messages
        if images and not any(IMAGE_MARKER in m["content"] for m in messages):
            first = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
            messages = [dict(m, content=IMAGE_MARKER * images + m["content"]) if i == first else m
                        for i, m in enumerate(messages)]
        try:
            texts.append(render_chat(template, messages, bos_token=bos, eos_token=eos))
        except ChatTemplateError as e:
            raise UserError(f"{p.where}: {e}") from None
    return texts


def check_markers(texts: list[str], prompts: list[Prompt], image_paths: list[str], vision) -> None:
    """Every prompt of a vision-language model (`vision`: model.vision) holds one `<image>` marker per
    --image, or none when images came (they then go first); a marker without an image is refused.
    A text-only model takes no --image."""
    images = len(image_paths)
    if vision is None:
        if images:
            raise DataError(f"--image {image_paths[0]!r}: this model has no image encoder (model.vision is unset); "
                            f"it takes text alone. Drop --image, or load a vision-language model.")
        return
    for text, p in zip(texts, prompts):
        markers = text.count(IMAGE_MARKER)
        if markers != images and (markers or not images):
            raise DataError(f"{p.where} holds {markers} {IMAGE_MARKER} marker(s) but {images} image(s) came "
                            f"with --image; give one --image per marker (the same images go with every "
                            f"prompt), or no markers and the images come first.")
