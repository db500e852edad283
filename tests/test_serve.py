"""llm/tools/serve.py: the OpenAI-compatible server, driven by the official `openai` client against a
real server on 127.0.0.1 (a free port), plus raw HTTP for what a client library never sends.

Most tests share one server run in this process (uvicorn in a thread) so that they can look
at its engine; one slow test starts `python -m llm.serve` as a program.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llm.config import ModelConfig
from llm.data.template import BOS, END, render_prompt
from llm.data.tokenizer import Tokenizer
from llm.nn.artifacts import load_model_dir, save_model_dir
from llm.nn.model import GPT
from llm.sample.generate import generate
from llm.tools.serve import StopStrings, listen, make_app, server_config
from tests.conftest import ROOT

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ["To be, or not to be, that is the question: 12 + 7 = 19\n#### 19",
        "Whether 'tis nobler in the mind to suffer the slings and arrows", "小明有 3 个苹果。"] * 5
SEQ_LEN = 64
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(TEXT, vocab_size=300, min_frequency=1, jieba=False)


def babbler(tok: Tokenizer, seq_len: int = SEQ_LEN) -> GPT:
    """A random model that never ends an answer by itself (its special tokens all score 0, below the
    best of ~290 random logits), so every answer runs to max_tokens or a stop string."""
    m = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=seq_len, n_layer=2, n_head=4, n_kv_head=4,
                        n_embd=32, tie_embeddings=False), seed=6)
    with torch.no_grad():
        m.lm_head.weight[tok.n_base:] = 0.0
    return m.eval()


class Server:
    """uvicorn serving `app` in a thread, on a free port of 127.0.0.1."""

    def __init__(self, app, **limits):
        import uvicorn

        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = app
        self.server = uvicorn.Server(server_config(app, log_level="warning", **limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        end = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < end and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(tok):
    model = babbler(tok)
    server = Server(make_app(model, tok, model_id="sft", fingerprint="fp123"))
    yield server, model
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return served[0].client()


def raw(url: str, body: bytes | None = None, method: str | None = None, headers=None) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) of one HTTP request; errors are answers too. A body is
    declared JSON unless `headers` say otherwise."""
    headers = headers if headers is not None else {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def post(url: str, body) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return raw(url + "/v1/chat/completions", data, headers={"Content-Type": "application/json"})


def expected(model, tok, messages, max_tokens: int) -> str:
    """What llm.sample.generate answers greedily through the chat template."""
    out = generate(model, [render_prompt(messages, tok)], max_tokens, temperature=0.0, pad_id=tok.pad_id,
                   stop_ids=(tok.special[END], tok.special[BOS]))
    return tok.decode(out.responses()[0])


def ask(client, **kw):
    return client.chat.completions.create(model="sft", messages=kw.pop("messages", HI), **kw)


# ---------------------------------------------------------------------------
# with the openai client


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list()] == ["sft"]
    status, body = raw(served[0].url + "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == "sft" and body["context"] == SEQ_LEN


def test_a_greedy_answer_is_what_generate_gives_through_the_chat_template(served, client, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}]
    r = ask(client, messages=msgs, temperature=0, max_tokens=12)
    want = expected(served[1], tok, msgs, 12)
    assert want and r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
    assert r.model == "sft" and r.system_fingerprint == "fp123"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(render_prompt(msgs, tok)), 12)


