"""bench.prediction at a small size: its table, and every text equal to the plain one."""

from __future__ import annotations

import argparse

from bench import prediction


def test_the_prediction_bench_prints_its_table(capsys) -> None:
    parser = argparse.ArgumentParser()
    prediction.add_arguments(parser)
    args = parser.parse_args(["--budgets", "16", "--max-depths", "4", "--num-prompts", "1", "--max-tokens", "24"])
    assert prediction.run(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 | 4 |")]
    assert len(rows) == 1 and rows[0].endswith("| yes |")
    plain, same = (float(cell.split()[0]) for cell in rows[0].split("|")[3:5])
    assert same < plain  # the answer as its own prediction takes fewer passes
