"""`specexec bench` end to end on a tiny pair: every method, mode and temperature runs every prompt,
the outputs are written, and the raw figures hang together; the streamed bytes per pass are what the engine moves. (Timings are only written, never
asserted: speed claims live in the benchmark's own output.)"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from specexec.__main__ import main
from tests.helpers.tiny_models import make_tiny_pair

pytestmark = pytest.mark.slow


def test_bench_runs_every_configuration_and_writes_its_outputs(tmp_path):
    target, draft = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=3, layers=3)
    weights = target / "model.safetensors"
    save_file({k: v.half() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    out = tmp_path / "out"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--modes", "resident,ram,disk",
            "--budgets", "4,8", "--temperatures", "0,0.6", "--num-prompts", "2", "--seeds", "2", "--max-tokens", "6",
            "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} >= {"bench.json", "bench.md", "tokens_per_pass.png", "tokens_per_s.png"}
    data = json.loads((out / "bench.json").read_text())
    runs = {(r["mode"], r["temperature"], r["method"], r["budget"]): r for r in data["runs"]}
    expected = {(mode, t, method, budget) for mode in ("resident", "ram", "disk") for t in (0.0, 0.6)
                for method, budget in [("autoregressive", 1), *[(m, b) for m in ("specinfer", "specexec", "rrs")
                                                                  for b in (4, 8)], ("specexec", "auto")]}
    assert set(runs) == expected
    for key, run in runs.items():
        greedy = key[1] == 0.0
        # greedy runs each prompt once, sampling with --seeds 2 seeds (trajectories); ignore_eos: all run to max_tokens
        assert run["prompt_index"] == ([0, 1] if greedy else [0, 1, 0, 1]), key
        assert len(set(run["seeds"])) == len(run["seeds"]), key
        assert run["completion_tokens"] == [6] * len(run["prompt_index"]), key
        assert run["trajectories"] == len(run["prompt_index"]) and run["tokens_per_pass_se"] >= 0, key
        passes = run["target_passes"]
        if greedy or key[2] == "specexec":  # sample-and-match: the trees' expectation is known
            assert all(e is not None for steps in run["expected"] for e in steps), key
        if greedy:  # an argmax walk is deterministic: expected equals realized, step by step
            assert run["expected"] == [[float(a) for a in steps] for steps in run["accepted"]], key
        if key[2] == "specinfer" and not greedy:
            assert run["expected_tokens_per_pass"] is None, key
        if key[2] == "autoregressive":
            assert passes == [6] * len(run["prompt_index"])
        else:  # one entry per target pass; each pass emits its accepted draft tokens + 1
            budget = 8 if key[3] == "auto" else key[3]
            assert [len(a) for a in run["accepted"]] == passes, key
            assert all(0 <= n <= budget for steps in run["accepted"] for n in steps), key
            assert all(sum(n + 1 for n in steps[:-1]) < 6 <= sum(n + 1 for n in steps) for steps in run["accepted"])
    layer_file_bytes = sum(v.nbytes for k, v in load_file(weights).items() if ".layers." in k)
    info = data["meta"]["modes"]
    assert "bytes_per_pass" not in info["resident"]
    assert info["disk"]["bytes_per_pass"] == layer_file_bytes  # the fp16 bytes the engine reads
    # ram streams what was loaded: on CPU an fp16 checkpoint loads as fp32, twice the file's bytes
    assert info["ram"]["bytes_per_pass"] == pytest.approx(2 * layer_file_bytes, rel=0.02)
    markdown = (out / "bench.md").read_text()
    assert markdown.count("| SpecExec | auto (~") == 6  # 3 modes x 2 temperatures
