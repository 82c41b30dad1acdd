"""Multimodal checkpoints whose language model the engine runs alone.

Gemma 3 (4B-27B), Mistral Small 3.1/3.2 and Ministral 3, and every Qwen3.5 are published as image-text
models: a vision tower and a projector beside a text decoder of a family the engine runs. The engine
runs the text decoder as its causal LM (what AutoModelForCausalLM builds from the checkpoint's
text_config) and never loads the vision tower, as llama.cpp and vLLM do for text-only serving.

Their tensors sit under one of two prefixes: `model.language_model.*` (transformers 5 layout) or
`language_model.model.*` with the head at `language_model.lm_head.*` (the layout of the first Gemma 3
and Mistral 3 releases, which transformers still writes for them). Names here are the causal LM's
(`model.layers.3.mlp.up_proj.weight`, `lm_head.weight`); `checkpoint_names` lists where each may be stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported where used: the server imports this module at start
    from transformers import PretrainedConfig

# config.json architecture -> its text model's model_type when text_config does not name one
LANGUAGE_MODEL_OF = {
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Mistral3ForConditionalGeneration": "mistral",  # Mistral Small 3.x; Ministral 3's text_config says ministral3
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
}
# from_pretrained's key_mapping (regex -> replacement) reading the text decoder of either layout
KEY_MAPPING = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}
DECODER_PREFIXES = ("model.language_model.", "language_model.model.")  # where the text decoder's tensors live
NOT_LOADED_PREFIXES = ("model.visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                       "multi_modal_projector.")  # vision towers and projectors


def is_multimodal(config: dict) -> bool:
    """config.json of a multimodal checkpoint the engine runs as its language model."""
    return isinstance(config.get("text_config"), dict) and any(
        arch in LANGUAGE_MODEL_OF for arch in config.get("architectures") or [])


def language_model_config(config: dict) -> dict:
    """The config.json fields of the model the engine runs: for a multimodal checkpoint (is_multimodal), its
    text_config under the causal LM's architecture name, with the checkpoint's dtype and quantization where
    the text config has none, and the checkpoint's tying (the composite model ties or not, whatever its
    text_config says); any other config as it is."""
    if not is_multimodal(config):
        return config
    fields = dict(config["text_config"])
    arch = next(arch for arch in config["architectures"] if arch in LANGUAGE_MODEL_OF)
    fields.setdefault("model_type", LANGUAGE_MODEL_OF[arch])
    for key in ("dtype", "torch_dtype", "quantization_config"):
        if key in config and key not in fields:
            fields[key] = config[key]
    if "tie_word_embeddings" in config:
        fields["tie_word_embeddings"] = config["tie_word_embeddings"]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(fields["model_type"])
    fields["architectures"] = [causal_lm or f"{arch} with a {fields['model_type']} language model"]
    return fields


def hf_config(folder: str | Path) -> PretrainedConfig:
    """transformers' config of the model the engine runs from the checkpoint in `folder` (for a multimodal
    checkpoint: its text model's config, as language_model_config reads it)."""
    from transformers import AutoConfig

    raw = json.loads((Path(folder) / "config.json").read_text())
    if not is_multimodal(raw):
        return AutoConfig.from_pretrained(folder)
    fields = language_model_config(raw)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def checkpoint_names(name: str) -> list[str]:
    """Names a causal LM's tensor may have in a checkpoint: its own, without the base model's prefix, or under
    a multimodal checkpoint's language model (either layout)."""
    if name.startswith("lm_head."):
        return [name, "language_model." + name]
    if not name.startswith("model."):
        return [name]
    inner = name.removeprefix("model.")
    return [name, inner, *(prefix + inner for prefix in DECODER_PREFIXES)]


def model_name(stored: str) -> str:
    """The causal LM's name of a tensor or module stored under `stored` (checkpoint_names' inverse)."""
    for prefix in DECODER_PREFIXES:
        if stored.startswith(prefix):
            return "model." + stored.removeprefix(prefix)
    return stored.removeprefix("language_model.") if stored.startswith("language_model.lm_head") else stored


def decoder_prefix(names) -> str:
    """Where the decoder layers' tensors live among the checkpoint's tensor `names`: `model.`, or a
    multimodal checkpoint's language model prefix."""
    for prefix in DECODER_PREFIXES:
        if any(name.startswith(prefix + "layers.") for name in names):
            return prefix
    return "model."


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a multimodal checkpoint keeps in its processor's chat_template.json (the tokenizer
    does not read that file), or None."""
    try:
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None
