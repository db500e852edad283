"""llm.serve's chat page (llm/chat_page.html at /) in headless Chromium, driven over the DevTools
protocol: a message typed and sent with Enter comes back streamed piece by piece, and the answer
in the page is the one the API gives for the same conversation at temperature 0.

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

from llm.serve import make_app
from tests.browser import chromium
from tests.test_serve import HI, Server, babbler, raw, tok  # noqa: F401 (tok is a fixture)

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


def test_the_page_needs_nothing_from_elsewhere():
    page = (Path(__file__).parents[1] / "llm" / "chat_page.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "@import" not in page
