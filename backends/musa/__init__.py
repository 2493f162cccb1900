"""The musa backend (Moore Threads GPUs).

Driver virtual memory management goes through libmusa.so by ctypes
(:mod:`.driver`, usable without torch_musa); streams, events, pinned memory and
graphs go through torch_musa (``torch.musa``), in :mod:`.backend`. It imports those and
the interface only (see :mod:`graphslot.backends`).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from .driver import ENV_LIBMUSA, MusaDriver, MusaLibrary, MusaUnavailable, probe_driver

if TYPE_CHECKING:
    from .backend import MusaBackend

__all__ = ["ENV_LIBMUSA", "MusaDriver", "MusaLibrary", "MusaUnavailable", "probe", "create"]


def _torch_musa_problem() -> tuple[str | None, int]:
    """Why torch_musa cannot be used (or None), and the device index it would use."""
    if importlib.util.find_spec("torch_musa") is None:
        return ("torch_musa is not installed (install Moore Threads' torch_musa wheel that "
                "matches your torch and MUSA SDK)"), 0
    try:
        import torch
        import torch_musa  # noqa: F401  (registers the "musa" device and torch.musa)
    except Exception as e:  # a broken vendor install is a reason, not a crash
        return f"importing torch_musa failed: {type(e).__name__}: {e}", 0
    tmusa = getattr(torch, "musa")  # attached by torch_musa; unknown to torch's stubs
    if not tmusa.is_available():
        return "torch.musa.is_available() is False (no MUSA device visible to torch_musa)", 0
    return None, int(tmusa.current_device())


def probe() -> str | None:
    """``None`` when the musa backend can run here, else what is missing.

    Checks torch_musa and the driver independently and reports every problem found,
    so one run of ``graphslot info`` names everything that needs fixing.
    """
    problems = []
    why, index = _torch_musa_problem()
    if why:
        problems.append(why)
    why = probe_driver(index)
    if why:
        problems.append(why)
    return "; ".join(problems) or None


def create() -> MusaBackend:
    from .backend import MusaBackend

    return MusaBackend()
