"""Chat templates for the server: the rendering lives in megajax.data.chat_template (training data renders
conversations with the same sandbox); this module adds `--chat-template FILE`'s reader."""

from __future__ import annotations

import codecs
from pathlib import Path

from megajax.data.chat_template import (  # noqa: F401  (the server's names for them)
    ChatTemplateError, TemplateLimit, check_chat_template, compile_chat_template, find_chat_template, naming,
    render_chat, special_token)
from megajax.data.chat_template import chat_template_source as chat_template_source_of  # noqa: F401
from megajax.errors import UserError


def read_chat_template(path: str) -> str:
    """`megajax serve --chat-template FILE`'s text, compiled as the server will run it (UserError naming the
    file now, rather than a 400 for every chat request)."""
    accepted = "give a Jinja chat template file (the text of a tokenizer_config.json's \"chat_template\")"
    try:
        template = Path(path).expanduser().read_bytes().removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {path!r}: cannot read it as UTF-8 text ({e}); {accepted}.") from None
    if not template.strip():
        raise UserError(f"--chat-template {path!r} is empty; {accepted}.")
    try:
        compile_chat_template(template)
    except ChatTemplateError as e:
        raise UserError(f"--chat-template {path!r}: {e}; {accepted}.") from None
    return template
