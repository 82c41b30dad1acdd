"""Per-node logits processing and sampling: pure functions with an explicit generator.

Order (as in vLLM): logit_bias, repetition penalty, presence/frequency penalties, temperature,
top_k, top_p, min_p. Penalties use the counts of generated tokens on each node's own path.
"""

from __future__ import annotations

import torch

from engine.types import SamplingParams

NEG_INF = float("-inf")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
) -> torch.Tensor:
    """logits: [n, vocab]; output_counts: [n, vocab] generated-token counts per node's path;
    prompt_mask: [vocab] bool, tokens present in the prompt (repetition penalty only)."""
    if params.repetition_penalty != 1.0:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        if output_counts is not None:
            seen |= output_counts > 0
        if prompt_mask is not None:
            seen |= prompt_mask[None, : logits.shape[1]]
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if output_counts is not None and (params.presence_penalty or params.frequency_penalty):
        logits = logits - params.frequency_penalty * output_counts
        logits = logits - params.presence_penalty * (output_counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float]) -> torch.Tensor:
    if not logit_bias:
        return logits
    keys = [i for i in logit_bias if i < logits.shape[1]]
    ids = torch.tensor(keys, dtype=torch.long, device=logits.device)
    vals = torch.tensor([logit_bias[i] for i in keys], dtype=logits.dtype, device=logits.device)
    logits = logits.clone()
    logits[:, ids] += vals
    return logits


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [n, 1]
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab] mass of strictly better tokens
    remove_sorted = mass_before >= top_p
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, NEG_INF)


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n, vocab] raw logits -> processed logits (-inf where removed). Greedy skips the
    distribution-shaping steps: argmax of the result is the greedy token."""
    logits = apply_logit_bias(logits.float(), params.logit_bias)
    logits = apply_penalties(logits, params, output_counts, prompt_mask)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p)


def sample_tokens(logits: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    """One token per row of processed logits [n, vocab]: argmax if greedy, else an independent
    fresh draw per row (exponential race, equivalent to multinomial)."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
