"""The check's checkpoints: a target with a few 70B-shaped Llama decoder layers and a small draft,
both random, seeded, built on the device (fast) and saved as one safetensors file each (the disk
source reads it), with a word-level tokenizer over the shared vocabulary (the engine checks it).

Every weight is non-zero (norm weights drawn around one): a layer computed from another layer's ring
slot, or from stale bytes, changes the logits."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from bench.gpu_check.context import CheckContext, Checkpoints
from bench.gpu_check.plan import Plan
from bench.target import bench_config, cache_key, is_built, mark_built
from engine.offload.layout import layout_of

WEIGHT_STD = 0.02  # projections and embeddings ~ N(0, 0.02), as Llama initialises them
NORM_STD = 0.1  # norm weights ~ N(1, 0.1): distinct in every layer, like every other tensor
MAX_CONTEXT = 16384  # max_position_embeddings: the check's 8k context plus a 2k tree fit


def target_config(plan: Plan) -> LlamaConfig:
    config = bench_config(plan.num_layers, plan.hidden, plan.mlp, plan.vocab_size)
    config.num_attention_heads = plan.num_heads
    config.num_key_value_heads = plan.num_kv_heads
    config.head_dim = plan.head_dim
    config.max_position_embeddings = MAX_CONTEXT
    return config


def draft_config(plan: Plan) -> LlamaConfig:
    config = bench_config(plan.draft_layers, plan.draft_hidden, plan.draft_mlp, plan.vocab_size)
    config.max_position_embeddings = MAX_CONTEXT
    return config


def meta_model(config: LlamaConfig, dtype: torch.dtype) -> nn.Module:
    """The model's modules and shapes, no storage (layouts, store plans)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def random_model(config: LlamaConfig, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """Initialized on `device` from `seed` without touching the global generators' state."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        for name, param in model.named_parameters():  # explicit: transformers may leave weights unset
            if "norm" in name:
                param.normal_(1.0, NORM_STD)
            else:
                param.normal_(0.0, WEIGHT_STD)
            param.masked_fill_(param == 0, WEIGHT_STD)  # an exact zero would hide a slot mix-up
    zero = [name for name, param in model.named_parameters() if not bool(param.ne(0).all())]
    assert not zero, f"random weights with zeros: {zero[:3]}"
    return model.eval()


def save_tokenizer(folder: Path, vocab_size: int, eos_token_id: int) -> None:
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"<{eos_token_id}>").save_pretrained(folder)


def save(model: nn.Module, folder: Path, vocab_size: int) -> None:
    """One safetensors file, flushed to disk (a later O_DIRECT read must not wait for writeback)."""
    hf_logging.disable_progress_bar()
    try:
        model.to("cpu").save_pretrained(folder, max_shard_size="1000GB")
    finally:
        hf_logging.enable_progress_bar()
    save_tokenizer(folder, vocab_size, model.config.eos_token_id)
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def build_checkpoints(plan: Plan, root: Path, device: torch.device, dtype: torch.dtype) -> Checkpoints:
    """Build (or reuse, if `root` already holds them) the target and draft of `plan`."""
    precision = str(dtype).removeprefix("torch.")
    shape = {"num_layers": plan.num_layers, "hidden": plan.hidden, "mlp": plan.mlp, "seed": plan.seed}
    extra = (
        plan.num_heads,
        plan.num_kv_heads,
        plan.head_dim,
        plan.vocab_size,
        plan.draft_layers,
        plan.draft_hidden,
    )
    folder = root / f"gpu-check-{cache_key(shape, precision, extra)}"
    target, draft = folder / "target", folder / "draft"
    begin = time.perf_counter()
    reused = is_built(folder)
    if not reused:
        for config, path, seed in (
            (target_config(plan), target, plan.seed),
            (draft_config(plan), draft, plan.seed + 1),
        ):
            model = random_model(config, dtype, device, seed)
            save(model, path, plan.vocab_size)
            del model
        mark_built(folder, precision, shape)
    layout_model = meta_model(target_config(plan), dtype)
    target_bytes = sum(p.numel() * p.element_size() for p in layout_model.parameters())
    layer_bytes = layout_of(layout_model.model.layers[0]).nbytes
    seconds = 0.0 if reused else time.perf_counter() - begin
    return Checkpoints(target, draft, layer_bytes, target_bytes, seconds, reused)


def build_section(ctx: CheckContext) -> None:
    plan, report = ctx.plan, ctx.report
    ctx.checkpoints = checkpoints = build_checkpoints(plan, ctx.work_dir, ctx.device, ctx.dtype)
    how = (
        "reused from the work dir"
        if checkpoints.reused
        else f"on {ctx.device} in {checkpoints.seconds:.1f} s"
    )
    report.table("checkpoint", "shape", "bytes", "built")
    report.row(
        "target",
        f"{plan.num_layers} Llama decoder layers: {plan.layer_shape}",
        f"{checkpoints.target_bytes:,} ({checkpoints.layer_bytes:,} per layer)",
        how,
    )
    report.row("draft", f"{plan.draft_layers} layers, hidden {plan.draft_hidden}, same vocabulary", "-", how)
