"""bench.seeds at a small size: its table, the same tokens with overlap off and on, seeds found with it on."""

from __future__ import annotations

import argparse

from bench import seeds


def test_the_seeds_bench_prints_its_table(capsys) -> None:
    parser = argparse.ArgumentParser()
    seeds.add_arguments(parser)
    args = ["--budgets", "64", "--streams", "1", "--factors", "2", "--steps", "6", "--slow-pass-ms", "60"]
    assert seeds.run(parser.parse_args(args)) == 0
    rows = [[c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 64 | 1 |")]
    assert [r[3] for r in rows] == ["off", "on, 2x"]
    assert rows[0][10] == rows[1][10]  # the digests: the same tokens
    assert rows[0][7] == "0.00 / 1" and float(rows[1][7].split(" /")[0]) > 0  # trees grown from a seed
