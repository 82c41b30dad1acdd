"""MODEL_CARD.md of a pair built (or trained further) by `specexec build-default`."""

from __future__ import annotations

import platform
import shlex
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch

from builder import fim_corpus, fim_eval, sampling_sweep
from builder import training as tr
from builder.corpus import Corpus
from builder.pair_eval import (
    ACCEPTANCE_BUDGET,
    ACCEPTANCE_PROMPTS,
    ACCEPTANCE_TOKENS,
    FIM_SAMPLE,
    INDENTED_PROMPTS,
)

EARLIER_TITLE = "Earlier training"
# Sections of the card of the pair a run started from that its own card quotes
QUOTED_SECTIONS = ("Command", EARLIER_TITLE, "Data and tokenizer", "Training", "Held-out evaluation")


def model_card(
    s: dict[str, Any], corpus: Corpus, facts: dict[str, Any], ev: tr.EvalResult, results: dict[str, bool]
) -> str:
    """MODEL_CARD.md text: command, earlier training, data, sizes, training, held-out figures, checks, samples."""
    t_shape, d_shape = facts["target_shape"], facts["draft_shape"]
    lines = [
        "# Default SpecExec model pair (built by `specexec build-default`)",
        "",
        "A small Llama target and a distilled Llama draft for Python code completion, trained from",
        f"scratch on this machine's {'Python standard library sources' if is_stdlib(s) else 'sources in the corpus below'}"
        + (f": the pair in `{s['init_from']}` (made as '{EARLIER_TITLE}' says), trained further by the command "
           "below." if s["init_from"] else ".")
        + " No downloaded weights or data.",
        "",
        "## Command",
        "",
        f"    {shlex.join([Path(sys.executable).name, '-m', 'builder.build_default', *s['argv']])}",
        "",
        f"- Seed {s['seed']}, trained on {s['device']}, {s['threads']} torch thread(s), Python {platform.python_version()}, "
        f"torch {torch.__version__}, corpus `{s['corpus']}`",
        f"- Total {'time of this run' if s['init_from'] else 'build time'} {facts['seconds'] / 60:.1f} min",
        *facts["earlier"],
        *_data_lines(s, corpus),
        "",
        "## Models",
        "",
        "| | hidden | layers | heads | MLP | params (embeddings incl., tied) | file size |",
        "|---|---|---|---|---|---|---|",
        _model_row("target", t_shape, facts["target_params"], facts["target_bytes"]),
        _model_row("draft", d_shape, facts["draft_params"], facts["draft_bytes"]),
        "",
        f"Ratio target/draft params: {facts['target_params'] / facts['draft_params']:.2f}. "
        f"Weights stored as {s['dtype']}; trained in fp32 on context windows of {s['seq_len']} tokens "
        f"(max_position_embeddings {s['max_positions']}; quality beyond {s['seq_len']} tokens is untested).",
        "",
        *_training_lines(s, facts),
        *_eval_lines(ev, results, facts["tokens_per_pass"], facts["fim_eval"]),
        *sampling_sweep.card_lines(facts["sampling"]),
        "## Greedy samples (prompt `def fibonacci(n):\\n`)",
        "",
        "Target:",
        "",
        "```python",
        facts["samples"]["target"],
        "```",
        "",
        "Draft:",
        "",
        "```python",
        facts["samples"]["draft"],
        "```",
        "",
        *_fim_lines(facts["samples"]["fim"]),
        *_indented_lines(facts["samples"]["indented"]),
    ]
    return "\n".join(lines)


