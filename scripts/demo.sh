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
.venv/bin/python -m client.demo --url "http://127.0.0.1:$port" --wait 120 &
client=$!
trap 'kill "$server" "$client" 2>/dev/null; wait "$server" "$client" 2>/dev/null || true' EXIT
# Whichever ends first decides: a server that dies (a native crash in the model load or the
# first decode, a start error) ends the demo at once, saying how, instead of the client
# waiting out its 120 s on a refused connection.
set +e
wait -n -p first "$server" "$client"
status=$?
set -e
if [ "$first" = "$server" ]; then
  if [ "$status" -gt 128 ]; then
    how="signal $((status - 128)) (SIG$(kill -l "$((status - 128))"))"
  else
    how="status $status"
  fi
  echo "serve exited: $how; server log (.models/serve.log):" >&2
  tail -n 20 .models/serve.log >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "server log (.models/serve.log):" >&2
  tail -n 20 .models/serve.log >&2
  exit 1
fi
