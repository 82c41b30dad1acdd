#!/usr/bin/env bash
# Sets up .venv on a fresh machine (torch first, from the local CPU wheel where there is one),
# then lints and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
.venv/bin/ruff check .
# Two workers (one torch thread each) on the 2-core machines; files stay whole per worker.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
