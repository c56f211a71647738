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

import codecs
import contextvars
import json
import re
import time
from pathlib import Path

from megajax.data import template_sandbox
from megajax.data.template_sandbox import ChatTemplateError, TemplateLimit  # noqa: F401  (the names callers use)
from megajax.data.text_files import parse_json
from megajax.data.user_files import kind_of
from megajax.errors import DataError


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


class TemplateFileError(ChatTemplateError, DataError):
    """A tokenizer folder's chat template cannot be read: its chat_template.jinja or tokenizer_config.json is
    not what transformers reads (a user error wherever it is met)."""


def _folder_template_and_source(folder: Path) -> tuple[str | None, str]:
    """(the chat template of a Hugging Face tokenizer folder as transformers' AutoTokenizer reads it, where
    it was found): chat_template.jinja (transformers 5's file) when there is one, else `chat_template` in
    its tokenizer_config.json (a string, or a list of named templates: the one named "default"); (None, "")
    without one. A .jinja file that is not a UTF-8 text file, a tokenizer_config.json that is not JSON, or a
    `chat_template` of another kind (a number; a list without "default") is a TemplateFileError naming it."""
    folder = Path(folder)
    path = folder / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_bytes().removeprefix(codecs.BOM_UTF8).decode("utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateFileError(f"the chat template {path} cannot be read ({e}); it must be UTF-8 text") from None
    if path.exists():  # a directory or a FIFO: transformers would fail on it, not take tokenizer_config.json's
        kind = "a directory" if path.is_dir() else kind_of(path) or "not a file"
        raise TemplateFileError(f"the chat template {path} is {kind}, not a file; it must be a UTF-8 text file "
                                f"(or be absent, for the \"chat_template\" of tokenizer_config.json)")
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return None, ""
    try:
        config = parse_json(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise TemplateFileError(f"{config_file} is not a readable JSON file ({e}), so its \"chat_template\" "
                                f"cannot be read") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TemplateFileError(f"{config_file}: \"chat_template\" is a list of templates named "
                                    f"{', '.join(map(repr, named)) or 'nothing'}, none of them \"default\" (the one "
                                    f"transformers renders when none is chosen)")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TemplateFileError(f"{config_file}: \"chat_template\" is {json.dumps(template)[:80]}; expected the "
                                f"template's text (a string) or a list of {{\"name\", \"template\"}} objects")
    if template:
        return template, f"\"chat_template\" in {config_file}"
    return None, ""


def folder_chat_template(folder: Path) -> str | None:
    """The chat template of a Hugging Face tokenizer folder (_folder_template_and_source), or None."""
    return _folder_template_and_source(folder)[0]


def _template_and_source(tokenizer) -> tuple[str | None, str]:
    _, folder = _config(tokenizer)
    return (None, "") if folder is None else _folder_template_and_source(folder)


def find_chat_template(tokenizer) -> str | None:
    """The chat template of the tokenizer's Hugging Face folder (folder_chat_template); None without
    one (the byte tokenizer has none)."""
    return _template_and_source(tokenizer)[0]


def chat_template_source(tokenizer) -> str:
    """Where find_chat_template found the template, for messages: '"chat_template" in
    DIR/tokenizer_config.json' or 'DIR/chat_template.jinja' ("" without one)."""
    return _template_and_source(tokenizer)[1]


def naming(e: ChatTemplateError, source: str) -> str:
    """The error's text with the template named by its source ("the chat template (SOURCE) ...")."""
    text = str(e)
    if source and text.startswith("the chat template"):
        return f"the chat template ({source}){text[len('the chat template'):]}"
    return text


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

    def raise_exception(message):
        error = ChatTemplateError(f"the chat template refused the messages: {message}")
        error.refused = True
        raise error

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = template_sandbox.environment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[loopcontrols, _generation_extension()])
    env.filters["tojson"] = template_sandbox.bounded_filter("tojson", tojson)
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
            compiled = _TEMPLATES[template] = template_sandbox.bounded(lambda: _environment().from_string(template))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template is not valid Jinja: line {e.lineno}: {e.message}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # a constant expression Jinja evaluates while compiling
            raise ChatTemplateError(f"the chat template is not valid Jinja: {type(e).__name__}: {e}") from None
    return compiled


def _failed(e: Exception) -> ChatTemplateError:
    """A rendering's failure as a ChatTemplateError (the template's own refusal and the bounds as they are)."""
    if isinstance(e, ChatTemplateError):
        return e
    return ChatTemplateError(f"the chat template failed ({type(e).__name__}: {e})")


def render_chat(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """The text for `messages` ({"role", "content"} dicts), by default ending with the generation prompt;
    rendered within megajax.data.template_sandbox's bounds."""
    compiled = compile_chat_template(template)
    try:
        return template_sandbox.bounded(lambda: compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token))
    except Exception as e:
        raise _failed(e) from None


def render_with_answers(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
                        add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """(text, spans): the rendered conversation and the [begin, end) character span of each
    `{% generation %}` block in it, in order (none when the template has no such blocks)."""
    compiled = compile_chat_template(template)
    chunks: list[str] = []
    spans: list[tuple[int, int]] = []

    def render():
        size = 0
        for chunk in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=bos_token, eos_token=eos_token):
            size += len(chunk)
            if size > template_sandbox.MAX_CHARS:
                raise template_sandbox.output_limit()
            chunks.append(chunk)

    token = _ANSWERS.set((chunks, spans))
    try:
        template_sandbox.bounded(render)
    except Exception as e:
        raise _failed(e) from None
    finally:
        _ANSWERS.reset(token)
    return "".join(chunks), spans


# A conversation every template renders: one that fails on it fails on every conversation.
PLAIN_CONVERSATION = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello."}]


def check_chat_template(template: str, source: str = "", *, bos_token: str = "", eos_token: str = "") -> None:
    """ChatTemplateError naming `source` when the template is not valid Jinja or fails on a plain conversation
    (a user turn and an answer; the user turn with the generation prompt): then it would fail on every one.
    The template refusing that conversation (`raise_exception`) is left for the real ones to show."""
    try:
        compile_chat_template(template)
        for messages, prompt in ((PLAIN_CONVERSATION, False), (PLAIN_CONVERSATION[:1], True)):
            try:
                render_with_answers(template, messages, add_generation_prompt=prompt, bos_token=bos_token,
                                    eos_token=eos_token)
            except ChatTemplateError as e:
                if not e.refused:
                    raise ChatTemplateError(f"{e}, on a plain conversation ({json.dumps(messages)[:120]}), so on "
                                            f"every one") from None
    except ChatTemplateError as e:
        raise ChatTemplateError(naming(e, source)) from None
