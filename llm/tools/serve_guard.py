"""What keeps llm.serve standing in front of hostile clients and hostile web pages.

Three layers, each small enough to read on its own:

1. `guarded_protocol`: uvicorn's h11 connection with the limits uvicorn lacks. A request must
   arrive whole (headers and body) within `request_timeout` seconds of the connection opening
   or of the previous answer, so a client that sends nothing, or its headers a byte at a time
   (slowloris), is dropped. Its line and headers are at most 16 KiB, counted across reads
   (431). A client that reads none of its waiting answer for `send_timeout` seconds is dropped
   and the answer freed. Beyond `max_connections` open connections a new one closes the one
   idle longest, so idle sockets cannot lock clients out; only when every connection is
   answering a request is it answered 503 and closed. A client that half-closes after its
   request is answered; one that hung up entirely is told apart by its kernel's reset to an
   interim "100 Continue", and its generation stops. Idle keep-alive connections are closed
   by uvicorn's own `timeout_keep_alive`.
2. `Guard`, an ASGI middleware: the request's Host must be one the server answers to and its
   Origin, when a browser sends one, the server's own or one allowed by name. Together these
   stop a web page from driving the server through the visitor's browser (DNS rebinding gives
   the page a foreign Host; a cross-site form or `fetch` carries the page's Origin). A POST body
   must be declared `application/json` (415 otherwise): a page can send `text/plain` across
   sites without asking the browser first, never `application/json`. With an API key set,
   /v1/... and the tokenizer endpoints need `Authorization: Bearer <key>` (401).
3. `AnswerLimit`, an ASGI middleware: no answer is longer than `max_bytes`; one that would
   be is replaced by a 400 that says so, and a stream ends there.
4. `QuietLog`, a logging filter: client errors that the server expects (a reset connection, a
   malformed request, running out of file descriptors while accepting) are logged as one line
   without a traceback, and any one message at most once per `every` seconds with a count of
   those held back, so a flood of bad clients cannot fill the disk with the log.
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from typing import Iterable

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error shape, as llm.serve writes every error."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


# ---------------------------------------------------------------------------
# 1. connections


MAX_HEAD_BYTES = 16 * 1024  # a request's line and headers together


def _raw_answer(status: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer that closes its connection, for refusals made before h11 sees a request."""
    body = error_body(int(status.split()[0]), message, code)
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status.encode(), len(body), body))