def earlier_lines(init_from: Path) -> list[str]:
    """The card of the pair in `init_from`, its QUOTED_SECTIONS one heading level down."""
    card = init_from / "MODEL_CARD.md"
    head = ["", f"## {EARLIER_TITLE}", ""]
    if not card.exists():
        return [*head, f"`{init_from}` had no MODEL_CARD.md: how it was trained is not known here."]
    quoted, keep = [], False
    for line in card.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            keep = line[3:].startswith(QUOTED_SECTIONS)
        elif line.startswith("# "):
            keep = False
        if keep:
            quoted.append("#" + line if line.startswith("##") else line)
    note = (
        f"This run started from the pair in `{init_from}`. Its MODEL_CARD.md said (sections "
        f"{', '.join(QUOTED_SECTIONS)}, as written; where its data section does not say that parts of a "
        "document are tokenized apart, each document was tokenized as one text):"
    )
    return [*head, note, "", *quoted]


def _fim_lines(middle: str) -> list[str]:
    prefix, suffix = FIM_SAMPLE
    return [
        "## Fill-in-the-middle sample (target greedy; the pair's output is the same)",
        "",
        f"Prefix `{prefix!r}`, suffix `{suffix!r}`; middle filled in: `{middle!r}`. The whole file:",
        "",
        "```python",
        prefix + middle + suffix,
        "```",
        "",
    ]


def _indented_lines(continuations: list[str]) -> list[str]:
    """Each INDENTED_PROMPTS prompt with its greedy continuation."""
    num_code = sum(bool(text.strip()) for text in continuations)
    return [
        "## Prompts ending in an indented new line (target greedy, at most 16 tokens)",
        "",
        f"Where Enter and auto-indent leave an editor's cursor; {num_code} of {len(continuations)} continue "
        "with code (the pair's output is the same):",
        "",
        *(f"- `{prompt!r}` -> `{text!r}`" for prompt, text in zip(INDENTED_PROMPTS, continuations, strict=True)),
        "",
    ]


def is_stdlib(s: dict[str, Any]) -> bool:
    return Path(s["corpus"]) == Path(sysconfig.get_paths()["stdlib"])


def _data_lines(s: dict[str, Any], corpus: Corpus) -> list[str]:
    folder = "the stdlib folder" if is_stdlib(s) else f"`{s['corpus']}`"
    tokenizer_origin = f"taken over from `{s['init_from']}`, " if s["init_from"] else ""
    return [
        "",
        "## Data and tokenizer",
        "",
        f"- Corpus: `.py` files under {folder} (site-packages excluded, non-UTF-8 files skipped"
        + ("" if s["max_files"] is None else f", first {s['max_files']} files only")
        + ").",
        f"- Held out: files whose sha1(relative path) % {s['heldout_mod']} == 0: {corpus.heldout_files} files, "
        f"{corpus.heldout_ids.numel():,} tokens. Train: {corpus.train_files} files, "
        f"{corpus.train_bytes / 1e6:.1f} MB, {corpus.train_ids.numel():,} tokens (FIM examples included).",
        f"- Fill-in-the-middle: a seeded {s['fim_rate']:.0%} of the train files are cut at line ends into "
        f"pieces of {fim_corpus.MIN_PIECE_CHARS}-{fim_corpus.MAX_PIECE_CHARS}+ characters, each split at a "
        "cursor that does not cut a word; the middle runs to the end of the cursor's line or one or two "
        f"lines below it ({fim_corpus.LINE_END_SHARE:.0%}), else to a second random point. Written in SPM "
        "order, `<|fim_prefix|><|fim_suffix|>suf<|fim_middle|>pre mid` (then EOS), so the middle continues "
        f"the prefix directly; `fim_order: {fim_corpus.FIM_ORDER}` in tokenizer_config.json tells the server. "
        f"{corpus.fim_examples:,} FIM examples. The held-out figures below are on plain text.",
        "- Tokenized at the cursor, as the server tokenizes a prompt: a FIM example's prompt (ending at the "
        "cursor) and its middle are tokenized apart, and a seeded "
        f"{s['cut_rate']:.0%} of the other train files ({corpus.cut_documents:,} files) are cut at "
        f"{corpus.cuts:,} cursors (one per {fim_corpus.MIN_PIECE_CHARS}-{fim_corpus.MAX_PIECE_CHARS}+ "
        f"character piece: where an indented line's code starts {fim_corpus.CUT_INDENT_SHARE:.0%} of the time, else at a "
        "point that does not cut a word) whose parts are tokenized apart; the token before a cut is no training "
        "target (only a prompt ends there). Byte-level BPE gives a space run's "
        "last space to the next word, so a prompt ending in an indented new line ends in a token that "
        "whole-text tokenization does not put before code; the model meets both tokenizations.",
        f"- Byte-level BPE, vocab {len(corpus.tokenizer)} ({tokenizer_origin}trained on the train files only); "
        f"special tokens {', '.join(f'`{t}`' for t in tr.SPECIAL_TOKENS)} are atomic. BOS is prepended on "
        "encode; documents are `BOS text EOS`. Chat template: `<|role|>\\n...<|eos|>\\n` turns, with "
        "add_generation_prompt.",
        "- Both folders hold the identical tokenizer.",
    ]


