"""The raw virtual-memory calls one vendor implements (:class:`VmmDriver`)."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["VmmDriver"]


class VmmDriver(Protocol):
    """The raw virtual-memory calls one vendor implements (the CUDA/MUSA driver model).

    Arguments are already checked by :class:`Backend` (sizes granular, ranges inside a
    live reservation, nothing mapped twice), and calls arrive one at a time. Each raises
    :class:`~graphslot.errors.DriverError` (with an empty ``op``) naming the driver call,
    its error name and code.
    """

    def granularity(self) -> int:
        """The allocation granularity in bytes: sizes and offsets are multiples of it."""

    def reserve(self, size: int, alignment: int) -> int:
        """Reserve ``size`` bytes of address space (aligned to ``alignment`` when nonzero)."""

    def free(self, va: int, size: int) -> None:
        """Give a reservation with nothing mapped in it back."""

    def create(self, size: int) -> Any:
        """Create ``size`` bytes of physical backing; returns the vendor's handle."""

    def release(self, handle: Any) -> None:
        """Return unmapped physical backing to the driver."""

    def map(self, va: int, size: int, handle: Any) -> None:
        """Map all of ``handle``'s ``size`` bytes at ``va`` (not yet accessible)."""

    def unmap(self, va: int, size: int) -> None:
        """Unmap ``[va, va + size)``; the address range stays reserved."""

    def set_access(self, va: int, size: int) -> None:
        """Let the device read and write ``[va, va + size)`` (needed after every map)."""

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory."""
