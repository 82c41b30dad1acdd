"""What .ci/run (the CI entry point) must do so that no test skips there for want of an install."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def npm_installed_folders(script: str) -> set[str]:
    """The folders .ci/run runs `npm ci --prefix` in (a `for client in ...` loop over tests/clients/ too)."""
    folders = set(re.findall(r"npm ci --prefix ([\w/.-]+)", script))
    for names in re.findall(r"for client in ([\w ]+); do\n\s+npm ci --prefix \"tests/clients/\$client\"", script):
        folders |= {f"tests/clients/{name}" for name in names.split()}
    return {folder for folder in folders if "$" not in folder}


def test_every_node_package_of_the_tests_is_installed_in_ci() -> None:
    """A test needing node packages skips without them; CI installs every lock file's packages where node is
    (the Vercel AI SDK's test skipped in CI for want of this)."""
    locks = {str(path.parent.relative_to(REPO)) for path in (REPO / "tests").rglob("package-lock.json")
             if "node_modules" not in path.parts}
    assert "tests/clients/vercel_ai" in locks
    assert locks <= npm_installed_folders((REPO / ".ci" / "run").read_text()), locks


def test_the_gptq_job_reuses_the_main_venv() -> None:
    """scripts/test-gptq.sh layers .venv-gptq on .venv (a .pth line), installing only what the gptq extra adds:
    no torch install of its own (3 min 23 s for a venv of its own here, 49 s layered)."""
    script = (REPO / "scripts" / "test-gptq.sh").read_text()
    commands = [line.strip() for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert "source scripts/setup.sh" in commands
    assert any(line.startswith("purelib .venv/bin/python >") and ".pth" in line for line in commands)
    installs = [line for line in commands if "-m pip install" in line]
    assert len(installs) == 1 and ".[dev,gptq]" in installs[0]
