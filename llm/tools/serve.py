"""An OpenAI-compatible HTTP server for a model directory, with a chat page.

    python -m llm.serve models/sft [--host 127.0.0.1] [--port 8000] [--device cpu] [--api-key KEY]

    GET  /                      a chat page (llm/tools/chat_page.html): one conversation, answers streamed
    POST /v1/chat/completions   OpenAI's chat completions; with "stream": true the answer comes as
                                server-sent events, one `data: {chunk}` per piece, then `data: [DONE]`
    POST /v1/completions        OpenAI's legacy completions: raw text or token ids in, with the
                                per-token log-probs that evaluation harnesses read (echo, logprobs)
    GET  /v1/models             the one model served, named after the directory ("sft")
    GET  /tokenizer_info, POST /tokenize, POST /detokenize
                                vLLM's tokenizer endpoints, so that a harness counts tokens the
                                server's way (lm-evaluation-harness: tokenizer_backend=remote)
    GET  /health                {"status": "ok", "model": ..., "running": 0|1, "queued": n}

Any OpenAI client works against it (`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`).
Conversations go through the chat template of llm/data/template.py (`render_prompt`), the one the
model was trained with, and the answer ends at <|end|> or <|endoftext|>.

Chat request fields honoured: messages (roles system, developer (= system), user, assistant;
content a string or a list of {"type": "text"} parts), temperature (0 to 2, default 1;
0 = greedy), top_p, top_k (an extension, 0 = off), max_tokens or max_completion_tokens
(default: the rest of the context), stop (a string or up to 4), seed, stream,
stream_options.include_usage, n (1 only), and truncation (the name OpenAI's Responses API gives
it): "disabled" (the default) refuses a conversation longer than the context with 400, "auto"
drops its earliest messages as `python -m llm.chat` does (llm.tools.chat.fit_context: the system
message and the newest message stay, whole exchanges go) until the answer has max_tokens, or
half the context, of room, and the answer says how many went ("forgotten_messages", in every
chunk when streaming); the chat page asks for "auto". Fields whose meaning this server cannot honour
(tools, logprobs, penalties, logit_bias, n > 1, a JSON response_format) are refused with
400 when set, rather than silently ignored; fields that do not change the answer (user,
metadata, ...) are ignored. /v1/completions takes prompt (a string, a list of strings, a list
of token ids or a list of those; each its own choice), max_tokens (default 16, 0 allowed),
temperature, top_p, top_k, stop, seed, logprobs (0 to 20) and echo; it does not stream.
Its log-probs come from one forward of the model over prompt + completion, the numbers
training's losses compute, so a loglikelihood evaluation through the API scores as one
in-process would.

How requests run: one worker thread generates one answer at a time, the rest wait in a
bounded queue (--max-queue) and a request that finds it full gets 503 at once. One at a
time keeps each request's sampling settings and seed its own (a batch would share one
generator), so a seeded request gets the same answer whatever else is being served
(tested with 8 concurrent clients). Batching would raise throughput, since decoding a
small model is bound by per-step overhead that a batch shares; it is the next step if that
matters. A request without a seed gets one drawn from the server's generator (--seed), so
the same requests in the same order get the same answers. A client that hangs up, streaming
or not, stops its generation at the next decoding step.

What bounds memory and keeps it serving (llm/tools/serve_guard.py has the network side): a body is
counted as it arrives and cut off at --max-request-bytes (413); a request's line and headers
are at most 16 KiB (431); text longer in bytes than the context could hold (context x the
longest token's bytes) is refused before it is tokenized, and one text at a time goes through
the tokenizer, whose cache keeps no long chunk; /tokenize, which counts whole documents up to
--max-request-bytes, runs on a tokenizer of its own, one text at a time with at most
--max-queue waiting (503 beyond), in short pieces that give way to any generation, so it never
holds up a chat request; the queue is bounded; no answer is longer than --max-answer-bytes (one
that would be is refused with 400, a stream ends there), and a client that reads none of its
waiting answer for --send-timeout seconds is dropped with it, so unread answers cannot pile up
in memory; at most --max-connections connections are open: one more closes the connection idle
longest (a new client always gets in) or, when every one is answering a request, is answered
503; a connection must send a whole request within --request-timeout seconds and an idle one is
closed after --keep-alive; a client that shuts down its sending side after its request still
gets its answer (a client that hangs up entirely stops its generation); expected client errors
are logged as one line, each message at most once per 10 s.

Who may call it: only requests whose Host is localhost, 127.0.0.1, ::1, --host or an
--allow-host name (a DNS-rebinding page's Host is refused), whose Origin, if any, is the
server's own or an --allow-origin one (another site's page is refused), whose POST body is
declared application/json (415 otherwise: the one kind of body a page cannot send to another
site without the browser asking first), and, with --api-key or LLM_API_KEY set, that carry
`Authorization: Bearer <key>` (the chat page and /health need none; a key set but empty is
refused at start-up rather than taken as no key).

Every error is JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for
a malformed request (including a prompt longer than the context, with its length, and an answer
over --max-answer-bytes), 401 without the API key, 403 for a refused Host or Origin, 404 for an
unknown model or path (naming every endpoint served), 405, 413 for a body over
--max-request-bytes, 415, 431 for headers over 16 KiB, 503 when a queue is full or every
connection is answering a request, 500 for a bug (logged with its traceback; the server keeps
serving).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import json
import logging
import math
import os
import queue
import random
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch

from llm.data.template import BOS, STOP_TOKENS, ContextError, fit_context, render_prompt
from llm.data.tokenizer import text_windows
from llm.sample.generate import generate, sampling_problem
from llm.tools.chat import TextStream, checked_arg, load_for_cli, positive_int_arg
from llm.tools.serve_guard import LOCAL_HOSTS, MAX_HEAD_BYTES, AnswerLimit, Guard, guarded_protocol, quiet_logs

log = logging.getLogger("llm.serve")

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS, MAX_STOP_CHARS = 4, 200
MAX_PROMPTS, MAX_LOGPROBS = 256, 20  # prompts in one /v1/completions request; listed likeliest tokens
COUNT_PIECE_CHARS = 1 << 14  # /tokenize counts a long text this many characters at a time
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
    truncation: bool = False  # "truncation": "auto": drop the earliest messages to fit, as llm.chat does


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
    _check_model(body, model_id)
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
    stops = _stops(body)
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
    truncation = body.get("truncation", "disabled")
    if truncation not in ("auto", "disabled"):
        raise ApiError(400, f'truncation must be "auto" or "disabled", got {json.dumps(truncation)[:40]}',
                       param="truncation")
    return Request(truncation=truncation == "auto", messages=messages, temperature=temperature,
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
# Legacy completions: raw text in, raw text out, with the log-probs evaluation harnesses read


@dataclass
class CompletionRequest:
    prompts: list  # each a string or a list of token ids
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # how many of the likeliest tokens to list at each position
    echo: bool = False


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    if stops is None:
        return ()
    if (not isinstance(stops, tuple) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most"
                       f" {MAX_STOP_CHARS} characters", param="stop")
    return stops


def _check_model(body: Any, model_id: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"the model {json.dumps(model)[:80]} does not exist; this server has {model_id!r}",
                       param="model", code="model_not_found")


def _prompts(prompt: Any, vocab_size: int) -> list:
    """OpenAI's four shapes of `prompt`: a string, a list of strings, a list of token ids, a list of those."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"prompt must be a string, a list of token ids, or a non-empty list of at most"
                       f" {MAX_PROMPTS} of either", param="prompt")
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not all(not isinstance(t, bool) and isinstance(t, int)
                                           and 0 <= t < vocab_size for t in p):
            raise ApiError(400, f"prompt[{i}]: token ids must be integers in [0, {vocab_size})", param="prompt")
        if not isinstance(p, (str, list)) or not p:
            raise ApiError(400, f"prompt[{i}] must be a non-empty string or list of token ids, got"
                           f" {json.dumps(p)[:80]}", param="prompt")
        if isinstance(p, str):
            _text(p, f"prompt[{i}]")
    return prompt


