"""`specexec bench hardening`: the checks of issue 29 against the real server (a subprocess on the
built-in pair unless --target/--draft), each printed as one JSON line.

- latency: a 4-token completion's latency idle, then while six slow-to-prepare requests are in
  flight (unique 10,000-property schemas of ~600 KB, or 12 MB /infill bodies);
- infill: the server's CPU seconds (all its threads, /proc) for one 12 MB /infill;
- gaps: a running stream's longest gap between events, alone and while four 16 MiB bodies of
  ~8M small JSON values arrive;
- schemas: the six schemas the issue names (and what pydantic makes), sampled: a 400, or every
  output validates (jsonschema);
- memory: the server's resident memory over N requests that each bring a new JSON schema
  (bench/hardening_memory.py also measures compiles in-process).

Every response status is kept: any 5xx, and any "Traceback" in the server's log, is reported.

    specexec bench hardening [--checks latency,infill,gaps,schemas,memory] [--memory-requests 3000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from bench.hardening_memory import new_schema, rss_kb, schema_memory
from bench.serve_process import ServerProcess, running_server, split_flags
from engine.cli import DEFAULT_MODELS, comma_list

CHECKS = ("latency", "infill", "gaps", "schemas", "memory")
SMALL = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
MIB = 1 << 20
IDLE_SECONDS = 10.0  # of 4-token completions alone, to compare with the same under load
INT = {"type": "integer"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=str(DEFAULT_MODELS / "target"))
    parser.add_argument("--draft", default=str(DEFAULT_MODELS / "draft"))
    parser.add_argument("--checks", type=comma_list(str), default=list(CHECKS), help=f"comma list of {CHECKS}")
    parser.add_argument("--memory-requests", type=int, default=3000, help="new-schema requests after warm-up")
    parser.add_argument("--latency-kinds", type=comma_list(str), default=["schema", "infill"],
                        help="slow requests for the latency check: schema (10,000 properties), schema-N (N), infill, "
                             "infill-parse (refused after "
                             "parsing), infill-values (refused before parsing)")
    parser.add_argument("--server-flags", default="", help="more `specexec serve` flags, one string")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ 100)


class Client:
    """httpx with every status counted."""

    def __init__(self, url: str):
        self.url = url
        self.statuses: Counter[int] = Counter()
        self._lock = threading.Lock()

    def post(self, path: str, timeout: float = 300, **kwargs: Any) -> httpx.Response:
        response = httpx.post(self.url + path, timeout=timeout, trust_env=False, **kwargs)
        with self._lock:
            self.statuses[response.status_code] += 1
        return response

    def timed(self, path: str, body: dict[str, Any]) -> float:
        begin = time.monotonic()
        response = self.post(path, json=body)
        assert response.status_code == 200, response.text
        return time.monotonic() - begin


def big_schema(tag: str, num_properties: int = 10_000) -> dict[str, Any]:
    """A unique ~600 KB schema: `num_properties` optional properties of several types."""
    kinds = [INT, {"type": "string"}, {"type": "boolean"}, {"type": "array", "items": INT}]
    return {"type": "object", "properties": {f"{tag}_property_{i:05d}": kinds[i % 4] for i in range(num_properties)}}


def slow_request(kind: str, index: int) -> tuple[str, bytes]:
    if kind.startswith("schema"):  # schema: 10,000 properties; schema-N: N
        size = int(kind.split("-")[1]) if "-" in kind else 10_000
        schema = big_schema(f"s{index}_{time.monotonic_ns()}", size)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
        return "/v1/chat/completions", json.dumps(body).encode()
    if kind == "infill-values":  # read, then refused by the value count before parsing
        return "/infill", many_values_body(12 * MIB)
    body = infill_body(12 * MIB, index)
    if kind == "infill-parse":  # read and parsed, then refused (unknown model) before tokenizing
        body["model"] = "no-such-model"
    return "/infill", json.dumps(body).encode()


def infill_body(num_bytes: int, salt: int = 0) -> dict[str, Any]:
    line = f"def f_{salt}(x):\n    return x + {salt}\n"
    text = line * (num_bytes // 3 // len(line))
    return {"input_prefix": text, "input_suffix": text, "input_extra": [{"filename": "a.py", "text": text}],
            "n_predict": 4}


def summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {"n": len(ordered), "median_s": round(statistics.median(ordered), 3),
            "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3), "max_s": round(ordered[-1], 3)}


def check_latency(client: Client, kind: str) -> dict[str, Any]:
    """4-token completions one after another: IDLE_SECONDS alone, then while six slow requests of
    `kind` run (sent at once)."""
    client.timed("/v1/completions", SMALL)  # warm
    idle: list[float] = []
    begin = time.monotonic()
    while time.monotonic() - begin < IDLE_SECONDS:
        idle.append(client.timed("/v1/completions", SMALL))
    # sent from processes of their own, bodies made before the clock runs: the client's own work
    # would otherwise slow the measured requests
    context = multiprocessing.get_context("spawn")
    ready, go, statuses = context.Queue(), context.Event(), context.Queue()
    senders = [context.Process(target=send_slow, args=(client.url, kind, i, ready, go, statuses)) for i in range(6)]
    for sender in senders:
        sender.start()
    for _ in senders:
        ready.get(timeout=300)
    go.set()
    busy: list[float] = []
    while any(sender.is_alive() for sender in senders) or len(busy) < 3:
        busy.append(client.timed("/v1/completions", SMALL))
    slow_statuses = [statuses.get(timeout=60) for _ in senders]
    for sender in senders:
        sender.join()
    client.statuses.update(slow_statuses)
    idle_row, busy_row = summary(idle), summary(busy)
    return {"check": f"latency/{kind}", "idle": idle_row, "busy": busy_row,
            "busy_over_idle": {key: round(busy_row[key] / idle_row[key], 2) for key in ("median_s", "p90_s", "max_s")},
            "slow_statuses": sorted(slow_statuses)}


def send_slow(url: str, kind: str, index: int, ready: Any, go: Any, statuses: Any) -> None:
    """In a process of its own: make the body, say so, wait for `go`, send it, put the status."""
    path, body = slow_request(kind, index)
    ready.put(index)
    go.wait()
    response = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=300,
                          trust_env=False)
    statuses.put(response.status_code)


def check_infill(client: Client, server: ServerProcess) -> dict[str, Any]:
    body = json.dumps(infill_body(12 * MIB)).encode()
    pid = server.process.pid
    before, begin = cpu_seconds(pid), time.monotonic()
    response = client.post("/infill", content=body, headers={"content-type": "application/json"})
    wall = time.monotonic() - begin
    return {"check": "infill_12mb", "body_bytes": len(body), "status": response.status_code,
            "truncated": response.json().get("truncated") if response.status_code == 200 else None,
            "server_cpu_s": round(cpu_seconds(pid) - before, 3), "wall_s": round(wall, 3)}


def stream_times(client: Client, on_first: Callable[[], None] | None) -> tuple[list[float], int]:
    """Arrival times of a streamed completion's events (512 tokens); `on_first` runs after the first."""
    body = {"prompt": "def main():\n", "max_tokens": 512, "ignore_eos": True, "stream": True, "temperature": 0}
    times: list[float] = []
    with httpx.stream("POST", client.url + "/v1/completions", json=body, timeout=300, trust_env=False) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic())
                if len(times) == 1 and on_first is not None:
                    on_first()
        return times, response.status_code


