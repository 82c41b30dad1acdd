"""The tool-call readers on recorded-style model outputs (Qwen2.5 / Hermes, Llama 3.1 JSON,
Mistral), whole and streamed at every split, plus the JSON scanner against `json.loads`."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.toolcalls.json_scan import JsonScanner, Status
from server.toolcalls.output import ToolOutput
from server.toolcalls.parsers import FORMATS

Calls = list[tuple[str, dict[str, Any]]]

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
NESTED = ('{"name": "search", "arguments": {"query": "caf\\u00e9 \\"quoted\\" ✓", '
          '"filters": {"year": [2020, 2021.5, -3e2], "exact": true, "lang": null}}}')
NESTED_ARGS = {"query": 'café "quoted" ✓', "filters": {"year": [2020, 2021.5, -300.0], "exact": True, "lang": None}}
W_ARGS = {"city": "Paris", "unit": "c"}

# (format, model output, expected content, expected calls)
WELL_FORMED: list[tuple[str, str, str | None, Calls]] = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", None,
     [("get_weather", W_ARGS), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", f"I'll look that up.\n\n<tool_call>\n{WEATHER}\n</tool_call>", "I'll look that up.",
     [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\nDone, and <b>bold</b> text after.",
     "Done, and <b>bold</b> text after.", [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>\n{NESTED}\n</tool_call>", None, [("search", NESTED_ARGS)]),
    ("hermes", '<tool_call>\n{"name": "run", "arguments": {"code": "def f():\n    return 1\n"}}\n</tool_call>',
     None, [("run", {"code": "def f():\n    return 1\n"})]),  # a raw newline inside a string
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),  # keys in the other order
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',
     None, [("get_weather", {"city": "Rome"})]),  # arguments as a JSON string
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
    ("hermes", f"<tool_call>\n{WEATHER}", None, [("get_weather", W_ARGS)]),  # EOS before </tool_call>
    ("hermes", "The weather in Paris is sunny, 21°C. No <tool_call needed.", "The weather in Paris is sunny, "
     "21°C. No <tool_call needed.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None,
     [("get_weather", W_ARGS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None,
     [("get_weather", W_ARGS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', None,
     [("get_weather", W_ARGS), ("get_time", {"tz": "Europe/Paris"})]),
    ("llama3_json", '\n\n{"type": "function", "name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("llama3_json", "Let me check.<|python_tag|>" + '{"name": "get_time", "parameters": {"tz": "UTC"}}',
     "Let me check.", [("get_time", {"tz": "UTC"})]),
    ("llama3_json", "It is sunny in Paris today.\n", "It is sunny in Paris today.\n", []),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}]", None, [("get_weather", W_ARGS)]),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", None,
     [("get_weather", W_ARGS), ("get_time", {"tz": "Europe/Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}', None, [("get_weather", W_ARGS)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time{}', "Sure.",
     [("get_weather", W_ARGS), ("get_time", {})]),
    ("mistral", "It will rain in Paris [at noon].", "It will rain in Paris [at noon].", []),
]

# malformed tool-call text: whole, it is all content (and never an error)
MALFORMED: list[tuple[str, str]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>'),
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"tool": "get_weather", "args": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),
    ("llama3_json", '{"city": "Paris", "unit": "c"}'),  # JSON, but not a call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": True}}'),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": 'Paris'}}]"),
    ("mistral", "[TOOL_CALLS] Sorry, I cannot call tools."),
]


def run(fmt: str, pieces: list[str], eager: bool, max_calls: int | None = None) -> tuple[str | None, Calls, list[dict]]:
    """(content, calls, raw tool-call delta entries) of an output fed in `pieces`."""
    out = ToolOutput(FORMATS[fmt], eager=eager, max_calls=max_calls)
    deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    entries = [d.tool_call for d in deltas if d.tool_call is not None]
    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    for entry in entries:
        if "id" in entry:
            names[entry["index"]] = entry["function"]["name"]
        arguments[entry["index"]] = arguments.get(entry["index"], "") + entry["function"]["arguments"]
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]  # strict JSON: raises if not
    return (content if content or not calls else None), calls, entries


def whole(fmt: str, text: str, **kwargs) -> tuple[str | None, Calls]:
    out = ToolOutput(FORMATS[fmt], eager=False, **kwargs)
    content, calls = out.message(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


def splits(text: str, seed: int) -> list[list[str]]:
    """Every two-piece split, character by character, and random multi-piece splits."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), WELL_FORMED)
