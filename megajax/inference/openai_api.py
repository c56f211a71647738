"""OpenAI's dialect of `megajax serve`: completions, chat completions and the tokenizer endpoints.

    POST /v1/completions       prompt (string, list of strings, token ids, list of token id lists),
                               max_tokens (16; 0 with echo scores the prompt only), temperature, top_p,
                               top_k, n, seed, stop (string or list, matched on the text), logprobs
                               (0-20), echo, presence_penalty, frequency_penalty, stream
                               (+ stream_options.include_usage), user, model
    POST /v1/chat/completions  messages rendered with the tokenizer's chat template (content parts: text,
                               and images as base64 data URLs for a vision-language model); max_tokens /
                               max_completion_tokens (default: the rest of the context), logprobs +
                               top_logprobs in chat's shape, the sampling fields above, stream
    POST /tokenize             {"prompt": text | "messages": [...]} -> {"tokens", "count", "max_model_len"}
    POST /detokenize           {"tokens": [...]} -> {"prompt": text}
    GET  /tokenizer_info       eos_token, bos_token, pad_token, chat_template, model_max_length

Log-probabilities are the model's own (a log-softmax of its logits, before temperature, filters
and penalties). A field OpenAI's API does not have is refused with HTTP 400 naming it, like a
field value megajax cannot honour (`suffix`, `logit_bias`, `best_of` other than n, tools).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import queue
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from megajax.data.chat import ROLES
from megajax.errors import DataError
from megajax.inference.batcher import Job
from megajax.inference.chat import ChatTemplateError, TemplateLimit, naming, render_chat, special_token
from megajax.inference.generate import MAX_TOP_LOGPROBS, Completion, TokenScores
from megajax.inference.images import (IMAGE_MARKER, MAX_IMAGE_BYTES, decode_image, image_prompt_ids, preprocess_tiles,
                                      read_user_file)
from megajax.inference.request import OPENAI_FIELDS, RequestError, checked, field, random_seed
from megajax.inference.sampling import Sampling
from megajax.inference.text import StopText, completion_text, cut_at_stop

MAX_STOPS = 16  # OpenAI allows 4; lm-evaluation-harness sends a task's stop strings and end-of-text, often 5

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                 "presence_penalty", "frequency_penalty", "seed", "user", "logit_bias"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "logprobs", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                               "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}


def _fields(body: dict, known: set, endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field '{unknown[0]}' in {endpoint}" + (f" (also {', '.join(unknown[1:])})"
                           if unknown[1:] else "") + f"; the fields are: {', '.join(sorted(known))}.", unknown[0],
                           code="unknown_field")


def _refuse_unless(body: dict, name: str, ok) -> None:
    if name in body and not ok(body[name]):
        raise RequestError(f"'{name}' = {json.dumps(body[name])[:80]} is not supported by this server.", name)


@dataclass
class Plan:
    """A parsed generation request: prompts (token ids) x n sequences and how to answer."""
    prompts: list[list[int]]
    prompt_texts: list[str]
    n: int
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    logprobs: int | None  # None: no log-probabilities; else the alternatives per token
    echo: bool
    stream: bool
    include_usage: bool
    images: list | None = None  # per prompt: its images [N, H, W, 3] (a vision-language model's), or None

    def jobs(self, events: queue.Queue) -> list[Job]:
        out = []
        for i in range(len(self.prompts) * self.n):
            sampling = dataclasses.replace(self.sampling, seed=(self.sampling.seed + i) % 2**63)
            out.append(Job(self.prompts[i // self.n], sampling, self.max_tokens, i, events, self.stream,
                           top_logprobs=self.logprobs or 0, score_prompt=self.echo and self.logprobs is not None,
                           images=None if self.images is None else self.images[i // self.n]))
        return out


def _cancel_unless(complete: bool, jobs: list[Job]) -> None:
    """A stream its consumer left early (the client disconnected): its jobs are dropped at the next step."""
    if not complete:
        for job in jobs:
            job.cancelled = True


@dataclass
class Choice:
    """One finished sequence as the answer gives it."""
    index: int
    text: str  # without the stop sequence or end-of-document token
    ids: list[int]  # the tokens the answer counts (through the stop sequence, or the end-of-document token)
    scores: TokenScores | None
    finish_reason: str
    completion: Completion


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop' must be a string or a list of strings.", "stop")
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOPS:
        raise RequestError(f"'stop' has {len(stops)} sequences; at most {MAX_STOPS}.", "stop")
    return stops


def _plan(service, body: dict, prompts: list[list[int]], texts: list[str], *, max_tokens: int,
          logprobs: int | None, echo: bool, prompt_param: str = "prompt", budget_param: str = "max_tokens",
          images: list | None = None) -> Plan:
    temperature = field(body, "temperature", float, 1.0, accept="a number")
    top_p = field(body, "top_p", float, 1.0, accept="a number")
    top_k = field(body, "top_k", int, 0, accept="an integer")
    n = field(body, "n", int, 1, check=lambda v: v >= 1, accept="an integer >= 1")
    seed = field(body, "seed", int, None, accept="an integer")
    stream = field(body, "stream", bool, False)
    presence = field(body, "presence_penalty", float, 0.0, accept="a number")
    frequency = field(body, "frequency_penalty", float, 0.0, accept="a number")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise RequestError("'stream_options' is {\"include_usage\": true|false}, with 'stream': true.",
                           "stream_options")
    if not isinstance(body.get("user", ""), str) or not isinstance(body.get("model", ""), (str, type(None))):
        raise RequestError("'user' and 'model' must be strings.", "user" if "user" in body else "model")
    _refuse_unless(body, "logit_bias", lambda v: v in (None, {}))
    # OpenAI's dialect: top_k -1 is off too; no seed: a random one.
    sampling = checked(Sampling(temperature, 0 if top_k == -1 else top_k, top_p,
                                 random_seed() if seed is None else seed, presence, frequency),
                        OPENAI_FIELDS)
    plan = Plan(prompts, texts, n, max_tokens, sampling, _stops(body), logprobs, echo, stream,
                bool((options or {}).get("include_usage")), images)
    service.check_prompts(prompts, max_tokens, prompt_param, budget_param, len(prompts) * n, images)
    return plan


class OpenAIDialect:
    """The OpenAI endpoints on a CompletionService (its tokenizer, generator, batcher and template)."""

    def __init__(self, service):
        self.service = service
        self.tokenizer = service.tokenizer
        self._token_texts: dict[int, str] = {}

    # ------------------------------------------------------------ helpers

    def token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _head(self, prefix: str, kind: str) -> dict:
        return {"id": self.service.response_id(prefix), "object": kind, "created": int(time.time()),
                "model": self.service.model_name}

    def _top(self, alternatives: list[tuple[int, float]], token: int, logprob: float, count: int) -> dict:
        """{token text: logprob} of the `count` most likely tokens and the chosen one (OpenAI's shape;
        tokens whose texts coincide keep the likelier)."""
        top: dict[str, float] = {}
        for t, lp in alternatives[:count]:
            top.setdefault(self.token_text(t), lp)
        top.setdefault(self.token_text(token), logprob)
        return top

    def _finish(self, plan: Plan, c: Completion, index: int) -> Choice:
        ids = c.completion_ids
        body = ids[:-1] if c.finish_reason == "stop" else ids
        cut = cut_at_stop(self.tokenizer, body, plan.stops) if plan.stops else None
        if cut is not None:
            text, kept = cut
            ids, finish = ids[:kept], "stop"
        else:
            text, finish = completion_text(self.tokenizer, c), c.finish_reason
        scores = c.scores[:len(ids)] if c.scores is not None and plan.logprobs is not None else None
        return Choice(index, text, ids, scores, finish, c)

    def _run(self, plan: Plan) -> tuple[list[Choice], queue.Queue]:
        jobs, events = self.service.submit(plan)
        return [self._finish(plan, c, i) for i, c in enumerate(self.service.wait(jobs, events))], events

    @staticmethod
    def _usage(plan: Plan, lengths: list[int]) -> dict:
        """OpenAI's usage: each prompt's tokens once (whatever n), every sequence's counted tokens."""
        prompt_tokens = sum(len(p) for p in plan.prompts)
        completion_tokens = sum(lengths)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    # ------------------------------------------------------------ completions

    def _completion_logprobs(self, ids: list[int], scores: TokenScores | None, count: int, offset: int,
                             leading_none: bool = False) -> dict:
        tokens = [self.token_text(t) for t in ids]
        logprobs: list = [None] * leading_none
        top: list = [None] * leading_none
        if scores is not None:
            logprobs += scores.logprobs
            top += [self._top(alts, t, lp, count) for t, lp, alts in zip(ids[leading_none:], scores.logprobs,
                                                                            scores.top)]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}

    def _prompt(self, body: dict) -> tuple[list[list[int]], list[str]]:
        prompts = self.service.encode_prompts(body.get("prompt"), "prompt")
        raw = body["prompt"]
        raw = [raw] if isinstance(raw, str) or (raw and not isinstance(raw[0], (str, list))) else raw
        texts = [r if isinstance(r, str) else self.tokenizer.decode(ids) for r, ids in zip(raw, prompts)]
        return prompts, texts

    def completions(self, body: dict):
        """(answer dict) or, with stream, (a generator of event dicts); raises RequestError."""
        _fields(body, COMPLETION_FIELDS, "POST /v1/completions")
        _refuse_unless(body, "suffix", lambda v: v in (None, ""))
        echo = field(body, "echo", bool, False)
        logprobs = field(body, "logprobs", int, None, check=lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                        accept=f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        max_tokens = field(body, "max_tokens", int, 16, check=lambda v: v >= 0, accept="an integer >= 0")
        if max_tokens == 0 and not echo:
            raise RequestError("'max_tokens' = 0 asks for no new tokens; that needs 'echo': true (the prompt "
                               "scored, with 'logprobs').", "max_tokens")
        prompts, texts = self._prompt(body)
        plan = _plan(self.service, body, prompts, texts, max_tokens=max_tokens, logprobs=logprobs, echo=echo)
        best_of = body.get("best_of")
        if best_of is not None and best_of != plan.n:
            raise RequestError(f"'best_of' = {json.dumps(best_of)[:40]}: only best_of = n ({plan.n}) is supported "
                               f"(every sequence is returned).", "best_of")
        head = self._head("cmpl", "text_completion")
        if plan.stream:
            return self._completion_stream(plan, head)
        choices, _ = self._run(plan)
        out = []
        for ch in choices:
            p = ch.index // plan.n
            text, lp = ch.text, None
            if plan.echo:
                text = plan.prompt_texts[p] + text
            if plan.logprobs is not None:
                start = 0 if plan.echo else len(plan.prompt_texts[p])
                lp = self._completion_logprobs(ch.ids, ch.scores, plan.logprobs, start)
                if plan.echo:
                    ps = ch.completion.prompt_scores
                    prompt_lp = self._completion_logprobs(plan.prompts[p], ps, plan.logprobs, 0, leading_none=True)
                    shift = sum(len(t) for t in prompt_lp["tokens"])
                    lp = {k: prompt_lp[k] + ([o + shift for o in lp[k]] if k == "text_offset" else lp[k])
                          for k in lp}
            out.append({"index": ch.index, "text": text, "logprobs": lp, "finish_reason": ch.finish_reason})
        return {**head, "choices": out, "usage": self._usage(plan, [len(c.ids) for c in choices])}

    def _stream_events(self, plan: Plan, jobs: list[Job], events: queue.Queue) -> Iterator[tuple]:
        """(kind, index, text delta, ids, scores, finish reason) per piece of each sequence, kind "prompt"
        (its scores, echo) or "text"; the text stops at a stop sequence, whose tokens end the ids. Ends with
        ("usage", lengths of each sequence's counted ids)."""
        eod = self.service.generator.eod_id
        texts = [StopText(self.tokenizer, eod, plan.stops) for _ in jobs]
        counted = [0] * len(jobs)
        ids_so_far: list[list[int]] = [[] for _ in jobs]
        left = len(jobs)
        while left:
            kind, index, payload = events.get()
            if kind == "error":
                raise RuntimeError(payload)
            if kind == "prompt":
                yield "prompt", index, "", [], payload, None
                continue
            text = texts[index]
            if kind == "done":
                left -= 1
                if text.stopped:
                    continue
                delta = text.add([], final=True)
                yield "text", index, delta, [], None, "stop" if text.stopped else payload.finish_reason
                continue
            if text.stopped:
                continue
            delta = text.add(payload.ids)
            ids, scores = payload.ids, payload.scores
            if text.stopped:  # the tokens through the stop sequence
                body = [t for t in ids_so_far[index] + ids if t != eod]
                cut = cut_at_stop(self.tokenizer, body, plan.stops)
                keep = max((cut[1] if cut else len(body)) - len(ids_so_far[index]), 0)
                ids, scores = ids[:keep], None if scores is None else scores[:keep]
            ids_so_far[index] += ids
            counted[index] += len(ids)
            yield "text", index, delta, ids, scores, "stop" if text.stopped else None
        yield "usage", -1, "", counted, None, None

    def _completion_stream(self, plan: Plan, head: dict):
        jobs, events = self.service.submit(plan)
        offsets = [0 if plan.echo else len(plan.prompt_texts[i // plan.n]) for i in range(len(jobs))]
        pending_echo = set(range(len(jobs))) if plan.echo else set()

        def chunk(index, text, lp, finish):
            return {**head, "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}]}

        def echo(index, scores):
            pending_echo.discard(index)
            p = plan.prompts[index // plan.n]
            lp = None
            if plan.logprobs is not None:
                lp = self._completion_logprobs(p, scores, plan.logprobs, 0, leading_none=True)
                offsets[index] = sum(len(t) for t in lp["tokens"])
            return chunk(index, plan.prompt_texts[index // plan.n], lp, None)

        complete = False
        try:
            for kind, index, delta, ids, scores, finish in self._stream_events(plan, jobs, events):
                if kind == "usage":
                    if plan.include_usage:
                        yield {**head, "choices": [], "usage": self._usage(plan, ids)}
                    continue
                if kind == "prompt":
                    yield echo(index, scores)
                    continue
                if index in pending_echo:  # echo without log-probabilities: the prompt text first
                    yield echo(index, None)
                lp = None
                if plan.logprobs is not None and ids:
                    lp = self._completion_logprobs(ids, scores, plan.logprobs, offsets[index])
                    offsets[index] += sum(len(t) for t in lp["tokens"])
                if delta or finish or lp:
                    yield chunk(index, delta, lp, finish)
            complete = True
        except RuntimeError as e:
            yield {**head, "error": {"message": f"generation failed: {e}", "type": "server_error"}}
        finally:
            _cancel_unless(complete, jobs)

    # ------------------------------------------------------------ chat

    def _image_part(self, part: dict, where: str) -> np.ndarray:
        """An `image_url` content part's image, preprocessed for the encoder ([tiles, H, W, 3], one tile
        untiled); RequestError naming the part."""
        vision = self.service.generator.model.vision
        if vision is None:
            raise RequestError(f"{where} is an image, but this model has no image encoder (model.vision is "
                               f"unset): it takes text parts alone.", "messages", code="images_not_supported")
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise RequestError(f"{where}: an image part is {{\"type\": \"image_url\", \"image_url\": {{\"url\": "
                               f"\"data:image/png;base64,...\"}}}}.", "messages")
        if url.startswith("file://"):
            data = self._local_image(url, where)
        elif not url.startswith("data:"):
            local = " or a file:// URL under --allowed-local-media-path" if self.service.allowed_media else ""
            raise RequestError(f"{where}: image_url {url[:80]!r} is not a data URL{local}; this server fetches "
                               f"nothing, so an image comes inline as \"data:image/<format>;base64,<the file's "
                               f"bytes>\".", "messages", code="image_url_not_supported")
        else:
            data = self._data_url(url, where)
        try:
            return preprocess_tiles(decode_image(data, where), vision)
        except DataError as e:
            raise RequestError(str(e), "messages", code="invalid_image") from None

    def _local_image(self, url: str, where: str) -> bytes:
        """A file:// URL's bytes, when the file lies under --allowed-local-media-path."""
        root = self.service.allowed_media
        if root is None:
            raise RequestError(f"{where}: image_url {url[:80]!r} is a local file; the server reads local files only "
                               f"under --allowed-local-media-path DIR (not set), else give the image as a base64 "
                               f"data URL.", "messages", code="image_url_not_supported")
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
        if not path.is_relative_to(root):
            raise RequestError(f"{where}: {str(path)!r} is outside --allowed-local-media-path {str(root)!r}.",
                               "messages", code="image_url_not_supported")
        try:
            return read_user_file(path, f"{where}: {str(path)!r}", MAX_IMAGE_BYTES)
        except DataError as e:
            raise RequestError(str(e), "messages", code="invalid_image") from None

    @staticmethod
    def _data_url(url: str, where: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise RequestError(f"{where}: the data URL {url[:40]!r}... is not base64 (expected "
                               f"\"data:image/<format>;base64,...\").", "messages")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RequestError(f"{where}: the data URL's base64 does not decode ({e}).", "messages") from None

    def chat_prompt(self, messages: Any, param: str = "messages") -> list[int]:
        """The messages' prompt ids (chat_prompt_images without images: refused when it has some)."""
        return self.chat_prompt_images(messages, param)[0]

    def chat_prompt_images(self, messages: Any, param: str = "messages") -> tuple[list[int], np.ndarray | None]:
        """(prompt ids, images [N, H, W, 3] or None): the messages rendered with the chat template, each
        image part an `<image>` marker in its message's text, expanded to image_seq_length placeholders
        (per tile of a tiled image, whose tiles are its pictures in `images`, image after image)."""
        template = self.service.chat_template
        if template is None:
            raise RequestError("this model's tokenizer has no chat template (no chat_template.jinja beside it, no "
                               "'chat_template' in its tokenizer_config.json), so chat messages cannot be turned into a prompt; start the "
                               "server with `megajax serve --chat-template FILE` (a Jinja chat template), or use "
                               "POST /v1/completions with the prompt text.", param, code="no_chat_template")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(f"'{param}' must be a non-empty list of {{\"role\", \"content\"}} objects.", param)
        flat, images = [], []
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, list):  # content parts: text, and images at their places
                texts = []
                for j, p in enumerate(content):
                    where = f"'{param}'[{i}].content[{j}]"
                    if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                        texts.append(p["text"])
                    elif isinstance(p, dict) and p.get("type") == "image_url":
                        images.append(self._image_part(p, where))
                        texts.append(IMAGE_MARKER)
                    else:
                        raise RequestError(f"{where}: the parts are text ({{\"type\": \"text\", \"text\": ...}}) "
                                           f"and images ({{\"type\": \"image_url\", \"image_url\": {{\"url\": "
                                           f"\"data:image/png;base64,...\"}}}}).", param)
                content = "".join(texts)
            if not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
                raise RequestError(f"'{param}'[{i}] needs a string 'role' and a string 'content'.", param)
            if m["role"] not in ROLES:  # as fine-tuning data's roles: a template knows these
                raise RequestError(f"'{param}'[{i}] has role {m['role']!r}; the roles are "
                                   f"{', '.join(map(repr, ROLES))}.", param)
            if content is None and m["role"] != "assistant":  # OpenAI's: only an assistant turn may leave it out
                raise RequestError(f"'{param}'[{i}] (role {m['role']!r}) has no 'content'; only an assistant "
                                   f"message may leave it out.", param)
            flat.append({**m, "content": content if content is not None else ""})
        try:
            text = render_chat(template, flat, bos_token=special_token(self.tokenizer, "bos_token"),
                               eos_token=special_token(self.tokenizer, "eos_token"))
        except TemplateLimit as e:  # past a bound on these messages: too long, or a template that never ends
            raise RequestError(naming(e, self.service.chat_template_source), param) from None
        except ChatTemplateError as e:
            if e.refused:  # the template's own raise_exception: these messages are not for this model
                raise RequestError(str(e), param) from None
            raise RequestError(f"{naming(e, self.service.chat_template_source)}: the server's chat template cannot "
                               f"render these messages (a fault of the template, not of the request)", param,
                               status=500, code="chat_template_error") from None
        vision = self.service.generator.model.vision
        if vision is None:
            return self.tokenizer.encode(text), None
        limit = self.service.limit_images
        if len(images) > limit:
            raise RequestError(f"'{param}' holds {len(images)} images; at most {limit} per prompt "
                               f"(--limit-images-per-prompt).", param)
        if text.count(IMAGE_MARKER) != len(images):
            raise RequestError(f"'{param}': the rendered prompt holds {text.count(IMAGE_MARKER)} {IMAGE_MARKER} "
                               f"marker(s) for {len(images)} image part(s); {IMAGE_MARKER} in a text part is "
                               f"reserved for an image.", param)
        try:
            ids = image_prompt_ids(self.tokenizer, text, len(images), vision, [len(x) for x in images])
        except DataError as e:
            raise RequestError(str(e), param) from None
        return ids, np.concatenate(images) if images else None

    def _chat_logprobs(self, ids: list[int], scores: TokenScores, count: int) -> dict:
        def entry(token, lp):
            text = self.token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts[:count]]}
                            for t, lp, alts in zip(ids, scores.logprobs, scores.top)]}

    def chat(self, body: dict):
        _fields(body, CHAT_FIELDS, "POST /v1/chat/completions")
        for name in ("tools", "functions"):
            _refuse_unless(body, name, lambda v: v in (None, []))
        for name in ("tool_choice", "function_call"):
            _refuse_unless(body, name, lambda v: v in (None, "none"))
        _refuse_unless(body, "response_format", lambda v: v in (None, {"type": "text"}))
        prompt, images = self.chat_prompt_images(body.get("messages"))
        want_logprobs = field(body, "logprobs", bool, False)
        top = field(body, "top_logprobs", int, None, check=lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                   accept=f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top is not None and not want_logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        room = max(self.service.generator.context - len(prompt), 1)
        max_tokens = field(body, name, int, room, check=lambda v: v >= 1, accept="an integer >= 1")
        plan = _plan(self.service, body, [prompt], [""], max_tokens=max_tokens,
                     logprobs=(top or 0) if want_logprobs else None, echo=False, prompt_param="messages",
                     budget_param=name, images=None if images is None else [images])
        head = self._head("chatcmpl", "chat.completion")
        if plan.stream:
            return self._chat_stream(plan, {**head, "object": "chat.completion.chunk"})
        choices, _ = self._run(plan)
        out = [{"index": ch.index, "message": {"role": "assistant", "content": ch.text},
                "logprobs": None if ch.scores is None else self._chat_logprobs(ch.ids, ch.scores, plan.logprobs),
                "finish_reason": ch.finish_reason} for ch in choices]
        return {**head, "choices": out, "usage": self._usage(plan, [len(c.ids) for c in choices])}

    def _chat_stream(self, plan: Plan, head: dict):
        jobs, events = self.service.submit(plan)

        def chunk(index, delta, lp, finish):
            return {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        complete = False
        try:
            for i in range(len(jobs)):
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            for kind, index, delta, ids, scores, finish in self._stream_events(plan, jobs, events):
                if kind == "usage":
                    if plan.include_usage:
                        yield {**head, "choices": [], "usage": self._usage(plan, ids)}
                    continue
                lp = self._chat_logprobs(ids, scores, plan.logprobs) if scores is not None and ids else None
                if delta or finish or lp:
                    yield chunk(index, {"content": delta} if delta else {}, lp, finish)
            complete = True
        except RuntimeError as e:
            yield {**head, "error": {"message": f"generation failed: {e}", "type": "server_error"}}
        finally:
            _cancel_unless(complete, jobs)

    # ------------------------------------------------------------ tokenizer

    def tokenize(self, body: dict) -> dict:
        _fields(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"},
                "POST /tokenize")
        add_special = field(body, "add_special_tokens", bool, True)
        if ("prompt" in body) == ("messages" in body):
            raise RequestError("give 'prompt' (a string) or 'messages' (chat messages), one of them.", "prompt")
        if "messages" in body:
            tokens = self.chat_prompt(body["messages"])
        else:
            if not isinstance(body["prompt"], str):
                raise RequestError("'prompt' must be a string.", "prompt")
            tokens = self.tokenizer.encode(body["prompt"])
            bos = getattr(self.tokenizer, "bos_id", None)
            if add_special and bos is not None:
                tokens = [bos] + tokens
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.service.generator.context}

    def detokenize(self, body: dict) -> dict:
        _fields(body, {"model", "tokens"}, "POST /detokenize")
        tokens = body.get("tokens")
        vocab = self.service.generator.model.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise RequestError(f"'tokens' must be a list of token ids in [0, {vocab}).", "tokens")
        return {"prompt": self.tokenizer.decode(tokens)}

    def tokenizer_info(self) -> dict:
        return {"tokenizer_class": type(self.tokenizer).__name__,
                "eos_token": special_token(self.tokenizer, "eos_token") or None,
                "bos_token": special_token(self.tokenizer, "bos_token") or None, "pad_token": None,
                "chat_template": self.service.chat_template, "model_max_length": self.service.generator.context}
