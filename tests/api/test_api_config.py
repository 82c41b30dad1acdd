"""ServerConfig validation and `specexec serve` flag/TOML merging (no server)."""

from __future__ import annotations

import argparse

import pytest

from engine.types import ConfigError
from server.config import ServerConfig
from server.serve import add_server_arguments, server_config_from


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_bind_loopback_only() -> None:
    config = ServerConfig()
    assert config.host == "127.0.0.1" and config.port == 8000 and config.api_key is None
    assert config.cors_origins == () and config.chat_template is None


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"port": 70000}, "server.port"),
        ({"port": "80"}, "server.port"),
        ({"host": ""}, "server.host"),
        ({"api_key": ""}, "server.api_key"),
        ({"api_key": " padded "}, "server.api_key"),
        ({"chat_template": "/no/such/template.jinja"}, "server.chat_template"),
        ({"ping_seconds": 0}, "server.ping_seconds"),
        ({"log_level": "loud"}, "server.log_level"),
        ({"cors_origins": [""]}, "server.cors_origins"),
    ],
)
def test_invalid_fields_are_named(fields: dict, field_name: str) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig(**fields)
    assert info.value.field == field_name


def test_flags_override_toml_and_lists_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECEXEC_API_KEY", raising=False)
    toml = {"host": "0.0.0.0", "port": 9000, "cors_origins": ["http://a.example"], "api_key": "from-file"}
    config = server_config_from(parse("--port", "9100", "--cors-origins", "http://b.example, http://c.example"),
                                toml, "deploy.toml")
    assert config.host == "0.0.0.0" and config.port == 9100 and config.api_key == "from-file"
    assert config.cors_origins == ("http://b.example", "http://c.example")
    assert server_config_from(parse(), None) == ServerConfig()


def test_unknown_toml_key_names_file_and_field() -> None:
    with pytest.raises(ConfigError) as info:
        server_config_from(parse(), {"prot": 1}, "deploy.toml")
    assert info.value.field == "server.prot" and "deploy.toml" in str(info.value)


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECEXEC_API_KEY", "env-key")
    assert server_config_from(parse(), None).api_key == "env-key"
    assert server_config_from(parse("--api-key", "flag-key"), None).api_key == "flag-key"
