"""Backend selection: ``GRAPHSLOT_BACKEND`` = auto | cpu | cuda | musa.

Each backend package under ``graphslot.backends`` exposes two functions:
``probe() -> str | None`` (``None`` when usable here, else the reason it is not) and
``create() -> Backend``. They are imported lazily so that ``import graphslot`` never
pulls a vendor library in.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from .backend import Backend
from .errors import BackendUnavailableError, UsageError

__all__ = ["BACKENDS", "ENV_VAR", "get_backend", "selection_reason", "probe"]

log = logging.getLogger("graphslot")

ENV_VAR = "GRAPHSLOT_BACKEND"
#: Known backends, in the order ``auto`` tries them (cpu always works).
BACKENDS = ("cuda", "musa", "cpu")

_lock = threading.Lock()
_cache: dict[str, Backend] = {}
_reasons: dict[str, str] = {}


def _module(name: str) -> Any:
    return importlib.import_module(f"graphslot.backends.{name}")


def probe(name: str) -> str | None:
    """Whether backend ``name`` can run here.

    Args:
        name: ``"cpu"``, ``"cuda"`` or ``"musa"``.

    Returns:
        ``None`` if it can, else a sentence saying what is missing.

    Raises:
        UsageError: an unknown name (the message lists the valid ones).
    """
    if name not in BACKENDS:
        raise UsageError(f"unknown graphslot backend {name!r}; valid names are "
                         f"auto, {', '.join(sorted(BACKENDS))} (set {ENV_VAR})")
    try:
        return _module(name).probe()
    except Exception as e:  # a broken vendor install must not break auto selection
        return f"probing the {name} backend raised {type(e).__name__}: {e}"


def _choose(requested: str) -> tuple[str, str]:
    if requested != "auto":
        why = probe(requested)
        if why is not None:
            raise BackendUnavailableError(f"the {requested} backend was asked for but cannot run "
                                          f"here: {why}")
        return requested, f"{ENV_VAR}={requested}"
    skipped: list[str] = []
    for name in BACKENDS:
        why = probe(name)
        if why is None:
            reason = f"auto: {name} is usable"
            if skipped:
                reason += " (" + "; ".join(skipped) + ")"
            return name, reason
        skipped.append(f"{name} skipped: {why}")
    raise BackendUnavailableError("no backend is usable: " + "; ".join(skipped))


def get_backend(name: str | None = None) -> Backend:
    """The process-wide backend named by ``name`` or ``GRAPHSLOT_BACKEND`` (default auto).

    ``auto`` picks cuda where a CUDA device with VMM support is usable, then musa, then
    cpu, and logs which and why. One instance per backend lives for the whole process, so
    every part of graphslot shares one ledger.

    Args:
        name: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"musa"``; None reads the variable.

    Returns:
        The backend.

    Raises:
        UsageError: an unknown name (the message lists the valid ones).
        BackendUnavailableError: a named backend that cannot run here, saying what is
            missing.
    """
    requested = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if requested != "auto" and requested not in BACKENDS:
        source = f"set {ENV_VAR}" if not name else "the name given"
        raise UsageError(f"unknown graphslot backend {requested!r}; valid names are "
                         f"auto, {', '.join(sorted(BACKENDS))} ({source})")
    with _lock:
        if requested in _cache:
            return _cache[requested]
        chosen, reason = _choose(requested)
        if chosen not in _cache:
            _cache[chosen] = _module(chosen).create()
            _reasons[chosen] = reason
            log.info("graphslot backend %s selected: %s", chosen, reason)
        _cache[requested] = _cache[chosen]
        _reasons[requested] = reason
        return _cache[chosen]


def selection_reason(backend: Backend) -> str:
    """Why ``backend`` was chosen.

    Args:
        backend: a backend from :func:`get_backend` (or one constructed directly).

    Returns:
        The reason as logged at selection, or ``"constructed directly"``.
    """
    return _reasons.get(backend.name, "constructed directly")
