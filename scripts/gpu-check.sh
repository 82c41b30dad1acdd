#!/usr/bin/env bash
# The GPU check (issue 12): builds a few 70B-shaped random layers and a draft, then measures copy
# bandwidth, streamed == resident logits, overlap, peak memory / attention backend / host syncs of
# real steps at an 8k context, disk reads and one `specexec bench` row. No downloads, no venv, no
# installs: the system python3 with torch and transformers. Without CUDA it says so and exits 2.
#   bash scripts/gpu-check.sh --out "$OUT/gpu.md"
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m bench.gpu_check "$@"
