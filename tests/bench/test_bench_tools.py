"""`specexec bench offload` and `specexec bench quant` on tiny targets: they run from the CLI, build
and cache what they need, and print tables whose byte figures are right. (Timings are only printed:
speed claims live in the benchmarks' own output, not in tests.)"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from engine.model import gptq
from specexec.__main__ import main
from tests.helpers.gptq_extra import missing_gptq
from tests.helpers.tiny_models import make_tiny_pair

TINY = ["--layers", "2", "--hidden", "64", "--mlp", "256", "--group-size", "32", "--passes", "1", "--rounds", "1"]


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


def test_bench_quant_reports_bytes_per_pass_for_each_precision(tmp_path, capsys):
    out = tmp_path / "quant.json"
    args = ["bench", "quant", *TINY, "--cache-dir", str(tmp_path / "cache"), "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    header, *rows = table_rows(text)
    assert header[:5] == ["precision", "activations", "MB/pass", "bytes vs fp32", "tokens"]
    data = json.loads(out.read_text())
    by = {(r["precision"], r["num_tokens"]): r for r in data["rows"]}
    fp32, fp16 = by["fp32", 1], by["fp16", 1]
    # layer tensors only (norms and 7 projections): fp16 is half of fp32 up to the 256-byte alignment
    assert 0.49 < fp16["bytes_per_pass"] / fp32["bytes_per_pass"] <= 0.51
    assert fp16["activations"] == "float16" and fp32["activations"] == "float32"
    for row in data["rows"]:
        disk = () if row["precision"] == "gptq-4bit" else ("disk_read_s", "disk_streamed_s")  # int4: RAM only
        assert all(row[k] > 0 for k in ("resident_s", "ram_copy_s", "ram_streamed_s", *disk))
    assert [r[0] for r in rows][:4] == ["fp32", "fp32", "fp16", "fp16"]
    if missing_gptq():  # fails under SPECEXEC_REQUIRE_GPTQ=1 (scripts/test-gptq.sh)
        assert "gptq-4bit: skipped, the gptq extra is not installed" in text and gptq.GPTQ_PIP in text
        assert ("gptq-4bit", 1) not in by
    else:
        assert by["gptq-4bit", 1]["bytes_per_pass"] < fp16["bytes_per_pass"] / 2.5
        assert by["gptq-4bit-dequantize", 1]["bytes_per_pass"] < fp16["bytes_per_pass"] / 2.5
        assert by["gptq-4bit", 1]["disk_streamed_s"] is None
    # the built checkpoints are cached: a second run builds nothing
    built = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert main([*args, "--precisions", "fp16", "--tokens", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == built


def test_bench_quant_rejects_an_unknown_precision(tmp_path, capsys):
    assert main(["bench", "quant", "--precisions", "int3", "--cache-dir", str(tmp_path)]) == 2
    assert "unknown precision int3" in capsys.readouterr().err


@pytest.mark.parametrize("sources", [["ram"], ["ram", "disk"]])
def test_bench_offload_on_a_given_target(tmp_path, capsys, sources):
    target, _ = make_tiny_pair(tmp_path, arch="llama", draft="noisy", seed=3, layers=3)
    args = ["bench", "offload", "--target", str(target), "--tokens", "1", "4", "--passes", "1", "--rounds", "1"]
    assert main([*args, "--sources", *sources]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("source"))
    rows = [line.split() for line in lines if line.split()[:1] in (["ram"], ["disk"])]
    assert [(r[0], r[1]) for r in rows] == [(s, n) for s in sources for n in ("1", "4")]
    # MB/pass is every decoder layer's bytes (nothing resident), counted here from the file itself
    with safe_open(target / "model.safetensors", "pt") as f:
        layer_bytes = sum(f.get_tensor(k).nbytes for k in f.keys() if ".layers." in k)
    mb_column = header.split().index("MB/pass") - 3  # "resident ms", "copy ms", "streamed ms": 2 words each
    for row in rows:
        megabytes = float(row[mb_column])
        if row[0] == "ram":
            assert megabytes == pytest.approx(layer_bytes / 1e6, rel=2e-3)
        else:  # O_DIRECT reads whole 4 KiB blocks: each of the 3 layer spans may grow by up to 2 blocks
            assert layer_bytes / 1e6 * 0.998 <= megabytes <= (layer_bytes + 3 * 2 * 4096) / 1e6 * 1.002
