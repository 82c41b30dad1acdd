"""Every configs/*.toml loads through `specexec serve --config`'s own code path, without weights.

`serve` runs engine_config_from_args (file + flags -> EngineConfig, then the models resolved: folders,
or hub ids from the cache or downloaded) and server_config_from (the [server] table + flags ->
ServerConfig). The serve parser here is built from the same two argument sets; the full CLI parser
would import transformers for its other commands. The resolution is stubbed where no weights exist.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import tomllib

from engine import cli as flags
from engine.cli import DEFAULT_MODELS, add_engine_arguments, engine_config_from_args
from engine.config import EngineConfig
from engine.types import CheckpointError, ConfigError
from server.config import ServerConfig
from server.serve import add_server_arguments, server_config_from

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))
REAL_CONFIGS = [path for path in CONFIGS if path.name != "default.toml"]

# file -> (target, draft, budget, dtype), as the issue lists the deployments
DEPLOYMENTS = {
    "llama2-70b-chat.toml": ("meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-7b-chat-hf", 2048, "float16"),
    "llama2-70b-chat-gptq.toml": ("TheBloke/Llama-2-70B-chat-GPTQ", "meta-llama/Llama-2-7b-chat-hf", 256, "float16"),
    "llama3.1-70b-instruct.toml": (
        "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", 1024, "bfloat16"
    ),
    "mixtral-8x7b-instruct.toml": (
        "mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mistral-7B-Instruct-v0.2", 1024, "bfloat16"
    ),
    "qwen2.5-72b-instruct.toml": ("Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", 1024, "bfloat16"),
}


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specexec serve")
    add_engine_arguments(parser)
    add_server_arguments(parser)
    return parser


def load(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    """What `specexec serve ARGV` builds before it loads any weights."""
    args = serve_parser().parse_args(list(argv))
    config, server_section = engine_config_from_args(args)
    return config, server_config_from(args, server_section, args.config)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """Stub the models' resolution (folders, hub ids); returns the configs it was asked to resolve."""
    checked: list[EngineConfig] = []

    def resolve(config: EngineConfig) -> EngineConfig:
        checked.append(config)
        return config

    monkeypatch.setattr(flags, "resolve_models", resolve)
    monkeypatch.delenv("SPECEXEC_API_KEY", raising=False)
    return checked


def test_one_config_per_deployment() -> None:
    assert {path.name for path in CONFIGS} == {*DEPLOYMENTS, "default.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_config_validates(path: Path, no_weights: list[EngineConfig]) -> None:
    config, server = load("--config", str(path))
    assert no_weights == [config]
    assert config.model.target and config.model.draft
    assert config.speculation.method == "specexec"
    assert server.host == "127.0.0.1" and server.port == 8000


@pytest.mark.parametrize("path", REAL_CONFIGS, ids=lambda path: path.name)
def test_real_config_is_the_listed_deployment(path: Path, no_weights: list[EngineConfig]) -> None:
    config, _ = load("--config", str(path))
    target, draft, budget, dtype = DEPLOYMENTS[path.name]
    assert (config.model.target, config.model.draft) == (target, draft)  # hub ids, relative to the cwd
    assert (config.speculation.budget, config.model.dtype, config.model.device) == (budget, dtype, "cuda")
    assert config.offload.enabled and config.offload.source == "ram" and config.offload.gpu_memory
    assert config.limits.max_context is not None
    text = path.read_text()
    assert "are Hugging Face Hub ids" in text and "downloads the files they need" in text


def test_default_config_is_the_builtin_default(no_weights: list[EngineConfig]) -> None:
    from_file, server_from_file = load("--config", str(CONFIG_DIR / "default.toml"))
    builtin, server_builtin = load()
    assert from_file.replace("model", target="", draft="") == builtin.replace("model", target="", draft="")
    assert server_from_file == server_builtin
    # ../models/default/* next to configs/ is the folder the engine falls back to without a target
    raw = tomllib.loads((CONFIG_DIR / "default.toml").read_text())["model"]
    for role in ("target", "draft"):
        assert os.path.normpath(CONFIG_DIR / raw[role]) == str(DEFAULT_MODELS / role) == getattr(builtin.model, role)
        if (DEFAULT_MODELS / role).is_dir():
            assert getattr(from_file.model, role) == str(DEFAULT_MODELS / role)


def test_flags_override_the_file(no_weights: list[EngineConfig]) -> None:
    path = CONFIG_DIR / "llama2-70b-chat.toml"
    config, server = load("--config", str(path), "--budget", "512", "--target", "/elsewhere/70b", "--port", "9000")
    assert config.speculation.budget == 512 and config.model.target == "/elsewhere/70b"
    assert config.model.draft == "meta-llama/Llama-2-7b-chat-hf" and server.port == 9000


def test_relative_paths_next_to_the_file_then_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models" / "target").mkdir(parents=True)
    (tmp_path / "work" / "org" / "draft").mkdir(parents=True)
    (tmp_path / "deploy").mkdir()
    path = tmp_path / "deploy" / "pair.toml"
    path.write_text('[model]\ntarget = "../models/target"\ndraft = "org/draft"\n')
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.delenv("SPECEXEC_API_KEY", raising=False)
    config, _ = load("--config", os.path.relpath(path))  # the real model-folder check passes
    assert Path(config.model.target).is_absolute()
    assert Path(config.model.target).resolve() == (tmp_path / "models" / "target").resolve()
    assert config.model.draft == "org/draft" and Path(config.model.draft).is_dir()


def test_missing_weights_name_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config's hub id, with no folder of that name, not in the (empty) hub cache, offline: one line."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="--target meta-llama/Llama-2-70b-chat-hf: not in the local Hugging "
                                              "Face cache .* and HF_HUB_OFFLINE=1 forbids downloading it"):
        load("--config", str(CONFIG_DIR / "llama2-70b-chat.toml"))
    with pytest.raises(CheckpointError, match="--target ./nowhere: no such model folder"):
        load("--target", "./nowhere", "--draft", "./nowhere")


