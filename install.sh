#!/usr/bin/env bash
# One-command install: CPU torch where there is no GPU, then specdec with its dev extras.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q torch==2.13.0 || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
python -m pip install -q -e ".[dev]"
# speculators is only used to cross-check exports; --no-deps keeps it from pulling a CUDA torch.
python -m pip install -q --no-deps "speculators==0.9.0" || echo "note: speculators not installed; the cross-check test will be skipped"
