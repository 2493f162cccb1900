"""graphslot: fixed virtual addresses for device graphs whose memory moves.

A captured device graph (a CUDA or MUSA graph) remembers raw addresses. graphslot
reserves a virtual address range once, lets you capture against it, and swaps,
releases or shares the *physical* memory behind it outside replay, so the graph never
sees a new pointer.

The public surface:

* :func:`get_backend` - the device backend (``GRAPHSLOT_BACKEND`` = auto|cpu|cuda|musa).
* :class:`Backend` - reserve/create/map/unmap/release, streams, events, copies.
* :mod:`graphslot.errors` - the exception hierarchy.
"""

from __future__ import annotations

from .backend import (
    Allocation,
    Backend,
    DeviceGraph,
    FaultPlan,
    Ledger,
    Reservation,
    Transaction,
    align_up,
)
from .errors import (
    BackendUnavailableError,
    CaptureMismatchError,
    DriverError,
    GraphslotError,
    InjectedFault,
    StateError,
    StreamError,
    UsageError,
)
from .selection import BACKENDS, get_backend, selection_reason

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "Backend",
    "BACKENDS",
    "BackendUnavailableError",
    "CaptureMismatchError",
    "DeviceGraph",
    "DriverError",
    "FaultPlan",
    "GraphslotError",
    "InjectedFault",
    "Ledger",
    "Reservation",
    "StateError",
    "StreamError",
    "Transaction",
    "UsageError",
    "align_up",
    "get_backend",
    "selection_reason",
]
