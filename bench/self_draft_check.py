"""`python -m bench.self_draft_check [--device cuda]`: the self-draft on this machine's device, in one
minute: greedy output with `--draft self` equals the target alone (method autoregressive, same engine
load), resident and streamed from RAM and disk, overlap on and off, and the tokens per pass. For a GPU
session: on CUDA the copies are made on the device and run tinygemm / the dequantize path, and overlap
runs the draft on its own stream beside the target's pass. Exit status 1 on any difference.

    python -m bench.self_draft_check --device cuda --prompts 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.prompts import CODE_PROMPTS
from engine.cli import DEFAULT_MODELS, auto_threads
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.runtime import Engine
from engine.types import Request, SamplingParams

MODES = {"resident": OffloadConfig(), "ram": OffloadConfig(enabled=True, resident_layers=2),
         "disk": OffloadConfig(enabled=True, source="disk", resident_layers=0)}


def check(device: str, mode: str, overlap: bool, prompts: list[str], max_tokens: int, budget: int) -> bool:
    engine = Engine.load(EngineConfig(
        model=ModelConfig(target=str(DEFAULT_MODELS / "target"), draft="self", device=device),
        speculation=SpeculationConfig(budget=budget, overlap=overlap), offload=MODES[mode],
        limits=LimitsConfig(max_context=512),
    ))
    try:
        same, tokens, passes, begin = True, 0, 0, time.perf_counter()
        for index, text in enumerate(prompts):
            ids = engine.tokenizer.encode(text)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            deltas = list(engine.generate(Request(f"s{index}", ids, params)))
            got = [t for d in deltas for t in d.token_ids]
            alone = Request(f"a{index}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            method="autoregressive")
            want = [t for d in engine.generate(alone) for t in d.token_ids]
            same &= got == want
            tokens, passes = tokens + len(got), passes + len(deltas)
        print(f"{device} {mode:8s} overlap {'on ' if overlap else 'off'}: {'same' if same else 'DIFFERENT'} "
              f"({tokens / passes:.2f} tokens per pass, {time.perf_counter() - begin:.1f} s)", flush=True)
        return same
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(auto_threads("cuda" if args.device.startswith("cuda") or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu"))
    prompts = list(CODE_PROMPTS[: args.prompts])
    results = [check(args.device, mode, overlap, prompts, args.max_tokens, args.budget)
               for mode in MODES for overlap in (False, True)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
