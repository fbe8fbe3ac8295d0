#!/usr/bin/env bash
# Create or refresh the project's virtualenv (.venv) and the pinned CDK CLI (node_modules).
# Idempotent: a second run only checks that everything is installed.
# Python packages come from the hashed locks (requirements.txt -> requirements/*.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
stamp=.venv/.requirements.sha256
want=$(cat requirements.txt requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # llama-cpp-python compiles llama.cpp from source on a new machine; the adapter uses only
  # libllama and ggml, so the multimodal library (mtmd) is not built. pip caches the wheel.
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
    .venv/bin/python -m pip install --quiet --require-hashes -r requirements.txt
  # setuptools warns about every editable install (a generic note, not about this project)
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install --quiet --no-deps -e .
  echo "$want" > "$stamp"
fi
if [ -f package-lock.json ] && [ ! -d node_modules ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
