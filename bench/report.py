"""`specexec bench` outputs: derived figures, the markdown table, the JSON and the PNG plots."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace


@dataclass
class RunResult:
    """One configuration over every trajectory (a prompt run with one seed): raw figures, one list entry
    per trajectory."""

    mode: str
    temperature: float
    method: str
    budget: int | str  # int, or "auto"
    prompt_index: list[int] = field(default_factory=list)  # per trajectory: which prompt
    seeds: list[int] = field(default_factory=list)  # per trajectory: its request seed
    completion_tokens: list[int] = field(default_factory=list)
    target_passes: list[int] = field(default_factory=list)
    decode_seconds: list[float] = field(default_factory=list)
    prefill_seconds: list[float] = field(default_factory=list)
    draft_seconds: list[float] = field(
        default_factory=list
    )  # engine step split (draft incl. tree bookkeeping)
    target_seconds: list[float] = field(default_factory=list)
    draft_forward_seconds: list[float] = field(default_factory=list)  # inside the draft model's forward
    target_forward_seconds: list[float] = field(default_factory=list)  # inside the target's (incl. streaming)
    tree_sizes: list[list[int]] = field(default_factory=list)  # per prompt, per step (root included)
    accepted: list[list[int]] = field(default_factory=list)
    expected: list[list[float | None]] = field(default_factory=list)  # per step: E[accepted | tree], None: unknown
    steps: list[list[tuple[float, float, float]]] = field(
        default_factory=list
    )  # per step (draft, target, step) s


MODE_LABELS = {
    "resident": "target resident",
    "ram": "target streamed from RAM",
    "disk": "target streamed from disk, pages evicted",
}
METHOD_LABELS = {"autoregressive": "Autoregressive", "specinfer": "SpecInfer", "specexec": "SpecExec", "rrs": "RRS"}


def ratio_with_se(numerators: list[float], denominators: list[float]) -> tuple[float, float]:
    """sum(a) / sum(b) over clusters (trajectories) and its cluster-robust standard error (the delta
    method for a ratio of sums; nan with fewer than two clusters)."""
    total = sum(denominators)
    if total <= 0:
        return float("nan"), float("nan")
    ratio = sum(numerators) / total
    n = len(denominators)
    if n < 2:
        return ratio, float("nan")
    mean = total / n
    var = sum((a - ratio * b) ** 2 for a, b in zip(numerators, denominators, strict=True)) / (n * (n - 1))
    return ratio, math.sqrt(var) / mean


def per_trajectory_tokens_per_pass(result: RunResult) -> tuple[float, float, float | None, float]:
    """(tokens/pass, se, expected tokens/pass or None, its se) with accepted + bonus per step."""
    passes = [len(steps) for steps in result.accepted]
    value, se = ratio_with_se([sum(a + 1 for a in steps) for steps in result.accepted], passes)
    known = getattr(result, "expected", [])  # old raw.json files have none
    if not known or any(e is None for steps in known for e in steps):
        return value, se, None, float("nan")
    expected, expected_se = ratio_with_se([sum(e + 1 for e in steps) for steps in known], [len(k) for k in known])
    return value, se, expected, expected_se


def summarize(result: RunResult, link: dict) -> dict[str, float]:
    """Per-configuration figures from the raw per-trajectory lists; *_se: standard errors clustered by
    trajectory."""
    tokens = sum(result.completion_tokens)
    passes = max(sum(result.target_passes), 1)
    decode = max(sum(result.decode_seconds), 1e-9)
    forwards = sum(result.draft_forward_seconds) + sum(result.target_forward_seconds)
    steps = [size - 1 for sizes in result.tree_sizes for size in sizes]
    tokens_per_pass, tokens_per_pass_se, expected, expected_se = per_trajectory_tokens_per_pass(result)
    _, tokens_per_s_se = ratio_with_se(result.completion_tokens, result.decode_seconds)
    out = {
        "tokens": tokens,
        "passes": passes,
        "trajectories": len(result.accepted),
        # accepted + bonus per pass, before max_tokens truncation of the last step
        "tokens_per_pass": tokens_per_pass,
        "tokens_per_pass_se": tokens_per_pass_se,
        # 1 + E[accepted | tree] per pass (sample-and-match trees; None for sampled SpecInfer)
        "expected_tokens_per_pass": expected,
        "expected_tokens_per_pass_se": expected_se,
        "emitted_per_pass": tokens / passes,
        "tokens_per_s": tokens / decode,
        "tokens_per_s_se": tokens_per_s_se,
        "draft_s_per_step": sum(result.draft_seconds) / passes,
        "target_s_per_step": sum(result.target_seconds) / passes,
        "step_s": decode / passes,
        "overhead_fraction": max(0.0, 1.0 - forwards / decode),
        "mean_tree_budget": sum(steps) / max(len(steps), 1),
    }
    if link.get("bytes_per_pass"):
        limit = out["emitted_per_pass"] * link["link_bytes_per_s"] / link["bytes_per_pass"]
        out["limit_tokens_per_s"] = limit
        out["fraction_of_limit"] = out["tokens_per_s"] / limit
    return out


def add_speedups(rows: list[dict]) -> None:
    """speedup = tokens/s over autoregressive in the same mode and temperature."""
    base = {(r["mode"], r["temperature"]): r["tokens_per_s"] for r in rows if r["method"] == "autoregressive"}
    for row in rows:
        ar = base.get((row["mode"], row["temperature"]))
        row["speedup"] = row["tokens_per_s"] / ar if ar else float("nan")


def speedup_text(speedup: float) -> str:
    """'1.23x', or '-' when no autoregressive row ran (--methods without it)."""
    return "-" if speedup != speedup else f"{speedup:.2f}x"


def budget_label(row: dict) -> str:
    if row["budget"] == "auto":
        return f"auto (~{row['mean_tree_budget']:.0f})"
    return "-" if row["method"] == "autoregressive" else str(row["budget"])


def mode_heading(mode: str, info: dict, padding: dict) -> str:
    parts = [f"### {MODE_LABELS[mode]}"]
    if padding:
        parts.append(
            f"Heavy padded target: {padding['total_bytes'] / 1e9:.2f} GB of decoder layers "
            f"({padding['num_layers']} layers), outputs equal to the trained target's (acceptance of the trained pair)."
        )
    if info.get("bytes_per_pass"):
        parts.append(
            f"Streamed per pass: {info['bytes_per_pass'] / 1e9:.3f} GB; measured link bandwidth "
            f"{info['link_bytes_per_s'] / 1e9:.2f} GB/s (plain {'read' if mode == 'disk' else 'copy'}, no compute)."
        )
    seconds = (info.get("auto") or {}).get("final", {}).get("target_seconds")
    if seconds:
        profile = ", ".join(f"{int(b)}: {t:.3f}" for b, t in sorted((int(b), t) for b, t in seconds.items()))
        parts.append(
            f"Measured target pass seconds by budget (--budget auto's estimates at the end): {profile}."
        )
    return "\n\n".join(parts)


def goals(rows: list[dict]) -> str:
    """The issue's goals, computed from the rows (per mode and temperature)."""
    lines = ["### Goals", ""]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for temperature in dict.fromkeys(r["temperature"] for r in rows):
            sel = [r for r in rows if r["mode"] == mode and r["temperature"] == temperature]
            fixed = {r["budget"]: r for r in sel if r["method"] == "specexec" and r["budget"] != "auto"}
            infer = {r["budget"]: r for r in sel if r["method"] == "specinfer"}
            auto = next((r for r in sel if r["budget"] == "auto"), None)
            if not fixed:
                continue
            best = max(fixed.values(), key=lambda r: r["tokens_per_s"])
            ratios = ", ".join(
                f"{b}: {fixed[b]['tokens_per_pass'] / infer[b]['tokens_per_pass']:.2f}x"
                for b in fixed
                if b in infer
            )
            items = [
                f"SpecExec/SpecInfer tokens per pass {ratios or 'n/a'}",
                f"best SpecExec {best['tokens_per_s']:.2f} tok/s at budget {best['budget']} "
                f"({speedup_text(best['speedup'])} autoregressive)",
            ]
            if "fraction_of_limit" in best:
                items.append(f"{100 * best['fraction_of_limit']:.0f}% of the physical limit")
            spec_rows = [r for r in sel if r["method"] != "autoregressive"]
            items.append(
                f"engine overhead {100 * min(r['overhead_fraction'] for r in spec_rows):.1f}-"
                f"{100 * max(r['overhead_fraction'] for r in spec_rows):.1f}%"
            )
            if auto is not None:
                items.append(
                    f"budget auto {auto['tokens_per_s']:.2f} tok/s = "
                    f"{100 * auto['tokens_per_s'] / best['tokens_per_s']:.0f}% of the best fixed budget"
                )
            lines.append(f"- {MODE_LABELS[mode]}, T={temperature:g}: " + "; ".join(items) + ".")
    return "\n".join(lines) + "\n"


