"""Loading local Hugging Face checkpoints (config + safetensors + tokenizer)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from engine import multimodal
from engine.model import families, fp8, gptq, int4_formats, mxfp4
from engine.types import CheckpointError, ConfigError, VocabMismatchError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """model.device as a torch device; a CUDA device this torch or machine does not have is a ConfigError
    saying what to do (not torch's assertion deep in the load)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        check_cuda_device(device, resolved.index)
    return resolved


def check_cuda_device(device: str, index: int | None) -> None:
    if torch.version.cuda is None:
        raise ConfigError(f"--device {device}", (
            f"this torch ({torch.__version__}) is a build without CUDA; install a CUDA build of torch into this "
            "environment (https://pytorch.org/get-started/locally/), or use --device cpu (--device auto: CUDA "
            "where there is one)"))
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}", (
            f"no CUDA device is usable (torch {torch.__version__}, CUDA {torch.version.cuda}: no GPU, no driver "
            "for this CUDA, or CUDA_VISIBLE_DEVICES hides them; `nvidia-smi` shows which); use --device cpu"))
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ConfigError(f"--device {device}", f"this machine has {count} CUDA device(s), cuda:0 to "
                          f"cuda:{count - 1}; name one of them")


def resolve_dtype(dtype: str, device: torch.device, config: dict) -> torch.dtype:
    """The load dtype: as given, or for `auto` float32 off CUDA; on CUDA the checkpoint's own half
    dtype (`config`: its config.json) where the GPU computes in it (bfloat16 needs compute capability
    8.0+), else float16."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    stored = str(config.get("dtype") or config.get("torch_dtype") or "").removeprefix("torch.")
    if stored == "bfloat16" and torch.cuda.get_device_capability(device) >= (8, 0):  # CUDA-only
        return torch.bfloat16
    return torch.float16


def read_config(path: str) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a local Hugging Face checkpoint folder)")
    try:
        config = multimodal.language_model_config(json.loads(config_file.read_text()))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: config.json is not valid JSON ({exc}); download the checkpoint again") from None
    refused = families.refusal(config.get("architectures") or [])
    if refused is not None:
        raise CheckpointError(f"{path}: {refused}")
    gptq.check_loadable(path, config)
    return config


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    gptq_kernel: str = "dequantize",
    compute_device: torch.device | None = None,
) -> nn.Module:
    """Load weights on `device` (host by default: the offload planner moves what is resident).
    A GPTQ checkpoint's layers run on `gptq_kernel` (gptq.select_kernel) for `compute_device`
    (default: `device`)."""
    config = read_config(path)
    packed = int4_formats.format_of(config)
    if packed is not None:  # AWQ, compressed-tensors: converted here, no quantization library
        from engine.model.int4_checkpoint import load_int4_checkpoint

        home = torch.device(device)
        model, _ = load_int4_checkpoint(path, packed, dtype, home, gptq_kernel, torch.device(compute_device or device))
        return model.to(device).eval().requires_grad_(False)
    block_fp8 = fp8.format_of(config)
    if block_fp8 is not None:  # FP8 layer maps kept as stored, dequantized per call (engine.model.fp8)
        from engine.model.fp8_checkpoint import load_fp8_checkpoint

        return load_fp8_checkpoint(path, block_fp8, dtype, torch.device(device)).eval().requires_grad_(False)
    dequantized = mxfp4.is_mxfp4(config)  # GPT-OSS's MXFP4 experts: dequantized by transformers as it loads
    quantized = gptq.quant_method(config) is not None and not dequantized
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        extra = gptq.load_kwargs(config) if quantized else {}
        if dequantized:
            from transformers import Mxfp4Config

            extra["quantization_config"] = Mxfp4Config(dequantize=True)  # works without triton or kernels
        with warnings.catch_warnings():
            # our GPTQConfig only picks the kernel; transformers warns that it merges it into the checkpoint's
            warnings.filterwarnings("ignore", message="You passed `quantization_config`", category=UserWarning)
            if multimodal.is_multimodal(json.loads((Path(path) / "config.json").read_text())):
                # its text decoder alone, read from the language model's prefix; the vision tower is left unread
                extra |= dict(config=multimodal.hf_config(path), key_mapping=multimodal.KEY_MAPPING)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot load weights: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if quantized:
        gptq.make_streamable(model)  # packed buffers only: resident and streamed layers run the same
        gptq.select_kernel(model, gptq_kernel, torch.device(compute_device or device))
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    folder = Path(path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:  # a multimodal checkpoint may keep it with its processor's files only
        tokenizer.chat_template = multimodal.processor_chat_template(folder)
    return tokenizer


def check_vocab(
    target_path: str,
    target_tok: PreTrainedTokenizerBase | None,
    draft_path: str,
    draft_tok: PreTrainedTokenizerBase | None,
) -> None:
    """The draft must give every shared token id the same token as the target (padding allowed)."""
    if target_tok is None or draft_tok is None:
        missing = target_path if target_tok is None else draft_path
        raise VocabMismatchError(
            f"cannot check that draft {draft_path!r} and target {target_path!r} share a vocabulary: "
            f"{missing!r} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); copy its "
            "model's tokenizer files into it"
        )
    target_vocab = {i: t for t, i in target_tok.get_vocab().items()}
    draft_vocab = {i: t for t, i in draft_tok.get_vocab().items()}
    shared = min(len(target_vocab), len(draft_vocab))
    for token_id in range(shared):
        if target_vocab.get(token_id) != draft_vocab.get(token_id):
            raise VocabMismatchError(
                f"draft {draft_path!r} and target {target_path!r} have incompatible vocabularies: "
                f"token id {token_id} is {draft_vocab.get(token_id)!r} in the draft but "
                f"{target_vocab.get(token_id)!r} in the target; a draft must share the target's token ids: "
                "use a draft with the target's tokenizer (a smaller model of its family), or --method "
                "autoregressive to serve without one"
            )


def eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
