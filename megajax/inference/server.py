"""`megajax serve`: text generation over HTTP, for OpenAI-style clients and Megatron's tools.

    POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
    GET /tokenizer_info    OpenAI's dialect (megajax/inference/openai_api.py)
    PUT  /api              Megatron's text generation server: prompts, tokens_to_generate,
                           temperature, top_k, top_p, random_seed, add_BOS -> {"text": [...], "segments"}
    GET  /v1/models        the one model
    GET  /health           readiness: 200 {"status": "ok", ...} when the batcher is ready (compiled) and the
                           server is not draining; else 503 {"status": "compiling" | "draining", "message"}
    GET  /health/live      liveness: 200 whenever the process answers HTTP
    GET  /metrics          Prometheus metrics (megajax/inference/serve_metrics.py)

Built on the standard library's ThreadingHTTPServer (a thread per connection; server-sent
events are plain chunks on a kept-open response), so it runs wherever megajax does; the work is
in one batcher thread that decodes concurrent requests together: the continuous engine
(megajax/inference/engine.py, the default: sequences join and leave the running batch at every step,
over a paged KV cache) or the static Batcher (megajax/inference/batcher.py, `--batching static`).
A malformed request gets an HTTP 4xx with OpenAI's error object {"error": {"message", "type",
"param", "code"}} and the server keeps serving; so does a request whose prompt plus new tokens
exceeds the context (the message names the limit). Every answer, errors included, reads the
request's whole body first, so a kept-alive connection's next request parses.

Every request has an id: the client's X-Request-Id header, else one made here (a completion's
is its answer's `id`); it comes back in the X-Request-Id header, is set on the request's jobs,
and starts its log line on stderr (one per finished request: id, method, path, status, prompt and
new tokens, time to first token, total seconds, finish reasons; `client_gone: ...` when the client left
before its answer, which then is not sent). SIGTERM or Ctrl-C drains: new work
is refused with 503 and Retry-After, /health answers 503, the requests in progress finish (up to a
drain timeout), then the server closes; a second signal closes at once.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from megajax.errors import UserError
from megajax.inference.batcher import Batcher, Job
from megajax.data.chat import trained_chat_template
from megajax.data.text_files import lone_surrogate, parse_json
from megajax.inference.chat import (ChatTemplateError, chat_template_source_of, check_chat_template,
                                   special_token)
from megajax.inference.engine import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_CHUNK, Engine
from megajax.inference.generate import ContextLengthError
from megajax.inference.openai_api import OpenAIDialect
from megajax.inference.request import MEGATRON_FIELDS, RequestError, checked, field, random_seed
from megajax.inference.sampling import Sampling
from megajax.inference.serve_metrics import ServeMetrics, Tally, request_line
from megajax.inference.text import first_stop

MAX_BODY_BYTES = 16 * 2**20
MAX_DRAIN_BYTES = 64 * 2**20  # a refused body up to this size is read and dropped; a larger one closes the connection
MAX_SEQUENCES = 256  # prompts x n in one request
DEFAULT_LIMIT_IMAGES = 4  # a chat prompt's images at most (--limit-images-per-prompt)
OPS_PATHS = ("/health", "/health/live", "/metrics")  # answered while draining; not logged or counted as errors
RETRY_AFTER_S = 1  # what a refused request's Retry-After says (another replica takes it meanwhile)
MAX_REQUEST_ID = 128
# The id prefix of each endpoint's answer (OpenAI's), and of the others' request ids.
ID_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}


_SAY = threading.Lock()


def _say(line: str) -> None:
    """One log line on stderr in one write (print writes the text and its newline apart, so the request
    threads' lines ran together)."""
    with _SAY:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class ClientGone(ConnectionError):
    """The client closed the connection in the middle of its request's body (the message says how far)."""


@dataclass(eq=False)
class RequestContext:
    """One HTTP request while it is answered: its id, its answer's id, its jobs and their tally (compared by
    identity)."""
    id: str
    response_id: str
    started: float  # time.monotonic()
    ops: bool  # a probe or a scrape
    logged: bool = True  # gets a log line (--disable-log-requests read when the request arrives)
    note: str = ""  # ends the log line: the client left before its answer
    tally: Tally = dataclasses.field(default_factory=Tally)
    jobs: list = dataclasses.field(default_factory=list)


class CompletionService:
    """Request parsing and answers, independent of HTTP (the handler below only moves bytes)."""

    def __init__(self, loaded, max_batch: int = 8, chunk: int = 16, chat_template: str | None = None,
                 batching: str = "continuous", block_size: int = DEFAULT_BLOCK_SIZE, num_kv_blocks: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefill_rows: int | None = None,
                 prefix_caching: bool = True, quiet: bool = True,
                 limit_images: int | None = None, allowed_local_media_path: str | None = None,
                 chat_template_source: str = ""):
        self.loaded = loaded
        if limit_images is not None and limit_images < 0:
            raise UserError(f"--limit-images-per-prompt {limit_images}: must be >= 0.")
        if loaded.generator.model.vision is None:  # a text model takes no images: its options would do nothing
            given = [o for o, v in (("--limit-images-per-prompt", limit_images),
                                    ("--allowed-local-media-path", allowed_local_media_path)) if v is not None]
            if given:
                raise UserError(f"{' and '.join(given)}: this model has no image encoder (model.vision is unset), "
                                f"so its requests hold no images; drop {'them' if len(given) > 1 else 'it'}, or "
                                f"serve a vision-language model.")
        # a chat prompt's images at most (a vision-language model)
        self.limit_images = DEFAULT_LIMIT_IMAGES if limit_images is None else limit_images
        # file:// image URLs are read under this directory (None: data URLs only)
        self.allowed_media = None
        if allowed_local_media_path is not None:
            root = Path(allowed_local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise UserError(f"--allowed-local-media-path {allowed_local_media_path!r}: not a directory; give "
                                f"the directory whose files chat requests may name as file:// image URLs.")
            self.allowed_media = root
        self.generator, self.tokenizer = loaded.generator, loaded.tokenizer
        # The chat template: --chat-template's, else the one the model speaks (its tokenizer's own, or the byte
        # tokenizer's of a run trained on chat data; None: chat is refused); checked now (compiled, and rendered
        # on a plain conversation), so a broken one stops the start-up instead of failing every chat request.
        try:
            self.chat_template = chat_template or trained_chat_template(self.tokenizer, loaded.cfg.data.format)
            self.chat_template_source = chat_template_source or (
                "--chat-template" if chat_template else
                f"the tokenizer's: {chat_template_source_of(self.tokenizer) or 'the chat fine-tuning template'}")
            if self.chat_template is not None:
                check_chat_template(self.chat_template, self.chat_template_source,
                                    bos_token=special_token(self.tokenizer, "bos_token"),
                                    eos_token=special_token(self.tokenizer, "eos_token"))
        except ChatTemplateError as e:
            raise UserError(f"{e}; pass --chat-template FILE with a working Jinja chat template.") from None
        self.metrics = ServeMetrics()
        if batching == "continuous":
            self.batcher = Engine(self.generator, max_batch, block_size=block_size, num_blocks=num_kv_blocks,
                                  prefill_chunk=prefill_chunk, prefill_rows=prefill_rows,
                                  prefix_caching=prefix_caching, observer=self.metrics,
                                  quiet=quiet)
        elif batching == "static":
            self.batcher = Batcher(self.generator, max_batch=max_batch, chunk=chunk, observer=self.metrics)
        else:
            raise UserError(f"--batching {batching!r}: must be continuous or static.")
        self.metrics.bind(self.batcher.stats)
        self.draining = False
        self._local = threading.local()  # .request: the RequestContext the handler thread answers
        self._lock = threading.Lock()
        self._active: list[RequestContext] = []  # requests in progress (not probes or scrapes)
        self.model_name = loaded.name or "megajax"
        self.max_batch = max_batch
        self.openai = OpenAIDialect(self)

    def close(self, wait: bool = True) -> None:
        """Stops the batcher after the jobs submitted; without `wait`, leaves them and its thread to the
        process's exit (requests cut by a drain)."""
        if wait:
            self.batcher.close()

    # -------------------------------------------------------------- operations

    def readiness(self) -> str | None:
        """None when ready for work; else why not ("draining", or "compiling" while the batcher is not ready)."""
        if self.draining:
            return "draining"
        if not getattr(self.batcher, "ready", True):
            return "compiling"
        return None

    def enter(self, request: RequestContext) -> bool:
        """Counts `request` in progress; False (refuse it) once draining."""
        with self._lock:
            if self.draining:
                return False
            self._active.append(request)
            return True

    def leave(self, request: RequestContext) -> None:
        with self._lock:
            if request in self._active:
                self._active.remove(request)

    def start_draining(self) -> list[RequestContext]:
        """Refuses new work from now on; returns the requests in progress."""
        with self._lock:
            self.draining = True
            return list(self._active)

    def in_progress(self) -> list[RequestContext]:
        with self._lock:
            return list(self._active)

    def current(self) -> RequestContext | None:
        return getattr(self._local, "request", None)

    def response_id(self, prefix: str) -> str:
        """The id of an answer made on this thread: its request's (when made for it), else a new one."""
        request = self.current()
        if request is not None and request.response_id.startswith(prefix + "-"):
            return request.response_id
        return new_id(prefix)

    def _track(self, jobs: list[Job]) -> None:
        """Gives `jobs` the current request's id and tallies them for its log line."""
        request = self.current()
        if request is None:
            return
        for job in jobs:
            job.request_id = request.id
        request.jobs.extend(jobs)
        self.metrics.watch(jobs, request.tally)

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "context_length": self.generator.context,
                "max_batch": self.max_batch, "mesh": self.loaded.mesh_text, "batches": self.batcher.batches,
                "sequences": self.batcher.sequences}

    # -------------------------------------------------------------- requests

    def encode_prompts(self, prompts: Any, name: str, add_bos: bool = False) -> list[list[int]]:
        """Strings, or (OpenAI) token id lists, as token id lists."""
        single_ids = isinstance(prompts, list) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        if isinstance(prompts, str) or single_ids:
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise RequestError(f"'{name}' must be a string, a non-empty list of strings, a list of token ids "
                               f"or a list of token id lists.", name)
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids = self.tokenizer.encode(p)
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                vocab = self.generator.model.vocab_size
                if any(not 0 <= t < vocab for t in p):
                    raise RequestError(f"'{name}'[{i}] holds token ids outside [0, {vocab}).", name)
                ids = list(p)
            else:
                raise RequestError(f"'{name}'[{i}] must be a string (or a list of token ids).", name)
            if add_bos:
                bos = getattr(self.tokenizer, "bos_id", None)
                bos = bos if bos is not None else self.tokenizer.eod_id
                ids = ([bos] if bos is not None else []) + ids
            out.append(ids)
        return out

    def check_prompts(self, prompts: list[list[int]], max_new: int, prompt_param: str, budget_param: str,
                      sequences: int, images: list | None = None) -> None:
        """RequestError for too many sequences, an empty prompt or one that does not fit the context with
        `max_new` new tokens (naming the prompt's field, or the budget's when fewer new tokens would fit),
        or image placeholders that are not its `images`' (per prompt; a vision-language model's)."""
        if sequences > MAX_SEQUENCES:
            times_n = sequences != len(prompts)
            raise RequestError(f"{sequences} sequences{' (prompts x n)' * times_n} in one request; at most "
                               f"{MAX_SEQUENCES}.", "n" if times_n else prompt_param)
        try:
            self.generator.check(prompts, [max_new] * len(prompts))
        except ContextLengthError as e:
            fits = max(len(p) for p in prompts) < self.generator.context
            raise RequestError(str(e), budget_param if fits else prompt_param,
                               code="context_length_exceeded") from None
        except UserError as e:
            raise RequestError(str(e), prompt_param) from None
        if self.generator.model.vision is not None:
            try:
                self.generator.check_images(prompts, images or [None] * len(prompts))
            except UserError as e:
                raise RequestError(str(e), prompt_param) from None
        fits = getattr(self.batcher, "fits", None)  # the continuous engine's KV pool
        longest = max(len(p) for p in prompts)
        if fits is not None and not fits(longest, max_new):
            e = self.batcher
            raise RequestError(
                f"a prompt of {longest} tokens plus {max_new} new tokens needs "
                f"{e.pool.blocks_for(longest + max_new)} KV blocks of {e.block_size} positions, but the server's "
                f"pool holds {e.num_blocks} (--num-kv-blocks); shorten the prompt or ask for fewer new tokens.",
                budget_param, code="context_length_exceeded")

    def submit(self, plan) -> tuple[list[Job], queue.Queue]:
        """An OpenAI request plan's jobs (megajax.inference.openai_api.Plan), queued on the batcher (with
        stop sequences, each one's stop test)."""
        events: queue.Queue = queue.Queue()
        jobs = plan.jobs(events)
        if plan.stops:
            for job in jobs:
                job.stopped = lambda ids: first_stop(self.tokenizer.decode(ids), plan.stops) is not None
        self._track(jobs)
        self.batcher.submit(jobs)
        return jobs, events

    def _jobs(self, prompts: list[list[int]], samplings: list[Sampling], max_new: int, stream: bool,
              param: str) -> tuple[list[Job], queue.Queue]:
        self.check_prompts(prompts, max_new, "prompts", param, len(samplings))
        events: queue.Queue = queue.Queue()
        jobs = [Job(ids, s, max_new, i, events, stream) for i, (ids, s) in enumerate(zip(prompts, samplings))]
        self._track(jobs)
        self.batcher.submit(jobs)
        return jobs, events

    @staticmethod
    def wait(jobs: list[Job], events: queue.Queue) -> list:
        results: list = [None] * len(jobs)
        try:
            while any(r is None for r in results):
                kind, index, payload = events.get()
                if kind == "error":
                    raise RequestError(f"generation failed: {payload}", status=500)
                if kind == "done":
                    results[index] = payload
        finally:  # left early (an error, the caller gone): the other sequences are dropped at the next step
            if any(r is None for r in results):
                for job in jobs:
                    job.cancelled = True
        return results

    def megatron(self, body: dict) -> dict:
        prompts_raw = body.get("prompts")
        if not isinstance(prompts_raw, list) or not prompts_raw or not all(isinstance(p, str) for p in prompts_raw):
            raise RequestError("'prompts' must be a non-empty list of strings.", "prompts")
        if field(body, "logprobs", bool, False):
            raise RequestError("'logprobs' = true is not supported by this server.", "logprobs")
        if body.get("beam_width") is not None:
            raise RequestError("'beam_width' (beam search) is not supported by this server.", "beam_width")
        add_bos = field(body, "add_BOS", bool, False)
        prompts = self.encode_prompts(prompts_raw, "prompts", add_bos=add_bos)
        max_new = field(body, "tokens_to_generate", int, 64, check=lambda v: v >= 1, accept="an integer >= 1")
        temperature = field(body, "temperature", float, 1.0, accept="a number")
        top_k = field(body, "top_k", int, 0, accept="an integer")
        top_p = field(body, "top_p", float, 0.0, accept="a number")
        seed = field(body, "random_seed", int, -1, accept="an integer (-1: random)")
        # Megatron's dialect: top_p 0 is off (1), random_seed -1 a random seed.
        base = checked(Sampling(temperature, top_k, 1.0 if top_p == 0 else top_p,
                                 random_seed() if seed == -1 else seed), MEGATRON_FIELDS)
        samplings = [dataclasses.replace(base, seed=(base.seed + i) % 2**63) for i in range(len(prompts))]
        jobs, events = self._jobs(prompts, samplings, max_new, False, "tokens_to_generate")
        done = self.wait(jobs, events)
        texts, segments = [], []
        for ids, c in zip(prompts, done):
            new = c.completion_ids[:-1] if c.finish_reason == "stop" else c.completion_ids
            texts.append(self.tokenizer.decode(ids + new))
            segments.append([self.tokenizer.decode([t]) for t in ids + new])
        return {"text": texts, "segments": segments, "logprobs": None}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "megajax"
    service: CompletionService  # set on the subclass the server makes
    quiet = False
    log_requests = True  # one line per finished request on stderr (not for probes and scrapes)
    _request: RequestContext | None = None
    _status = 0
    # path -> {method: name of the handler method}
    ROUTES = {"/health": {"GET": "_health"}, "/health/live": {"GET": "_live"}, "/metrics": {"GET": "_metrics"},
              "/v1/models": {"GET": "_models"},
              "/v1/completions": {"POST": "_completions"}, "/v1/chat/completions": {"POST": "_chat"},
              "/tokenize": {"POST": "_tokenize"}, "/detokenize": {"POST": "_detokenize"},
              "/tokenizer_info": {"GET": "_tokenizer_info"}, "/api": {"PUT": "_megatron"}}

    def handle(self) -> None:
        """The connection's requests, one after another; a client that resets a kept-alive connection while
        no request of it is open ends it quietly (a request in progress is logged by _dispatch)."""
        try:
            super().handle()
        except ConnectionError:
            self.close_connection = True

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if not self.quiet:
            super().log_message(format, *args)

    def log_request(self, code="-", size="-"):
        """Nothing: the request log's line (_finish) replaces the standard library's access line."""

    def send_response(self, code, message=None):
        """The status line, then the request's id (X-Request-Id); an error status is counted."""
        super().send_response(code, message)
        self._status = int(code)
        request = self._request
        if request is not None:
            self.send_header("X-Request-Id", request.id)
        if request is None or not request.ops:
            self.service.metrics.http_status(int(code))

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict | None = None) -> None:
        self._drain()
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers)

    def send_error(self, code, message=None, explain=None):
        """The base class's own errors (a malformed request line or headers, an unknown method) in OpenAI's
        JSON shape; the connection closes, as its state is unknown."""
        self.close_connection = True
        if not hasattr(self, "_unread"):
            self._unread = 0
        text = message or HTTPStatus(code).phrase
        try:
            self._error(code, f"{text} ({explain})" if explain and explain != text else text)
        except OSError:
            pass

    # ------------------------------------------------------------ bodies

    def _start_body(self) -> None:
        """Notes how much body the request has (read by _body, or dropped by _drain)."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            self._unread, self.close_connection = 0, True  # a body we do not read: nothing else can follow
        elif length is not None and length.strip().isdigit():
            self._unread = int(length)
        else:
            self._unread = 0
            self.close_connection = length is not None  # a malformed length: the stream's position is lost

    def _drain(self) -> None:
        """Reads and drops the body not read yet, so that the connection's next request parses (a body over
        MAX_DRAIN_BYTES closes the connection instead)."""
        left = getattr(self, "_unread", 0)
        if left > MAX_DRAIN_BYTES:
            self.close_connection = True
            self._unread = 0
            return
        total = left
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                self.close_connection = True
                self._unread = 0
                raise ClientGone(f"client_gone: sent {total - left} of {total} body bytes")
            left -= len(chunk)
        self._unread = 0

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise RequestError("the request needs a JSON body with a Content-Length header.",
                               status=HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body has {length} bytes; at most {MAX_BODY_BYTES}.",
                               status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        kind = self.headers.get("Content-Type")
        if kind is not None and kind.split(";")[0].strip().lower() != "application/json":
            raise RequestError(f"Content-Type {kind!r} is not supported; send the body as JSON with "
                               f"Content-Type: application/json.", code="unsupported_content_type")
        raw = self.rfile.read(int(length))
        self._unread = 0
        if len(raw) < int(length):
            raise ClientGone(f"client_gone: sent {len(raw)} of {length} body bytes")
        try:
            body = parse_json(raw)
        except ValueError as e:
            raise RequestError(f"the body is not valid JSON ({e}).") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object.")
        found = lone_surrogate(body) if b"\\u" in raw or b"\\U" in raw else None
        if found:  # "\ud800": valid JSON, but no character: no tokenizer can encode it
            raise RequestError(f"the body holds the JSON escape {found}, half of a UTF-16 surrogate pair without "
                               f"its other half: not a character, and not encodable as UTF-8; send the whole pair "
                               f"(e.g. \\ud83d\\ude00) or the character itself.")
        return body

    # ------------------------------------------------------------ routing

    def _dispatch(self) -> None:
        self._start_body()
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        given = self.headers.get("X-Request-Id")
        answer_id = new_id(ID_PREFIXES.get(path, "req"))
        request = self._request = RequestContext(given or answer_id, answer_id, time.monotonic(), path in OPS_PATHS,
                                                     logged=self.log_requests)
        self._status = 0
        self.service._local.request = request
        entered = False
        try:
            if given is not None and not (0 < len(given) <= MAX_REQUEST_ID and given.isascii() and given.isprintable()
                                          and " " not in given):
                request.id = answer_id
                self._error(HTTPStatus.BAD_REQUEST, f"X-Request-Id {given[:MAX_REQUEST_ID]!r}: a request id is 1 to "
                            f"{MAX_REQUEST_ID} visible ASCII characters (no spaces); leave the header out to get "
                            f"one made here.", code="invalid_request_id")
            elif request.ops:
                self._route(path)
            elif not (entered := self.service.enter(request)):
                self.close_connection = True
                self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down and takes no new requests; "
                            "retry (another replica, or this one once restarted).", code="server_shutting_down",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
            else:
                self._route(path)
        except ConnectionError as e:  # the client left: one log line, no answer (nobody is there to read it)
            self.close_connection = True
            request.note = str(e) if isinstance(e, ClientGone) else f"client_gone: {type(e).__name__}"
        finally:
            self._finish(request, path)  # before leaving: a drain waits for the log line too
            if entered:
                self.service.leave(request)
                if self.service.draining:
                    self.close_connection = True

    def _finish(self, request: RequestContext, path: str) -> None:
        """Ends the request's tally and duration, and writes its log line."""
        self._request = None
        self.service._local.request = None
        seconds = time.monotonic() - request.started
        metrics = self.service.metrics
        metrics.release(request.jobs)
        if request.jobs and self._status == 200:
            metrics.request_done(seconds)
        if request.logged and not request.ops:
            line = request_line(request.id, self.command, path, self._status, request.tally if request.jobs else None,
                                seconds) + (f" {request.note}" if request.note else "")
            _say(line)

    def _route(self, path: str) -> None:
        methods = self.ROUTES.get(path)
        if methods is None:
            self._error(HTTPStatus.NOT_FOUND, f"no endpoint {path}; the endpoints are "
                        + ", ".join(f"{m} {p}" for p, ms in self.ROUTES.items() for m in ms) + ".", code="not_found")
            return
        if self.command not in methods:
            allowed = ", ".join(methods)
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not allowed on {path}; use {allowed}.",
                        code="method_not_allowed", headers={"Allow": allowed})
            return
        try:
            getattr(self, methods[self.command])()
            self._drain()  # a body the endpoint did not read (GET /health with one)
        except RequestError as e:
            self._error(e.status, str(e), e.param, e.code)
        except ConnectionError:
            raise  # the client left: _dispatch logs it
        except Exception as e:  # a bug: the server keeps serving
            import traceback
            traceback.print_exc()
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch  # noqa: N815 (the base class's names)

    def do_HEAD(self) -> None:  # noqa: N802
        self._start_body()
        try:
            self._drain()
            self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
            self.send_header("Content-Length", "0")
            self.end_headers()
        except ConnectionError:
            self.close_connection = True

    def _health(self) -> None:
        why = self.service.readiness()
        if why is None:
            self._send_json(200, self.service.health())
            return
        message = ("the server is shutting down (draining the requests in progress)" if why == "draining" else
                   "the batcher is compiling the shapes it will run; ready when that is done")
        self._send_json(HTTPStatus.SERVICE_UNAVAILABLE, {"status": why, "message": message})

    def _live(self) -> None:
        self._send_json(200, {"status": "alive"})

    def _metrics(self) -> None:
        try:
            data, kind = self.service.metrics.exposition()
        except RuntimeError as e:
            self._error(HTTPStatus.NOT_IMPLEMENTED, str(e), code="metrics_unavailable")
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _models(self) -> None:
        s = self.service
        model = {"id": s.model_name, "object": "model", "created": 0, "owned_by": "megajax",
                 "max_model_len": s.generator.context}
        self._send_json(200, {"object": "list", "data": [model]})

    def _megatron(self) -> None:
        self._send_json(200, self.service.megatron(self._body()))

    def _tokenize(self) -> None:
        self._send_json(200, self.service.openai.tokenize(self._body()))

    def _detokenize(self) -> None:
        self._send_json(200, self.service.openai.detokenize(self._body()))

    def _tokenizer_info(self) -> None:
        self._send_json(200, self.service.openai.tokenizer_info())

    def _completions(self) -> None:
        self._answer(self.service.openai.completions(self._body()))

    def _chat(self) -> None:
        self._answer(self.service.openai.chat(self._body()))

    def _answer(self, answer) -> None:
        """A dict as JSON, or a generator's events as server-sent events (then `data: [DONE]`)."""
        if isinstance(answer, dict):
            self._send_json(200, answer)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for event in answer:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:  # the client gone (BrokenPipe, ConnectionReset): the stream's jobs are cancelled now
            answer.close()


