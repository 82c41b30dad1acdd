#!/usr/bin/env bash
# The GPTQ tests (tests/model/test_quant.py, and tests/bench/test_bench_tools.py's 4-bit rows) in their own venv:
# the gptq extra downgrades numpy and pulls ~30 packages, so it stays out of the main .venv. torch stays pinned
# in the same install command. CI runs this (.ci/run), so it fails when the extra does not install, when a
# GPTQ test would skip for want of it (SPECEXEC_REQUIRE_GPTQ=1), and when any test here skips at all.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-gptq/bin/python ]; then
  python3 -m venv .venv-gptq
fi
.venv-gptq/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
if ! .venv-gptq/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,gptq]" "torch==2.13.0"; then
  echo "test-gptq: FAILED: the gptq extra did not install (pip install -e '.[dev,gptq]'); GPTQ tests not run" >&2
  exit 1
fi
report="$(mktemp --suffix=.xml)"
trap 'rm -f "$report"' EXIT
SPECEXEC_REQUIRE_GPTQ=1 .venv-gptq/bin/python -m pytest -q -p no:cacheprovider -rs --junitxml "$report" \
  tests/model/test_quant.py tests/bench/test_bench_tools.py "$@"
# pytest passed; a skipped GPTQ test would still be a test that did not run
.venv-gptq/bin/python - "$report" <<'EOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot().find("testsuite")
total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
print(f"test-gptq: {total - skipped} passed, {skipped} skipped")
if skipped or total == 0:
    sys.exit("test-gptq: FAILED: every GPTQ test must run here (see the skip reasons above)")
EOF
