"""Models named by Hugging Face Hub id, resolved to a local snapshot folder by huggingface_hub.

    folder = resolve_model("Qwen/Qwen2.5-72B-Instruct", revision=None, flag="--target")

A value naming an existing folder is that folder, as before. Otherwise it must be a hub id (`org/name`
or `name`). Its snapshot in the local cache (HF_HOME / HF_HUB_CACHE) is used when it holds the files
the model needs, with no network call; else, unless HF_HUB_OFFLINE=1, those files are downloaded into
the cache by `snapshot_download`, with huggingface_hub's progress bars on stderr. `needed_files` picks
them from the repository's file list: config, tokenizer, generation config, chat template and one set
of weights (safetensors; never `original/` or other subfolders, Mistral's consolidated.safetensors
beside the transformers shards, or .bin files beside safetensors). A gated, missing, unreachable or
offline model raises CheckpointError: one line naming the id and what to do.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

from engine.types import CheckpointError

log = logging.getLogger("specexec.engine")

METADATA = re.compile(r"^(?:[^/]+\.json|tokenizer\.model|[^/]+\.tiktoken|merges\.txt|vocab\.txt|[^/]+\.jinja)$")
SAFETENSORS_INDEX = "model.safetensors.index.json"
HUB_PAGE = "https://huggingface.co"


def is_local(value: str) -> bool:
    return bool(value) and Path(value).expanduser().is_dir()


def looks_like_hub_id(value: str) -> bool:
    """`org/name` or `name` as the Hub spells ids (huggingface_hub's own check), and not a path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not value or value.startswith(("/", ".", "~")) or "\\" in value:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def needed_files(files: list[str]) -> list[str]:
    """The files of a model repository the engine loads (module doc), from its file list."""
    top = [name for name in files if "/" not in name]
    wanted = [name for name in top if METADATA.match(name)]
    safetensors = [name for name in top if name.endswith(".safetensors")]
    transformers_shards = [name for name in safetensors if name.startswith("model")]
    if transformers_shards:
        wanted += transformers_shards
    elif safetensors:
        wanted += [name for name in safetensors if not name.startswith("consolidated")] or safetensors
    else:
        wanted += [name for name in top if name.startswith("pytorch_model") and name.endswith(".bin")]
    return sorted(set(wanted))


def has_weights(folder: Path) -> bool:
    """Whether `folder` holds a config and a complete set of weights (every shard its index names)."""
    if not (folder / "config.json").is_file():
        return False
    for index_name in (SAFETENSORS_INDEX, "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
            return bool(shards) and all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of `repo_id` at `revision` (a branch, tag or commit) if it holds the
    files the model needs (the download's own file list where the cache kept it), else None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(found, str):
        return None
    folder = Path(found).parent
    listed = cached_file_list(repo_id, revision)
    if listed is None:  # a cache laid by other tools or releases: judge by the files
        return folder if has_weights(folder) else None
    return folder if all((folder / name).exists() for name in needed_files(listed)) else None


def cached_file_list(repo_id: str, revision: str | None) -> list[str] | None:
    """The repository's file list the download cached (huggingface_hub releases that keep one), or None."""
    try:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:
        return None
    try:
        return [entry.path for entry in get_cached_repo_tree(repo_id, revision=revision)]
    except CachedRepoTreeNotFoundError:
        return None


def download(repo_id: str, revision: str | None) -> Path:
    """Download the files `repo_id` needs into the cache (progress bars on stderr); its snapshot folder."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()
    commit = api.model_info(repo_id, revision=revision).sha  # fails fast (no retries) when gated, missing, unreachable
    entries = [e for e in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(e, RepoFile)]
    wanted = needed_files([entry.path for entry in entries])
    if "config.json" not in wanted:
        raise CheckpointError(f"{repo_id}: the repository has no config.json; it is not a transformers model")
    size = sum(entry.size or 0 for entry in entries if entry.path in wanted)
    print(f"specexec: downloading {repo_id} ({len(wanted)} files, {size / 1e9:.2f} GB) into {cache_dir()}",
          file=sys.stderr, flush=True)
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=wanted))


def resolve_model(value: str, revision: str | None = None, flag: str = "--target") -> str:
    """The local folder of a model named by `value`: a folder, or a hub id (module doc)."""
    if is_local(value):
        return value
    if not looks_like_hub_id(value):
        raise CheckpointError(f"{flag} {value}: no such model folder, and not a Hugging Face Hub id (org/name)")
    cached = cached_snapshot(value, revision)
    if cached is not None:
        log.info("%s %s: from the Hugging Face cache, %s", flag, value, cached)
        return str(cached)
    at = f" (revision {revision})" if revision else ""
    if offline():
        raise CheckpointError(
            f"{flag} {value}{at}: not in the local Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE=1 forbids "
            f"downloading it; download it where the Hub is reachable (`hf download {value}`), or unset HF_HUB_OFFLINE")
    try:
        return str(download(value, revision))
    except Exception as exc:
        error = download_error(exc, value, at, flag)
        if error is exc:
            raise
        raise error from exc


def download_error(exc: Exception, repo_id: str, at: str, flag: str) -> Exception:
    """One line for a failed look-up or download of `repo_id`: what happened and what to do. Errors not
    of the Hub or the network come back as they are."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, GatedRepoError):
        return CheckpointError(
            f"{flag} {repo_id}: a gated model; accept its terms at {HUB_PAGE}/{repo_id} with your account, then "
            "log in here (`hf auth login`, or set HF_TOKEN) and run again")
    if isinstance(exc, RepositoryNotFoundError):
        return CheckpointError(
            f"{flag} {repo_id}: no such model on the Hugging Face Hub, nor a local folder of that name; check the "
            "id (org/name), or log in (`hf auth login`, or set HF_TOKEN) if it is a private model")
    if isinstance(exc, RevisionNotFoundError):
        return CheckpointError(f"{flag} {repo_id}{at}: the model has no such revision (a branch, tag or commit)")
    network = isinstance(exc, (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError))
    network = network or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")
    if not network:
        return exc
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(
        f"{flag} {repo_id}{at}: not in the local Hugging Face cache ({cache_dir()}) and the download failed "
        f"({reason}); check the network (and HF_ENDPOINT), or download it where the Hub is reachable")


def model_config_file(value: str, download: bool, revision: str | None = None) -> Path | None:
    """config.json of a hub id from the cache, else (with `download`, unless offline) downloaded alone;
    None when neither gives it (no such model, no network). For plans: shapes, not weights."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    if is_local(value) or not looks_like_hub_id(value):
        return None
    found = try_to_load_from_cache(value, "config.json", revision=revision)
    if isinstance(found, str):
        return Path(found)
    if not download or offline():
        return None
    try:
        return Path(hf_hub_download(value, "config.json", revision=revision))
    except Exception as exc:
        if download_error(exc, value, "", "") is exc:
            raise
        return None

TOKENIZER_FILE = re.compile(r"^(?:tokenizer[^/]*|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|"
                            r"[^/]+\.tiktoken)$")


def tokenizer_folder(repo_id: str) -> Path | None:
    """A snapshot folder holding `repo_id`'s tokenizer files (downloaded alone where not cached), or None
    when offline or the Hub cannot give them."""
    from huggingface_hub import HfApi, snapshot_download, try_to_load_from_cache

    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        found = try_to_load_from_cache(repo_id, name)
        if isinstance(found, str):
            return Path(found).parent
    if offline():
        return None
    try:
        files = [sibling.rfilename for sibling in HfApi().model_info(repo_id).siblings or []]
        wanted = [name for name in files if TOKENIZER_FILE.match(name)]
        return Path(snapshot_download(repo_id, allow_patterns=wanted)) if wanted else None
    except Exception as exc:
        if download_error(exc, repo_id, "", "") is exc:
            raise
        return None
