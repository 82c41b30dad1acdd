#!/usr/bin/env bash
# The GPTQ tests (tests/test_quant.py, and tests/test_bench_tools.py's 4-bit rows) in their own venv: the gptq extra downgrades numpy and pulls
# ~30 packages, so it stays out of the main .venv. torch stays pinned in the same install command.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-gptq/bin/python ]; then
  python3 -m venv .venv-gptq
fi
.venv-gptq/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
if ! .venv-gptq/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,gptq]" "torch==2.13.0"; then
  echo "test-gptq: WARNING: the gptq extra did not install here; GPTQ tests not run" >&2
  exit 0
fi
.venv-gptq/bin/python -m pytest -q -p no:cacheprovider tests/model/test_quant.py tests/bench/test_bench_tools.py "$@"