def guarded_protocol(max_connections: int, request_timeout: float, send_timeout: float = 10.0):
    """A subclass of uvicorn's H11Protocol with llm.serve's connection limits (pass it as
    uvicorn.Config(http=...)): the cap, the whole-request and send deadlines, the header limit,
    and answers to half-closed clients."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    refusal = _raw_answer("503 Service Unavailable", f"the server has {max_connections} connections open, its"
                          " limit, all of them answering a request; retry later", "too_many_connections")
    too_big = _raw_answer("431 Request Header Fields Too Large", f"the request's line and headers are over"
                          f" {MAX_HEAD_BYTES} bytes, this server's limit", "headers_too_large")
    waiting = (h11.IDLE, h11.SEND_BODY)  # the client's side: still owes us (part of) a request

    class GuardedH11Protocol(H11Protocol):
        deadline = None  # the whole-request timer
        sending = None  # the send timer, while answer bytes wait for the client to read them
        unsent = 0  # bytes waiting when the send timer was set
        idle_since = 0.0  # when it last had no request being answered
        head = 0  # bytes of the request line and headers seen so far
        tail = b""  # the last 3 of them, to find a "\r\n\r\n" cut across two reads
        probe = None  # the timer that polls a half-closed client's socket

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.idle_since = time.monotonic()
            if sum(not c.transport.is_closing() for c in self.connections) > max_connections:  # this one included
                if not self._make_room():
                    log.warning("refused a connection: %d are open, all answering a request, the limit"
                                " (--max-connections)", len(self.connections) - 1)
                    transport.write(refusal)
                    transport.close()
                    return
            self._arm()

        def _idle(self) -> bool:
            """No request is being answered: none began, its answer is written, or it is still arriving."""
            return (self.cycle is None or self.cycle.response_complete or self.conn.their_state in waiting)

        def _make_room(self) -> bool:
            """Close the connection idle longest (not this one) so that a new client always gets in."""
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                    and not c.transport.is_closing() and c._idle()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c.idle_since)
            log.warning("closed the connection idle longest (%.0fs) to let a new one in: %d connections are the"
                        " limit (--max-connections)", time.monotonic() - oldest.idle_since, max_connections)
            oldest.transport.abort()  # abort, not close: answer bytes it never read are dropped, not kept
            return True

        # -- the whole-request deadline

        def _arm(self) -> None:
            self.deadline = self.loop.call_later(request_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _too_slow(self) -> None:
            self.deadline = None
            if not self.transport.is_closing() and self.conn.their_state in waiting:
                log.warning("closed a connection that did not send a whole request within %gs (--request-timeout)",
                            request_timeout)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                if self.deadline is None:
                    self._arm()  # the next request on a kept-alive connection begins
                if self._head_too_big(data):
                    log.warning("refused a request whose headers are over %d bytes", MAX_HEAD_BYTES)
                    self._disarm()
                    self.transport.write(too_big)
                    self.transport.close()
                    return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self.head, self.tail = 0, b""
            if self.conn.their_state not in waiting:
                self._disarm()

        def _head_too_big(self, data: bytes) -> bool:
            """Whether the request line and headers, counted across reads, pass MAX_HEAD_BYTES (h11's own
            limit counts only what is still incomplete after a read, so one large read got past it)."""
            seen = self.tail + data
            end = seen.find(b"\r\n\r\n")
            size = self.head + (len(data) if end < 0 else end + 4 - len(self.tail))
            self.head, self.tail = size, seen[-3:]
            return size > MAX_HEAD_BYTES

        # -- answers the client does not read

        def pause_writing(self) -> None:
            super().pause_writing()
            self._watch_send()

        def on_response_complete(self) -> None:
            self.idle_since = time.monotonic()
            if self.transport.get_write_buffer_size():
                self._watch_send()
            super().on_response_complete()

        def _watch_send(self) -> None:
            if self.sending is None:
                self.unsent = self.transport.get_write_buffer_size()
                self.sending = self.loop.call_later(send_timeout, self._send_check)

        def _send_check(self) -> None:
            """Drop the connection if its client read nothing of the waiting answer in send_timeout
            seconds: the answer's bytes are freed, not held for a reader that may never come."""
            self.sending = None
            left = self.transport.get_write_buffer_size()
            if not left:
                return
            if left >= self.unsent:
                log.warning("dropped a connection whose client read none of its answer (%d bytes waiting) in %gs"
                            " (--send-timeout)", left, send_timeout)
                self.transport.abort()
                return
            self._watch_send()  # it reads, slowly: give it another send_timeout

        # -- half-closed clients

        def eof_received(self) -> bool | None:
            """The client shut down its side after a whole request. It may have half-closed (it still
            reads: answer it) or hung up entirely (stop its generation): a FIN looks the same. So keep
            the connection open, and let the client's kernel tell them apart: data reaching a socket
            its program closed is answered with a reset, so an HTTP/1.1 client gets an interim
            "100 Continue" at once (every HTTP/1.1 client must skip it) and the socket's error is
            polled until the answer is written."""
            if self.cycle is None or self.cycle.response_complete or self.conn.their_state in waiting:
                return None  # nothing (whole) to answer: the transport closes
            self.cycle.keep_alive = False  # close after this answer
            if not self.cycle.response_started and self.conn.their_http_version == b"1.1":
                self.cycle.waiting_for_100_continue = False
                self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                              reason=b"Continue")))
            self.probe = self.loop.call_later(0.05, self._probe_peer)
            return True

        def _probe_peer(self) -> None:
            self.probe = None
            if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
                return
            sock = self.transport.get_extra_info("socket")
            if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):  # reset: it hung up
                self.transport.abort()
                return
            self.probe = self.loop.call_later(0.25, self._probe_peer)

        def connection_lost(self, exc) -> None:
            self._disarm()
            for timer in (self.sending, self.probe):
                if timer is not None:
                    timer.cancel()
            self.sending = self.probe = None
            super().connection_lost(exc)

    return GuardedH11Protocol


# ---------------------------------------------------------------------------
# 2. requests


