#!/usr/bin/env bash
# Shared body of env/setup_cuda{118,121,126,130}.sh: set up <repo>/.venv with a CUDA build of
# torch. Run through those wrappers; here the first argument is the CUDA line (118, 121, 126, 130).
#
#   env/setup_cuda126.sh [--dev] [--dry-run] [--check]
#
# Before installing anything it checks the machine, and refuses with what to do when:
#   - nvidia-smi is missing or fails (no driver / no GPU visible);
#   - the driver's maximum CUDA version ("CUDA Version" in nvidia-smi) is older than the wheel's
#     CUDA runtime (set LLM_CUDA_MINOR_COMPAT=1 to rely on CUDA minor-version compatibility
#     within the same major version instead);
#   - a GPU is older than the oldest architecture the wheel has kernels for.
# `nvcc --version` is printed when present; a different toolkit version is only a warning (the
# wheel bundles its own CUDA runtime; nvcc matters only for building CUDA extensions).
# After the install it runs env/check_env.py --require-cuda, which fails unless a CUDA op runs,
# and prints every GPU's name and memory.
#
# Which wheel: torch 2.13.0 is published for CUDA 12.6 and 13.0 (13.2 is experimental); there
# are no CUDA 11.8 (last: torch 2.7) or 12.1 (last: torch 2.5) builds of it. So the 118 and 121
# scripts install the cu126 build, which bundles its own CUDA 12.6 runtime and needs only a
# driver that supports CUDA 12.6. cu126 is the line with the widest GPU support (Maxwell sm_50
# to Hopper sm_90); cu130 adds Blackwell (sm_100, sm_120) and drops everything before Turing.
# A GPU outside the chosen wheel's range is refused before anything is installed.
#
# Environment (also for tests): LLM_NVIDIA_SMI and LLM_NVCC (paths used instead of nvidia-smi and
# nvcc), LLM_TORCH_INDEX (default https://download.pytorch.org/whl/<tag>), LLM_CUDA_MINOR_COMPAT,
# PYTHON, LLM_VENV.
set -euo pipefail

# shellcheck source=env/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

LINE="${1:-}"
shift || true
case "$LINE" in
    118) TAG=cu126 WHEEL_CUDA=12.6 ;;
    121) TAG=cu126 WHEEL_CUDA=12.6 ;;
    126) TAG=cu126 WHEEL_CUDA=12.6 ;;
    130) TAG=cu130 WHEEL_CUDA=13.0 ;;
    *) die "unknown CUDA line '$LINE'" "Run one of env/setup_cuda118.sh, setup_cuda121.sh, setup_cuda126.sh, setup_cuda130.sh." ;;
esac
# $0 is this file; messages should name the script the user ran.
SCRIPT="env/setup_cuda$LINE.sh"
SETUP_NAME="$SCRIPT"
TORCH_INDEX="${LLM_TORCH_INDEX:-https://download.pytorch.org/whl/$TAG}"
SMI="${LLM_NVIDIA_SMI:-nvidia-smi}"
NVCC="${LLM_NVCC:-nvcc}"

# GPU architectures each wheel line has kernels for (PyTorch's CUDA support matrix for 2.13:
# cu126 sm_50..sm_90, no PTX; cu130 sm_75..sm_120 plus PTX, so no upper limit), and the Linux
# driver NVIDIA lists for each CUDA release (for messages only: the check itself compares the
# CUDA version nvidia-smi reports).
case "$TAG" in
    cu126) MIN_CAP=5.0 MAX_CAP=9.0 DRIVER_HINT="560.28 or newer" ;;
    cu130) MIN_CAP=7.5 MAX_CAP="" DRIVER_HINT="580.65 or newer" ;;
esac

