#!/usr/bin/env bash
# Set up the project's virtual environment for CPU: <repo>/.venv with the CPU build of torch.
#
#   env/setup_cpu.sh            # runtime packages (enough for `dvc repro`)
#   env/setup_cpu.sh --dev      # plus the test tools (pytest, hypothesis, reference clients)
#   env/setup_cpu.sh --dry-run  # print what would be done, change nothing
#   env/setup_cpu.sh --check    # exit 0 when .venv is up to date, 1 when an install is needed
#
# Idempotent: a run whose requirement files, pyproject.toml and Python are unchanged since the
# last complete install (hash in .venv/.setup-stamp) installs nothing and takes seconds.
# Needs PyPI (or a pip mirror set in pip's config); never contacts a model hub.
# Environment: PYTHON (interpreter that creates the venv, default python3), LLM_VENV (venv path),
# LLM_TORCH_CPU_INDEX (index with the +cpu torch wheels, default https://download.pytorch.org/whl/cpu;
# set it empty to use only pip's configured indexes).
set -euo pipefail

# shellcheck source=env/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

usage() {
    sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

TORCH_CPU_INDEX="${LLM_TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"

describe_torch_step() {
    local from="pip's configured indexes"
    [[ -z "$TORCH_CPU_INDEX" ]] || from="$TORCH_CPU_INDEX (extra index, when reachable)"
    echo "pip install torch==$1 (CPU build: the +cpu wheel from $from)"
}

# PyPI's Linux torch wheel is the CUDA build (GBs of nvidia-* packages); the +cpu build lives on
# the PyTorch index (or a local wheel folder). A local version "+cpu" sorts above the plain
# release, so offering that index as an *extra* index makes pip prefer the CPU build while
# torch's dependencies still come from PyPI.
install_torch() {
    local pin="$1" have
    have="$(installed_torch)"
    if [[ "$have" == "$pin" || "$have" == "$pin+"* ]]; then
        say "torch $have already installed; keeping it"
        if torch_is_cuda_build; then
            warn "this venv has a CUDA build of torch ($have); it runs on CPU too. For the smaller CPU build: rm -rf '$VENV' and rerun $SETUP_NAME."
        fi
        return 0
    fi
    local args=()
    if [[ -n "$TORCH_CPU_INDEX" ]]; then
        if url_reachable "$TORCH_CPU_INDEX/torch/"; then
            args=(--extra-index-url "$TORCH_CPU_INDEX")
        else
            warn "$TORCH_CPU_INDEX is not reachable; installing torch==$pin from pip's configured indexes only."
        fi
    fi
    pip_install "torch==$pin" ${args[@]+"${args[@]}"} "torch==$pin"
    if torch_is_cuda_build; then
        warn "installed torch $(installed_torch) is a CUDA build (it works on CPU, but pulls GBs of nvidia-* packages). For the CPU build make $TORCH_CPU_INDEX reachable (or set PIP_FIND_LINKS to a folder holding the torch-$pin+cpu wheel), rm -rf '$VENV' and rerun $SETUP_NAME."
    fi
}

# True when the installed torch wheel depends on NVIDIA's CUDA packages (read from its metadata,
# without importing torch).
torch_is_cuda_build() {
    "$VENV_PY" -c 'import importlib.metadata as m, sys; sys.exit(0 if any(r.startswith("nvidia-") for r in (m.requires("torch") or [])) else 1)'
}

parse_setup_args "$@"
run_setup cpu
