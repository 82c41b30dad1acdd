#!/usr/bin/env bash
# Issue 38's part B, prepared: what a session lent a GPU runs, in commands of under 5 minutes each
# (the system python3 with torch and transformers; nothing installed).
#   bash scripts/gpu-partb.sh 1 "$OUT"   # the cuda-marked tests, then the full-shape section (~5 min: its steps
#                                        # with the draft's graphs off and on)
#   bash scripts/gpu-partb.sh 2 "$OUT"   # the sections the round changed: build, steps, serving (~2 min)
#   bash scripts/gpu-partb.sh 3 "$OUT"   # the draft's tree forward alone: eager vs compiled layers (~1-2 min)
#   bash scripts/gpu-partb.sh 4 "$OUT"   # the draft's forwards as CUDA graphs: cuda tests, the draft forward,
#                                        # the draft phase with trees on the device and on the host, per tree
#                                        # or as a forest (growth),
#                                        # then the full shape per draft variant: graphs, 8x extensions, host
#                                        # trees, a fresh tree's forwards capped at 8 (bench/gpu_check/plan.py
#                                        # FullShape.variants, in order of worth; --seconds: those the time left
#                                        # cannot hold are not run, the tables print what ran; ~6-9 min)
#   bash scripts/gpu-partb.sh 5 "$OUT"   # what run 4 (2026-11-28, H200) left: the cuda tests, the full shape's four
#                                        # variants after a warm-up (graphs; fresh 8; 8x extension; 8x with host
#                                        # trees; a failed row is reported with the allocator's state and the
#                                        # next runs), then the one row that failed (8x extensions, budget 1024,
#                                        # 4 streams) with expandable segments and CUDA_LAUNCH_BLOCKING=1 (at most
#                                        # 75 + 335 + 160 s: one call with timeout_s 600)
#   bash scripts/gpu-partb.sh 6 "$OUT"   # the step rows of the defaults (graphs, 8x extensions) and of 2x
#                                        # extensions (at most 340 s: one call with timeout_s 360)
#   bash scripts/gpu-partb.sh 7 "$OUT"   # the defaults' step rows at budget 1024 alone (the overlap goal; at most
#                                        # 150 s: one call with timeout_s 170)
# Stage 1 runs the full shape with the int4 dequantization compiled into one kernel per shape
# (SPECEXEC_INT4_DEQUANT=compiled, the default where triton is installed); its kernel table compares it
# with the eager one and tinygemm.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage 1, 2, 3, 4, 5, 6 or 7}
out=${2:-gpu-partb}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$stage" in
  1)
    git log --oneline -1 > "$out/commit.txt" 2>/dev/null
    timeout 100 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda -rs tests/model tests/offload \
        tests/speculation/test_overlap.py tests/speculation/test_step_timing.py tests/speculation/test_host_trees.py \
        tests/speculation/test_forest.py > "$out/cuda-tests.log" 2>&1
    tail -3 "$out/cuda-tests.log"
    SPECEXEC_INT4_DEQUANT=compiled timeout 280 bash scripts/gpu-check.sh --out "$out/fullshape.md" \
        --work-dir /tmp/gpucheck --sections header,fullshape --seconds 265 > "$out/fullshape.log" 2>&1
    tail -n 3 "$out/fullshape.log"
    ;;
  2)
    timeout 280 bash scripts/gpu-check.sh --out "$out/sections.md" --work-dir /tmp/gpucheck \
        --sections header,build,steps,serving > "$out/sections.log" 2>&1
    tail -n 3 "$out/sections.log"
    ;;
  3)
    timeout 280 bash scripts/gpu-check.sh --out "$out/draftpass.md" --work-dir /tmp/gpucheck \
        --sections header,draftpass > "$out/draftpass.log" 2>&1
    tail -n 3 "$out/draftpass.log"
    ;;
  4)
    git log --oneline -1 > "$out/commit.txt" 2>/dev/null
    timeout 90 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda -rs tests/model tests/offload \
        tests/speculation/test_overlap.py tests/speculation/test_step_timing.py tests/speculation/test_host_trees.py \
        tests/speculation/test_forest.py > "$out/cuda-tests.log" 2>&1
    tail -3 "$out/cuda-tests.log"
    timeout 150 bash scripts/gpu-check.sh --out "$out/draftpass.md" --work-dir /tmp/gpucheck \
        --sections header,draftpass,growth > "$out/draftpass.log" 2>&1
    tail -n 3 "$out/draftpass.log"
    SPECEXEC_INT4_DEQUANT=compiled timeout 330 bash scripts/gpu-check.sh --out "$out/fullshape.md" \
        --work-dir /tmp/gpucheck --sections header,fullshape --seconds 315 > "$out/fullshape.log" 2>&1
    tail -n 3 "$out/fullshape.log"
    ;;
  5)
    git log --oneline -1 > "$out/commit.txt" 2>/dev/null
    timeout 75 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda -rs tests/model \
        tests/offload tests/speculation/test_overlap.py tests/speculation/test_step_timing.py \
        tests/speculation/test_host_trees.py tests/speculation/test_forest.py > "$out/cuda-tests.log" 2>&1
    tail -3 "$out/cuda-tests.log"
    SPECEXEC_INT4_DEQUANT=compiled timeout 335 bash scripts/gpu-check.sh --out "$out/fullshape.md" \
        --work-dir /tmp/gpucheck --sections header,fullshape --seconds 320 > "$out/fullshape.log" 2>&1
    tail -n 3 "$out/fullshape.log"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_LAUNCH_BLOCKING=1 SPECEXEC_INT4_DEQUANT=compiled \
        timeout 160 bash scripts/gpu-check.sh --out "$out/expandable.md" --work-dir /tmp/gpucheck \
        --sections fullshape --variants 0 --budgets 1024 --streams 4 --steps-only > "$out/expandable.log" 2>&1
    tail -n 3 "$out/expandable.log"
    ;;
  6)
    git log --oneline -1 > "$out/commit.txt" 2>/dev/null
    SPECEXEC_INT4_DEQUANT=compiled timeout 340 bash scripts/gpu-check.sh --out "$out/steps.md" --work-dir /tmp/gpucheck \
        --sections header,fullshape --variants 0,2 --steps-only --seconds 320 > "$out/steps.log" 2>&1
    tail -n 3 "$out/steps.log"
    ;;
  7)
    SPECEXEC_INT4_DEQUANT=compiled timeout 150 bash scripts/gpu-check.sh --out "$out/defaults.md" --work-dir /tmp/gpucheck \
        --sections fullshape --variants 0 --budgets 1024 --steps-only --seconds 130 > "$out/defaults.log" 2>&1
    tail -n 3 "$out/defaults.log"
    ;;
  *)
    echo "stage must be 1, 2, 3, 4, 5, 6 or 7" >&2
    exit 2
    ;;
esac
