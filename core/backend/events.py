"""Framework events lent from a backend's free list (:class:`LentEvent`)."""

from __future__ import annotations

from typing import Any

__all__ = ["FREE_EVENTS", "LentEvent"]

#: at most this many idle events wait in a backend's free list
FREE_EVENTS = 1024


class LentEvent:
    """A framework event lent from its backend's free list (:meth:`Backend.new_event`).

    Making a device event costs host time besides recording it (on the H200, inside a
    launch-bound step, 3.1 us per new framework event against 1.2 us per lent one), and
    the offload engine makes about four per layer and step. When nothing refers to this
    handle any more, nothing can wait on or query what it recorded, so its event goes
    back to the list for a later handle to record again; waits already queued on a
    stream keep the record they saw.
    """

    __slots__ = ("event", "recorded", "_free")

    def __init__(self, event: Any, free: list[Any]) -> None:
        self.event = event
        #: whether this handle recorded it: until then it reads as a new event does
        #: (complete, nothing to wait for), whatever its event's earlier record was
        self.recorded = False
        self._free = free

    def __del__(self) -> None:
        try:
            if len(self._free) < FREE_EVENTS:
                self._free.append(self.event)
        except Exception:  # at interpreter exit the module's globals may be gone already
            pass

    # The framework event's protocol (the backend and streams call these), reading as a
    # new event until this handle records it
    def record(self, stream: Any = None) -> None:
        self.event.record(stream)
        self.recorded = True  # only now: a record that failed leaves it unrecorded

    def query(self) -> bool:
        return not self.recorded or bool(self.event.query())

    def synchronize(self) -> None:
        if self.recorded:
            self.event.synchronize()

    def wait(self, stream: Any = None) -> None:
        if self.recorded:
            self.event.wait(stream)
