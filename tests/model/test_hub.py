"""Models named by Hugging Face Hub id (engine.model.hub, named_models, draft_auto).

- A cache laid out as huggingface_hub lays it (refs/, snapshots/, blobs/; tests/helpers/fake_hub.py)
  with tiny models: ids resolve from it offline, a revision picks its snapshot, a partial snapshot
  does not count, a config file may name ids, `--draft auto` chooses a same-vocabulary draft that
  fits and refuses, listing the candidates, when none does.
- A real download through huggingface_hub from a local HTTP server answering the Hub's endpoints
  (HF_ENDPOINT), as `specexec generate` runs it: progress bars on stderr, only the files a model
  needs; gated, missing and offline models exit 2 with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model import draft_auto, hub
from engine.types import CheckpointError
from tests.helpers.fake_hub import FakeHub, put_in_cache, repo_files
from tests.helpers.tiny_models import build_model, build_tokenizer, make_tiny_pair, save_checkpoint

REPO = Path(__file__).resolve().parents[2]
GB = 10**9


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """org/tiny (target), org/tiny-draft (a noisy copy: same tokenizer, same size), org/tiny-small (same
    tokenizer, a third of the target), org/other-vocab (a small model of another tokenizer)."""
    root = tmp_path_factory.mktemp("hub_models")
    target, noisy = make_tiny_pair(root / "pair", draft="noisy")
    small = make_tiny_pair(root / "small", draft="random")[1]
    tokenizer = build_tokenizer(vocab_size=300)
    other = save_checkpoint(build_model("llama", len(tokenizer), 5, hidden=32), tokenizer, root / "other")
    (target / "original").mkdir()
    (target / "original" / "consolidated.00.pth").write_bytes(b"\0" * 64)  # a second copy: never fetched
    (target / "pytorch_model.bin").write_bytes(b"\0" * 64)  # a duplicate format: never fetched
    return {"org/tiny": target, "org/tiny-draft": noisy, "org/tiny-small": small, "org/other-vocab": other}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline (huggingface_hub reads both settings at import: patched here)."""
    from huggingface_hub import constants

    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def test_needed_files_are_one_set_of_weights() -> None:
    llama = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "original/consolidated.00.pth",
             "original/params.json", "original/tokenizer.model", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "LICENSE", "README.md", "USE_POLICY.md", ".gitattributes"]
    assert hub.needed_files(llama) == sorted(set(llama) - {"original/consolidated.00.pth", "original/params.json",
                                                           "original/tokenizer.model", "LICENSE", "README.md",
                                                           "USE_POLICY.md", ".gitattributes"})
    mistral = ["config.json", "consolidated.safetensors", "model-00001-of-00003.safetensors", "params.json",
               "tokenizer.model", "tokenizer.model.v3", "pytorch_model-00001-of-00003.bin"]
    assert hub.needed_files(mistral) == ["config.json", "model-00001-of-00003.safetensors", "params.json",
                                         "tokenizer.model"]
    gptq = ["config.json", "gptq_model-4bit-128g.safetensors", "quantize_config.json", "tokenizer.model"]
    assert hub.needed_files(gptq) == sorted(gptq)
    old = ["config.json", "pytorch_model.bin", "vocab.json", "merges.txt", "flax_model.msgpack"]
    assert hub.needed_files(old) == ["config.json", "merges.txt", "pytorch_model.bin", "vocab.json"]


def test_ids_resolve_from_the_cache_offline(models, cache) -> None:
    snapshot = put_in_cache(cache, "org/tiny", models["org/tiny"])
    assert hub.resolve_model("org/tiny") == str(snapshot)
    assert hub.resolve_model(str(models["org/tiny"])) == str(models["org/tiny"])  # a folder stays a folder
    put_in_cache(cache, "org/partial", models["org/tiny"], only=["config.json", "tokenizer.json"])
    with pytest.raises(CheckpointError, match=r"--draft org/partial: not in the local Hugging Face cache \(.*\) and "
                                              r"HF_HUB_OFFLINE=1 forbids downloading it; .*`hf download org/partial`"):
        hub.resolve_model("org/partial", flag="--draft")
    with pytest.raises(CheckpointError, match="no such model folder, and not a Hugging Face Hub id"):
        hub.resolve_model("./no/such/folder")