BAD_FIELDS = [
    # unknown keys and sections
    ("[speculation]\nbugdet = 64", "speculation.bugdet"),
    ("[server]\nprot = 8000", "server.prot"),
    ("[speculaton]\nbudget = 64", "speculaton"),
    # wrong types
    ("[model]\ntarget = 70", "model.target"),
    ('[offload]\ngpu_memory = "24"', "offload.gpu_memory"),
    ('[offload]\nenabled = "yes"', "offload.enabled"),
    ("[limits]\nmax_context = 4096.0", "limits.max_context"),
    ("[speculation]\nmax_expand = true", "speculation.max_expand"),
    ('[speculation]\nbudget = "many"', "speculation.budget"),
    ('[server]\nport = "8000"', "server.port"),
    # out-of-range values
    ("[speculation]\nmax_expand = 0", "speculation.max_expand"),
    ("[speculation]\ndecay = 1.5", "speculation.decay"),
    ("[speculation]\ngreedy_tree_temperature = 0", "speculation.greedy_tree_temperature"),
    ("[speculation]\nsampled_tree_temperature_scale = 5", "speculation.sampled_tree_temperature_scale"),
    ("[speculation]\nspecinfer_temperature = 0", "speculation.specinfer_temperature"),
    ('[offload]\nsource = "nvme"', "offload.source"),
    ("[offload]\nring_size = 1", "offload.ring_size"),
    ('[model]\ndtype = "fp8"', "model.dtype"),
    ("[limits]\nmax_queue = -1", "limits.max_queue"),
    ("[server]\nport = 70000", "server.port"),
    ('[server]\nlog_level = "loud"', "server.log_level"),
    # not TOML at all
    ("[model\ntarget = 1", "config"),
]


@pytest.mark.parametrize(("body", "field_name"), BAD_FIELDS, ids=[field for _, field in BAD_FIELDS])
def test_bad_field_names_file_and_field(
    body: str, field_name: str, tmp_path: Path, no_weights: list[EngineConfig]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body + "\n")
    with pytest.raises(ConfigError) as info:
        load("--config", str(path))
    assert info.value.field == field_name
    assert str(info.value).startswith(f"{path}: {field_name}")


def test_bad_edit_of_a_real_config_names_file_and_field(tmp_path: Path, no_weights: list[EngineConfig]) -> None:
    text = (CONFIG_DIR / "llama2-70b-chat.toml").read_text()
    path = tmp_path / "edited.toml"
    path.write_text(text.replace("budget = 2048", "budget = -2048"))
    with pytest.raises(ConfigError, match=rf"^{path}: speculation\.budget: must be an integer >= 1"):
        load("--config", str(path))
