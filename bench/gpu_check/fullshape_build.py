"""The full-shape section's pair, built in memory on the device (no checkpoint on disk, no gptqmodel):

- target: Llama-3-70B's shape, every decoder projection a 4-bit `Int4Linear` (group 128) whose values
  are drawn on the device and packed there by torch's converter (engine.model.gptq_int4.pack_for);
  every layer streams from pinned RAM (the offload store), embeddings, final norm and head resident;
- draft: Llama-3.2-1B's shape in the compute dtype, resident.

The pair is aligned by construction, so its acceptance is that of a draft that agrees with its target:
every layer's output projections (o_proj, down_proj) are zero in both models (their int4 scales, the
draft's weights), so each model's logits are a fixed function of the last token, head(norm(embed(x)));
the target's embedding and head are the draft's mapped through P [draft hidden, hidden] with
orthonormal rows, so the target's logits are exactly sqrt(hidden / draft hidden) times the draft's
(same argmax, sharper). Every layer still does all of its work (attention over the KV cache, the MLP)."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from bench.gpu_check.plan import FullShape
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model.gptq_int4 import Int4Linear, pack_for
from engine.model.pair import LoadedPair
from engine.model.runner import DecoderRunner
from engine.offload.build import build_offloaded_runner
from engine.runtime import Engine

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ZEROED = ("self_attn.o_proj", "mlp.down_proj")  # their outputs are zero: logits depend on the last token only
WEIGHT_STD = 0.02  # each int4 matrix's effective weight std: (q - 8) x scale, q uniform in 0..15
DRAFT_LOGIT_STD = 6.0  # std of the draft's logits: a few likely tokens per position, then a long tail


def target_config(shape: FullShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.mlp,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def draft_config(shape: FullShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.draft_hidden, intermediate_size=shape.draft_mlp,
        num_hidden_layers=shape.draft_layers, num_attention_heads=shape.draft_heads,
        num_key_value_heads=shape.draft_kv_heads, head_dim=shape.draft_head_dim, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def random_int4(in_features: int, out_features: int, group: int, device: torch.device,
                generator: torch.Generator, zero: bool) -> Int4Linear:
    """An Int4Linear with values drawn and packed on `device`, its tensors on the host (to stream)."""
    values = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, device=device,
                           generator=generator)  # [N, K]
    packed = pack_for(values, device)
    scale = 0.0 if zero else WEIGHT_STD / math.sqrt(85 / 4)  # (q - 8) has variance 85 / 4
    scales_and_zeros = torch.zeros(in_features // group, out_features, 2, dtype=torch.bfloat16)
    scales_and_zeros[..., 0] = scale  # zero term 0: symmetric around q = 8
    return Int4Linear(in_features, out_features, group, device.type, packed, scales_and_zeros, None, None)


def int4_layers(model: nn.Module, shape: FullShape, device: torch.device, seed: int) -> None:
    """Replace every projection of the meta model's decoder layers by a random Int4Linear (host) and
    give the norms weights of one (host)."""
    generator = torch.Generator(device).manual_seed(seed)
    for layer in model.model.layers:
        for name in PROJECTIONS:
            owner_name, _, leaf = name.rpartition(".")
            old = layer.get_submodule(name)
            setattr(layer.get_submodule(owner_name), leaf, random_int4(
                old.in_features, old.out_features, shape.group_size, device, generator, name in ZEROED))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = nn.Parameter(torch.ones(shape.hidden, dtype=norm.weight.dtype), requires_grad=False)


def aligned_heads(shape: FullShape, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Embeddings and heads of the pair: draft's random, target's = draft's @ P (module doc)."""
    generator = torch.Generator(device).manual_seed(seed)
    vocab, small, large = shape.vocab_size, shape.draft_hidden, shape.hidden
    embed = torch.randn(vocab, small, device=device, generator=generator)
    head = torch.randn(vocab, small, device=device, generator=generator) * (DRAFT_LOGIT_STD / math.sqrt(small))
    basis, _ = torch.linalg.qr(torch.randn(large, small, device=device, generator=generator))  # [large, small]
    projection = basis.T  # [small, large], orthonormal rows
    return {"draft_embed": embed.to(dtype), "draft_head": head.to(dtype),
            "target_embed": (embed @ projection).to(dtype), "target_head": (head @ projection).to(dtype)}


def set_weight(module: nn.Module, tensor: torch.Tensor) -> None:
    module.weight = nn.Parameter(tensor, requires_grad=False)


def build_target(shape: FullShape, heads: dict[str, torch.Tensor], config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, seed: int) -> DecoderRunner:
    """The int4 target: layers streamed from pinned RAM (config.offload), the rest resident."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config(shape), dtype=dtype)
    int4_layers(model, shape, device, seed)
    set_weight(model.model.embed_tokens, heads["target_embed"])
    set_weight(model.lm_head, heads["target_head"])
    set_weight(model.model.norm, torch.ones(shape.hidden, dtype=dtype, device=device))
    with torch.device(device):
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not meta, f"left on the meta device: {meta[:3]}"
    return build_offloaded_runner(model.eval(), config, device)


def build_draft(shape: FullShape, heads: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                seed: int) -> DecoderRunner:
    generator_state = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])
    with generator_state, torch.no_grad():
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(draft_config(shape), dtype=dtype)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(tuple(f"{z}.weight" for z in ZEROED)):
                param.zero_()
            else:
                param.normal_(0.0, WEIGHT_STD)
    set_weight(model.model.embed_tokens, heads["draft_embed"])
    set_weight(model.lm_head, heads["draft_head"])
    return DecoderRunner(model.eval())


def engine_config(shape: FullShape, device: torch.device, dtype: torch.dtype, budget: int) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(target="full-shape-int4", draft="full-shape-draft", device=str(device),
                          dtype=str(dtype).removeprefix("torch.")),
        speculation=SpeculationConfig(method="specexec", budget=budget),
        offload=OffloadConfig(enabled=True, source="ram", resident_layers=0, ring_size=2),
        limits=LimitsConfig(max_context=shape.max_context, max_running=max(shape.streams), prefix_cache_slots=0),
    )


def build_engine(shape: FullShape, device: torch.device, dtype: torch.dtype, seed: int) -> Engine:
    """The pair loaded and planned (Engine.reserve_memory: the plan against the device's free memory,
    under the memory cap when one is set)."""
    config = engine_config(shape, device, dtype, max(shape.budgets))
    heads = aligned_heads(shape, device, dtype, seed)
    target = build_target(shape, heads, config, device, dtype, seed + 1)
    draft = build_draft(shape, heads, device, dtype, seed + 2)
    del heads
    pair = LoadedPair(target, draft, tokenizer=None, eos_token_ids=frozenset(), max_context=shape.max_context)
    engine = Engine(pair, config)
    try:
        engine.reserve_memory()
    except BaseException:
        engine.close()
        raise
    return engine
