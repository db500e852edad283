"""llm.serve's chat page (llm/tools/chat_page.html at /) in headless Chromium, driven over the DevTools
protocol: a message typed and sent with Enter comes back streamed piece by piece, and the answer
in the page is the one the API gives for the same conversation at temperature 0; a conversation
longer than the context goes on, its earliest messages forgotten (the API's "truncation": "auto",
tested here too), and the system message field is sent first.

Chromium gets no network but the server's loopback address (a proxy that does not exist and no
host name resolves), so a page that needed a CDN would fail here.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from llm.data.template import fit_context, render_prompt
from llm.tools.serve import make_app
from tests.browser import chromium
from tests.test_serve import HI, SEQ_LEN, Server, babbler, expected, post, raw, tok  # noqa: F401 (tok: a fixture)
from tests.test_serve_completions import served  # noqa: F401 (a fixture: the babbler served as "sft")

pytestmark = pytest.mark.usefixtures("one_thread")
SCREENSHOT = Path("/tmp/chat_page.png")


class DevTools:
    """The DevTools protocol of one Chromium tab, over a websocket (aiohttp's client)."""

    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)

    async def __call__(self, method: str, **params):
        i = next(self.ids)
        await self.ws.send_json({"id": i, "method": method, "params": params})
        while True:  # events arrive between answers; only ours matters
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expression: str):
        r = await self("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def until(self, expression: str, timeout: float = 60):
        end = time.monotonic() + timeout
        while not (value := await self.js(expression)):
            assert time.monotonic() < end, f"timed out waiting for {expression}"
            await asyncio.sleep(0.05)
        return value


def start_chromium(profile: Path) -> tuple[subprocess.Popen, str]:
    """Headless Chromium with a DevTools port; (process, the first tab's websocket URL)."""
    proc = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "--window-size=900,640", "--proxy-server=127.0.0.1:9",
                             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    for line in proc.stderr:
        if m := re.search(r"DevTools listening on ws://([\d.:]+)/", line):
            break
        assert time.monotonic() < end, "chromium did not open its DevTools port"
    else:
        raise RuntimeError(f"chromium exited {proc.wait()} before opening its DevTools port")
    for _ in range(100):
        pages = [t for t in raw(f"http://{m.group(1)}/json/list")[1] if t.get("type") == "page"]
        if pages:
            return proc, pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.1)
    raise RuntimeError("chromium opened no tab")


