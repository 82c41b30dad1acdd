# Sourced by scripts/test.sh and scripts/serve.sh: create .venv and install the project.
# torch==2.13.0 goes in first: any other torch spec pulls gigabytes of CUDA wheels here.
# pip runs only when pyproject.toml or this file changed since the last install (a stamp in .venv);
# SPECEXEC_SETUP=always forces it.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
setup_key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "${SPECEXEC_SETUP:-}" = always ] || [ "$(cat .venv/.specexec-setup 2>/dev/null)" != "$setup_key" ]; then
  rm -f .venv/.specexec-setup
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
  echo "$setup_key" > .venv/.specexec-setup
fi
unset setup_key
