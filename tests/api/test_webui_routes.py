"""The chat page's routes (server/webui/) over a FakeEngine: `/` serves the page (plain text with
--no-webui), HEAD / is a 200 either way, the page is open while /v1 keeps its key, and everything the page
loads is one of the server's own files (it works offline)."""

from __future__ import annotations

import argparse
import re
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engine.types import ConfigError
from server.serve import add_server_arguments, server_config_from
from server.webui import STATIC
from tests.helpers.fake_engine import FakeEngine

STATIC_FILES = sorted(path.name for path in Path(STATIC).iterdir())


def test_root_serves_the_page(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())
    page = httpx.get(f"{srv.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>SpecExec Server</title>" in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "unsafe-inline" not in policy
    head = httpx.head(f"{srv.url}/", timeout=10)
    assert head.status_code == 200 and head.content == b""
    script = httpx.get(f"{srv.url}/webui/app.js", timeout=10)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert httpx.get(f"{srv.url}/webui/../server/config.py", timeout=10).status_code == 404


def test_no_webui_answers_plain_text(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine(), webui=False)
    page = httpx.get(f"{srv.url}/", timeout=10)
    assert page.status_code == 200 and page.text == "SpecExec Server is running\n"
    assert page.headers["content-type"].startswith("text/plain")
    assert httpx.head(f"{srv.url}/", timeout=10).status_code == 200
    assert httpx.get(f"{srv.url}/webui/app.js", timeout=10).status_code == 404


def test_page_is_open_and_the_api_keeps_its_key(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine(), api_key="secret")
    assert httpx.get(f"{srv.url}/", timeout=10).status_code == 200
    assert httpx.get(f"{srv.url}/webui/style.css", timeout=10).status_code == 200
    assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 401
    keyed = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer secret"}, timeout=10)
    assert keyed.status_code == 200


def test_the_page_loads_only_its_own_files() -> None:
    """Every src/href and module import names a file under /webui/; no URL of another host anywhere."""
    html = (STATIC / "index.html").read_text()
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets and all(a.startswith("/webui/") and a.removeprefix("/webui/") in STATIC_FILES for a in assets)
    for name in STATIC_FILES:
        text = (STATIC / name).read_text()
        for target in re.findall(r"""from\s+'(\.[^']+)'""", text):
            assert target.removeprefix("./") in STATIC_FILES, (name, target)
        urls = set(re.findall(r"https?://[^\s'\"`)]+", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)  # the SVG namespace is a name, not a fetch


@pytest.mark.parametrize("name", STATIC_FILES)
def test_every_file_is_served(fake_server: Callable, name: str) -> None:
    srv = fake_server(FakeEngine())
    response = httpx.get(f"{srv.url}/webui/{name}", timeout=10)
    assert response.status_code == 200 and response.content == (STATIC / name).read_bytes()


def test_no_webui_flag_and_config_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECEXEC_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_config_from(parser.parse_args([]), None).webui is True
    assert server_config_from(parser.parse_args(["--no-webui"]), None).webui is False
    assert server_config_from(parser.parse_args([]), {"webui": False}).webui is False
    with pytest.raises(ConfigError, match="server.webui"):
        server_config_from(parser.parse_args([]), {"webui": "no"})


@pytest.mark.parametrize("webui", [True, False])
def test_root_answers_while_the_model_loads(fake_server: Callable, webui: bool) -> None:
    release = threading.Event()

    def loader(config: object) -> FakeEngine:
        release.wait(30)
        return FakeEngine()

    srv = fake_server(loader=loader, webui=webui)
    try:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        assert httpx.get(f"{srv.url}/", timeout=10).status_code == 200
        assert httpx.head(f"{srv.url}/", timeout=10).status_code == 200
    finally:
        release.set()
