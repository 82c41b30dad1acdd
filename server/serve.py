"""`specexec serve` glue: the [server] flags, ServerConfig from flags + TOML, and uvicorn."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, NoReturn

from engine.config import EngineConfig, build_section
from engine.types import ConfigError
from server.config import (
    GENERATION_CONFIG,
    JSON_WHITESPACE,
    LOG_LEVELS,
    REASONING_FORMATS,
    TOOL_PARSERS,
    ServerConfig,
    api_key_from_env,
)

log = logging.getLogger("specexec.server")

# flag dest -> ServerConfig field (the same name: every flag is a [server] key)
SERVER_FIELDS = ("host", "port", "webui", "api_key", "cors_origins", "chat_template", "tool_parser", "reasoning_format",
                 "served_model_name",
                 "ping_seconds", "log_level", "allowed_hosts", "read_timeout", "shutdown_timeout",
                 "grammar_timeout", "generation_config", "json_whitespace", "max_connections", "chat_template_kwargs")
MIB = 2**20


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the [server] section; defaults are None so a config file can fill them in."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=None, help="TCP port (default 8000)")
    group.add_argument("--no-webui", dest="webui", action="store_const", const=False, default=None,
                       help="no chat page at / (it answers plain text); config: webui = false")
    group.add_argument("--api-key", default=None,
                       help="require this key on /v1/*, /infill and /api/* (Bearer or x-api-key); env SPECEXEC_API_KEY also works")
    group.add_argument("--cors-origins", default=None,
                       help="comma-separated browser origins allowed to call the API, or '*'")
    group.add_argument("--chat-template", default=None, help="Jinja file overriding the tokenizer's chat template")
    group.add_argument("--chat-template-kwargs", "--default-chat-template-kwargs", dest="chat_template_kwargs",
                       default=None, metavar="JSON",
                       help="template variables every chat request gets, a JSON object (llama.cpp's flag; vLLM's "
                            "name works too), e.g. '{\"enable_thinking\": false}' to turn Qwen3's thinking off for "
                            "clients that cannot ask; a request's chat_template_kwargs win")
    group.add_argument("--tool-parser", default=None, choices=TOOL_PARSERS,
                       help="tool-call format of the model's output (default auto: recognised from the chat "
                            "template); none: tools are ignored and replies are plain text")
    group.add_argument("--reasoning-format", default=None, choices=REASONING_FORMATS,
                       help="auto (default): a chat reply's leading <think>...</think> block is returned apart "
                            "(reasoning_content, Anthropic thinking, Ollama thinking) when the chat template has "
                            "the tags, and GPT-OSS's analysis channel; none: all of the output is content (GPT-OSS: "
                            "analysis then answer, channel markup hidden)")
    group.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                       help="model ids accepted in requests (space- or comma-separated); the first is listed "
                            "first by /v1/models (default: the model name)")
    group.add_argument("--generation-config", default=None, choices=GENERATION_CONFIG,
                       help="auto (default, as vLLM): sampling fields a request leaves out (temperature, top_p, "
                            "top_k, min_p, repetition_penalty) take the values in the target's "
                            "generation_config.json; none: the API's defaults (temperature 1, no truncation)")
    group.add_argument("--json-whitespace", default=None, choices=JSON_WHITESPACE,
                       help="JSON written under a grammar (response_format, guided_json, tool-call arguments): "
                            "compact (default: the separators ', ' and ': ' chat templates print, no other "
                            "whitespace) or free (any whitespace, at most 16 characters between elements)")
    group.add_argument("--ping-seconds", type=float, default=None,
                       help="interval of SSE ': ping' keep-alive comments (default 5)")
    group.add_argument("--log-level", default=None, choices=LOG_LEVELS, help="uvicorn log level (default info)")
    group.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host header names accepted besides localhost/127.0.0.1/[::1], or "
                            "'*' for any (default: loopback names only when bound to loopback, any otherwise)")
    group.add_argument("--max-body-mb", type=float, default=None,
                       help="largest request body in MiB; larger ones get 413 (default 16; config: max_body_bytes)")
    group.add_argument("--max-connections", type=int, default=None,
                       help="open connections served at once, at most what the file limit leaves (raised to the "
                            "hard limit at start); past it, 503 (default 1024)")
    group.add_argument("--read-timeout", type=float, default=None,
                       help="seconds a client may take to send request headers, and may stall within a body "
                            "(default 10)")
    group.add_argument("--shutdown-timeout", type=float, default=None,
                       help="seconds running requests get to finish after SIGTERM/SIGINT before they are "
                            "ended (default 10)")
    group.add_argument("--grammar-timeout", type=float, default=None,
                       help="seconds a request's JSON schema or regex may take to compile (longer: 400), and "
                            "may wait for a compile thread (longer: 429) (default 10)")


def server_config_from(args: argparse.Namespace | None, toml_section: dict | None,
                       source: str | None = None) -> ServerConfig:
    """The [server] table of a config file, overridden by any flag given on the command line."""
    values: dict[str, Any] = dict(toml_section or {})
    flags: dict[str, str] = {}  # field -> the flag that set it (errors name it)
    for name in SERVER_FIELDS:
        value = getattr(args, name, None) if args is not None else None
        if value is None:
            continue
        values[name] = value
        flags[name] = "--no-webui" if name == "webui" else "--" + name.replace("_", "-")
    if isinstance(getattr(args, "served_model_name", None), list):
        values["served_model_name"] = [n.strip() for arg in args.served_model_name for n in arg.split(",") if n.strip()]
    for name in ("cors_origins", "allowed_hosts"):
        if name in values and isinstance(values[name], str):
            values[name] = [o.strip() for o in values[name].split(",") if o.strip()]
    if isinstance(values.get("chat_template_kwargs"), str):  # the flag's JSON text
        try:
            values["chat_template_kwargs"] = json.loads(values["chat_template_kwargs"])
        except json.JSONDecodeError as exc:
            raise ConfigError(flags.get("chat_template_kwargs", "server.chat_template_kwargs"),
                              f"must be a JSON object, e.g. '{{\"enable_thinking\": false}}' ({exc})") from None
    if getattr(args, "max_body_mb", None) is not None:
        if args.max_body_mb * MIB < 1024:
            raise ConfigError("--max-body-mb", f"must be at least 0.001 (1 KiB), got {args.max_body_mb:g}")
        values["max_body_bytes"] = round(args.max_body_mb * MIB)
        flags["max_body_bytes"] = "--max-body-mb"
    if values.get("api_key") is None and (env_key := api_key_from_env()) is not None:
        values["api_key"] = env_key
    return build_section(ServerConfig, values, "server", source, flags)


def check_port(host: str, port: int) -> None:
    """Bind `host`:`port` as uvicorn will (SO_REUSEADDR, as asyncio does) and let it go, so a port in use is
    said before the model loads (uvicorn finds it only after the load, minutes for a large model)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}", f"not an address of this machine ({exc.strerror}); use 127.0.0.1 "
                          "(this machine only) or 0.0.0.0 (every interface)") from None
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise bind_error(host, port, exc) from None


