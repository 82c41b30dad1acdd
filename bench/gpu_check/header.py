"""The report's header: when, on what, with which software."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from importlib import metadata

import torch

from bench.gpu_check.context import CheckContext
from bench.gpu_check.probes import GB

NVIDIA_SMI_QUERIES = (  # (label, --query-gpu fields): one query each, so an unknown field loses one row
    ("nvidia-smi: GPU, driver, memory", "name,driver_version,memory.total"),
    ("nvidia-smi: PCIe link gen, width (max)", "pcie.link.gen.max,pcie.link.width.max"),
)


def command_output(*argv: str) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def header_rows(ctx: CheckContext) -> list[tuple[str, str]]:
    rows = [("date (UTC)", time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))]
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)  # CUDA-only
        rows += [
            ("GPU", f"{props.name}, {props.total_memory / GB:.1f} GB, {props.multi_processor_count} SMs"),
            ("compute capability", f"{props.major}.{props.minor}"),
        ]
    else:
        rows.append(("GPU", "none: CPU test mode (--allow-cpu), CUDA-only probes stubbed"))
    for label, fields in NVIDIA_SMI_QUERIES:
        rows.append(
            (label, command_output("nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader") or "-")
        )
    rows += [
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda})"),
        ("transformers", version_of("transformers")),
        ("triton", version_of("triton")),
        ("python", platform.python_version()),
        ("host", f"{os.cpu_count()} cores, {host_memory_bytes() / GB:.0f} GB RAM, {platform.machine()}"),
        ("commit", os.environ.get("SPECEXEC_COMMIT") or commit_of_checkout()),
        ("dtype", str(ctx.dtype).removeprefix("torch.")),
        ("work dir", str(ctx.work_dir)),
    ]
    return rows


def header_section(ctx: CheckContext) -> None:
    ctx.report.table("item", "value")
    for item, value in header_rows(ctx):
        ctx.report.row(item, value)


def commit_of_checkout() -> str:
    """HEAD, with `+changes` when the work tree differs from it (a copied tree may carry stale git data)."""
    head = command_output("git", "rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (no git checkout)"
    dirty = command_output("git", "status", "--porcelain", "--untracked-files=no")
    return f"{head}+changes" if dirty else head
