"""Measurements of a saved pair for its model card: greedy samples and tokens per target pass.

The held-out loss, accuracy and agreement are training.evaluate_pair; FIM quality is fim_eval.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from builder import fim_corpus

SAMPLE_PROMPT = "def fibonacci(n):\n"
FIM_SAMPLE = ("def add(a, b):\n    return ", "\n\n\ndef sub(a, b):\n    return a - b\n")  # (prefix, suffix)
ACCEPTANCE_PROMPTS = 5  # code prompts of bench.prompts
ACCEPTANCE_TOKENS = 64  # new tokens per prompt
ACCEPTANCE_BUDGET = 64


@torch.no_grad()
def sample(model: torch.nn.Module, tok: PreTrainedTokenizerFast, max_new_tokens: int) -> str:
    """Greedy continuation of SAMPLE_PROMPT (prompt included)."""
    enc = tok(SAMPLE_PROMPT, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)  # [1, prompt + new]
    return tok.decode(out[0], skip_special_tokens=True)


@torch.no_grad()
def fim_sample(model: torch.nn.Module, tok: PreTrainedTokenizerFast, max_new_tokens: int) -> str:
    """Greedy middle for FIM_SAMPLE's prefix and suffix (stops at EOS)."""
    enc = tok(fim_corpus.fim_prompt(*FIM_SAMPLE), return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)  # [1, prompt + new]
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def tokens_per_pass(out: Path) -> dict[tuple[str, float], float]:
    """Mean tokens per target pass (accepted + bonus) of the saved pair, at budget ACCEPTANCE_BUDGET,
    over the first ACCEPTANCE_PROMPTS code prompts: {(method, temperature): value}."""
    from bench.prompts import CODE_PROMPTS
    from engine.config import EngineConfig, ModelConfig, SpeculationConfig
    from engine.runtime import Engine
    from engine.types import Request, SamplingParams

    models = ModelConfig(target=str(out / "target"), draft=str(out / "draft"))
    base = Engine.load(EngineConfig(model=models, speculation=SpeculationConfig(budget=ACCEPTANCE_BUDGET)))
    new_tokens = min(ACCEPTANCE_TOKENS, base.max_context // 2)
    texts = CODE_PROMPTS[:ACCEPTANCE_PROMPTS]
    prompts = [base.tokenizer.encode(text)[: base.max_context - new_tokens] for text in texts]
    figures = {}
    for method in ("specexec", "specinfer"):
        engine = base.with_speculation(dataclasses.replace(base.config.speculation, method=method))
        for temperature in (0.0, 0.6):
            tokens = passes = 0
            for idx, prompt in enumerate(prompts):
                params = SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=idx, ignore_eos=True)
                for delta in engine.generate(Request(f"card-{idx}", prompt, params)):
                    if delta.totals is not None:
                        tokens += delta.totals.accepted_tokens + delta.totals.target_passes
                        passes += delta.totals.target_passes
            figures[method, temperature] = tokens / max(passes, 1)
    return figures


# Prompts that end where Enter and auto-indent leave an editor's cursor (issue 23: the pair once
# answered every one of them with EOS).
INDENTED_PROMPTS = (
    "def read_config(path):\n    ",
    "for i in range(10):\n    ",
    "try:\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "def add(a, b):\n    ",
    "if __name__ == '__main__':\n    ",
    "with open(path) as f:\n    ",
    "def main():\n    args = parse()\n    ",
)


@torch.no_grad()
def indented_continuations(model: torch.nn.Module, tok: PreTrainedTokenizerFast, max_new_tokens: int = 16) -> list[str]:
    """Greedy continuation (prompt excluded, stops at EOS) of each INDENTED_PROMPTS prompt."""
    outs = []
    for prompt in INDENTED_PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)  # [1, prompt + new]
        outs.append(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return outs
