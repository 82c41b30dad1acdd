# Sourced by scripts/test.sh and scripts/serve.sh: create .venv and install the project.
# torch==2.13.0 goes in first: any other torch spec pulls gigabytes of CUDA wheels here.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
