# Sourced by scripts/test.sh and scripts/serve.sh: create .venv and install the project.
# torch==2.13.0 goes in first: any other torch spec pulls gigabytes of CUDA wheels here.
# pip runs only when pyproject.toml or this file changed since the last install (a stamp in .venv);
# SPECEXEC_SETUP=always forces it. A first install takes minutes: it says what it does (on stderr) and
# pip shows its own progress (each package as it is collected, downloaded and installed).
setup_say() { echo "specexec setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  setup_say "creating .venv (a Python environment of the project's own, in $(pwd)/.venv)"
  python3 -m venv .venv
fi
setup_key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "${SPECEXEC_SETUP:-}" = always ] || [ "$(cat .venv/.specexec-setup 2>/dev/null)" != "$setup_key" ]; then
  rm -f .venv/.specexec-setup
  setup_started=$SECONDS
  setup_say "installing torch 2.13.0 into .venv (first, so no other torch is pulled in; a download of about" \
            "200 MB for the CPU build, none if this torch is there already)"
  .venv/bin/python -m pip install --disable-pip-version-check "torch==2.13.0"
  setup_say "installing the project and its dependencies into .venv (transformers, fastapi, uvicorn, xgrammar," \
            "the test tools: about 100 packages, minutes on a first run)"
  .venv/bin/python -m pip install --disable-pip-version-check -e ".[dev]"
  echo "$setup_key" > .venv/.specexec-setup
  setup_say "done in $((SECONDS - setup_started)) s; later runs skip this step until pyproject.toml changes"
  unset setup_started
fi
unset setup_key
