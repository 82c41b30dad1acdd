"""A logging pass-through between Open WebUI and `specexec serve` (manual check, not a test).

    .venv/bin/python scripts/open_webui_proxy.py --listen 8001 --upstream http://127.0.0.1:8000 --log requests.jsonl

Forwards every request unchanged (streams stay streams) and appends one JSON line per
/v1/*completions request (and per Ollama /api/chat or /api/generate request): what Open WebUI asked for (task kind guessed from the prompt, tools,
stream, max_tokens), the status, seconds to the first byte and in total, and the server's usage
and timings. Used by scripts/open-webui-check.sh to see which extra requests a chat message costs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

TASK_MARKERS = (  # the first line of Open WebUI's default task prompts (0.12, and older wordings)
    ("title", "Generate a concise title summarizing"),
    ("title", "Generate a concise, 3-5 word title"),
    ("follow_ups", "Predict 3-5 useful messages this user might"),
    ("follow_ups", "Suggest 3-5 relevant follow-up questions"),
    ("tags", "Generate 1-3 broad tags"),
    ("queries", "Analyze the chat history to determine the necessity of generating search queries"),
    ("autocomplete", "You are an autocompletion system"),
    ("emoji", "reflect the speaker's likely facial expression"),
)
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def task_kind(body: dict[str, Any]) -> str:
    text = json.dumps(body.get("messages") or body.get("prompt") or "")
    return next((kind for kind, marker in TASK_MARKERS if marker in text), "chat")


def summary(body: dict[str, Any]) -> dict[str, Any]:
    last = (body.get("messages") or [{}])[-1].get("content", body.get("prompt", ""))
    return {"kind": task_kind(body), "model": body.get("model"), "stream": bool(body.get("stream")),
            "tools": len(body.get("tools") or []), "tool_choice": body.get("tool_choice"),
            "max_tokens": body.get("max_tokens", body.get("max_completion_tokens")),
            "messages": len(body.get("messages") or []), "last": str(last)[:120],
            "keys": sorted(body)}


def usage_from(raw: bytes) -> dict[str, Any]:
    """usage / timings / finish_reason from a JSON body, the SSE events of a stream or the lines of an
    Ollama NDJSON stream (its last object: prompt_eval_count, eval_count, done_reason)."""
    found: dict[str, Any] = {}
    texts = [raw.decode("utf-8", "replace")]
    if raw.lstrip().startswith(b"data:") or b"\ndata:" in raw:
        texts = [line[5:].strip() for line in texts[0].splitlines() if line.startswith("data:")]
    elif raw.count(b"\n") > 1:
        texts = texts[0].splitlines()
    for text in texts:
        try:
            event = json.loads(text)
        except ValueError:
            continue
        for key in ("usage", "timings", "error"):
            if event.get(key):
                found[key] = event[key]
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                found["finish_reason"] = choice["finish_reason"]
        if event.get("done") is True and "eval_count" in event:  # Ollama's final object
            found["usage"] = {"prompt_tokens": event.get("prompt_eval_count"), "completion_tokens": event["eval_count"]}
            found["finish_reason"] = event.get("done_reason")
    return found


def build(upstream: str, log_path: Path) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        started, started_at = time.monotonic(), time.time()
        upstream_request = client.build_request(request.method, request.url.path, params=request.query_params,
                                                headers=headers, content=body)
        response = await client.send(upstream_request, stream=True)
        record: dict[str, Any] | None = None
        if request.method == "POST" and request.url.path.endswith(("completions", "/api/chat", "/api/generate")):
            try:
                record = summary(json.loads(body))
            except ValueError:
                record = {"kind": "unparsed"}
        chunks: list[bytes] = []
        first: list[float] = []

        async def relay():
            async for chunk in response.aiter_raw():
                if not first:
                    first.append(time.monotonic() - started)
                chunks.append(chunk)
                yield chunk

        async def finish() -> None:
            await response.aclose()
            if record is None:
                return
            record.update(started=time.strftime("%H:%M:%S", time.localtime(started_at)),
                          status=response.status_code, first_byte_s=round(first[0], 3) if first else None,
                          total_s=round(time.monotonic() - started, 3), **usage_from(b"".join(chunks)))
            with log_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers,
                                 background=BackgroundTask(finish))

    methods = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, default=8001)
    parser.add_argument("--upstream", default="http://127.0.0.1:8000")
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    uvicorn.run(build(args.upstream, args.log), host="127.0.0.1", port=args.listen, log_level="warning")


if __name__ == "__main__":
    main()
