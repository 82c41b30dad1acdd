"""The pair's models as flags and config files name them -> local folders, before anything loads.

    config = resolve_pair(config)  # hub ids found in the cache or downloaded; a draft "auto" chosen

A target or draft is a local folder or a Hugging Face Hub id (engine.model.hub); a target given by id
is served under that id unless model.name says otherwise. A draft "auto" is chosen by
engine.model.draft_auto, which says what it chose and why on stderr; a draft "self" is the target's own
layers (engine.model.self_draft), and its `self_draft_from` checkpoint a folder or hub id like any.
"""

from __future__ import annotations

import sys

from engine.config import SELF_DRAFT, EngineConfig
from engine.model import hub

AUTO = "auto"


def draft_by_default(target: str, draft: str, method: str) -> str:
    """The draft when none is named: "auto" for a target given by hub id (a folder target keeps none)."""
    if draft or not isinstance(target, str) or not target or method == "autoregressive" or hub.is_local(target):
        return draft
    return AUTO if hub.looks_like_hub_id(target) else draft


def resolve_pair(config: EngineConfig) -> EngineConfig:
    model = config.model
    target = hub.resolve_model(model.target, model.revision or None, "--target")
    name = model.name or (model.target if target != model.target else "")
    draft = model.draft
    self_draft_from = model.self_draft_from
    if self_draft_from:
        self_draft_from = hub.resolve_model(self_draft_from, None, "--self-draft-from")
    if config.speculation.method != "autoregressive" and draft:
        if draft == SELF_DRAFT and not hub.is_local(draft):
            pass  # the target's own layers (engine.model.self_draft)
        elif draft == AUTO and not hub.is_local(draft):
            from engine.model.draft_auto import resolve_auto

            draft, why = resolve_auto(config.replace("model", target=target), model.target)
            print(f"specexec: {why}", file=sys.stderr, flush=True)
        else:
            draft = hub.resolve_model(draft, model.draft_revision or None, "--draft")
    return config.replace("model", target=target, draft=draft, name=name, self_draft_from=self_draft_from)