def test_streaming_gives_the_same_answer_in_pieces(client):
    whole = ask(client, temperature=0.9, seed=3, max_tokens=15).choices[0].message.content
    chunks = list(ask(client, temperature=0.9, seed=3, max_tokens=15, stream=True,
                      stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole and len([p for p in pieces if p]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 15


def test_the_event_stream_ends_with_done(served):
    status, text = post(served[0].url, {"messages": HI, "max_tokens": 3, "stream": True})
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_the_seed_decides_the_sample(client):
    answers = [ask(client, temperature=1.0, seed=s, max_tokens=10).choices[0].message.content for s in (7, 7, 8)]
    assert answers[0] == answers[1] != answers[2]


def test_fields_at_their_do_nothing_values_are_accepted(client):
    r = ask(client, max_tokens=2, frequency_penalty=0, presence_penalty=0, logprobs=False, n=1, user="u",
            response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"


def test_top_p_that_keeps_one_token_is_greedy(client):
    greedy = ask(client, temperature=0, max_tokens=10).choices[0].message.content
    assert ask(client, temperature=1.5, top_p=1e-9, seed=1, max_tokens=10).choices[0].message.content == greedy


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_before_it(client, stream):
    full = ask(client, temperature=0, max_tokens=30).choices[0].message.content
    stop = full[10:13]
    want = full[:full.index(stop)]
    if stream:
        chunks = [c for c in ask(client, temperature=0, max_tokens=30, stop=["not in it", stop], stream=True)]
        got = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = ask(client, temperature=0, max_tokens=30, stop=stop)
        got, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert got == want and finish == "stop"


def test_eight_concurrent_clients_each_get_their_own_seeded_answer(served, client):
    seeds = list(range(100, 108))
    alone = {s: ask(client, temperature=1.0, seed=s, max_tokens=12).choices[0].message.content for s in seeds}

    def one(seed):
        return seed, ask(served[0].client(), temperature=1.0, seed=seed, max_tokens=12).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        together = dict(pool.map(one, seeds))
    assert together == alone and len(set(alone.values())) == 8


def test_an_answer_that_the_model_ends_finishes_with_stop(tok):
    end = tok.special[END]

    class Terse(GPT):  # always says <|end|> first
        def logits(self, h):
            return super().logits(h).index_fill(-1, torch.tensor([end]), 1e4)

    m = Terse(babbler(tok).config, seed=0).eval()
    server = Server(make_app(m, tok, model_id="sft"))
    try:
        r = ask(server.client(), temperature=0)
    finally:
        server.close()
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_server_answers_and_a_seed_reproduces(tok):
    server = Server(make_app(babbler(tok).cuda(), tok, model_id="sft"))
    try:
        c = server.client()
        a, b = (ask(c, temperature=1.0, seed=5, max_tokens=8).choices[0] for _ in range(2))
    finally:
        server.close()
    assert a.message.content == b.message.content and a.finish_reason == "length"


# ---------------------------------------------------------------------------
# a full queue


def test_a_full_queue_answers_503_and_the_waiting_requests_are_still_served(tok):
    gate, entered = threading.Event(), threading.Event()

    class Gated(GPT):
        def hidden_states(self, *a, **kw):
            entered.set()
            assert gate.wait(20), "the test never opened the gate"
            return super().hidden_states(*a, **kw)

    m = Gated(babbler(tok).config, seed=0)
    m.load_state_dict(babbler(tok).state_dict())
    server = Server(make_app(m.eval(), tok, model_id="sft", max_queue=1))
    try:
        results = {}

        def run(name):
            results[name] = ask(server.client(), temperature=0, max_tokens=4).choices[0].finish_reason

        first = threading.Thread(target=run, args=("running",))
        first.start()
        assert entered.wait(30)  # the worker is generating the first request...
        second = threading.Thread(target=run, args=("queued",))
        second.start()
        end = time.monotonic() + 30
        while raw(server.url + "/health")[1]["queued"] < 1:  # ...and the second waits in the queue
            assert time.monotonic() < end
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as e:
            ask(server.client(), max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "overloaded"
        gate.set()
        first.join(60)
        second.join(60)
        assert results == {"running": "length", "queued": "length"}
    finally:
        gate.set()
        server.close()


def test_a_client_that_goes_away_mid_stream_frees_the_worker(tok):
    class Slow(GPT):  # 0.1 s per token: 50 tokens take 5 s
        def hidden_states(self, *a, **kw):
            time.sleep(0.1)
            return super().hidden_states(*a, **kw)

    m = Slow(babbler(tok).config, seed=0).eval()
    server = Server(make_app(m, tok, model_id="sft"))
    try:
        body = json.dumps({"messages": HI, "max_tokens": 50, "stream": True}).encode()
        r = urllib.request.urlopen(urllib.request.Request(server.url + "/v1/chat/completions", body,
                                                          headers={"Content-Type": "application/json"}), timeout=30)
        assert r.readline().startswith(b"data: ")
        r.close()
        t0 = time.monotonic()
        while raw(server.url + "/health")[1]["running"]:
            assert time.monotonic() - t0 < 2.5, "the worker kept generating for a client that left"
            time.sleep(0.05)
    finally:
        server.close()


# ---------------------------------------------------------------------------
# what no client library sends: every one a 4xx in OpenAI's error shape, never a crash


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN is not valid JSON"),
    (b"\xff\xfe{}", 400, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ([1, 2], 400, "JSON object"),
    ({}, 400, "messages must be"),
    ({"messages": []}, 400, "messages must be"),
    ({"messages": ["hi"]}, 400, "messages[0] must be an object"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text parts"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "lone surrogate"),
    ({"messages": HI, "temperature": "hot"}, 400, "temperature must be a number"),
    ({"messages": HI, "temperature": 3}, 400, "temperature must be in [0, 2]"),
    ({"messages": HI, "temperature": 1e-300}, 400, "temperature must be 0 (greedy)"),
    ({"messages": HI, "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"messages": HI, "max_tokens": 0}, 400, "max_tokens must be an integer"),
    ({"messages": HI, "max_tokens": 2.5}, 400, "max_tokens must be an integer"),
    ({"messages": HI, "max_tokens": True}, 400, "max_tokens must be an integer"),
    ({"messages": HI, "max_tokens": 10**30}, 400, "max_tokens must be an integer"),
    ({"messages": HI, "max_tokens": 60}, 400, "ask for at most 58"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop must be"),
    ({"messages": HI, "stop": [""]}, 400, "stop must be"),
    ({"messages": HI, "seed": "x"}, 400, "seed must be an integer"),
    ({"messages": HI, "stream": "yes"}, 400, "stream must be true or false"),
    ({"messages": HI, "n": 2}, 400, "n: this server returns one choice"),
    ({"messages": HI, "tools": [{"type": "function"}]}, 400, "tools is not supported"),
    ({"messages": HI, "logprobs": True}, 400, "logprobs is not supported"),
    ({"messages": HI, "frequency_penalty": 0.5}, 400, "frequency_penalty is not supported"),
    ({"messages": HI, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": HI, "model": "gpt-5"}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "x " * 100}]}, 400, "this model's context is 64 tokens"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[f"{i}:{b[2][:20]}" for i, b in enumerate(BAD)])
def test_malformed_requests_get_a_4xx_json_error(served, body, status, message):
    got, answer = post(served[0].url, body)
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert message in answer["error"]["message"]
    assert raw(served[0].url + "/health")[0] == 200


def test_a_prompt_longer_than_the_context_is_refused_with_its_length(served, client, tok):
    msgs = [{"role": "user", "content": "x " * 100}]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, messages=msgs)
    n = len(render_prompt(msgs, tok))
    assert f"the messages are {n} tokens" in e.value.body["message"]
    assert e.value.body["code"] == "context_length_exceeded"


def test_an_oversized_body_is_413_whether_declared_or_not(tok):
    server = Server(make_app(babbler(tok), tok, model_id="sft", max_request_bytes=1000))
    try:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]}).encode()
        status, body = post(server.url, big)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert post(server.url, {"messages": HI, "max_tokens": 2})[0] == 200
    finally:
        server.close()


@pytest.mark.parametrize("path,method,status", [("/v1/nothing", "GET", 404), ("/v1/chat/completions", "GET", 405),
                                                ("/v1/models/gpt-5", "GET", 404), ("/health", "POST", 405)])
def test_unknown_paths_and_methods_get_json_errors(served, path, method, status):
    got, body = raw(served[0].url + path, b"{}" if method == "POST" else None, method=method)
    assert got == status and "message" in body["error"]


def test_stop_strings_hold_back_only_what_could_begin_one():
    s = StopStrings(("END", "xyz"))
    assert [s.feed(p) for p in ["abc E", "N", "D tail"]] == ["abc ", "", ""] and s.hit
    s = StopStrings(("END",))
    assert [s.feed(p) for p in ["aE", "Nb", "EN"]] + [s.flush()] == ["a", "ENb", "", "EN"] and not s.hit


# ---------------------------------------------------------------------------
# the program


@pytest.mark.slow
def test_the_program_serves_on_a_free_port_and_stops_on_sigint(tok, tmp_path):
    import signal

    save_model_dir(tmp_path / "sft", babbler(tok), tok, {"stage": "sft"})
    proc = subprocess.Popen([sys.executable, "-m", "llm.serve", str(tmp_path / "sft"), "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "serving sft (...) at http://127.0.0.1:PORT/v1"
        assert line.startswith("serving sft") and "http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" at ")[-1].strip()
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        m, _, _ = load_model_dir(tmp_path / "sft")
        assert c.chat.completions.create(model="sft", messages=HI, temperature=0, max_tokens=6
                                         ).choices[0].message.content == expected(m, tok, HI, 6)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_command_lines_are_clear_errors(tmp_path, capsys):
    from llm.tools.serve import main
    for argv, why in [(["--port", "70000"], "[0, 65535]"), (["--max-queue", "0"], ">= 1"),
                      (["--device", "toaster"], "not a torch device")]:
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path), *argv])
        assert e.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing")])
    assert e.value.code == 1 and "no model directory" in capsys.readouterr().err
