"""graphslot's own account of a backend's memory: reservations, allocations, mappings.

:class:`Ledger` records what the checked :class:`~graphslot.backend.Backend` reserved,
created and mapped; every argument of a VMM call is checked against it before the driver
sees it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from ..sizes import format_bytes

__all__ = ["VMM_OPS", "Allocation", "Ledger", "Mapping", "Reservation", "align_up"]

#: The VMM operations that count as driver calls (per-step counters use these names).
VMM_OPS = ("reserve", "free", "create", "release", "map", "unmap", "set_access")


def align_up(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment``.

    Args:
        n: a non-negative integer.
        alignment: a positive integer.

    Returns:
        The smallest multiple of ``alignment`` that is at least ``n``.
    """
    return -(-n // alignment) * alignment


def _fmt(n: int) -> str:
    return format_bytes(n, exact=True)  # sizes in messages are read back exactly


@dataclass(eq=False)
class Allocation:
    """Physical backing created by :meth:`Backend.create`. ``handle`` is the backend's own."""

    size: int
    handle: Any
    released: bool = False
    mapped_at: set[tuple[int, int]] = field(default_factory=set)  # (reservation va, offset)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self.mapped_at)} mapping(s)"
        return f"Allocation({_fmt(self.size)}, {state})"


@dataclass(eq=False)
class Mapping:
    """One allocation mapped at ``offset`` of a reservation."""

    offset: int
    size: int
    allocation: Allocation
    accessible: bool = False


@dataclass(eq=False)
class Reservation:
    """A reserved virtual address range. ``va`` never changes while it lives.

    ``mappings`` is read-only outside the checked backend, which changes it through
    :meth:`add_mapping`, :meth:`remove_mapping` and :meth:`grant_access` so the sorted
    index and ``version`` stay right (a pool of 2 MiB pages has thousands of mappings).
    """

    va: int
    size: int
    freed: bool = False
    mappings: dict[int, Mapping] = field(default_factory=dict)  # offset -> Mapping
    #: bumped by every change of the mappings or their access.
    version: int = 0
    _starts: list[int] = field(default_factory=list, repr=False)  # sorted mapping offsets
    _accessible: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @property
    def end(self) -> int:
        return self.va + self.size

    def mapping_at(self, offset: int) -> Mapping | None:
        return self.mappings.get(offset)

    def covering(self, offset: int) -> Mapping | None:
        """The mapping holding byte ``offset``, if any."""
        k = bisect.bisect_right(self._starts, offset) - 1
        m = self.mappings.get(self._starts[k]) if k >= 0 else None
        return m if m is not None and offset < m.offset + m.size else None

    def overlapping(self, offset: int, size: int) -> Mapping | None:
        """The first mapping sharing a byte with ``[offset, offset + size)``, if any."""
        m = self.covering(offset)
        if m is not None:
            return m
        k = bisect.bisect_left(self._starts, offset)
        if k < len(self._starts) and self._starts[k] < offset + size:
            return self.mappings.get(self._starts[k])
        return None

    # (changes come under the backend's driver lock; a reader without it, a replay's
    # check, finds an offset in the index only while the dict has it)
    def add_mapping(self, m: Mapping) -> None:
        self.mappings[m.offset] = m
        bisect.insort(self._starts, m.offset)
        self._changed()

    def remove_mapping(self, offset: int) -> Mapping:
        del self._starts[bisect.bisect_left(self._starts, offset)]
        m = self.mappings.pop(offset)
        self._changed()
        return m

    def grant_access(self, ms: list[Mapping]) -> None:
        for m in ms:
            m.accessible = True
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        self._accessible.clear()

    def is_accessible(self, offset: int, size: int) -> bool:
        """True when every byte of ``[offset, offset + size)`` is mapped and accessible
        (answered from a cache until the mappings change: replays ask it every time)."""
        version = self.version  # (as of the start: a change meanwhile is not cached over)
        if self._accessible.get((offset, size)) == version:
            return True
        pos, end = offset, offset + size
        hit = self.covering(pos)
        while pos < end:
            if hit is None or not hit.accessible:
                return False
            pos = hit.offset + hit.size
            hit = self.mappings.get(pos)  # (the next one starts where this one ends, or none)
        if len(self._accessible) > 4096:
            self._accessible.clear()
        self._accessible[(offset, size)] = version
        return True

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{len(self.mappings)} mapping(s)"
        return f"Reservation(va=0x{self.va:x}, {_fmt(self.size)}, {state})"


class Ledger:
    """graphslot's exact account of what it reserved, created and mapped on a backend."""

    def __init__(self) -> None:
        self.reservations: dict[int, Reservation] = {}
        self.allocations: set[Allocation] = set()
        self._mapped = 0
        self._allocated = 0
        #: the most bytes mapped at once since the last :meth:`reset_peak` (each
        #: allocation once, however many addresses it is mapped at).
        self.peak_mapped_bytes = 0
        #: the most physical bytes created and not released at once since then: what the
        #: device really held (pages kept unmapped for reuse count here, not as mapped).
        self.peak_allocated_bytes = 0

    def _on_map(self, nbytes: int) -> None:
        self._mapped += nbytes
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self._mapped)

    def _on_unmap(self, nbytes: int) -> None:
        self._mapped -= nbytes

    def _on_create(self, alloc: Allocation) -> None:
        self.allocations.add(alloc)
        self._allocated += alloc.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self._allocated)

    def _on_release(self, alloc: Allocation) -> None:
        self.allocations.discard(alloc)
        self._allocated -= alloc.size

    def reset_peak(self) -> None:
        self.peak_mapped_bytes = self._mapped
        self.peak_allocated_bytes = self._allocated

    @property
    def reserved_bytes(self) -> int:
        return sum(r.size for r in self.reservations.values())

    @property
    def allocated_bytes(self) -> int:
        """Physical bytes created and not yet released."""
        return self._allocated

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped through graphslot now: an allocation mapped at several
        addresses counts once (the device holds it once)."""
        return self._mapped

    def find(self, va: int, nbytes: int) -> Reservation | None:
        """The live reservation that holds all of ``[va, va + nbytes)``, if any."""
        for r in self.reservations.values():
            if r.va <= va and va + nbytes <= r.end:
                return r
        return None

    def snapshot(self) -> dict[str, int]:
        return {
            "reservations": len(self.reservations),
            "reserved_bytes": self.reserved_bytes,
            "allocations": len(self.allocations),
            "allocated_bytes": self.allocated_bytes,
            "mapped_bytes": self.mapped_bytes,
        }
