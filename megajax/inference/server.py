"""`megajax serve`: text generation over HTTP, for OpenAI-style clients and Megatron's tools.

    POST /v1/completions   OpenAI completions: prompt (string, list of strings, token ids),
                           max_tokens, temperature, top_p, top_k, n, seed, stream (server-sent events)
    PUT  /api              Megatron's text generation server: prompts, tokens_to_generate,
                           temperature, top_k, top_p, random_seed, add_BOS -> {"text": [...], "segments"}
    GET  /health           {"status": "ok", ...};  GET /v1/models: the one model

Built on the standard library's ThreadingHTTPServer (a thread per connection; server-sent
events are plain chunks on a kept-open response), so it runs wherever megajax does; the work is
in one Batcher thread (megajax/inference/batcher.py) that decodes concurrent requests together.
A malformed request gets HTTP 400 with {"error": {"message", "type", "param"}} and the server
keeps serving; so does a request whose prompt plus new tokens exceeds the context (the message
names the limit).
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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megajax.errors import UserError
from megajax.inference.batcher import Batcher, Job
from megajax.inference.sampling import Sampling, SamplingError
from megajax.inference.text import IncrementalText, completion_text

MAX_BODY_BYTES = 16 * 2**20
MAX_SEQUENCES = 256  # prompts x n in one request


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


_MISSING = object()


def _get(body: dict, name: str, kind, default=_MISSING, *, check=None, accept: str = ""):
    """body[name] as `kind` (int, float, bool, or a tuple of types), default when absent or null;
    RequestError naming the field otherwise."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise RequestError(f"'{name}' is required.", name)
        return default
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool)}[kind](value)
    if not ok or (check is not None and not check(value)):
        raise RequestError(f"'{name}' = {json.dumps(value)[:80]}: expected {accept or kind.__name__}.", name)
    return float(value) if kind is float else value


def _random_seed() -> int:
    return secrets.randbits(63)


# Each dialect's request field of a Sampling setting (the ranges are megajax.inference.sampling.RANGES).
OPENAI_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed"}
MEGATRON_FIELDS = {**OPENAI_FIELDS, "seed": "random_seed"}


def _checked(sampling: Sampling, fields: dict[str, str]) -> Sampling:
    """The sampling settings, or a RequestError naming the request field, its value and the range."""
    try:
        return sampling.check({k: f"'{name}'" for k, name in fields.items()})
    except SamplingError as e:
        raise RequestError(str(e), fields[e.field]) from None


