"""`specexec bench serve`: metrics parsing, chunk reading and the aggregation of per-stream timings into
table rows on hand-built inputs; one end-to-end --quick run through the real server (no timed assertions)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.serve import add_arguments, resolve_options
from bench.serve_client import StreamResult, read_chunk
from bench.serve_metrics import delta, histogram_mean, num_passes, parse_metrics, pass_figures, total
from bench.serve_process import rejected_flags
from bench.serve_report import add_speedups, build_rows, goals, markdown, summarize_streams
from engine.cli import CliError
from specexec.__main__ import main

METRICS_BEFORE = """\
# HELP specexec_target_passes_total Target model passes (engine steps)
# TYPE specexec_target_passes_total counter
specexec_target_passes_total 10.0
specexec_generation_tokens_total 30.0
specexec_requests_total{endpoint="completions",finish_reason="length"} 2.0
specexec_requests_total{endpoint="chat",finish_reason="stop"} 1.0
specexec_scheduler_info{max_running="1",policy="fifo"} 1.0
"""
METRICS_AFTER = """\
specexec_target_passes_total 16.0
specexec_generation_tokens_total 54.0
specexec_requests_total{endpoint="completions",finish_reason="length"} 4.0
specexec_requests_total{endpoint="chat",finish_reason="stop"} 1.0
specexec_requests_per_pass_bucket{le="+Inf"} 4.0
"""
PASS_HISTOGRAMS = """\
specexec_requests_per_pass_count {count}
specexec_requests_per_pass_sum {requests}
specexec_pass_emitted_tokens_count {count}
specexec_pass_emitted_tokens_sum {tokens}
specexec_target_passes_total {per_request}
"""


def test_parse_metrics_reads_samples_and_sums_label_sets():
    samples = parse_metrics(METRICS_BEFORE)
    assert samples["specexec_target_passes_total"] == 10.0
    assert total(samples, "specexec_requests_total") == 3.0  # both label sets
    assert total(samples, "specexec_requests") is None  # a prefix of another name is not that name
    assert total(samples, "specexec_absent") is None
    after = parse_metrics(METRICS_AFTER)
    assert after['specexec_requests_per_pass_bucket{le="+Inf"}'] == 4.0
    assert delta(parse_metrics(METRICS_BEFORE), after, "specexec_requests_total") == 2.0


def test_without_pass_level_histograms_passes_come_from_the_pass_counter():
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    assert num_passes(before, after) == 6.0
    assert histogram_mean(before, after, "specexec_pass_emitted_tokens") is None
    assert pass_figures(before, after) == {
        "passes": 6.0, "pass_emitted_tokens": None, "requests_per_pass": None, "generation_tokens": 24.0,
    }


def test_pass_level_histograms_win_over_the_per_request_counter():
    before = parse_metrics(PASS_HISTOGRAMS.format(count=2, requests=2, tokens=7, per_request=2))
    after = parse_metrics(PASS_HISTOGRAMS.format(count=5, requests=11, tokens=31, per_request=11))
    figures = pass_figures(before, after)
    assert figures["passes"] == 3.0  # passes, not the 9 request-passes of the counter
    assert figures["requests_per_pass"] == pytest.approx(3.0)
    assert figures["pass_emitted_tokens"] == pytest.approx(8.0)


def stream(sent: float, first: float | None, done: float | None, tokens: int, passes: int | None,
           error: str | None = None) -> dict:
    return {"sent": sent, "first_token": first, "done": done, "completion_tokens": tokens,
            "target_passes": passes, "error": error}


def setting(num_streams: int, streams: list[dict], figures: dict | None = None, temperature: float = 0.0) -> dict:
    return {"kind": "streams", "source": "disk", "variant": "default", "temperature": temperature,
            "num_streams": num_streams, "streams": streams, "pass_figures": figures or {}}


def test_summarize_streams_aggregates_per_stream_timings():
    streams = [stream(0.0, 1.0, 4.0, 8, 2), stream(0.1, 3.0, 8.1, 8, 4), stream(0.2, None, None, 0, None, "boom")]
    row = summarize_streams(setting(3, streams, {"passes": 5.0}))
    assert row["failed"] == 1
    assert row["tokens"] == 16
    assert row["wall_seconds"] == pytest.approx(8.1)
    assert row["aggregate_tokens_per_s"] == pytest.approx(16 / 8.1)
    assert row["stream_tokens_per_s"] == pytest.approx((8 / 4.0 + 8 / 8.0) / 2)
    assert row["ttft_mean"] == pytest.approx((1.0 + 2.9) / 2)
    assert row["ttft_max"] == pytest.approx(2.9)
    assert row["tokens_per_pass_request"] == pytest.approx((4 + 2) / 2)
    assert row["tokens_per_pass"] == pytest.approx(16 / 5)  # no pass histogram: tokens / passes
    assert row["requests_per_pass"] is None
    with_histogram = summarize_streams(setting(3, streams, {"passes": 5.0, "pass_emitted_tokens": 3.5}))
    assert with_histogram["tokens_per_pass"] == 3.5


def test_a_setting_whose_streams_all_failed_keeps_its_row():
    row = summarize_streams(setting(2, [stream(0.0, None, None, 0, None, "HTTP 429")] * 2))
    assert row["failed"] == 2 and "aggregate_tokens_per_s" not in row


def test_speedup_is_against_one_stream_of_the_same_source_variant_and_temperature():
    rows = [summarize_streams(setting(n, [stream(0.0, 0.5, 2.0, 8 * n, 2)], temperature=t))
            for t in (0.0, 0.6) for n in (1, 4)]
    rows[3]["aggregate_tokens_per_s"] = rows[2]["aggregate_tokens_per_s"] * 3.5
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 4.0, 1.0, 3.5])
    items = goals(rows, [], [])
    assert len(items) == 2 and all("met" in item and "not met" not in item for item in items)


def test_report_rows_and_markdown_from_raw_entries():
    short = {**stream(1.0, 1.5, 2.0, 8, 2), "chunk_times": [1.5]}
    raw = [
        setting(1, [stream(0.0, 1.0, 3.0, 8, 2)], {"passes": 2.0}),
        {"kind": "interrupt", "source": "disk", "variant": "default", "long_max_tokens": 400,
         "short_max_tokens": 8, "long": stream(0.0, 0.9, None, 0, None), "short": short, "passes_waited": 2.0,
         "long_chunks_waited": 1},
        *[{"kind": "turn", "source": "disk", "variant": "default", "prefix_cache": cache,
           "turn1": {**stream(0.0, 1.0, 2.0, 32, 8), "prompt_tokens": 25},
           "turn2": {**stream(3.0, 3.2 + 0.5 * (cache == "off"), 3.9, 4, 1), "prompt_tokens": 70,
                     "cached_tokens": 56 if cache == "on" else None,
                     "prefill_seconds": 0.1 if cache == "on" else 0.6}} for cache in ("on", "off")],
    ]
    rows, interrupts, turns = build_rows(raw)
    assert interrupts[0]["short_ttft"] == pytest.approx(0.5) and interrupts[0]["passes_waited"] == 2.0
    assert [t["turn2_ttft"] for t in turns] == pytest.approx([0.2, 0.7])
    meta = {"command": "specexec bench serve --quick", "started": "2026-01-01 00:00:00", "wall_seconds": 60.0,
            "machine": {"cpu": "cpu", "cpu_count": 2, "memory_gb": 8.0, "device": "cpu"}, "loadavg_end": (1.0,),
            "target_label": "t", "draft": "d", "max_tokens": 8, "seed": 0, "servers": {}, "skipped": ["x"]}
    text = markdown(meta, rows, interrupts, turns)
    assert "| default | 0 | 1 | 2.67 | 1.00x |" in text
    assert "| disk | default | off | 25 + 32 | 70 | - | 0.600 | 0.700 |" in text  # '-': not reported
    assert "2 target passes after it arrived (goal <= 2: met)" in text
    assert "0.100 s with the prefix cache (56 of 70 prompt tokens cached) vs 0.600 s without" in text
    assert "## Skipped\n\n- x" in text


def test_read_chunk_follows_completions_and_chat_chunks():
    result = StreamResult(sent=0.0)
    read_chunk(result, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.1)
    assert result.first_token is None  # the role chunk carries no text
    read_chunk(result, {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, 0.2)
    read_chunk(result, {"choices": [{"index": 0, "text": " there"}]}, 0.3)
    read_chunk(result, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                        "timings": {"target_passes": 3, "prompt_ms": 250.0}}, 0.4)
    read_chunk(result, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5,
                                                 "prompt_tokens_details": {"cached_tokens": 6}}}, 0.5)
    assert (result.first_token, result.text, result.num_text_chunks) == (0.2, "Hi there", 2)
    assert (result.target_passes, result.prefill_seconds) == (3, 0.25)
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (9, 5, 6)
    read_chunk(result, {"error": {"message": "bad"}}, 0.6)
    assert "bad" in result.error


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_options_quick_defaults_flags_and_variants():
    quick = resolve_options(parse(["--quick", "--max-tokens", "5"]))
    assert quick.sources == ["resident"] and quick.pad_to_gb == 0.0 and quick.max_tokens == 5
    full = resolve_options(parse(["--variant", "serial=--max-running 1", "--server-flags", "--budget 32"]))
    assert full.sources == ["ram", "disk"] and full.streams == [1, 2, 4, 8]
    assert full.variants == {"default": [], "serial": ["--max-running", "1"]}
    assert full.server_flags == ["--budget", "32"]
    for bad in (["--variant", "noequals"], ["--variant", "default=--x"], ["--sources", "gpu"], ["--streams", "0"]):
        with pytest.raises(CliError):
            resolve_options(parse(bad))


def test_rejected_flags_are_told_from_other_startup_failures():
    assert rejected_flags("specexec: error: unrecognized arguments: --max-running 1")
    assert not rejected_flags("specexec serve: loading the engine failed: out of memory")


@pytest.mark.slow
def test_quick_run_through_the_real_server_writes_its_outputs(tmp_path):
    assert main(["bench", "serve", "--quick", "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"serve.md", "serve.json", "serve.png"}
    data = json.loads((tmp_path / "serve.json").read_text())
    settings = [r for r in data["raw"] if r["kind"] == "streams"]
    assert [(r["source"], r["num_streams"]) for r in settings] == [("resident", 1), ("resident", 2)]
    for entry in settings:
        for result in entry["streams"]:
            assert result["error"] is None and result["completion_tokens"] == 8  # EOS ignored
            assert result["sent"] <= result["first_token"] <= result["done"]
            assert result["target_passes"] >= 1
        assert entry["pass_figures"]["passes"] >= 1
    (interrupt,) = [r for r in data["raw"] if r["kind"] == "interrupt"]
    assert interrupt["short"]["first_token"] is not None and interrupt["passes_waited"] >= 1
    (turn,) = [r for r in data["raw"] if r["kind"] == "turn"]
    assert turn["turn2"]["prompt_tokens"] > turn["turn1"]["prompt_tokens"] + turn["turn1"]["completion_tokens"]
    assert "| default | 0 | 2 |" in (tmp_path / "serve.md").read_text()
