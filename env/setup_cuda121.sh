#!/usr/bin/env bash
# Set up .venv with torch 2.13.0 for a machine with a CUDA 12.1 stack. torch 2.13.0 has no
# cu121 wheel (the last one is torch 2.5), so this installs the cu126 build, which bundles its
# own CUDA 12.6 runtime, after checking that the NVIDIA driver supports CUDA 12.6.
# Options: --dev, --dry-run, --check, --help. The logic is shared in env/_setup_cuda.sh.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/_setup_cuda.sh" 121 "$@"
