"""Engine configuration: frozen dataclasses validated on construction.

Every field is a key of a configs/ TOML file, and most have a CLI flag (engine.cli)
(section = dataclass: [model], [speculation], [offload], [limits], [server]).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.types import ConfigError, SpeculationMethod

Method = SpeculationMethod
# overlap: a tree grows on during its pass to this many times its budget. speculation.extension_factor auto:
# EXTENSION_FACTOR where that costs no device memory over SMALL_EXTENSION_FACTOR (an attention-only draft, whose
# KV room does not depend on it, and trees large enough that a draft forward is bounded by --max-expand rows
# either way: SpeculationConfig.extension_factor_for; docs/bench/gpu.md, runs 5 and 6), else the small one
EXTENSION_FACTOR = 8
SMALL_EXTENSION_FACTOR = 2
OffloadSource = Literal["ram", "disk"]
SELF_DRAFT = "self"  # model.draft: the target's own layers, 4-bit (engine.model.self_draft)


def require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(field_name, message)


@dataclass(frozen=True)
class ModelConfig:
    target: str = ""  # a local checkpoint folder or a Hugging Face Hub id (engine.model.hub)
    # the same, "auto": chosen from the hub cache and known shapes (engine.model.draft_auto), or "self": the
    # target with 4-bit copies of its (streamed) decoder layers, sharing the rest (engine.model.self_draft)
    draft: str = ""
    # draft "self": a 4-bit checkpoint of the target (GPTQ, AWQ, compressed-tensors; folder or hub id) whose
    # decoder layers the self-draft uses instead of copies quantized at load; "": quantized at load
    self_draft_from: str = ""
    revision: str = ""  # the target's hub revision (branch, tag or commit); "": main
    draft_revision: str = ""  # the draft's
    dtype: str = "auto"  # auto: float32 on CPU; CUDA: a bf16 checkpoint's bfloat16 on sm80+, else float16
    device: str = "auto"  # auto: cuda if available else cpu
    name: str = ""  # model id served over HTTP; default: target folder name
    threads: int = 0  # CPU threads for torch's kernels; 0: auto (engine.cli.auto_threads)
    # GPTQ checkpoints: int4 (repacked at load; torch's int4 matmul on bf16 activations, on CUDA a
    # bf16 matrix once per call of many rows: engine.model.gptq_int4), dequantize (gptqmodel's torch
    # kernel: the whole matrix per call), auto (int4 where it applies, except a target streamed from disk)
    gptq_kernel: str = "auto"

    def __post_init__(self) -> None:
        require(
            self.dtype in ("auto", "float32", "float16", "bfloat16"),
            "model.dtype",
            f"must be auto, float32, float16 or bfloat16, got {self.dtype!r}",
        )
        require(
            isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "model.device",
            f"must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        require(self.threads >= 0, "model.threads", f"must be >= 0 (0: auto), got {self.threads!r}")
        require(self.gptq_kernel in ("auto", "int4", "dequantize"), "model.gptq_kernel",
                f"must be auto, int4 or dequantize, got {self.gptq_kernel!r}")
        require(not self.self_draft_from or self.draft == SELF_DRAFT, "model.self_draft_from",
                f"needs draft = {SELF_DRAFT!r} (--draft self), got draft {self.draft!r}")


@dataclass(frozen=True)
class SpeculationConfig:
    method: Method = "specexec"
    budget: int | Literal["auto"] = 64  # draft tokens per tree (root excluded)
    max_expand: int = 128  # K: leaves expanded per draft forward
    max_children: int = 32  # w: children proposed per expanded node
    max_depth: int = 32  # depth cap == draft forward cap per step
    decay: float = 1.0  # score += log(decay) per level (reference implementation: 0.95)
    # greedy requests: tree nodes are ranked by draft log-probs at this temperature; below 1 sharpens
    # them (deeper trees). 0.5 gave the default pair 24-26% more tokens per pass than 1.0
    # (docs/bench/greedy_tree_temperature.md).
    greedy_tree_temperature: float = 0.5
    # sampled requests: nodes are ranked by draft log-probs at the request's temperature times this
    # (1: the request's own temperature; any value keeps sampling exact, it only shapes the tree)
    sampled_tree_temperature_scale: float = 1.0
    # method specexec: unseeded sampled requests at this temperature or above grow SpecInfer trees
    # (sampled chains, rejection sampling) instead; both are exact. 0.85 sits between 0.8, where
    # SpecExec trees still win or tie on both measured pairs, and 0.9, where SpecInfer's win by 0.7-1.3
    # tokens per pass (docs/bench/acceptance.md). Seeded requests keep SpecExec trees, whose text is a
    # function of (seed, position) alone. Above 2, the API's largest temperature: SpecExec trees always.
    specinfer_temperature: float = 0.85
    # the draft grows the trees on while the target scores them (in another thread; on CUDA the pass
    # and the draft on streams of their own), and what it grew under the step's outcome seeds the next
    # tree; off: draft, then target. auto: on for CUDA, off on a CPU, where the pass is compute-bound
    # and overlap measured 0.86-0.98x (docs/bench/overlap.md)
    overlap: bool | Literal["auto"] = "auto"
    # the draft's tree forwards replayed as CUDA graphs, one per shape (engine.model.draft_graphs): a small
    # draft's forward is bound by launching its kernels (docs/bench/gpu.md). on with a CPU draft: the same
    # static forward, run without capture. auto: on for CUDA, off on a CPU
    draft_graphs: bool | Literal["auto"] = "auto"
    # SpecExec trees grow on the host while the draft runs on a GPU (engine.speculation.drafter.Drafter): a
    # growth's ~90 small tensor ops a draft forward run on the host instead of each launched on the device (the
    # larger part of a four-stream draft phase with graphs: docs/bench/gpu.md). Off unless asked for until a GPU
    # run measures it; no effect with a CPU draft
    host_trees: bool = False
    # the SpecExec trees of a step's requests (no grammar) grow as one forest: each draft forward's selection,
    # inputs and add-children run once for all of them (engine.speculation.forest_growth), not once per tree;
    # off: one growth per tree (for comparison)
    forest: bool = True
    # overlap: a tree grows on during its pass to this many times the step's budget (its extension; its subtree
    # under the step's outcome seeds the next tree): a larger extension leaves fewer draft forwards before the
    # next pass (docs/bench/overlap.md, "Extension budget"). auto: EXTENSION_FACTOR where it costs no memory,
    # else SMALL_EXTENSION_FACTOR (extension_factor_for)
    extension_factor: int | Literal["auto"] = "auto"
    # overlap, several streams: in a step where other trees grow on from their seeds (a few forwards), a tree
    # without one (its full search) runs at most this many draft forwards after its catch-up before the pass,
    # so the others do not wait on it; it grows on during the pass. 0: no cap. Off until a GPU run measures
    # it (docs/bench/forest.md, "With overlap")
    fresh_forwards: int = 0

    def resolved(self, device_type: str, hybrid_draft: bool = False, max_budget: int = 0,
                 max_running: int = 1) -> SpeculationConfig:
        """This config with overlap and draft_graphs 'auto' decided for a device of `device_type`, and
        extension_factor 'auto' for the draft and trees of at most `max_budget` nodes (extension_factor_for)."""
        cuda = device_type == "cuda"
        return dataclasses.replace(self, overlap=cuda if self.overlap == "auto" else self.overlap,
                                   draft_graphs=cuda if self.draft_graphs == "auto" else self.draft_graphs,
                                   extension_factor=self.extension_factor_for(hybrid_draft, max_budget, max_running))

    def extension_factor_for(self, hybrid_draft: bool, max_budget: int, max_running: int) -> int:
        """extension_factor, 'auto' decided: EXTENSION_FACTOR where it costs no memory over SMALL_EXTENSION_FACTOR
        (memory_plan: a draft forward holds at most max_running x max_expand rows, or every running extension's
        nodes; a hybrid draft keeps linear-attention rows for (factor + 1) trees), else SMALL_EXTENSION_FACTOR."""
        if self.extension_factor != "auto":
            return self.extension_factor
        rows_bound = SMALL_EXTENSION_FACTOR * max_budget + max_running >= max_running * self.max_expand
        return EXTENSION_FACTOR if rows_bound and not hybrid_draft else SMALL_EXTENSION_FACTOR

    def extension_budget(self, budget: int) -> int:
        """Nodes a tree may grow to during its pass (overlap): extension_factor x the step's budget; 0 off."""
        assert self.overlap != "auto" and self.extension_factor != "auto", "resolve first (SpeculationConfig.resolved)"
        return self.extension_factor * budget if self.overlap else 0

    def tree_method(self, greedy: bool, temperature: float, seeded: bool) -> Method:
        """The trees a request's steps grow: `method`, except specexec's switch for hot unseeded requests."""
        if self.method == "specexec" and not greedy and not seeded and temperature >= self.specinfer_temperature:
            return "specinfer"
        if self.method == "rrs" and greedy:
            return "specexec"
        return self.method

    def describe(self) -> str:
        """One line for the server's startup log."""
        if self.method == "autoregressive":
            return "autoregressive (no draft)"
        switch = ""
        if self.method == "specexec" and self.specinfer_temperature <= 2.0:
            switch = f"; SpecInfer trees for unseeded requests at temperature >= {self.specinfer_temperature:g}"
        return f"{self.method}, budget {self.budget}{switch}"

    def __post_init__(self) -> None:
        require(
            self.method in ("specexec", "specinfer", "rrs", "autoregressive"),
            "speculation.method",
            f"must be specexec, specinfer, rrs or autoregressive, got {self.method!r}",
        )
        require(
            self.budget == "auto" or (isinstance(self.budget, int) and self.budget >= 1),
            "speculation.budget",
            f"must be an integer >= 1 or 'auto', got {self.budget!r}",
        )
        for name in ("max_expand", "max_children", "max_depth"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"speculation.{name}", f"must be >= 1, got {value!r}")
        require(0.0 < self.decay <= 1.0, "speculation.decay", f"must be in (0, 1], got {self.decay!r}")
        require(self.overlap in (True, False, "auto"), "speculation.overlap",
                f"must be on, off or auto, got {self.overlap!r}")
        require(self.draft_graphs in (True, False, "auto"), "speculation.draft_graphs",
                f"must be on, off or auto, got {self.draft_graphs!r}")
        require(self.host_trees in (True, False), "speculation.host_trees", f"must be on or off, got {self.host_trees!r}")
        require(self.forest in (True, False), "speculation.forest", f"must be on or off, got {self.forest!r}")
        require(self.extension_factor == "auto" or (isinstance(self.extension_factor, int) and self.extension_factor >= 1),
                "speculation.extension_factor", f"must be an integer >= 1 or 'auto', got {self.extension_factor!r}")
        require(isinstance(self.fresh_forwards, int) and self.fresh_forwards >= 0, "speculation.fresh_forwards",
                f"must be an integer >= 0 (0: no cap), got {self.fresh_forwards!r}")
        require(
            isinstance(self.greedy_tree_temperature, int | float) and 0.0 < self.greedy_tree_temperature <= 2.0,
            "speculation.greedy_tree_temperature",
            f"must be in (0, 2], got {self.greedy_tree_temperature!r}",
        )
        require(
            isinstance(self.sampled_tree_temperature_scale, int | float)
            and 0.0 < self.sampled_tree_temperature_scale <= 4.0,
            "speculation.sampled_tree_temperature_scale",
            f"must be in (0, 4], got {self.sampled_tree_temperature_scale!r}",
        )
        require(
            isinstance(self.specinfer_temperature, int | float) and self.specinfer_temperature > 0.0,
            "speculation.specinfer_temperature",
            f"must be > 0, got {self.specinfer_temperature!r}",
        )