usage() {
    cat <<EOF
Set up .venv with torch $(torch_pin_version)+$TAG (CUDA $WHEEL_CUDA wheel) for an NVIDIA GPU.

  $SCRIPT            runtime packages (enough for \`dvc repro\`)
  $SCRIPT --dev      plus test tools (pytest, hypothesis, reference clients)
  $SCRIPT --dry-run  check the driver, print the plan, change nothing
  $SCRIPT --check    exit 0 when .venv is up to date, 1 when an install is needed

For CPU-only machines use env/setup_cpu.sh.
EOF
}

parse_setup_args "$@"

cpu_hint="use env/setup_cpu.sh to run on CPU instead"

# ---- 1. the driver -----------------------------------------------------------------------------
if ! smi_path="$(command -v "$SMI" 2>/dev/null)"; then
    die "nvidia-smi not found ($SMI): no NVIDIA driver is installed, or it is not on PATH." \
        "Install the NVIDIA driver (>= $DRIVER_HINT for CUDA $WHEEL_CUDA) and check that 'nvidia-smi' lists your GPU;" \
        "in a container, start it with GPU access (docker run --gpus all ...); or $cpu_hint."
fi
if ! smi_out="$("$smi_path" 2>&1)"; then
    die "'$smi_path' failed, so the driver cannot be used:" \
        "$(printf '%s\n' "$smi_out" | head -n 3 | tr '\n' ' ')" \
        "Check that the NVIDIA kernel module is loaded (reboot after a driver install/upgrade) and that 'nvidia-smi' works as this user; or $cpu_hint."
fi
driver_cuda="$(printf '%s\n' "$smi_out" | sed -n -E 's/.*CUDA Version: *([0-9]+\.[0-9]+).*/\1/p' | head -n 1)"
driver_version="$(printf '%s\n' "$smi_out" | sed -n -E 's/.*Driver Version: *([0-9][0-9.]*).*/\1/p' | head -n 1)"
[[ -n "$driver_cuda" ]] || die "could not read 'CUDA Version' from '$smi_path' output." \
    "Run nvidia-smi yourself: the header should show 'Driver Version: ... CUDA Version: X.Y'. Update the driver if it does not."
say "NVIDIA driver ${driver_version:-?}: supports CUDA up to $driver_cuda; wheel torch+$TAG needs CUDA $WHEEL_CUDA"

if [[ "$LINE" == 118 || "$LINE" == 121 ]]; then
    warn "torch $(torch_pin_version) has no CUDA ${LINE:0:2}.${LINE:2} wheel (the last cu118 build is torch 2.7, the last cu121 build torch 2.5); installing the cu126 build, which bundles its own CUDA 12.6 runtime. Your local CUDA toolkit is not used by it."
fi

if (( $(version_num "$driver_cuda") < $(version_num "$WHEEL_CUDA") )); then
    same_major=0
    [[ "${driver_cuda%%.*}" == "${WHEEL_CUDA%%.*}" ]] && same_major=1
    if [[ "${LLM_CUDA_MINOR_COMPAT:-0}" == 1 && $same_major == 1 ]]; then
        warn "driver supports CUDA $driver_cuda < $WHEEL_CUDA; continuing because LLM_CUDA_MINOR_COMPAT=1 (CUDA minor-version compatibility: most of torch works, kernels that need a newer driver, e.g. PTX JIT, may fail)."
    else
        lines=("Update the NVIDIA driver to one that supports CUDA $WHEEL_CUDA (Linux driver $DRIVER_HINT), then rerun $SCRIPT.")
        if [[ "$TAG" == cu130 ]] && (( $(version_num "$driver_cuda") >= $(version_num 12.6) )); then
            lines+=("Or use env/setup_cuda126.sh: its wheel needs only CUDA 12.6, which this driver supports.")
        fi
        if ((same_major)); then
            lines+=("Or, at your own risk, rely on CUDA minor-version compatibility: LLM_CUDA_MINOR_COMPAT=1 $SCRIPT")
        fi
        lines+=("Or $cpu_hint.")
        die "the NVIDIA driver ${driver_version:-?} supports CUDA up to $driver_cuda, older than the CUDA $WHEEL_CUDA runtime in torch $(torch_pin_version)+$TAG." \
            "${lines[@]}"
    fi
fi

# ---- 2. the GPUs' architectures ----------------------------------------------------------------
if gpu_caps="$("$smi_path" --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null)" && [[ -n "$gpu_caps" ]]; then
    too_old=() too_new=()
    while IFS= read -r row; do
        [[ -n "$row" ]] || continue
        name="${row%,*}"
        cap="$(printf '%s' "${row##*,}" | tr -d '[:space:]')"
        say "GPU: $name (compute capability $cap)"
        if [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]] && (( $(version_num "$cap") < $(version_num "$MIN_CAP") )); then
            too_old+=("$name (sm_${cap/./})")
        elif [[ -n "$MAX_CAP" && "$cap" =~ ^[0-9]+\.[0-9]+$ ]] && (( $(version_num "$cap") > $(version_num "$MAX_CAP") )); then
            too_new+=("$name (sm_${cap/./})")
        fi
    done <<<"$gpu_caps"
    if ((${#too_old[@]})); then
        other="env/setup_cuda126.sh (kernels from sm_50)"
        [[ "$TAG" == cu126 ]] && other="an older torch release, which this project does not pin"
        die "torch+$TAG has no kernels for: ${too_old[*]}; its oldest architecture is sm_${MIN_CAP/./}." \
            "Use $other, or $cpu_hint."
    fi
    if ((${#too_new[@]})); then
        die "torch+$TAG has no kernels for: ${too_new[*]}; its newest architecture is sm_${MAX_CAP/./}." \
            "Use env/setup_cuda130.sh (kernels up to sm_120; needs a driver that supports CUDA 13.0), or $cpu_hint."
    fi
else
    warn "could not list GPUs with '$smi_path --query-gpu=name,compute_cap'; skipping the architecture check (check_env.py tests a real CUDA op after the install)."
fi

# ---- 3. nvcc (informational) -------------------------------------------------------------------
if nvcc_path="$(command -v "$NVCC" 2>/dev/null)" && nvcc_out="$("$nvcc_path" --version 2>&1)"; then
    nvcc_release="$(printf '%s\n' "$nvcc_out" | sed -n -E 's/.*release ([0-9]+\.[0-9]+).*/\1/p' | head -n 1)"
    say "nvcc --version ($nvcc_path): $(printf '%s\n' "$nvcc_out" | grep -m 1 'release' || echo "$nvcc_out" | tail -n 1)"
    if [[ -n "$nvcc_release" && "$nvcc_release" != "$WHEEL_CUDA" ]]; then
        warn "nvcc is CUDA $nvcc_release but the torch wheel bundles CUDA $WHEEL_CUDA. Fine for this project (it builds no CUDA extensions); for building extensions, install the CUDA $WHEEL_CUDA toolkit or put it first on PATH."
    fi
else
    say "nvcc: not found (not needed: the torch wheel bundles its CUDA runtime)"
fi

# ---- 4. the install ----------------------------------------------------------------------------
describe_torch_step() {
    echo "pip install torch==$1+$TAG --index-url $TORCH_INDEX"
}

install_torch() {
    local pin="$1" have
    have="$(installed_torch)"
    if [[ "$have" == "$pin+$TAG" ]]; then
        say "torch $have already installed; keeping it"
        return 0
    fi
    [[ -z "$have" ]] || say "replacing torch $have with torch $pin+$TAG"
    if ! url_reachable "$TORCH_INDEX/torch/"; then
        warn "$TORCH_INDEX is not reachable from here; trying pip's configured sources (e.g. PIP_FIND_LINKS) for torch==$pin+$TAG."
    fi
    # The local version label (+cu126) makes pip replace a CPU build already in the venv and
    # refuse any other build. --index-url (not --extra-) as PyTorch's own instructions say: the
    # nvidia-* dependencies come from the same index, consistent with the wheel.
    pip_install "torch==$pin+$TAG (from $TORCH_INDEX; if this machine cannot reach it, set LLM_TORCH_INDEX to a mirror or PIP_FIND_LINKS to a folder with the wheel)" \
        --index-url "$TORCH_INDEX" "torch==$pin+$TAG"
}

final_check() {
    say "checking that CUDA works (env/check_env.py --require-cuda)"
    "$VENV_PY" "$ENV_DIR/check_env.py" --require-cuda \
        || die "torch+$TAG is installed but CUDA is not usable (see the report above)." \
            "Follow the hint above; after fixing the driver/GPU access rerun $SCRIPT (it will not reinstall); or $cpu_hint."
}

run_setup "$TAG"
