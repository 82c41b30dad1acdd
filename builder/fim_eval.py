"""Fill-in-the-middle quality of a checkpoint on held-out files, as an editor would see it.

Examples are fim_corpus.fim_splits of held-out texts (seeded): a prefix, a middle and a suffix each.
The target alone generates greedily from the FIM prompt in its tokenizer's order (`fim_order` in the
tokenizer config: "spm", else "psm"), at most MAX_NEW_TOKENS, and the decoded text is compared with
the middle: exactly right, first line right (what a one-line tab completion shows), stopped with EOS,
and empty (EOS at once); and, teacher-forced, whether the target's most likely first token after the
prompt is the middle's first token (EOS for an empty middle), the middle tokenized alone. For scale,
`plain_first_line`: the first line right when the model just continues the prefix (no suffix, no FIM
markers), the model's plain-completion skill on the same cursors. Speculation does not change greedy
output, so the served pair gives the same text.

    python -m builder.fim_eval models/default/target
"""

from __future__ import annotations

import argparse
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from builder import fim_corpus
from builder import training as tr

MAX_NEW_TOKENS = 48
NUM_EXAMPLES = 200
HELDOUT_MOD = 50  # build-default's held-out split


@dataclass(frozen=True)
class FimScore:
    examples: int
    exact: float  # fraction whose generated middle equals the true one
    first_line: float  # fraction whose first generated line equals the middle's first line
    stopped: float  # fraction that ended with EOS within MAX_NEW_TOKENS
    empty: float  # fraction whose generated middle is empty (EOS first)
    true_empty: float  # fraction whose true middle is empty
    first_token: float  # fraction whose argmax after the prompt is the middle's first token (teacher-forced)
    plain_first_line: float  # first line right from a plain continuation of the prefix


def fim_order(tokenizer: PreTrainedTokenizerBase) -> str:
    return "spm" if str(tokenizer.init_kwargs.get("fim_order", "psm")).lower() == "spm" else "psm"


def prompt_text(order: str, prefix: str, suffix: str) -> str:
    """The FIM prompt (BOS excluded) in `order`; SPM is what build-default trains on."""
    if order == "spm":
        return fim_corpus.fim_prompt(prefix, suffix)
    return f"{fim_corpus.FIM_PREFIX}{prefix}{fim_corpus.FIM_SUFFIX}{suffix}{fim_corpus.FIM_MIDDLE}"


def examples(texts: list[str], count: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(prefix, middle, suffix) of the first `count` FIM pieces of `texts` (plain pieces skipped)."""
    rng = random.Random(seed)
    out = [part for text in texts for part in fim_corpus.fim_splits(text, rng) if isinstance(part, tuple)]
    return out[:count]


@torch.no_grad()
def score(model: torch.nn.Module, tok: PreTrainedTokenizerBase, cases: list[tuple[str, str, str]]) -> FimScore:
    order = fim_order(tok)
    exact = first_line = stopped = plain = first_token = empty = 0
    for prefix, middle, suffix in cases:
        prompt = prompt_text(order, prefix, suffix)
        first_token += int(first_token_right(model, tok, prompt, middle))
        text, ended = greedy(model, tok, prompt)
        exact += int(ended and text == middle)
        first_line += int(text.split("\n")[0] == middle.split("\n")[0])
        stopped += int(ended)
        empty += int(text == "")
        plain_text, _ = greedy(model, tok, prefix)
        plain += int(plain_text.split("\n")[0] == middle.split("\n")[0])
    n = max(len(cases), 1)
    return FimScore(
        examples=len(cases), exact=exact / n, first_line=first_line / n, stopped=stopped / n, empty=empty / n,
        true_empty=sum(middle == "" for _p, middle, _s in cases) / n, first_token=first_token / n,
        plain_first_line=plain / n,
    )


def first_token_right(model: torch.nn.Module, tok: PreTrainedTokenizerBase, prompt: str, middle: str) -> bool:
    """Whether the argmax after BOS + prompt is the first token of the middle encoded alone (EOS if empty)."""
    enc = tok(prompt, return_tensors="pt")
    middle_ids = tok.encode(middle, add_special_tokens=False) or [tok.eos_token_id]
    return int(model(**enc).logits[0, -1].argmax()) == middle_ids[0]


def greedy(model: torch.nn.Module, tok: PreTrainedTokenizerBase, prompt: str) -> tuple[str, bool]:
    """(decoded greedy continuation of BOS + prompt, whether it ended with EOS)."""
    enc = tok(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, enc["input_ids"].shape[1] :]
    return tok.decode(out, skip_special_tokens=True), tok.eos_token_id in out.tolist()


def heldout_texts(corpus: Path) -> list[str]:
    return tr.read_texts(corpus, tr.list_corpus_files(corpus), HELDOUT_MOD)[1]


def card_lines(result: FimScore) -> list[str]:
    return [
        f"- Fill-in-the-middle, {result.examples} held-out pieces split as in training, target greedy "
        f"(at most {MAX_NEW_TOKENS} tokens): middle exactly right {result.exact:.1%}, first line right "
        f"{result.first_line:.1%} (continuing the prefix without FIM: {result.plain_first_line:.1%}), ended with "
        f"EOS {result.stopped:.1%} (at once, an empty middle: {result.empty:.1%}; true middles that are empty: "
        f"{result.true_empty:.1%}), first middle token right {result.first_token:.1%} (teacher-forced; "
        "`python -m builder.fim_eval`).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="target folder (weights and tokenizer)")
    parser.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--examples", type=int, default=NUM_EXAMPLES)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    result = score(model, tok, examples(heldout_texts(args.corpus), args.examples))
    print("\n".join(card_lines(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
