"""Fill-in-the-middle on the built-in default pair: the middles it fills in (greedy) make the file parse,
through /v1/completions `suffix`, /infill and Ollama's /api/generate `suffix` alike."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig, ModelConfig

DEFAULT_PAIR = Path(__file__).resolve().parents[2] / "models" / "default"
HAS_FIM = (DEFAULT_PAIR / "target" / "tokenizer.json").exists() and (
    "<|fim_prefix|>" in (DEFAULT_PAIR / "target" / "tokenizer.json").read_text(encoding="utf-8")
)

pytestmark = pytest.mark.skipif(
    not HAS_FIM, reason="models/default has no FIM tokens: rebuild it with `specexec build-default`"
)

# (prefix, suffix, start of the middle): holes whose greedy middle on the committed pair (checked by hand)
# ends with EOS and makes the file parse. The tiny pair continues the cursor's line well but often runs on
# past where the suffix begins (MODEL_CARD.md), so this checks the FIM path end to end, not completion
# quality.
CASES = [
    ("def close(self):\n    self.file.close(", "\n", "self."),
]


@pytest.fixture(scope="module")
def default_pair_engine() -> Any:
    from engine.runtime import Engine

    config = EngineConfig(model=ModelConfig(target=str(DEFAULT_PAIR / "target"), draft=str(DEFAULT_PAIR / "draft"),
                                            name="specexec-default"))
    return Engine.load(config)


def test_default_pair_asks_for_spm_prompts(default_pair_engine: Any) -> None:
    from server.fim import FimFormat

    fim = FimFormat.detect(default_pair_engine.tokenizer)
    assert fim is not None and fim.name == "qwen" and fim.order == "spm"


@pytest.mark.parametrize(("prefix", "suffix", "start"), CASES)
def test_default_pair_fills_a_middle_that_parses(fake_server: Callable, default_pair_engine: Any, prefix: str,
                                                 suffix: str, start: str) -> None:
    srv = fake_server(default_pair_engine)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(model="specexec-default", prompt=prefix, suffix=suffix, max_tokens=32,
                                    temperature=0)
    middle = out.choices[0].text
    assert out.choices[0].finish_reason == "stop" and middle.strip(), middle  # ended by EOS, not the limit
    assert middle.startswith(start), middle  # SPM: the middle continues the prefix at the cursor
    ast.parse(prefix + middle + suffix)
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 32, "temperature": 0}
    infill = httpx.post(f"{srv.url}/infill", json=body, timeout=120).json()
    assert infill["content"] == middle and infill["stop_type"] == "eos"
    ollama = httpx.post(f"{srv.url}/api/generate", timeout=120, json={  # Ollama's `suffix`: the same middle
        "model": "specexec-default", "prompt": prefix, "suffix": suffix, "stream": False,
        "options": {"num_predict": 32, "temperature": 0}}).json()
    assert ollama["response"] == middle and ollama["done_reason"] == "stop"


def test_continue_default_request_shapes_fit_the_context(fake_server: Callable, default_pair_engine: Any) -> None:
    """Continue sends max_tokens 4096 by default, far beyond the built-in pair's 1024-token context: the
    budget is cut to what the prompt leaves (200, ending with "length" if the model runs on)."""
    srv = fake_server(default_pair_engine)
    chat = {"model": "specexec-default", "max_tokens": 4096, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a function that reverses a string."}],
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=chat, timeout=300) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    usage = next(e for e in events if '"usage"' in e and '"choices":[]' in e)
    assert events[-1] == "[DONE]" and '"prompt_tokens"' in usage
    autocomplete = {"model": "specexec-default", "max_tokens": 4096, "temperature": 0.01, "stream": True,
                    "prompt": "<|fim_prefix|><|fim_suffix|>\n<|fim_middle|>def read(path):\n    return ",
                    "stop": ["<|endoftext|>", "\n\n"]}
    response = httpx.post(f"{srv.url}/v1/completions", json=autocomplete, timeout=300)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
