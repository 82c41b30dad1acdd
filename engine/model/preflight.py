"""What a load would find wrong with a pair, found before any weights load, each answered in one line
saying what to do (CheckpointError / ConfigError): a device this torch or machine lacks, a folder that
holds no model (no config.json, an unsupported architecture, no weights), a draft whose token ids differ
from the target's, a max_context past the target's trained positions, an offload source that cannot
stream the target (an MXFP4 checkpoint from disk).

    check_pair(config)  # `specexec serve` and `generate`, after the hub ids are resolved to folders

`serve` runs it before it listens and loads in a thread: a mistake found only by the load would end in a
traceback after a full start. The load repeats these checks (the engine is also used from scripts).
"""

from __future__ import annotations

from pathlib import Path

from engine.config import SELF_DRAFT, EngineConfig
from engine.model import checkpoint, hub
from engine.model.pair import check_offload_source, check_self_draft, max_context_for
from engine.types import CheckpointError


def check_pair(config: EngineConfig) -> None:
    model = config.model
    checkpoint.resolve_device(model.device)
    target_config = check_model_folder(model.target, "--target")
    max_context_for(config.limits, target_config, model.target)
    check_offload_source(config, target_config)
    method = config.speculation.method
    if method == "autoregressive":
        return
    if not model.draft:
        raise CheckpointError(f"--method {method} needs a draft model: name one with --draft (a smaller model with "
                              "the target's tokenizer), or use --method autoregressive")
    if model.draft == SELF_DRAFT:  # the target's own layers: no draft folder, no second vocabulary
        if model.self_draft_from:
            check_model_folder(model.self_draft_from, "--self-draft-from")
        check_self_draft(config, target_config)
        return
    check_model_folder(model.draft, "--draft")
    tokenizers = checkpoint.load_tokenizer(model.target), checkpoint.load_tokenizer(model.draft)
    checkpoint.check_vocab(model.target, tokenizers[0], model.draft, tokenizers[1])


def check_model_folder(path: str, flag: str) -> dict:
    """The folder's config.json, checked to be a model the engine loads, with its weights."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{flag} {path}: no such folder")
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{flag} {path}: no config.json there, so no model; point {flag} at a Hugging Face checkpoint folder "
            "(config.json, *.safetensors and tokenizer files) or name a Hub id (org/name)")
    try:
        config = checkpoint.read_config(path)
    except CheckpointError as exc:
        raise CheckpointError(f"{flag} {exc}") from None
    if not hub.has_weights(folder):
        raise CheckpointError(
            f"{flag} {path}: config.json but no weights (*.safetensors, or a shard its index names is missing); "
            f"download the whole checkpoint (e.g. `hf download <repo id> --local-dir {path}`)")
    return config
