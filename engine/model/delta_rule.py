"""The gated delta rule over a token tree: pure functions over tensors (no model, no cache).

The recurrence of a Gated DeltaNet layer (Qwen3-Next, Qwen3.5), per value head, state S [dk, dv]:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

with q, k L2-normalised and q scaled by dk^-0.5. Unrolled from a state S_0, with gamma_t the sum of g
along the path from S_0 to t:

    u_t + beta_t sum_{j < t} exp(gamma_t - gamma_j) (k_t . k_j) u_j = beta_t (v_t - exp(gamma_t) S_0^T k_t)
    o_t = exp(gamma_t) S_0^T q_t + sum_{j <= t} exp(gamma_t - gamma_j) (q_t . k_j) u_j

Both sums run over t's own path only, so over a tree every node gets exactly what the chain of its
ancestors gives: "j < t" becomes "j is a strict ancestor of t", a triangular system over the nodes in
parent-before-child order (the chunked form transformers and flash-linear-attention use, with the
ancestor mask in place of the causal one). Rows kept from earlier passes (`PastRows`: a draft's nodes
expanded before) enter as known terms. Nothing here materialises a per-node state: a node keeps
(k, u, gamma), [heads x (dk + dv + 1)], and the committed state advances along the accepted path only
(`advance_state`). Tests compare against transformers' torch_recurrent_gated_delta_rule per path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as transformers' (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@dataclass
class PastRows:
    """Pending rows of earlier passes (not committed), each row relative to the committed state."""

    keys: torch.Tensor  # [key heads, m, dk] fp32, normalised
    values: torch.Tensor  # [value heads, m, dv] fp32: u, the delta rule's corrected values
    gammas: torch.Tensor  # [value heads, m] fp32: log decay from the committed state through the row
    mask: torch.Tensor  # [n, m] bool: which of them are ancestors of each new row


@dataclass
class TreeRows:
    """What the new rows leave for later rows and for the commit (the same fields as PastRows')."""

    keys: torch.Tensor  # [key heads, n, dk]
    values: torch.Tensor  # [value heads, n, dv]
    gammas: torch.Tensor  # [value heads, n]


def masked_decay(gamma_rows: torch.Tensor, gamma_cols: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[..., n, m]: exp(gamma_rows[..., r] - gamma_cols[..., j]) where mask[r, j], else 0 (masked before
    the exp: a non-ancestor's difference may be positive and large)."""
    diff = gamma_rows[..., :, None] - gamma_cols[..., None, :]
    return diff.masked_fill(~mask, float("-inf")).exp()


def tree_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    ancestors: torch.Tensor,
    past: PastRows | None = None,
) -> tuple[torch.Tensor, TreeRows]:
    """The gated delta rule over n tree rows from the committed `state`.

    query, key: [n, key heads, dk] (raw: normalised here); value: [n, value heads, dv]; g (log decay,
    <= 0), beta: [n, value heads]; state: [value heads, dk, dv] fp32; ancestors: [n, n] bool, row r's
    ancestors among the rows, r included, every ancestor in an earlier row. Returns the output
    [n, value heads, dv] fp32 and the rows' (k, u, gamma). Value heads are grouped [key heads, repeats]:
    each key head's products are computed once for the value heads it serves."""
    num_rows, num_k, dk = key.shape
    num_v, dv = value.shape[1], value.shape[2]
    groups = (num_k, num_v // num_k)
    q = (l2norm(query.float()) * dk**-0.5).transpose(0, 1)  # [hk, n, dk]
    k = l2norm(key.float()).transpose(0, 1)
    v = value.float().transpose(0, 1).reshape(*groups, num_rows, dv)  # [hk, rep, n, dv]
    g_h, beta_h = g.float().T.reshape(*groups, num_rows), beta.float().T.reshape(*groups, num_rows)
    gamma = g_h @ ancestors.to(g_h.dtype).T  # [hk, rep, n]: sum of g over each row's ancestors in the pass
    if past is not None:
        # plus the gamma of the row's deepest past ancestor: the smallest (g <= 0 along a path)
        past_gammas = past.gammas.reshape(*groups, -1)  # [hk, rep, m]
        from_past = past_gammas[..., None, :].masked_fill(~past.mask, float("inf")).amin(dim=-1)  # [hk, rep, n]
        gamma = gamma + torch.where(past.mask.any(dim=1), from_past, 0.0)
    decay = masked_decay(gamma, gamma, ancestors)  # [hk, rep, n, n], 1 on the diagonal, 0 off the paths
    grouped_state = state.reshape(*groups, dk, dv)
    from_state = gamma.exp()[..., None]  # [hk, rep, n, 1]
    rhs = v - from_state * (k[:, None] @ grouped_state)  # [hk, rep, n, dv]
    out = from_state * (q[:, None] @ grouped_state)
    if past is not None:
        past_values = past.values.reshape(*groups, -1, dv)
        past_decay = masked_decay(gamma, past_gammas, past.mask)  # [hk, rep, n, m]
        rhs = rhs - (past_decay * (k @ past.keys.transpose(1, 2))[:, None]) @ past_values
        out = out + (past_decay * (q @ past.keys.transpose(1, 2))[:, None]) @ past_values
    rhs = rhs * beta_h[..., None]
    # lower triangle: strict ancestors (0 elsewhere, by decay); the diagonal is taken as 1 (unitriangular)
    system = beta_h[..., None] * (k @ k.transpose(1, 2))[:, None] * decay
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [hk, rep, n, dv]
    out = out + ((q @ k.transpose(1, 2))[:, None] * decay) @ u
    out = out.reshape(num_v, num_rows, dv).transpose(0, 1)
    return out, TreeRows(k, u.reshape(num_v, num_rows, dv), gamma.reshape(num_v, num_rows))


def advance_state(state: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """The state after a chain of m rows (the accepted path, in order) from `state` ([..., hv, dk, dv] fp32):
    exp(gamma_c) S + sum_j exp(gamma_c - gamma_j) k_j u_j^T, gamma_c the chain's last gamma.
    keys [..., hk, m, dk], values [..., hv, m, dv], gammas [..., hv, m] (relative to `state`); leading dims
    (layers) are batched."""
    repeats = values.shape[-3] // keys.shape[-3]
    k_h = keys if repeats == 1 else keys.repeat_interleave(repeats, dim=-3)
    last = gammas[..., -1:]  # [..., hv, 1]
    weighted = k_h * (last - gammas).exp()[..., None]  # [..., hv, m, dk]
    return last.exp()[..., None] * state + weighted.transpose(-1, -2) @ values
