"""The device-neutral backend interface.

A :class:`Backend` is one device reached through one vendor's APIs, in three parts:

* **A VMM driver** (:class:`VmmDriver`, :mod:`.driver`): the nine raw virtual-memory calls
  a vendor implements (granularity, reserve, free, create, release, map, unmap, set access,
  memory info). They receive arguments that are already valid, only talk to the driver,
  and raise ``DriverError`` with the driver's error name and code.
* **The vendor's side** (:class:`DeviceVendor` and :class:`Capabilities`, :mod:`.vendor`):
  the streams, events, copies, tensors over raw addresses and graphs a vendor implements,
  and the optional features it declares, with their defaults.
* **The checked layer** (:class:`Backend`, :mod:`.checked`), the same for every vendor:
  what users and the rest of graphslot call. It validates every argument against
  graphslot's own ledger (:mod:`.ledger`), refuses driver calls during graph capture,
  serialises driver work behind one lock, counts calls, plants injected faults and rolls
  transactions back (:mod:`.transaction`), and turns a driver's failure into a
  :class:`~graphslot.errors.DriverError` that says what was being done.

Graphs and their random streams are in :mod:`.graphs`, lent events in :mod:`.events`.
This package belongs to the interface layer: it imports only :mod:`graphslot.errors` and
:mod:`graphslot.sizes` (and torch), never a backend or the library above it.
"""

from __future__ import annotations

from .checked import Backend
from .driver import VmmDriver
from .events import FREE_EVENTS, LentEvent
from .graphs import DeviceGraph, RngStream, no_gc
from .ledger import VMM_OPS, Allocation, Ledger, Mapping, Reservation, align_up
from .transaction import FaultPlan, Transaction
from .vendor import ALLOCATOR_STATS_KEYS, FEATURE_HOOKS, Capabilities, DeviceVendor

__all__ = [
    "Backend",
    "Capabilities",
    "DeviceVendor",
    "Reservation",
    "Allocation",
    "Mapping",
    "Ledger",
    "FaultPlan",
    "Transaction",
    "VmmDriver",
    "RngStream",
    "DeviceGraph",
    "align_up",
    "no_gc",
    "LentEvent",
    "FREE_EVENTS",
    "VMM_OPS",
    "ALLOCATOR_STATS_KEYS",
    "FEATURE_HOOKS",
]