async def chat_in_page(ws_url: str, page_url: str, message: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        tab = DevTools(ws)
        await tab("Page.enable")
        await tab("Page.navigate", url=page_url)
        await tab.until("document.readyState === 'complete' && !!document.getElementById('input')")
        title = await tab.js("document.getElementById('model').textContent")
        await tab.js("""(() => { document.getElementById('temperature').value = '0';
            window.pieces = 0;  // how many times the answer's text changed: once per streamed piece
            // count records, not callbacks: pieces that arrive in one network read share a callback
            new MutationObserver(records => window.pieces += records.length).observe(document.getElementById('log'),
                {subtree: true, childList: true, characterData: true}); })()""")
        await tab.js("document.getElementById('input').focus()")
        await tab("Input.insertText", text=message)
        for kind in ("keyDown", "keyUp"):
            await tab("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      text="\r" if kind == "keyDown" else "")
        await tab.until("document.querySelector('.assistant')?.dataset.state === 'done'")
        answer = await tab.js("document.querySelector('.assistant .text').textContent")
        asked = await tab.js("document.querySelector('.user .text').textContent")
        pieces = await tab.js("window.pieces")
        shot = await tab("Page.captureScreenshot", format="png")
        SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
        await tab.js("document.getElementById('reset').click()")
        after_reset = await tab.js("document.querySelectorAll('.msg').length")
        return {"title": title, "answer": answer, "asked": asked, "pieces": pieces, "after_reset": after_reset}


@pytest.mark.slow
def test_the_chat_page_streams_the_answer_the_api_gives(tok, tmp_path):
    pytest.importorskip("aiohttp")
    if chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    server = Server(make_app(babbler(tok), tok, model_id="tiny-sft"))
    proc = None
    try:
        status, api = raw(server.url + "/v1/chat/completions",
                          json.dumps({"messages": HI, "temperature": 0}).encode())
        assert status == 200
        proc, ws_url = start_chromium(tmp_path / "profile")
        seen = asyncio.run(chat_in_page(ws_url, server.url + "/", HI[0]["content"]))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        server.close()
    want = api["choices"][0]["message"]["content"]
    assert seen["title"] == "tiny-sft" and seen["asked"] == HI[0]["content"]
    assert want and seen["answer"] == want
    assert seen["pieces"] > 5, seen  # streamed, not set once
    assert seen["after_reset"] == 0


async def converse(ws_url: str, page_url: str, system: str, texts: list[str]) -> dict:
    """Type a system message, then send `texts` one by one at temperature 0; what the page showed and
    the bodies it posted."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        tab = DevTools(ws)
        await tab("Page.enable")
        await tab("Page.navigate", url=page_url)
        await tab.until("document.readyState === 'complete' && !!document.getElementById('system')")
        await tab.js("""(() => { document.getElementById('temperature').value = '0';
            window.bodies = [];  // what the page posts, read where it leaves
            const send = window.fetch;
            window.fetch = (url, options) => { window.bodies.push(JSON.parse(options.body)); return send(url, options); };
            })()""")
        await tab.js("document.getElementById('system').focus()")
        await tab("Input.insertText", text=system)
        for i, text in enumerate(texts, start=1):
            await tab.js("document.getElementById('input').focus()")
            await tab("Input.insertText", text=text)
            await tab.js("document.getElementById('send').click()")
            await tab.until(f"document.querySelectorAll('.assistant[data-state=done], .error').length >= {i}")
        shot = await tab("Page.captureScreenshot", format="png")
        SCREENSHOT.with_name("chat_page_long.png").write_bytes(base64.b64decode(shot["data"]))
        return await tab.js("""({
            bodies: window.bodies, errors: [...document.querySelectorAll('.error')].map(e => e.textContent),
            answers: [...document.querySelectorAll('.assistant .text')].map(e => e.textContent),
            forgotten: document.querySelectorAll('.msg.forgotten').length,
            notices: [...document.querySelectorAll('.notice')].map(e => e.textContent),
            kept: messages })""")


@pytest.mark.slow
def test_a_long_conversation_in_the_page_forgets_its_earliest_turns_and_says_so(tok, tmp_path):
    """Every answer of the babbler fills the context (it never ends one), so each turn after the first
    must forget the exchange before it: the page goes on, greys out what went, says so, and sends
    the system message from its field first."""
    pytest.importorskip("aiohttp")
    if chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    model = babbler(tok)
    server = Server(make_app(model, tok, model_id="tiny-sft"))
    proc = None
    try:
        proc, ws_url = start_chromium(tmp_path / "profile")
        seen = asyncio.run(converse(ws_url, server.url + "/", "Be brief.", ["Hi", "And then?", "Once more", "Last"]))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        server.close()
    assert seen["errors"] == [] and len(seen["answers"]) == 4 and all(seen["answers"])
    system = {"role": "system", "content": "Be brief."}
    bodies = seen["bodies"]
    assert len(bodies) == 4 and all(b["truncation"] == "auto" and b["messages"][0] == system for b in bodies)
    # each request after the first forgets the exchange before it, and the next one sends only what was kept
    fits = [fit_context(b["messages"], lambda t: len(tok.encode(t, allowed_special="none")), SEQ_LEN, SEQ_LEN // 2)
            for b in bodies]
    assert [gone for _, gone in fits] == [0, 2, 2, 2]
    for (kept, _), after in zip(fits[1:], bodies[2:]):
        assert after["messages"][:len(kept)] == kept and len(after["messages"]) == len(kept) + 2
    assert seen["forgotten"] == 2 * 3 and len(seen["notices"]) == 3
    assert all("no longer fit the model's context of 64 tokens" in n for n in seen["notices"])
    # the last answer is the API's for the conversation the page still holds
    last = [system, *seen["kept"][:-1]]
    assert seen["answers"][-1] == expected(model, tok, last, SEQ_LEN - len(render_prompt(last, tok)))


def test_the_page_needs_nothing_from_elsewhere():
    page = (Path(__file__).parents[1] / "llm" / "tools" / "chat_page.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "@import" not in page


# ---------------------------------------------------------------------------
# "truncation": "auto", what the page asks for


def long_conversation(exchanges: int) -> list[dict]:
    conv = [{"role": "system", "content": "Be brief."}]
    for i in range(exchanges):
        conv += [{"role": "user", "content": f"question {i} about the slings"},
                 {"role": "assistant", "content": f"answer {i}: 12 + 7 = 19"}]
    return conv + [{"role": "user", "content": "the last one"}]


def count(tok):
    return lambda text: len(tok.encode(text, allowed_special="none"))


@pytest.mark.parametrize("stream", [False, True])
def test_truncation_auto_answers_a_conversation_longer_than_the_context_as_llm_chat_would(served, tok, stream):
    server, model = served
    conv = long_conversation(4)
    assert len(render_prompt(conv, tok)) > SEQ_LEN
    status, refused = post(server.url, {"messages": conv, "temperature": 0, "max_tokens": 8})
    assert status == 400 and refused["error"]["code"] == "context_length_exceeded"
    kept, forgotten = fit_context(conv, count(tok), SEQ_LEN, 8)
    assert forgotten >= 2
    status, body = post(server.url, {"messages": conv, "temperature": 0, "max_tokens": 8, "truncation": "auto",
                                     "stream": stream})
    assert status == 200, body
    if stream:
        chunks = [json.loads(e[len("data: "):]) for e in body.split("\n\n") if e and e != "data: [DONE]"]
        assert {c["forgotten_messages"] for c in chunks} == {forgotten}
        answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        assert body["forgotten_messages"] == forgotten
        assert body["usage"]["prompt_tokens"] == len(render_prompt(kept, tok))
        answer = body["choices"][0]["message"]["content"]
    assert answer and answer == expected(model, tok, kept, 8)


def test_without_max_tokens_truncation_leaves_half_the_context_for_the_answer(served, tok):
    conv = long_conversation(4)
    kept, forgotten = fit_context(conv, count(tok), SEQ_LEN, SEQ_LEN // 2)
    status, body = post(served[0].url, {"messages": conv, "temperature": 0, "truncation": "auto"})
    assert status == 200 and body["forgotten_messages"] == forgotten > 0
    assert body["usage"]["prompt_tokens"] == len(render_prompt(kept, tok)) <= SEQ_LEN // 2
    assert body["usage"]["total_tokens"] == SEQ_LEN  # the babbler never stops: the answer has all the rest


def test_truncation_drops_an_old_message_too_long_to_read_and_refuses_only_a_new_one(served):
    url = served[0].url
    huge = {"role": "user", "content": "x " * 20_000}
    status, body = post(url, {"messages": [huge, {"role": "assistant", "content": "no"}, *HI], "max_tokens": 4,
                              "truncation": "auto"})
    assert status == 200 and body["forgotten_messages"] == 2
    status, body = post(url, {"messages": [*HI, {"role": "assistant", "content": "no"}, huge], "max_tokens": 4,
                              "truncation": "auto"})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = post(url, {"messages": HI, "truncation": "yes"})
    assert status == 400 and 'truncation must be "auto" or "disabled"' in body["error"]["message"]
    status, body = post(url, {"messages": HI, "max_tokens": 4})
    assert status == 200 and "forgotten_messages" not in body  # OpenAI's shape unless asked
