#!/usr/bin/env bash
# Set up .venv with torch 2.13.0+cu126: the stable CUDA 12.6 line, widest GPU support (Maxwell
# sm_50 to Hopper sm_90). Checks that the NVIDIA driver supports CUDA 12.6.
# Options: --dev, --dry-run, --check, --help. The logic is shared in env/_setup_cuda.sh.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/_setup_cuda.sh" 126 "$@"
