"""`specexec bench serve` outputs: per-setting rows from raw stream timings, the markdown, the plot.

Everything here is pure over the raw JSON (`serve.json`'s "raw"), so the outputs can be rebuilt:
`python -m bench.serve_report OUT_DIR`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean
from typing import Any

SOURCE_LABELS = {
    "resident": "target resident",
    "ram": "target streamed from RAM",
    "disk": "target streamed from disk, pages evicted",
}
GOAL_SPEEDUP_STREAMS, GOAL_SPEEDUP = 4, 3.0  # aggregate tok/s at 4 streams >= 3x one stream
GOAL_PASSES_WAITED = 2  # a short request's first token within 2 engine steps of its arrival


def finished(streams: list[dict]) -> list[dict]:
    return [s for s in streams if s["done"] is not None and s["error"] is None]


def summarize_streams(setting: dict) -> dict[str, Any]:
    """One concurrency setting's row: aggregate and per-stream rates, time to first token, tokens
    per pass per request (the server's per-request timings) and per pass (its /metrics)."""
    streams = finished(setting["streams"])
    figures = setting.get("pass_figures") or {}
    row = {k: setting[k] for k in ("source", "variant", "temperature", "num_streams")}
    row["failed"] = len(setting["streams"]) - len(streams)
    if not streams:
        return row
    tokens = sum(s["completion_tokens"] for s in streams)
    span = max(s["done"] for s in streams) - min(s["sent"] for s in streams)
    ttfts = [s["first_token"] - s["sent"] for s in streams if s["first_token"] is not None]
    per_request = [s["completion_tokens"] / s["target_passes"] for s in streams if s["target_passes"]]
    passes = figures.get("passes")
    row.update(
        tokens=tokens,
        wall_seconds=span,
        aggregate_tokens_per_s=tokens / span if span > 0 else None,
        stream_tokens_per_s=mean(s["completion_tokens"] / max(s["done"] - s["sent"], 1e-9) for s in streams),
        ttft_mean=mean(ttfts) if ttfts else None,
        ttft_max=max(ttfts) if ttfts else None,
        tokens_per_pass_request=mean(per_request) if per_request else None,
        tokens_per_pass=figures.get("pass_emitted_tokens") or (tokens / passes if passes else None),
        requests_per_pass=figures.get("requests_per_pass"),
        passes=passes,
    )
    return row


def add_speedups(rows: list[dict]) -> None:
    """`speedup`: aggregate tok/s over the one-stream row of the same source, variant and temperature."""
    base = {
        (r["source"], r["variant"], r["temperature"]): r.get("aggregate_tokens_per_s")
        for r in rows if r["num_streams"] == 1
    }
    for row in rows:
        one = base.get((row["source"], row["variant"], row["temperature"]))
        agg = row.get("aggregate_tokens_per_s")
        row["speedup"] = agg / one if agg and one else None


def summarize_interrupt(raw: dict) -> dict[str, Any]:
    long, short = raw["long"], raw["short"]
    ttft = short["first_token"] - short["sent"] if short["first_token"] is not None else None
    return {
        "source": raw["source"], "variant": raw["variant"], "long_max_tokens": raw["long_max_tokens"],
        "short_max_tokens": raw["short_max_tokens"], "short_ttft": ttft,
        "short_seconds": short["done"] - short["sent"] if short["done"] is not None else None,
        "passes_waited": raw.get("passes_waited"),
        "long_chunks_waited": raw.get("long_chunks_waited"),
        "long_ttft": long["first_token"] - long["sent"] if long["first_token"] is not None else None,
    }


def summarize_turn(raw: dict) -> dict[str, Any]:
    turn1, turn2 = raw["turn1"], raw["turn2"]
    return {
        "source": raw["source"], "variant": raw["variant"], "prefix_cache": raw["prefix_cache"],
        "turn1_prompt_tokens": turn1["prompt_tokens"], "turn1_completion_tokens": turn1["completion_tokens"],
        "turn2_prompt_tokens": turn2["prompt_tokens"], "cached_tokens": turn2["cached_tokens"],
        "turn2_prefill_seconds": turn2["prefill_seconds"],
        "turn2_ttft": turn2["first_token"] - turn2["sent"] if turn2["first_token"] is not None else None,
    }


def cell(value: Any, fmt: str = ".2f", suffix: str = "") -> str:
    """A table cell; '-' for a figure the server did not report."""
    if value is None:
        return "-"
    return f"{value:{fmt}}{suffix}" if isinstance(value, float) else f"{value}{suffix}"


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def streams_table(rows: list[dict], source: str) -> str:
    head = ["variant", "T", "streams", "aggregate tok/s", "x 1 stream", "stream tok/s", "TTFT mean s",
            "TTFT max s", "tokens/pass per request", "tokens/pass", "requests/pass"]
    return markdown_table(head, [
        [r["variant"], f"{r['temperature']:g}", str(r["num_streams"]), cell(r.get("aggregate_tokens_per_s")),
         cell(r.get("speedup"), suffix="x"), cell(r.get("stream_tokens_per_s")), cell(r.get("ttft_mean")),
         cell(r.get("ttft_max")), cell(r.get("tokens_per_pass_request")), cell(r.get("tokens_per_pass")),
         cell(r.get("requests_per_pass"))]
        for r in rows if r["source"] == source
    ])


def interrupt_table(rows: list[dict]) -> str:
    head = ["source", "variant", "long request tokens", "short request tokens", "short TTFT s",
            "passes waited", "long chunks meanwhile", "short request s"]
    return markdown_table(head, [
        [r["source"], r["variant"], str(r["long_max_tokens"]), str(r["short_max_tokens"]),
         cell(r["short_ttft"]), cell(r["passes_waited"], ".0f"), cell(r["long_chunks_waited"]), cell(r["short_seconds"])]
        for r in rows
    ])


def turn_table(rows: list[dict]) -> str:
    head = ["source", "variant", "prefix cache", "turn 1 prompt + reply tokens", "turn 2 prompt tokens",
            "cached tokens", "turn 2 prefill s", "turn 2 TTFT s"]
    return markdown_table(head, [
        [r["source"], r["variant"], r["prefix_cache"], f"{r['turn1_prompt_tokens']} + {r['turn1_completion_tokens']}",
         str(r["turn2_prompt_tokens"]), cell(r["cached_tokens"]), cell(r["turn2_prefill_seconds"], ".3f"),
         cell(r["turn2_ttft"], ".3f")]
        for r in rows
    ])


def goals(rows: list[dict], interrupts: list[dict], turns: list[dict]) -> list[str]:
    """The issue's goals, read off the rows."""
    out = []
    for r in rows:
        if r["num_streams"] == GOAL_SPEEDUP_STREAMS and r.get("speedup") is not None:
            verdict = "met" if r["speedup"] >= GOAL_SPEEDUP else "not met"
            out.append(f"{SOURCE_LABELS[r['source']]}, {r['variant']}, T={r['temperature']:g}: aggregate tok/s at "
                       f"{GOAL_SPEEDUP_STREAMS} streams = {r['speedup']:.2f}x one stream "
                       f"(goal >= {GOAL_SPEEDUP:g}x: {verdict}).")
    for r in interrupts:
        if r["passes_waited"] is not None:
            verdict = "met" if r["passes_waited"] <= GOAL_PASSES_WAITED else "not met"
            out.append(f"{SOURCE_LABELS[r['source']]}, {r['variant']}: the short request's first token came "
                       f"{r['passes_waited']:.0f} target passes after it arrived (goal <= {GOAL_PASSES_WAITED}: "
                       f"{verdict}), {cell(r['short_ttft'])} s.")
    for key in dict.fromkeys((t["source"], t["variant"]) for t in turns):
        pair = {t["prefix_cache"]: t for t in turns if (t["source"], t["variant"]) == key}
        on, off = pair.get("on"), pair.get("off")
        if on and off:
            out.append(f"{SOURCE_LABELS[key[0]]}, {key[1]}: turn 2 prefill {cell(on['turn2_prefill_seconds'], '.3f')} s "
                       f"with the prefix cache ({cell(on['cached_tokens'])} of {on['turn2_prompt_tokens']} prompt "
                       f"tokens cached) vs {cell(off['turn2_prefill_seconds'], '.3f')} s without.")
    return out


def header(meta: dict) -> str:
    machine = meta["machine"]
    lines = [
        "# specexec bench serve: concurrent streams through the real HTTP server", "",
        f"`{meta['command']}`", "",
        f"{meta['started']} UTC, {meta['wall_seconds'] / 60:.1f} min. Machine: {machine['cpu']}, "
        f"{machine['cpu_count']} cores, {machine['memory_gb']:.0f} GB RAM, device {machine['device']}; "
        f"load average at end {meta['loadavg_end'][0]:.2f}.", "",
        f"Target: {meta['target_label']}. Draft: `{meta['draft']}`. Code prompts (raw completions, EOS ignored), "
        f"{meta['max_tokens']} tokens per stream, stream i seeded {meta['seed']} + i; every request's prompt is "
        "unique (a comment line naming its setting and stream on top), so none reuses another's cached prefix.", "",
        "aggregate tok/s: all streams' tokens / (last done - first sent). stream tok/s: a stream's tokens / its "
        "own time from sent to done (queueing included), mean over streams. TTFT: sent to first text chunk. "
        "tokens/pass per request: a request's tokens / the target passes it took part in (its `timings`). "
        "tokens/pass and requests/pass: per target pass, from /metrics (pass-level histograms when the server "
        "has them, else its pass counter); '-': not reported by this server.",
    ]
    return "\n".join(lines)


def markdown(meta: dict, rows: list[dict], interrupts: list[dict], turns: list[dict]) -> str:
    parts = [header(meta), "## Concurrent streams"]
    for source in dict.fromkeys(r["source"] for r in rows):
        commands = "; ".join(f"{name}: `{cmd}`" for name, cmd in meta["servers"].get(source, {}).items())
        parts += [f"### {SOURCE_LABELS[source]}", f"Server ({commands})." if commands else "",
                  streams_table(rows, source)]
    failed = [r for r in rows if r["failed"]]
    if failed:
        parts.append("Failed streams (left out of the means): " + ", ".join(
            f"{r['source']} {r['variant']} T={r['temperature']:g} x{r['num_streams']}: {r['failed']}" for r in failed))
    if interrupts:
        parts += ["## A short request arriving during a long one",
                  "Greedy. The short request is sent once the long one has streamed its first text; passes waited: "
                  "target passes (/metrics) between sending it and its first token. The long request is cut off "
                  "(client disconnect) once the short one has its first token.", interrupt_table(interrupts)]
    if turns:
        parts += ["## Second chat turn",
                  "Turn 1: one user message, greedy reply. Turn 2: turn 1's messages + the reply + a new user "
                  "message. Prefill s: the server's `timings.prompt_ms`; cached tokens: "
                  "`usage.prompt_tokens_details.cached_tokens` ('-': not reported).", turn_table(turns)]
    items = goals(rows, interrupts, turns)
    if items:
        parts += ["## Goals", "\n".join(f"- {item}" for item in items)]
    if meta.get("skipped"):
        parts += ["## Skipped", "\n".join(f"- {item}" for item in meta["skipped"])]
    return "\n\n".join(p for p in parts if p) + "\n"


def build_rows(raw: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    rows = [summarize_streams(r) for r in raw if r["kind"] == "streams"]
    add_speedups(rows)
    interrupts = [summarize_interrupt(r) for r in raw if r["kind"] == "interrupt"]
    turns = [summarize_turn(r) for r in raw if r["kind"] == "turn"]
    return rows, interrupts, turns


def write_report(out: Path, meta: dict, raw: list[dict]) -> dict[str, Path]:
    """serve.md, serve.json (meta, raw and rows) and serve.png under `out`."""
    from bench.serve_plot import plot_streams

    out.mkdir(parents=True, exist_ok=True)
    rows, interrupts, turns = build_rows(raw)
    paths = {"table": out / "serve.md", "json": out / "serve.json", "plot": out / "serve.png"}
    summary = {"streams": rows, "interrupts": interrupts, "turns": turns}
    paths["json"].write_text(json.dumps({"meta": meta, "raw": raw, "rows": summary}, indent=1))
    paths["table"].write_text(markdown(meta, rows, interrupts, turns))
    if rows:
        plot_streams(rows, paths["plot"], meta["target_label"], SOURCE_LABELS)
    else:
        del paths["plot"]
    return paths


if __name__ == "__main__":  # rebuild the outputs from a run's serve.json: python -m bench.serve_report DIR
    folder = Path(sys.argv[1])
    data = json.loads((folder / "serve.json").read_text())
    print(write_report(folder, data["meta"], data["raw"]))
