"""How much memory this process can still populate: the kernel's figure and the cgroup's limit.

Reads ``/proc/meminfo`` and the cgroup files only: no torch, so that the scheduler side (the
:class:`~kvoffload.Manager`) can size its own structures against it too.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["CGROUP_ROOT", "PROC_MEMINFO", "host_memory_available"]

#: Where the kernel reports the memory it can give, and the cgroup (v2, then v1) limits.
PROC_MEMINFO: Final = "/proc/meminfo"
CGROUP_ROOT: Final = "/sys/fs/cgroup"


def host_memory_available(
    meminfo: str = PROC_MEMINFO, cgroup_root: str = CGROUP_ROOT
) -> tuple[int, str] | None:
    """The bytes of memory this process can still populate, and where that figure comes from.

    The smaller of the kernel's ``MemAvailable`` and the room left under this process's cgroup memory
    limit (v2 ``memory.max - memory.current``, else v1 ``memory.limit_in_bytes -
    memory.usage_in_bytes``). None when neither can be read (not Linux).
    """
    found: list[tuple[int, str]] = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file, name in (
        ("memory.max", "memory.current", "cgroup memory.max"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "cgroup memory limit"),
    ):
        try:
            with open(os.path.join(cgroup_root, limit_file)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(cgroup_root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text != "max" and int(limit_text) < 1 << 60:  # v1 reports "no limit" as ~2**63
            found.append((max(0, int(limit_text) - usage), name))
        break
    return min(found) if found else None