def parse_completion_request(body: Any, model_id: str, vocab_size: int) -> CompletionRequest:
    """Check a /v1/completions body; every problem is an ApiError naming the field."""
    _check_model(body, model_id)
    unsupported = {k: v for k, v in UNSUPPORTED.items() if k not in ("logprobs", "top_logprobs")}
    for key, unused in {**unsupported, "suffix": None, "stream": False}.items():
        if body.get(key, unused) not in (unused, [], {}):
            raise ApiError(400, f"{key} is not supported on /v1/completions", param=key,
                           code="unsupported_parameter")
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise ApiError(400, f"{key}: this server returns one choice per prompt, got {json.dumps(body[key])}",
                           param=key, code="unsupported_parameter")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    problem = sampling_problem(temperature=temperature)
    if problem:
        raise ApiError(400, problem, param="temperature")
    max_tokens = _integer(body, "max_tokens", 0, 2**31)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise ApiError(400, f"echo must be true or false, got {json.dumps(echo)[:40]}", param="echo")
    return CompletionRequest(
        prompts=_prompts(body.get("prompt"), vocab_size), max_tokens=16 if max_tokens is None else max_tokens,
        temperature=temperature, top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_integer(body, "top_k", 0, 2**31) or 0, stop=_stops(body),
        seed=_integer(body, "seed", -2**63, 2**64 - 1), logprobs=_integer(body, "logprobs", 0, MAX_LOGPROBS),
        echo=echo)


