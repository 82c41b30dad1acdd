"""Sampling defaults from the target's generation_config.json (`--generation-config auto`, as vLLM).

A checkpoint's generation_config.json carries its recommended sampling (Llama 3.1 Instruct:
temperature 0.6, top_p 0.9). Every field of SAMPLING_FIELDS that the file sets becomes the value of
that field for a request that leaves it out (or sends null); a value the request gives wins. Read
with transformers' GenerationConfig (`to_diff_dict`: only what the file sets), as vLLM reads it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("specexec.server")

# the request fields a generation_config may default (vLLM's list, less max_new_tokens)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """{field: value} for every SAMPLING_FIELDS entry `model_dir`'s generation_config.json sets; {}
    without the file (or when it sets none of them)."""
    if not (Path(model_dir) / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig  # here: its module imports tqdm, which the app leaves out

    try:
        config = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except (OSError, ValueError) as exc:
        log.warning("generation_config.json of %s could not be read (%s): no sampling defaults", model_dir, exc)
        return {}
    return {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}


def sampling_defaults_for(mode: str, model_dir: str | Path) -> dict[str, Any]:
    """The server's defaults: `auto`, the target's generation_config.json; `none`, none. Logged."""
    defaults = read_sampling_defaults(model_dir) if mode == "auto" else {}
    if defaults:
        shown = ", ".join(f"{name} {value:g}" for name, value in defaults.items())
        log.info("sampling defaults from the target's generation_config.json (a request's own values win): %s", shown)
    else:
        reason = "--generation-config none" if mode == "none" else "the target's generation_config.json sets none"
        log.info("sampling defaults: the API's own (temperature 1, no top_p/top_k/min_p/penalty); %s", reason)
    return defaults
