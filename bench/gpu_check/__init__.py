"""`bash scripts/gpu-check.sh` (python3 -m bench.gpu_check): what only a GPU can show, in one run.

Builds a seeded random target with a few 70B-shaped Llama decoder layers (hidden 8192, MLP 28672,
64 query / 8 KV heads, 128k vocabulary; every weight non-zero, so a layer computed from the wrong
ring slot changes the logits) and a small random draft sharing its vocabulary, then measures:
pinned->device copy bandwidth, streamed vs resident logits (ring sizes 2 and 3, also with compute
slowed below copy speed), streamed pass time against max(copy, compute), peak device memory,
attention backend and host syncs of real engine steps at an 8k context, the disk source's read
bandwidth, and one end-to-end `specexec bench` row. Every section reports its own failure and the
run goes on. Writes markdown to stdout and to --out. Imports engine code only (never server/).

    python3 -m bench.gpu_check --out gpu.md [--work-dir DIR] [--sections copy,equality]
"""
