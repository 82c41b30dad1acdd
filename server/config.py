"""HTTP server configuration: a frozen dataclass validated on construction.

Every field maps 1:1 to a `specexec serve` flag (`--field-name`) and to a key of the
`[server]` section of a configs/ TOML file. Flags override the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.config import require

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "SPECEXEC_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless told otherwise
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # protects /v1/*; None: open (env SPECEXEC_API_KEY also works)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed; ("*",) allows any
    chat_template: str | None = None  # Jinja file overriding the tokenizer's chat_template
    served_model_name: str | None = None  # model id over HTTP; default: the engine's model name
    ping_seconds: float = 5.0  # SSE `: ping` comment interval while a stream is open
    log_level: str = "info"

    def __post_init__(self) -> None:
        if isinstance(self.cors_origins, list):
            object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
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
            self.served_model_name is None or bool(self.served_model_name),
            "server.served_model_name",
            "must be a non-empty string",
        )
        require(
            isinstance(self.ping_seconds, (int, float)) and self.ping_seconds > 0,
            "server.ping_seconds",
            f"must be > 0, got {self.ping_seconds!r}",
        )
        require(self.log_level in LOG_LEVELS, "server.log_level", f"must be one of {', '.join(LOG_LEVELS)}")

    def read_chat_template(self) -> str | None:
        if self.chat_template is None:
            return None
        return Path(self.chat_template).read_text(encoding="utf-8")


def api_key_from_env() -> str | None:
    value = os.environ.get(API_KEY_ENV, "").strip()
    return value or None