def test_a_revision_picks_its_snapshot(models, cache) -> None:
    main = put_in_cache(cache, "org/tiny", models["org/tiny"])
    other = put_in_cache(cache, "org/tiny", models["org/tiny-draft"], revision="v2")
    assert main != other
    assert hub.resolve_model("org/tiny") == str(main)
    assert hub.resolve_model("org/tiny", revision="v2") == str(other)
    commit = other.name
    assert hub.resolve_model("org/tiny", revision=commit) == str(other)


def cache_all(cache: Path, models: dict[str, Path]) -> dict[str, Path]:
    return {repo_id: put_in_cache(cache, repo_id, folder) for repo_id, folder in models.items()}


def config_for(target: Path):
    from engine.config import EngineConfig, ModelConfig

    return EngineConfig(model=ModelConfig(target=str(target), draft="auto", dtype="float32"))


def test_draft_auto_picks_the_largest_same_vocabulary_draft_that_fits(models, cache) -> None:
    snapshots = cache_all(cache, models)
    folder, why = draft_auto.choose_draft(config_for(snapshots["org/tiny"]), "org/tiny", 10 * GB, "a test GPU")
    # org/tiny-draft is the target's size (more than half its parameters): not a draft for it
    assert folder == str(snapshots["org/tiny-small"])
    assert why.startswith("--draft auto: org/tiny-small (in the cache; the target's 320 tokens and special tokens; "
                          "the largest candidate that fits beside it on a test GPU")


def test_draft_auto_checks_the_tokens_not_the_names(models, cache) -> None:
    snapshots = cache_all(cache, {k: v for k, v in models.items() if k != "org/tiny-small"})
    with pytest.raises(CheckpointError) as info:
        draft_auto.choose_draft(config_for(snapshots["org/tiny"]), "org/tiny", 10 * GB, "a test GPU")
    message = str(info.value)
    assert "--draft auto: no draft shares org/tiny's tokens and fits beside it on a test GPU (the target is resident: --offload streams its layers); candidates: " in message
    assert "org/other-vocab: another vocabulary (300 tokens, the target's 320)" in message
    assert "Name a draft with --draft" in message and "\n" not in message


def test_draft_auto_refuses_listing_candidates_when_none_fits(models, cache) -> None:
    snapshots = cache_all(cache, models)
    plan = draft_auto.plan_config(config_for(snapshots["org/tiny"]), on_cpu=True)
    with pytest.raises(CheckpointError) as info:
        draft_auto.choose_draft(plan, "org/tiny", int(0.51 * GB), "a 0.51 GB GPU")
    message = str(info.value)
    assert "no draft shares org/tiny's tokens and fits beside it on a 0.51 GB GPU" in message
    assert "org/tiny-small: does not fit beside the target (" in message


def test_a_config_file_names_hub_ids(models, cache, tmp_path, monkeypatch) -> None:
    """A target by id, no draft: `--draft auto`; served under its id."""
    from engine.cli import add_engine_arguments, engine_config_from_args

    snapshots = cache_all(cache, models)
    path = tmp_path / "pair.toml"
    path.write_text('[model]\ntarget = "org/tiny"\n')
    monkeypatch.chdir(tmp_path)
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config, _ = engine_config_from_args(parser.parse_args(["--config", str(path)]))
    assert config.model.target == str(snapshots["org/tiny"]) and config.model.name == "org/tiny"
    assert config.model.draft == str(snapshots["org/tiny-small"])
    config, _ = engine_config_from_args(parser.parse_args(["--config", str(path), "--draft", "org/tiny-draft"]))
    assert config.model.draft == str(snapshots["org/tiny-draft"])


def run_specexec(*argv: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "specexec", *argv], capture_output=True, text=True, env=full,
                          cwd=REPO, timeout=timeout)


