#!/usr/bin/env bash
# One-command install. Creates ./.venv (unless a virtual environment is already active), installs
# PyTorch (the CPU build where there is no NVIDIA GPU), then specdec with its test extras.
#   ./install.sh            then   .venv/bin/specdec quickstart
set -euo pipefail
cd "$(dirname "$0")"
if [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  py=.venv/bin/python
fi
"$py" -m pip install -q --upgrade pip
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    # A pinned CPU build; an unpinned torch would pull a multi-GB CUDA build.
    "$py" -m pip install -q "torch==2.13.0"
  fi
fi
"$py" -m pip install -q -e ".[dev]"
# speculators is only used to cross-check our exports. --no-deps keeps it from replacing torch
# (it asks for torchvision/torchaudio); what it imports is installed next, against the torch above.
{ "$py" -m pip install -q --no-deps "speculators==0.9.0" \
  && "$py" -m pip install -q "datasets>=4,<=5.1.0" "hs-connectors==0.9.0" loguru; } \
  || echo "note: speculators not installed; the cross-check test will be skipped"
echo "installed: $("$py" -m specdec --version)  (python: $py)"