@dataclass(frozen=True)
class OffloadConfig:
    enabled: bool = False
    source: OffloadSource = "ram"
    resident_layers: int | None = None  # None: as many as gpu_memory allows (0 without a budget)
    gpu_memory: float | None = None  # GB of device memory for the target's layers
    ring_size: int = 2  # device buffers in the streaming ring
    evict_page_cache: bool = True  # disk source: drop pages after each read (emulates model > RAM)

    def __post_init__(self) -> None:
        require(self.source in ("ram", "disk"), "offload.source", f"must be ram or disk, got {self.source!r}")
        require(
            self.resident_layers is None or self.resident_layers >= 0,
            "offload.resident_layers",
            f"must be >= 0, got {self.resident_layers!r}",
        )
        require(self.gpu_memory is None or self.gpu_memory > 0, "offload.gpu_memory", "must be > 0")
        require(self.ring_size >= 2, "offload.ring_size", f"must be >= 2, got {self.ring_size!r}")


@dataclass(frozen=True)
class LimitsConfig:
    max_context: int | None = None  # None: the target's max_position_embeddings, capped at 8192
    # a max_context beyond the target's trained positions is refused unless this is set: rotary
    # position embeddings past the trained range degrade the output
    allow_long_context: bool = False
    max_queue: int = 16  # waiting requests beyond the running ones; more get 429
    default_max_tokens: int = 256
    # requests whose trees share one target pass; fewer when their KV caches do not fit (logged)
    max_running: int = 4
    # KV slots kept beyond the running ones for the prefix cache (finished requests' prompt + answer,
    # LRU); fewer when they do not fit; 0 turns prefix reuse off
    prefix_cache_slots: int = 4
    # prompt tokens a joining request writes per target pass while others decode (its prompt fills in
    # slices across steps); 0: auto, the most that keeps the pass within twice its cost (engine.pass_times)
    prefill_slice: int = 0

    def __post_init__(self) -> None:
        require(self.max_context is None or self.max_context >= 2, "limits.max_context", "must be >= 2")
        require(self.max_queue >= 0, "limits.max_queue", f"must be >= 0, got {self.max_queue!r}")
        require(self.default_max_tokens >= 1, "limits.default_max_tokens", "must be >= 1")
        require(self.max_running >= 1, "limits.max_running", f"must be >= 1, got {self.max_running!r}")
        require(self.prefix_cache_slots >= 0, "limits.prefix_cache_slots",
                f"must be >= 0, got {self.prefix_cache_slots!r}")
        require(self.prefill_slice >= 0, "limits.prefill_slice", f"must be >= 0 (0: auto), got {self.prefill_slice!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def replace(self, section: str, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **changes)})


def _fits(value: object, hint: object) -> bool:
    """Whether a TOML or flag value has a field's type (a bool is no int; an int is a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in args)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is tuple:  # tuple[X, ...]: TOML gives a list
        return isinstance(value, (tuple, list)) and all(_fits(item, args[0]) for item in value)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def describe_type(hint: object) -> str:
    """A field's type in words, as a config file or a flag spells its values ("one of 'ram', 'disk'",
    "an integer or 'auto'"), never a Python name ("must be Method")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        shown = [repr(arg) for arg in args]
        return shown[0] if len(shown) == 1 else f"one of {', '.join(shown[:-1])} or {shown[-1]}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arg) for arg in args if arg is not type(None))
    if origin is tuple:
        return f"a list of {describe_type(args[0]).removeprefix('a ').removeprefix('an ')}s"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))  # type: ignore[call-overload]


