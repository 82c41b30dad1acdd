"""The sampling defaults that suit a code model, by measurement: `temperature`, `top_p`, `top_k` chosen on
held-out code, for its generation_config.json (which `--generation-config auto` applies).

    python -m builder.sampling_sweep models/default/target --write   # the table, the choice, written

Prompts: held-out files of the build's split (build-default's, sha1(path) % 50 == 0), each cut at a seeded
top-level `def`/`class` line, its first lines up to PROMPT_TOKENS tokens (whole lines). Each setting samples
SAMPLES_PER_PROMPT continuations of NEW_TOKENS tokens per prompt with the target alone (transformers'
`generate`: penalties, then temperature, top_k, top_p, as the engine orders them; seeded).

The measure, which needs neither the draft nor a judge model: a continuation is **good** when
- prompt + continuation, cut to whole lines, is a valid start of a Python program (`codeop`: it compiles, or
  fails only for want of what comes next: an open block, bracket or docstring), and
- it repeats itself no more than real code does: its share of non-blank lines that repeat an earlier line
  of the same continuation is at most the REAL_QUANTILE quantile of the same share in the files' own
  continuations of the same prompts (so greedy loops like `self.assertEqual(s, b'')` x 8 fail).
Word salad fails the first test, degenerate loops the second. The score is the share of good
continuations (with its binomial standard error); the mean log-likelihood per token the target gives its
own samples is printed beside it, for scale. The choice (`choose`): of the settings within one standard
error of the best, the lowest temperature. build-default runs the sweep on every pair it builds. Speculation never changes these distributions: any setting
is served exactly, only tokens per pass differ.
"""

from __future__ import annotations

import argparse
import codeop
import itertools
import json
import math
import random
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from builder import training as tr

HELDOUT_MOD = 50  # build-default's held-out split
PROMPT_TOKENS = 48
NEW_TOKENS = 64
NUM_PROMPTS = 96
SAMPLES_PER_PROMPT = 3
REAL_QUANTILE = 0.9
TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
TOP_PS = (1.0, 0.9)
TOP_KS = (0, 20)


@dataclass(frozen=True)
class Setting:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    def describe(self) -> str:
        if self.temperature == 0:
            return "greedy"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}"


@dataclass(frozen=True)
class Score:
    setting: Setting
    good: float  # share of good continuations
    valid: float  # share that are valid Python starts
    looping: float  # share that repeat lines more than real code
    loglik: float  # mean log-likelihood per token of the samples under the target (unprocessed)
    count: int

    @property
    def stderr(self) -> float:
        return math.sqrt(self.good * (1 - self.good) / self.count)


def valid_python_start(text: str) -> bool:
    """Whether `text`, cut to whole lines, is a valid start of a Python program (module doc)."""
    text = text[: text.rfind("\n") + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in sampled strings: warnings, not errors
        try:
            codeop.compile_command(text, "<sample>", "exec")
        except (SyntaxError, ValueError, OverflowError):
            return False
    return True


def repeated_line_share(text: str) -> float:
    """Share of the non-blank lines of `text` that repeat an earlier line of it (stripped)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return 0.0 if not lines else 1 - len(set(lines)) / len(lines)


def prompts_from(texts: list[str], tok: PreTrainedTokenizerBase, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, the file's own continuation of NEW_TOKENS tokens) at seeded top-level def/class lines."""
    rng = random.Random(seed)
    starts = [(t, i) for t, text in enumerate(texts) for i, line in enumerate(text.splitlines(keepends=True))
              if line.startswith(("def ", "class "))]
    rng.shuffle(starts)
    found: list[tuple[str, str]] = []
    for text_index, line_index in starts:
        lines = texts[text_index].splitlines(keepends=True)[line_index:]
        prompt = ""
        for line in lines:
            if len(tok.encode(prompt + line, add_special_tokens=False)) > PROMPT_TOKENS:
                break
            prompt += line
        rest = "".join(lines)[len(prompt):]
        rest_ids = tok.encode(rest, add_special_tokens=False)
        if prompt and len(rest_ids) >= NEW_TOKENS:
            found.append((prompt, tok.decode(rest_ids[:NEW_TOKENS])))
        if len(found) == count:
            break
    return found


@torch.no_grad()
def sample(model: torch.nn.Module, tok: PreTrainedTokenizerBase, prompts: list[str], setting: Setting,
           samples: int, seed: int) -> tuple[list[str], float]:
    """(continuations, prompt by prompt and `samples` each; mean log-likelihood per token under the target)."""
    torch.manual_seed(seed)
    tok.padding_side = "left"
    batch = tok([p for p in prompts for _ in range(samples)], return_tensors="pt", padding=True)
    greedy = setting.temperature == 0
    extra = {} if greedy else {"temperature": setting.temperature, "top_p": setting.top_p, "top_k": setting.top_k}
    out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=not greedy,
                         pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True, **extra)
    new = out.sequences[:, batch["input_ids"].shape[1]:]  # [n, NEW_TOKENS]
    logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [n, NEW_TOKENS, vocab]
    loglik = logprobs.gather(-1, new.unsqueeze(-1)).mean().item()
    return tok.batch_decode(new, skip_special_tokens=True), loglik