def _model_row(name: str, shape: tr.ModelShape, params: int, size: int) -> str:
    return (
        f"| {name} | {shape.hidden} | {shape.layers} | {shape.heads} | {shape.intermediate} | "
        f"{params:,} | {size / 1e6:.2f} MB |"
    )


def _training_lines(s: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    lines = ["## Training", ""]
    for role, how in (("target", "next-token CE"), ("draft", f"{s['kd_weight']} x KL(target || draft) + CE")):
        r: tr.StageResult = facts[f"{role}_run"]
        cut = f" (stopped by the {s[f'{role}_minutes']} min limit)" if r.stopped_by_time else ""
        start = f"continued from `{Path(s['init_from']) / role}`, " if s["init_from"] else ""
        lines.append(
            f"- {role}: {start}{how}, AdamW lr {s[f'{role}_lr']}, batch {s['batch_size']} x {s['seq_len']}, "
            f"{r.steps} steps{cut} of {s[f'{role}_steps']} planned, {r.tokens:,} tokens, "
            f"{r.seconds / 60:.1f} min, {r.cpu_seconds / 60:.1f} CPU-min ({r.tokens / max(r.seconds, 1e-9):,.0f} tokens/s), "
            f"final train loss (EMA) {r.final_loss:.3f}"
        )
    return [*lines, ""]


def _eval_lines(
    ev: tr.EvalResult, results: dict[str, bool], per_pass: dict[tuple[str, float], float], fim: fim_eval.FimScore
) -> list[str]:
    return [
        f"## Held-out evaluation ({ev.positions:,} positions, fp16 checkpoints reloaded in fp32)",
        "",
        f"- Target loss: {ev.target_loss:.4f} nats/token (top-1 accuracy {ev.target_acc:.1%})",
        f"- Draft loss: {ev.draft_loss:.4f} nats/token (top-1 accuracy {ev.draft_acc:.1%})",
        f"- Gap draft - target: {ev.draft_loss - ev.target_loss:.4f} nats/token",
        f"- Draft/target top-1 agreement: {ev.agreement:.1%}",
        f"- Mean tokens per target pass at budget {ACCEPTANCE_BUDGET} (accepted draft tokens + the bonus "
        f"token), {ACCEPTANCE_PROMPTS} code prompts x {ACCEPTANCE_TOKENS} new tokens, measured with "
        "engine.Engine on this machine:",
        f"  SpecExec {per_pass['specexec', 0.0]:.2f} (greedy), {per_pass['specexec', 0.6]:.2f} (temperature "
        f"0.6); SpecInfer {per_pass['specinfer', 0.0]:.2f} (greedy), {per_pass['specinfer', 0.6]:.2f} "
        "(temperature 0.6).",
        *fim_eval.card_lines(fim),
        "",
        "Checks: " + "; ".join(f"{name}: {'PASS' if ok else 'FAIL'}" for name, ok in results.items()),
        "",
    ]