class _HTTPServer(ThreadingHTTPServer):
    # The standard library listens with a backlog of 5: more clients connecting at once than that
    # have their connection attempts dropped by the kernel and retried a second later (a 1 s time to
    # first token for the 6th of 16 simultaneous clients).
    request_queue_size = 128


class CompletionServer:
    """The HTTP server and its service; `start()` serves from a background thread (tests, notebooks)."""

    def __init__(self, loaded, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, chunk: int = 16,
                 quiet: bool = False, chat_template: str | None = None, log_requests: bool = True, **batching):
        """`batching`: CompletionService's batching, block_size, num_kv_blocks, prefill_chunk, prefill_rows,
        prefix_caching, limit_images, allowed_local_media_path.
        The address is bound first (OSError: taken, or not this machine's), then the service starts its
        batcher (UserError: a chat template or KV pool it cannot use)."""
        handler = type("Handler", (_Handler,), {"quiet": quiet, "log_requests": log_requests and not quiet})
        self.httpd = _HTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        try:
            self.service = handler.service = CompletionService(loaded, max_batch=max_batch, chunk=chunk,
                                                               chat_template=chat_template, quiet=quiet, **batching)
        except BaseException:
            self.httpd.server_close()
            raise
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "CompletionServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="megajax-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self, wait: bool = True) -> None:
        """Stops serving; without `wait`, a batch still running is not waited for (the process is ending)."""
        if self._thread is not None:  # serving from start()'s thread: stop its loop (shutdown() would wait
            self.httpd.shutdown()     # forever for a loop that never ran, or that an interrupt already ended)
        self.httpd.server_close()
        self.service.close(wait=wait)

    def drain(self, timeout: float, why: str = "") -> list[RequestContext]:
        """Refuses new work and waits up to `timeout` seconds for the requests in progress to finish (a
        KeyboardInterrupt ends the wait); says on stderr what it waits for and how it went. Returns the
        requests still in progress (cut): their jobs are marked cancelled."""
        running = self.service.start_draining()
        _say(f"megajax serve: {why + ': ' if why else ''}draining: {len(running)} request"
              f"{'s' * (len(running) != 1)} in progress{''.join(' ' + r.id for r in running[:8])}"
              f"{' ...' * (len(running) > 8)}; new ones get 503; waiting up to {timeout:g} s (--drain-timeout; a "
              f"second SIGTERM or Ctrl-C stops at once)")
        started = time.monotonic()
        left, how = running, "drained"
        try:
            while left and time.monotonic() - started < timeout:
                time.sleep(0.05)
                left = self.service.in_progress()
        except KeyboardInterrupt:
            how = "stopped by a second signal"
            raise
        finally:
            left = self.service.in_progress()
            for request in left:
                for job in request.jobs:
                    job.cancelled = True
            _say(f"megajax serve: {how} after {time.monotonic() - started:.1f} s: {len(running) - len(left)} "
                  f"finished, {len(left)} cut{''.join(' ' + r.id for r in left[:8])}{' ...' * (len(left) > 8)}")
        return left


