"""bench.forest at a small size: its table, the same tokens per tree and as a forest, fewer ops as a forest."""

from __future__ import annotations

import argparse

from bench import forest


def test_the_forest_bench_prints_its_table(capsys) -> None:
    parser = argparse.ArgumentParser()
    forest.add_arguments(parser)
    assert forest.run(parser.parse_args(["--budgets", "32", "--streams", "3", "--max-tokens", "12"])) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 | 3 |")]
    assert [row[3].strip() for row in rows] == ["per tree", "forest"]
    assert rows[0][7] == rows[1][7]  # the digests: the same tokens
    assert float(rows[1][5]) < float(rows[0][5])  # ops a draft pass