def _host_name(value: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: Host, Origin, API key and Content-Type checks in front of `app`.

    hosts: host names the server answers to ("*" = any); origins: other sites' origins whose
    pages may call it, e.g. "http://localhost:3000" ("*" = any); open_paths: paths served without
    the API key (the chat page itself, /health)."""

    def __init__(self, app, *, hosts: Iterable[str], origins: Iterable[str] = (), api_key: str | None = None,
                 open_paths: Iterable[str] = ()):
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key is empty, which would look like a key and check none: pass None to serve"
                             " without a key, or a non-empty key")
        self.app, self.api_key = app, api_key
        self.hosts = {_host_name(h) for h in hosts}
        self.origins = {o.rstrip("/").lower() for o in origins}
        self.open_paths = set(open_paths)

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if host and "*" not in self.hosts and _host_name(host) not in self.hosts:
            return 403, (f"this server does not answer to the Host {host[:100]!r} (it answers to"
                         f" {', '.join(sorted(self.hosts))}); to serve it, start the server with"
                         f" --allow-host {_host_name(host)[:100]}"), "host_not_allowed"
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/").lower()
        if origin and not self._own_origin(origin, host, scope) and not self._named_origin(origin):
            return 403, (f"requests from pages of {origin[:100]!r} are refused; to allow them, start the server"
                         f" with --allow-origin {origin[:100]}"), "origin_not_allowed"
        if scope["method"] == "OPTIONS":
            return None
        if self.api_key is not None and scope["path"] not in self.open_paths:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                return 401, ("this server needs an API key: send the header 'Authorization: Bearer <key>'"
                             " with the key it was started with (--api-key or LLM_API_KEY)"), "invalid_api_key"
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if kind != "application/json":
                return 415, (f"a POST body must be JSON sent with 'Content-Type: application/json', got"
                             f" {kind[:60]!r}" if kind else "a POST body must be JSON sent with 'Content-Type:"
                             " application/json', and this request names no Content-Type"), "unsupported_media_type"
        return None

    @staticmethod
    def _own_origin(origin: str, host: str, scope) -> bool:
        return bool(host) and origin == f"{scope.get('scheme', 'http')}://{host.lower()}"

    def _named_origin(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        origin = headers.get(b"origin", b"")
        cors = [] if not origin or refusal else [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        if refusal is None and scope["method"] == "OPTIONS" and cors:  # a browser asks before a cross-site call
            cors += [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                     (b"access-control-allow-headers", b"authorization, content-type"),
                     (b"access-control-max-age", b"600")]
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            return await send({"type": "http.response.body", "body": b""})
        if refusal is not None:
            status, message, code = refusal
            body = error_body(status, message, code)
            extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
            return await send({"type": "http.response.body", "body": body})
        if not cors:
            return await self.app(scope, receive, send)

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        return await self.app(scope, receive, send_cors)


# ---------------------------------------------------------------------------
# 3. answers


class AnswerLimit:
    """ASGI middleware: no answer of `app` is longer than max_bytes. An answer that declares a
    longer Content-Length is replaced by a 400 that says so (the request asked for too much at once);
    one of unknown length (a stream) ends where it reaches the limit, logged; the rest of its
    generation runs and is dropped (bounded by the context: a stream's answer is one completion,
    which at the default limit never reaches it)."""

    def __init__(self, app, *, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"sent": 0, "refused": False, "ended": False}

        async def limited(message):
            if message["type"] == "http.response.start":
                size = dict(message.get("headers", [])).get(b"content-length", b"")
                if size.isdigit() and int(size) > self.max_bytes:
                    state["refused"] = True
                    body = error_body(400, f"the answer would be {int(size)} bytes, more than this server's limit of"
                                           f" {self.max_bytes} (--max-answer-bytes); ask for less in one request"
                                           " (fewer prompts, fewer logprobs, no echo, a shorter text)", "answer_too_large")
                    await send({"type": "http.response.start", "status": 400, "headers": [
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                    return await send({"type": "http.response.body", "body": body})
                return await send(message)
            if state["refused"] or state["ended"]:  # the rest of an answer already replaced or cut
                return None
            if message["type"] != "http.response.body":
                return await send(message)
            body = message.get("body", b"")
            state["sent"] += len(body)
            if state["sent"] > self.max_bytes:
                log.warning("cut a streamed answer at %d bytes (--max-answer-bytes)", self.max_bytes)
                state["ended"] = True
                keep = len(body) - (state["sent"] - self.max_bytes)
                return await send({"type": "http.response.body", "body": body[:keep], "more_body": False})
            await send(message)

        await self.app(scope, receive, limited)


# ---------------------------------------------------------------------------
# 4. the log

log = logging.getLogger("llm.serve")


class QuietLog(logging.Filter):
    """Logs each message (its format string) at most once per `every` seconds; a connection
    error (OSError: reset, broken pipe, too many open files) loses its traceback."""

    def __init__(self, every: float = 10.0):
        super().__init__()
        self.every = every
        self.last: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, format) -> (time logged, held back)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        if record.exc_info and isinstance(record.exc_info[1], OSError):
            e = record.exc_info[1]
            record.exc_info, record.exc_text = None, None
            record.msg = f"{record.msg}: {type(e).__name__}: {str(e).replace('%', '%%')}"
        now = time.monotonic()
        when, held = self.last.get(key, (-float("inf"), 0))
        if now - when < self.every:
            self.last[key] = (when, held + 1)
            return False
        if len(self.last) > 1000:  # messages are format strings, few; this only bounds a surprise
            self.last.clear()
        self.last[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} [{held} more like this in the last {now - when:.0f}s not logged]"
        return True


def quiet_logs(loggers: Iterable[str] = ("uvicorn.error", "asyncio", "llm.serve"), every: float = 10.0) -> QuietLog:
    """Put one QuietLog on each of `loggers` that has none yet (a process may make several servers)."""
    f = QuietLog(every)
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(g, QuietLog) for g in logger.filters):
            logger.addFilter(f)
    return f
