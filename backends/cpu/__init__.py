"""The cpu backend: real VMM semantics on host memory (mmap, memfd, worker-thread streams).

It is the default where no GPU is present, and what CI runs. It imports the interface
only (see :mod:`graphslot.backends`).
"""

from __future__ import annotations

import os
import sys

from .backend import CpuBackend

__all__ = ["CpuBackend", "probe", "create"]


def probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the cpu backend needs Linux (memfd_create, MAP_FIXED); this is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing (needs Linux 3.17+ and Python 3.8+)"
    return None


def create() -> CpuBackend:
    return CpuBackend()
