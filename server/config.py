"""HTTP server configuration: a frozen dataclass validated on construction.

Every field maps 1:1 to a `specexec serve` flag (`--field-name`) and to a key of the
`[server]` section of a configs/ TOML file. Flags override the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import require

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
REASONING_FORMATS = ("auto", "none")  # server/reasoning.py
TOOL_PARSERS = ("auto", "hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "none")  # server/toolcalls/parsers.py
API_KEY_ENV = "SPECEXEC_API_KEY"
GENERATION_CONFIG = ("auto", "none")  # where left-out sampling fields come from (server/sampling_defaults.py)
JSON_WHITESPACE = ("compact", "free")  # whitespace in JSON under a grammar (engine.types.StructuredOutput)
# apply_chat_template's own parameters and the variables the server sets: not a request's (or the
# server's chat_template_kwargs) to pass
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless told otherwise
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # protects /v1/*; None: open (env SPECEXEC_API_KEY also works)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed; ("*",) allows any
    chat_template: str | None = None  # Jinja file overriding the tokenizer's chat_template
    tool_parser: str = "auto"  # tool-call format; auto: from the chat template; none: no tool calls
    # auto: a chat reply's leading <think> block is reasoning (reasoning_content / thinking), when the
    # chat template or tokenizer has the tags (server/reasoning.py), and a harmony model's analysis channel
    # (server/harmony.py); none: all of it is content (harmony markup still hidden)
    reasoning_format: str = "auto"
    webui: bool = True  # the chat page at / (server/webui/); off: / answers plain text
    # model ids over HTTP, all accepted, the first listed first by /v1/models (and echoed when a
    # request names none); a string is one name; (): the engine's model name
    served_model_name: tuple[str, ...] | str = ()
    ping_seconds: float = 5.0  # SSE `: ping` comment interval while a stream is open
    log_level: str = "info"
    # Host header names accepted besides the loopback ones (localhost, 127.0.0.1, [::1]); ("*",): any.
    # (): loopback names only while bound to a loopback address, any name otherwise
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 16 * 2**20  # larger request bodies get 413 (a 128k-token prompt is ~0.5-3 MB)
    read_timeout: float = 10.0  # seconds to send the request headers, and most seconds of silence in a body
    shutdown_timeout: float = 10.0  # seconds running requests get to finish after SIGTERM/SIGINT
    grammar_timeout: float = 10.0  # seconds a request's grammar may take to compile; longer: a 400
    # open connections served at once (at most what the file limit leaves: server/connections.py); past
    # it, 503
    max_connections: int = 1024
    # auto: a request's left-out temperature/top_p/top_k/min_p/repetition_penalty take the values the
    # target's generation_config.json sets (as vLLM); none: the API's own defaults
    generation_config: str = "auto"
    # JSON written under a grammar (response_format, guided_json, tool-call arguments): compact (", " and
    # ": ", as chat templates print JSON), or free whitespace (at most 16 characters per gap)
    json_whitespace: str = "compact"
    # template variables every chat request gets (llama.cpp's --chat-template-kwargs, vLLM's
    # --default-chat-template-kwargs), e.g. {"enable_thinking": false}; a request's own win
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cors_origins, list):
            object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
        names = self.served_model_name
        if not isinstance(names, tuple):
            object.__setattr__(self, "served_model_name", (names,) if isinstance(names, str) else tuple(names or ()))
        require(isinstance(self.host, str) and bool(self.host), "server.host", "must be a non-empty string")
        require(
            isinstance(self.port, int) and not isinstance(self.port, bool) and 0 <= self.port <= 65535,
            "server.port",
            f"must be an integer in [0, 65535], got {self.port!r}",
        )
        require(
            self.api_key is None or (isinstance(self.api_key, str) and self.api_key.strip() == self.api_key != ""),
            "server.api_key",
            "must be a non-empty string without surrounding whitespace",
        )
        require(
            all(isinstance(o, str) and o for o in self.cors_origins),
            "server.cors_origins",
            f"must be a list of non-empty origin strings, got {self.cors_origins!r}",
        )
        require(
            self.chat_template is None or Path(self.chat_template).is_file(),
            "server.chat_template",
            f"file not found: {self.chat_template!r}",
        )
        require(
            all(isinstance(n, str) and n.strip() == n != "" for n in self.served_model_name)
            and len(set(self.served_model_name)) == len(self.served_model_name),
            "server.served_model_name",
            f"must be distinct non-empty names without surrounding whitespace, got {self.served_model_name!r}",
        )
        require(
            isinstance(self.ping_seconds, (int, float)) and self.ping_seconds > 0,
            "server.ping_seconds",
            f"must be > 0, got {self.ping_seconds!r}",
        )
        require(self.log_level in LOG_LEVELS, "server.log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        require(isinstance(self.webui, bool), "server.webui", f"must be true or false, got {self.webui!r}")
        require(self.generation_config in GENERATION_CONFIG, "server.generation_config",
                f"must be one of {', '.join(GENERATION_CONFIG)}, got {self.generation_config!r}")
        require(self.json_whitespace in JSON_WHITESPACE, "server.json_whitespace",
                f"must be one of {', '.join(JSON_WHITESPACE)}, got {self.json_whitespace!r}")
        require(self.reasoning_format in REASONING_FORMATS, "server.reasoning_format",
                f"must be one of {', '.join(REASONING_FORMATS)}")
        require(self.tool_parser in TOOL_PARSERS, "server.tool_parser", f"must be one of {', '.join(TOOL_PARSERS)}")
        kwargs = self.chat_template_kwargs
        require(kwargs is None or (isinstance(kwargs, dict) and all(isinstance(k, str) and k for k in kwargs)),
                "server.chat_template_kwargs", f"must be a JSON object of template variables, got {kwargs!r}")
        require(not (RESERVED_TEMPLATE_KWARGS & set(kwargs or {})), "server.chat_template_kwargs",
                f"cannot set {', '.join(sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {})))}: the server sets them")
        self._check_limits()

    def _check_limits(self) -> None:
        if isinstance(self.allowed_hosts, list):
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        require(
            all(isinstance(h, str) and h and h == h.strip() and "/" not in h for h in self.allowed_hosts),
            "server.allowed_hosts",
            f"must be a list of host names (no scheme or path), or '*', got {self.allowed_hosts!r}",
        )
        require(
            isinstance(self.max_body_bytes, int) and not isinstance(self.max_body_bytes, bool)
            and self.max_body_bytes >= 1024,
            "server.max_body_bytes",
            f"must be an integer >= 1024, got {self.max_body_bytes!r}",
        )
        require(
            isinstance(self.max_connections, int) and not isinstance(self.max_connections, bool)
            and self.max_connections >= 1,
            "server.max_connections",
            f"must be an integer >= 1, got {self.max_connections!r}",
        )
        for name, minimum in (("read_timeout", 0.1), ("shutdown_timeout", 0.0), ("grammar_timeout", 0.1)):
            value = getattr(self, name)
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= minimum,
                f"server.{name}",
                f"must be a number of seconds >= {minimum:g}, got {value!r}",
            )

    def read_chat_template(self) -> str | None:
        if self.chat_template is None:
            return None
        return Path(self.chat_template).read_text(encoding="utf-8")


def api_key_from_env() -> str | None:
    value = os.environ.get(API_KEY_ENV, "").strip()
    return value or None
