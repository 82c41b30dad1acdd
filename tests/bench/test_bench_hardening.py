"""bench/hardening.py and bench/hardening_memory.py without a server: the bodies are what the checks
say (sizes, value counts), the six schemas are the ones the engine refuses, the summaries add up."""

from __future__ import annotations

import json

import pytest

from bench.hardening import MIB, big_schema, infill_body, issue_schemas, many_values_body, slow_request
from bench.hardening import summary as latency_summary
from bench.hardening_memory import new_schema, schema_memory
from engine.speculation.schema_support import enforceable
from engine.types import StructuredOutputError
from server.json_body import MAX_JSON_VALUES, check_json_size


def test_bodies_have_the_sizes_the_checks_name() -> None:
    body = many_values_body(16 * MIB - 1024)
    assert len(body) <= 16 * MIB and json.loads(body)["junk"][-1] == 1
    with pytest.raises(Exception) as info:  # refused before parsing
        check_json_size(body)
    assert info.value.code == "too_many_json_values"
    assert len(big_schema("x")["properties"]) == 10_000
    path, raw = slow_request("schema", 0)
    assert path == "/v1/chat/completions" and 500_000 < len(raw) < 800_000  # the issue's ~600 KB
    path, raw = slow_request("infill", 0)
    assert path == "/infill" and 11 * MIB < len(raw) < 14 * MIB
    assert json.loads(slow_request("infill-parse", 1)[1])["model"] == "no-such-model"
    check_json_size(json.dumps(infill_body(12 * MIB)).encode())  # far fewer values than MAX_JSON_VALUES
    assert MAX_JSON_VALUES < 8_000_000


@pytest.mark.parametrize("name", list(issue_schemas()))
def test_the_six_schemas_are_refused_by_the_engine(name: str) -> None:
    with pytest.raises(StructuredOutputError):
        enforceable(issue_schemas()[name])


def test_summaries() -> None:
    row = latency_summary([0.3, 0.1, 0.2, 0.4])
    assert row == {"n": 4, "median_s": 0.25, "p90_s": 0.3, "max_s": 0.4}
    sizes = iter(range(1000, 10**6, 7))
    result = schema_memory(lambda i: None, lambda: next(sizes), 1000)
    assert result["requests_after_warmup"] == 1000 and [i for i, _ in result["trace_kib"]] == [500, 1000]
    assert new_schema(1) != new_schema(2)
