"""A real `specexec serve` process over a tiny model pair, driven by the official openai SDK."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.helpers.sse_helpers import assert_stream_invariants, post_stream

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
PROMPT = "for i in range(10):\n"


def check_sdk_stream(chunks: list[Any], chat: bool, include_usage: bool) -> tuple[str, str, Any]:
    """Stream invariants through the SDK's objects; returns (text, finish_reason, usage)."""
    assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
    assert {c.model for c in chunks} == {chunks[0].model}
    assert all(c.object == ("chat.completion.chunk" if chat else "text_completion") for c in chunks)
    choice_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in choice_chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length")
    usage = None
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
    else:
        assert all(c.usage is None for c in chunks) and len(choice_chunks) == len(chunks)
    if chat:
        assert choice_chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    else:
        text = "".join(c.choices[0].text for c in choice_chunks)
    assert choice_chunks[-1].timings["target_passes"] >= 1  # our extra object
    return text, finishes[-1], usage


def check_usage(usage: Any, completion_tokens: int | None = None) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens


def same_usage(a, b) -> bool:
    """Equal token counts (cached_tokens differ: a repeated request hits the prefix cache)."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return all(getattr(a, key) == getattr(b, key) for key in keys)


def test_chat_sync_stream_equals_non_stream(client: openai.OpenAI, model_id: str) -> None:
    full = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=24, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == model_id
    choice = full.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    check_usage(full.usage)
    assert full.usage.completion_tokens <= 24 and (choice.finish_reason == "stop") == (full.usage.completion_tokens < 24)
    timings = full.timings
    assert timings["target_passes"] >= 1 and timings["mean_accepted_per_pass"] >= 1.0
    assert timings["draft_tokens_accepted"] >= 0 and timings["generation_tokens_per_second"] > 0
    assert timings["prompt_tokens_per_second"] > 0
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text, finish, usage = check_sdk_stream(chunks, chat=True, include_usage=True)
    assert text == choice.message.content and finish == choice.finish_reason
    assert same_usage(usage, full.usage)
    # the second identical request found the first's KV: every prompt token but the last was cached
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_sync_stream_equals_non_stream(client: openai.OpenAI, model_id: str) -> None:
    full = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    check_usage(full.usage)
    for include_usage in (False, True):
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0,
                                                stream=True, **extra))
        text, finish, usage = check_sdk_stream(chunks, chat=False, include_usage=include_usage)
        assert text == full.choices[0].text and finish == full.choices[0].finish_reason
        if usage is not None:
            assert same_usage(usage, full.usage)


def test_async_client_both_endpoints(live_server, model_id: str) -> None:
    async def main() -> None:
        aclient = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)
        full = await aclient.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=16,
                                                     temperature=0)
        stream = await aclient.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=16,
                                                       temperature=0, stream=True)
        text, finish, _ = check_sdk_stream([c async for c in stream], chat=True, include_usage=False)
        assert (text, finish) == (full.choices[0].message.content, full.choices[0].finish_reason)
        plain = await aclient.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0)
        stream = await aclient.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        text, finish, usage = check_sdk_stream([c async for c in stream], chat=False, include_usage=True)
        assert (text, finish) == (plain.choices[0].text, plain.choices[0].finish_reason)
        check_usage(usage, plain.usage.completion_tokens)
        await aclient.close()

    asyncio.run(main())


def test_raw_wire_format(live_server, model_id: str) -> None:
    body = {"model": model_id, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    stream = post_stream(f"{live_server.url}/v1/chat/completions", body)
    assert_stream_invariants(stream, chat=True, include_usage=True)


def test_stop_string_across_tokens(client: openai.OpenAI, model_id: str) -> None:
    full = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0, stop=None)
    text = full.choices[0].text
    starts = [i for i in range(6, len(text) - 4) if "\ufffd" not in text[i : i + 4]]
    assert starts, f"no usable stop string in {text!r}"
    stop = text[starts[0] : starts[0] + 4]
    expected = text[: text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0,
                                        stop=[stop, "\x00never"], stream=stream)
        if stream:
            got, finish, _ = check_sdk_stream(list(out), chat=False, include_usage=False)
        else:
            got, finish = out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens < full.usage.completion_tokens
        assert got == expected and finish == "stop" and stop not in got


def test_max_tokens_one_gives_length(client: openai.OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=1, temperature=0)
    if out.usage.completion_tokens == 1:
        assert out.choices[0].finish_reason == "length"
    else:  # the first token was EOS
        assert out.usage.completion_tokens == 0 and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 1


def test_same_seed_same_text(client: openai.OpenAI, model_id: str) -> None:
    def sample(seed: int, stream: bool = False) -> str:
        out = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=1.0, top_p=0.95,
                                        seed=seed, stream=stream, extra_body={"ignore_eos": True})
        if stream:
            return "".join(c.choices[0].text for c in out if c.choices)
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first and sample(1234, stream=True) == first
    others = {sample(seed) for seed in (1, 2, 3)}
    assert len(others | {first}) > 1  # the seed actually matters


def test_concurrent_greedy_clients_get_their_solo_output(live_server, client: openai.OpenAI,
                                                         model_id: str) -> None:
    prompts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(8)]
    solo = [client.completions.create(model=model_id, prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in prompts]

    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0,
                                     timeout=300)

        async def one(i: int) -> str:
            if i % 2:  # half of them stream
                stream = await aclient.completions.create(model=model_id, prompt=prompts[i], max_tokens=16,
                                                          temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            out = await aclient.completions.create(model=model_id, prompt=prompts[i], max_tokens=16, temperature=0)
            return out.choices[0].text

        try:
            return list(await asyncio.gather(*(one(i) for i in range(8))))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == solo


def target_alone_greedy(model: Any, prompt_ids: list[int], max_tokens: int, eos_id: int) -> list[int]:
    """Plain greedy decoding with the target alone (transformers, full forward each step)."""
    import torch

    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            next_id = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if next_id == eos_id:
                break
            out.append(next_id)
            ids.append(next_id)
    return out


def test_greedy_http_equals_target_alone(client: openai.OpenAI, model_id: str, tiny_pair) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    target_path = tiny_pair[0]
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    for prompt in (PROMPT, "class Point:\n    def __init__(self"):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        expected_ids = target_alone_greedy(model, prompt_ids, 48, tokenizer.eos_token_id)
        expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
        for prompt_arg in (prompt, prompt_ids):
            out = client.completions.create(model=model_id, prompt=prompt_arg, max_tokens=48, temperature=0)
            assert out.choices[0].text == expected
            assert out.usage.completion_tokens == len(expected_ids)
            assert out.choices[0].finish_reason == ("length" if len(expected_ids) == 48 else "stop")


def test_a_second_chat_turn_is_served_from_the_prefix_cache(client: openai.OpenAI, model_id: str) -> None:
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    turn1 = client.chat.completions.create(model=model_id, messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": turn1.choices[0].message.content},
                 {"role": "user", "content": "Now one that subtracts them."}]
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert turn1.usage.prompt_tokens - 1 <= cached < usage.prompt_tokens  # turn 1's prompt at least