def many_values_body(num_bytes: int) -> bytes:
    head, tail = b'{"prompt": "x", "max_tokens": 2, "junk": [', b"1]}"
    return head + b"1," * ((num_bytes - len(head) - len(tail)) // 2) + tail


def check_gaps(client: Client) -> dict[str, Any]:
    alone, _ = stream_times(client, None)
    body = many_values_body(16 * MIB - 1024)
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}).status_code))
        for _ in range(4)]
    marks: list[float] = []

    def upload() -> None:
        marks.append(time.monotonic())
        for thread in threads:
            thread.start()

    busy, status = stream_times(client, upload)
    for thread in threads:
        thread.join()

    def longest(times: list[float]) -> float:
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    return {"check": "stream_gaps_4x16mib", "body_bytes": len(body), "body_statuses": sorted(statuses),
            "stream_status": status, "alone_longest_gap_s": round(longest(alone), 3),
            "alone_stream_s": round(alone[-1] - alone[0], 3), "busy_longest_gap_s": round(longest(busy), 3),
            "busy_stream_s": round(busy[-1] - busy[0], 3), "uploads_began_after_s": round(marks[0] - busy[0], 3)}


def issue_schemas() -> dict[str, dict[str, Any]]:
    obj = {"type": "object"}
    return {
        "uniqueItems": {**obj, "properties": {"tags": {"type": "array", "items": INT, "uniqueItems": True}},
                        "required": ["tags"]},
        "dependentRequired": {**obj, "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        "if/then": {**obj, "properties": {"k": {"enum": ["x", "y"]}, "n": INT}, "required": ["k"],
                    "if": {"properties": {"k": {"const": "x"}}}, "then": {"required": ["n"]}},
        "allOf two parts": {"allOf": [{**obj, "properties": {"a": INT}, "required": ["a"]},
                                      {**obj, "properties": {"b": INT}, "required": ["b"]}]},
        "required undeclared": {**obj, "properties": {"a": INT}, "required": ["a", "zzz"]},
        "anyOf []": {"anyOf": []},
    }


