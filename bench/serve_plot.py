"""`specexec bench serve`'s plot: aggregate tokens/s and time to first token against concurrent streams."""

from __future__ import annotations

from pathlib import Path

PANELS = (  # row key, y label, log y axis
    ("aggregate_tokens_per_s", "aggregate tokens / s", False),
    ("ttft_mean", "time to first token (s): mean, dotted: max", True),
)


def draw_max(ax: object, rows: list[dict], line: tuple[str, str, float], color: str) -> None:
    """The slowest stream's time to first token: a thin dotted line under the mean's."""
    pts = sorted((r["num_streams"], r["ttft_max"]) for r in rows
                 if (r["source"], r["variant"], r["temperature"]) == line and r.get("ttft_max") is not None)
    if pts:
        ax.plot(*zip(*pts, strict=True), linestyle=":", linewidth=1, color=color)


def plot_streams(rows: list[dict], path: Path, target_label: str, source_labels: dict[str, str]) -> None:
    """One column per source, rows: aggregate tok/s and mean TTFT; one line per variant and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(r["source"] for r in rows))
    fig, axes = plt.subplots(len(PANELS), len(sources), figsize=(5.5 * len(sources), 3.8 * len(PANELS)),
                             squeeze=False)
    lines = list(dict.fromkeys((r["variant"], r["temperature"]) for r in rows))
    streams = sorted({r["num_streams"] for r in rows})
    for j, source in enumerate(sources):
        for i, (key, ylabel, log_y) in enumerate(PANELS):
            ax = axes[i][j]
            for variant, temperature in lines:
                pts = sorted(
                    (r["num_streams"], r[key]) for r in rows
                    if (r["source"], r["variant"], r["temperature"]) == (source, variant, temperature)
                    and r.get(key) is not None
                )
                if pts:
                    style = "-" if variant == lines[0][0] else "--"
                    drawn = ax.plot(*zip(*pts, strict=True), marker="o", linestyle=style,
                                    label=f"{variant}, T={temperature:g}")
                    if key == "ttft_mean":
                        draw_max(ax, rows, (source, variant, temperature), drawn[0].get_color())
            ax.set_xscale("log", base=2)
            ax.set_xticks(streams, [str(n) for n in streams])
            if log_y:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(ylabel)
            ax.set_title(source_labels[source], fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"specexec bench serve ({target_label.replace('`', '')})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
