"""`megajax serve`: text generation over HTTP, for OpenAI-style clients and Megatron's tools.

    POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
    GET /tokenizer_info    OpenAI's dialect (megajax/inference/openai_api.py)
    PUT  /api              Megatron's text generation server: prompts, tokens_to_generate,
                           temperature, top_k, top_p, random_seed, add_BOS -> {"text": [...], "segments"}
    GET  /health           {"status": "ok", ...};  GET /v1/models: the one model

Built on the standard library's ThreadingHTTPServer (a thread per connection; server-sent
events are plain chunks on a kept-open response), so it runs wherever megajax does; the work is
in one batcher thread that decodes concurrent requests together: the continuous engine
(megajax/inference/engine.py, the default: sequences join and leave the running batch at every step,
over a paged KV cache) or the static Batcher (megajax/inference/batcher.py, `--batching static`).
A malformed request gets an HTTP 4xx with OpenAI's error object {"error": {"message", "type",
"param", "code"}} and the server keeps serving; so does a request whose prompt plus new tokens
exceeds the context (the message names the limit). Every answer, errors included, reads the
request's whole body first, so a kept-alive connection's next request parses.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megajax.errors import UserError
from megajax.inference.batcher import Batcher, Job
from megajax.inference.chat import find_chat_template
from megajax.inference.engine import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_CHUNK, Engine
from megajax.inference.generate import ContextLengthError
from megajax.inference.openai_api import OpenAIDialect
from megajax.inference.request import MEGATRON_FIELDS, RequestError, checked, field, random_seed
from megajax.inference.sampling import Sampling
from megajax.inference.text import first_stop

MAX_BODY_BYTES = 16 * 2**20
MAX_DRAIN_BYTES = 64 * 2**20  # a refused body up to this size is read and dropped; a larger one closes the connection
MAX_SEQUENCES = 256  # prompts x n in one request


class CompletionService:
    """Request parsing and answers, independent of HTTP (the handler below only moves bytes)."""

    def __init__(self, loaded, max_batch: int = 8, chunk: int = 16, chat_template: str | None = None,
                 batching: str = "continuous", block_size: int = DEFAULT_BLOCK_SIZE, num_kv_blocks: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, quiet: bool = True):
        self.loaded = loaded
        self.generator, self.tokenizer = loaded.generator, loaded.tokenizer
        if batching == "continuous":
            self.batcher = Engine(self.generator, max_batch, block_size=block_size, num_blocks=num_kv_blocks,
                                  prefill_chunk=prefill_chunk, quiet=quiet)
        elif batching == "static":
            self.batcher = Batcher(self.generator, max_batch=max_batch, chunk=chunk)
        else:
            raise UserError(f"--batching {batching!r}: must be continuous or static.")
        self.model_name = loaded.name or "megajax"
        self.max_batch = max_batch
        # The chat template: --chat-template's, else the tokenizer's own (None: chat is refused).
        self.chat_template = chat_template or find_chat_template(self.tokenizer)
        self.openai = OpenAIDialect(self)

    def close(self) -> None:
        self.batcher.close()

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
                      sequences: int) -> None:
        """RequestError for too many sequences, an empty prompt or one that does not fit the context with
        `max_new` new tokens (naming the prompt's field, or the budget's when fewer new tokens would fit)."""
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
        self.batcher.submit(jobs)
        return jobs, events

    def _jobs(self, prompts: list[list[int]], samplings: list[Sampling], max_new: int, stream: bool,
              param: str) -> tuple[list[Job], queue.Queue]:
        self.check_prompts(prompts, max_new, "prompts", param, len(samplings))
        events: queue.Queue = queue.Queue()
        jobs = [Job(ids, s, max_new, i, events, stream) for i, (ids, s) in enumerate(zip(prompts, samplings))]
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
    # path -> {method: name of the handler method}
    ROUTES = {"/health": {"GET": "_health"}, "/v1/models": {"GET": "_models"},
              "/v1/completions": {"POST": "_completions"}, "/v1/chat/completions": {"POST": "_chat"},
              "/tokenize": {"POST": "_tokenize"}, "/detokenize": {"POST": "_detokenize"},
              "/tokenizer_info": {"GET": "_tokenizer_info"}, "/api": {"PUT": "_megatron"}}

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if not self.quiet:
            super().log_message(format, *args)

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
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                self.close_connection = True
                break
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
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(f"the body is not valid JSON ({e}).") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object.")
        return body

    # ------------------------------------------------------------ routing

    def _dispatch(self) -> None:
        self._start_body()
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
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
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug: the server keeps serving
            import traceback
            traceback.print_exc()
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch  # noqa: N815 (the base class's names)

    def do_HEAD(self) -> None:  # noqa: N802
        self._start_body()
        self._drain()
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _health(self) -> None:
        self._send_json(200, self.service.health())

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


class CompletionServer:
    """The HTTP server and its service; `start()` serves from a background thread (tests, notebooks)."""

    def __init__(self, loaded, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, chunk: int = 16,
                 quiet: bool = False, chat_template: str | None = None, **batching):
        """`batching`: CompletionService's batching, block_size, num_kv_blocks, prefill_chunk."""
        self.service = CompletionService(loaded, max_batch=max_batch, chunk=chunk, chat_template=chat_template,
                                         quiet=quiet, **batching)
        handler = type("Handler", (_Handler,), {"service": self.service, "quiet": quiet})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
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

    def close(self) -> None:
        if self._thread is not None:  # serving from start()'s thread: stop its loop (shutdown() would wait
            self.httpd.shutdown()     # forever for a loop that never ran, or that an interrupt already ended)
        self.httpd.server_close()
        self.service.close()


def serve(loaded, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          chat_template: str | None = None, **batching) -> None:
    """Serves until interrupted; `batching`: CompletionService's batching options."""
    try:
        server = CompletionServer(loaded, host=host, port=port, max_batch=max_batch, chat_template=chat_template,
                                  **batching)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host.") from None
    # The handlers go in before the address is printed: whoever reads it may signal at once.
    previous = _stop_on_signals()
    try:
        print(f"megajax serve: {loaded.path} on {loaded.mesh_text}, context {loaded.generator.context} tokens, "
              f"up to {max_batch} sequences per batch; listening on {server.url} (POST /v1/completions, "
              f"POST /v1/chat/completions{'' if server.service.chat_template else ' (no chat template)'}, PUT /api, "
              f"GET /health)", file=sys.stderr, flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_signals() -> dict:
    """Ctrl-C (SIGINT) and SIGTERM (a scheduler's or Kubernetes' stop) end `serve_forever` cleanly,
    also when the process was started with SIGINT ignored (as a shell's background job is). Returns
    the handlers replaced (none outside the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, frame):
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