def build_section(cls: type, values: dict, section: str, source: str | None = None,
                  flags: dict[str, str] | None = None):
    """Construct dataclass `cls` from a dict, with errors naming the file and the field; a value that came
    from a command-line flag (`flags`: field -> flag) is named by its flag instead."""
    flags = flags or {}

    def error(key: str, message: str) -> ConfigError:
        if key in flags:
            return ConfigError(flags[key], message)
        return ConfigError(f"{section}.{key}", message, source)

    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in names:
            raise error(key, f"unknown field (known: {', '.join(sorted(names))})")
        if not _fits(value, hints[key]):
            raise error(key, f"must be {describe_type(hints[key])}, got {value!r}")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise error(exc.field.split(".", 1)[-1], str(exc).split(": ", 1)[-1]) from None
    except TypeError as exc:
        raise ConfigError(section, str(exc), source) from None


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "speculation": SpeculationConfig,
    "offload": OffloadConfig,
    "limits": LimitsConfig,
}


def read_config_file(path: str) -> dict[str, dict]:
    """A configs/ TOML file: {section: {field: value}}. Errors name the file."""
    import tomllib

    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError("config", "file not found", path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"invalid TOML: {exc}", path) from None
    for section, values in data.items():
        if section not in (*SECTIONS, "server") or not isinstance(values, dict):
            raise ConfigError(section, f"unknown section (known: {', '.join([*SECTIONS, 'server'])})", path)
    resolve_relative_paths(data, Path(path).resolve().parent)
    return data


