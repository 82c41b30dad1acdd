"""`specexec bench scoring` end to end on a tiny pair: one row per budget, temperature and scale, the
paired difference beside every scale but 1, and a clear error for a corpus with nothing held out."""

from __future__ import annotations

import pytest

from builder.training import is_heldout
from specexec.__main__ import main
from tests.helpers.tiny_models import make_tiny_pair

pytestmark = pytest.mark.slow


def write_corpus(folder, heldout: int):
    """Files until `heldout` of them fall in the held-out split (1 in 50 by the name's sha1)."""
    folder.mkdir()
    i = found = 0
    while found < heldout or i < 10:
        (folder / f"mod{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n\n" for j in range(40)))
        found += is_heldout(f"mod{i}.py", 50)
        i += 1
    return folder


def test_bench_scoring_prints_a_row_per_configuration(tmp_path, capsys):
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=3)
    corpus = write_corpus(tmp_path / "corpus", heldout=2)
    args = ["bench", "scoring", "--target", str(target), "--draft", str(draft), "--corpus", str(corpus),
            "--budgets", "4,8", "--temperatures", "0.6,1", "--scales", "0.8,1", "--contexts", "3",
            "--context-tokens", "24", "--threads", "1", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert [(r[0], r[1], r[2]) for r in rows] == [(b, t, s) for b in ("4", "8") for t in ("0.6", "1")
                                                   for s in ("0.8", "1")]
    for row in rows:
        assert 1.0 <= float(row[3]) <= int(row[0]) + 1
        assert (row[4] == "-") == (row[2] == "1")
    assert (tmp_path / "out" / "scoring.md").is_file() and (tmp_path / "out" / "scoring.json").is_file()


def test_bench_scoring_needs_held_out_text(tmp_path, capsys):
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=3)
    corpus = write_corpus(tmp_path / "corpus", heldout=0)
    assert main(["bench", "scoring", "--target", str(target), "--draft", str(draft), "--corpus", str(corpus)]) == 2
    assert "no held-out file" in capsys.readouterr().err
