#!/usr/bin/env bash
# The GPTQ tests (tests/model/test_quant.py, and tests/bench/test_bench_tools.py's 4-bit rows) in their own venv:
# the gptq extra downgrades numpy and pulls ~20 packages, so it stays out of the main .venv. CI runs this
# (.ci/run), so it fails when the extra does not install, when a GPTQ test would skip for want of it
# (SPECEXEC_REQUIRE_GPTQ=1), and when any test here skips at all.
# .venv-gptq reuses .venv (scripts/setup.sh makes it, as scripts/test.sh does): a .pth line puts .venv's packages
# (torch and the other ~100) behind its own, so pip installs only what the extra adds or changes (its numpy
# shadows .venv's; pip never touches .venv, which is outside this environment): 49 s instead of 3 min 23 s for a
# venv of its own on the project's 2-core machine. pip runs only when pyproject.toml, this file or .venv changed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
if [ ! -x .venv-gptq/bin/python ]; then
  python3 -m venv .venv-gptq
fi
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
purelib .venv/bin/python > "$(purelib .venv-gptq/bin/python)/specexec-main-venv.pth"
gptq_key=$(cat pyproject.toml scripts/test-gptq.sh .venv/.specexec-setup | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv-gptq/.specexec-setup 2>/dev/null)" != "$gptq_key" ]; then
  rm -f .venv-gptq/.specexec-setup
  if ! .venv-gptq/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,gptq]" "torch==2.13.0"; then
    echo "test-gptq: FAILED: the gptq extra did not install (pip install -e '.[dev,gptq]'); GPTQ tests not run" >&2
    exit 1
  fi
  echo "$gptq_key" > .venv-gptq/.specexec-setup
fi
unset gptq_key
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
