#!/usr/bin/env bash
# The project's test command: install, lint, format check, type-check, then the tests.
# Locally it runs the fast loop (tests marked slow deselected: the embedded SmolLM2, the
# README main job, benchmark smoke runs, cfn-lint); CI (CI=true) and `--full` run them all.
# Other arguments go to pytest, e.g. `scripts/test.sh -k adapter`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
selection=(-m "not slow")
if [ "${1:-}" = "--full" ]; then
  shift
  selection=()
elif [ "${CI:-}" = "true" ]; then
  selection=()
fi
set +e
python -m pytest "${selection[@]}" "$@"
status=$?
set -e
if [ "${#selection[@]}" -gt 0 ]; then
  echo "fast loop: tests marked slow were skipped; scripts/test.sh --full runs everything (as CI does)"
fi
# pytest exits 5 when a selection (extra arguments) matched no test; that is not a failure
# of the code. Without arguments (CI) collecting nothing is a broken suite and fails.
if [ "$status" -eq 5 ] && [ "$#" -gt 0 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$status"
