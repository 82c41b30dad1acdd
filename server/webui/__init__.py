"""The built-in chat page at `/` (`--no-webui` turns it off): static files, every one served from here.

    GET  /            the page (server/webui/static/index.html); with --no-webui a plain-text 200
    HEAD /            200 either way (clients probe it: Claude Code does before anything else)
    GET  /webui/...   its scripts and styles

The page is open like /health: it holds nothing secret, and with --api-key it asks for the key and keeps
it in the tab's sessionStorage only; every API call it makes carries the key. A strict Content-Security-
Policy keeps the page to this origin (no inline script, no other host).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
RUNNING = "SpecExec Server is running\n"
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def install_webui(app: FastAPI, enabled: bool) -> None:
    """`/` (GET and HEAD) and, when `enabled`, the page's files under /webui."""

    async def root(request: Request) -> Response:
        if not enabled:
            return PlainTextResponse(RUNNING)
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    app.add_api_route("/", root, methods=["GET", "HEAD"])
    if enabled:
        app.mount("/webui", StaticFiles(directory=STATIC), name="webui")
