"""What keeps llm.serve standing in front of hostile clients and hostile web pages.

Three layers, each small enough to read on its own:

1. `guarded_protocol`: uvicorn's h11 connection with two limits uvicorn lacks. A request must
   arrive whole (headers and body) within `request_timeout` seconds of the connection opening
   or of the previous answer, so a client that sends nothing, or its headers a byte at a time
   (slowloris), is dropped; and a connection beyond `max_connections` open ones is answered
   503 at once and closed, before it can hold a file descriptor. Idle keep-alive connections
   are closed by uvicorn's own `timeout_keep_alive`; headers over h11's 16 KiB limit are 400.
2. `Guard`, an ASGI middleware: the request's Host must be one the server answers to and its
   Origin, when a browser sends one, the server's own or one allowed by name. Together these
   stop a web page from driving the server through the visitor's browser (DNS rebinding gives
   the page a foreign Host; a cross-site form or `fetch` carries the page's Origin). A POST body
   must be declared `application/json` (415 otherwise): a page can send `text/plain` across
   sites without asking the browser first, never `application/json`. With an API key set,
   /v1/... and the tokenizer endpoints need `Authorization: Bearer <key>` (401).
3. `QuietLog`, a logging filter: client errors that the server expects (a reset connection, a
   malformed request, running out of file descriptors while accepting) are logged as one line
   without a traceback, and any one message at most once per `every` seconds with a count of
   those held back, so a flood of bad clients cannot fill the disk with the log.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Iterable

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error shape, as llm.serve writes every error."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


# ---------------------------------------------------------------------------
# 1. connections


def guarded_protocol(max_connections: int, request_timeout: float):
    """A subclass of uvicorn's H11Protocol with a connection cap and a whole-request deadline
    (pass it as uvicorn.Config(http=...))."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = error_body(503, f"the server has {max_connections} connections open, its limit; retry later",
                      "too_many_connections")
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    waiting = (h11.IDLE, h11.SEND_BODY)  # the client's side: still owes us (part of) a request

    class GuardedH11Protocol(H11Protocol):
        deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # this one included
                log.warning("refused a connection: %d are open, the limit (--max-connections)",
                            len(self.connections) - 1)
                transport.write(refusal)
                transport.close()
                return
            self._arm()

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
            if self.deadline is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on a kept-alive connection begins
            super().data_received(data)
            if self.conn.their_state not in waiting:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
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
# 3. the log

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
