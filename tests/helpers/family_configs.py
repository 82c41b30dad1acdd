"""Tiny configs of every model family the engine runs, built with transformers' own config classes.

Each family's fields are set as its checkpoints on the Hugging Face Hub set them (sliding windows and
their per-layer pattern, q/k norms, partial rotary, NoPE layers, multipliers, sinks, MoE routing), at
toy sizes; sliding windows are WINDOW tokens, shorter than the tests' sequences, so they bind.
`tiny_config(family, vocab_size, ...)` (tests.helpers.tiny_models) dispatches here.
"""

from __future__ import annotations

from transformers import (
    Cohere2Config,
    Gemma3TextConfig,
    Glm4Config,
    Glm4MoeConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
)
from transformers.models.ministral3.configuration_ministral3 import Ministral3Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

WINDOW = 5  # sliding window of the families that have one: shorter than every test sequence

# the families of the README's "supported models", in its order
FAMILIES = (
    "llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "gemma3", "phi3", "gpt_oss", "glm4",
    "olmo2", "granite", "cohere2", "smollm3", "ministral", "ministral3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
    "glm4_moe",
)
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text")  # Gated DeltaNet layers between attention layers
# Gated DeltaNet state at toy sizes, grouped as the hub's (Qwen3-Next: 16 key heads serve 32 value heads);
# the convolution window (4, as every checkpoint) is shorter than the tests' paths, so it binds
LINEAR_FIELDS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4)


def alternating(num_layers: int, pattern: int) -> list[str]:
    """Hub layer pattern: `pattern - 1` sliding layers, then one full one (the last layer is full when
    there are fewer layers than the pattern, so both kinds run in a 2-layer model)."""
    kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return kinds


def hybrid(num_layers: int, interval: int = 4) -> list[str]:
    """Hub layer pattern of the Gated DeltaNet hybrids: `interval - 1` linear layers, then a full one; both
    kinds present in any model of 2 layers or more (the last is full, the first linear)."""
    kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    kinds[-1] = "full_attention"
    kinds[0] = "linear_attention" if num_layers > 1 else kinds[0]
    return kinds


def family_config(family: str, common: dict) -> PretrainedConfig:
    """`common`: vocab, sizes, heads, special ids (tiny_models.tiny_config). Head dims are set as the hub
    sets them where a family decouples head_dim from hidden / heads."""
    hidden, layers = common["hidden_size"], common["num_hidden_layers"]
    head_dim = hidden // common["num_attention_heads"]
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=4096)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3":  # q/k norms; head_dim set apart from hidden / heads (Qwen3-32B: 128 at 5120 / 64)
        return Qwen3Config(**common, head_dim=2 * head_dim, use_sliding_window=False, attention_bias=False)
    if family == "qwen3_moe":  # routed experts, top-k renormalised (Qwen3-30B-A3B)
        return Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=hidden, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[], use_sliding_window=False)
    if family == "gemma3":  # scaled embeddings, sandwich norms, local/global rotary, 5:1 sliding pattern
        return Gemma3TextConfig(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=WINDOW,
            layer_types=alternating(layers, 6), hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            final_logit_softcapping=30.0,  # Gemma 2's value (Gemma 3 ships none): the soft-capping path runs
        )
    if family == "phi3":  # fused qkv and gate/up projections, partial rotary (Phi-4-mini: 0.75), window
        return Phi3Config(**common, sliding_window=WINDOW, partial_rotary_factor=0.75)
    if family == "gpt_oss":  # attention sinks, biases, alternating windows, yarn rotary, clamped SwiGLU experts
        return GptOssConfig(
            **common, head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            layer_types=alternating(layers, 2), attention_bias=True,
            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150_000.0},
        )
    if family == "glm4":  # sandwich norms, fused gate/up, partial rotary 0.5, qkv bias
        return Glm4Config(**common, head_dim=head_dim, partial_rotary_factor=0.5, attention_bias=True)
    if family == "olmo2":  # post-norms only, q/k norms over all heads
        return Olmo2Config(**common)
    if family == "granite":  # embedding, residual, attention and logit multipliers (Granite 3.x values)
        return GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.015625, logits_scaling=8.0)
    if family == "cohere2":  # parallel attention and MLP, LayerNorm, 3:1 window pattern, NoPE full layers
        return Cohere2Config(**common, sliding_window=WINDOW, layer_types=alternating(layers, 4), logit_scale=0.25)
    if family == "smollm3":  # NoPE every 4th layer (here: the last)
        return SmolLM3Config(**common, no_rope_layers=[1] * (layers - 1) + [0], use_sliding_window=False)
    if family == "ministral":  # Ministral-8B: interleaved sliding and full layers
        return MinistralConfig(**common, head_dim=head_dim, sliding_window=WINDOW, layer_types=alternating(layers, 2))
    if family == "ministral3":  # Ministral 3's text model: yarn rotary, queries scaled by position past
        # original_max_position_embeddings (Llama 4's rule; here 8 positions, so the tests' prompts pass it)
        return Ministral3Config(**common, head_dim=head_dim, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1_000_000_000.0, "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1})
    if family == "qwen3_next":  # 3:1 Gated DeltaNet / gated attention, partial rotary 0.25, MoE with shared expert
        return Qwen3NextConfig(**common, **LINEAR_FIELDS, head_dim=2 * head_dim, layer_types=hybrid(layers),
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                               shared_expert_intermediate_size=hidden, decoder_sparse_step=1,
                               mlp_only_layers=[], norm_topk_prob=True)
    if family == "qwen3_5_text":  # Qwen3.5 dense: 3:1 Gated DeltaNet / gated attention, mrope-shaped rotary
        return Qwen3_5TextConfig(**common, **LINEAR_FIELDS, head_dim=2 * head_dim, layer_types=hybrid(layers),
                                 rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                  "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
    if family == "qwen3_5_moe_text":  # Qwen3.5-MoE: the same layers, routed experts with a shared expert
        return Qwen3_5MoeTextConfig(**common, **LINEAR_FIELDS, head_dim=2 * head_dim, layer_types=hybrid(layers),
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                                    shared_expert_intermediate_size=hidden,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
    if family == "glm4_moe":  # GLM-4.5 / 4.6 / 4.7: partial rotary 0.5, qkv bias, q/k norms (4.6+), a dense first
        # layer, then sigmoid-scored routed experts (a per-expert correction bias) with a shared expert
        return Glm4MoeConfig(**common, head_dim=head_dim, partial_rotary_factor=0.5, attention_bias=True,
                             use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                             moe_intermediate_size=hidden, first_k_dense_replace=1, n_group=1, topk_group=1,
                             norm_topk_prob=True, routed_scaling_factor=2.5)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