def test_recorded_outputs_whole(fmt: str, text: str, content: str | None, calls: Calls) -> None:
    assert whole(fmt, text) == (content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), WELL_FORMED)
def test_recorded_outputs_streamed_at_every_split(fmt: str, text: str, content: str | None, calls: Calls) -> None:
    for pieces in splits(text, seed=len(text)):
        for eager in (True, False):
            got_content, got_calls, entries = run(fmt, pieces, eager)
            assert (got_content, got_calls) == (content, calls), (eager, pieces)
            starts = [e for e in entries if "id" in e]
            assert [e["index"] for e in starts] == list(range(len(calls)))
            assert all(e["type"] == "function" and e["function"]["arguments"] == "" for e in starts)
            assert all(e["id"].startswith("call_") and len(e["id"]) == 29 for e in starts)
            assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                       for e in entries if "id" not in e)


def test_eager_streams_arguments_before_the_call_ends() -> None:
    out = ToolOutput(FORMATS["hermes"], eager=True)
    assert out.feed("<tool_call>\n") == []
    first = out.feed('{"name": "get_weather", "arguments": {"ci')
    assert [d.tool_call for d in first] == [
        {"index": 0, "id": first[0].tool_call["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"ci'}},
    ]
    assert [d.tool_call for d in out.feed('ty": "Paris"}}\n</tool_call>')] == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
    assert out.finish() == [] and out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_calls_are_content(fmt: str, text: str) -> None:
    assert whole(fmt, text) == (text, [])
    for pieces in splits(text, seed=1)[::7]:
        content, calls, _ = run(fmt, pieces, eager=False)
        assert (content, calls) == (text, [])


def test_streamed_call_broken_after_commit_keeps_every_character() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>'
    out = ToolOutput(FORMATS["hermes"], eager=True)
    deltas = [d for ch in text for d in out.feed(ch)] + out.finish()
    arguments = "".join(d.tool_call["function"]["arguments"] for d in deltas if d.tool_call)
    content = "".join(d.content for d in deltas if d.content is not None)
    assert arguments == '{"city": "Paris",' and content == "}}\n</tool_call>"
    assert text.endswith(arguments + content)


def test_text_around_calls_and_a_malformed_block_between_good_ones() -> None:
    text = (f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\nAnd <tool_call> oops </tool_call> then\n"
            f"<tool_call>{TIME}</tool_call>\nAll done.")
    expected = ("Checking.And <tool_call> oops </tool_call> thenAll done.",
                [("get_weather", W_ARGS), ("get_time", {"tz": "Europe/Paris"})])
    assert whole("hermes", text) == expected
    for pieces in splits(text, seed=2)[::5]:
        assert run("hermes", pieces, eager=True)[:2] == expected


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    assert whole("hermes", text, max_calls=1) == (None, [("get_weather", W_ARGS)])
    content, calls, entries = run("hermes", list(text), eager=True, max_calls=1)
    assert (content, calls) == (None, [("get_weather", W_ARGS)]) and {e["index"] for e in entries} == {0}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_a_call_cut_off_by_max_tokens_is_never_content(fmt: str) -> None:
    """Under the calls' grammar the output ends inside a call only when max_tokens cuts it: whole, the
    call is dropped; streamed, a call already sent keeps its arguments so far."""
    call = {"hermes": f"Sure.\n<tool_call>\n{WEATHER}", "llama3_json": WEATHER.replace("arguments", "parameters"),
            "mistral": f"Sure.[TOOL_CALLS][{WEATHER}"}[fmt]
    text = call[: call.index('"Paris"')]
    content = None if fmt == "llama3_json" else "Sure."
    assert whole(fmt, text) == (content or "", [])
    for pieces in splits(text, seed=3)[::9]:
        assert run(fmt, pieces, eager=False)[:2] == (content or "", [])
        got_content, _, entries = [*run_raw(fmt, pieces)]
        assert got_content == content and [e["function"]["name"] for e in entries if "id" in e] == ["get_weather"]
        assert "".join(e["function"]["arguments"] for e in entries) == '{"city": '


def run_raw(fmt: str, pieces: list[str]) -> tuple[str | None, None, list[dict]]:
    out = ToolOutput(FORMATS[fmt], eager=True)
    deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    return content or None, None, [d.tool_call for d in deltas if d.tool_call is not None]


def test_plain_text_passes_through_exactly() -> None:
    rng = random.Random(0)
    alphabet = "ab {}[]<>\"',:;\n\t✓日" + "tool_call" + "TOOL_CALLS" + "python_tag|"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for fmt in FORMATS:
            content, calls = whole(fmt, text)
            if not calls:
                assert content == text, (fmt, text)


def scan(text: str) -> tuple[Status, str]:
    scanner = JsonScanner()
    out = []
    status = Status.MORE
    for ch in text:
        status = scanner.feed(ch)
        if status is Status.ERROR:
            break
        out.append(scanner.last)
        if status is Status.DONE:
            break
    return status, "".join(out)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randint(0, 5 if depth < 3 else 2)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -1, 17, 3.25, -0.5e-7, 1e21, 123456789])
    if kind == 2:
        return "".join(rng.choice('ab "\\/\n\t\u00e9✓\x01') for _ in range(rng.randint(0, 6)))
    if kind in (3, 4):
        return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def test_json_scanner_agrees_with_json_loads() -> None:
    rng = random.Random(0)
    for _ in range(400):
        value = {"v": random_value(rng)}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        if rng.random() < 0.3:  # raw control characters inside strings, as models write them
            text = text.replace("\\n", "\n").replace("\\t", "\t")
        status, normalised = scan(text)
        assert status is Status.DONE and json.loads(normalised) == json.loads(text, strict=False)
        for _ in range(5):  # one character changed: accepted only if it is still JSON
            i = rng.randrange(len(text))
            broken = text[:i] + rng.choice('{}[]",:0-.eE tfn\\x') + text[i + 1:]
            status, normalised = scan(broken)
            if status is Status.DONE:  # strict JSON, the value json reads at the start of the text
                assert json.loads(normalised) == json.JSONDecoder(strict=False).raw_decode(broken.lstrip())[0]
                continue
            with pytest.raises(json.JSONDecodeError):
                json.loads(broken, strict=False)


