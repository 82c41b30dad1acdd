"""The built-in pair's sampling defaults (issue 42 item 14): chosen by builder.sampling_sweep's measure,
shipped in its generation_config.json, stated in its model card, applied by `--generation-config auto`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from builder import sampling_sweep as sweep
from builder.sampling_sweep import Score, Setting
from server.sampling_defaults import sampling_defaults_for

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = REPO / "models" / "default" / "target"


def test_the_built_in_pair_ships_the_measured_defaults_its_card_states() -> None:
    shipped = sampling_defaults_for("auto", DEFAULT_TARGET)  # what --generation-config auto applies
    assert set(shipped) == {"temperature", "top_p", "top_k"} and 0 < shipped["temperature"] < 1
    assert json.loads((DEFAULT_TARGET / "generation_config.json").read_text())["do_sample"] is True
    card = (REPO / "models" / "default" / "MODEL_CARD.md").read_text()
    section = card[card.index("## Sampling defaults"):]
    stated = re.search(r"sets \*\*temperature ([\d.]+), top_p ([\d.]+), top_k (\d+)\*\*", section)
    assert stated and (float(stated[1]), float(stated[2]), int(stated[3])) == (
        shipped["temperature"], shipped["top_p"], shipped["top_k"])
    row = f"| temperature {shipped['temperature']:g}, top_p {shipped['top_p']:g}, top_k {shipped['top_k']} |"
    assert row in section  # the chosen setting is one the sweep measured
    assert "python -m builder.sampling_sweep" in section


@pytest.mark.parametrize(("text", "valid"), [
    ("def f(x):\n    return x\n", True),
    ("def f(x):\n    if x:\n", True),  # an open block: wants what follows
    ("x = foo(a,\n    b,\n", True),  # an open bracket
    ('def f():\n    """Doc\n', True),  # an open docstring
    ("def f(x):\n    return )\n", False),
    ("def f(x):\n    y = 1\n  z = 2\n", False),
    ("x = 'abc\n", False),
    ("def f(x):\n    return x\nthe partial last li", True),  # cut to whole lines first
])
def test_valid_python_start(text: str, valid: bool) -> None:
    assert sweep.valid_python_start(text) is valid


def test_repeated_line_share() -> None:
    assert sweep.repeated_line_share("a = 1\n\nb = 2\n") == 0.0
    assert sweep.repeated_line_share("x()\n  x()\nx()\ny()\n") == 0.5  # 2 of 4 lines repeat an earlier one
    assert sweep.repeated_line_share("") == 0.0


def score(temperature: float, good: float, count: int = 100) -> Score:
    return Score(Setting(temperature, 0.9, 20), good, good, 0.0, -1.0, count)


def test_the_choice_is_the_lowest_temperature_within_one_standard_error_of_the_best() -> None:
    scores = [score(0.0, 0.9), score(0.4, 0.30), score(0.8, 0.37), score(1.0, 0.40), score(0.9, 0.38)]
    assert sweep.choose(scores).setting.temperature == 0.8  # 0.40 - 0.049 < 0.37; greedy never chosen
    assert sweep.choose([score(0.4, 0.2), score(1.0, 0.4)]).setting.temperature == 1.0


def test_a_sweep_on_a_tiny_model_writes_what_the_server_reads(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.tiny_models import make_tiny_pair

    target, _ = make_tiny_pair(tmp_path / "pair", draft="random")
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    body = "".join(f"    value_{i} = compute({i}, {i + 1})\n" for i in range(40))
    files = [f"import os\n\n\ndef first_{n}(x):\n{body}\n\nclass Second{n}:\n{body}" for n in range(3)]
    result = sweep.run_sweep(model, tok, files, prompts=4, samples=2, temperatures=(0.5, 1.0))
    assert result is not None and result.prompts == 4 and len(result.scores) == 1 + 2 * 4
    assert all(s.count == 8 for s in result.scores) and result.chosen.setting.temperature in (0.5, 1.0)
    sweep.write_defaults(Path(target), result.chosen.setting)
    chosen = result.chosen.setting
    assert sampling_defaults_for("auto", target) == {"temperature": chosen.temperature, "top_p": chosen.top_p,
                                                     "top_k": chosen.top_k}
    lines = "\n".join(sweep.card_lines(result))
    assert lines.startswith("## Sampling defaults") and sweep.table_row(result.chosen) in lines
    assert sweep.run_sweep(model, tok, ["x = 1\n"], prompts=4) is None  # no def/class to start from
