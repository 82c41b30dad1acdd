"""Reading a server's Prometheus `/metrics` text: samples, deltas between two scrapes, pass counts.

Metrics a server version lacks read as absent (None), never as zero, so the benchmark runs
unchanged against servers with and without pass-level metrics.
"""

from __future__ import annotations

import re

# pass-level histograms (one observation per target pass, whatever the number of requests in it)
REQUESTS_PER_PASS = "specexec_requests_per_pass"
PASS_EMITTED_TOKENS = "specexec_pass_emitted_tokens"
# per request and pass (one observation per request in each pass): the fallback pass count when
# the server runs one request per pass
TARGET_PASSES = "specexec_target_passes_total"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")

Samples = dict[str, float]  # "name" or "name{labels}" -> value


def parse_metrics(text: str) -> Samples:
    """Every sample line of the text exposition format; comments and blank lines skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            samples[name + (labels or "")] = float(value)
        except ValueError:
            continue
    return samples


def total(samples: Samples, name: str) -> float | None:
    """The sum of `name` over every label set; None when the server exports no such sample."""
    values = [v for key, v in samples.items() if key == name or key.startswith(name + "{")]
    return sum(values) if values else None


def delta(before: Samples, after: Samples, name: str) -> float | None:
    """after - before of one metric (summed over labels); None when either scrape lacks it."""
    start, end = total(before, name), total(after, name)
    if start is None or end is None:
        return None
    return end - start


def histogram_mean(before: Samples, after: Samples, name: str) -> float | None:
    """Mean of the observations a histogram got between two scrapes; None when absent or none."""
    count = delta(before, after, f"{name}_count")
    amount = delta(before, after, f"{name}_sum")
    if count is None or amount is None or count <= 0:
        return None
    return amount / count


def num_passes(before: Samples, after: Samples) -> float | None:
    """Target passes between two scrapes: a pass-level histogram's count when the server has one,
    else the per-request pass counter (equal to passes while one request runs per pass)."""
    for name in (f"{PASS_EMITTED_TOKENS}_count", f"{REQUESTS_PER_PASS}_count", TARGET_PASSES):
        value = delta(before, after, name)
        if value is not None:
            return value
    return None


def pass_figures(before: Samples, after: Samples) -> dict[str, float | None]:
    """Passes, tokens per pass and requests per pass between two scrapes (None: not exported)."""
    return {
        "passes": num_passes(before, after),
        "pass_emitted_tokens": histogram_mean(before, after, PASS_EMITTED_TOKENS),
        "requests_per_pass": histogram_mean(before, after, REQUESTS_PER_PASS),
        "generation_tokens": delta(before, after, "specexec_generation_tokens_total"),
    }
