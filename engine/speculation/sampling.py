"""Per-node logits processing and sampling: pure functions with an explicit generator.

Order (as in vLLM): the grammar's allowed tokens (structured output), logit_bias, repetition
penalty, presence/frequency penalties, temperature, top_k, top_p, min_p. Penalties use the counts of
generated tokens on each node's own path.

A tree's logits are processed in blocks of rows (NodeLogits), so the transient memory of
processing is bounded by the block size, not by the number of nodes: every step is row-wise.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.speculation.tree import Tree, path_token_counts
from engine.types import SamplingParams

NEG_INF = float("-inf")
LOGITS_BLOCK_BYTES = 64 << 20  # one [rows, vocab] fp32 block of processing
# Blocks alive at once while one block is processed: at most 7 of processing's own tensors (sort
# indices count 2; tests/speculation/test_bounded_processing.py), plus CUDA sort's index and radix buffers.
LOGITS_WORKSPACE_BLOCKS = 12


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


BiasTensors = tuple[torch.Tensor, torch.Tensor]  # ([k] long token ids, [k] fp32 biases)


def bias_tensors(logit_bias: dict[int, float], vocab_size: int, device: torch.device) -> BiasTensors | None:
    """logit_bias on the device, once per step rather than once per block (None: nothing in vocab)."""
    keys = [i for i in logit_bias if i < vocab_size]
    if not keys:
        return None
    ids = torch.tensor(keys, dtype=torch.long, device=device)
    return ids, torch.tensor([logit_bias[i] for i in keys], dtype=torch.float32, device=device)


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float] | BiasTensors | None) -> torch.Tensor:
    """[n, vocab] logits plus the bias (a dict, or bias_tensors made once for many calls)."""
    if isinstance(logit_bias, dict):
        logit_bias = bias_tensors(logit_bias, logits.shape[1], logits.device) if logit_bias else None
    if logit_bias is None:
        return logits
    ids, vals = logit_bias
    logits = logits.clone()
    logits[:, ids] += vals.to(logits.dtype)
    return logits


BITS_PER_WORD = 32  # packed allowed-token masks: bit j of word w is token 32 * w + j


@functools.cache
def byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool on `device`: bit i of byte value v (masks are packed lowest bit first, as xgrammar
    fills them), made once per device."""
    return (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)[None, :]) & 1 == 1


def unpack_allowed(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, ceil(vocab / 32)] int32 packed masks -> [k, vocab_size] bool (ids past the packed width:
    False). Transient memory: one [k, vocab] bool and one [k, vocab / 8] long."""
    assert sys.byteorder == "little", "packed masks are read byte by byte, lowest bit first"
    as_bytes = bits.contiguous().view(torch.uint8)  # [k, 4 * words]
    allowed = byte_bits(bits.device)[as_bytes.long()].flatten(1)  # [k, 32 * words]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))


def apply_allowed(logits: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    """[n, vocab] logits with the tokens a grammar forbids at -inf; bits: [n, words] packed masks
    (None: unconstrained, `logits` returned as is). Out of place."""
    if bits is None:
        return logits
    return logits.masked_fill(~unpack_allowed(bits, logits.shape[1]), NEG_INF)


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
    del sorted_logits  # each [n, vocab] temporary is freed as soon as it is used
    mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)  # [n, vocab] mass of strictly better tokens
    del sorted_probs
    remove_sorted = mass_before >= top_p
    del mass_before
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    del order, remove_sorted
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
    return shape_logits(penalise_logits(logits, params, output_counts, prompt_mask), params)


def penalise_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor | None,
    prompt_mask: torch.Tensor | None,
    bias: BiasTensors | None = None,
) -> torch.Tensor:
    """logit_bias (`bias` when prepared, else params.logit_bias), then the penalties: [n, vocab] raw
    logits -> fp32 (possibly `logits` itself)."""
    logits = apply_logit_bias(logits.float(), params.logit_bias if bias is None else bias)
    return apply_penalties(logits, params, output_counts, prompt_mask)


def shape_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p on penalised [n, vocab] logits (greedy: unchanged)."""
    if params.greedy:
        return logits
    logits = logits / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p)


