"""Engine command-line flags: each maps 1:1 to a config field (configs/ TOML section.field)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from engine.config import SELF_DRAFT, EngineConfig, engine_config_from, read_config_file
from engine.model.named_models import draft_by_default, resolve_pair
from engine.types import ConfigError

DEFAULT_MODELS = Path(__file__).resolve().parents[1] / "models" / "default"
DEFAULT_MODEL_NAME = "specexec-default"

# flag -> (section, field, type: a callable, "on_off" or "int_or_auto", help); the help's default is read from the
# config dataclass
ENGINE_FLAGS: dict[str, tuple[str, str, type | str, str]] = {
    "--target": ("model", "target", str, "target model: a local Hugging Face checkpoint folder or a Hub id (org/name: "
                 "from the hub cache, else downloaded) (default: the built-in pair)"),
    "--draft": ("model", "draft", str, "draft model: a folder, a Hub id, auto (a cached or known model with the "
                "target's token ids that fits beside it; the default for a target given by id), or self (the target "
                "with 4-bit copies of its streamed layers, sharing the rest); must share the target's token ids "
                "(default: the built-in pair)"),
    "--self-draft-from": ("model", "self_draft_from", str, "--draft self: a 4-bit checkpoint (GPTQ, AWQ, "
                          "compressed-tensors) of the target, folder or Hub id, whose layers the draft uses instead "
                          "of copies quantized at load"),
    "--revision": ("model", "revision", str, "the target's Hub revision: a branch, tag or commit (default: main)"),
    "--draft-revision": ("model", "draft_revision", str, "the draft's Hub revision (default: main)"),
    "--dtype": ("model", "dtype", str, "auto (fp32 on CPU; on CUDA bf16 for a bf16 checkpoint on sm80+, else fp16), "
                "float32, float16 or bfloat16"),
    "--device": ("model", "device", str, "auto (cuda if available), cpu or cuda[:N]"),
    "--threads": ("model", "threads", int, "CPU threads for torch's kernels; 0: auto (the usable cores less one, "
                  "at least 1, at most 16; on CUDA: 1)"),
    "--gptq-kernel": ("model", "gptq_kernel", str, "GPTQ checkpoints: int4 (repacked at load; torch's int4 matmul, "
                      "on CUDA a bf16 matrix once per call of many rows), dequantize (gptqmodel's torch kernel, "
                      "the whole matrix per call) or auto (int4 where it applies, unless the target streams from disk)"),
    "--method": ("speculation", "method", str, "specexec, specinfer, rrs or autoregressive (no draft)"),
    "--budget": ("speculation", "budget", "int_or_auto", "draft tokens per tree, or auto (measured at startup and from traffic)"),
    "--max-expand": ("speculation", "max_expand", int, "K: leaves expanded per draft forward"),
    "--max-children": ("speculation", "max_children", int, "w: children proposed per expanded node"),
    "--max-depth": ("speculation", "max_depth", int, "deepest tree node (= draft forwards per step)"),
    "--decay": ("speculation", "decay", float, "tree scores add log(decay) per level, in (0, 1]"),
    "--greedy-tree-temperature": ("speculation", "greedy_tree_temperature", float,
                                  "greedy requests: temperature of the draft scores that rank tree nodes"),
    "--sampled-tree-temperature-scale": ("speculation", "sampled_tree_temperature_scale", float,
                                         "sampled requests: tree nodes ranked at the request's temperature times this"),
    "--specinfer-temperature": ("speculation", "specinfer_temperature", float,
                                "method specexec: unseeded requests at this temperature or above grow SpecInfer trees"),
    "--overlap": ("speculation", "overlap", "on_off", "on: the draft grows trees while the target scores them "
                  "(and seeds the next tree); off: draft, then target; auto (default): on for CUDA, off on a CPU"),
    "--draft-graphs": ("speculation", "draft_graphs", "on_off", "on: the draft's tree forwards replayed as CUDA graphs "
                       "(one launch for a forward's ~1,000 kernels); auto (default): on for CUDA, off on a CPU"),
    "--host-trees": ("speculation", "host_trees", "on_off", "on: SpecExec trees grow on the host while the draft "
                     "runs on a GPU (fewer device launches a draft forward); off (default)"),
    "--forest": ("speculation", "forest", "on_off", "on (default): the SpecExec trees of a step's requests grow as "
                 "one forest (one set of small ops a draft forward for all); off: one growth per tree"),
    "--fresh-forwards": ("speculation", "fresh_forwards", int, "overlap: a tree without a seed runs at most this "
                         "many draft forwards before a pass whose other trees have seeds; 0 (default): no cap"),
    "--extension-factor": ("speculation", "extension_factor", "int_or_auto", "overlap: a tree grows on during its pass "
                           "to this many times the budget (its subtree seeds the next tree); auto (default): 8 where "
                           "that costs no device memory over 2, else 2"),
    "--offload-source": ("offload", "source", str, "where streamed layers come from: ram or disk (safetensors files)"),
    "--resident-layers": ("offload", "resident_layers", int,
                          "target layers kept on the device (default: as many as --gpu-memory allows)"),
    "--gpu-memory": ("offload", "gpu_memory", float, "GB of device memory for resident target layers"),
    "--ring-size": ("offload", "ring_size", int, "device buffers in the streaming ring (>= 2)"),
    "--max-context": ("limits", "max_context", int,
                      "prompt + completion tokens (default: the target's trained positions, capped at 8192)"),
    "--max-queue": ("limits", "max_queue", int, "waiting requests beyond the running ones; more get 429"),
    "--max-running": ("limits", "max_running", int, "requests whose trees share one target pass"),
    "--prefix-cache-slots": ("limits", "prefix_cache_slots", int,
                             "KV slots kept for the prefix cache beyond the running ones; 0: no reuse"),
    "--prefill-slice": ("limits", "prefill_slice", int,
                        "prompt tokens a joining request writes per pass while others decode; 0: auto "
                        "(keeps a pass within twice its cost)"),
}
CHOICES = {"--dtype": ("auto", "float32", "float16", "bfloat16"), "--method": ("specexec", "specinfer", "rrs", "autoregressive"),
           "--offload-source": ("ram", "disk"), "--overlap": ("auto", "on", "off"),
           "--draft-graphs": ("auto", "on", "off"), "--host-trees": ("on", "off"), "--forest": ("on", "off"),
           "--gptq-kernel": ("auto", "int4", "dequantize")}


def on_off(text: str) -> bool | str:
    """'on' / 'off' -> True / False, 'auto' kept; anything else is kept for the config to refuse, naming the field."""
    return {"on": True, "off": False, "auto": "auto"}.get(text.lower(), text)


class CliError(Exception):
    pass


def field_default(section: str, field: str) -> object:
    from engine.config import SECTIONS

    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == field:
            return f.default
    raise KeyError(f"{section}.{field}")


def flag_help(flag: str) -> str:
    """'meaning [section] field, default X' for an engine flag."""
    section, field, _kind, meaning = ENGINE_FLAGS[flag]
    default = field_default(section, field)
    default = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
    shown = "" if default in (None, "") or "default" in meaning else f"; default {default}"
    return f"{meaning}{shown} [{section}] {field}"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (each flag is a key of a configs/ TOML file, [section] field)")
    group.add_argument("--config", help="a configs/ TOML file; flags given on the command line override it")
    for flag, (_section, _field, kind, _meaning) in ENGINE_FLAGS.items():
        choices = CHOICES.get(flag)  # shown, checked by the config (one error line naming the field)
        metavar = "{" + ",".join(choices) + "}" if choices else None
        convert = {"on_off": on_off, "int_or_auto": str}.get(kind, kind)  # int_or_auto: parsed after, naming the flag
        group.add_argument(flag, type=convert, default=None, metavar=metavar, help=flag_help(flag))
    group.add_argument("--offload", action="store_true", default=None,
                       help="stream the target's layers from RAM or disk (default off) [offload] enabled")
    group.add_argument(
        "--allow-long-context", action="store_true", default=None,
        help="accept a --max-context beyond the target's trained positions (default off) [limits] allow_long_context",
    )


def auto_threads(device: str) -> int:
    """CPU threads for torch when model.threads is 0: the usable cores less one (the server's event loop,
    tokenizer and other processes need one; oversubscribed torch threads spin and stall), at least 1 and
    at most 16; 1 on CUDA, where the host only launches kernels."""
    if device.startswith("cuda"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(16, cores - 1))


def apply_threads(config: EngineConfig) -> int:
    """Set torch's intra-op threads from model.threads (0: auto_threads); returns the number."""
    import torch

    device = config.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = config.model.threads or auto_threads(device)
    torch.set_num_threads(threads)
    return threads


