"""Chat messages as a prompt: the tokenizer's chat template, rendered as Hugging Face renders it.

    find_chat_template(tokenizer) -> template text or None   (chat_template.jinja beside its tokenizer.json,
                                                               else tokenizer_config.json's `chat_template`)
    render_chat(template, messages, bos_token=, eos_token=) -> prompt text
    render_with_answers(template, messages, ...) -> (text, [(begin, end) character spans])

The template is Jinja, run in a sandboxed environment with what `transformers`' apply_chat_template
gives it: `messages`, `add_generation_prompt` (True: the prompt ends where the assistant's answer
begins), `bos_token`, `eos_token`, `raise_exception(message)`, `strftime_now(format)`, the
loop-controls extension, a `tojson` filter that keeps non-ASCII text, and the `{% generation %}`
... `{% endgeneration %}` block that marks an assistant's answer (what transformers'
`return_assistant_tokens_mask` reads; render_with_answers reports the character span of each such
block as it is written out). The server encodes the rendered text like any prompt (no special
tokens added: the template writes them); training data (megajax.data.chat) masks its tokens by the
answer spans.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from pathlib import Path



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


def folder_chat_template(folder: Path) -> str | None:
    """The chat template of a Hugging Face tokenizer folder, as transformers' AutoTokenizer reads it:
    chat_template.jinja (transformers 5's file) when there is one, else `chat_template` in its
    tokenizer_config.json (a string, or a list of named templates: the one named "default"); None
    without one."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        try:
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def find_chat_template(tokenizer) -> str | None:
    """The chat template of the tokenizer's Hugging Face folder (folder_chat_template); None without
    one (the byte tokenizer has none)."""
    _, folder = _config(tokenizer)
    return None if folder is None else folder_chat_template(folder)


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


# While render_with_answers runs: (the chunks written so far, the answer spans found so far).
_ANSWERS: contextvars.ContextVar = contextvars.ContextVar("megajax_chat_answers", default=None)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tags(template: str) -> bool:
    """Whether the template marks assistant answers with `{% generation %}` blocks."""
    return _GENERATION_TAG.search(template) is not None


def _generation_extension():
    """The `{% generation %}...{% endgeneration %}` block: writes its body unchanged and, while
    render_with_answers runs, records where the body lands in the output."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_answer"), [], [], body).set_lineno(lineno)

        def _answer(self, caller):
            text = caller()
            tracking = _ANSWERS.get()
            if tracking is not None:
                chunks, spans = tracking
                begin = sum(map(len, chunks))  # the answer is written right after every chunk so far
                spans.append((begin, begin + len(text)))
            return text

    return Generation


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_extension()])
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


def render_chat(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """The text for `messages` ({"role", "content"} dicts), by default ending with the generation prompt."""
    import jinja2
    compiled = compile_chat_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: {e}).") from None


def render_with_answers(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                        add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """(text, spans): the rendered conversation and the [begin, end) character span of each
    `{% generation %}` block in it, in order (none when the template has no such blocks)."""
    import jinja2
    compiled = compile_chat_template(template)
    chunks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _ANSWERS.set((chunks, spans))
    try:
        for chunk in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=bos_token, eos_token=eos_token):
            chunks.append(chunk)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: {e}).") from None
    finally:
        _ANSWERS.reset(token)
    return "".join(chunks), spans
