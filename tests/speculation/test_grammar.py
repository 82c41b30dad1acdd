"""Structured output's grammar state (engine/speculation/grammar.py) and its masks in drafting and processing.

References are independent of the code under test: a fresh xgrammar matcher per node that accepts the
node's whole path (no tree walk, no rollback), bits read one by one in Python, and for the draft, the
check that every child the draft proposed is a token a fresh matcher accepts at its parent.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import xgrammar

from engine.config import SpeculationConfig
from engine.speculation.grammar import GrammarCache, GrammarState
from engine.speculation.sampling import NodeLogits, apply_allowed, process_logits, unpack_allowed
from engine.speculation.step import verify_step
from engine.speculation.tree import Tree, append_nodes
from engine.types import SamplingParams, StructuredOutput, StructuredOutputError
from tests.helpers.bigram import bigram_sampled_tree, bigram_tree
from tests.helpers.tiny_models import build_tokenizer

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)
EOS = TOKENIZER.eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "count": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["color", "count", "ok"],
}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return GrammarCache(TOKENIZER, VOCAB, [EOS])


def fresh_mask(cache: GrammarCache, spec: StructuredOutput, path: list[int]) -> list[bool]:
    """[vocab] the tokens allowed after `path`, from a new matcher; all True if the path is rejected
    or ends the grammar (the state's convention for nodes that are never reached)."""
    matcher = xgrammar.GrammarMatcher(cache.compile(spec))
    if not all(matcher.accept_token(t) for t in path) or matcher.is_terminated():
        return [True] * VOCAB
    bits = xgrammar.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bits)
    words = bits[0].tolist()
    return [bool((words[t // 32] >> (t % 32)) & 1) for t in range(VOCAB)]


def grammar_tree(cache: GrammarCache, spec: StructuredOutput, prefix: list[int], num_nodes: int, seed: int) -> Tree:
    """A random tree below the root: mostly tokens allowed at their parent, some leaves that are not
    (a parent is always a node the grammar accepts); siblings distinct."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, paths = [5], [-1], [[]]
    taken: list[set[int]] = [set()]
    valid = [0]
    for node in range(1, num_nodes):
        parent = valid[int(torch.randint(max(0, len(valid) - 6), len(valid), (), generator=gen))]
        allowed = [t for t, ok in enumerate(fresh_mask(cache, spec, prefix + paths[parent])) if ok]
        constrained = len(allowed) < VOCAB
        pool = allowed if torch.rand((), generator=gen) < 0.85 else list(range(VOCAB))
        free = [t for t in pool if t not in taken[parent]] or [t for t in range(VOCAB) if t not in taken[parent]]
        token = free[int(torch.randint(len(free), (), generator=gen))]
        tokens.append(token)
        parents.append(parent)
        paths.append(paths[parent] + [token])
        taken[parent].add(token)
        taken.append(set())
        if constrained and token in allowed and token != EOS:
            valid.append(node)
    ancestors = torch.ones(1, 1, dtype=torch.bool)
    for node in range(1, num_nodes):
        ancestors = append_nodes(ancestors, torch.tensor([parents[node]]))
    depths = [0] + [len(p) for p in paths[1:]]
    return Tree(token_ids=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                scores=torch.zeros(num_nodes), ancestors=ancestors, draft_slots=torch.full((num_nodes,), -1))


def node_paths(tree: Tree) -> list[list[int]]:
    paths: list[list[int]] = [[]]
    for node in range(1, tree.num_nodes):
        paths.append(paths[int(tree.parents[node])] + [int(tree.token_ids[node])])
    return paths


@pytest.mark.parametrize("spec", [JSON_SPEC, StructuredOutput("json_object"), StructuredOutput("regex", r"(ab|cd)+e?")],
                         ids=["json_schema", "json_object", "regex"])
def test_masks_at_every_node_equal_a_fresh_matcher_on_its_path(cache, spec):
    committed = [TOKENIZER.encode('{"color"', add_special_tokens=False), [], TOKENIZER.encode("ab")][
        ["json_schema", "json_object", "regex"].index(spec.kind)]
    state = cache.new_state(spec, torch.device("cpu"))
    assert state.accept(committed) == len(committed)
    tree = grammar_tree(cache, spec, committed, 40, seed=len(spec.spec))
    want = [fresh_mask(cache, spec, committed + path) for path in node_paths(tree)]
    got = unpack_allowed(state.bitmask(tree), VOCAB).tolist()
    assert got == want
    assert sum(not all(row) for row in want) >= 5  # most nodes really are constrained
    nodes = torch.tensor([7, 0, 3, 7])
    assert state.masks_for(tree, nodes).tolist() == [want[7], want[0], want[3], want[7]]
    root_only = Tree.single(5, torch.device("cpu"))
    assert unpack_allowed(state.bitmask(root_only), VOCAB).tolist() == [want[0]]  # the matcher came back


def test_accept_counts_the_tokens_up_to_the_end_of_the_grammar(cache):
    state = cache.new_state(StructuredOutput("json_schema", '{"enum": ["red", "green"]}'), torch.device("cpu"))
    text = TOKENIZER.encode('"red"', add_special_tokens=False)
    assert state.accept(text[:2]) == 2 and not state.terminated
    assert state.accept([*text[2:], EOS, 7, 8]) == len(text) - 2 + 1
    assert state.terminated and state.num_consumed == len(text) - 1


def test_unpack_reads_bit_j_of_word_w_as_token_32w_plus_j():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (5, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    words = bits.tolist()
    for vocab in (70, 96, 100):  # cut inside the last word; exactly the width; wider (padded ids: False)
        want = [[t < 96 and bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)] for row in words]
        assert unpack_allowed(bits, vocab).tolist() == want


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={4: 5.0}),
                                    SamplingParams(temperature=0.7, top_k=3, top_p=0.9, presence_penalty=0.5)],
                         ids=["greedy", "sampled"])
def test_node_logits_forbid_what_the_grammar_forbids_before_processing(cache, params):
    tree = grammar_tree(cache, JSON_SPEC, [], 12, seed=1)
    state = cache.new_state(JSON_SPEC, torch.device("cpu"))
    bits = state.bitmask(tree)
    allowed = torch.tensor([fresh_mask(cache, JSON_SPEC, path) for path in node_paths(tree)])
    raw = torch.randn(tree.num_nodes, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    counts = torch.zeros(VOCAB)
    got = NodeLogits(tree, raw, params, counts, None, bits)[0 : tree.num_nodes]
    plain = NodeLogits(tree, raw.masked_fill(~allowed, float("-inf")), params, counts, None)[0 : tree.num_nodes]
    assert torch.equal(got, plain)
    assert bool((got[~allowed] == float("-inf")).all())
    assert bool(allowed[torch.arange(tree.num_nodes), got.argmax(-1)].all())
    assert torch.equal(apply_allowed(raw, None), raw)
    assert torch.equal(process_logits(apply_allowed(raw, bits), params), process_logits(raw.masked_fill(~allowed, float("-inf")), params))


def proposed_children_are_allowed(cache: GrammarCache, spec: StructuredOutput, tree: Tree) -> bool:
    paths = node_paths(tree)
    for node in range(1, tree.num_nodes):
        parent = int(tree.parents[node])
        if not fresh_mask(cache, spec, paths[parent])[int(tree.token_ids[node])]:
            return False
    return True


DRAFT_TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(9)) * 2  # [prev token, vocab]
SPEC = SpeculationConfig(budget=48, max_expand=8, max_children=6, max_depth=8)
STOP = torch.zeros(VOCAB, dtype=torch.bool)
STOP[EOS] = True


def specexec_tree(state: GrammarState | None, params: SamplingParams, root: int = 5) -> Tree:
    mask = None if state is None else state.masks_for
    return bigram_tree(DRAFT_TABLE, root, params, SPEC, SPEC.budget, STOP, mask)


def specinfer_tree(state: GrammarState | None, params: SamplingParams, gen: torch.Generator, root: int = 5) -> Tree:
    mask = None if state is None else state.masks_for
    return bigram_sampled_tree(DRAFT_TABLE, root, params, SPEC.budget, SPEC.max_depth, STOP, gen, mask)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_draft_never_proposes_a_child_the_grammar_forbids(cache, temperature):
    params = SamplingParams(temperature=temperature)
    state = cache.new_state(JSON_SPEC, torch.device("cpu"))
    free = specexec_tree(None, params)
    assert not proposed_children_are_allowed(cache, JSON_SPEC, free)  # unconstrained, it would
    for tree in (specexec_tree(state, params), specinfer_tree(state, params, torch.Generator().manual_seed(3))):
        assert tree.num_nodes >= 8
        assert proposed_children_are_allowed(cache, JSON_SPEC, tree)
    sampled = specinfer_tree(state, params, torch.Generator().manual_seed(4))
    assert sampled.draft_probs is not None
    paths = node_paths(sampled)
    for node in range(sampled.num_nodes):  # the draft distribution at every expanded node: allowed tokens only
        if sampled.draft_probs[node].sum() > 0:
            allowed = torch.tensor(fresh_mask(cache, JSON_SPEC, paths[node]))
            assert float(sampled.draft_probs[node][~allowed].sum()) == 0.0


def test_a_spec_the_compiler_refuses_is_a_structured_output_error(cache):
    bad = [
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "nonsense"),
        (StructuredOutput("json_schema", "{not json"), "JSON schema"),
        (StructuredOutput("regex", "a(b"), "regex"),
    ]
    for spec, word in bad:
        with pytest.raises(StructuredOutputError, match=word) as info:
            cache.compile(spec)
        assert not str(info.value).startswith("[") and ".cc:" not in str(info.value)  # no C++ log prefix
    with pytest.raises(StructuredOutputError, match="kind"):
        StructuredOutput("xml")  # type: ignore[arg-type]
    with pytest.raises(StructuredOutputError, match="tokenizer"):
        GrammarCache(None, VOCAB, [EOS]).compile(JSON_SPEC)


def test_compiled_grammars_are_cached_least_recently_used_first_out():
    small = GrammarCache(TOKENIZER, VOCAB, [EOS], max_entries=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first = small.compile(a)
    assert small.compile(StructuredOutput("regex", "a+")) is first  # keyed by the spec's value
    small.compile(b)
    small.compile(a)  # a is now the most recent
    small.compile(c)  # drops b
    assert small.compile(a) is first
    assert small.compile(b) is not None and len(small._entries) == 2


def test_special_tokens_are_never_text_inside_the_grammar(cache):
    """Inside a JSON string any character may come, but not the tokenizer's special tokens (their
    text would be dropped or misread when decoded); EOS only where the grammar may end."""
    state = cache.new_state(StructuredOutput("json_object"), torch.device("cpu"))
    state.accept(TOKENIZER.encode('{"a', add_special_tokens=False))
    inside = state.masks_for(Tree.single(5, torch.device("cpu")), torch.zeros(1, dtype=torch.long))[0]
    assert int(inside.sum()) > 200  # a string takes almost any token
    assert not any(bool(inside[t]) for t in TOKENIZER.all_special_ids)
    state.accept(TOKENIZER.encode('": 1}', add_special_tokens=False))
    after = state.masks_for(Tree.single(5, torch.device("cpu")), torch.zeros(1, dtype=torch.long))[0]
    assert after.nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("rows_per_block", [1, 5, None])
def test_verification_with_masks_equals_verification_of_premasked_logits(cache, params, rows_per_block):
    """Masks are applied row by row inside each block: any block size gives what verification gives
    for logits with the forbidden tokens already at -inf (same path, bonus and generator state)."""
    tree = grammar_tree(cache, JSON_SPEC, [], 24, seed=4)
    bits = cache.new_state(JSON_SPEC, torch.device("cpu")).bitmask(tree)
    allowed = unpack_allowed(bits, VOCAB)
    raw = torch.randn(tree.num_nodes, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    counts = torch.zeros(VOCAB)
    gen_masked, gen_plain = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    masked = verify_step(tree, raw, params, counts, None, gen_masked, rows_per_block=rows_per_block, allowed=bits)
    plain = verify_step(tree, raw.masked_fill(~allowed, float("-inf")), params, counts, None, gen_plain)
    assert masked.path.tolist() == plain.path.tolist() and int(masked.bonus_id) == int(plain.bonus_id)
    assert torch.equal(gen_masked.get_state(), gen_plain.get_state())
    tree.allowed = bits  # verify_step's default: the tree's own masks
    again = verify_step(tree, raw, params, counts, None, torch.Generator().manual_seed(8))
    assert again.path.tolist() == masked.path.tolist() and int(again.bonus_id) == int(masked.bonus_id)


def test_a_structural_tag_writes_the_special_tokens_it_names_and_no_others() -> None:
    """Special tokens never appear in structured output, except those a spec names (a tool-call marker
    that is a special token): the grammar reads those as their text."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    tag = json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"],
                      "tags": [{"type": "tag", "begin": "[TOOL_CALLS]", "end": "]",
                                "content": {"type": "regex", "pattern": r"\[[a-z]+"}}]}})
    kept = xgrammar.GrammarMatcher(cache.compile(StructuredOutput("structural_tag", tag, ("[TOOL_CALLS]",))))
    assert kept.accept_token(marker) and kept.accept_string("[abc]") and kept.accept_token(tokenizer.eos_token_id)
    blocked = xgrammar.GrammarMatcher(cache.compile(StructuredOutput("structural_tag", tag)))
    assert not blocked.accept_token(marker)
    assert not blocked.accept_token(tokenizer.convert_tokens_to_ids("<|pad|>"))


