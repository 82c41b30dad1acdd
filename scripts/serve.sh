#!/usr/bin/env bash
# Sets up .venv on a fresh machine, then serves the built-in default model pair
# (or whatever `specexec serve` flags you pass) on http://127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
echo "specexec: starting specexec serve (a few seconds of imports, then it listens and loads the model; Ctrl+C" \
     "stops it)" >&2
exec .venv/bin/specexec serve "$@"
