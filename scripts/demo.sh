#!/usr/bin/env bash
# The main job on the embedded default: install, build the embedded model's artifact through
# model-build, unpack it as SageMaker would, start `serve` on localhost, send the example
# decisions, print the answers, stop the server.
# Usage: scripts/demo.sh [MODEL_DIR]   (default .models/opt-ml-model; SEMIF_PORT picks the port)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
model_dir=${1:-.models/opt-ml-model}
port=${SEMIF_PORT:-$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
mkdir -p .models "$model_dir"
.venv/bin/model-build --embedded --dest .models/model.tar.gz
tar -xzf .models/model.tar.gz -C "$model_dir"
echo "model directory: $model_dir ($(ls "$model_dir" | tr '\n' ' '))"
SEMIF_MODEL_DIR="$model_dir" SEMIF_HOST=127.0.0.1 SEMIF_PORT="$port" .venv/bin/serve > .models/serve.log 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
if ! .venv/bin/python -m client.demo --url "http://127.0.0.1:$port" --wait 120; then
  echo "server log (.models/serve.log):" >&2
  tail -n 20 .models/serve.log >&2
  exit 1
fi
