"""Where a self-draft fits: the largest budget (and context) at which `--draft self` fits a GPU.

    fit = self_draft_fit("Qwen/Qwen3-32B", total_bytes=24 * 10**9)  # SelfDraftFit: the plan and its flags

Every layer streamed is the smallest self-draft plan (each resident layer costs its full size in
place of its 4-bit copy), so a (context, budget) that does not fit with no resident layer fits with
none; the first (longest context, then largest budget) that fits gets as many resident layers as
still fit (pair_plan.most_resident_that_fit). The arithmetic is pair_plan's: the server's startup plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SELF_DRAFT, EngineConfig, ModelConfig, OffloadConfig
from engine.model import config_shapes, self_draft_plan
from engine.model.pair_plan import GB, PairPlan, gpu_memory_flag, most_resident_that_fit, plan_pair

BUDGETS = (1024, 512, 256, 128, 64)  # tried largest first
CONTEXTS = (8192, 4096, 2048, 1024)  # max context tried, longest first (capped at the target's trained positions)


@dataclass(frozen=True)
class SelfDraftFit:
    target: str
    refusal: str | None  # why the target cannot have a self-draft at all
    copy_bytes: int  # the 4-bit copy of every layer
    num_layers: int
    plan: PairPlan | None  # the fitting plan: longest context, largest budget, most resident layers
    flags: str  # the flags that give it

    @property
    def fits(self) -> bool:
        return self.plan is not None


def self_draft_config(target: str, budget: int, max_context: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=target, draft=SELF_DRAFT),
                        offload=OffloadConfig(enabled=True, resident_layers=0)).replace(
        "speculation", budget=budget).replace("limits", max_context=max_context)


def trained_contexts(config: dict) -> list[int]:
    trained = config.get("max_position_embeddings") or CONTEXTS[0]
    return sorted({min(context, trained) for context in CONTEXTS}, reverse=True)


def self_draft_fit(target: str, total_bytes: int) -> SelfDraftFit:
    """The best self-draft plan of `target` on a CUDA GPU of `total_bytes` (module doc)."""
    config, _ = config_shapes.read_model_config(target)
    why = self_draft_plan.target_refusal(config)
    if why is not None:
        return SelfDraftFit(target, why, 0, config["num_hidden_layers"], None, "")
    copy_bytes = sum(self_draft_plan.layer_copy_bytes(config, 2))
    for context in trained_contexts(config):
        for budget in BUDGETS:
            if not plan_pair(self_draft_config(target, budget, context), total_bytes).fits:
                continue
            plan = most_resident_that_fit(self_draft_config(target, budget, context), total_bytes)
            assert plan is not None  # no resident layer fits
            shorter = f" --max-context {context}" if context < trained_contexts(config)[0] else ""
            return SelfDraftFit(target, None, copy_bytes, config["num_hidden_layers"], plan,
                                f"--draft self --offload {gpu_memory_flag(plan)} --budget {budget}{shorter}")
    return SelfDraftFit(target, None, copy_bytes, config["num_hidden_layers"], None, "")


def describe_fit(fit: SelfDraftFit) -> str:
    """One line for `specexec plan`: the flags and what they give, or why not."""
    if fit.refusal is not None:
        return f"self-draft: not for this target ({fit.refusal})"
    if fit.plan is None:
        return (f"self-draft: does not fit this GPU (its 4-bit copy of every layer is {fit.copy_bytes / GB:.2f} GB; "
                f"nothing fits down to budget {BUDGETS[-1]} and a {CONTEXTS[-1]}-token context)")
    plan = fit.plan
    return (f"self-draft: `{fit.flags}` fits: {plan.resident_layers} of {plan.num_layers} layers resident and "
            f"shared, 4-bit copies of the other {plan.num_layers - plan.resident_layers} "
            f"({plan.inputs.loaded['draft weights'] / GB:.2f} GB), KV slots {plan.running} running + "
            f"{plan.cache_slots} prefix cache, {plan.plan.total / GB:.2f} GB")


def table_row(fit: SelfDraftFit) -> str:
    """A markdown row: target, layers, 4-bit copy, the fitting plan's budget, context, resident layers, GB."""
    if fit.refusal is not None:
        return f"| `{fit.target}` | {fit.num_layers} | | no: {fit.refusal.split(' (')[0]} | | | | | |"
    if fit.plan is None:
        return f"| `{fit.target}` | {fit.num_layers} | {fit.copy_bytes / GB:.2f} | no | | | | | |"
    plan = fit.plan
    return (f"| `{fit.target}` | {plan.num_layers} | {fit.copy_bytes / GB:.2f} | yes | {plan.inputs.budget} | "
            f"{plan.inputs.max_context} | {plan.resident_layers} | {plan.plan.total / GB:.2f} | `{fit.flags}` |")


def print_table(targets: list[str], total_bytes: int) -> None:
    print("| target | layers | 4-bit copy, all layers (GB) | self-draft fits | budget | max context | "
          "resident layers | GB | flags |")
    print("|---|--:|--:|---|--:|--:|--:|--:|---|")
    for target in targets:
        print(table_row(self_draft_fit(target, total_bytes)))
