"""`specexec build-default`: build the built-in default target/draft pair from the Python stdlib sources.

Pipeline: byte-level BPE tokenizer on the stdlib's own .py files (a deterministic slice of files held
out), a small Llama target trained by next-token prediction, a ~5x smaller Llama draft distilled from
the target (KL to its logits plus a little CE), both saved as fp16 HF checkpoints with the identical
tokenizer, then evaluated on the held-out slice and described in MODEL_CARD.md.

    python -m builder.build_default --out models/default --threads 1
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import shlex
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from builder import fim_corpus, fim_eval
from builder import training as tr

SAMPLE_PROMPT = "def fibonacci(n):\n"
FIM_SAMPLE = ("def add(a, b):\n    return ", "\n\n\ndef sub(a, b):\n    return a - b\n")  # (prefix, suffix)
ACCEPTANCE_PROMPTS = 5  # code prompts of bench.prompts
ACCEPTANCE_TOKENS = 64  # new tokens per prompt
ACCEPTANCE_BUDGET = 64

# name: (full-run default, --toy default)
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "max_files": (None, 24),
    "vocab_size": (4096, 400),
    "seq_len": (256, 32),
    "batch_size": (4, 2),
    "target_hidden": (256, 32),
    "target_layers": (4, 2),
    "target_heads": (4, 2),
    "target_intermediate": (704, 64),
    "draft_hidden": (96, 8),
    "draft_layers": (2, 1),
    "draft_heads": (2, 1),
    "draft_intermediate": (256, 16),
    "target_steps": (7600, 4),
    "draft_steps": (5500, 4),
    "target_minutes": (62.0, None),
    "draft_minutes": (32.0, None),
    "eval_tokens": (131072, 512),
    "sample_tokens": (80, 8),
    "fim_eval_examples": (fim_eval.NUM_EXAMPLES, 4),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `specexec build-default` (unset size flags take the full-run or the --toy default)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    parser.add_argument("--out", type=Path, default=Path("models/default"), help="output folder")
    parser.add_argument("--corpus", type=Path, default=Path(stdlib), help="folder of .py sources")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="train on this device (cpu, cuda); evaluation runs on CPU")
    parser.add_argument("--toy", action="store_true", help="tiny corpus slice, tiny models, a few steps")
    parser.add_argument("--heldout-mod", type=int, default=50, help="hold out 1 file in N (by path hash)")
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--kd-weight", type=float, default=0.9, help="KL weight in the draft loss")
    parser.add_argument("--max-positions", type=int, default=1024)
    parser.add_argument("--fim-rate", type=float, default=0.5, help="fraction of train files made FIM examples")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="stored weights")
    for name, (full, toy) in DEFAULTS.items():
        kind = float if name.endswith("minutes") else int
        parser.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=None, help=f"default {full} ({toy} with --toy)"
        )


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """All settings of a build: explicit flags win over the full-run / --toy defaults."""
    settings = {k: v for k, v in vars(args).items() if k not in DEFAULTS and k != "func"}
    for name, (full, toy) in DEFAULTS.items():
        value = getattr(args, name, None)
        settings[name] = value if value is not None else (toy if args.toy else full)
    return settings


@dataclass
class Corpus:
    tokenizer: PreTrainedTokenizerFast
    train_ids: torch.Tensor  # int32 [n_train_tokens]
    heldout_ids: torch.Tensor  # int32 [n_heldout_tokens]
    heldout_texts: list[str]
    train_files: int
    heldout_files: int
    train_bytes: int
    fim_examples: int
    seconds: float


def build_corpus(s: dict[str, Any]) -> Corpus:
    """Read the corpus, split off the held-out files, train the tokenizer on the rest, encode both."""
    start = time.monotonic()
    root = Path(s["corpus"])
    files = tr.list_corpus_files(root, s["max_files"])
    train, heldout = tr.read_texts(root, files, s["heldout_mod"])
    if not heldout:  # a tiny slice may hash no file into the held-out set: take the last one
        heldout = [train.pop()]
    tok = tr.train_tokenizer(train, s["vocab_size"])
    tok.model_max_length = s["max_positions"]
    tok.model_input_names = ["input_ids", "attention_mask"]
    tok.init_kwargs["fim_order"] = fim_corpus.FIM_ORDER  # saved in tokenizer_config.json for the server
    documents = fim_corpus.apply_fim(train, s["fim_rate"], s["seed"])
    n_fim = sum(doc.startswith(fim_corpus.FIM_PREFIX) for doc in documents)
    train_ids, heldout_ids = tr.encode_stream(tok, documents), tr.encode_stream(tok, heldout)
    n_bytes = sum(len(t.encode("utf-8")) for t in train)
    seconds = time.monotonic() - start
    return Corpus(tok, train_ids, heldout_ids, heldout, len(train), len(heldout), n_bytes, n_fim, seconds)


def shapes(s: dict[str, Any]) -> tuple[tr.ModelShape, tr.ModelShape]:
    """(target shape, draft shape) from the settings."""
    target = tr.ModelShape(
        s["target_hidden"], s["target_layers"], s["target_heads"], s["target_intermediate"]
    )
    draft = tr.ModelShape(s["draft_hidden"], s["draft_layers"], s["draft_heads"], s["draft_intermediate"])
    return target, draft


def stage_spec(s: dict[str, Any], role: str) -> tr.StageSpec:
    """Training stage settings for `role` ("target" or "draft")."""
    steps = s[f"{role}_steps"]
    return tr.StageSpec(
        name=role,
        steps=steps,
        minutes=s[f"{role}_minutes"],
        lr=s[f"{role}_lr"],
        batch_size=s["batch_size"],
        seq_len=s["seq_len"],
        warmup=min(100, max(1, steps // 10)),
    )


def save_checkpoint(model: torch.nn.Module, tok: PreTrainedTokenizerFast, path: Path, dtype: str) -> int:
    """save_pretrained a half-precision copy plus generation config and tokenizer; returns bytes on disk."""
    path.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to("cpu", getattr(torch, dtype))
    half.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    half.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def load_checkpoint(path: Path) -> torch.nn.Module:
    """Reload a saved checkpoint in fp32 for evaluation (as the server runs it on CPU)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def sample(model: torch.nn.Module, tok: PreTrainedTokenizerFast, max_new_tokens: int) -> str:
    """Greedy continuation of SAMPLE_PROMPT (prompt included)."""
    enc = tok(SAMPLE_PROMPT, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)  # [1, prompt + new]
    return tok.decode(out[0], skip_special_tokens=True)