def parse_int_or_auto(flag: str, value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise ConfigError(flag, f"must be an integer >= 1 or 'auto', got {value!r}") from None


def engine_config_from_args(args: argparse.Namespace, require_folders: bool = True) -> tuple[EngineConfig, dict]:
    """EngineConfig from --config and flags; also returns the file's [server] section. require_folders:
    the model folders must exist (`specexec plan` needs only their shapes)."""
    sections = read_config_file(args.config) if args.config else {}
    overrides: dict[str, dict] = {}
    flags: dict[str, dict[str, str]] = {}  # section -> field -> the flag that set it (errors name it)
    for flag, (section, field, kind, _meaning) in ENGINE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.setdefault(section, {})[field] = parse_int_or_auto(flag, value) if kind == "int_or_auto" else value
            flags.setdefault(section, {})[field] = flag
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
    else:
        method = {**sections.get("speculation", {}), **overrides.get("speculation", {})}.get("method", "specexec")
        draft = draft_by_default(model["target"], model.get("draft", ""), method)
        if draft != model.get("draft", ""):
            overrides.setdefault("model", {})["draft"] = draft
    config = engine_config_from(sections, overrides, args.config, flags)
    if require_folders:
        config = resolve_models(config)
    return config, sections.get("server", {})


def resolve_models(config: EngineConfig) -> EngineConfig:
    """The config with its models as local folders: hub ids from the cache or downloaded (progress on
    stderr), a draft "auto" chosen (engine.model.named_models); CheckpointError: one line, what to do."""
    return resolve_pair(config)


def check_paths(config: EngineConfig) -> None:
    for role in ("target", "draft", "self_draft_from"):
        path = getattr(config.model, role)
        if role == "draft" and path == SELF_DRAFT:
            continue
        if path and not Path(path).is_dir():
            if role == "draft" and config.speculation.method == "autoregressive":
                continue
            flag = "--" + role.replace("_", "-")
            raise CliError(
                f"{flag} {path}: no such model folder. The server never downloads weights: fetch them first "
                f"(e.g. `hf download <repo id> --local-dir <folder>`) and point {flag} or model.{role} at the folder"
            )


def comma_list(kind: type) -> Callable[[str], list]:
    """An argparse type: "1,2,3" -> [kind("1"), kind("2"), kind("3")]."""
    return lambda text: [kind(v) for v in text.split(",") if v]
