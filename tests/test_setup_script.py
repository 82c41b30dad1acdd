"""scripts/setup.sh (sourced by scripts/serve.sh and scripts/test.sh) on a bare clone: it says what it does
and lets pip show its progress, rather than sitting silent for the minutes a first install takes.

Run against stand-ins: a `python3` on PATH whose `-m venv` makes a `.venv/bin/python` that records its
arguments, so no environment is made and nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RECORDER = """#!/usr/bin/env bash
echo "$*" >> "{log}"
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  cp "$0" "$3/bin/python"
fi
"""


def run_setup(clone: Path, stubs: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"}
    env.pop("SPECEXEC_SETUP", None)
    return subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/setup.sh"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_first_setup_says_what_it_does_and_shows_pips_progress(tmp_path: Path) -> None:
    clone, stubs, log = tmp_path / "clone", tmp_path / "bin", tmp_path / "calls.log"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", clone)
    shutil.copy(REPO / "scripts" / "setup.sh", clone / "scripts")
    stubs.mkdir()
    (stubs / "python3").write_text(RECORDER.format(log=log))
    (stubs / "python3").chmod(0o755)

    first = run_setup(clone, stubs)
    assert first.returncode == 0, first.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "-m venv .venv"
    installs = [call.split() for call in calls[1:]]
    assert [call[:3] for call in installs] == [["-m", "pip", "install"]] * 2
    assert installs[0][-1] == "torch==2.13.0" and installs[1][-2:] == ["-e", ".[dev]"]
    for call in installs:  # pip's own progress: never silenced
        assert "-q" not in call and "--quiet" not in call and "--progress-bar" not in call, call
    said = [line for line in first.stderr.splitlines() if line.startswith("specexec setup: ")]
    assert [line.split(" (")[0] for line in said[:-1]] == [
        "specexec setup: creating .venv",
        "specexec setup: installing torch 2.13.0 into .venv",
        "specexec setup: installing the project and its dependencies into .venv",
    ] and said[-1].startswith("specexec setup: done in "), first.stderr

    again = run_setup(clone, stubs)  # nothing changed: no pip, nothing said
    assert again.returncode == 0 and again.stderr == "" and log.read_text().splitlines() == calls
