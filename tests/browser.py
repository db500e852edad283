"""Open a local page in headless Chromium with networking off and read back its DOM.

    python -m tests.browser dvc_plots/index.html     # CI: every Vega plot of `dvc plots show` drawn?

Networking is off three ways: an empty network namespace where `unshare -rn` works (root, or
unprivileged user namespaces), every host name unresolvable, and a proxy that does not exist.
A page that needs anything from the network (a CDN script) therefore fails here as it would on
a machine with no network.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def chromium() -> str | None:
    """The Chromium binary on PATH, or None (Debian: `apt-get install -y chromium`)."""
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def offline_dom(page: str | Path, budget_ms: int = 10000) -> str:
    """The DOM of `page` after it has loaded and run its scripts for up to `budget_ms` of virtual time."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("chromium is not installed (apt-get install -y chromium)")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", f"--virtual-time-budget={budget_ms}",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", Path(page).resolve().as_uri()]
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0:
        cmd = ["unshare", "-rn", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        raise RuntimeError(f"chromium exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def vega_plots(page: str | Path) -> tuple[int, int]:
    """(Vega plots the page of `dvc plots show` defines, plots drawn offline): a drawn plot is a
    vega-embed container holding a canvas or an svg of marks."""
    wanted = len(re.findall(r"vegaEmbed\('#", Path(page).read_text(encoding="utf-8")))
    dom = offline_dom(page)
    drawn = len(re.findall(r'<(?:canvas|svg)[^>]*class="marks"', dom))
    return wanted, drawn


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tests.browser PAGE.html", file=sys.stderr)
        return 2
    wanted, drawn = vega_plots(argv[0])
    print(f"{argv[0]}: {drawn} of {wanted} Vega plots drawn with no network")
    return 0 if wanted and drawn == wanted else 1


if __name__ == "__main__":
    raise SystemExit(main())