def test_a_real_download_from_a_local_hub(models, tmp_path) -> None:
    """huggingface_hub downloads from a local server answering the Hub's endpoints: progress on stderr,
    only the files the model needs; then the cache serves the same command offline."""
    cache = tmp_path / "hub"
    repos = {"org/tiny": models["org/tiny"], "org/tiny-draft": models["org/tiny-draft"]}
    argv = ("generate", "--target", "org/tiny", "--draft", "org/tiny-draft", "--prompt", "def add(",
            "--max-tokens", "4", "--temperature", "0")
    with FakeHub(repos) as server:
        done = run_specexec(*argv, env={"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(cache),
                                        "HF_HUB_DISABLE_PROGRESS_BARS": "0"})
        assert done.returncode == 0, done.stderr
        assert "specexec: downloading org/tiny (6 files, " in done.stderr
        assert "specexec: downloading org/tiny-draft (6 files, " in done.stderr
        assert "Fetching 6 files: 100%" in done.stderr  # huggingface_hub's own progress bar
        fetched = {path for method, path in server.requests if method == "GET" and "/resolve/" in path}
        assert not any("original/" in path or path.endswith(".bin") for path in fetched)
    snapshot = next((cache / "models--org--tiny" / "snapshots").iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == hub.needed_files(list(repo_files(models["org/tiny"])))
    offline = run_specexec(*argv, env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(cache),
                                       "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == done.stdout and "downloading" not in offline.stderr


@pytest.mark.parametrize(("repo_id", "offline", "expected"), [
    ("org/gated", False, "--target org/gated: a gated model; accept its terms at https://huggingface.co/org/gated"),
    ("org/missing", False, "--target org/missing: no such model on the Hugging Face Hub, nor a local folder"),
    ("org/tiny", True, "--target org/tiny: not in the local Hugging Face cache"),
])
def test_an_unavailable_model_exits_2_with_one_line(models, tmp_path, repo_id, offline, expected) -> None:
    with FakeHub({"org/tiny": models["org/tiny"]}, gated=("org/gated",)) as server:
        env = {"HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1" if offline else "0"}
        done = run_specexec("generate", "--target", repo_id, "--prompt", "x", env=env)
    assert done.returncode == 2
    assert done.stderr.startswith(f"specexec: error: {expected}")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_plan_names_models_by_id(models, cache, capsys) -> None:
    """`specexec plan` reads a hub id's config.json from the cache; `--draft auto` is chosen for the GPU."""
    from specexec.__main__ import main

    snapshots = cache_all(cache, models)
    assert main(["plan", "--target", "org/tiny", "--gpu-memory-total", "2"]) == 0
    captured = capsys.readouterr()
    assert f"target org/tiny ({snapshots['org/tiny'] / 'config.json'})" in captured.out
    assert f"draft  {snapshots['org/tiny-small']}" in captured.out and "fits, " in captured.out
    assert "specexec: --draft auto: org/tiny-small (in the cache;" in captured.err
    assert main(["plan", "--target", "org/nowhere", "--method", "autoregressive", "--gpu-memory-total", "2"]) == 2
    assert "org/nowhere: not in the Hugging Face cache, not among the known shapes" in capsys.readouterr().err


def test_draft_auto_falls_back_to_the_self_draft_for_a_streamed_target(models, cache) -> None:
    """No cached or known model shares the target's tokens: a streamed target drafts with its own layers in
    4-bit where that fits; a resident one, or one where it does not fit, is refused with the reason."""
    from engine.config import SELF_DRAFT

    snapshots = cache_all(cache, {k: v for k, v in models.items() if k not in ("org/tiny-small", "org/tiny-draft")})
    streamed = config_for(snapshots["org/tiny"]).replace("offload", enabled=True)
    folder, why = draft_auto.choose_draft(streamed, "org/tiny", 10 * GB, "a test GPU")
    assert folder == SELF_DRAFT
    assert why.startswith("--draft auto: the target's own layers in 4-bit (--draft self: no other model shares its tokens")
    assert "org/other-vocab: another vocabulary" in why
    with pytest.raises(CheckpointError, match="the target's own layers in 4-bit \\(--draft self\\): not chosen for a resident target"):
        draft_auto.choose_draft(config_for(snapshots["org/tiny"]), "org/tiny", 10 * GB, "a test GPU")
    with pytest.raises(CheckpointError, match="the target's own layers in 4-bit \\(--draft self\\): does not fit beside"):
        draft_auto.choose_draft(streamed, "org/tiny", 2 * 10**6, "a 2 MB GPU")
