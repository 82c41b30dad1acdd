"""`specexec bench self-draft` outputs: the table (tokens per pass with standard errors, the draft's cost
per step), the plot, raw.json, and the arithmetic for a 32B-class bf16 target streamed over PCIe 4.0."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.report import ratio_with_se

PCIE4_BYTES_PER_S = 25e9  # PCIe 4.0 x16, pinned host memory (assumed, not measured here)
GPU_BYTES_PER_S = 1008e9  # an RTX 4090's memory bandwidth (its data sheet); a draft forward of few rows reads its weights once
ARITHMETIC_TARGET = "Qwen/Qwen2.5-32B-Instruct"


def cell_row(pair: str, draft: str, cell: dict) -> dict:
    prompts = cell["prompts"]
    tokens = [sum(p["steps"]) for p in prompts]
    passes = [len(p["steps"]) for p in prompts]
    value, se = ratio_with_se(tokens, passes)
    steps = max(sum(passes), 1)
    forwards = sum(p["draft_forwards"] for p in prompts)
    return {
        "pair": pair, "draft": draft, "temperature": cell["temperature"], "budget": cell["budget"],
        "tokens_per_pass": value, "tokens_per_pass_se": se, "trajectories": len(prompts),
        "draft_ms_per_step": 1000 * sum(p["draft_seconds"] for p in prompts) / steps,
        "draft_forwards_per_step": forwards / steps,
        "ms_per_draft_forward": 1000 * sum(p["draft_forward_seconds"] for p in prompts) / max(forwards, 1),
        "target_ms_per_step": 1000 * sum(p["target_seconds"] for p in prompts) / steps,
        # accepted + bonus tokens per second of draft and target work (CPU, target resident): not the
        # streamed regime the self-draft is for, where the draft hides in the copy
        "tokens_per_s": sum(tokens) / max(sum(p["draft_seconds"] + p["target_seconds"] for p in prompts), 1e-9),
        # steps whose whole path was accepted down to the depth cap (max_depth + 1 tokens)
        "at_depth_cap": sum(s >= cell.get("max_depth", 32) + 1 for p in prompts for s in p["steps"]) / steps,
    }


def rows_of(results: list[dict]) -> list[dict]:
    return [cell_row(result["pair"], result["draft"], cell) for result in results for cell in result["cells"]]


def ratio_text(num: dict, den: dict) -> str:
    ratio = num["tokens_per_pass"] / den["tokens_per_pass"]
    rel = math.hypot(num["tokens_per_pass_se"] / num["tokens_per_pass"], den["tokens_per_pass_se"] / den["tokens_per_pass"])
    return f"{ratio:.2f}x ± {ratio * rel:.2f}"


def with_se(row: dict) -> str:
    return f"{row['tokens_per_pass']:.2f} ± {row['tokens_per_pass_se']:.2f}"


def markdown_table(rows: list[dict]) -> str:
    drafts = list(dict.fromkeys(row["draft"] for row in rows))
    head = ("| pair | T | budget | " + " | ".join(f"{d}: tokens/pass" for d in drafts)
            + " | self / pair | " + " | ".join(f"{d}: draft ms/step (passes/step, ms/pass)" for d in drafts)
            + " | target ms/step (pair draft / self) | tokens/s, resident on this CPU (pair draft / self) "
            "| self-draft steps at the depth cap |")
    lines = [head, "|" + "---|" * (3 + 2 * len(drafts) + 4)]
    for (pair, temperature, budget) in dict.fromkeys((r["pair"], r["temperature"], r["budget"]) for r in rows):
        cell = {r["draft"]: r for r in rows if (r["pair"], r["temperature"], r["budget"]) == (pair, temperature, budget)}
        tpp = " | ".join(with_se(cell[d]) if d in cell else "" for d in drafts)
        cost = " | ".join(f"{cell[d]['draft_ms_per_step']:.1f} ({cell[d]['draft_forwards_per_step']:.1f}, "
                          f"{cell[d]['ms_per_draft_forward']:.2f})" if d in cell else "" for d in drafts)
        ratio = ratio_text(cell[drafts[1]], cell[drafts[0]])
        target = f"{cell[drafts[0]]['target_ms_per_step']:.1f} / {cell[drafts[1]]['target_ms_per_step']:.1f}"
        capped = f"{100 * cell[drafts[1]]['at_depth_cap']:.0f}%"
        speed = f"{cell[drafts[0]]['tokens_per_s']:.0f} / {cell[drafts[1]]['tokens_per_s']:.0f}"
        lines.append(f"| {pair} | {temperature:g} | {budget} | {tpp} | {ratio} | {cost} | {target} | {speed} | {capped} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.2 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for pair, draft in dict.fromkeys((r["pair"], r["draft"]) for r in rows):
            pts = sorted((r["budget"], r["tokens_per_pass"], r["tokens_per_pass_se"]) for r in rows
                         if (r["pair"], r["draft"], r["temperature"]) == (pair, draft, temperature))
            xs, ys, errs = zip(*pts, strict=True)
            style = "-" if draft.startswith("self") else "--"
            ax.errorbar(xs, ys, yerr=[e if e == e else 0 for e in errs], marker="o", capsize=3, linestyle=style,
                        label=f"{pair}: {draft}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (draft tokens per tree)")
        ax.set_ylabel("tokens per target pass")
        ax.set_title(f"T = {temperature:g}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Self-draft (4-bit copy of the target) vs the pair's own draft, CPU", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def arithmetic() -> str:
    """A 32B-class bf16 target streamed over PCIe 4.0 on a 24 GB card: bytes from its config.json (the
    plan's arithmetic), step = max(copy, draft) with overlap. Arithmetic, not a measurement."""
    from engine.model import config_shapes, self_draft_plan
    from engine.model.self_draft_fit import self_draft_fit

    config, _ = config_shapes.read_model_config(ARITHMETIC_TARGET)
    layers = config_shapes.weight_bytes(config, 2)
    copy = sum(self_draft_plan.layer_copy_bytes(config, 2))
    head = config["vocab_size"] * config["hidden_size"] * 2
    lines = [f"Target {ARITHMETIC_TARGET}: {layers.num_layers} layers of {layers.layer / 1e9:.2f} GB in bf16 "
             f"({sum(layers.layers) / 1e9:.1f} GB), embeddings and head {layers.outer / 1e9:.2f} GB; the self-draft's "
             f"4-bit copy of every layer {copy / 1e9:.2f} GB."]
    for total in (24e9, 24 * 2**30):
        fit = self_draft_fit(ARITHMETIC_TARGET, int(total))
        where = f"{total / 1e9:.1f} GB card (`--gpu-memory-total {total / 1e9:.1f}`)"
        if fit.plan is None:
            lines.append(f"- {where}: the plan finds no self-draft that fits (down to budget 64, 1024-token context).")
        else:
            plan = fit.plan
            lines.append(f"- {where}: fits at budget {plan.inputs.budget}, max context {plan.inputs.max_context}, "
                         f"{plan.resident_layers} resident layers ({plan.plan.total / 1e9:.2f} GB planned): `{fit.flags}`.")
    streamed = sum(layers.layers)
    copy_s = streamed / PCIE4_BYTES_PER_S
    forward_s = (copy + head) / GPU_BYTES_PER_S
    lines += [
        f"- copy per pass, every layer streamed: {streamed / 1e9:.1f} GB / 25 GB/s = **{copy_s:.2f} s**;",
        f"- one self-draft forward of up to 128 rows reads its copy and the head once: "
        f"{(copy + head) / 1e9:.1f} GB / {GPU_BYTES_PER_S / 1e9:.0f} GB/s = **{1000 * forward_s:.0f} ms**; "
        f"a step of D forwards costs D x that: {1000 * 8 * forward_s:.0f} ms at D = 8, "
        f"{1000 * 32 * forward_s:.0f} ms at D = 32 (the depth cap);",
        f"- step = max(copy, draft) with overlap = {copy_s:.2f} s for D <= {int(copy_s / forward_s)}: the draft hides "
        "in the copy, so tokens/s = tokens per pass / {:.2f} s.".format(copy_s),
    ]
    return "\n".join(lines)


def write_report(out: Path, meta: dict, results: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "raw.json"
    raw.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    rows = rows_of(results)
    table = out / "bench.md"
    table.write_text(f"# Self-draft vs the pair's draft ({meta['machine']}; {meta['prompts']} code prompts x "
                     f"{meta['max_tokens']} tokens; {meta['minutes']} min)\n\nCPU numbers. tokens/pass: accepted + "
                     f"bonus per target pass, ± standard error clustered by prompt.\n\n{markdown_table(rows)}\n\n"
                     f"## Arithmetic (not measured)\n\n{arithmetic()}\n")
    png = out / "tokens_per_pass.png"
    plot(rows, png)
    return [raw, table, png]


def main(paths: list[str]) -> None:
    """Rewrite bench.md and the plot from raw.json files (python -m bench.self_draft_report DIR...)."""
    for folder in paths:
        data = json.loads((Path(folder) / "raw.json").read_text())
        write_report(Path(folder), data["meta"], data["results"])


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
