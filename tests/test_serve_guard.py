"""llm/tools/serve_guard.py and llm.serve's limits: each defence against a hostile client or web page on
its own (small, fast), then one load test of the real program under all of them at once.

Every test talks to a real server on 127.0.0.1, through raw sockets where a polite client
library would not misbehave enough.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

from llm.nn.model import GPT
from llm.tools.serve import make_app
from llm.tools.serve_guard import LOCAL_HOSTS, Guard, QuietLog
from tests.conftest import ROOT
from tests.test_serve import HI, Server, babbler, expected, raw, tok  # noqa: F401 (tok is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(tok):
    model = babbler(tok)
    server = Server(make_app(model, tok, model_id="sft"))
    yield server
    server.close()


def chat(url: str, headers: dict | None = None, body: dict | bytes | None = None) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body or {"messages": HI, "max_tokens": 2}).encode()
    return raw(url + "/v1/chat/completions", data, headers={**JSON, **(headers or {})})


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def recv_all(sock: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


# ---------------------------------------------------------------------------
# web pages: Host, Origin, Content-Type


def test_a_foreign_host_header_is_refused(served):
    status, body = chat(served.url, {"Host": "attacker.example"})
    assert status == 403 and body["error"]["code"] == "host_not_allowed"
    assert "--allow-host attacker.example" in body["error"]["message"]
    assert chat(served.url, {"Host": "localhost:1234"})[0] == 200


def test_allow_host_lets_a_named_host_in(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", hosts=("box.lan",)))
    try:
        assert chat(server.url, {"Host": "box.lan:80"})[0] == 200
        assert chat(server.url, {"Host": "other.lan"})[0] == 403
    finally:
        server.close()


def test_a_foreign_origin_is_refused_and_the_own_origin_served(served):
    status, body = chat(served.url, {"Origin": "http://attacker.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    assert chat(served.url, {"Origin": "null"})[0] == 403  # a sandboxed frame or a file:// page
    assert chat(served.url, {"Origin": served.url})[0] == 200  # the chat page itself


def test_an_allowed_origin_gets_cors_answers(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", origins=("http://localhost:3000",)))
    try:
        ask = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
        s = connect(server.url)
        s.sendall(b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  + b"".join(f"{k}: {v}\r\n".encode() for k, v in ask.items()) + b"Connection: close\r\n\r\n")
        preflight = recv_all(s).decode().lower()
        s.close()
        assert preflight.startswith("http/1.1 204") and "access-control-allow-origin: http://localhost:3000" in preflight
        assert chat(server.url, {"Origin": "http://localhost:3000"})[0] == 200
        assert chat(server.url, {"Origin": "http://localhost:3001"})[0] == 403
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_body_not_declared_json_is_415_and_nothing_runs(served, kind):
    steps = served.app.state.engine.steps
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    status, answer = raw(served.url + "/v1/chat/completions", body, headers={"Content-Type": kind} if kind else {})
    assert status == 415 and answer["error"]["code"] == "unsupported_media_type"
    assert served.app.state.engine.steps == steps


def test_with_an_api_key_set_v1_needs_it(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", api_key="s3cret"))
    try:
        status, body = chat(server.url)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert chat(server.url, {"Authorization": "Bearer wrong"})[0] == 401
        assert chat(server.url, {"Authorization": "Bearer s3cret"})[0] == 200
        assert raw(server.url + "/v1/models")[0] == 401
        assert raw(server.url + "/health")[0] == 200 and raw(server.url + "/")[0] == 200
    finally:
        server.close()


def test_the_api_key_comes_from_the_environment(monkeypatch):
    from llm.tools.serve import _parser
    monkeypatch.setenv("LLM_API_KEY", "from-env")
    assert _parser().parse_args(["m"]).api_key == "from-env"
    assert _parser().parse_args(["m", "--api-key", "k"]).api_key == "k"
    monkeypatch.delenv("LLM_API_KEY")
    assert _parser().parse_args(["m"]).api_key is None


def test_an_empty_api_key_is_refused_at_start_up(monkeypatch, capsys):
    from llm.tools.serve import main
    for env, argv in (("", ["m"]), ("k", ["m", "--api-key", " "])):
        monkeypatch.setenv("LLM_API_KEY", env)
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "LLM_API_KEY" in err and "empty" in err and "unset" in err
    with pytest.raises(ValueError, match="empty"):
        Guard(None, hosts=LOCAL_HOSTS, api_key="")


# ---------------------------------------------------------------------------
# memory: bodies and prompts


def test_a_body_declared_too_large_is_413_before_it_is_sent(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", max_request_bytes=1000))
    try:
        s = connect(server.url)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n" + b" " * 1000)  # 1 kB of the 50 MB it announced
        answer = recv_all(s, timeout=10)
        s.close()
        assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
    finally:
        server.close()


def test_a_chunked_body_is_cut_off_at_the_limit_while_it_streams(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", max_request_bytes=1000))
    try:
        s = connect(server.url)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):  # 1.5 kB of an endless body
            s.sendall(b"1f4\r\n" + b" " * 500 + b"\r\n")
        answer = recv_all(s, timeout=10)
        s.close()
        assert answer.startswith(b"HTTP/1.1 413")
    finally:
        server.close()


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(served, tok, monkeypatch):
    calls = []
    monkeypatch.setattr(type(tok), "encode", lambda self, *a, **kw: calls.append(1) or [])
    status, body = chat(served.url, body={"messages": [{"role": "user", "content": " " * 500_000}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and "bytes of text" in body["error"]["message"]
    assert calls == []


def test_the_tokenizer_cache_keeps_no_long_chunk(tok):
    text = " " * 10_000 + "x" + "\n" * 5000
    fresh = type(tok)(tok.merges, list(tok.special), tok.pattern)
    ids = fresh.encode(text)
    assert fresh.decode(ids) == text and ids == fresh.encode(text)
    assert fresh._cache and max(map(len, fresh._cache)) < 1000  # the runs of blanks were not kept


def test_tokenize_never_holds_up_chat_and_its_queue_is_bounded(tok, monkeypatch):
    """/tokenize counts long texts (here made to take 0.2 s a piece) on a path of its own: a chat
    request behind four of them is answered at once; more than --max-queue waiting get 503."""
    lengths = []

    def slow_encode(self, text, *a, _encode=type(tok).encode, **kw):
        lengths.append(len(text))
        if len(text) > 1000:
            time.sleep(0.2)
        return _encode(self, text, *a, **kw)

    monkeypatch.setattr(type(tok), "encode", slow_encode)
    server = Server(make_app(babbler(tok), tok, model_id="sft", max_queue=3))
    try:
        long = json.dumps({"prompt": "x " * 20_000}).encode()
        results = []
        counters = [threading.Thread(target=lambda: results.append(raw(server.url + "/tokenize", long)))
                    for _ in range(5)]
        for t in counters:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert chat(server.url)[0] == 200
        waited = time.monotonic() - t0
        for t in counters:
            t.join()
        assert waited < 0.8, f"a chat request waited {waited:.1f} s behind /tokenize"
        statuses = sorted(status for status, _ in results)
        assert statuses == [200] * 4 + [503], statuses  # one counting, 3 waiting, one refused
        assert [body["count"] for status, body in results if status == 200] == [40_000] * 4
        assert max(lengths) < 20_000  # counted in pieces, never the whole 40,000 characters at once
        s = connect(server.url)  # bounded by --max-request-bytes, as every endpoint
        s.sendall(post_head(2 << 20).replace(b"/v1/chat/completions", b"/tokenize") + b" " * 1000)
        assert recv_all(s).startswith(b"HTTP/1.1 413")
        s.close()
    finally:
        server.close()


# ---------------------------------------------------------------------------
# clients that leave, stall or crowd


class Slow(GPT):
    """0.05 s per decoding step. It has biases, so generation takes the plain path through
    hidden_states (llm.sample.generate's fast CPU decoder, which skips it, takes no model with biases)."""

    def __init__(self, config, **kw):
        super().__init__(dataclasses.replace(config, bias=True), **kw)

    def hidden_states(self, *a, **kw):
        time.sleep(0.05)
        return super().hidden_states(*a, **kw)


def test_a_non_streaming_client_that_hangs_up_stops_its_generation(tok):
    model = Slow(babbler(tok).config, seed=0).eval()
    server = Server(make_app(model, tok, model_id="sft"))
    engine = server.app.state.engine
    try:
        body = json.dumps({"messages": HI, "max_tokens": 50}).encode()  # 2.5 s if it ran to the end
        s = connect(server.url)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        end = time.monotonic() + 10
        while engine.steps < 3:
            assert time.monotonic() < end
            time.sleep(0.01)
        s.close()
        t0 = time.monotonic()
        while engine.running:
            assert time.monotonic() - t0 < 1.5, "the worker kept generating for a client that left"
            time.sleep(0.02)
        assert engine.steps < 50
    finally:
        server.close()


def test_a_silent_or_trickling_client_is_dropped_after_the_request_timeout(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft"), request_timeout=1.0)
    try:
        silent, trickle = connect(server.url), connect(server.url)
        t0 = time.monotonic()
        closed_at = None
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 100:
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                break
            trickle.settimeout(0.1)
            try:
                if trickle.recv(1) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
        assert closed_at is not None and closed_at < 3, "the server kept a slowloris connection open"
        assert recv_all(silent, timeout=3) == b""  # closed, never answered
        assert raw(server.url + "/health")[0] == 200
    finally:
        server.close()


def test_over_the_connection_cap_the_oldest_idle_connection_is_closed_first(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft"), max_connections=3)
    try:
        held = []
        for _ in range(3):
            held.append(connect(server.url))
            time.sleep(0.05)  # so that each is idle longer than the next
        newcomer = connect(server.url)
        newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert recv_all(newcomer).startswith(b"HTTP/1.1 200")
        assert recv_all(held[0], timeout=2) == b""  # the oldest: closed to let the newcomer in
        held[1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert recv_all(held[1]).startswith(b"HTTP/1.1 200")  # the others still served
        for s in held + [newcomer]:
            s.close()
    finally:
        server.close()


def test_health_answers_while_70_idle_connections_are_open(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft"))  # the default cap, 64
    try:
        idle = [connect(server.url) for _ in range(70)]
        time.sleep(0.2)
        assert [raw(server.url + "/health")[0] for _ in range(15)] == [200] * 15
        for s in idle:
            s.close()
    finally:
        server.close()


def test_connections_over_the_cap_get_503_only_while_every_one_is_answering(tok):
    model = Slow(babbler(tok).config, seed=0).eval()
    server = Server(make_app(model, tok, model_id="sft"), max_connections=2)
    try:
        body = json.dumps({"messages": HI, "max_tokens": 20}).encode()  # 1 s each
        busy = [connect(server.url) for _ in range(2)]
        for s in busy:
            s.sendall(post_head(len(body)) + body)
        time.sleep(0.3)
        extra = connect(server.url)
        answer = recv_all(extra, timeout=5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        assert all(recv_all(s, timeout=10).startswith(b"HTTP/1.1 200") for s in busy)
        for s in busy + [extra]:
            s.close()
        assert raw(server.url + "/health")[0] == 200
    finally:
        server.close()


def test_headers_over_16_kib_get_431_and_under_are_served(served):
    def health(pad: int, pieces: int) -> bytes:
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * pad + b"\r\nConnection: close\r\n\r\n"
        s = connect(served.url)
        step = -(-len(request) // pieces)
        for i in range(0, len(request), step):
            s.sendall(request[i:i + step])
            time.sleep(0.02)
        answer = recv_all(s)
        s.close()
        return answer

    for pieces in (1, 3):  # in one read, which h11's own limit let through up to 64 KiB, and across reads
        assert health(15_000, pieces).startswith(b"HTTP/1.1 200")
        too_big = health(17_000, pieces)
        assert too_big.startswith(b"HTTP/1.1 431") and b"headers_too_large" in too_big
    assert health(60_000, 1).startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_a_client_that_half_closes_after_its_request_gets_the_answer(served, version):
    body = json.dumps({"messages": HI, "max_tokens": 3}).encode()
    s = connect(served.url)
    s.sendall(post_head(len(body)).replace(b"HTTP/1.1", b"HTTP/" + version) + body)
    s.shutdown(socket.SHUT_WR)  # "I have sent everything", as `nc -N` or a shell's here-document does
    answer = recv_all(s)
    s.close()
    final = answer.split(b"HTTP/1.1 ")[-1]  # after the interim 100 Continue, if any
    assert final.startswith(b"200")
    assert json.loads(final.split(b"\r\n\r\n", 1)[1])["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------
# answers: their size, and clients that never read them


def echo_logprobs(n_prompts: int) -> bytes:
    """A /v1/completions request of ~250 bytes a prompt whose answer is ~40 KB a prompt."""
    ids = list(range(3, 3 + 63))
    return json.dumps({"model": "sft", "prompt": [ids] * n_prompts, "max_tokens": 0, "echo": True,
                       "logprobs": 20}).encode()


def test_an_answer_over_the_limit_is_refused_and_a_stream_is_cut_there(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", max_answer_bytes=100_000))
    try:
        assert raw(server.url + "/v1/completions", echo_logprobs(1))[0] == 200
        status, body = raw(server.url + "/v1/completions", echo_logprobs(10))
        assert status == 400 and body["error"]["code"] == "answer_too_large"
        assert "--max-answer-bytes" in body["error"]["message"]
    finally:
        server.close()
    server = Server(make_app(babbler(tok), tok, model_id="sft", max_answer_bytes=2000))
    try:
        status, text = raw(server.url + "/v1/chat/completions", json.dumps(
            {"messages": HI, "max_tokens": 40, "stream": True}).encode())
        assert status == 200 and 1000 < len(text.encode()) <= 2000 and "[DONE]" not in text
    finally:
        server.close()


def test_answers_their_clients_never_read_are_dropped_after_the_send_timeout(tok):
    """Clients that ask for a 4 MB answer each and never read it: after --send-timeout the server
    holds none of it, and its memory is back near where it started."""
    import gc

    import psutil

    server = Server(make_app(babbler(tok), tok, model_id="sft"), send_timeout=2.0)
    state = server.server.server_state
    try:
        request = post_head(0).replace(b"/v1/chat/completions", b"/v1/completions")
        body = echo_logprobs(100)
        request = request.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body)) + body
        assert raw(server.url + "/v1/completions", body)[0] == 200  # warm: the first answer's allocations
        gc.collect()
        start = psutil.Process().memory_info().rss / 2**20
        readers = []
        for _ in range(4):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # so that the kernel holds little of it
            s.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
            s.sendall(request)
            readers.append(s)
        held, end = 0, time.monotonic() + 30
        while not state.connections and time.monotonic() < end:
            time.sleep(0.05)
        while state.connections:
            held = max(held, sum(c.transport.get_write_buffer_size() for c in list(state.connections)))
            assert time.monotonic() < end, f"{len(state.connections)} connections still hold unread answers"
            time.sleep(0.05)
        assert held > 1 << 20, f"the test meant answers to wait unread, but at most {held} bytes did"
        gc.collect()
        after = psutil.Process().memory_info().rss / 2**20
        print(f"\nRSS {start:.0f} MB at start, {after:.0f} MB after; {held / 2**20:.1f} MB of answers held at most")
        assert after < start + 20
        assert raw(server.url + "/health")[0] == 200
        for s in readers:
            s.close()
    finally:
        server.close()


def test_unknown_paths_name_every_endpoint(served):
    status, body = raw(served.url + "/v1/nothing")
    assert status == 404
    for endpoint in ("GET /", "GET /health", "GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions",
                     "POST /tokenize"):
        assert endpoint in body["error"]["message"]


def test_the_log_says_an_expected_client_error_once_in_one_line():
    f = QuietLog(every=60)
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except OSError:
        import sys as _sys
        info = _sys.exc_info()
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 None, info) for _ in range(100)]
    kept = [r for r in records if f.filter(r)]
    assert len(kept) == 1 and kept[0].exc_info is None and "Connection reset by peer" in kept[0].getMessage()


def test_every_option_says_what_it_does():
    from llm.tools.serve import _parser
    assert all(a.help for a in _parser()._actions), [a.dest for a in _parser()._actions if not a.help]


# ---------------------------------------------------------------------------
# all at once, against the program


def rss_mb(pid: int) -> float:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


def one_request(url: str, head: bytes, body: bytes, hang_up_after: float | None = None) -> bytes:
    s = connect(url)
    try:
        s.sendall(head + body)
        if hang_up_after is not None:
            time.sleep(hang_up_after)
            return b""
        return recv_all(s, timeout=30)
    except OSError:
        return b""
    finally:
        s.close()


def post_head(body_len: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % body_len)


@pytest.mark.slow
def test_the_program_holds_under_hostile_load(tok, tmp_path):
    """Oversized and whitespace bodies, clients that hang up mid-answer and 200 idle sockets; then
    a normal request is answered right, memory is back near where it started, the log is short."""
    from concurrent.futures import ThreadPoolExecutor

    import psutil  # noqa: F401 (fail early if missing)

    from llm.nn.artifacts import load_model_dir, save_model_dir

    save_model_dir(tmp_path / "sft", babbler(tok, seq_len=256), tok, {"stage": "sft"})
    log = (tmp_path / "stderr.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "llm.serve", str(tmp_path / "sft"), "--port", "0",
                             "--max-connections", "300", "--request-timeout", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = proc.stdout.readline().split(" at ")[-1].strip().removesuffix("/v1")
        assert url.startswith("http://127.0.0.1:"), log.read()
        assert raw(url + "/health")[0] == 200
        msgs = [{"role": "user", "content": "Hi there"}]
        ok = json.dumps({"messages": msgs, "max_tokens": 20, "temperature": 0}).encode()
        assert b" 200 OK" in one_request(url, post_head(len(ok)), ok)
        start = rss_mb(proc.pid)
        peak, t0 = start, time.monotonic()

        def whitespace(i: int) -> bytes:  # distinct near-megabyte prompts of blanks
            return json.dumps({"messages": [{"role": "user", "content": " " * (900_000 + i)}]}).encode()

        with ThreadPoolExecutor(16) as pool:
            big = [pool.submit(one_request, url, post_head(2_000_000), b" " * 100_000) for _ in range(30)]
            blank = [pool.submit(one_request, url, post_head(len(b)), b) for b in map(whitespace, range(60))]
            long = json.dumps({"messages": msgs, "max_tokens": 200}).encode()
            gone = [pool.submit(one_request, url, post_head(len(long)), long, 0.2) for _ in range(16)]
            idle = [connect(url) for _ in range(200)]
            health_while_idle = raw(url + "/health")[0]
            for f in big + blank + gone:
                f.result()
                peak = max(peak, rss_mb(proc.pid))
        statuses = [f.result()[:12] for f in big + blank]
        assert all(s == b"HTTP/1.1 413" for s in statuses[:30]), statuses[:30]
        assert all(s == b"HTTP/1.1 400" for s in statuses[30:]), statuses[30:]
        assert health_while_idle == 200
        time.sleep(2.5)  # the request timeout closes the idle sockets
        assert sum(recv_all(s, timeout=0.5) == b"" for s in idle) == 200
        for s in idle:
            s.close()
        answer = one_request(url, post_head(len(ok)), ok)
        m, _, _ = load_model_dir(tmp_path / "sft")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == expected(m, tok, msgs, 20)
        end = rss_mb(proc.pid)
        print(f"\nRSS: {start:.0f} MB at start, peak {peak:.0f} MB, {end:.0f} MB after;"
              f" {time.monotonic() - t0:.1f} s of load")
        assert end < start + 150
        log.seek(0)
        text = log.read()
        assert "Traceback" not in text and len(text) < 100_000, text[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
