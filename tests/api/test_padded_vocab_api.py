"""Serving a pair whose target emits ids past the draft's embedding (tests/helpers/padded_vocab.py):
the real app over the real engine, driven by the openai SDK. Greedy completions of token-id prompts
come back as transformers' greedy generate on the target decodes them (ids past the tokenizer have
no text), with logprobs, streamed and not. (A prompt id past the tokenizer is a 400 at the API; the
engine takes one, tests/speculation/test_padded_vocab.py.)"""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from server.app import build_app
from server.config import ServerConfig
from tests.api.conftest import free_port, run_uvicorn
from tests.helpers.offload_passes import reference_greedy
from tests.helpers.padded_vocab import make_padded_pair, prompts

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target, draft, draft_rows = make_padded_pair(tmp_path_factory.mktemp("padded-api"))
    config = EngineConfig(model=ModelConfig(target=target, draft=draft), speculation=SpeculationConfig(budget=16),
                          limits=LimitsConfig(max_context=128))
    port = free_port()
    app = build_app(config, ServerConfig(port=port), Engine.load(config))
    server, thread = run_uvicorn(app, port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, target, draft_rows
    server.should_exit = True
    thread.join(timeout=15)


def test_greedy_completions_equal_the_target_alone(served):
    client, target, draft_rows = served
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model_id = client.models.list().data[0].id
    emitted_past_draft = 0
    for prompt in [p for p in prompts(draft_rows) if max(p) < len(tokenizer)]:
        want = reference_greedy(model, prompt, NEW_TOKENS)
        emitted_past_draft += sum(t >= draft_rows for t in want)
        reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == tokenizer.decode(want)
        assert len(reply.choices[0].logprobs.tokens) == NEW_TOKENS
        stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == tokenizer.decode(want)
    assert emitted_past_draft >= 5
