"""Loading a target/draft pair: checkpoints, dtype, device, the context limit, offloading.

The target's context limit is checked before any weights load; the draft must share the target's
token ids (checked on the tokenizers). Embedding sizes may differ past the tokenizer (padding): ids
the target can emit but the draft cannot embed are fed to the draft as one fixed id it can.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, LimitsConfig
from engine.model import checkpoint, gptq, host_plan, mxfp4
from engine.model.runner import DecoderRunner
from engine.model.self_draft import SELF, build_self_draft
from engine.model.self_draft_plan import target_refusal
from engine.offload.build import build_offloaded_runner
from engine.offload.loader import load_offloaded_target
from engine.types import CheckpointError, ConfigError

DEFAULT_MAX_CONTEXT = 8192

log = logging.getLogger("specexec.engine")


@dataclass
class LoadedPair:
    target: DecoderRunner
    draft: DecoderRunner | None
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: frozenset[int]
    max_context: int

    def close(self) -> None:
        """Stop the target's layer streamer, if it streams (its loader thread must not outlive the
        interpreter's torch state: exiting with it mid-copy aborts the process). Idempotent."""
        close = getattr(self.target.layers, "close", None)
        if close is not None:
            close()


def load_pair(config: EngineConfig) -> LoadedPair:
    model_cfg = config.model
    device = checkpoint.resolve_device(model_cfg.device)
    target_config = checkpoint.read_config(model_cfg.target)
    limit = max_context_for(config.limits, target_config, model_cfg.target)  # before any weights load
    check_offload_source(config, target_config)
    dtype = checkpoint.resolve_dtype(model_cfg.dtype, device, target_config)
    tokenizer = checkpoint.load_tokenizer(model_cfg.target)
    needs_draft = config.speculation.method != "autoregressive"
    self_draft = needs_draft and model_cfg.draft == SELF
    if needs_draft:
        if not model_cfg.draft:
            raise CheckpointError(f"method {config.speculation.method} needs a draft model (--draft)")
        if self_draft:
            check_self_draft(config, target_config)
        else:
            checkpoint.read_config(model_cfg.draft)
            checkpoint.check_vocab(model_cfg.target, tokenizer, model_cfg.draft, checkpoint.load_tokenizer(model_cfg.draft))
    streaming = check_host_memory(config, device, dtype, target_config, needs_draft)  # before any weights load
    if streaming:
        target_model, streamer = load_offloaded_target(config, dtype, device)
        target = DecoderRunner(target_model, streamer)
    else:
        kernel = target_gptq_kernel(config, target_config)
        target_model = checkpoint.load_model(model_cfg.target, dtype, gptq_kernel=kernel, compute_device=device)
        target = build_target_runner(target_model, config, device)
    draft = None
    if self_draft:
        draft = build_self_draft(target, target_model, device, checkpoint_layers(config, dtype, device))
    elif needs_draft:
        draft = DecoderRunner(checkpoint.load_model(model_cfg.draft, dtype, device, model_cfg.gptq_kernel))
        match_embeddings(target, draft, tokenizer)
    eos = checkpoint.eos_token_ids(target_model, tokenizer)
    return LoadedPair(target, draft, tokenizer, eos, limit)


def check_host_memory(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, target_config: dict, needs_draft: bool
) -> bool:
    """Check the load's host memory from the checkpoints' headers (host_plan), before any weights load.
    Returns whether the target streams tensor by tensor into its store (an offloaded plain safetensors
    checkpoint or GPT-OSS's MXFP4 one; GPTQ checkpoints load through transformers)."""
    model_cfg = config.model
    try:
        target = host_plan.checkpoint_bytes(model_cfg.target, dtype)
        if needs_draft and model_cfg.draft == SELF:  # 4-bit copies: on the host only where it is the device
            draft = target.total // 4 if device.type == "cpu" else 0
            if model_cfg.self_draft_from:
                draft += host_plan.checkpoint_bytes(model_cfg.self_draft_from, dtype).total
        else:
            draft = host_plan.checkpoint_bytes(model_cfg.draft, dtype).total if needs_draft else 0
    except FileNotFoundError as exc:  # no *.safetensors: transformers loads other formats, unchecked
        log.warning("host memory not checked before loading: %s", exc)
        return False
    streaming = config.offload.enabled and gptq.streams_as_plain(target_config)
    need = host_plan.check_host_memory_before_loading(config, device.type == "cpu", target, draft, streaming)
    log.info("host memory for loading: %.2f GB (checked before loading)", need / host_plan.GB)
    return streaming


def check_offload_source(config: EngineConfig, target_config: dict) -> None:
    """Refuse an offload source that cannot stream the target (an MXFP4 checkpoint from disk), before any
    weights load."""
    refused = mxfp4.disk_refusal(target_config, config.offload)
    if refused is not None:
        raise ConfigError("offload.source", f"{config.model.target}: {refused}")