def bind_error(host: str, port: int, exc: OSError) -> ConfigError:
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"--port {port}", f"{host}:{port} is already in use (another server, perhaps an earlier "
                           "specexec serve); stop it, or pick another port with --port (0: any free one)")
    if exc.errno == errno.EACCES:
        return ConfigError(f"--port {port}", f"binding {host}:{port} is not permitted (ports below 1024 need "
                           "privileges); use a port above 1023")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"--host {host}", "not an address of this machine; use 127.0.0.1 (this machine only) or "
                           "0.0.0.0 (every interface)")
    return ConfigError(f"--port {port}", f"cannot bind {host}:{port} ({exc.strerror})")


def end_during_load(signum: int | None) -> NoReturn:
    """End the process while the engine still loads in its thread: at once, as a signal before the server
    listened does (specexec/__main__.py). Waiting would take the rest of the load (minutes for a 70B), and
    an interpreter exit around a thread inside torch can abort (`terminate called without an active
    exception`). Nothing is served yet: no response to finish, no file to write. Exit status: 130 for Ctrl+C
    (128 + SIGINT), 0 for SIGTERM (as after a drain), 1 when uvicorn stopped (a port it could not bind)."""
    code = {signal.SIGINT: 130, signal.SIGTERM: 0}.get(signum, 1) if signum is not None else 1
    if signum is not None:
        log.info("stopped while the model was loading (%s); the load is abandoned", signal.Signals(signum).name)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until interrupted; exits with status 1 if the engine fails to load."""
    import uvicorn

    from server.app import build_app
    from server.connections import (
        ACCEPT_BACKLOG,
        connection_limit,
        install_accept_error_filter,
        raise_file_limit,
    )
    from server.http_protocol import h11_protocol_with_header_timeout
    from server.shutdown import DrainingServer

    level = "DEBUG" if server_config.log_level == "trace" else server_config.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    install_accept_error_filter()
    file_limit = raise_file_limit()
    max_connections = connection_limit(server_config.max_connections, file_limit)
    log.info("at most %d open connections (--max-connections %d, file limit %d)", max_connections,
             server_config.max_connections, file_limit)
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
        http=h11_protocol_with_header_timeout(server_config.read_timeout, max_connections),
        backlog=ACCEPT_BACKLOG,  # a burst of accepts fits the files reserved (server/connections.py)
        timeout_graceful_shutdown=5,  # after the drain (server/shutdown.py), for connections still open
    )
    server = DrainingServer(config, app.state.specexec, server_config.shutdown_timeout)
    try:
        server.run()
    finally:
        if app.state.specexec.load_unfinished:  # stopped (a signal, or the port taken) while the model loads
            end_during_load(server.first_signal)
    if failed:
        print(f"specexec serve: loading the engine failed: {failed[0]}", file=sys.stderr)
        sys.exit(1)
