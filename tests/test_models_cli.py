"""`specexec models`: the cached models (a cache laid out as huggingface_hub lays it) with family, size,
quantization and context, and which cached models draft for each on a GPU of a given size."""

from __future__ import annotations

import pytest

from specexec.__main__ import main
from tests.helpers.fake_hub import put_in_cache
from tests.helpers.int4_checkpoints import write_awq
from tests.helpers.tiny_models import build_model, build_tokenizer, make_tiny_pair, save_checkpoint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    target, _ = make_tiny_pair(tmp_path / "pair", hidden=128)
    small = make_tiny_pair(tmp_path / "small", draft="random")[1]
    tokenizer = build_tokenizer(vocab_size=300)
    other = save_checkpoint(build_model("llama", len(tokenizer), 5, hidden=32), tokenizer, tmp_path / "other")
    folder = tmp_path / "hub"
    for repo_id, model in {"org/tiny": target, "org/tiny-small": small, "org/other-vocab": other,
                           "org/tiny-awq": write_awq(target, tmp_path / "awq")}.items():
        put_in_cache(folder, repo_id, model)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def rows(out: str) -> dict[str, list[str]]:
    return {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| org/")}


def test_models_lists_the_cache_and_the_pairs_that_fit(cache, capsys) -> None:
    assert main(["models", "--gpu-memory-total", "24"]) == 0
    out = capsys.readouterr().out
    assert f"Hugging Face cache: {cache}; pairs for a 24 GB GPU" in out
    table = rows(out)
    assert sorted(table) == ["org/other-vocab", "org/tiny", "org/tiny-awq", "org/tiny-small"]
    model, family, size, quant, context, drafts = table["org/tiny"]
    assert family == "llama" and size.endswith(" GB") and quant == "float32" and context == "512"
    assert drafts.startswith("org/tiny-small (") and "layers resident" in drafts
    assert "org/other-vocab" not in drafts  # another tokenizer
    assert table["org/tiny-awq"][3] == "awq 4-bit GEMM, groups of 128"
    assert table["org/tiny-awq"][5].startswith("org/tiny-small (")
    assert table["org/tiny-small"][5] == "none"  # nothing smaller shares its tokens


def test_a_gpu_too_small_for_any_pair(cache, capsys) -> None:
    assert main(["models", "--gpu-memory-total", "0.51"]) == 0
    assert rows(capsys.readouterr().out)["org/tiny"][5] == "none"
