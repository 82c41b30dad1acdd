#!/usr/bin/env bash
# Sets up .venv on a fresh machine (torch first, from the local CPU wheel where there is one),
# then lints and runs the whole test suite (the CI contract).
#   bash scripts/test.sh --quick    the quick loop: tests not marked `slow` (3.5 minutes on 2 idle cores)
#   bash scripts/test.sh ARGS       pytest arguments, e.g. tests/speculation -k budget
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
.venv/bin/ruff check .
args=("$@")
if [ "${1:-}" = --quick ]; then
  args=(-m "not slow" "${@:2}")
fi
# Two workers (one torch thread each) on the 2-core machines; files stay whole per worker.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "${args[@]}"
