#!/usr/bin/env bash
# The GPU path measured on a real GPU (issue 14), in two steps:
#
#   scripts/gpu-check.sh prepare [PREP_DIR]
#       here, with PyPI: the trimmed llama-cpp-python source tarball and the pure-Python
#       wheels the adapter needs, in PREP_DIR (default .gpu-prep; ignored by git, carried).
#   scripts/gpu-check.sh run [--cpu] [--shape gpu|small] [--out DIR] [--work DIR] PREP_DIR
#       on the GPU machine, no network: build the binding with GGML_CUDA=ON for the local GPU
#       only, install the wheels, generate the random-weight model, then run
#       scripts/gpu/run_checks.py (start/offload, shared state, prefix reuse, figures):
#       DIR/gpu-check.json, DIR/gpu-check-latency.png and a table on the terminal.
#       --cpu builds with GGML_CUDA=OFF and serves with SEMIF_N_GPU_LAYERS=0 (default shape
#       small), so the whole script can be exercised on a CPU-only Linux machine.
#
# Environment: PYTHON (prepare: .venv/bin/python; run: python3), CUDA_ARCHITECTURES
# (default native), THREADS (default all cores), SEMIF_WEIGHT_BUFFERS (default auto: no AMX
# weight buffers; the in-process engine and the served one both read it). The build is
# kept in the work folder (default ${TMPDIR:-/tmp}/semif-gpu-check) and reused when
# tarball and flags are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

usage() {
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

fail() {
  echo "gpu-check: $*" >&2
  exit 1
}

now() { date +%s.%N; }
since() { awk -v start="$1" -v end="$(now)" 'BEGIN { printf "%.1f", end - start }'; }

prepare() {
  [ "$#" -le 1 ] || usage
  "${PYTHON:-.venv/bin/python}" -m scripts.gpu.prepare "${1:-.gpu-prep}"
}

run() {
  local variant=cuda shape="" out=.cache/gpu-check work="${TMPDIR:-/tmp}/semif-gpu-check" prep=""
  while [ "$#" -gt 0 ]; do
    case "$1" in
      --cpu) variant=cpu ;;
      --shape) shape=$2; shift ;;
      --out) out=$2; shift ;;
      --work) work=$2; shift ;;
      -*) usage ;;
      *) [ -z "$prep" ] || usage; prep=$1 ;;
    esac
    shift
  done
  [ -n "$prep" ] || usage
  local started python tarball
  started=$(now)
  python=${PYTHON:-python3}
  shopt -s nullglob
  local tarballs=("$prep"/*-trimmed.tar.gz) wheels=("$prep"/wheels/*.whl)
  [ "${#tarballs[@]}" -eq 1 ] || fail "expected one *-trimmed.tar.gz in $prep (run prepare)"
  [ "${#wheels[@]}" -gt 0 ] || fail "no wheels in $prep/wheels (run prepare)"
  tarball=${tarballs[0]}
  local tools=(cmake ninja) layers=-1
  if [ "$variant" = cuda ]; then tools+=(nvcc nvidia-smi); else layers=0; fi
  for tool in "${tools[@]}"; do
    command -v "$tool" > /dev/null || fail "$tool not found"
  done
  shape=${shape:-$([ "$variant" = cuda ] && echo gpu || echo small)}
  mkdir -p "$work" "$out"
  out=$(cd "$out" && pwd)

  local step
  step=$(now)
  "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$work/site" "${wheels[@]}"
  local wheels_s
  wheels_s=$(since "$step")
  export PYTHONPATH="$work/binding-$variant:$work/site:$REPO"

  # Only the library: no tools, examples, tests or mtmd; only this machine's GPU architecture.
  local cmake_args="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
  cmake_args+=" -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON"
  if [ "$variant" = cuda ]; then
    cmake_args+=" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-native}"
  else
    cmake_args+=" -DGGML_CUDA=OFF"
  fi
  local stamp build_s=0
  stamp="$(sha256sum "$tarball" | cut -c1-64) $cmake_args"
  if [ "$(cat "$work/binding-$variant/.stamp" 2> /dev/null)" != "$stamp" ]; then
    step=$(now)
    rm -rf "$work/src-$variant" "$work/binding-$variant" "$work/build-$variant"
    mkdir -p "$work/src-$variant"
    tar -xzf "$tarball" -C "$work/src-$variant"
    local source=("$work/src-$variant"/*/)
    echo "gpu-check: building the binding ($variant, $(nproc) cores; log $out/build-$variant.log)"
    if ! CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$python" -m pip install \
      -v --disable-pip-version-check --no-index --no-build-isolation --no-deps --no-cache-dir \
      --target "$work/binding-$variant" --config-settings=build-dir="$work/build-$variant" \
      "${source[0]}" \
      > "$out/build-$variant.log" 2>&1; then
      tail -n 40 "$out/build-$variant.log" >&2
      fail "build failed after $(since "$step") s"
    fi
    echo "$stamp" > "$work/binding-$variant/.stamp"
    build_s=$(since "$step")
    echo "gpu-check: built in $build_s s"
  else
    echo "gpu-check: reusing the build in $work/binding-$variant"
  fi

  step=$(now)
  local gguf
  gguf="$work/model/gpu-check-$shape-$(sha256sum scripts/gpu/make_model.py | cut -c1-12).gguf"
  if [ ! -f "$gguf" ]; then
    "$python" -m scripts.gpu.make_model "$gguf.partial" --shape "$shape"
    mv "$gguf.partial" "$gguf"
  fi
  local model_s
  model_s=$(since "$step")

  PYTHONUNBUFFERED=1 "$python" -m scripts.gpu.run_checks --gguf "$gguf" --n-gpu-layers "$layers" \
    --threads "${THREADS:-$(nproc)}" --out "$out" --started "$started" \
    --phase "wheels=$wheels_s" --phase "build=$build_s" --phase "model=$model_s"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) usage ;;
esac
