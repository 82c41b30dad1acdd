"""`--draft auto`: a draft that shares the target's token ids and fits the memory plan beside it.

    folder, why = choose_draft(config, target_label)  # config.model.target: the target's folder

Candidates are the models in the local hub cache (engine.model.hub_cache) and those of
configs/shapes/models.toml, other than the target, of at most half its parameters. The
largest candidate that fits beside the target (engine.model.pair_plan on this device: a CUDA GPU's
memory, else the host's available memory at the CPU's float32) and whose tokenizer has the target's
vocabulary (the same id for every token) and the same special tokens is chosen. Tokenizers are
compared, not names: a known model not in the cache has its tokenizer files downloaded for the
check (never offline), and its weights only if it is chosen. When none fits and the target streams
(offload), the target's own layers in 4-bit are the draft (`--draft self`, engine.model.self_draft) if
that fits; else CheckpointError listing every candidate and why it was passed over. (A resident target
gets no self-draft by default: its 4-bit copy's forwards are not much cheaper than its own.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import SELF_DRAFT, EngineConfig
from engine.model import config_shapes, hub, hub_cache, self_draft_plan
from engine.types import CheckpointError, ConfigError

GB = 10**9
MAX_DRAFT_FRACTION = 0.5  # a draft has at most this share of the target's parameters


@dataclass
class Candidate:
    repo_id: str
    source: str  # what the plan reads: the cached folder, or the id of a known shape
    config: dict
    cached: bool
    why_not: str = ""  # empty while it may be chosen
    plan_gb: float = 0.0


def num_params(config: dict) -> int:
    """Weights of a model from its config.json (as if unquantized): linear maps, embeddings, head."""
    per_layer = sum(k * n for k, n, _ in config_shapes.linears(config))
    embeddings = config["vocab_size"] * config["hidden_size"] * (1 if config.get("tie_word_embeddings") else 2)
    return config["num_hidden_layers"] * per_layer + embeddings


def token_table(folder: str) -> tuple[dict[str, int], frozenset[int]] | None:
    """A tokenizer's vocabulary (token -> id) and its special tokens' ids; None without tokenizer files."""
    from engine.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        return None
    special = frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return tokenizer.get_vocab(), special


def candidates(config: EngineConfig, target_id: str) -> list[Candidate]:
    target_params = num_params(config_shapes.read_model_config(config.model.target)[0])
    found: dict[str, Candidate] = {}
    for model in hub_cache.cached_models():
        found[model.repo_id] = Candidate(model.repo_id, str(model.folder), model.config, True)
    for repo_id, fields in config_shapes.known_models().items():
        found.setdefault(repo_id, Candidate(repo_id, repo_id, fields, False))
    kept = []
    for candidate in found.values():
        if candidate.repo_id == target_id or Path(candidate.source) == Path(config.model.target):
            continue
        if num_params(candidate.config) > MAX_DRAFT_FRACTION * target_params:
            continue  # not a draft for this target: not listed
        kept.append(candidate)
    return sorted(kept, key=lambda c: (-num_params(c.config), not c.cached, c.repo_id))


def plan_config(config: EngineConfig, on_cpu: bool) -> EngineConfig:
    """On a CPU the weights load at float32 (model.dtype auto)."""
    return config.replace("model", dtype="float32") if on_cpu and config.model.dtype == "auto" else config


def check_fit(config: EngineConfig, candidate: Candidate, device_bytes: int) -> None:
    from engine.model.pair_plan import plan_pair

    try:
        result = plan_pair(config.replace("model", draft=candidate.source), device_bytes)
    except (CheckpointError, ConfigError, KeyError) as exc:
        candidate.why_not = f"cannot plan it: {exc}"
        return
    candidate.plan_gb = result.plan.total / GB
    if not result.fits:
        candidate.why_not = f"does not fit beside the target ({candidate.plan_gb:.2f} GB planned)"


def check_tokens(candidate: Candidate, target_tokens: tuple[dict[str, int], frozenset[int]]) -> None:
    folder = candidate.source if candidate.cached else hub.tokenizer_folder(candidate.repo_id)
    if folder is None:
        candidate.why_not = "not in the cache, and its tokenizer could not be fetched to compare"
        return
    tokens = token_table(str(folder))
    if tokens is None:
        candidate.why_not = "has no tokenizer files to compare"
    elif tokens[0] != target_tokens[0]:
        candidate.why_not = f"another vocabulary ({len(tokens[0])} tokens, the target's {len(target_tokens[0])})"
    elif tokens[1] != target_tokens[1]:
        candidate.why_not = "the same vocabulary but other special tokens"


def choose_draft(config: EngineConfig, target_id: str, device_bytes: int, device_label: str,
                 tokens_folder: str | None = None, fetch: bool = True) -> tuple[str, str]:
    """(the chosen draft's folder, one line saying what was chosen and why); CheckpointError when none fits.
    tokens_folder: where the target's tokenizer is (default: the target's folder); fetch: download the
    chosen draft's weights if it is not cached (else its id is returned, for plans)."""
    target_tokens = token_table(tokens_folder or config.model.target)
    if target_tokens is None:
        raise CheckpointError(f"--draft auto: the target {target_id} has no tokenizer files to compare drafts with")
    found = candidates(config, target_id)
    for candidate in found:
        check_fit(config, candidate, device_bytes)
        if candidate.why_not:
            continue
        check_tokens(candidate, target_tokens)
        if candidate.why_not:
            continue
        folder = candidate.source
        if not candidate.cached and fetch:
            folder = hub.resolve_model(candidate.repo_id, None, "--draft")
        passed = [c for c in found if c.why_not]
        where = "in the cache" if candidate.cached else ("downloaded" if fetch else "a known shape")
        why = (f"--draft auto: {candidate.repo_id} ({where}; "
               f"the target's {len(target_tokens[0])} tokens and special tokens; the largest candidate that fits "
               f"beside it on {device_label}: {candidate.plan_gb:.2f} GB planned)")
        if passed:
            why += "; passed over: " + "; ".join(f"{c.repo_id}: {c.why_not}" for c in passed)
        return folder, why
    listed = "; ".join(f"{c.repo_id}: {c.why_not or 'not checked'}" for c in found) or "none (the cache holds no smaller model)"
    self_draft = Candidate("the target's own layers in 4-bit (--draft self)", SELF_DRAFT, {}, True)
    check_self_draft(config, self_draft, device_bytes)
    if not self_draft.why_not:
        return SELF_DRAFT, (f"--draft auto: the target's own layers in 4-bit (--draft self: no other model shares its "
                            f"tokens and fits beside it on {device_label}; {self_draft.plan_gb:.2f} GB planned); "
                            f"candidates: {listed}")
    hint = "" if config.offload.enabled else " (the target is resident: --offload streams its layers)"
    raise CheckpointError(
        f"--draft auto: no draft shares {target_id}'s tokens and fits beside it on {device_label}{hint}; "
        f"candidates: {listed}; {self_draft.repo_id}: {self_draft.why_not}. Name a draft with --draft (a folder "
        "or hub id), or run without one (--method autoregressive)")