def serve(loaded, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          chat_template: str | None = None, drain_timeout: float = 30.0, log_requests: bool = True,
          **batching) -> None:
    """Serves until SIGTERM or Ctrl-C, then drains (up to `drain_timeout` seconds) and closes; `batching`:
    CompletionService's batching options."""
    try:
        server = CompletionServer(loaded, host=host, port=port, max_batch=max_batch, chat_template=chat_template,
                                  log_requests=log_requests, **batching)
    except (OSError, OverflowError) as e:
        raise UserError(f"cannot listen on {host}:{port} ({getattr(e, 'strerror', None) or e}); choose another "
                        f"--port or --host.") from None
    # The handlers go in before the address is printed: whoever reads it may signal at once.
    stopping = threading.Event()
    previous = _stop_on_signals(server.service, stopping)
    cut: list = []
    try:
        _say(f"megajax serve: {loaded.path} on {loaded.mesh_text}, context {loaded.generator.context} tokens, "
              f"up to {max_batch} sequences per batch; listening on {server.url} (POST /v1/completions, "
              f"POST /v1/chat/completions{'' if server.service.chat_template else ' (no chat template)'}, PUT /api, "
              f"GET /health, GET /health/live, GET /metrics)")
        if not previous:  # not the main thread: no signals here, serve until interrupted
            server.serve_forever()
        else:
            server.start()
            while not stopping.wait(1.0):
                failed = getattr(server.service.batcher, "error", None)
                if failed is not None:  # nothing could ever be answered: stop, saying why
                    raise UserError(f"the server's engine did not start ({failed}); nothing can be served. If it ran "
                                    f"out of memory, lower --max-batch or --num-kv-blocks.")
            cut = server.drain(drain_timeout, stopping.why)
    except KeyboardInterrupt:  # the second signal (drain() said so), or an interrupt without our handlers
        cut = server.service.in_progress()
        if cut and not stopping.is_set():
            _say(f"megajax serve: stopping at once: {len(cut)} request{'s' * (len(cut) != 1)} cut")
    finally:
        server.close(wait=not cut)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_signals(service: CompletionService, stopping: threading.Event) -> dict:
    """The first Ctrl-C (SIGINT) or SIGTERM (a scheduler's or Kubernetes' stop) starts draining: `service`
    refuses new work at once and `stopping` is set (its `why` names the signal); a second one raises
    KeyboardInterrupt (stop at once). Also when the process was started with SIGINT ignored (as a shell's
    background job is). Returns the handlers replaced (none outside the main thread, where signals cannot be
    handled)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    stopping.why = ""

    def stop(signum, frame):
        if stopping.is_set():
            raise KeyboardInterrupt
        service.start_draining()
        stopping.why = signal.Signals(signum).name
        stopping.set()

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