def check_schemas(client: Client) -> list[dict[str, Any]]:
    import jsonschema

    rows = []
    for name, schema in issue_schemas().items():
        validator = jsonschema.Draft202012Validator(schema)
        verdicts: Counter[str] = Counter()
        for seed in range(4):
            body = {"messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 200, "seed": seed,
                    "temperature": 1.0, "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "s", "schema": schema}}}
            response = client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                verdicts[f"{response.status_code} {response.json()['error']['message'][:90]}"] += 1
                continue
            choice = response.json()["choices"][0]
            try:
                validator.validate(json.loads(choice["message"]["content"]))
                verdicts[f"200 valid ({choice['finish_reason']})"] += 1
            except (ValueError, jsonschema.ValidationError):
                verdicts[f"200 INVALID ({choice['finish_reason']})"] += 1
        rows.append({"check": f"schema/{name}", "verdicts": dict(verdicts)})
    return rows


def check_memory(client: Client, server: ServerProcess, num_requests: int) -> dict[str, Any]:
    def request(i: int) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": new_schema(i)}}}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text

    return {"check": "memory_new_schemas", **schema_memory(request, lambda: rss_kb(server.process.pid), num_requests)}


def run(args: argparse.Namespace) -> int:
    flags = split_flags(args.server_flags)
    with running_server(args.target, args.draft, "resident", flags) as (server, _):
        client = Client(server.url)
        checks: dict[str, Callable[[], Any]] = {
            "latency": lambda: [check_latency(client, kind) for kind in args.latency_kinds],
            "infill": lambda: check_infill(client, server),
            "gaps": lambda: check_gaps(client),
            "schemas": lambda: check_schemas(client),
            "memory": lambda: check_memory(client, server, args.memory_requests),
        }
        for name in args.checks:
            result = checks[name]()
            for row in result if isinstance(result, list) else [result]:
                print(json.dumps(row), flush=True)
        log = server.log_path.read_text(errors="replace")
    print(json.dumps({"check": "statuses", "statuses": dict(sorted(client.statuses.items())),
                      "server_5xx": sum(n for status, n in client.statuses.items() if status >= 500),
                      "tracebacks_in_log": log.count("Traceback")}), flush=True)
    return 0


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(main_parser)
    raise SystemExit(run(main_parser.parse_args()))