def token_text(tok, i: int) -> str:
    """A token as the logprobs lists name it: its text, or 'bytes:\\xe5\\x9b' for part of a character."""
    b = tok.token_bytes(i)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def token_logprobs(model, ids: list[int], first: int, k: int) -> tuple[list, list]:
    """log p(ids[t] | ids[:t]) for t >= first, by one forward of the model over ids[:-1], and the k
    likeliest tokens at each of those positions as {token id: log-prob}. Position 0 has no context:
    its entries are None."""
    lp: list = [None] * (first == 0)
    top: list = [None] * (first == 0)
    start = max(first, 1)
    if start < len(ids):
        x = torch.tensor([ids[:-1]], device=model.wte.weight.device)             # (1, T-1)
        logp = torch.log_softmax(model(x)[0, start - 1:].float(), dim=-1)        # (T-start, V): token t+1 given <= t
        target = torch.tensor(ids[start:], device=logp.device)
        lp += logp.gather(-1, target[:, None])[:, 0].tolist()
        if k:
            values, index = logp.topk(k, dim=-1)                                 # (T-start, k)
            top += [dict(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
        else:
            top += [{} for _ in range(len(ids) - start)]
    return lp, top


def completion_choice(engine, job, prompt: list[int], c: CompletionRequest, seed: int) -> tuple[dict, int]:
    """One prompt's choice of a /v1/completions answer (without its index) and the tokens generated."""
    tok, new, stopped, n = engine.tok, [], False, 0
    if c.max_tokens:
        new, stopped, n = engine.generate(job, prompt, c.max_tokens, c, seed)
    completion = tok.decode(new)
    cut = min((k for k in (completion.find(s) for s in c.stop) if k >= 0), default=None)
    if cut is not None:
        completion, stopped = completion[:cut], True
    head = tok.decode(prompt)
    text = (head if c.echo else "") + completion
    logprobs = None
    if c.logprobs is not None:
        shown = (prompt if c.echo else []) + new
        offsets, data = [], b""
        base = 0 if c.echo else len(head)
        for i in shown:  # characters before each token; a token that starts mid-character counts from its start
            offsets.append(min(base + len(data.decode("utf-8", errors="ignore")), base + len(text)))
            data += tok.token_bytes(i)
        keep = sum(1 for o in offsets if o < base + len(text)) if cut is not None else len(shown)
        lp, top = token_logprobs(engine.model, prompt + new, 0 if c.echo else len(prompt), c.logprobs)
        logprobs = {"tokens": [token_text(tok, i) for i in shown[:keep]], "token_logprobs": lp[:keep],
                    "top_logprobs": [t if t is None else {token_text(tok, i): v for i, v in t.items()}
                                     for t in top[:keep]],
                    "text_offset": offsets[:keep]}
    return {"text": text, "logprobs": logprobs, "finish_reason": "stop" if stopped else "length"}, n


# ---------------------------------------------------------------------------
# The worker


@dataclass
class Job:
    """One request's work for the worker thread. `work(job)` runs there and reports through
    `send`; the HTTP side sets `cancelled` when its client leaves, and the work stops at its
    next decoding step."""
    work: Callable[["Job"], None]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    def send(self, *event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """One thread that runs one job at a time from a bounded queue of jobs.

    Events sent to a chat job: ("text", str) pieces, then ("done", finish_reason, completion_tokens)
    or ("error", message); to a completions job: ("done", choices, completion_tokens) or ("error", message).
    """

    def __init__(self, model, tokenizer, max_queue: int = 16):
        self.model, self.tok = model, tokenizer
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.running = 0
        self.steps = 0  # decoding steps taken, all jobs together (tests read it)
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
                with torch.no_grad():
                    job.work(job)
            except Exception as e:  # a bug: tell the client, log it, keep serving
                log.exception("generation failed")
                job.send("error", f"generation failed: {type(e).__name__}: {e}")
            finally:
                self.running = 0

    def generate(self, job: Job, prompt: list[int], max_tokens: int, r, seed: int,
                 on_text=lambda piece: None) -> tuple[list[int], bool, int]:
        """Decode up to max_tokens after `prompt`, handing text pieces to on_text once they are sure;
        ends at a stop token, at a stop string of r.stop or when the job is cancelled. Returns (the new
        ids without the stop token, whether the model or a stop string ended it, tokens generated)."""
        text, stops = TextStream(self.tok), StopStrings(r.stop)

        def step(tokens) -> bool:
            self.steps += 1
            piece = stops.feed(text.push(int(tokens[0])))
            if piece:
                on_text(piece)
            return stops.hit or job.cancelled

        device = self.model.wte.weight.device
        gen = generate(self.model, [prompt], max_tokens, temperature=r.temperature, top_k=r.top_k,
                       top_p=r.top_p, stop_ids=[self.tok.special[t] for t in STOP_TOKENS],
                       pad_id=self.tok.pad_id, generator=torch.Generator(device=device).manual_seed(seed),
                       stream=step)
        tail = stops.feed(text.flush()) + stops.flush()
        if tail:
            on_text(tail)
        return gen.responses()[0], stops.hit or bool(gen.stopped[0]), int(gen.response_mask.sum())

    def chat(self, job: Job, r: "Request", prompt: list[int], max_tokens: int, seed: int) -> None:
        _, stopped, n = self.generate(job, prompt, max_tokens, r, seed, lambda piece: job.send("text", piece))
        job.send("done", "stop" if stopped else "length", n)

    def complete(self, job: Job, prompts: list[list[int]], c: "CompletionRequest", seed: int) -> None:
        choices, used = [], 0
        for i, prompt in enumerate(prompts):
            if job.cancelled:
                return
            choice, n = completion_choice(self, job, prompt, c, (seed + i) % 2**64)
            choices.append({"index": i, **choice})
            used += n
        job.send("done", choices, used)


# ---------------------------------------------------------------------------
# HTTP


def error_response(e: ApiError):
    from starlette.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status)


async def read_json(request, max_request_bytes: int) -> Any:
    """The request's JSON body, counted as it arrives and refused (413) once over max_request_bytes."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_request_bytes:
        raise ApiError(413, f"the request is {declared} bytes; this server takes at most {max_request_bytes}",
                       code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise ApiError(413, f"the request is over {max_request_bytes} bytes, this server's limit",
                               code="request_too_large")
    except ClientDisconnect:
        raise ApiError(400, "the client went away before sending its whole request") from None

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(bytes(body), parse_constant=no_constants)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as e:  # includes bytes that are not UTF-8
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


async def outcome(job: Job, request, pieces: list[str]) -> tuple:
    """The job's last event, its text pieces gathered in `pieces`. If the client hangs up
    first, the job is cancelled (the worker stops at its next step) and this returns ("gone",)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancelled = True
        job.events.put_nowait(("gone",))

    watcher = asyncio.create_task(watch())
    try:
        while (event := await job.events.get())[0] == "text":
            pieces.append(event[1])
        return event
    finally:
        job.cancelled = True
        watcher.cancel()


async def sse(job: Job, head: dict, usage: Callable[[int], dict], include_usage: bool) -> AsyncIterator[str]:
    """A chat job's events as OpenAI's server-sent chunks; leaving early (the client hung up) cancels the job."""
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
                if include_usage:  # OpenAI's last chunk: no choices, the token counts
                    body = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(n)}
                    yield f"data: {json.dumps(body)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True


def make_app(model, tokenizer, *, model_id: str, fingerprint: str | None = None, max_queue: int = 16,
             max_request_bytes: int = 1 << 20, max_answer_bytes: int = 8 << 20, seed: int = 0,
             hosts: tuple[str, ...] = LOCAL_HOSTS, origins: tuple[str, ...] = (), api_key: str | None = None):
    """The Starlette application serving `model`; its engine starts and stops with the app.

    hosts, origins, api_key: what llm.tools.serve_guard.Guard lets in (the Host names answered, other
    sites allowed to call it, the key /v1/... needs).

    Longer than most functions here on purpose: the generating handlers are closures over the one
    engine, the model's id and the request limits, so the API's surface reads top to bottom in
    one place (and Starlette is imported only when a server is made)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    engine = Engine(model, tokenizer, max_queue)
    seq_len = model.config.seq_len
    seeds = random.Random(seed)  # seeds of requests that bring none
    created = int(time.time())
    # No text of more bytes than this fits in the context (each token is at most this many bytes
    # long), so longer text is refused before the tokenizer spends time and memory on it.
    max_text_bytes = seq_len * max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    encoding = threading.Lock()  # one text at a time through the tokenizer: its peak memory, not eight
    # (/tokenize has a tokenizer and a lock of its own: tokenizer_routes)

    def encode(text: str, allowed_special: str = "none") -> list[int]:
        with encoding:
            return tokenizer.encode(text, allowed_special=allowed_special)

    def render(messages: list[dict]) -> list[int]:
        with encoding:
            return render_prompt(messages, tokenizer)

    def fit(messages: list[dict], answer: int) -> tuple[list[dict], int]:
        """llm.chat's rule for a conversation longer than the context: its earliest messages go. A
        message of more than max_text_bytes cannot fit: it counts as longer than the context, untokenized."""
        def count(text: str) -> int:
            return seq_len + 1 if len(text.encode()) > max_text_bytes else len(encode(text))

        try:
            return fit_context(messages, count, seq_len, answer)
        except ContextError as e:
            raise ApiError(400, str(e), param="messages", code="context_length_exceeded") from None

    def too_long(n_bytes: int, what: str, param: str) -> ApiError:
        return ApiError(400, f"{what} {n_bytes} bytes of text, more than the {max_text_bytes} bytes that can fit in"
                             f" this model's context of {seq_len} tokens", param=param,
                        code="context_length_exceeded")

    async def chat_completions(request: HttpRequest):
        try:
            r = parse_request(await read_json(request, max_request_bytes), model_id)
            last = len(r.messages) - 1  # with truncation only the system and newest messages must fit
            n_bytes = sum(len(m["content"].encode()) for i, m in enumerate(r.messages)
                          if not r.truncation or i == last or (i == 0 and m["role"] == "system"))
            if n_bytes > max_text_bytes:
                raise too_long(n_bytes, "the messages are", "messages")
            forgotten = 0
            if r.truncation:
                r.messages, forgotten = await run_in_threadpool(fit, r.messages, r.max_tokens or seq_len // 2)
            prompt = await run_in_threadpool(render, r.messages)
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
            job_seed = seeds.randrange(2**63) if r.seed is None else r.seed
            job = Job(lambda j: engine.chat(j, r, prompt, r.max_tokens or room, job_seed),
                      asyncio.get_running_loop())
            engine.submit(job)
        except ApiError as e:
            return error_response(e)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_id,
                "system_fingerprint": fingerprint, **({"forgotten_messages": forgotten} if r.truncation else {})}

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

        if r.stream:
            return StreamingResponse(sse(job, head, usage, r.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces: list[str] = []
        event = await outcome(job, request, pieces)
        if event[0] != "done":
            return error_response(ApiError(500, event[1] if event[0] == "error" else "the client went away"))
        _, finish, n = event
        return JSONResponse({**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
            "finish_reason": finish, "logprobs": None}], "usage": usage(n)})

    async def completions(request: HttpRequest):
        try:
            c = parse_completion_request(await read_json(request, max_request_bytes), model_id, tokenizer.vocab_size)
            prompts = []
            for i, p in enumerate(c.prompts):
                if isinstance(p, str):
                    if len(p.encode()) > max_text_bytes:
                        raise too_long(len(p.encode()), f"prompt[{i}] is", "prompt")
                    p = await run_in_threadpool(encode, p, "all")
                if len(p) + c.max_tokens > seq_len:
                    raise ApiError(400, f"prompt[{i}] is {len(p)} tokens and max_tokens is {c.max_tokens}:"
                                        f" {len(p) + c.max_tokens} > this model's context of {seq_len} tokens",
                                   param="prompt", code="context_length_exceeded")
                prompts.append(p)
            job_seed = seeds.randrange(2**63) if c.seed is None else c.seed
            job = Job(lambda j: engine.complete(j, prompts, c, job_seed), asyncio.get_running_loop())
            engine.submit(job)
        except ApiError as e:
            return error_response(e)
        event = await outcome(job, request, [])
        if event[0] != "done":
            return error_response(ApiError(500, event[1] if event[0] == "error" else "the client went away"))
        _, choices, n = event
        n_prompt = sum(map(len, prompts))
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                             "model": model_id, "system_fingerprint": fingerprint, "choices": choices,
                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}})

    async def models(request: HttpRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "llm"}]})

    async def one_model(request: HttpRequest):
        if request.path_params["name"] != model_id:
            return error_response(ApiError(404, f"the model {request.path_params['name']!r} does not exist;"
                                       f" this server has {model_id!r}", code="model_not_found"))
        return JSONResponse({"id": model_id, "object": "model", "created": created, "owned_by": "llm"})

    async def health(request: HttpRequest):
        return JSONResponse({"status": "ok", "model": model_id, "running": engine.running,
                             "queued": engine.jobs.qsize(), "max_queue": max_queue, "context": seq_len})

    routes = [
        chat_page_route(model_id, seq_len),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", one_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *tokenizer_routes(tokenizer, seq_len, max_request_bytes, max_queue,
                          busy=lambda: bool(engine.running or engine.jobs.qsize())),
    ]
    served = ", ".join(f"{sorted(r.methods - {'HEAD'})[0]} {r.path.replace('{name:path}', '{model}')}"
                       for r in routes)

    async def http_error(request: HttpRequest, exc: HTTPException):
        what = {404: f"no such path: {request.url.path[:200]}; this server serves {served}",
                405: f"{request.method} is not allowed on {request.url.path[:200]}; this server serves {served}"}
        return error_response(ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail))))

    async def server_error(request: HttpRequest, exc: Exception):
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    guard = Middleware(Guard, hosts=hosts, origins=origins, api_key=api_key, open_paths=("/", "/health"))
    app = Starlette(routes=routes, middleware=[guard, Middleware(AnswerLimit, max_bytes=max_answer_bytes)],
                    lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.engine = engine
    return app


def tokenizer_routes(tokenizer, seq_len: int, max_request_bytes: int, max_queue: int,
                     busy: Callable[[], bool] = lambda: False) -> list:
    """vLLM's /tokenizer_info, /tokenize and /detokenize, which evaluation harnesses use to count a
    prompt's tokens the server's way (lm-evaluation-harness: tokenizer_backend=remote). Special-token
    text becomes the special token, as in a string prompt of /v1/completions.

    /tokenize counts text of any length up to --max-request-bytes (a document longer than the
    context is counted whole, as rolling log-likelihoods need), so it runs apart from chat: on a
    tokenizer of its own (its own cache; the tokenizer is not safe to share between threads), one
    text at a time, with at most max_queue more waiting (503 beyond). A chat request never waits
    for it, and the waiting requests wait on the event loop, not in the thread pool that chat
    prompts are rendered in. Counting holds Python's interpreter lock, which the generating thread
    needs at every step, so a long text is counted in short pieces, and between two pieces it
    waits while `busy()` (a generation runs or waits): a chat request is slowed by at most one
    piece."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    counter = type(tokenizer)(tokenizer.merges, list(tokenizer.special), tokenizer.pattern)
    counting = asyncio.Lock()
    waiting = 0

    async def tokenize(request: Any):
        nonlocal waiting
        try:
            body = await read_json(request, max_request_bytes)
            if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                raise ApiError(400, 'the body must be {"prompt": "some text"}', param="prompt")
            text = _text(body["prompt"], "prompt")
            if waiting > max_queue:  # one counting, max_queue waiting
                raise ApiError(503, f"the server is busy: {max_queue} /tokenize requests are already waiting"
                                    " (--max-queue); retry later", type="server_error", code="overloaded")
        except ApiError as e:
            return error_response(e)
        waiting += 1
        try:
            async with counting:
                ids = []
                for piece in text_windows(text, COUNT_PIECE_CHARS):
                    while busy():
                        await asyncio.sleep(0.005)
                    ids += await run_in_threadpool(counter.encode, piece, allowed_special="all")
        finally:
            waiting -= 1
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": seq_len})

    async def detokenize(request: Any):
        try:
            body = await read_json(request, max_request_bytes)
            ids = _prompts(body.get("tokens") if isinstance(body, dict) else None, tokenizer.vocab_size)[0]
            if not isinstance(ids, list):
                raise ApiError(400, 'the body must be {"tokens": [ids...]}', param="tokens")
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def tokenizer_info(request: Any):
        return JSONResponse({"tokenizer_class": "llm.data.tokenizer.Tokenizer", "eos_token": BOS, "bos_token": None,
                             "pad_token": tokenizer.decode([tokenizer.pad_id]), "model_max_length": seq_len,
                             "vocab_size": tokenizer.vocab_size})

    return [Route("/tokenizer_info", tokenizer_info, methods=["GET"]), Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]


def chat_page_route(model_id: str, seq_len: int):
    """GET / : llm/tools/chat_page.html with the model's name and context filled in; it may not be framed
    by another site, and its own inline script and style are all it runs."""
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    page = (Path(__file__).with_name("chat_page.html").read_text(encoding="utf-8")
            .replace("{{MODEL}}", html.escape(model_id)).replace("{{CONTEXT}}", str(seq_len)))

    async def chat_page(request: Any):
        return HTMLResponse(page, headers={
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            "X-Frame-Options": "DENY", "Cache-Control": "no-cache"})

    return Route("/", chat_page, methods=["GET"])


def server_config(app, *, max_connections: int = 64, request_timeout: float = 10.0, send_timeout: float = 10.0,
                  keep_alive: float = 5.0, log_level: str = "info"):
    """uvicorn's settings for `app` with llm.tools.serve_guard's connection limits, and its log quieted."""
    import uvicorn

    config = uvicorn.Config(app, http=guarded_protocol(max_connections, request_timeout, send_timeout),
                            log_level=log_level,
                            timeout_keep_alive=keep_alive, timeout_graceful_shutdown=2, ws="none",
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    quiet_logs()
    return config


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llm.serve",
                                 description="Serve a model directory over an OpenAI-compatible HTTP API, with a chat"
                                             " page at / .")
    ap.add_argument("model_dir", help="a model directory, e.g. models/sft")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on; without --api-key anyone who can"
                    " reach it can use the model, so think before using 0.0.0.0 (default: %(default)s)")
    ap.add_argument("--port", type=checked_arg(lambda p: None if 0 <= p <= 65535 else
                                               f"a port is in [0, 65535] (0 = any free port), got {p}", int),
                    default=8000, help="0 = any free port (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    ap.add_argument("--max-queue", type=positive_int_arg, default=16, metavar="N",
                    help="requests that may wait while one is generated; more get 503 (default: %(default)s)")
    ap.add_argument("--max-request-bytes", type=positive_int_arg, default=1 << 20, metavar="N",
                    help="largest request body accepted, counted as it arrives; larger gets 413 (default: %(default)s)")
    ap.add_argument("--max-answer-bytes", type=positive_int_arg, default=8 << 20, metavar="N",
                    help="longest answer sent; a request whose answer would be longer gets 400 saying so"
                    " (default: %(default)s)")
    ap.add_argument("--max-connections", type=positive_int_arg, default=64, metavar="N",
                    help="open connections at once; one more closes the connection idle longest, or is answered"
                    " 503 if every one is answering a request (default: %(default)s)")
    ap.add_argument("--request-timeout", type=checked_arg(lambda t: None if 0 < t <= 3600 else
                                                          f"seconds in (0, 3600], got {t}", float),
                    default=10.0, metavar="SECONDS", help="a connection must send a whole request (headers and"
                    " body) within this long of opening or of its previous answer, or it is closed; this is what"
                    " drops clients that send nothing or trickle their headers (default: %(default)s)")
    ap.add_argument("--send-timeout", type=checked_arg(lambda t: None if 0 < t <= 3600 else
                                                       f"seconds in (0, 3600], got {t}", float),
                    default=10.0, metavar="SECONDS", help="a connection whose client reads none of its waiting"
                    " answer for this long is dropped, and the answer with it (default: %(default)s)")
    ap.add_argument("--keep-alive", type=checked_arg(lambda t: None if 0 < t <= 3600 else
                                                     f"seconds in (0, 3600], got {t}", float),
                    default=5.0, metavar="SECONDS",
                    help="an idle connection is closed this long after its last answer (default: %(default)s)")
    ap.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                    help="also answer requests whose Host header names NAME (repeatable; '*' = any). By default"
                    " only localhost, 127.0.0.1, ::1 and --host are answered, which stops DNS-rebinding pages")
    ap.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                    help="let web pages from ORIGIN, e.g. http://localhost:3000, call the API (repeatable; '*' = any)."
                    " By default only the server's own chat page may; other pages' requests get 403")
    ap.add_argument("--api-key", default=os.environ.get("LLM_API_KEY"), metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1/... and the tokenizer endpoints (default: the"
                    " environment variable LLM_API_KEY; unset = no key needed; an empty key is refused)")
    ap.add_argument("--seed", type=int, default=0, metavar="N",
                    help="seed of the seeds given to requests that bring none (default: %(default)s)")
    ap.add_argument("--name", default=None, help="the model's id in the API (default: the directory's name)")
    return ap


def _allow_open_files(n: int) -> None:
    """Raise this process's open-file limit to cover n connections plus the files the server itself
    needs, where the hard limit allows; the connection cap then refuses before accept() fails."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():
        ap.error("the API key (--api-key, or the environment variable LLM_API_KEY) is set but empty, which would"
                 " look like a key and check none: to serve without a key, unset it (`unset LLM_API_KEY`, or leave"
                 " out --api-key); to require one, set a non-empty key")
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
    _allow_open_files(args.max_connections)
    app = make_app(model, tok, model_id=name, fingerprint=meta.get("fingerprint"), max_queue=args.max_queue,
                   max_request_bytes=args.max_request_bytes, max_answer_bytes=args.max_answer_bytes, seed=args.seed,
                   hosts=(*LOCAL_HOSTS, args.host, *args.allow_host), origins=tuple(args.allow_origin),
                   api_key=args.api_key)
    print(f"serving {name} ({model.summary()}) at {url}/v1", flush=True)
    print(f"chat page: {url}/", flush=True)
    if args.host in ("0.0.0.0", "::") and not args.allow_host:
        print(f"note: requests must name this machine as localhost or {args.host}; to serve it by another name"
              f" or address, add --allow-host NAME", flush=True)
    server = uvicorn.Server(server_config(app, max_connections=args.max_connections,
                                          request_timeout=args.request_timeout, send_timeout=args.send_timeout,
                                          keep_alive=args.keep_alive))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again for the caller
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
