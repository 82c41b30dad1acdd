"""`specexec bench self-draft` on a tiny pair: it runs from the CLI and writes raw.json, the table (every
(temperature, budget) with both drafts, standard errors, the self / pair ratio) and the plot; its
tokens per pass are what the raw steps say. (Timings are only printed, never asserted.)"""

from __future__ import annotations

import json

from bench.self_draft_report import rows_of
from specexec.__main__ import main
from tests.helpers.tiny_models import make_tiny_pair


def test_bench_self_draft_writes_the_table_and_plot(tmp_path, capsys):
    target, draft = make_tiny_pair(tmp_path / "pair", arch="llama", draft="noisy", seed=3, hidden=128)
    out = tmp_path / "out"
    assert main(["bench", "self-draft", "--pairs", f"{target},{draft}", "--names", "tiny", "--budgets", "16,32",
                 "--temperatures", "0,1", "--num-prompts", "2", "--max-tokens", "8", "--out", str(out)]) == 0
    data = json.loads((out / "raw.json").read_text())
    assert [r["draft"] for r in data["results"]] == ["pair draft", "self-draft"]
    rows = rows_of(data["results"])
    assert len(rows) == 2 * 2 * 2 and all(r["trajectories"] == 2 for r in rows)
    first = data["results"][1]["cells"][0]["prompts"]
    assert rows[4]["tokens_per_pass"] == sum(sum(p["steps"]) for p in first) / sum(len(p["steps"]) for p in first)
    table = (out / "bench.md").read_text()
    assert table.count("| tiny |") == 4 and "x ±" in table and "## Arithmetic (not measured)" in table
    assert (out / "tokens_per_pass.png").stat().st_size > 0
