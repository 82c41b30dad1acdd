"""One request whose grammar allows nothing (no first token; a dead end after its first token; only
infinitely deep values), beside three streams, over HTTP: it gets its own 4xx (or its
own error event), the three finish with the text each gives alone, and /health answers ok all along (within a
bound only a stuck event loop misses: no latency threshold that a loaded machine could cross)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Count to ten."}]
EMPTY_LANGUAGES = [{"guided_regex": "[^\\s\\S]"}, {"guided_json": {"$ref": "#"}},
                   {"guided_json": {"type": "string", "pattern": "[^\\s\\S]"}},  # a dead end after '"'
                   {"guided_json": {"properties": {"child": {"$ref": "#"}}, "required": ["child"]}}]
HEALTH_TIMEOUT = 30.0  # seconds


async def stream_text(http: httpx.AsyncClient, body: dict) -> tuple[int, str, list[dict]]:
    """(status, text, error events) of a streamed chat completion."""
    text, errors = "", []
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, "", [response.json()]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event)
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
    return 200, text, errors


async def health_answers(http: httpx.AsyncClient, stop: asyncio.Event) -> int:
    """/health polled until `stop`: each answer 200 `ok` within HEALTH_TIMEOUT (a bound a stuck event loop
    fails and a loaded machine does not); how many answered."""
    answers = 0
    while not stop.is_set():
        response = await http.get("/health", timeout=HEALTH_TIMEOUT)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        answers += 1
        await asyncio.sleep(0.02)
    return answers


@pytest.mark.parametrize("grammar", EMPTY_LANGUAGES, ids=["regex", "self-ref-schema", "dead-end", "infinite"])
def test_an_empty_grammar_fails_alone_over_http(live_server, model_id, grammar) -> None:
    bodies = [{"model": model_id, "messages": [{"role": "user", "content": f"Count to {n}."}], "max_tokens": 24,
               "temperature": 0} for n in (3, 5, 7)]
    bad = {"model": model_id, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **grammar}

    async def main():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as http:
            stop = asyncio.Event()
            health = asyncio.create_task(health_answers(http, stop))
            results = await asyncio.gather(*(stream_text(http, b) for b in [bodies[0], bad, bodies[1], bodies[2]]))
            stop.set()
            alone = [await stream_text(http, b) for b in bodies]
            return results, alone, await health

    results, alone, num_health = asyncio.run(main())
    status, _, errors = results[1]
    assert (400 <= status < 500) or (status == 200 and errors), results[1]
    error = errors[0]["error"]
    assert error["type"] == "invalid_request_error" and error.get("code") != "internal_error", error
    for got, want in zip([results[0], results[2], results[3]], alone, strict=True):
        assert got[0] == 200 and not got[2] and got[1] == want[1]
    logged = len(live_server.log_path.read_bytes())
    whole = httpx.post(f"{live_server.url}/v1/chat/completions", json=bad, timeout=120)
    assert whole.status_code == 400 and whole.json()["error"]["type"] == "invalid_request_error", whole.text
    assert b"Traceback" not in live_server.log_path.read_bytes()[logged:]
    assert num_health >= 1  # polled from before the four requests began until they ended, every answer ok
