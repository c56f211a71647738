"""Chat templates for the server: the rendering lives in megajax.data.chat_template (training data renders
conversations with the same sandbox); this module adds `--chat-template FILE`'s reader."""

from __future__ import annotations

import codecs
from pathlib import Path

from megajax.data.chat_template import (  # noqa: F401  (the server's names for them)
    ChatTemplateError, TemplateLimit, check_chat_template, compile_chat_template, find_chat_template, naming,
    render_chat, special_token)
from megajax.data.chat_template import chat_template_source as chat_template_source_of  # noqa: F401
from megajax.data.user_files import MAX_TEXT_BYTES, read_user_file
from megajax.errors import UserError


def read_chat_template(path: str) -> str:
    """`--chat-template FILE`'s text (`megajax serve`, `megajax generate --chat`; a regular file of at most
    MAX_TEXT_BYTES), compiled as it will run (UserError naming the file now, rather than a 400 for every
    chat request)."""
    accepted = "give a Jinja chat template file (the text of a tokenizer_config.json's \"chat_template\")"
    try:
        template = read_user_file(Path(path).expanduser(), f"--chat-template {path!r}",
                                  MAX_TEXT_BYTES).removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--chat-template {path!r}: not UTF-8 text ({e}); {accepted}.") from None
    if not template.strip():
        raise UserError(f"--chat-template {path!r} is empty; {accepted}.")
    try:
        compile_chat_template(template)
    except ChatTemplateError as e:
        raise UserError(f"--chat-template {path!r}: {e}; {accepted}.") from None
    return template
