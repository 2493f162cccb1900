"""Test-only device helpers: what tests need from a backend that training never does."""

from __future__ import annotations

import time
from typing import Any

import torch

import graphslot
from graphslot.errors import BackendUnavailableError


def selected_backend() -> tuple[graphslot.Backend | None, str]:
    """The backend ``GRAPHSLOT_BACKEND`` selects, or None and why it cannot run here.

    For tests that need the backend at import (a module-level skip): a module must still
    collect where the selected backend's device is absent, and skip with the reason."""
    try:
        return graphslot.get_backend(), ""
    except BackendUnavailableError as e:
        return None, f"selected backend unavailable: {e}"


def spin(b: graphslot.Backend, seconds: float, stream: Any = None) -> None:
    """Queue about ``seconds`` of busy work on ``stream`` (default: the current stream), so
    a test can hold a stream back and see whether events order what follows it."""
    stream = stream if stream is not None else b.current_stream()
    if b.device.type == "cpu":  # the cpu backend's streams (and the stub musa backend's)
        stream.submit(lambda: time.sleep(seconds))
        return
    if b.device.type == "cuda":
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(seconds * b.driver.clock_hz()))  # type: ignore[attr-defined]
        return
    musa: Any = getattr(torch, b.device.type)  # torch_musa's module
    sleep = getattr(musa, "_sleep", None)
    if sleep is None:
        raise RuntimeError(f"this torch_{b.device.type} has no _sleep to queue busy work")
    from graphslot.backends.musa import abi

    try:
        khz = b.driver.attribute(abi.MU_DEVICE_ATTRIBUTE_CLOCK_RATE)  # type: ignore[attr-defined]
    except graphslot.DriverError:
        khz = 0
    with musa.stream(stream):
        sleep(int(seconds * (khz or 1_000_000) * 1000))