PATH_FIELDS = {"model": ("target", "draft", "self_draft_from"), "server": ("chat_template",)}


def resolve_relative_paths(data: dict[str, dict], config_dir: Path) -> None:
    """A relative path in a config file means next to the file if it exists there, else the current dir.

    A hub-id-shaped value (`org/name`) stays as it is unless a folder of that name is next to the file:
    a folder of that name in the current dir, else the hub id (engine.model.hub)."""
    for section, names in PATH_FIELDS.items():
        values = data.get(section, {})
        for name in names:
            value = values.get(name)
            if not isinstance(value, str) or not value:
                continue  # wrong types are reported by build_section, naming the field
            path = Path(value).expanduser()
            if not path.is_absolute():
                beside = Path(os.path.normpath(config_dir / path))
                path = beside if beside.exists() else path
            values[name] = str(path)


def engine_config_from(
    sections: dict[str, dict], overrides: dict[str, dict] | None = None, source: str | None = None,
    flags: dict[str, dict[str, str]] | None = None,
) -> EngineConfig:
    """Build EngineConfig from file sections, then explicit overrides (CLI flags) on top. flags: section ->
    field -> the flag that gave an override (errors name the flag)."""
    built = {}
    for name, cls in SECTIONS.items():
        values = dict(sections.get(name, {}))
        values.update((overrides or {}).get(name, {}))
        built[name] = build_section(cls, values, name, source, (flags or {}).get(name))
    return EngineConfig(**built)
