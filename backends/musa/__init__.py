"""The musa backend (Moore Threads GPUs). Not implemented yet."""

from __future__ import annotations

from typing import Any


def probe() -> str | None:
    return "the musa backend is not implemented yet"


def create() -> Any:
    raise NotImplementedError("the musa backend is not implemented yet")
