#!/usr/bin/env bash
# Set up .venv with torch 2.13.0+cu130: the newest stable line, CUDA 13.0 (Turing sm_75 to
# Blackwell sm_120; no Maxwell, Pascal or Volta). Checks that the NVIDIA driver supports CUDA 13.0.
# Options: --dev, --dry-run, --check, --help. The logic is shared in env/_setup_cuda.sh.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/_setup_cuda.sh" 130 "$@"
