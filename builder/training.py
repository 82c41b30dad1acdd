"""Corpus, tokenizer and training loops behind `specexec build-default`.

Everything here is CPU-friendly and deterministic for a fixed seed as long as each stage's step
count stays ahead of its elapsed share of the wall-clock limit: the learning-rate schedule follows
whichever of the two is further along (so a stage cut by the limit still ends annealed), so once
time leads, the schedule and results depend on the machine's speed.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from builder.fim_corpus import FIM_TOKENS, Document

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IGNORE = -100  # label of a position with no training target (cross_entropy's ignore_index)
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS, *FIM_TOKENS]

# One turn per message: "<|role|>\n{content}<|eos|>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


def list_corpus_files(root: Path, max_files: int | None = None) -> list[Path]:
    """Every .py file under `root` (site-packages excluded), sorted by relative path; read_texts
    skips the unreadable and non-UTF-8 ones."""
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "__pycache__" in rel or not path.is_file():
            continue
        files.append(path)
    if max_files is not None:
        files = files[:max_files]
    return files


def is_heldout(rel_path: str, heldout_mod: int) -> bool:
    """Deterministic held-out split: sha1 of the relative path, 1 file in `heldout_mod`."""
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % heldout_mod == 0


def read_texts(root: Path, files: list[Path], heldout_mod: int) -> tuple[list[str], list[str]]:
    """Split file contents into (train texts, held-out texts); files that are not UTF-8 are skipped."""
    train, heldout = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        rel = path.relative_to(root).as_posix()
        (heldout if is_heldout(rel, heldout_mod) else train).append(text)
    return train, heldout


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with atomic special tokens, a BOS-prepending post-processor and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, *FIM_TOKENS],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tok: PreTrainedTokenizerFast, documents: list[Document]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents as BOS + tokens + EOS, a document's tokens being its parts' tokens, each
    part encoded alone (fim_corpus.Document). Returns (ids int32 [n_tokens], is_target bool [n_tokens]):
    a part's last token before another part is no training target, since only a prompt ends there (the
    model learns to continue after it, not to write text tokenized that way)."""
    bos, eos = tok.bos_token_id, tok.eos_token_id
    parts = [part for doc in documents for part in doc]
    encodings = iter(tok.backend_tokenizer.encode_batch(parts, add_special_tokens=False))
    ids: list[int] = []
    cursors: list[int] = []  # stream positions of tokens just before a cut
    for doc in documents:
        ids.append(bos)
        for idx in range(len(doc)):
            ids.extend(next(encodings).ids)
            if idx < len(doc) - 1:
                cursors.append(len(ids) - 1)
        ids.append(eos)
    is_target = torch.ones(len(ids), dtype=torch.bool)
    is_target[torch.tensor(cursors, dtype=torch.long)] = False
    return torch.tensor(ids, dtype=torch.int32), is_target


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int


def make_model(shape: ModelShape, tok: PreTrainedTokenizerFast, max_positions: int) -> LlamaForCausalLM:
    """A fresh fp32 Llama with tied input/output embeddings (the head shares the embedding matrix)."""
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config).float()


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters, embeddings included (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageSpec:
    """One training stage: at most `steps` optimizer steps and at most `minutes` of wall clock."""

    name: str
    steps: int
    minutes: float | None
    lr: float
    batch_size: int
    seq_len: int
    warmup: int = 100
    weight_decay: float = 0.1


@dataclass
class StageResult:
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    stopped_by_time: bool
    cpu_seconds: float  # this process's CPU time over the stage (all its threads)


def batches(
    ids: torch.Tensor, is_target: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of the stream: (inputs int64 [B, seq_len], labels int64 [B, seq_len]),
    labels the next tokens, IGNORE where the next token is no training target."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)  # [seq_len + 1]
    high = ids.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, high, (batch_size, 1), generator=gen)  # [B, 1]
        window = ids[starts + offsets].long()  # [B, seq_len + 1]
        labels = window[:, 1:].masked_fill(~is_target[starts + offsets[1:]], IGNORE)  # [B, seq_len]
        yield window[:, :-1], labels


def lr_at(step: int, progress: float, spec: StageSpec) -> float:
    """Linear warmup over `spec.warmup` steps, then cosine decay to 10% of the peak by progress 1."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def distill_loss(
    logits: torch.Tensor, teacher_logits: torch.Tensor | None, labels: torch.Tensor, kd_weight: float
) -> torch.Tensor:
    """CE to `labels` [B, L] (IGNORE: none), mixed with KL(teacher || student) over logits [B, L, V] at
    every position when a teacher is given."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [B*L, V]
    ce = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE)
    if teacher_logits is None or kd_weight == 0.0:
        return ce
    teacher_logp = F.log_softmax(teacher_logits.reshape(-1, vocab), dim=-1)  # [B*L, V]
    kl = F.kl_div(F.log_softmax(flat, dim=-1), teacher_logp, log_target=True, reduction="batchmean")
    return kd_weight * kl + (1.0 - kd_weight) * ce


