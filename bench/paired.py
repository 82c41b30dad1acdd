"""Tree methods paired by prompt: `python -m bench.paired RAW.json [RAW.json ...]`.

Reads `specexec bench` raw.json files (runs of the same prompts may be split over several files and
seeds), pools each prompt's trajectories per (temperature, method, budget) into tokens per pass
(accepted + bonus over target passes), and prints RRS minus SpecExec and minus SpecInfer: the mean
over prompts of each prompt's difference, its standard error and z. Pairing by prompt removes the
spread between prompts, which dominates the per-method standard errors.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict


def per_prompt(paths: list[str]) -> dict[tuple[float, str, int], dict[int, float]]:
    """(temperature, method, budget) -> {prompt index: tokens per pass over its trajectories}."""
    sums: dict[tuple, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for path in paths:
        for result in json.loads(open(path).read())["results"]:
            key = (result["temperature"], result["method"], result["budget"])
            for prompt, steps in zip(result["prompt_index"], result["accepted"], strict=True):
                sums[key][prompt][0] += sum(a + 1 for a in steps)
                sums[key][prompt][1] += len(steps)
    return {key: {p: t / n for p, (t, n) in prompts.items()} for key, prompts in sums.items()}


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) * (len(values) - 1))
    return mean, math.sqrt(var)


def main(paths: list[str]) -> None:
    table = per_prompt(paths)
    for temperature, budget in sorted({(k[0], k[2]) for k in table if k[1] == "rrs"}):
        rrs = table[(temperature, "rrs", budget)]
        parts = [f"T={temperature:g} budget {budget}:"]
        for other in ("specexec", "specinfer"):
            base = table.get((temperature, other, budget), {})
            common = sorted(set(rrs) & set(base))
            if len(common) > 1:
                mean, se = mean_se([rrs[p] - base[p] for p in common])
                parts.append(f"rrs - {other} {mean:+.2f} ± {se:.2f} ({len(common)} prompts, z {mean / se:.1f})")
        print("  ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:])
