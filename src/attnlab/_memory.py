"""How much memory the machine can give now: the one reading of it, used before large
allocations (checkpoints' rotary tables, the benchmarks' sizes)."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """Memory the machine can give now: psutil's `available` if psutil is installed, else
    /proc/meminfo's MemAvailable, else the free physical pages from os.sysconf; None when
    none of them can be read."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    meminfo = _meminfo_available()
    if meminfo is not None:
        return meminfo
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _meminfo_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts in kB
    except (OSError, ValueError, IndexError):
        return None
    return None
