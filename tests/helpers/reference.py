"""Independent references, with no engine code: sampling options, each parameter by its documented meaning
in float64 (vLLM's order: repetition, then frequency and presence penalties); the target alone, greedy or
seeded, by a plain loop over transformers' forward (plain_loop)."""

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


@torch.no_grad()
def plain_loop(model: torch.nn.Module, prompt: list[int], params: SamplingParams, num_tokens: int) -> list[int]:
    """The target alone: `num_tokens` tokens by a plain loop over transformers' forward on the whole
    sequence (no KV cache), no EOS stop. Greedy: argmax. Seeded sampling (temperature only): the token
    at sequence position k is argmax(p / E), p = softmax(logits / temperature) in float64, E ~ Exp(1)
    per vocab entry from a generator seeded with position_seed(seed, k): the engine's documented seeded
    draw (an exponential race, i.e. one multinomial draw), which makes a seeded request's text a
    function of the target, the prompt and the seed alone."""
    from engine.speculation.sampling import position_seed  # the seed schedule only, no sampling code

    shaped = params.top_k, params.top_p, params.min_p, params.repetition_penalty, params.logit_bias
    assert shaped == (0, 1.0, 0.0, 1.0, {}) and not params.frequency_penalty and not params.presence_penalty, (
        "plain_loop samples by temperature alone"
    )
    assert params.greedy or params.seed is not None, "an unseeded draw has no reference text"
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].double()  # [vocab]
        if params.greedy:
            ids.append(int(logits.argmax()))
            continue
        probs = (logits / params.temperature).softmax(dim=-1)
        generator = torch.Generator().manual_seed(position_seed(params.seed, len(ids)))
        noise = torch.empty(logits.shape[0]).exponential_(generator=generator)  # fp32, as drawn per position
        ids.append(int((probs / noise.double()).argmax()))
    return ids[len(prompt) :]
