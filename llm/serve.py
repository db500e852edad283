"""An OpenAI-compatible HTTP server for a model directory.

    python -m llm.serve models/sft [--host 127.0.0.1] [--port 8000] [--device cpu]

    POST /v1/chat/completions   OpenAI's chat completions; with "stream": true the answer comes as
                                server-sent events, one `data: {chunk}` per piece, then `data: [DONE]`
    GET  /v1/models             the one model served, named after the directory ("sft")
    GET  /health                {"status": "ok", "model": ..., "running": 0|1, "queued": n}

Any OpenAI client works against it (`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`).
Conversations go through the chat template of llm/chat.py (`render_prompt`), the one the
model was trained with, and the answer ends at <|end|> or <|endoftext|>.

Request fields honoured: messages (roles system, developer (= system), user, assistant;
content a string or a list of {"type": "text"} parts), temperature (0 to 2, default 1;
0 = greedy), top_p, top_k (an extension, 0 = off), max_tokens or max_completion_tokens
(default: the rest of the context), stop (a string or up to 4), seed, stream,
stream_options.include_usage, n (1 only). Fields whose meaning this server cannot honour
(tools, logprobs, penalties, logit_bias, n > 1, a JSON response_format) are refused with
400 when set, rather than silently ignored; fields that do not change the answer (user,
metadata, ...) are ignored.

How requests run: one worker thread generates one answer at a time, the rest wait in a
bounded queue (--max-queue) and a request that finds it full gets 503 at once. One at a
time keeps each request's sampling settings and seed its own (a batch would share one
generator), so a seeded request gets the same answer whatever else is being served
(tested with 8 concurrent clients). Batching would raise throughput, since decoding a
small model is bound by per-step overhead that a batch shares; it is the next step if that
matters. A request without a seed gets one drawn from the server's generator (--seed), so
the same requests in the same order get the same answers.

Every error is JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
400 for a malformed request (including a prompt longer than the context, with its length),
404 for an unknown model or path, 405, 413 for a body over --max-request-bytes, 503 when the
queue is full, 500 for a bug (logged with its traceback; the server keeps serving). There
is no authentication: it binds to 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import queue
import random
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import torch

from llm.chat import STOP_TOKENS, TextStream, checked_arg, load_for_cli, positive_int_arg, render_prompt
from llm.generate import generate, sampling_problem

log = logging.getLogger("llm.serve")

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS, MAX_STOP_CHARS = 4, 200
UNSUPPORTED = {  # field -> the value that means "not used"; anything else is refused
    "tools": None, "functions": None, "tool_choice": None, "function_call": None,
    "logprobs": False, "top_logprobs": None, "audio": None, "prediction": None,
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None,
}


class ApiError(Exception):
    """A request that cannot be served: HTTP status + OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------
# Requests


@dataclass
class Request:
    messages: list[dict]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{key} must be a number, got {json.dumps(v)}", param=key)
    if not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        raise ApiError(400, f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", param=key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be an integer in [{lo}, {hi}], got {json.dumps(v)}", param=key)
    return v


def _text(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}[{j}]: only text parts are supported"
                               f' ({{"type": "text", "text": "..."}})', param=where)
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where} must be a string or a list of text parts, got {json.dumps(content)[:80]}",
                       param=where)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:  # JSON can spell a lone surrogate ("\ud800"); it is not text
        raise ApiError(400, f"{where} is not valid Unicode (it holds a lone surrogate)", param=where) from None
    return content


