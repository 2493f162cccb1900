"""Multi-step VMM work that rolls back (:class:`Transaction`), and planted driver
failures for tests of that rollback (:class:`FaultPlan`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InjectedFault, UsageError
from .ledger import VMM_OPS, Allocation, Reservation

if TYPE_CHECKING:
    from .checked import Backend

__all__ = ["FaultPlan", "Transaction"]


class FaultPlan:
    """Plants driver failures for tests of rollback and recovery paths.

    ``backend.faults.fail("map")`` makes the next ``map`` driver call fail with an
    :class:`~graphslot.errors.InjectedFault` before it reaches the driver;
    ``fail("map", after=2)`` lets two calls through first.
    """

    def __init__(self) -> None:
        self._plan: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def fail(self, op: str, after: int = 0, times: int = 1) -> None:
        """Plan a failure of driver call ``op``.

        Args:
            op: one of the VMM operations (``"reserve"``, ``"map"`` ...).
            after: calls of ``op`` let through first.
            times: calls that fail after those.
        """
        if op not in VMM_OPS:
            raise UsageError(f"cannot inject a fault into {op!r}; choose one of {', '.join(VMM_OPS)}")
        with self._lock:
            self._plan[op] = [after, times]

    def clear(self) -> None:
        """Drop every planned failure."""
        with self._lock:
            self._plan.clear()

    def check(self, op: str, desc: str) -> None:
        """Before driver call ``op`` (described as ``desc``): raise the planned failure, if due."""
        with self._lock:
            entry = self._plan.get(op)
            if entry is None:
                return
            if entry[0] > 0:
                entry[0] -= 1
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self._plan[op]
        raise InjectedFault(desc, op, "GRAPHSLOT_INJECTED_FAULT", -1, "planted by FaultPlan")


class Transaction:
    """Multi-step VMM work that is undone in reverse order if any step fails.

    Use through :meth:`Backend.transaction`::

        with backend.transaction() as tx:
            res = tx.reserve(size)
            alloc = tx.create(size)
            tx.map(res, 0, alloc)
            tx.set_access(res, 0, size)

    If a step raises, every earlier step is rolled back (unmap, release, free) and the
    original error propagates; nothing is leaked. On success the work is kept.
    """

    def __init__(self, backend: Backend) -> None:
        self._b = backend
        self._undo: list[Callable[[], None]] = []

    def reserve(self, size: int, alignment: int = 0) -> Reservation:
        res = self._b.reserve(size, alignment)
        self._undo.append(lambda: self._b.free(res))
        return res

    def create(self, size: int) -> Allocation:
        alloc = self._b.create(size)
        self._undo.append(lambda: self._b.release(alloc))
        return alloc

    def map(self, res: Reservation, offset: int, alloc: Allocation) -> None:
        self._b.map(res, offset, alloc)
        self._undo.append(lambda: self._b.unmap(res, offset, alloc.size))

    def set_access(self, res: Reservation, offset: int, size: int) -> None:
        self._b.set_access(res, offset, size)  # undone by the unmap before it

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._undo.clear()
            return
        errors = []
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception as e:  # keep undoing; report below
                errors.append(e)
        self._undo.clear()
        if errors and exc is not None:
            exc.add_note(f"graphslot: rollback also failed: {errors!r}")
