"""GrammarCache (engine/speculation/grammar.py): a grammar stays while a spec object it was compiled for
lives, past the LRU's bound, and goes when those objects do; one compile per spec at a time."""

from __future__ import annotations

import gc
import threading
import time

import pytest

import engine.speculation.grammar as grammar
from engine.speculation.grammar import GrammarCache
from engine.types import StructuredOutput, StructuredOutputError


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """compile_spec replaced by a slow fake that records each spec it compiles (no tokenizer needed)."""
    compiled: list[str] = []

    def fake_compile(compiler: object, spec: StructuredOutput) -> object:
        time.sleep(0.05)
        compiled.append(spec.spec)
        if spec.spec == "bad":
            raise StructuredOutputError("bad spec")
        return object()

    monkeypatch.setattr(grammar, "compile_spec", fake_compile)
    monkeypatch.setattr(GrammarCache, "_get_compiler", lambda self, kept: None)
    return compiled


def test_a_grammar_stays_while_its_spec_object_lives(counting: list[str]) -> None:
    cache = GrammarCache(None, 10, [1], max_entries=2)
    queued = StructuredOutput("regex", "a+")  # validated by the server, then waits in the engine's queue
    first = cache.compile(queued)
    for i in range(5):  # others push it out of the LRU
        cache.compile(StructuredOutput("regex", f"x{i}"))
    assert cache.compile(queued) is first and counting.count("a+") == 1
    del queued
    gc.collect()
    for i in range(3):
        cache.compile(StructuredOutput("regex", f"y{i}"))
    assert StructuredOutput("regex", "a+") not in cache._held  # released once the object was gone
    cache.compile(StructuredOutput("regex", "a+"))
    assert counting.count("a+") == 2


def test_holds_do_not_keep_spec_objects_alive(counting: list[str]) -> None:
    cache = GrammarCache(None, 10, [1], max_entries=4)
    for i in range(200):
        cache.compile(StructuredOutput("regex", f"r{i}"))
    gc.collect()
    cache.compile(StructuredOutput("regex", "last"))
    assert len(cache._held) <= 4 + 1 and len(cache._entries) == 4


def test_one_compile_per_spec_at_a_time(counting: list[str]) -> None:
    cache = GrammarCache(None, 10, [1])
    results: list[object] = []
    errors: list[BaseException] = []

    def compile_it(text: str) -> None:
        try:
            results.append(cache.compile(StructuredOutput("regex", text)))
        except StructuredOutputError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=compile_it, args=(text,)) for text in ["same"] * 4 + ["bad"] * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counting.count("same") == 1 and len({id(r) for r in results}) == 1 and len(results) == 4
    assert counting.count("bad") == 1 and len(errors) == 3  # every waiter gets the one compile's error
    assert cache._compiling == {}


def test_the_heap_is_trimmed_after_compiles_on_threads_of_their_own(counting: list[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar's compile threads leave freed memory in glibc's per-thread arenas: trimmed after each
    compile that used them (docs/bench/hardening.md), also a failed one; a cache hit compiles nothing."""
    trims: list[int] = []
    monkeypatch.setattr(grammar, "release_free_heap", lambda: trims.append(1))
    cache = GrammarCache(None, 10, [1])
    monkeypatch.setattr(grammar, "compile_threads", lambda: 1)
    cache.compile(StructuredOutput("regex", "one"))
    assert trims == []
    monkeypatch.setattr(grammar, "compile_threads", lambda: 4)
    kept = StructuredOutput("regex", "two")
    cache.compile(kept)
    cache.compile(kept)
    with pytest.raises(StructuredOutputError):
        cache.compile(StructuredOutput("regex", "bad"))
    assert len(trims) == 2


def test_release_free_heap_runs_here() -> None:
    grammar.release_free_heap()  # glibc: malloc_trim; elsewhere nothing
