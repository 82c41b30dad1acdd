"""The models in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE), read with huggingface_hub's
`scan_cache_dir`: no network.

    for model in cached_models(): model.repo_id, model.folder, model.size_on_disk, model.config

A repository counts when one of its snapshots holds a config.json of an architecture the engine runs
and a complete set of weights: the snapshot of its main branch when that one does, else the most
recently used snapshot that does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.model import hub


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    folder: Path  # the snapshot folder
    size_on_disk: int  # bytes of the repository's blobs in the cache (every revision)
    config: dict  # its config.json


def supported(config: dict) -> bool:
    from engine.model.families import SUPPORTED_ARCHS

    return any(arch in SUPPORTED_ARCHS for arch in config.get("architectures") or [])


def snapshot_with_weights(repo) -> Path | None:
    """The snapshot of a scanned repository to use (module doc), or None."""
    main = hub.cached_snapshot(repo.repo_id, None)
    if main is not None:
        return main
    for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
        if hub.has_weights(Path(revision.snapshot_path)):
            return Path(revision.snapshot_path)
    return None


def cached_models() -> list[CachedModel]:
    """Every model in the cache the engine can load (module doc), by id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        scanned = scan_cache_dir(hub.cache_dir())
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(scanned.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        folder = snapshot_with_weights(repo)
        if folder is None:
            continue
        from engine.multimodal import language_model_config

        config = language_model_config(json.loads((folder / "config.json").read_text()))  # Qwen3.5: its text model
        if supported(config):
            found.append(CachedModel(repo.repo_id, folder, repo.size_on_disk, config))
    return found