class CompletionService:
    """Request parsing and answers, independent of HTTP (the handler below only moves bytes)."""

    def __init__(self, loaded, max_batch: int = 8, chunk: int = 16):
        self.loaded = loaded
        self.generator, self.tokenizer = loaded.generator, loaded.tokenizer
        self.batcher = Batcher(self.generator, max_batch=max_batch, chunk=chunk)
        self.model_name = loaded.name or "megajax"
        self.max_batch = max_batch

    def close(self) -> None:
        self.batcher.close()

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "context_length": self.generator.context,
                "max_batch": self.max_batch, "mesh": self.loaded.mesh_text, "batches": self.batcher.batches,
                "sequences": self.batcher.sequences}

    # -------------------------------------------------------------- requests

    def _encode_prompts(self, prompts: Any, name: str, add_bos: bool = False) -> list[list[int]]:
        """Strings, or (OpenAI) token id lists, as token id lists."""
        single_ids = isinstance(prompts, list) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        if isinstance(prompts, str) or single_ids:
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise RequestError(f"'{name}' must be a string or a non-empty list of strings.", name)
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

    def _jobs(self, prompts: list[list[int]], samplings: list[Sampling], max_new: int, stream: bool,
              param: str) -> tuple[list[Job], queue.Queue]:
        if len(samplings) > MAX_SEQUENCES:
            raise RequestError(f"{len(samplings)} sequences in one request; at most {MAX_SEQUENCES}.", param)
        try:
            self.generator.check(prompts, [max_new] * len(prompts))
        except UserError as e:
            raise RequestError(str(e), param) from None
        events: queue.Queue = queue.Queue()
        jobs = [Job(ids, s, max_new, i, events, stream) for i, (ids, s) in enumerate(zip(prompts, samplings))]
        self.batcher.submit(jobs)
        return jobs, events

    @staticmethod
    def _wait(jobs: list[Job], events: queue.Queue) -> list:
        results: list = [None] * len(jobs)
        while any(r is None for r in results):
            kind, index, payload = events.get()
            if kind == "error":
                raise RequestError(f"generation failed: {payload}", status=500)
            if kind == "done":
                results[index] = payload
        return results

    def openai(self, body: dict):
        """(answer dict) or, with stream, (a generator of event dicts); raises RequestError."""
        unsupported = {"echo": lambda v: v is True, "logprobs": lambda v: v is not None,
                       "suffix": lambda v: v is not None, "stop": lambda v: v not in (None, [], ""),
                       "best_of": lambda v: v not in (None, 1), "logit_bias": lambda v: v not in (None, {}),
                       "presence_penalty": lambda v: v not in (None, 0, 0.0),
                       "frequency_penalty": lambda v: v not in (None, 0, 0.0)}
        for key, used in unsupported.items():
            if used(body.get(key)):
                raise RequestError(f"'{key}' = {json.dumps(body[key])[:80]} is not supported by this server.", key)
        prompts = self._encode_prompts(body.get("prompt"), "prompt")
        max_new = _get(body, "max_tokens", int, 16, check=lambda v: v >= 1, accept="an integer >= 1")
        temperature = _get(body, "temperature", float, 1.0, accept="a number")
        top_p = _get(body, "top_p", float, 1.0, accept="a number")
        top_k = _get(body, "top_k", int, 0, accept="an integer")
        n = _get(body, "n", int, 1, check=lambda v: v >= 1, accept="an integer >= 1")
        seed = _get(body, "seed", int, None, accept="an integer")
        stream = _get(body, "stream", bool, False)
        # OpenAI's dialect: top_k -1 is off too; no seed: a random one.
        base = _checked(Sampling(temperature, 0 if top_k == -1 else top_k, top_p,
                                 _random_seed() if seed is None else seed), OPENAI_FIELDS)
        samplings = [dataclasses.replace(base, seed=(base.seed + i) % 2**63) for i in range(len(prompts) * n)]
        expanded = [p for p in prompts for _ in range(n)]
        jobs, events = self._jobs(expanded, samplings, max_new, stream, "max_tokens")
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if stream:
            return self._openai_stream(head, jobs, events)
        done = self._wait(jobs, events)
        choices = [{"index": i, "text": completion_text(self.tokenizer, c), "logprobs": None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(done)]
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.completion_ids) for c in done)
        return {**head, "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                                      "completion_tokens": completion_tokens,
                                                      "total_tokens": prompt_tokens + completion_tokens}}

    def _openai_stream(self, head: dict, jobs: list[Job], events: queue.Queue):
        texts = [IncrementalText(self.tokenizer, self.generator.eod_id) for _ in jobs]
        left = len(jobs)
        while left:
            kind, index, payload = events.get()
            if kind == "error":
                yield {**head, "error": {"message": f"generation failed: {payload}", "type": "server_error"}}
                return
            if kind == "tokens":
                delta, finish = texts[index].add(payload), None
            else:
                delta, finish = texts[index].add([], final=True), payload.finish_reason
                left -= 1
            if delta or finish:
                yield {**head, "choices": [{"index": index, "text": delta, "logprobs": None,
                                            "finish_reason": finish}]}

    def megatron(self, body: dict) -> dict:
        prompts_raw = body.get("prompts")
        if not isinstance(prompts_raw, list) or not prompts_raw or not all(isinstance(p, str) for p in prompts_raw):
            raise RequestError("'prompts' must be a non-empty list of strings.", "prompts")
        if _get(body, "logprobs", bool, False):
            raise RequestError("'logprobs' = true is not supported by this server.", "logprobs")
        if body.get("beam_width") is not None:
            raise RequestError("'beam_width' (beam search) is not supported by this server.", "beam_width")
        add_bos = _get(body, "add_BOS", bool, False)
        prompts = self._encode_prompts(prompts_raw, "prompts", add_bos=add_bos)
        max_new = _get(body, "tokens_to_generate", int, 64, check=lambda v: v >= 1, accept="an integer >= 1")
        temperature = _get(body, "temperature", float, 1.0, accept="a number")
        top_k = _get(body, "top_k", int, 0, accept="an integer")
        top_p = _get(body, "top_p", float, 0.0, accept="a number")
        seed = _get(body, "random_seed", int, -1, accept="an integer (-1: random)")
        # Megatron's dialect: top_p 0 is off (1), random_seed -1 a random seed.
        base = _checked(Sampling(temperature, top_k, 1.0 if top_p == 0 else top_p,
                                 _random_seed() if seed == -1 else seed), MEGATRON_FIELDS)
        samplings = [dataclasses.replace(base, seed=(base.seed + i) % 2**63) for i in range(len(prompts))]
        jobs, events = self._jobs(prompts, samplings, max_new, False, "tokens_to_generate")
        done = self._wait(jobs, events)
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

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        if not self.quiet:
            super().log_message(format, *args)

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("the request needs a JSON body with a Content-Length header.",
                               status=HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body has {length} bytes; at most {MAX_BODY_BYTES}.",
                               status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RequestError(f"the body is not valid JSON ({e}).") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object.")
        return body

    def _dispatch(self, routes: dict) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        route = routes.get(path)
        if route is None:
            known = {"/health", "/v1/models", "/v1/completions", "/api"}
            if path in known:
                self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not allowed on {path}.")
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no endpoint {path}; try POST /v1/completions, PUT /api or "
                                                  f"GET /health.")
            return
        try:
            route()
        except RequestError as e:
            self._error(e.status, str(e), e.param)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug: the server keeps serving
            import traceback
            traceback.print_exc()
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        s = self.service
        models = {"object": "list", "data": [{"id": s.model_name, "object": "model", "owned_by": "megajax"}]}
        self._dispatch({"/health": lambda: self._send_json(200, s.health()),
                        "/v1/models": lambda: self._send_json(200, models)})

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch({"/v1/completions": self._completions})

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch({"/api": lambda: self._send_json(200, self.service.megatron(self._body()))})

    def _completions(self) -> None:
        answer = self.service.openai(self._body())
        if isinstance(answer, dict):
            self._send_json(200, answer)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for event in answer:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class CompletionServer:
    """The HTTP server and its service; `start()` serves from a background thread (tests, notebooks)."""

    def __init__(self, loaded, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, chunk: int = 16,
                 quiet: bool = False):
        self.service = CompletionService(loaded, max_batch=max_batch, chunk=chunk)
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
        self.httpd.shutdown()
        self.httpd.server_close()
        self.service.close()


def serve(loaded, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8) -> None:
    """Serves until interrupted."""
    try:
        server = CompletionServer(loaded, host=host, port=port, max_batch=max_batch)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host.") from None
    print(f"megajax serve: {loaded.path} on {loaded.mesh_text}, context {loaded.generator.context} tokens, up to "
          f"{max_batch} sequences per batch; listening on {server.url} (POST /v1/completions, PUT /api, "
          f"GET /health)", file=sys.stderr, flush=True)
    previous = _stop_on_signals()
    try:
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
