"""GPT-OSS for API tests: its real chat template, the tiny tokenizer with the harmony special tokens, and
a FakeEngine that writes a scripted harmony output and stops at `<|return|>` / `<|call|>`.

templates/openai-gpt-oss-120b.jinja is GPT-OSS's chat template as llama.cpp keeps it, unchanged:
ggml-org/llama.cpp, models/templates/openai-gpt-oss-120b.jinja (openai/gpt-oss-120b's template; copied
from the fork corbinjurgens/llama.cpp at 33732cb5df654489c2ca6ceea9b6687f0af64dca). Its generation
prompt ends with `<|start|>assistant`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import scripted_engine, tool_tokenizer

GPT_OSS_TEMPLATE = (Path(__file__).parent / "templates" / "openai-gpt-oss-120b.jinja").read_text()
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
STOP_TOKENS = ("<|return|>", "<|call|>")  # GPT-OSS's generation_config eos ids; <|end|> is not one

ANSWER = ("<|channel|>analysis<|message|>We need to add 2 and 2.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>')


@lru_cache(maxsize=1)
def harmony_tokenizer():
    return tool_tokenizer(GPT_OSS_TEMPLATE, HARMONY_TOKENS)


def harmony_engine(script: str, tokens_per_step: int = 1, **kwargs) -> FakeEngine:
    tokenizer = harmony_tokenizer()
    engine = scripted_engine(tokenizer, script, tokens_per_step, **kwargs)
    engine.eos_token_ids = frozenset(tokenizer.convert_tokens_to_ids(list(STOP_TOKENS)))
    return engine
