"""What the benchmark scripts record about the machine they ran on."""

from __future__ import annotations

import platform

__all__ = ["cpu_name"]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else the platform's answer."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
