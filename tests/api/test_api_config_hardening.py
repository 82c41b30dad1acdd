"""The hardening fields of ServerConfig and their flags: allowed_hosts, max_body_bytes, read_timeout,
shutdown_timeout."""

from __future__ import annotations

import pytest

from engine.types import ConfigError
from server.config import ServerConfig
from server.serve import server_config_from
from tests.api.test_api_config import parse


def test_defaults() -> None:
    config = ServerConfig()
    assert config.allowed_hosts == () and config.max_body_bytes == 16 * 2**20
    assert config.read_timeout == 10.0 and config.shutdown_timeout == 10.0


def test_flags_and_toml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECEXEC_API_KEY", raising=False)
    toml = {"allowed_hosts": ["a.lan"], "max_body_bytes": 4096, "read_timeout": 3, "shutdown_timeout": 0}
    assert server_config_from(parse(), toml).allowed_hosts == ("a.lan",)
    config = server_config_from(parse("--allowed-hosts", "b.lan, c.lan", "--max-body-mb", "0.5",
                                      "--read-timeout", "2.5", "--shutdown-timeout", "30"), toml)
    assert config.allowed_hosts == ("b.lan", "c.lan") and config.max_body_bytes == 2**19
    assert config.read_timeout == 2.5 and config.shutdown_timeout == 30
    assert server_config_from(parse("--allowed-hosts", "*"), None).allowed_hosts == ("*",)


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"allowed_hosts": [""]}, "server.allowed_hosts"),
        ({"allowed_hosts": ["http://a.lan/"]}, "server.allowed_hosts"),
        ({"max_body_bytes": 10}, "server.max_body_bytes"),
        ({"max_body_bytes": 1.5e6}, "server.max_body_bytes"),
        ({"read_timeout": 0}, "server.read_timeout"),
        ({"read_timeout": "10"}, "server.read_timeout"),
        ({"shutdown_timeout": -1}, "server.shutdown_timeout"),
    ],
)
def test_invalid_values_are_named(fields: dict, field_name: str) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig(**fields)
    assert info.value.field == field_name