def parse_request(body: Any, model_id: str) -> Request:
    """Check a /v1/chat/completions body; every problem is an ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"the model {json.dumps(model)[:80]} does not exist; this server has {model_id!r}",
                       param="model", code="model_not_found")
    for key, unused in UNSUPPORTED.items():
        if body.get(key, unused) not in (unused, [], {}):
            raise ApiError(400, f"{key} is not supported by this server", param=key, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format",
                       code="unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"n: this server returns one choice per request (n = 1), got {json.dumps(body['n'])}",
                       param="n", code="unsupported_parameter")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    messages = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {sorted(ROLES)}, got {json.dumps(role)[:80]}",
                           param=f"{where}.role")
        messages.append({"role": ROLES[role], "content": _text(m.get("content"), f"{where}.content")})
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    if stops is None:
        stops = ()
    if (not isinstance(stops, tuple) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most"
                       f" {MAX_STOP_CHARS} characters", param="stop")
    max_tokens = _integer(body, "max_completion_tokens", 1, 2**31)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 2**31)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {json.dumps(stream)[:40]}", param="stream")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    problem = sampling_problem(temperature=temperature)  # e.g. 1e-300: no usable distribution
    if problem:
        raise ApiError(400, problem, param="temperature")
    return Request(messages=messages, temperature=temperature,
                   top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                   top_k=_integer(body, "top_k", 0, 2**31) or 0, max_tokens=max_tokens, stop=stops,
                   seed=_integer(body, "seed", -2**63, 2**64 - 1), stream=stream,
                   include_usage=bool(options.get("include_usage")))


class StopStrings:
    """Cuts streamed text at the first stop string, holding back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held, self.hit = stops, "", False

    def feed(self, piece: str) -> str:
        """The text that is now certain to be part of the answer."""
        if self.hit or not piece:
            return ""
        if not self.stops:
            return piece
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held, self.hit = "", True
            return text[:min(found)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


# ---------------------------------------------------------------------------
# The worker


@dataclass
class Job:
    request: Request
    prompt: list[int]
    max_tokens: int
    seed: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away: stop generating

    def send(self, *event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """One thread that generates one answer at a time from a bounded queue of jobs.

    Events sent to a job: ("text", str) pieces, then ("done", finish_reason, completion_tokens)
    or ("error", message).
    """

    def __init__(self, model, tokenizer, max_queue: int = 16):
        self.model, self.tok = model, tokenizer
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.running = 0
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="llm.serve worker", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        while True:  # jobs still waiting are told, not left hanging
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.send("error", "the server is shutting down")
        if self.thread is not None:
            with contextlib.suppress(queue.Full):
                self.jobs.put_nowait(None)
            self.thread = None

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(503, f"the server is busy: {self.jobs.maxsize} requests are already waiting;"
                                f" retry later", type="server_error", code="overloaded") from None

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled:
                continue
            self.running = 1
            try:
                self._generate(job)
            except Exception as e:  # a bug: tell the client, log it, keep serving
                log.exception("generation failed")
                job.send("error", f"generation failed: {type(e).__name__}: {e}")
            finally:
                self.running = 0

    def _generate(self, job: Job) -> None:
        r = job.request
        text, stops = TextStream(self.tok), StopStrings(r.stop)

        def step(tokens) -> bool:
            piece = stops.feed(text.push(int(tokens[0])))
            if piece:
                job.send("text", piece)
            return stops.hit or job.cancelled

        device = self.model.wte.weight.device
        gen = generate(self.model, [job.prompt], job.max_tokens, temperature=r.temperature, top_k=r.top_k,
                       top_p=r.top_p, stop_ids=[self.tok.special[t] for t in STOP_TOKENS],
                       pad_id=self.tok.pad_id, generator=torch.Generator(device=device).manual_seed(job.seed),
                       stream=step)
        tail = stops.feed(text.flush())
        tail += stops.flush()
        if tail:
            job.send("text", tail)
        finish = "stop" if stops.hit or bool(gen.stopped[0]) else "length"
        job.send("done", finish, int(gen.response_mask.sum()))


# ---------------------------------------------------------------------------
# HTTP


def make_app(model, tokenizer, *, model_id: str, fingerprint: str | None = None, max_queue: int = 16,
             max_request_bytes: int = 1 << 20, seed: int = 0):
    """The Starlette application serving `model`; its engine starts and stops with the app.

    One function on purpose, longer than most here: the route handlers are closures over the one
    engine, the model's id and the request limits, so the whole HTTP surface reads top to bottom
    in one place (and Starlette is imported only when a server is made)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    engine = Engine(model, tokenizer, max_queue)
    seq_len = model.config.seq_len
    seeds = random.Random(seed)  # seeds of requests that bring none
    created = int(time.time())

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def read_json(request: HttpRequest) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise ApiError(413, f"the request is {declared} bytes; this server takes at most {max_request_bytes}",
                           code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise ApiError(413, f"the request is over {max_request_bytes} bytes, this server's limit",
                               code="request_too_large")

        def no_constants(name: str):
            raise ValueError(f"{name} is not valid JSON")

        try:
            return json.loads(bytes(body), parse_constant=no_constants)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as e:  # includes bytes that are not UTF-8
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    async def completions(request: HttpRequest):
        try:
            r = parse_request(await read_json(request), model_id)
            prompt = await run_in_threadpool(render_prompt, r.messages, tokenizer)
            if len(prompt) >= seq_len:
                raise ApiError(400, f"the messages are {len(prompt)} tokens with the chat template; this model's"
                                    f" context is {seq_len} tokens and the answer needs at least one",
                               param="messages", code="context_length_exceeded")
            room = seq_len - len(prompt)
            if r.max_tokens is not None and r.max_tokens > room:
                raise ApiError(400, f"the messages are {len(prompt)} tokens and max_tokens is {r.max_tokens}:"
                                    f" {len(prompt) + r.max_tokens} > this model's context of {seq_len} tokens;"
                                    f" ask for at most {room}", param="max_tokens",
                               code="context_length_exceeded")
            job = Job(r, prompt, r.max_tokens or room, seeds.randrange(2**63) if r.seed is None else r.seed,
                      asyncio.get_running_loop())
            engine.submit(job)
        except ApiError as e:
            return error(e)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id,
                "system_fingerprint": fingerprint}

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

        if r.stream:
            return StreamingResponse(sse(job, head, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces = []
        try:
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    pieces.append(event[1])
                elif event[0] == "error":
                    return error(ApiError(500, event[1]))
                else:
                    break
        finally:
            job.cancelled = True  # done, or the client went away (the task was cancelled)
        _, finish, n = event
        return JSONResponse({**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
            "finish_reason": finish, "logprobs": None}], "usage": usage(n)})

    async def sse(job: Job, head: dict, usage) -> AsyncIterator[str]:
        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            body = {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                event = await job.events.get()
                if event[0] == "text":
                    yield chunk({"content": event[1]})
                elif event[0] == "error":
                    yield f"data: {json.dumps(ApiError(500, event[1]).body())}\n\n"
                    break
                else:
                    _, finish, n = event
                    yield chunk({}, finish)
                    if job.request.include_usage:  # OpenAI's last chunk: no choices, the token counts
                        body = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(n)}
                        yield f"data: {json.dumps(body)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True

    async def models(request: HttpRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "llm"}]})

    async def one_model(request: HttpRequest):
        if request.path_params["name"] != model_id:
            return error(ApiError(404, f"the model {request.path_params['name']!r} does not exist;"
                                       f" this server has {model_id!r}", code="model_not_found"))
        return JSONResponse({"id": model_id, "object": "model", "created": created, "owned_by": "llm"})

    async def health(request: HttpRequest):
        return JSONResponse({"status": "ok", "model": model_id, "running": engine.running,
                             "queued": engine.jobs.qsize(), "max_queue": max_queue, "context": seq_len})

    async def http_error(request: HttpRequest, exc: HTTPException):
        what = {404: f"no such path: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail))))

    async def server_error(request: HttpRequest, exc: Exception):
        log.exception("request failed")
        return error(ApiError(500, f"internal error: {type(exc).__name__}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", one_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error}, lifespan=lifespan)
    app.state.engine = engine
    return app


# ---------------------------------------------------------------------------
# The command line


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = a free one, see getsockname())."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llm.serve",
                                 description="Serve a model directory over an OpenAI-compatible HTTP API.")
    ap.add_argument("model_dir", help="a model directory, e.g. models/sft")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on; the API has no authentication,"
                    " so think before using 0.0.0.0 (default: %(default)s)")
    ap.add_argument("--port", type=checked_arg(lambda p: None if 0 <= p <= 65535 else
                                               f"a port is in [0, 65535] (0 = any free port), got {p}", int),
                    default=8000, help="0 = any free port (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    ap.add_argument("--max-queue", type=positive_int_arg, default=16, metavar="N",
                    help="requests that may wait while one is generated; more get 503 (default: %(default)s)")
    ap.add_argument("--max-request-bytes", type=positive_int_arg, default=1 << 20, metavar="N",
                    help="largest request body accepted; larger gets 413 (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, metavar="N",
                    help="seed of the seeds given to requests that bring none (default: %(default)s)")
    ap.add_argument("--name", default=None, help="the model's id in the API (default: the directory's name)")
    args = ap.parse_args(argv)
    model, tok, meta = load_for_cli(ap, args.model_dir, args.device, heads=("lm",))
    import uvicorn

    name = args.name or Path(args.model_dir).resolve().name
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"{ap.prog}: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    app = make_app(model, tok, model_id=name, fingerprint=meta.get("fingerprint"), max_queue=args.max_queue,
                   max_request_bytes=args.max_request_bytes, seed=args.seed)
    print(f"serving {name} ({model.summary()}) at {url}/v1", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again for the caller
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
