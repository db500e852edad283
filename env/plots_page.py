"""Write the `dvc plots show` page template with Vega inside it, so that a page written anywhere
(`dvc plots show -o DIR`, `dvc plots diff -o DIR`, a folder copied to another machine) draws its
plots with no network and no venv beside it.

    python env/plots_page.py env/dvc_plots.html .venv/share/vega .venv/share/vega/dvc_plots.html

env/dvc_plots.html loads Vega, Vega-Lite and Vega-Embed by a path relative to the page
(`../.venv/share/vega/<file>`), which holds only for an output folder directly under the
repository root. This replaces each of those script tags by the file itself (about 0.8 MB per
page). The setup (env/_common.sh) runs it once Vega is in the venv and points DVC's
`plots.html_template` at the result in `.dvc/config.local` (not tracked by git).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

SCRIPT = re.compile(r'<script src="\.\./\.venv/share/vega/([A-Za-z0-9_.-]+\.js)"></script>')


def inline(template: str, vega_dir: Path) -> str:
    """`template` with each `<script src="../.venv/share/vega/NAME">` replaced by NAME's text from
    `vega_dir`. Raises FileNotFoundError naming a missing file, ValueError for a template with no
    such tag or a script that would end the tag early."""
    names = SCRIPT.findall(template)
    if not names:
        raise ValueError("the template loads no script from ../.venv/share/vega/: nothing to inline")

    def body(m: re.Match) -> str:
        path = vega_dir / m.group(1)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; run `bash env/setup_cpu.sh` (it fetches Vega with npm)")
        js = path.read_text(encoding="utf-8")
        if "</script" in js.lower():
            raise ValueError(f"{path} contains '</script', which would end the inline script early")
        return f"<script>/* {m.group(1)}, inlined by env/plots_page.py */\n{js}\n</script>"

    return SCRIPT.sub(body, template)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    template, vega_dir, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    try:
        page = inline(template.read_text(encoding="utf-8"), vega_dir)
    except (OSError, ValueError) as e:
        print(f"plots_page: {e}", file=sys.stderr)
        return 1
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    print(f"plots_page: wrote {out} ({len(page.encode()) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
