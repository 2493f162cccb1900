"""graphslot: fixed virtual addresses for device graphs whose memory moves.

A captured device graph (a CUDA or MUSA graph) remembers raw addresses. graphslot
reserves a virtual address range once, lets you capture against it, and swaps,
releases or shares the *physical* memory behind it outside replay, so the graph never
sees a new pointer.

The public surface:

* :func:`get_backend` - the device backend (``GRAPHSLOT_BACKEND`` = auto|cpu|cuda|musa).
* :class:`Backend` - reserve/create/map/unmap/release, streams, events, copies.
* :mod:`graphslot.errors` - the exception hierarchy.
* :mod:`graphslot.offload` and :mod:`graphslot.adapters.torch` - graph-safe activation offload.
* :mod:`graphslot.arena` - mutually exclusive graph variants sharing one physical pool
  (:class:`~graphslot.arena.VariantGraphs`) and static graph I/O planned by lifetime
  (:class:`~graphslot.arena.IOArena`).
* :mod:`graphslot.planner` - plan and verify fixed arenas for tensors with known lifetimes,
  mutually exclusive branches and alias groups.

Dependencies run one way (import-linter contract ``layers``; docs/architecture.md draws
them): the commands (:mod:`graphslot.cli`) over the adapters over the library (arena,
budget, memory, offload, paged, planner, precision, profile, recompute, selection,
trace) over the backends over the interface (backend, errors, regions, sizes).
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
    BudgetError,
    CaptureMismatchError,
    DriverError,
    GraphslotError,
    InjectedFault,
    PoolFullError,
    StateError,
    StreamError,
    IncompatibleError,
    UsageError,
)
from .planner import Plan, PlanError, SlotPlanEntry, export_slot_plan, import_slot_plan, plan, verify
from .selection import BACKENDS, get_backend, selection_reason

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "Backend",
    "BACKENDS",
    "BackendUnavailableError",
    "BudgetError",
    "CaptureMismatchError",
    "DeviceGraph",
    "DriverError",
    "FaultPlan",
    "GraphslotError",
    "InjectedFault",
    "Ledger",
    "Plan",
    "PlanError",
    "PoolFullError",
    "SlotPlanEntry",
    "export_slot_plan",
    "import_slot_plan",
    "plan",
    "verify",
    "Reservation",
    "StateError",
    "StreamError",
    "Transaction",
    "UsageError",
    "IncompatibleError",
    "align_up",
    "get_backend",
    "selection_reason",
]
