"""Independent references for sampling options: each parameter by its documented meaning, in float64,
with no engine code (vLLM's order: repetition, then frequency and presence penalties)."""

from __future__ import annotations

from collections import Counter

import torch

from engine.types import SamplingParams


def penalise(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[vocab] raw logits -> penalised float64 logits. repetition_penalty divides positive and
    multiplies negative logits of tokens seen in prompt or output; frequency_penalty subtracts
    penalty x count in the output; presence_penalty subtracts penalty once per output token."""
    out = logits.double().clone()
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            value = float(out[token])
            out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(output).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out
