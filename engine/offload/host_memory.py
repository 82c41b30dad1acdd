"""Host memory this process may still allocate: the host's MemAvailable, and its cgroup's limit.

A container (Docker, Kubernetes, systemd slices) caps memory with a cgroup whatever the host has
free: past memory.max (v2) or memory.limit_in_bytes (v1) the kernel's OOM killer ends the process.
What the cgroup still allows is its limit minus its working set (usage less inactive file pages,
which the kernel reclaims before it kills: the figure `docker stats` and the kubelet use), for the
process's own cgroup and every ancestor, whichever is smallest.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MEMINFO = Path("/proc/meminfo")
UNLIMITED = 1 << 62  # v1 reports "no limit" as a huge page-rounded number


def meminfo_available(meminfo: Path = PROC_MEMINFO) -> int:
    """The host's MemAvailable (free memory plus reclaimable cache) in bytes; elsewhere free pages."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.lstrip("-").isdigit() else int(text)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[Path, int]]:
    """(cgroup folder, version) of this process, innermost first, then each ancestor up to `root`."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[Path, int]] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, version = root, 2
        elif "memory" in controllers.split(","):
            base, version = root / "memory", 1
        else:
            continue
        folder = base / path.lstrip("/")
        if not folder.is_dir():  # a namespaced container sees its own cgroup as the root
            folder = base
        while True:
            found.append((folder, version))
            if folder == base or folder.parent == folder:
                break
            folder = folder.parent
    return found


def cgroup_available(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Bytes this process's cgroups still allow (the tightest of its own and its ancestors'), or None
    when no memory limit applies."""
    tightest = None
    for folder, version in _cgroup_dirs(root, proc_cgroup):
        if version == 2:
            limit, usage = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
            inactive = _stat(folder / "memory.stat", "inactive_file")
        else:
            limit, usage = _read_int(folder / "memory.limit_in_bytes"), _read_int(folder / "memory.usage_in_bytes")
            inactive = _stat(folder / "memory.stat", "total_inactive_file")
        if limit is None or limit >= UNLIMITED:
            continue
        working_set = max(0, (usage or 0) - inactive)
        left = max(0, limit - working_set)
        tightest = left if tightest is None else min(tightest, left)
    return tightest


def host_memory_available() -> int:
    """Bytes this process can still allocate: MemAvailable, or less where a cgroup limit binds."""
    available = meminfo_available()
    limited = cgroup_available()
    return available if limited is None else min(available, limited)
