#!/usr/bin/env bash
# Create or refresh the project's virtualenv (.venv) and the pinned CDK CLI (node_modules).
# Idempotent: a second run only checks that everything is installed.
# Python packages come from the hashed locks (requirements.txt -> requirements/*.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# llama-cpp-python compiles llama.cpp from source on a new machine, for this CPU
# (-march=native); the adapter uses only libllama and ggml, so the multimodal library (mtmd)
# is not built. pip caches the wheel. On x86-64 llama.cpp is compiled without Intel AMX: on an
# AMX host (c7i/m7i/r7i) -march=native builds ggml's AMX kernels, whose weight buffers crash,
# and SEMIF_WEIGHT_BUFFERS=auto then turns CPU_REPACK off with them (adapter/weight_buffers.py).
# ggml's GGML_AMX_* options act only when GGML_NATIVE is off; an explicit -mno-* wins over
# -march=native whatever the order, so the compiler flags switch AMX off in every build.
no_amx=""
if [ "$(uname -m)" = x86_64 ]; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
install_locked() {
  CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" CFLAGS="${CFLAGS:-} $no_amx" \
    CXXFLAGS="${CXXFLAGS:-} $no_amx" \
    .venv/bin/python -m pip install --quiet --require-hashes "$@" -r requirements.txt
}
stamp=.venv/.requirements.sha256
want=$(echo "$no_amx" | cat - requirements.txt requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  install_locked
  # setuptools warns about every editable install (a generic note, not about this project)
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install --quiet --no-deps -e .
  # pip keeps an installed binding, and reuses a cached wheel whatever flags built it: on an
  # AMX host, a binding that still carries the AMX kernels is rebuilt once, without the cache.
  if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && .venv/bin/python -c 'import sys; from adapter.backends import amx_libraries, bundled_lib_dir; sys.exit(not amx_libraries(bundled_lib_dir()))'; then
    .venv/bin/python -m pip uninstall --quiet --yes llama-cpp-python
    install_locked --no-cache-dir
  fi
  echo "$want" > "$stamp"
fi
if [ -f package-lock.json ] && [ ! -d node_modules ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
