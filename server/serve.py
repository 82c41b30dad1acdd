"""`specexec serve` glue: the [server] flags, ServerConfig from flags + TOML, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from engine.config import EngineConfig, build_section
from server.config import LOG_LEVELS, ServerConfig, api_key_from_env

log = logging.getLogger("specexec.server")

# flag dest -> ServerConfig field (the same name: every flag is a [server] key)
SERVER_FIELDS = ("host", "port", "api_key", "cors_origins", "chat_template", "served_model_name",
                 "ping_seconds", "log_level")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the [server] section; defaults are None so a config file can fill them in."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=None, help="TCP port (default 8000)")
    group.add_argument("--api-key", default=None,
                       help="require this key on /v1/* (Bearer or x-api-key); env SPECEXEC_API_KEY also works")
    group.add_argument("--cors-origins", default=None,
                       help="comma-separated browser origins allowed to call the API, or '*'")
    group.add_argument("--chat-template", default=None, help="Jinja file overriding the tokenizer's chat template")
    group.add_argument("--served-model-name", default=None,
                       help="model id shown by /v1/models and required in requests (default: model name)")
    group.add_argument("--ping-seconds", type=float, default=None,
                       help="interval of SSE ': ping' keep-alive comments (default 5)")
    group.add_argument("--log-level", default=None, choices=LOG_LEVELS, help="uvicorn log level (default info)")


def server_config_from(args: argparse.Namespace | None, toml_section: dict | None,
                       source: str | None = None) -> ServerConfig:
    """The [server] table of a config file, overridden by any flag given on the command line."""
    values: dict[str, Any] = dict(toml_section or {})
    for name in SERVER_FIELDS:
        value = getattr(args, name, None) if args is not None else None
        if value is None:
            continue
        values[name] = value
    if "cors_origins" in values and isinstance(values["cors_origins"], str):
        values["cors_origins"] = [o.strip() for o in values["cors_origins"].split(",") if o.strip()]
    if values.get("api_key") is None and (env_key := api_key_from_env()) is not None:
        values["api_key"] = env_key
    return build_section(ServerConfig, values, "server", source)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until interrupted; exits with status 1 if the engine fails to load."""
    import uvicorn

    from server.app import build_app

    level = "DEBUG" if server_config.log_level == "trace" else server_config.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = build_app(engine_config, server_config, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    server.run()
    if failed:
        print(f"specexec serve: loading the engine failed: {failed[0]}", file=sys.stderr)
        sys.exit(1)
