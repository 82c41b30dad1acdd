"""What keeps a web page from driving a key-less server on the same machine.

- Host check (DNS rebinding): a page on evil.example whose name is re-pointed at 127.0.0.1
  reaches this server with `Host: evil.example`. While bound to a loopback address only loopback
  names are answered (`localhost`, `127.x.x.x`, `[::1]`, any port); `--allowed-hosts` adds names,
  `*` allows all. Bound to any other address (a LAN IP, 0.0.0.0) every name is allowed unless
  `--allowed-hosts` lists some. Others get an OpenAI-shaped 403.
- JSON only: a cross-site `fetch` may POST `text/plain` (or no content type) without a CORS
  preflight; `require_json` refuses any POST body that is not `application/json` with 415.
"""

from __future__ import annotations

import ipaddress

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.config import ServerConfig
from server.errors import forbidden_host, unsupported_media_type

LOOPBACK_NAMES = frozenset({"localhost"})
JSON_CHARSETS = frozenset({"utf-8", "utf8"})


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1 (brackets allowed)."""
    host = host.strip("[]").lower().rstrip(".")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """The Host names accepted besides loopback ones; None: any name."""
    extra = frozenset(h.lower().strip("[]").rstrip(".") for h in config.allowed_hosts)
    if "*" in extra:
        return None
    if not extra and not is_loopback(config.host):
        return None
    return extra


def host_name(header: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, _ = header.partition(":")
    return name.rstrip(".")


class HostCheckMiddleware:
    """Pure ASGI (streams pass through untouched): a 403 for a Host header not allowed."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            # no Host header (HTTP/1.0): no browser sends that, so there is nothing to rebind
            if header is not None and not self.host_ok(host_name(header)):
                await forbidden_host(header).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def host_ok(self, name: str) -> bool:
        return name in self.allowed or is_loopback(name)


def require_json(request: Request) -> None:
    """Dependency of POST routes: the body must be `application/json` (charset utf-8, if given)."""
    value = request.headers.get("content-type")
    media, *params = (value or "").split(";")
    charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in params
                    if p.strip().lower().startswith("charset=")), None)
    if media.strip().lower() != "application/json" or (charset is not None and charset not in JSON_CHARSETS):
        raise unsupported_media_type(value)