def train_stage(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    is_target: torch.Tensor,
    spec: StageSpec,
    seed: int,
    teacher: LlamaForCausalLM | None = None,
    kd_weight: float = 0.0,
) -> StageResult:
    """Train `model` on random windows of `ids` (next-token CE on the tokens `is_target` marks,
    optionally distilled from `teacher`)."""
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    budget = spec.minutes * 60.0 if spec.minutes else None
    start, cpu_start, ema, step, by_time = time.monotonic(), time.process_time(), float("nan"), 0, False
    bar = tqdm(total=spec.steps, desc=spec.name, dynamic_ncols=True, mininterval=5.0)
    device = next(model.parameters()).device  # the teacher lives there too
    for step, (inputs, labels) in enumerate(batches(ids, is_target, spec.batch_size, spec.seq_len, seed)):
        elapsed = time.monotonic() - start
        progress = max(step / spec.steps, elapsed / budget if budget else 0.0)
        if step >= spec.steps or progress >= 1.0:
            by_time = step < spec.steps
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, spec)
        loss = _train_step(model, opt, inputs.to(device), labels.to(device), teacher, kd_weight)
        ema = loss if math.isnan(ema) else 0.98 * ema + 0.02 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", min=f"{elapsed / 60:.1f}", refresh=False)
    bar.close()
    model.eval()
    seconds = time.monotonic() - start
    cpu_seconds = time.process_time() - cpu_start
    return StageResult(step, step * spec.batch_size * spec.seq_len, seconds, ema, by_time, cpu_seconds)


def _train_step(
    model: LlamaForCausalLM,
    opt: torch.optim.Optimizer,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    teacher: LlamaForCausalLM | None,
    kd_weight: float,
) -> float:
    """One optimizer step on inputs and labels int64 [B, L]; returns the loss value."""
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=inputs).logits  # [B, L, V]
    logits = model(input_ids=inputs).logits  # [B, L, V]
    loss = distill_loss(logits, teacher_logits, labels, kd_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalResult:
    target_loss: float
    draft_loss: float
    target_acc: float
    draft_acc: float
    agreement: float
    positions: int


@torch.no_grad()
def evaluate_pair(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, ids: torch.Tensor, seq_len: int, max_tokens: int
) -> EvalResult:
    """Held-out NLL (nats/token), top-1 accuracy, and draft/target top-1 agreement on non-overlapping windows."""
    n_windows = max(1, min((ids.numel() - 1) // seq_len, max_tokens // seq_len))
    sums = torch.zeros(5, dtype=torch.float64)  # target nll, draft nll, target hit, draft hit, agree
    for w in range(n_windows):
        chunk = ids[w * seq_len : (w + 1) * seq_len + 1].long()  # [L + 1]
        inputs, labels = chunk[None, :-1], chunk[1:]  # [1, L], [L]
        t_logits = target(input_ids=inputs).logits[0].float()  # [L, V]
        d_logits = draft(input_ids=inputs).logits[0].float()  # [L, V]
        t_top, d_top = t_logits.argmax(-1), d_logits.argmax(-1)  # [L] each
        sums += torch.tensor(
            [
                F.cross_entropy(t_logits, labels, reduction="sum").item(),
                F.cross_entropy(d_logits, labels, reduction="sum").item(),
                (t_top == labels).sum().item(),
                (d_top == labels).sum().item(),
                (t_top == d_top).sum().item(),
            ],
            dtype=torch.float64,
        )
    n = n_windows * seq_len
    t_loss, d_loss, t_acc, d_acc, agree = (sums / n).tolist()
    return EvalResult(t_loss, d_loss, t_acc, d_acc, agree, n)