def with_se(value: float, se: float | None) -> str:
    """'4.21 ± 0.13', or '4.21' without a standard error."""
    if se is None or se != se:
        return f"{value:.2f}"
    return f"{value:.2f} ± {se:.2f}"


def markdown_table(rows: list[dict], modes: dict, padding: dict) -> str:
    out = []
    for mode, info in modes.items():
        streamed = bool(info.get("bytes_per_pass"))
        head = [
            "T",
            "method",
            "budget",
            "tokens/pass",
            "expected",
            "tokens/s",
            "speedup",
            "draft s/step",
            "target s/step",
            "overhead",
        ]
        head += ["limit tok/s", "% of limit"] if streamed else []
        lines = [
            mode_heading(mode, info, padding),
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for r in (r for r in rows if r["mode"] == mode):
            cells = [
                f"{r['temperature']:g}",
                METHOD_LABELS[r["method"]],
                budget_label(r),
                with_se(r["tokens_per_pass"], r.get("tokens_per_pass_se")),
                "-" if r.get("expected_tokens_per_pass") is None else f"{r['expected_tokens_per_pass']:.2f}",
                with_se(r["tokens_per_s"], r.get("tokens_per_s_se")),
                speedup_text(r["speedup"]),
                f"{r['draft_s_per_step']:.3f}",
                f"{r['target_s_per_step']:.3f}",
                f"{100 * r['overhead_fraction']:.1f}%",
            ]
            if streamed:
                cells += [f"{r['limit_tokens_per_s']:.2f}", f"{100 * r['fraction_of_limit']:.0f}%"]
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def plot(
    rows: list[dict],
    modes: list[str],
    temperatures: list[float],
    key: str,
    ylabel: str,
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(modes), len(temperatures), figsize=(5.5 * len(temperatures), 4 * len(modes)), squeeze=False
    )
    for i, mode in enumerate(modes):
        for j, temperature in enumerate(temperatures):
            ax = axes[i][j]
            sel = [r for r in rows if r["mode"] == mode and r["temperature"] == temperature]
            for method in ("specexec", "specinfer", "rrs"):
                pts = sorted(
                    (r["budget"], r[key], r.get(f"{key}_se") or 0.0)
                    for r in sel
                    if r["method"] == method and r["budget"] != "auto"
                )
                if pts:
                    xs, ys, errs = zip(*pts, strict=True)
                    errs = [e if e == e else 0.0 for e in errs]  # nan (one trajectory): no bar
                    ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=METHOD_LABELS[method])
            for r in sel:
                if r["method"] == "autoregressive":
                    ax.axhline(r[key], color="gray", linestyle="--", label="Autoregressive")
                elif r["budget"] == "auto":
                    ax.plot(
                        [r["mean_tree_budget"]],
                        [r[key]],
                        marker="*",
                        markersize=14,
                        linestyle="",
                        color="tab:red",
                        label="SpecExec, budget auto (mean budget)",
                    )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (draft tokens per tree)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{MODE_LABELS[mode]}, T={temperature:g}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, meta: dict, results: list[RunResult]) -> dict[str, Path]:
    """bench.md, bench.json, tokens_per_pass.png, tokens_per_s.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    raw = [dataclasses.asdict(result) for result in results]
    (out / "raw.json").write_text(
        json.dumps({"meta": meta, "results": raw}, default=str)
    )  # first: never lost
    return write_report(out, meta, raw)


def write_report(out: Path, meta: dict, raw: list[dict]) -> dict[str, Path]:
    rows = []
    for result in raw:
        rows.append({**result, **summarize(SimpleNamespace(**result), meta["modes"][result["mode"]])})
    add_speedups(rows)
    padding = meta.get("padding") or {}
    label = "heavy padded target, outputs of the trained target" if padding else "target as given"
    header = (
        f"# specexec bench ({label})\n\n`{meta['command']}`\n\n"
        f"{meta['started']} UTC, {meta['wall_seconds'] / 60:.1f} min, torch threads {meta['torch_threads']}, "
        f"load average at end {meta['loadavg_end'][0]:.2f}. Tokens/s over decoding steps (prefill excluded); "
        "overhead = step time outside the draft and target forwards (weight streaming counts as forward). "
        "tokens/pass = accepted + bonus per target pass (before max_tokens truncation); expected = 1 + the "
        "trees' exact E[accepted] under sample-and-match (the sum of their nodes' target path probabilities; "
        "'-' for sampled SpecInfer, whose rejection sampling accepts differently); ± = standard error "
        "clustered by trajectory (a prompt run with one seed; greedy runs once per prompt); the physical "
        "limit uses tokens emitted per pass, so % of limit = link time / step time.\n\n"
    )
    paths = {
        "table": out / "bench.md",
        "json": out / "bench.json",
        "tokens_per_pass": out / "tokens_per_pass.png",
        "tokens_per_s": out / "tokens_per_s.png",
    }
    paths["table"].write_text(header + markdown_table(rows, meta["modes"], padding) + "\n" + goals(rows))
    paths["json"].write_text(json.dumps({"meta": meta, "runs": rows}, indent=1, default=str))
    modes = list(meta["modes"])
    temperatures = sorted({r["temperature"] for r in rows})
    plot(
        rows,
        modes,
        temperatures,
        "tokens_per_pass",
        "tokens per target pass",
        paths["tokens_per_pass"],
        f"Tokens per target pass vs budget ({label})",
    )
    plot(
        rows,
        modes,
        temperatures,
        "tokens_per_s",
        "tokens / s",
        paths["tokens_per_s"],
        f"Decoding speed vs budget ({label})",
    )
    return paths


if __name__ == "__main__":  # rebuild the outputs from a run's raw.json: python -m bench.report DIR
    folder = Path(sys.argv[1])
    data = json.loads((folder / "raw.json").read_text())
    print(write_report(folder, data["meta"], data["results"]))