@pytest.mark.parametrize("tail", ["\n<", "\n<tool_", "<tool_call"])
def test_a_marker_begun_when_max_tokens_cut_the_output_is_never_content(tail: str) -> None:
    """`tool_choice: "required"`: one call done, the next `<tool_call>` begun, then max_tokens. Whole or
    streamed at every split, the call is read and the partial marker is dropped; after an EOS (or a stop
    string) the same characters are the reply's text."""
    text = f"<tool_call>\n{WEATHER}\n</tool_call>{tail}"
    for eager in (False, True):
        for pieces in splits(text, seed=5)[::7]:
            out = ToolOutput(FORMATS["hermes"], eager=eager)
            deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish("length")
            assert not [d.content for d in deltas if d.content], (eager, pieces)
            assert [d.tool_call["function"]["name"] for d in deltas if d.tool_call and "id" in d.tool_call] == [
                "get_weather"]
    content, calls = ToolOutput(FORMATS["hermes"], eager=False).message(text, "length")
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [W_ARGS]
    assert ToolOutput(FORMATS["hermes"], eager=False).message(text, "stop")[0] == tail.strip()
    assert ToolOutput(FORMATS["hermes"], eager=False).message("a <", "length") == ("a ", None)
    assert ToolOutput(FORMATS["hermes"], eager=False).message("a <", "stop") == ("a <", None)