@torch.no_grad()
def fim_sample(model: torch.nn.Module, tok: PreTrainedTokenizerFast, max_new_tokens: int) -> str:
    """Greedy middle for FIM_SAMPLE's prefix and suffix (stops at EOS)."""
    enc = tok(fim_corpus.fim_prompt(*FIM_SAMPLE), return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)  # [1, prompt + new]
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def train_pair(s: dict[str, Any], corpus: Corpus, out: Path) -> dict[str, Any]:
    """Train and save the target, then distil and save the draft; returns the training facts."""
    t_shape, d_shape = shapes(s)
    torch.manual_seed(s["seed"])
    device = torch.device(s["device"])
    target = tr.make_model(t_shape, corpus.tokenizer, s["max_positions"]).to(device)
    draft = tr.make_model(d_shape, corpus.tokenizer, s["max_positions"]).to(device)
    t_params, d_params = tr.count_params(target), tr.count_params(draft)
    print(f"target params {t_params:,}  draft params {d_params:,}  ratio {t_params / d_params:.2f}")
    if d_params * 5 > t_params:
        raise ValueError(f"draft has {d_params:,} params, more than 1/5 of the target's {t_params:,}")
    t_run = tr.train_stage(target, corpus.train_ids, stage_spec(s, "target"), s["seed"])
    t_bytes = save_checkpoint(target, corpus.tokenizer, out / "target", s["dtype"])
    d_run = tr.train_stage(
        draft,
        corpus.train_ids,
        stage_spec(s, "draft"),
        s["seed"] + 1,
        teacher=target,
        kd_weight=s["kd_weight"],
    )
    d_bytes = save_checkpoint(draft, corpus.tokenizer, out / "draft", s["dtype"])
    return {
        "target_params": t_params,
        "draft_params": d_params,
        "target_run": t_run,
        "draft_run": d_run,
        "target_bytes": t_bytes,
        "draft_bytes": d_bytes,
    }


def checks(facts: dict[str, Any], ev: tr.EvalResult) -> dict[str, bool]:
    """The issue's acceptance criteria for the default pair."""
    return {
        "target loss >= 0.3 nats below draft": ev.draft_loss - ev.target_loss >= 0.3,
        "top-1 agreement >= 50%": ev.agreement >= 0.5,
        "pair size <= 50 MB": facts["target_bytes"] + facts["draft_bytes"] <= 50_000_000,
    }