def sample_tokens(
    logits: torch.Tensor, greedy: bool, generator: torch.Generator, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of processed logits [n, vocab]: argmax if greedy, else a draw per row by
    exponential race (equivalent to multinomial): argmax of p / E with E ~ Exp(1) per entry, fresh
    from `generator`, or the given `noise` rows ([n, vocab'] with vocab' >= vocab)."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(noise[:, : probs.shape[1]]).argmax(dim=-1)


def position_seed(seed: int, position: int) -> int:
    """A generator seed for the token at `position` of a sequence sampled with `seed`."""
    return (seed * 6364136223846793005 + position * 1442695040888963407 + 1) % (1 << 63)


def position_noise(seed: int, first_position: int, count: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[count, vocab] Exp(1) noise for the tokens at positions first_position .. + count - 1, each row a
    function of (seed, position) alone. Sample-and-match draws every node at depth d with row d: only
    one node per depth lies on the accepted walk, so the emitted tokens are exact draws, and a seeded
    request's output is the same whatever tree, budget or batch it runs in (and without speculation)."""
    generator = torch.Generator(device=device)
    rows = torch.empty(count, vocab_size, device=device)
    for row in range(count):
        generator.manual_seed(position_seed(seed, first_position + row))
        rows[row].exponential_(generator=generator)
    return rows


def block_rows(vocab_size: int, block_bytes: int | None = None) -> int:
    """Rows per processing block: a [rows, vocab] fp32 block stays within block_bytes
    (None: LOGITS_BLOCK_BYTES). Depends on nothing else, so seeded draws are reproducible."""
    return max(1, (block_bytes or LOGITS_BLOCK_BYTES) // (vocab_size * 4))


def blocks(num_rows: int, rows_per_block: int) -> Iterator[slice]:
    """Consecutive row slices of at most rows_per_block rows covering [0, num_rows), in order."""
    for begin in range(0, num_rows, rows_per_block):
        yield slice(begin, min(begin + rows_per_block, num_rows))


def logits_workspace_bytes(vocab_size: int, block_bytes: int | None = None) -> int:
    """Device memory that processing a tree's logits needs beyond the raw logits themselves."""
    return LOGITS_WORKSPACE_BLOCKS * block_rows(vocab_size, block_bytes) * vocab_size * 4


@dataclass(frozen=True)
class NodeLogits:
    """A tree's processed logits, computed on demand from each node's own path: `nodes[a:b]` is
    process_logits of rows a..b-1 ([b - a, vocab] fp32), equal to those rows of the whole matrix,
    after the tokens `allowed` forbids are set to -inf (so greedy is constrained greedy and sampling
    draws from the constrained distribution). Nothing of size [n, vocab] is made besides `raw`."""

    tree: Tree
    raw: torch.Tensor  # [n, vocab] raw target logits
    params: SamplingParams
    output_counts: torch.Tensor  # [vocab] float, generated tokens so far (the root too, if generated)
    prompt_mask: torch.Tensor | None  # [vocab] bool
    allowed: torch.Tensor | None = None  # [n, ceil(vocab / 32)] int32 packed grammar masks; None: all

    bias: BiasTensors | None = field(init=False)  # params.logit_bias on the device, made once

    def __post_init__(self) -> None:
        bias = bias_tensors(self.params.logit_bias, self.raw.shape[1], self.raw.device)
        object.__setattr__(self, "bias", bias)

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        raw = self.raw[rows] if self.allowed is None else apply_allowed(self.raw[rows].float(), self.allowed[rows])
        penalised = penalise_logits(raw, self.params, self.path_counts(rows), self.prompt_mask, self.bias)
        return shape_logits(penalised, self.params)  # the counts are freed before shaping

    def path_counts(self, rows: slice) -> torch.Tensor | None:
        """[num_rows, vocab] generated-token counts on each node's path, or None without penalties."""
        if not self.params.uses_penalties:
            return None
        counts = path_token_counts(self.tree, self.raw.shape[1], rows)
        return counts.add_(self.output_counts[None])
