"""Autocast as captured graphs see it.

A graph replays the kernels its capture recorded, in the dtypes autocast chose then: a
layer captured under ``torch.autocast`` must run under the same autocast, and one captured
without it, without it (:func:`autocast_dtype` says which, for a device type). Backward
passes run outside autocast, as torch recommends and training loops do (``loss.backward()``
after the ``with torch.autocast(...)`` block): each backward op in the dtypes of what its
forward saved. A capture or a measurement of a backward made while the caller's autocast
is on would let autocast recast the backward's own products, so they run under
:func:`without_autocast`. A recompute inside the backward still runs under the forward's
autocast: ``torch.utils.checkpoint`` restores it.

Device neutral: ``torch.autocast`` for the device type, where autocast knows it.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

__all__ = ["autocast_dtype", "without_autocast"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` now, None where it is off (or where
    autocast does not know the device type)."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):
        return None
    return torch.get_autocast_dtype(device_type) if on else None


def without_autocast(device_type: str) -> ContextManager[object]:
    """Autocast off on ``device_type`` within (nothing to do where it is off already)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
