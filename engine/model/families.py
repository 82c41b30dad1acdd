"""The model families the engine runs, and the few model-level facts that are not in a module.

Every decoder layer runs its own transformers code (engine.model.runner); what a family adds above
the layers lives in transformers' CausalLM/Model `forward`, not in a module the engine can call, so it
is listed here by the config field that holds it:
- embeddings multiplied by a config value (Granite's `embedding_multiplier`; Gemma 3 scales inside its
  embedding module, so it needs nothing here);
- logits divided (Granite's `logits_scaling`), multiplied (Cohere2's `logit_scale`) or soft-capped
  (Gemma's `final_logit_softcapping`) after the head.
Families transformers ships that the engine cannot run yet are refused with the reason (REFUSED).
Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) run their linear-attention layers through
engine.model.linear_attention. Multimodal checkpoints of these families (Gemma 3, Mistral 3, Qwen3.5) run
as their language model (engine.multimodal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Family:
    name: str  # as the README lists it
    architectures: tuple[str, ...]  # config.json `architectures` entries
    embedding_multiplier: str | None = None  # config field: embeddings x value
    logits_divisor: str | None = None  # config field: logits / value
    logits_multiplier: str | None = None  # config field: logits x value
    logits_softcap: str | None = None  # config field: logits = cap * tanh(logits / cap) when set
    eager_attention: bool = False  # its attention has sinks: attend_eager, score blocks in memory (the plan counts them)
    linear_attention: bool = False  # Gated DeltaNet layers between its attention layers (engine.model.linear_attention)


FAMILIES = (
    Family("Llama", ("LlamaForCausalLM",)),
    Family("Mistral", ("MistralForCausalLM",)),
    Family("Qwen2", ("Qwen2ForCausalLM",)),
    Family("Mixtral", ("MixtralForCausalLM",)),
    Family("Qwen3", ("Qwen3ForCausalLM",)),
    Family("Qwen3-MoE", ("Qwen3MoeForCausalLM",)),
    Family("Gemma 3 (text)", ("Gemma3ForCausalLM",), logits_softcap="final_logit_softcapping"),
    Family("Phi-3 / Phi-4", ("Phi3ForCausalLM",)),
    Family("GPT-OSS", ("GptOssForCausalLM",), eager_attention=True),
    Family("GLM-4", ("Glm4ForCausalLM",)),
    Family("GLM-4.5 (MoE)", ("Glm4MoeForCausalLM",)),
    Family("OLMo 2", ("Olmo2ForCausalLM",)),
    Family("Granite", ("GraniteForCausalLM",), embedding_multiplier="embedding_multiplier",
           logits_divisor="logits_scaling"),
    Family("Cohere2", ("Cohere2ForCausalLM",), logits_multiplier="logit_scale"),
    Family("SmolLM3", ("SmolLM3ForCausalLM",)),
    Family("Ministral", ("MinistralForCausalLM",)),
    Family("Ministral 3", ("Ministral3ForCausalLM",)),
    Family("Qwen3-Next", ("Qwen3NextForCausalLM",), linear_attention=True),
    Family("Qwen3.5 (text)", ("Qwen3_5ForCausalLM",), linear_attention=True),
    Family("Qwen3.5-MoE (text)", ("Qwen3_5MoeForCausalLM",), linear_attention=True),
)
BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
SUPPORTED_ARCHS = tuple(BY_ARCHITECTURE)

LINEAR_ATTENTION = ("linear-attention hybrid whose recurrent layers the engine does not run (it runs Gated DeltaNet "
                    "hybrids: Qwen3-Next, Qwen3.5)")
MLA = "model with multi-head latent attention (compressed keys and values, which the engine's KV cache does not hold)"
MULTIMODAL = "multimodal checkpoint (the engine runs text-only causal LMs: use a text-only checkpoint of its language model)"
REFUSED = {  # config.json architecture -> why it cannot run here
    **dict.fromkeys(("GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM",
                     "JambaForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM", "Lfm2ForCausalLM",
                     "Lfm2MoeForCausalLM", "MiniMaxForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM",
                     "RecurrentGemmaForCausalLM", "Zamba2ForCausalLM", "KimiLinearForCausalLM"), LINEAR_ATTENTION),
    **dict.fromkeys(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                     "Glm4MoeLiteForCausalLM", "LongcatFlashForCausalLM"), MLA),
    **dict.fromkeys(("Gemma3nForConditionalGeneration", "LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                     "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                     "Qwen3VLMoeForConditionalGeneration", "Llama4ForConditionalGeneration",
                     "Glm4vForConditionalGeneration", "Idefics3ForConditionalGeneration"), MULTIMODAL),
}


def supported_names() -> str:
    return ", ".join(family.name for family in FAMILIES)


def refusal(architectures: list[str]) -> str | None:
    """None when one of `architectures` runs here; else one line: why not, and which families run."""
    if any(arch in BY_ARCHITECTURE for arch in architectures):
        return None
    reasons = [f"{arch} is a {REFUSED[arch]}" for arch in architectures if arch in REFUSED]
    why = "; ".join(reasons) if reasons else f"architecture {architectures} is not supported"
    return f"{why}; the engine runs these families: {supported_names()}"


def family_of(model: torch.nn.Module) -> Family:
    arch = type(model).__name__
    if arch not in BY_ARCHITECTURE:
        raise ValueError(refusal([arch]))
    return BY_ARCHITECTURE[arch]


def config_value(config, field: str | None) -> float | None:
    """The config's value of `field` (None: no field named, or the config leaves it unset)."""
    return None if field is None else getattr(config, field, None)


def scale_embeddings(family: Family, config, embeds: torch.Tensor) -> torch.Tensor:
    """[..., hidden] token embeddings as the model's forward scales them before the first layer."""
    multiplier = config_value(config, family.embedding_multiplier)
    return embeds if multiplier is None else embeds * multiplier


def scale_logits(family: Family, config, logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] head output (model dtype) as the CausalLM's forward scales it, in its order."""
    divisor = config_value(config, family.logits_divisor)
    multiplier = config_value(config, family.logits_multiplier)
    cap = config_value(config, family.logits_softcap)
    if divisor is not None:
        logits = logits / divisor
    if multiplier is not None:
        logits = logits * multiplier
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def layer_windows(config, layers: list[torch.nn.Module]) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as its attention module passes it to the
    attention function: the module's own `sliding_window` where it keeps one (per layer type), else the
    config's (Mistral, Mixtral and Phi-3 pass config.sliding_window from every layer)."""
    windows = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:  # a linear-attention layer (no KV, no mask)
            windows.append(None)
            continue
        windows.append(attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None))
    return windows
