"""Chat messages as a prompt: the tokenizer's chat template, rendered as Hugging Face renders it.

    find_chat_template(tokenizer) -> template text or None   (tokenizer_config.json's `chat_template`,
                                                               or chat_template.jinja beside it)
    render_chat(template, messages, bos_token=, eos_token=) -> prompt text

The template is Jinja, run in a sandboxed environment with what `transformers`' apply_chat_template
gives it: `messages`, `add_generation_prompt` (True: the prompt ends where the assistant's answer
begins), `bos_token`, `eos_token`, `raise_exception(message)`, `strftime_now(format)`, the
loop-controls extension, and a `tojson` filter that keeps non-ASCII text. The rendered text is then
encoded like any prompt (no special tokens added: the template writes them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from megajax.errors import UserError


class ChatTemplateError(ValueError):
    """The template is not valid Jinja, or raised while rendering (`raise_exception`)."""


def _config(tokenizer) -> tuple[dict, Path | None]:
    """(tokenizer_config.json of a Hugging Face tokenizer's directory or {}, that directory or None)."""
    name = getattr(tokenizer, "name", "")
    path = Path(name) if name and name != "byte" else None
    if path is None or not path.exists():
        return {}, None
    folder = path if path.is_dir() else path.parent
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return (config if isinstance(config, dict) else {}), folder


def find_chat_template(tokenizer) -> str | None:
    """The chat template of the tokenizer's Hugging Face directory: `chat_template` in its
    tokenizer_config.json (a string, or a list of named templates: the one named "default"), else a
    chat_template.jinja file there; None without one (the byte tokenizer has none)."""
    config, folder = _config(tokenizer)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    return None


def special_token(tokenizer, key: str) -> str:
    """The text of the tokenizer's `bos_token` / `eos_token` as its tokenizer_config.json names it
    (else the end-of-document token's text for eos), or ""."""
    config, _ = _config(tokenizer)
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    if isinstance(value, str):
        return value
    raw = getattr(tokenizer, "_tok", None)
    eod = getattr(tokenizer, "eod_id", None)
    if key == "eos_token" and raw is not None and eod is not None:
        return raw.id_to_token(eod) or ""
    return ""


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env


_TEMPLATES: dict[str, object] = {}


def compile_chat_template(template: str):
    """The template compiled in the sandbox `render_chat` runs it in (cached); ChatTemplateError naming the
    line when it is not valid Jinja. The server compiles its template at start-up."""
    import jinja2
    compiled = _TEMPLATES.get(template)
    if compiled is None:
        try:
            compiled = _TEMPLATES[template] = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template is not valid Jinja: line {e.lineno}: {e.message}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template is not valid Jinja: {e}") from None
    return compiled


def read_chat_template(path: str) -> str:
    """`megajax serve --chat-template FILE`'s text, compiled as the server will run it (UserError naming the
    file now, rather than a 400 for every chat request)."""
    accepted = "give a Jinja chat template file (the text of a tokenizer_config.json's \"chat_template\")"
    try:
        template = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {path!r}: cannot read it ({e}); {accepted}.") from None
    if not template.strip():
        raise UserError(f"--chat-template {path!r} is empty; {accepted}.")
    try:
        compile_chat_template(template)
    except ChatTemplateError as e:
        raise UserError(f"--chat-template {path!r}: {e}; {accepted}.") from None
    return template


def render_chat(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for `messages` ({"role", "content"} dicts), ending with the generation prompt."""
    import jinja2
    compiled = compile_chat_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                               eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: {e}).") from None