def run(args: argparse.Namespace) -> int:
    """Build the default pair into args.out; returns 0 when every acceptance check passes (or --toy)."""
    s = resolve(args)
    torch.set_num_threads(s["threads"])
    out, start = Path(s["out"]), time.monotonic()
    corpus = build_corpus(s)
    print(
        f"corpus: {corpus.train_files} train files ({corpus.train_ids.numel():,} tokens), "
        f"{corpus.heldout_files} held-out files ({corpus.heldout_ids.numel():,} tokens), "
        f"{corpus.seconds:.1f} s"
    )
    facts = train_pair(s, corpus, out)
    target, draft = load_checkpoint(out / "target"), load_checkpoint(out / "draft")
    ev = tr.evaluate_pair(target, draft, corpus.heldout_ids, s["seq_len"], s["eval_tokens"])
    facts["samples"] = {
        "target": sample(target, corpus.tokenizer, s["sample_tokens"]),
        "draft": sample(draft, corpus.tokenizer, s["sample_tokens"]),
        "fim": fim_sample(target, corpus.tokenizer, s["sample_tokens"]),
    }
    fim_cases = fim_eval.examples(corpus.heldout_texts, s["fim_eval_examples"])
    facts["fim_eval"] = fim_eval.score(target, corpus.tokenizer, fim_cases)
    facts["tokens_per_pass"] = tokens_per_pass(out)
    facts["seconds"] = time.monotonic() - start
    results = checks(facts, ev)
    card = model_card(s, corpus, facts, ev, results)
    (out / "MODEL_CARD.md").write_text(card, encoding="utf-8")
    print(card)
    return 0 if s["toy"] or all(results.values()) else 1


def model_card(
    s: dict[str, Any], corpus: Corpus, facts: dict[str, Any], ev: tr.EvalResult, results: dict[str, bool]
) -> str:
    """MODEL_CARD.md text: command, data, sizes, training, held-out figures, checks, samples."""
    t_shape, d_shape = shapes(s)
    lines = [
        "# Default SpecExec model pair (built by `specexec build-default`)",
        "",
        "A small Llama target and a distilled Llama draft for Python code completion, trained from",
        f"scratch on this machine's {'Python standard library sources' if is_stdlib(s) else 'sources in the corpus below'}."
        " No downloaded weights or data.",
        "",
        "## Command",
        "",
        f"    {shlex.join([Path(sys.executable).name, '-m', 'builder.build_default', *sys.argv[1:]])}",
        "",
        f"- Seed {s['seed']}, trained on {s['device']}, {s['threads']} torch thread(s), Python {platform.python_version()}, "
        f"torch {torch.__version__}, corpus `{s['corpus']}`",
        f"- Total build time {facts['seconds'] / 60:.1f} min",
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
    ]
    return "\n".join(lines)


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


def is_stdlib(s: dict[str, Any]) -> bool:
    return Path(s["corpus"]) == Path(sysconfig.get_paths()["stdlib"])


def _data_lines(s: dict[str, Any], corpus: Corpus) -> list[str]:
    folder = "the stdlib folder" if is_stdlib(s) else f"`{s['corpus']}`"
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
        f"- Byte-level BPE, vocab {len(corpus.tokenizer)} (trained on the train files only); special tokens "
        f"{', '.join(f'`{t}`' for t in tr.SPECIAL_TOKENS)} are atomic. BOS is prepended on encode; documents "
        "are `BOS text EOS`. Chat template: `<|role|>\\n...<|eos|>\\n` turns, with add_generation_prompt.",
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
        lines.append(
            f"- {role}: {how}, AdamW lr {s[f'{role}_lr']}, batch {s['batch_size']} x {s['seq_len']}, "
            f"{r.steps} steps{cut} of {s[f'{role}_steps']} planned, {r.tokens:,} tokens, "
            f"{r.seconds / 60:.1f} min ({r.tokens / max(r.seconds, 1e-9):,.0f} tokens/s), "
            f"final train loss (EMA) {r.final_loss:.3f}"
        )
    return [*lines, ""]


def tokens_per_pass(out: Path) -> dict[tuple[str, float], float]:
    """Mean tokens per target pass (accepted + bonus) of the saved pair, at budget ACCEPTANCE_BUDGET,
    over the first ACCEPTANCE_PROMPTS code prompts: {(method, temperature): value}."""
    from bench.prompts import CODE_PROMPTS
    from engine.config import EngineConfig, ModelConfig, SpeculationConfig
    from engine.runtime import Engine
    from engine.types import Request, SamplingParams

    models = ModelConfig(target=str(out / "target"), draft=str(out / "draft"))
    base = Engine.load(EngineConfig(model=models, speculation=SpeculationConfig(budget=ACCEPTANCE_BUDGET)))
    new_tokens = min(ACCEPTANCE_TOKENS, base.max_context // 2)
    texts = CODE_PROMPTS[:ACCEPTANCE_PROMPTS]
    prompts = [base.tokenizer.encode(text)[: base.max_context - new_tokens] for text in texts]
    figures = {}
    for method in ("specexec", "specinfer"):
        engine = base.with_speculation(dataclasses.replace(base.config.speculation, method=method))
        for temperature in (0.0, 0.6):
            tokens = passes = 0
            for idx, prompt in enumerate(prompts):
                params = SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=idx, ignore_eos=True)
                for delta in engine.generate(Request(f"card-{idx}", prompt, params)):
                    if delta.totals is not None:
                        tokens += delta.totals.accepted_tokens + delta.totals.target_passes
                        passes += delta.totals.target_passes
            figures[method, temperature] = tokens / max(passes, 1)
    return figures


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m builder.build_default", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