def check_self_draft(config: EngineConfig, candidate: Candidate, device_bytes: int) -> None:
    """Whether the self-draft may be chosen: a streamed target that can have one, and the plan fits."""
    if not config.offload.enabled:
        candidate.why_not = "not chosen for a resident target"
        return
    why = self_draft_plan.target_refusal(config_shapes.read_model_config(config.model.target)[0])
    if why is not None:
        candidate.why_not = why
        return
    check_fit(config, candidate, device_bytes)


def on_device(config: EngineConfig) -> tuple[int, str, bool]:
    """(bytes the plan may use, a label, whether it is the host): the CUDA GPU's memory, else the host's."""
    import torch

    from engine.model.checkpoint import resolve_device
    from engine.model.pair_plan import CUDA_CONTEXT_BYTES
    from engine.offload.host_memory import host_memory_available

    device = resolve_device(config.model.device)
    if device.type == "cuda":  # CUDA-only
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"{props.name} ({props.total_memory / GB:.1f} GB)", False
    available = host_memory_available()
    return available + CUDA_CONTEXT_BYTES, f"the CPU ({available / GB:.1f} GB of host memory available)", True


def resolve_auto(config: EngineConfig, target_id: str) -> tuple[str, str]:
    """choose_draft for this machine's device."""
    device_bytes, label, on_cpu = on_device(config)
    return choose_draft(plan_config(config, on_cpu), target_id, device_bytes, label)

