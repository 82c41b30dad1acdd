"""The tree form of the gated delta rule equals transformers' own recurrence along every path.

Reference: transformers' torch_recurrent_gated_delta_rule (one token at a time, fp32) run over each
node's path from the same initial state. Checked: every node's output, a tree scored in two passes
(the second pass's rows reading the first's as past rows, as a draft's later expansions do), grouped
value heads, and the state advanced along one path (advance_state) against the recurrence's final
state. A rule that reads a sibling's row instead of an ancestor's is caught."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from engine.model.delta_rule import PastRows, advance_state, tree_delta_rule
from tests.helpers.trees import ancestors_and_depths, path_of

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 5, 9, 9]
TOL = 1e-5


def inputs(num_nodes: int, heads: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    num_k, num_v = heads
    gen = torch.Generator().manual_seed(seed)
    dk, dv = 8, 6
    return dict(
        query=torch.randn(num_nodes, num_k, dk, generator=gen),
        key=torch.randn(num_nodes, num_k, dk, generator=gen),
        value=torch.randn(num_nodes, num_v, dv, generator=gen),
        g=-torch.rand(num_nodes, num_v, generator=gen) * 2.0,
        beta=torch.rand(num_nodes, num_v, generator=gen),
        state=torch.randn(num_v, dk, dv, generator=gen) * 0.5,
    )


def recurrent(x: dict[str, torch.Tensor], path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' recurrence over the path's rows: (outputs [len, hv, dv], final state [hv, dk, dv])."""
    out, state = torch_recurrent_gated_delta_rule(
        x["query"][path][None], x["key"][path][None], x["value"][path][None], g=x["g"][path][None],
        beta=x["beta"][path][None], initial_state=x["state"][None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state[0]


@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_every_node_equals_the_recurrence_along_its_path(heads):
    x = inputs(len(PARENTS), heads, seed=1)
    ancestors, _ = ancestors_and_depths(PARENTS)
    out, _ = tree_delta_rule(x["query"], x["key"], x["value"], x["g"], x["beta"], x["state"], ancestors)
    for node in range(len(PARENTS)):
        want, _ = recurrent(x, path_of(PARENTS, node))
        torch.testing.assert_close(out[node], want[-1], atol=TOL, rtol=TOL)


def test_two_passes_with_past_rows_equal_one():
    """Nodes 0-4 in a first pass; 5-11 in a second that reads the first's rows as past rows."""
    x = inputs(len(PARENTS), (2, 4), seed=2)
    ancestors, _ = ancestors_and_depths(PARENTS)
    first, second = list(range(5)), list(range(5, len(PARENTS)))
    pick = {name: t[first] for name, t in x.items() if name != "state"}
    _, rows = tree_delta_rule(**pick, state=x["state"], ancestors=ancestors[first][:, first])
    past = PastRows(rows.keys, rows.values, rows.gammas, ancestors[second][:, first])
    pick = {name: t[second] for name, t in x.items() if name != "state"}
    out, _ = tree_delta_rule(**pick, state=x["state"], ancestors=ancestors[second][:, second], past=past)
    for row, node in enumerate(second):
        want, _ = recurrent(x, path_of(PARENTS, node))
        torch.testing.assert_close(out[row], want[-1], atol=TOL, rtol=TOL)


def test_the_state_advances_along_one_path():
    x = inputs(len(PARENTS), (2, 4), seed=3)
    ancestors, _ = ancestors_and_depths(PARENTS)
    _, rows = tree_delta_rule(x["query"], x["key"], x["value"], x["g"], x["beta"], x["state"], ancestors)
    path = path_of(PARENTS, 10)
    state = advance_state(x["state"], rows.keys[:, path], rows.values[:, path], rows.gammas[:, path])
    _, want = recurrent(x, path)
    torch.testing.assert_close(state, want, atol=TOL, rtol=TOL)
    wrong = path_of(PARENTS, 11)  # a sibling's path: a different state
    moved = advance_state(x["state"], rows.keys[:, wrong], rows.values[:, wrong], rows.gammas[:, wrong])
    assert not torch.allclose(moved, want, atol=1e-3)


def test_a_sibling_read_as_an_ancestor_is_caught():
    x = inputs(len(PARENTS), (2, 2), seed=4)
    ancestors, _ = ancestors_and_depths(PARENTS)
    wrong = ancestors.clone()
    wrong[4, 3] = True  # node 4 also "sees" its sibling 3
    out, _ = tree_delta_rule(x["query"], x["key"], x["value"], x["g"], x["beta"], x["state"], wrong)
    want, _ = recurrent(x, path_of(PARENTS, 4))
    assert not torch.allclose(out[4], want[-1], atol=1e-3)