def score(model: torch.nn.Module, tok: PreTrainedTokenizerBase, cases: list[tuple[str, str]], setting: Setting,
          loop_limit: float, samples: int = SAMPLES_PER_PROMPT, seed: int = 0) -> Score:
    prompts = [prompt for prompt, _ in cases]
    texts, loglik = sample(model, tok, prompts, setting, samples, seed)
    full = [prompts[i // samples] + text for i, text in enumerate(texts)]
    valid = [valid_python_start(text) for text in full]
    looping = [repeated_line_share(text) > loop_limit for text in texts]
    good = [v and not lo for v, lo in zip(valid, looping, strict=True)]
    n = len(texts)
    return Score(setting, sum(good) / n, sum(valid) / n, sum(looping) / n, loglik, n)


def loop_limit_of(cases: list[tuple[str, str]]) -> float:
    """REAL_QUANTILE quantile of the repeated-line share of the files' own continuations."""
    shares = sorted(repeated_line_share(real) for _, real in cases)
    return shares[min(len(shares) - 1, int(REAL_QUANTILE * len(shares)))]


def grid(temperatures: tuple[float, ...] = TEMPERATURES) -> list[Setting]:
    return [Setting(0.0)] + [Setting(t, p, k) for t, p, k in itertools.product(temperatures, TOP_PS, TOP_KS)]


@dataclass(frozen=True)
class Sweep:
    prompts: int
    samples: int
    real_valid: float  # share of the files' own continuations that are valid Python starts
    loop_limit: float
    scores: tuple[Score, ...]
    chosen: Score
    seconds: float


def run_sweep(model: torch.nn.Module, tok: PreTrainedTokenizerBase, heldout: list[str], prompts: int = NUM_PROMPTS,
              samples: int = SAMPLES_PER_PROMPT, temperatures: tuple[float, ...] = TEMPERATURES,
              progress: bool = False) -> Sweep | None:
    """Every setting of the grid scored on `prompts` held-out prompts; None when the texts give fewer than 2."""
    started = time.monotonic()
    cases = prompts_from(heldout, tok, prompts)
    if len(cases) < 2:
        return None
    limit = loop_limit_of(cases)
    scores = []
    for setting in grid(temperatures):
        scores.append(score(model, tok, cases, setting, limit, samples))
        if progress:
            print(table_row(scores[-1]), flush=True)
    real_valid = sum(valid_python_start(prompt + real) for prompt, real in cases) / len(cases)
    return Sweep(len(cases), samples, real_valid, limit, tuple(scores), choose(scores), time.monotonic() - started)


def choose(scores: list[Score]) -> Score:
    """Of the sampled settings within one standard error of the best sampled score, the lowest temperature
    (trees accept more tokens per pass as it falls, and below --specinfer-temperature unseeded requests keep
    SpecExec trees), then the best score. Greedy is in the table for scale, never a sampling default."""
    sampled = [s for s in scores if s.setting.temperature > 0]
    best = max(sampled, key=lambda s: s.good)
    near = [s for s in sampled if s.good >= best.good - best.stderr]
    return min(near, key=lambda s: (s.setting.temperature, -s.good))


def write_defaults(folder: Path, setting: Setting) -> None:
    """Set `setting` in `folder`'s generation_config.json (do_sample on, as checkpoints that ship sampling do)."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.update(do_sample=True, temperature=setting.temperature, top_p=setting.top_p, top_k=setting.top_k)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def table_row(result: Score) -> str:
    return (f"| {result.setting.describe()} | {result.good:.1%} ± {result.stderr:.1%} | {result.valid:.1%} | "
            f"{result.looping:.1%} | {result.loglik:.2f} |")


def card_lines(sweep: Sweep | None) -> list[str]:
    """The model card's section: the measure, the table, the choice."""
    if sweep is None:
        return ["## Sampling defaults", "", "None set: the held-out files gave too few prompts for the sweep.", ""]
    chosen = sweep.chosen.setting
    return [
        "## Sampling defaults",
        "",
        f"generation_config.json sets **temperature {chosen.temperature:g}, top_p {chosen.top_p:g}, top_k "
        f"{chosen.top_k}**, which `specexec serve` applies to requests that leave them out "
        "(`--generation-config auto`, the default). Chosen by `python -m builder.sampling_sweep` "
        f"({sweep.seconds / 60:.1f} min): {sweep.prompts} held-out prompts (a top-level `def`/`class` and its first "
        f"lines, up to {PROMPT_TOKENS} tokens) x {sweep.samples} samples x {NEW_TOKENS} tokens per setting, the "
        "target alone. A continuation is *good* when prompt + continuation (whole lines) is a valid start of a "
        "Python program (`codeop`: it compiles, or fails only for want of what follows) and it repeats lines "
        f"no more than real code: its share of non-blank lines that repeat an earlier one at most "
        f"{sweep.loop_limit:.2f}, the {REAL_QUANTILE:.0%} quantile of that share in the files' own continuations "
        f"of the same prompts{' (so: no repeated line)' if sweep.loop_limit == 0 else ''}; {sweep.real_valid:.0%} of "
        "those are valid starts. Word salad fails the first test, greedy loops the second; neither needs "
        "the draft or a judge model. The choice: of the sampled settings within one standard error of the best, "
        "the lowest temperature (trees accept more tokens per pass as it falls); greedy is there for scale.",
        "",
        "| setting | good | valid | looping | target log-likelihood per token of the sample |",
        "|---|--:|--:|--:|--:|",
        *(table_row(result) for result in sweep.scores),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="target folder (weights and tokenizer)")
    parser.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--samples", type=int, default=SAMPLES_PER_PROMPT)
    parser.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)))
    parser.add_argument("--write", action="store_true",
                        help="set the chosen defaults in the checkpoint's generation_config.json")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    heldout = tr.read_texts(args.corpus, tr.list_corpus_files(args.corpus), HELDOUT_MOD)[1]
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    sweep = run_sweep(model, tok, heldout, args.prompts, args.samples, temperatures, progress=True)
    print("\n".join(card_lines(sweep)))
    if sweep is not None and args.write:
        write_defaults(args.checkpoint, sweep.chosen.setting)
        print(f"written to {args.checkpoint / 'generation_config.json'}")
    return 0 if sweep is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
