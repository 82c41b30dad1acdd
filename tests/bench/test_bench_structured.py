"""`specexec bench structured` end to end on a tiny pair: one row per budget, temperature and schema
setting, with the grammar's time only in the schema rows. (Timings are printed, never asserted.)"""

from __future__ import annotations

import pytest

from specexec.__main__ import main
from tests.helpers.tiny_models import make_tiny_pair

pytestmark = pytest.mark.slow


def test_bench_structured_prints_a_row_per_configuration(tmp_path, capsys):
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=3)
    args = ["bench", "structured", "--target", str(target), "--draft", str(draft), "--budgets", "4,8",
            "--temperatures", "0,0.6", "--num-prompts", "2", "--max-tokens", "12", "--threads", "1"]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert [(r[0], r[1], r[2]) for r in rows] == [(b, t, s) for b in ("4", "8") for t in ("0", "0.6")
                                                   for s in ("none", "json_schema")]
    for row in rows:
        tokens_per_pass, grammar_ms = float(row[3]), float(row[7])
        assert 1.0 <= tokens_per_pass <= int(row[0]) + 1
        assert (grammar_ms > 0) == (row[2] == "json_schema")
