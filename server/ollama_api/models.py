"""The served model as the Ollama API describes it: `/api/tags`, `/api/show`, `/api/ps`, `/api/version`.

Ollama names carry a tag (`name:tag`, default `latest`): each served id (`--served-model-name`, else the
model name) is listed as `id:latest` (an id that has a tag already stays as it is), and a request may
name a model with or without `:latest`. The facts come from the target checkpoint's folder, read once:
`config.json` (family, context and layer sizes, quantization) and the safetensors files (size on disk,
parameter count from their headers); a target that is not a local folder shows what the engine knows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.multimodal import language_model_config
from server.errors import APIError
from server.state import ServerState

OLLAMA_VERSION = "0.14.0"  # the Ollama release whose API this follows (clients check a minimum version)
TAG = ":latest"
NEVER_EXPIRES = "2318-01-01T00:00:00Z"  # /api/ps: the model stays loaded for the server's life (Ollama: keep_alive -1)
HEADER_BYTES_MAX = 100 * 1024 * 1024  # a safetensors header larger than this is not read


@dataclass(frozen=True)
class ModelFacts:
    family: str = "unknown"
    size: int = 0  # bytes of weights on disk
    parameter_count: int = 0
    quantization: str = "unknown"
    modified_at: str = "1970-01-01T00:00:00Z"
    digest: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the target's config.json

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "safetensors", "family": self.family, "families": [self.family],
                "parameter_size": parameter_size(self.parameter_count), "quantization_level": self.quantization}


def ollama_name(model_id: str) -> str:
    return model_id if ":" in model_id else model_id + TAG


def served_id(state: ServerState, name: str | None) -> str | None:
    """The served id a request's `model` names (None: the default one); a 404 for another model."""
    if not name:
        return None
    for model_id in state.model_names:
        if name in (model_id, ollama_name(model_id)):
            return model_id
    served = ", ".join(ollama_name(model_id) for model_id in state.model_names)
    raise APIError(404, f"model '{name}' not found: this server serves {served}", param="model",
                   code="model_not_found")


@functools.lru_cache(maxsize=4)
def model_facts(target: str) -> ModelFacts:
    folder = Path(target)
    try:
        config = language_model_config(json.loads((folder / "config.json").read_text()))  # multimodal: the text model's
        weights = sorted(folder.glob("*.safetensors"))
        size = sum(path.stat().st_size for path in weights)
        mtime = max((path.stat().st_mtime for path in weights), default=0.0)
        count = sum(_parameter_count(path) for path in weights)
    except (OSError, ValueError):
        return ModelFacts()
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + str(size).encode()).hexdigest()
    modified = datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ModelFacts(str(config.get("model_type", "unknown")), size, count, _quantization(config), modified,
                      digest, config)


def _parameter_count(path: Path) -> int:
    """Elements of every tensor a safetensors file holds (read from its header only)."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > HEADER_BYTES_MAX:
            raise ValueError(f"{path}: header too large")
        header = json.loads(f.read(header_len))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def _quantization(config: dict[str, Any]) -> str:
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        return f"{str(quant.get('quant_method', 'quantized')).upper()} {quant.get('bits', '?')}-bit"
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "unknown")
    return {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(dtype, dtype)


def parameter_size(count: int) -> str:
    """7615616512 -> '7.6B', as Ollama writes it."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def facts(state: ServerState) -> ModelFacts:
    return model_facts(state.engine_config.model.target)


def tags(state: ServerState) -> dict[str, Any]:
    info = facts(state)
    return {"models": [{"name": ollama_name(model_id), "model": ollama_name(model_id), "modified_at": info.modified_at,
                        "size": info.size, "digest": info.digest, "details": info.details()}
                       for model_id in state.model_names]}


def running(state: ServerState) -> dict[str, Any]:
    """/api/ps: the model is loaded while the server runs (on the GPU: its weights, as far as resident)."""
    info = facts(state)
    on_gpu = str(getattr(state.engine, "device", "cpu")).startswith("cuda")
    context = state.prompt.max_context if state.prompt is not None else 0
    return {"models": [{"name": ollama_name(model_id), "model": ollama_name(model_id), "size": info.size,
                        "digest": info.digest, "details": info.details(), "expires_at": NEVER_EXPIRES,
                        "size_vram": info.size if on_gpu else 0, "context_length": context}
                       for model_id in state.model_names]}


def show(state: ServerState, model_id: str) -> dict[str, Any]:
    _, prompt = state.require_ready()
    info = facts(state)
    config = info.config
    arch = info.family
    model_info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": info.parameter_count,
                                  f"{arch}.context_length": prompt.max_context}
    for key, name in (("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"),
                      ("num_attention_heads", "attention.head_count"),
                      ("num_key_value_heads", "attention.head_count_kv"),
                      ("intermediate_size", "feed_forward_length"), ("vocab_size", "vocab_size")):
        if isinstance(config.get(key), int):
            model_info[f"{arch}.{name}"] = config[key]
    capabilities = ["completion"]
    if prompt.tools.format is not None:
        capabilities.append("tools")
    if prompt.fim is not None:
        capabilities.append("insert")
    if prompt.reasoning:  # <think> blocks read apart: `think` is served (server/reasoning.py)
        capabilities.append("thinking")
    template = prompt.chat_template if isinstance(prompt.chat_template, str) else json.dumps(prompt.chat_template)
    return {"license": "", "modelfile": f"# served by specexec serve\nFROM {state.engine_config.model.target}\n",
            "parameters": _parameters(state), "template": template, "details": info.details(),
            "model_info": model_info, "capabilities": capabilities, "modified_at": info.modified_at}


def _parameters(state: ServerState) -> str:
    """The sampling defaults (from generation_config.json) and the context, in Modelfile PARAMETER lines."""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repeat_penalty"}
    lines = [f"{names[key]:<30} {value}" for key, value in state.sampling_defaults.items() if key in names]
    if state.prompt is not None:
        lines.append(f"{'num_ctx':<30} {state.prompt.max_context}")
    return "\n".join(lines)
