"""The engine on tiny checkpoints: caches, determinism, stop conditions, errors, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.runtime import Engine
from engine.speculation.step import prefill
from engine.types import ContextLengthError, FinishReason, Request, SamplingParams, VocabMismatchError
from tests.helpers.tiny_models import build_tokenizer, make_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=3)
    return str(target), str(draft)


def load(pair, **spec) -> Engine:
    target, draft = pair
    return Engine.load(EngineConfig(
        model=ModelConfig(target=target, draft=draft),
        speculation=SpeculationConfig(**spec),
        limits=LimitsConfig(max_context=256),
    ))


@pytest.mark.parametrize("method", ["specexec", "specinfer"])
def test_committed_kv_equals_a_fresh_recompute(pair, method):
    engine = load(pair, method=method, budget=16)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=100)
    engine.add_request(Request("r", [5, 6, 7, 8], params))
    for _ in range(6):
        engine.step()
    running = engine.scheduler.running[0]
    ctx, seq = running.ctx, running.seq
    for runner, cache in ((engine.pair.target, ctx.target_cache), (ctx.drafter.runner, ctx.drafter.cache)):
        length = cache.length
        assert length <= len(seq.token_ids) - 1
        fresh = runner.new_cache(length + 1)
        prefill(runner, fresh, seq.token_ids[:length])
        for kept, recomputed in ((cache.keys, fresh.keys), (cache.values, fresh.values)):
            kept, recomputed = kept[:, :, :length], recomputed[:, :, :length]
            # fp32 summation order differs between a tree pass and a prefill: relative 2e-5 of the scale
            assert (kept - recomputed).abs().max() <= 2e-5 * recomputed.abs().max()
        assert cache.positions[:length].tolist() == list(range(length))
    assert ctx.target_cache.length == len(seq.token_ids) - 1  # the root has no KV yet


def test_same_seed_same_output_and_different_seeds_differ(pair):
    engine = load(pair, budget=16)
    prompt = [5, 6, 7, 8, 9]

    def sample(seed: int) -> list[int]:
        return engine.generate_ids(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True))

    assert sample(11) == sample(11)
    outputs = {tuple(sample(seed)) for seed in range(4)}
    assert len(outputs) >= 3


def test_stop_token_ids_and_max_tokens(pair):
    engine = load(pair, budget=16)
    free = engine.generate_ids([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert len(free) == 20
    stop_at = free[7]
    deltas = list(engine.generate(Request("s", [5, 6, 7], SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(stop_at,)))))
    got = [t for d in deltas for t in d.token_ids]
    assert got == free[: free.index(stop_at)]
    assert deltas[-1].finish_reason is FinishReason.STOP
    one = list(engine.generate(Request("o", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))))
    assert one[-1].finish_reason is FinishReason.LENGTH and sum(len(d.token_ids) for d in one) == 1
    assert one[-1].totals.completion_tokens == 1


def test_abort_between_steps(pair):
    engine = load(pair, budget=8)
    calls = iter(range(100))
    deltas = list(engine.generate(Request("a", [5, 6], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)),
                                  should_abort=lambda: next(calls) >= 2))
    assert deltas[-1].finish_reason is FinishReason.ABORT
    assert len(deltas) == 3


def test_context_overflow_is_a_clear_error(pair):
    engine = load(pair, budget=8)
    with pytest.raises(ContextLengthError, match="maximum context length is 256 tokens"):
        engine.validate_request(200, 100)
    with pytest.raises(ContextLengthError):
        list(engine.generate(Request("c", [5] * 250, SamplingParams(max_tokens=10))))


def test_incompatible_vocabularies_name_both_models(tmp_path, pair):
    target, _ = pair
    other_dir = tmp_path / "other"
    _, other_draft = make_tiny_pair(other_dir, draft="random")
    tok = build_tokenizer(vocab_size=300)
    tok.add_tokens(["<|odd|>"], special_tokens=True)
    # Swap two ids in the draft's tokenizer: same tokens, different ids.
    vocab = tok.get_vocab()
    a, b = "<|end|>", "<|bos|>"
    import json

    data = json.loads(tok.backend_tokenizer.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in (a, b):
            entry["id"] = vocab[b] if entry["content"] == a else vocab[a]
    (other_draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(VocabMismatchError) as err:
        Engine.load(EngineConfig(model=ModelConfig(target=target, draft=str(other_draft))))
    assert target in str(err.value) and str(other_draft) in str(err.value)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specexec", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_generate_prints_only_the_completion(pair):
    target, draft = pair
    engine = load(pair, budget=8)
    prompt_ids = engine.tokenizer.encode("def add(a, b):", add_special_tokens=True)  # as /v1/completions does
    want = engine.tokenizer.decode(
        engine.generate_ids(prompt_ids, SamplingParams(temperature=0.0, max_tokens=12)), skip_special_tokens=True)
    out = run_cli("generate", "--target", target, "--draft", draft, "--prompt", "def add(a, b):",
                  "--max-tokens", "12", "--budget", "8", "--stats")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    assert "tokens_per_pass=" in out.stderr and "target_passes=" in out.stderr


@pytest.mark.slow
def test_cli_generate_into_a_closed_pipe_exits_quietly(pair):
    target, draft = pair
    args = [sys.executable, "-m", "specexec", "generate", "--target", target, "--draft", draft, "--prompt", "x",
            "--max-tokens", "8", "--budget", "8"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head -c 0`: nobody reads the completion
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


@pytest.mark.parametrize("args", [
    ["--target", "/no/such/model", "--prompt", "x"],
    ["--budget", "0", "--prompt", "x"],
    ["--method", "magic", "--prompt", "x"],
])
def test_cli_bad_arguments_exit_2_with_one_line(pair, args):
    target, draft = pair
    base = ["generate", "--target", target, "--draft", draft]
    out = run_cli(*base, *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specexec: error:"), out.stderr