def check_self_draft(config: EngineConfig, target_config: dict) -> None:
    """Refuse `--draft self` for a target that cannot have one, and a `--self-draft-from` checkpoint that
    is not a 4-bit checkpoint of the target's shape (before any weights load)."""
    why = target_refusal(target_config)
    if why is not None:
        raise ConfigError("model.draft", f"--draft self: {why}")
    path = config.model.self_draft_from
    if not path:
        return
    source = checkpoint.read_config(path)
    if gptq.quant_method(source) is None:
        raise ConfigError("model.self_draft_from", f"{path}: not a quantized checkpoint (no quantization_config)")
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size"):
        if source.get(key) != target_config.get(key):
            raise ConfigError("model.self_draft_from", f"{path}: {key} {source.get(key)} is not the target's "
                              f"{target_config.get(key)}: not a checkpoint of the same model")


def checkpoint_layers(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> list | None:
    """The decoder layers of the `--self-draft-from` checkpoint, loaded on the host for `device`'s
    kernels (its embeddings and head are dropped: the self-draft shares the target's); None without one."""
    path = config.model.self_draft_from
    if not path:
        return None
    model = checkpoint.load_model(path, dtype, "cpu", config.model.gptq_kernel, device)
    return list(model.model.layers)


def target_gptq_kernel(config: EngineConfig, target_config: dict) -> str:
    """The GPTQ kernel asked for the target: the disk source streams the checkpoint's own packing, which
    only the dequantize kernel reads (gptq_int4's module doc)."""
    kernel = config.model.gptq_kernel
    if not (config.offload.enabled and config.offload.source == "disk" and gptq.quant_method(target_config)):
        return kernel
    if kernel == "int4":
        raise ConfigError("model.gptq_kernel", "a GPTQ target streamed from disk runs on the dequantize kernel only "
                          "(the int4 kernel needs its own packing, made at load: --offload-source ram)")
    return "dequantize"


def trained_positions(target_config: dict) -> int | None:
    """Positions the target was trained for (config.json): max_position_embeddings, or a rope
    scaling's original length x factor when larger (YaRN-style configs keep the original there)."""
    trained = target_config.get("max_position_embeddings")
    rope = target_config.get("rope_scaling") or target_config.get("rope_parameters") or {}
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if isinstance(trained, int) and isinstance(factor, int | float) and isinstance(original, int):
        trained = max(trained, int(original * factor))
    return trained if isinstance(trained, int) else None


def max_context_for(limits: LimitsConfig, target_config: dict, target_path: str) -> int:
    """limits.max_context, or the trained positions capped at DEFAULT_MAX_CONTEXT. Raises ConfigError
    for a max_context past the trained positions unless limits.allow_long_context."""
    trained = trained_positions(target_config)
    if limits.max_context is None:
        return min(trained or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT)
    if trained is not None and limits.max_context > trained and not limits.allow_long_context:
        raise ConfigError("limits.max_context", (
            f"{limits.max_context} is beyond the {trained} positions the target {target_path!r} was trained "
            "for (max_position_embeddings in its config.json): rotary position embeddings past the trained "
            f"range degrade the output. Lower --max-context to {trained} or less, or pass --allow-long-context "
            "(limits.allow_long_context = true) to run anyway"
        ))
    return limits.max_context


def build_target_runner(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> DecoderRunner:
    """Resident target, or layers streamed by the offload streamer."""
    if not config.offload.enabled:
        return DecoderRunner(model.to(device))
    return build_offloaded_runner(model, config, device)


def fallback_input_id(draft: DecoderRunner, tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The id a draft is fed for target ids past its embedding: its pad token (else the tokenizer's
    pad, unk or eos token), if the draft embeds it; else 0."""
    candidates = [getattr(draft.config, "pad_token_id", None)]
    if tokenizer is not None:
        candidates += [tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id]
    for token_id in candidates:
        if isinstance(token_id, int) and 0 <= token_id < draft.num_embeddings:
            return token_id
    return 0


def match_embeddings(target: DecoderRunner, draft: DecoderRunner, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Compare the embedding sizes: a target that can emit ids past the draft's embedding (Qwen2.5-72B:
    152064 rows, Qwen2.5-1.5B: 151936) gets its draft a fallback input id for them."""
    if target.vocab_size <= draft.num_embeddings:
        return
    draft.fallback_input_id = fallback_input_id(draft, tokenizer)
    log.info("the target's vocabulary (%d ids) is larger than the draft's embedding (%d rows): the draft is "
             "fed id %d for the ids past it and never drafts them", target.vocab_size, draft.num_embeddings,
             draft.fallback_input_id)
