"""Engine command-line flags: each maps 1:1 to a config field (configs/ TOML section.field)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig, engine_config_from, read_config_file
from engine.types import ConfigError

DEFAULT_MODELS = Path(__file__).resolve().parents[1] / "models" / "default"
DEFAULT_MODEL_NAME = "specexec-default"

# flag -> (section, field, type)
ENGINE_FLAGS: dict[str, tuple[str, str, type]] = {
    "--target": ("model", "target", str),
    "--draft": ("model", "draft", str),
    "--dtype": ("model", "dtype", str),
    "--device": ("model", "device", str),
    "--method": ("speculation", "method", str),
    "--budget": ("speculation", "budget", str),
    "--max-expand": ("speculation", "max_expand", int),
    "--max-children": ("speculation", "max_children", int),
    "--max-depth": ("speculation", "max_depth", int),
    "--decay": ("speculation", "decay", float),
    "--greedy-tree-temperature": ("speculation", "greedy_tree_temperature", float),
    "--sampled-tree-temperature-scale": ("speculation", "sampled_tree_temperature_scale", float),
    "--specinfer-temperature": ("speculation", "specinfer_temperature", float),
    "--offload-source": ("offload", "source", str),
    "--resident-layers": ("offload", "resident_layers", int),
    "--gpu-memory": ("offload", "gpu_memory", float),
    "--ring-size": ("offload", "ring_size", int),
    "--max-context": ("limits", "max_context", int),
    "--max-queue": ("limits", "max_queue", int),
    "--max-running": ("limits", "max_running", int),
    "--prefix-cache-slots": ("limits", "prefix_cache_slots", int),
}


class CliError(Exception):
    pass


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a configs/ TOML file; flags given on the command line override it")
    for flag, (section, field, kind) in ENGINE_FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, help=f"[{section}] {field}")
    parser.add_argument("--offload", action="store_true", default=None, help="[offload] enabled: stream target layers")
    parser.add_argument(
        "--allow-long-context", action="store_true", default=None,
        help="[limits] allow_long_context: accept a --max-context beyond the target's trained positions",
    )


def parse_budget(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise ConfigError("speculation.budget", f"must be an integer >= 1 or 'auto', got {value!r}") from None


def engine_config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, dict]:
    """EngineConfig from --config and flags; also returns the file's [server] section."""
    sections = read_config_file(args.config) if args.config else {}
    overrides: dict[str, dict] = {}
    for flag, (section, field, _kind) in ENGINE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.setdefault(section, {})[field] = parse_budget(value) if field == "budget" else value
    if args.offload:
        overrides.setdefault("offload", {})["enabled"] = True
    if args.allow_long_context:
        overrides.setdefault("limits", {})["allow_long_context"] = True
    model = {**sections.get("model", {}), **overrides.get("model", {})}
    if not model.get("target"):
        overrides.setdefault("model", {}).update(
            target=str(DEFAULT_MODELS / "target"), draft=model.get("draft") or str(DEFAULT_MODELS / "draft")
        )
        if not model.get("name"):
            overrides["model"]["name"] = DEFAULT_MODEL_NAME
    config = engine_config_from(sections, overrides, args.config)
    check_paths(config)
    return config, sections.get("server", {})


def check_paths(config: EngineConfig) -> None:
    for role in ("target", "draft"):
        path = getattr(config.model, role)
        if path and not Path(path).is_dir():
            if role == "draft" and config.speculation.method == "autoregressive":
                continue
            raise CliError(
                f"--{role} {path}: no such model folder. The server never downloads weights: fetch them first "
                f"(e.g. `hf download <repo id> --local-dir <folder>`) and point --{role} or model.{role} at the folder"
            )


def comma_list(kind: type) -> Callable[[str], list]:
    """An argparse type: "1,2,3" -> [kind("1"), kind("2"), kind("3")]."""
    return lambda text: [kind(v) for v in text.split(",") if v]
