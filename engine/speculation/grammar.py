"""Structured output: a grammar compiled against the tokenizer (xgrammar) decides which tokens each
tree node may take.

`GrammarCache` compiles `StructuredOutput` specs, once per spec (LRU; one compile at a time per spec), for
one tokenizer and vocabulary (one xgrammar compiler per set of special tokens a spec lets through;
usually one). A compiled grammar also stays while any spec object it was compiled for
lives: a request validated by the server and still queued finds its grammar when it starts, however
many others went through the LRU meanwhile (else the engine's own thread would compile it, and every
running request would wait). JSON schemas are checked first for keywords the grammar engine would not
enforce, and rewritten where it enforces them otherwise (engine/speculation/schema_support.py).
`GrammarState` is one request's matcher. Its state is the grammar after every committed token (the
tree's root is the last committed token, so the root's mask is the matcher's own). `bitmask` walks
the paths of a tree's nodes with accept/rollback and returns to that state; `accept` advances it
after a step commits tokens. Masks are packed 32 tokens to an int32 word (sampling.unpack_allowed).

xgrammar is imported on first use: a server that never sees a grammar never loads it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import platform
import re
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from engine.speculation.reasoning_prefix import reasoning_prefix
from engine.speculation.sampling import BITS_PER_WORD, unpack_allowed
from engine.speculation.schema_support import enforceable, enforceable_tag
from engine.speculation.tree import Tree
from engine.types import StructuredOutput, StructuredOutputError

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per engine
# Whitespace characters allowed between JSON elements with json_whitespace "free": room for
# pretty-printing, but a model cannot stall a request in an endless run of spaces.
MAX_JSON_WHITESPACE = 16
JSON_SEPARATORS = (", ", ": ")  # json_whitespace "compact": as json.dumps and chat templates' tojson print JSON
ALL_TOKENS = -1  # a packed word with every bit set
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " prefix


def compile_error(spec: StructuredOutput, exc: Exception) -> StructuredOutputError:
    what = {"json_object": "JSON grammar", "json_schema": "JSON schema", "regex": "regex",
            "structural_tag": "structural tag"}[spec.kind]
    first = _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return StructuredOutputError(f"the {what} cannot be compiled: {first}")


class GrammarCache:
    """Compiled grammars for one tokenizer, at most `max_entries`, least recently used dropped.
    Thread-safe: the server compiles in its threads, the engine's worker looks up."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the target's logits width (may exceed the tokenizer's)
        self.stop_token_ids = sorted(stop_token_ids)  # end the grammar (EOS); empty: the tokenizer's EOS
        self.max_entries = max_entries
        self._entries: OrderedDict[StructuredOutput, xgrammar.CompiledGrammar] = OrderedDict()
        # spec -> [compiled, number of holds]: one hold per compile() call, released when that call's spec
        # object is garbage; finalizers only append to `_released` (any thread), compile() applies them
        self._held: dict[StructuredOutput, list[Any]] = {}
        self._released: deque[StructuredOutput] = deque()
        self._compiling: dict[StructuredOutput, Future[xgrammar.CompiledGrammar]] = {}
        self._compilers: dict[tuple[str, ...], xgrammar.GrammarCompiler] = {}  # by the special tokens kept
        self._special_texts: frozenset[str] | None = None  # the tokenizer's, on the first compile
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec`, kept while `spec` (this object) lives; StructuredOutputError if
        it cannot be compiled. A spec another thread is compiling waits for that compile."""
        with self._lock:
            self._apply_releases()
            compiled = self._lookup(spec)
            if compiled is not None:
                self._hold(spec, compiled)
                return compiled
            compiler = self._get_compiler(kept_tokens(spec))
            pending = self._compiling.get(spec)
            owner = pending is None
            if pending is None:
                pending = self._compiling[spec] = Future()
        if not owner:
            compiled = pending.result()  # the other compile's grammar, or its error
        else:
            compiled = self._compile_owned(compiler, spec, pending)
        with self._lock:
            self._hold(spec, compiled)
        return compiled

    def _compile_owned(self, compiler: xgrammar.GrammarCompiler, spec: StructuredOutput,
                       pending: Future[xgrammar.CompiledGrammar]) -> xgrammar.CompiledGrammar:
        try:
            compiled = compile_spec(compiler, spec)  # outside the lock: a large schema takes a while
        except BaseException as exc:
            with self._lock:
                del self._compiling[spec]
            pending.set_exception(exc)
            raise
        finally:
            if compile_threads() > 1:
                release_free_heap()
        with self._lock:
            del self._compiling[spec]
            self._entries[spec] = compiled
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def _lookup(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar | None:
        """Under the lock: the LRU's entry (now the most recent), else a held one."""
        compiled = self._entries.get(spec)
        if compiled is not None:
            self._entries.move_to_end(spec)
            return compiled
        held = self._held.get(spec)
        return None if held is None else held[0]

    def _hold(self, spec: StructuredOutput, compiled: xgrammar.CompiledGrammar) -> None:
        """Under the lock: keep `compiled` until this `spec` object is garbage."""
        key = dataclasses.replace(spec)  # an equal copy: a key must not keep `spec` alive
        entry = self._held.setdefault(key, [compiled, 0])
        entry[1] += 1
        weakref.finalize(spec, self._released.append, key)

    def _apply_releases(self) -> None:
        """Under the lock: drop the holds of spec objects that are gone."""
        while self._released:
            key = self._released.popleft()
            entry = self._held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]

    def new_state(self, spec: StructuredOutput, device: torch.device) -> GrammarState:
        return GrammarState(self.compile(spec), self.vocab_size, device)

    def _get_compiler(self, kept: tuple[str, ...]) -> xgrammar.GrammarCompiler:
        """Made on first use, under the lock; one per set of special tokens kept as text (a kept text that is
        no special token of the tokenizer changes nothing, so it makes no compiler of its own)."""
        if self.tokenizer is None:
            raise StructuredOutputError("structured output needs the model's tokenizer, and this model has none")
        if self._special_texts is None:
            self._special_texts = special_texts(self.tokenizer)
        key = tuple(sorted(set(kept) & self._special_texts))
        if key not in self._compilers:
            import xgrammar

            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids, key)
            # this class is the cache; half the cores at most, so a long compile leaves the engine its own
            self._compilers[key] = xgrammar.GrammarCompiler(info, max_threads=compile_threads(), cache_enabled=False)
        return self._compilers[key]


@functools.cache
def compile_threads() -> int:
    """xgrammar's threads per compile: half the usable cores (at least one, at most its default 8)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, min(8, cores // 2))


def release_free_heap() -> None:
    """glibc: hand the free memory of every malloc arena back to the system (malloc_trim). xgrammar
    starts threads of its own for each compile (more than one thread); what they allocate and free
    stays in glibc's per-thread arenas, and resident memory grows with each new grammar (measured in
    docs/bench/hardening.md). Elsewhere: nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def special_texts(tokenizer: Any) -> frozenset[str]:
    """The texts of the tokenizer's special added tokens (what `tokenizer_info` may keep as text)."""
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(token.content for i, token in added.items() if token.special or i in special)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                   kept: Sequence[str] = ()) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens (BOS, chat and FIM
    markers, ...) as xgrammar's special tokens: never allowed, where xgrammar alone would read
    "<|im_start|>" as text a JSON string may contain. Stop tokens still end the grammar. Special
    tokens named in `kept` (by text) stay tokens of their text (xgrammar never allows a special
    token, not even one a structural tag names by id)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=list(stop_token_ids) or None)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
    kept_ids = {added_id for added_id, token in added.items() if token.content in kept}
    special -= kept_ids
    vocab = [b"" if i in special else text for i, text in enumerate(info.decoded_vocab)]  # b"": special
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                  stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
    """json_object: any JSON object; json_schema: strict mode (no properties or items the schema does
    not name, as OpenAI's strict schemas require; every such output is valid under the schema);
    structural_tag: as given, each of its JSON schemas checked and rewritten as a json_schema spec is
    (engine/speculation/schema_support.py). JSON whitespace as `spec.json_whitespace` says: compact (a
    structural tag's JSON schemas become grammars of compact JSON) or free. With `spec.reasoning`, the
    reasoning block's grammar (engine/speculation/reasoning_prefix.py) comes first, then that one."""
    import xgrammar

    try:
        if spec.reasoning is None:
            return build_grammar(spec, compiler.compile_json_schema, compiler.compile_structural_tag,
                                 compiler.compile_regex)
        grammar = build_grammar(spec, xgrammar.Grammar.from_json_schema, xgrammar.Grammar.from_structural_tag,
                                xgrammar.Grammar.from_regex)
        return compiler.compile_grammar(xgrammar.Grammar.concat(reasoning_prefix(spec.reasoning), grammar))
    except StructuredOutputError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise compile_error(spec, exc) from None


def build_grammar(spec: StructuredOutput, from_schema: Callable[..., Any], from_tag: Callable[[str], Any],
                  from_regex: Callable[[str], Any]) -> Any:
    """`spec`'s grammar made by xgrammar's makers (a compiler's `compile_*`, or `Grammar.from_*`)."""
    compact = spec.json_whitespace == "compact"
    json_format = {"any_whitespace": False, "separators": JSON_SEPARATORS} if compact else {
        "any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    if spec.kind == "json_object":
        return from_schema('{"type": "object"}', strict_mode=False, **json_format)
    if spec.kind == "json_schema":
        schema = enforceable(json.loads(spec.spec))  # not JSON: a clearer message than the compiler's
        return from_schema(json.dumps(schema), strict_mode=True, **json_format)
    if spec.kind == "structural_tag":
        tag = enforceable_tag(json.loads(spec.spec))
        return from_tag(json.dumps(compact_json_tag(tag) if compact else tag))
    return from_regex(spec.spec)


def kept_tokens(spec: StructuredOutput) -> tuple[str, ...]:
    """The special tokens `spec`'s grammar reads as their text: its own, and its reasoning block's tags."""
    block = spec.reasoning
    return spec.special_tokens if block is None else (*spec.special_tokens, block.open, block.close)


def compact_json_tag(tag: Any) -> Any:
    """A parsed structural tag with each of its JSON schemas (strict, as the tag's own are) as the grammar
    of compact JSON under that schema: the tag format has no whitespace setting of its own. A schema in
    another style (Qwen's `<parameter=k>v</parameter>` XML, style "qwen_xml") is kept as it is."""
    import xgrammar

    if isinstance(tag, list):
        return [compact_json_tag(value) for value in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema" and "json_schema" in tag and tag.get("style", "json") == "json":
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(tag["json_schema"]), any_whitespace=False,
                                                    separators=JSON_SEPARATORS, strict_mode=True)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: compact_json_tag(value) for key, value in tag.items()}


class GrammarState:
    """One request's grammar: the matcher at the committed tokens, and this step's masks by path."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, device: torch.device):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // BITS_PER_WORD)
        self.device = device
        self.num_consumed = 0  # tokens of the last `accept` the grammar took (all, unless it ended)
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}  # path below the root -> [words] int32, this step
        self._dead_ends: set[tuple[int, ...]] = set()  # paths (this step) after which the grammar allows nothing

    @property
    def terminated(self) -> bool:
        """The grammar took its stop token: the output is complete."""
        return self.matcher.is_terminated()

    def check_live(self) -> None:
        """Raise StructuredOutputError when the grammar allows no token after the committed ones (an
        empty language, e.g. a schema that only refers to itself): the request cannot go on."""
        if self.terminated:
            return
        self._fill([()] if () not in self._rows else [])
        if () in self._dead_ends:
            raise dead_end()

    def bitmask(self, tree: Tree, nodes: torch.Tensor | None = None) -> torch.Tensor:
        """[k, ceil(vocab / 32)] int32 on the device: the packed masks of the tokens the grammar allows
        after each of `nodes` ([k] node indices; None: every node), from each node's own path. A node
        whose path the grammar rejects, or completes with its stop token, allows every token (it is
        never reached, or its row is never used); so does a dead end, a path after which the grammar
        allows nothing (a language empty past a first token, such as a string pattern that matches
        nothing): no distribution is emptied, and a token committed there is refused by `accept` with
        a StructuredOutputError. One host sync (the tree's ids and parents)."""
        num_nodes = tree.num_nodes
        parts = [tree.token_ids, tree.parents] if nodes is None else [tree.token_ids, tree.parents, nodes]
        host = torch.cat(parts).tolist()
        tokens, parents = host[:num_nodes], host[num_nodes : 2 * num_nodes]
        wanted = range(num_nodes) if nodes is None else host[2 * num_nodes :]
        paths: list[tuple[int, ...]] = [()]  # token ids below the root, root first; parents precede children
        for node in range(1, num_nodes):
            paths.append(paths[parents[node]] + (tokens[node],))
        keys = [paths[node] for node in wanted]
        self._fill([key for key in dict.fromkeys(keys) if key not in self._rows])
        return torch.stack([self._rows[key] for key in keys]).to(self.device)

    def masks_for(self, tree: Tree, nodes: torch.Tensor) -> torch.Tensor:
        """[k, vocab] bool on the device: the tokens the grammar allows after each of `nodes` ([k])."""
        return unpack_allowed(self.bitmask(tree, nodes), self.vocab_size)

    def _fill(self, keys: list[tuple[int, ...]]) -> None:
        """Masks of these paths into the step's table: a depth-first walk (sorted paths share prefixes)
        that accepts each path's tokens past the common prefix, rolls back the rest, ends where it began."""
        if not keys:
            return
        buffer = torch.full((len(keys), self.num_words), ALL_TOKENS, dtype=torch.int32)  # [m, words]
        accepted: list[int] = []  # tokens accepted beyond the committed state
        for row, key in sorted(enumerate(keys), key=lambda item: item[1]):
            common = 0
            while common < min(len(accepted), len(key)) and accepted[common] == key[common]:
                common += 1
            if len(accepted) > common:
                self.matcher.rollback(len(accepted) - common)
                del accepted[common:]
            for token in key[common:]:
                if not self.matcher.accept_token(token):
                    break
                accepted.append(token)
            if len(accepted) == len(key) and not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(buffer, row)
                if not bool(buffer[row].any()):
                    self._dead_ends.add(key)
                    buffer[row] = ALL_TOKENS
            self._rows[key] = buffer[row]
        if accepted:
            self.matcher.rollback(len(accepted))

    def accept(self, new_ids: Sequence[int]) -> int:
        """Advance past a step's committed tokens; returns (and keeps in num_consumed) how many the
        grammar took: all, or up to and including the one that completed it."""
        dead_ends, self._dead_ends = self._dead_ends, set()
        self._rows.clear()
        self.num_consumed = len(new_ids)
        for index, token in enumerate(new_ids):
            if self.matcher.is_terminated():
                self.num_consumed = index
                break
            if not self.matcher.accept_token(token):
                if tuple(new_ids[:index]) in dead_ends:
                    raise dead_end()
                raise AssertionError(f"committed token {token} is outside the grammar (verification masks every node)")
        return self.num_consumed


def dead_end() -> StructuredOutputError:
    return StructuredOutputError(
        "the structured output's grammar allows no token here: its language is empty (e.g. a schema that only "
        "refers to itself, a regex that matches nothing, or a string pattern that matches nothing)")
