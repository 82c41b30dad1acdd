"""A second live server with --max-queue 1, --api-key and --cors-origins: 429, 401, CORS, 503 while loading."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from tests.helpers.polling import WAIT_SECONDS

pytestmark = pytest.mark.slow

KEY = "test-key-123"
ORIGIN = "http://localhost:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded_server(start_serve):
    return start_serve("--budget", "8", "--max-queue", "1", "--max-running", "1", "--api-key", KEY, "--cors-origins", ORIGIN)


def test_loading_then_healthy(guarded_server) -> None:
    statuses = guarded_server.health_statuses
    # the engine loads in a thread after uvicorn is up: /health answers 503 meanwhile (tiny models load
    # in well under a second, so this window may be missed; test_api_app checks it with a slow loader)
    assert statuses[-1] == 200 and set(statuses[:-1]) <= {503}


def test_api_key(guarded_server) -> None:
    url = guarded_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401, headers
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and set(error) == {"message", "type", "param", "code"}
        assert response.headers["x-should-retry"] == "false"
    assert httpx.post(f"{url}/v1/chat/completions", content=b"junk").status_code == 401  # auth before parsing
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200  # /health stays open
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_cors(guarded_server) -> None:
    url = guarded_server.url
    preflight = httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    response = httpx.get(f"{url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    response = httpx.get(f"{url}/v1/models", headers={**AUTH, "Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in response.headers


def queue_depth(metrics_text: str) -> float:
    match = re.search(r"^specexec_queue_depth (\S+)$", metrics_text, re.MULTILINE)
    assert match
    return float(match.group(1))


def test_queue_bound_gives_429_and_the_others_complete(guarded_server) -> None:
    url = guarded_server.url
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 150, "temperature": 0,
            "ignore_eos": True}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=180) as http:
            started, release = asyncio.Event(), asyncio.Event()

            async def running() -> None:  # streams, so we know when it occupies the engine
                long = {**body, "max_tokens": 400, "stream": True}  # far longer than the test needs it
                async with http.stream("POST", "/v1/chat/completions", json=long) as resp:
                    assert resp.status_code == 200
                    async for _ in resp.aiter_lines():
                        started.set()
                        if release.is_set():
                            return  # hang up: the server aborts it and runs the queued one

            first = asyncio.create_task(running())
            await asyncio.wait_for(started.wait(), 60)
            second = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + WAIT_SECONDS
            while queue_depth((await http.get("/metrics")).text) != 1:
                assert time.monotonic() < deadline, "the second request never queued"
                await asyncio.sleep(0.02)
            extra = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(3)))
            assert not first.done()
            for response in extra:
                assert response.status_code == 429, response.text
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["code"] == "queue_full"
                assert response.headers.get("x-should-retry") != "false"
            release.set()
            await first
            done = await second
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 150
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            out = await sdk.chat.completions.create(model=done.json()["model"], messages=body["messages"],
                                                    max_tokens=2)
            assert out.choices[0].finish_reason in ("stop", "length")
            await sdk.close()

    asyncio.run(main())
    metrics = httpx.get(f"{url}/metrics").text
    assert 'specexec_requests_rejected_total{endpoint="chat",status="429"} 3.0' in metrics
