"""Log-probabilities of a step's emitted tokens, from the target logits verification already has.

A step emits m tokens: the accepted path's tokens after the root, then the bonus token. Token j
(0-based) was drawn at path node path[j], so its log-prob is row path[j] of the processed logits
(NodeLogits: penalties from that node's own path, then temperature, top_k, top_p, min_p; greedy
requests stop after the penalties: the logits before temperature, so without penalties the raw
log-probabilities, which vLLM reports by default). With structured output the distribution is the
constrained one (tokens the grammar forbids at -inf, the rest renormalised), the one tokens are drawn
from. Only the m path rows are processed here, in blocks, and the result stays on the device until
the step's one `.tolist()`.
"""

from __future__ import annotations

import torch

from engine.speculation.sampling import NodeLogits, block_rows, blocks
from engine.speculation.tree import Tree
from engine.types import SamplingParams, TokenLogprob


def path_chain(tree: Tree, path: torch.Tensor) -> Tree:
    """The path's nodes as a chain tree: node i of the chain is tree node path[i], with the same
    ancestors (so the same penalty counts); the chain's root is the tree's. path: [m], root first."""
    num_nodes = path.shape[0]
    return Tree(
        token_ids=tree.token_ids[path],
        parents=torch.arange(-1, num_nodes - 1, device=path.device),
        depths=tree.depths[path],
        scores=tree.scores[path],
        ancestors=tree.ancestors[path][:, path],  # [m, m] lower triangular
        draft_slots=tree.draft_slots[path],
        allowed=None if tree.allowed is None else tree.allowed[path],
    )


def emitted_logprobs(
    tree: Tree,
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    path: torch.Tensor,
    new_ids: torch.Tensor,
) -> torch.Tensor:
    """[m * (1 + 2k)] float64 (k = params.logprobs; empty when None): per emitted token its
    log-prob, the k largest log-probs, then their token ids (exact in float64). No host sync.

    logits: [n, vocab] raw target logits; path: [m] accepted nodes; new_ids: [m] the emitted tokens;
    output_counts, prompt_mask: as verification used them (counts before this step)."""
    if params.logprobs is None:
        return torch.zeros(0, dtype=torch.float64, device=logits.device)
    vocab_size = logits.shape[1]
    num_top = min(params.logprobs, vocab_size)
    chain = path_chain(tree, path)
    nodes = NodeLogits(chain, logits[path], params, output_counts, prompt_mask, chain.allowed)
    parts = []
    for rows in blocks(path.shape[0], block_rows(vocab_size)):
        log_probs = nodes[rows].log_softmax(dim=-1)  # [rows, vocab]
        chosen = log_probs.gather(1, new_ids[rows, None])  # [rows, 1]
        top = log_probs.topk(num_top, dim=-1)  # [rows, k] each
        parts.append(torch.cat([chosen.double(), top.values.double(), top.indices.double()], dim=1))
        del log_probs
    return torch.cat(parts).flatten()


def unpack_logprobs(values: list[float], num_tokens: int) -> list[TokenLogprob]:
    """emitted_logprobs' values (on the host) -> one TokenLogprob per emitted token."""
    width = len(values) // num_tokens
    num_top = (width - 1) // 2
    assert len(values) == num_tokens * width and width == 1 + 2 * num_top, "one row of 1 + 2k values per token"
    out = []
    for j in range(num_tokens):
        row = values[j * width : (j + 1) * width]
        out.append(TokenLogprob(row[0], [int(t) for t in row[1 + num_top :]], row[1 : 1 + num_top]))
    return out