def accepts(cache: GrammarCache, spec: StructuredOutput, text: str) -> bool:
    """Whether the grammar takes `text` whole and may then end."""
    matcher = xgrammar.GrammarMatcher(cache.compile(spec))
    return matcher.accept_string(text) and matcher.accept_token(EOS)


TOOL_TAG = json.dumps({"type": "structural_tag", "format": {
    "type": "tag", "begin": '<tool_call>\n{"name": "f", "arguments": ',
    "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]},
        "max_whitespace_cnt": 16}, "end": "}\n</tool_call>"}})


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "structural_tag"])
def test_json_is_compact_by_default_and_free_on_request(cache, kind) -> None:
    """Compact: exactly json.dumps's separators (", ", ": ") and no other whitespace, so a model cannot
    spend its tokens on whitespace; free: up to 16 whitespace characters per gap."""
    spec = {"json_schema": JSON_SPEC, "json_object": StructuredOutput("json_object"),
            "structural_tag": StructuredOutput("structural_tag", TOOL_TAG)}[kind]
    value = {"color": "red", "count": 3, "ok": True} if kind != "structural_tag" else {"city": "Paris", "days": [1, 2]}
    wrap = (lambda text: f'<tool_call>\n{{"name": "f", "arguments": {text}}}\n</tool_call>') \
        if kind == "structural_tag" else (lambda text: text)
    compact = json.dumps(value)
    others = [json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2),
              compact.replace(": ", ":  ", 1), compact.replace("{", "{ ", 1)]
    free = dataclasses.replace(spec, json_whitespace="free")
    assert spec.json_whitespace == "compact" and accepts(cache, spec, wrap(compact))
    assert not any(accepts(cache, spec, wrap(text)) for text in [*others, " " + compact])
    assert accepts(cache, free, wrap(compact)) and all(accepts(cache, free, wrap(text)) for text in others)
    assert not accepts(cache, free, wrap(compact.replace("{", "{" + " " * 17, 1)))


def test_json_whitespace_is_checked() -> None:
    with pytest.raises(StructuredOutputError, match="json_whitespace"):
        StructuredOutput("json_object", json_whitespace="pretty")
