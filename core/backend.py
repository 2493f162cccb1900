"""The device-neutral backend interface.

A :class:`Backend` is one device reached through one vendor's APIs, in two layers:

* **A VMM driver** (:class:`VmmDriver`): the nine raw virtual-memory calls a vendor
  implements (granularity, reserve, free, create, release, map, unmap, set access,
  memory info). They receive arguments that are already valid, only talk to the driver,
  and raise ``DriverError`` with the driver's error name and code.
* **The checked layer** (``reserve``, ``create``, ``map`` ...), the same class for every
  vendor. It validates every argument against graphslot's own ledger, refuses driver
  calls during graph capture, serialises driver work behind one lock, counts calls,
  plants injected faults, rolls transactions back and turns a driver's failure into a
  :class:`~graphslot.errors.DriverError` that says what was being done. Everything else
  in graphslot (slots, the offload engine, the planner) uses only these.

Streams and events are the framework's own objects with torch's method names
(``Stream.wait_event``, ``Event.record``, ``query``, ``synchronize``, ``elapsed_time``) on
every backend; a backend supplies how to make them, copies, tensors over raw addresses
and graphs.

Virtual memory follows the CUDA/MUSA driver model: reserve a VA range, create physical
backing, map backing at an offset of the range, grant access; later unmap (the VA stays
reserved) and release (the pages return to the driver). A tensor view made with
:meth:`Backend.tensor_at` keeps its ``data_ptr()`` whatever is mapped behind it.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol, Sequence, TypeVar

from .errors import DriverError, InjectedFault, StateError, UsageError
from .sizes import format_bytes, view_extent

if TYPE_CHECKING:  # torch is a runtime dependency, but keep import of this module cheap
    import torch

__all__ = [
    "Backend",
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
]

T = TypeVar("T")

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


# --------------------------------------------------------------------------- ledger


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
    """A reserved virtual address range. ``va`` never changes while it lives."""

    va: int
    size: int
    freed: bool = False
    mappings: dict[int, Mapping] = field(default_factory=dict)  # offset -> Mapping

    @property
    def end(self) -> int:
        return self.va + self.size

    def mapping_at(self, offset: int) -> Mapping | None:
        return self.mappings.get(offset)

    def is_accessible(self, offset: int, size: int) -> bool:
        """True when every byte of ``[offset, offset + size)`` is mapped and accessible."""
        pos, end = offset, offset + size
        while pos < end:
            hit = None
            for m in self.mappings.values():
                if m.offset <= pos < m.offset + m.size:
                    hit = m
                    break
            if hit is None or not hit.accessible:
                return False
            pos = hit.offset + hit.size
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
        #: the most bytes mapped at once since the last :meth:`reset_peak`.
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
        """Bytes mapped through graphslot now (an allocation mapped twice counts twice)."""
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
        if op not in VMM_OPS:
            raise UsageError(f"cannot inject a fault into {op!r}; choose one of {', '.join(VMM_OPS)}")
        with self._lock:
            self._plan[op] = [after, times]

    def clear(self) -> None:
        with self._lock:
            self._plan.clear()

    def check(self, op: str, desc: str) -> None:
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


# --------------------------------------------------------------------------- transaction


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


# --------------------------------------------------------------------------- graphs


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Collect garbage now, then keep the collector off until the block ends.

    Device graph captures run inside it: a reference cycle that holds device tensors (a
    saved-tensor hook that returns its argument makes one) must not be freed mid-capture,
    where freeing touches streams the capture does not own and invalidates it.
    """
    import gc

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class DeviceGraph(abc.ABC):
    """A captured sequence of device work bound to the addresses it touched.

    Replay reads and writes exactly the addresses seen at capture; whatever physical
    memory is mapped there at replay time is what the graph sees.
    """

    @abc.abstractmethod
    def capture(self, stream: Any = None) -> ContextManager[None]:
        """Context manager: work issued inside is recorded instead of (or as well as) run."""

    @abc.abstractmethod
    def replay(self) -> None:
        """Run the recorded work again on the current stream."""

    @property
    def pool_bytes(self) -> int | None:
        """Bytes reserved by this graph's private memory pool (shared pools count fully)."""
        return None


class RngStream(abc.ABC):
    """A random stream of graphs' own, which two graphs can draw the same numbers from.

    A recomputed layer's backward graph runs its forward again: its random ops (dropout)
    must draw what its forward graph drew at that microbatch's replay, while the next
    forward draws fresh numbers. Graphs attached to the stream draw from it what their
    captures drew under :meth:`drawing`; :meth:`position` and :meth:`seek` (outside
    capture) rewind it between replays. Made by :meth:`Backend.new_rng_stream`.
    """

    @abc.abstractmethod
    def attach(self, graph: DeviceGraph) -> None:
        """Before ``graph``'s capture: its replays may draw from this stream."""

    @abc.abstractmethod
    def drawing(self) -> ContextManager[None]:
        """Inside the capture of an attached graph: the random ops issued inside draw from
        this stream, at capture and at every replay."""

    @abc.abstractmethod
    def position(self) -> Any:
        """Where the stream is now (outside capture), for :meth:`seek`."""

    @abc.abstractmethod
    def seek(self, position: Any) -> None:
        """Move to ``position``: the next replay draws what was drawn from there before."""


# --------------------------------------------------------------------------- backend


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


class Backend(abc.ABC):
    """One device reached through one vendor's VMM driver, streams and events.

    Args:
        driver: the vendor's raw VMM calls; a backend that must set the device up first
            may pass None here and assign :attr:`driver` before the first driver call.
    """

    #: short name used by ``GRAPHSLOT_BACKEND`` ("cpu", "cuda", "musa").
    name: str = "abstract"

    #: the raw VMM calls; only this class's checked methods call them
    driver: VmmDriver

    def __init__(self, driver: VmmDriver | None = None) -> None:
        if driver is not None:
            self.driver = driver
        self.ledger = Ledger()
        self.faults = FaultPlan()
        #: driver calls and host synchronisations made through this backend, by name.
        self.counters: Counter[str] = Counter()
        self._lock = threading.RLock()  # serialises every driver call
        self._granularity: int | None = None
        #: page-locked host bytes of live buffers made by :meth:`pinned_empty`
        self.pinned_bytes = 0
        self._pinned_lock = threading.Lock()
        self._side: Any = None
        self._free_events: list[Any] = []  # events of dropped LentEvents, to record again

    def side_stream(self) -> Any:
        """This backend's one stream for eager side work, such as the warm-up iterations
        before a capture (made on first use, the same object afterwards).

        Libraries keep state per stream for as long as the process lives (cuBLAS and
        cuBLASLt a workspace of tens of MiB for each stream and thread that ran a matmul),
        so work that needs a stream other than the current one, over and over (every
        graphed stack built), shares this one and pays that state once."""
        with self._lock:
            if self._side is None:
                self._side = self.new_stream()
            return self._side

    # ------------------------------------------------------------------ what a backend supplies
    # Besides :attr:`driver`: capture state, streams and events (torch's protocol), copies,
    # tensors over raw addresses, graphs. Arguments are already validated.

    @abc.abstractmethod
    def _is_capturing(self) -> bool: ...

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream work is issued on now, in this thread."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A new stream (for copies: runs concurrently with the current stream)."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> ContextManager[Any]:
        """Context manager that makes ``stream`` current in this thread."""

    @abc.abstractmethod
    def _new_event(self, timing: bool) -> Any:
        """A new framework event (with timing if asked)."""

    def new_event(self, timing: bool = False) -> Any:
        """An event that nothing recorded yet; ``timing=True`` lets :meth:`elapsed_ms` read it.

        Without timing it is a :class:`LentEvent`: its framework event may be one that an
        earlier, dropped handle recorded, now recorded again (cheaper than a new one). Like
        every stream this backend works with, it is for this backend's device only (a
        framework event keeps the device of its first record)."""
        if timing:
            return self._new_event(True)
        free = self._free_events
        try:
            ev = free.pop()  # (pop, not a length check first: another thread may take the last)
        except IndexError:
            ev = self._new_event(False)
        return LentEvent(ev, free)

    # A LentEvent speaks the framework event's protocol itself (record, query, synchronize,
    # wait), so these need not tell the two apart.
    def _record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def _wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query_event(self, event: Any) -> bool:
        """True when all work before the event's last record has finished."""
        return bool(event.query())

    def _event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded timing events."""
        return float(start.elapsed_time(end))

    # -- events inside graphs ---------------------------------------------------------
    #: whether a graph under capture can record and wait on events itself (record and wait
    #: nodes of its own), as the offload engine's sections need: a wait node waits for the
    #: record its event had when the graph was launched (not for one queued later), and a
    #: wait queued on another stream after a launch waits for the graph's record node in
    #: that launch. Backends that can, measured so (benchmarks/graph_events.py), say True.
    graph_events: bool = False

    def _new_graph_event(self) -> Any:
        raise NotImplementedError

    def _graph_record(self, event: Any) -> None:
        raise NotImplementedError

    def _graph_wait(self, event: Any) -> None:
        raise NotImplementedError

    def new_graph_event(self) -> Any:
        """An event that a graph under capture may record or wait on (:meth:`graph_record`,
        :meth:`graph_wait`) and that streams use outside graphs like any event. It starts
        complete, and it is its owner's for good (never lent to anyone else).

        Raises:
            UsageError: this backend's graphs cannot hold events (``graph_events`` is
                False), or a capture is under way.
        """
        if not self.graph_events:
            raise UsageError(f"the {self.name} backend's graphs cannot record or wait on events")
        if self._is_capturing():
            raise UsageError("new_graph_event: make graph events before the capture that uses them")
        return self._new_graph_event()

    def _in_graph(self, what: str) -> None:
        if not self.graph_events:
            raise UsageError(f"{what}: the {self.name} backend's graphs cannot hold events")
        if not self._is_capturing():
            raise UsageError(f"{what} adds a node to the graph under capture; no capture is under way")

    def graph_record(self, event: Any) -> None:
        """Inside a capture: the graph records ``event`` at this point of its work, at every
        replay (streams outside wait for that record as for any)."""
        self._in_graph("graph_record")
        self._graph_record(event)

    def graph_wait(self, event: Any) -> None:
        """Inside a capture: the graph's later work waits, at every replay, for the record
        ``event`` had when that replay was launched."""
        self._in_graph("graph_wait")
        self._graph_wait(event)

    @abc.abstractmethod
    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None: ...

    @abc.abstractmethod
    def _pinned_empty(self, nbytes: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _tensor_at(self, va: int, nbytes: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _synchronize(self) -> None: ...

    @abc.abstractmethod
    def new_graph(self, share_pool_with: DeviceGraph | None = None,
                  pool_region: tuple[int, int] | None = None) -> DeviceGraph:
        """An empty device graph; see :class:`DeviceGraph`.

        Graphs made with ``share_pool_with=g`` draw their private memory from ``g``'s pool,
        as the forward and backward graphs of one layer should.

        ``pool_region=(va, size)`` makes the graph's private pool come from that range
        of a graphslot reservation, which the caller maps (see :mod:`graphslot.arena`):
        graphs of mutually exclusive variants can then share physical memory. Such a
        graph has ``pool_region``, ``pool_used_bytes`` (the high-water mark) and
        ``executes_during_capture`` (whether the region must be mapped while capturing).
        A capture that needs more than ``size`` bytes fails with a
        :class:`~graphslot.errors.UsageError`. Pass one of the two arguments, not both.
        """

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Device name, VMM support and versions: ``{"device", "vmm_supported", "versions"}``."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device tensors of this backend live on."""

    # ------------------------------------------------------------------ helpers

    def _call(self, op: str, desc: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one raw VMM call: fault plan, capture guard, counting, error context."""
        if self._is_capturing():
            raise StateError(f"{desc}: driver call {op} refused during graph capture; "
                             "map and unmap memory outside capture and replay")
        self.faults.check(op, desc)
        self.counters[op] += 1
        try:
            return fn(*args)
        except DriverError as e:
            if e.op:
                raise
            raise DriverError(desc, e.call, e.name, e.code, e.detail) from None

    def _check_size(self, what: str, size: Any, *, granular: bool = True) -> int:
        if isinstance(size, bool) or not isinstance(size, int):
            raise UsageError(f"{what}: size must be an int, got {type(size).__name__} {size!r}")
        if size <= 0:
            raise UsageError(f"{what}: size must be positive, got {size}")
        g = self.granularity
        if granular and size % g:
            raise UsageError(
                f"{what}: size {size} is not a multiple of the allocation granularity {g} "
                f"({_fmt(g)}); round it up with graphslot.align_up(size, backend.granularity)")
        return size

    def _live(self, res: Reservation, what: str) -> Reservation:
        if not isinstance(res, Reservation):
            raise UsageError(f"{what}: expected a Reservation, got {type(res).__name__}")
        if res.freed or self.ledger.reservations.get(res.va) is not res:
            raise UsageError(f"{what}: reservation at 0x{res.va:x} was freed or belongs to "
                             f"another backend; reserve a new range")
        return res

    def _range(self, res: Reservation, offset: int, size: int, what: str) -> None:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise UsageError(f"{what}: offset must be a non-negative int, got {offset!r}")
        if offset % self.granularity:
            raise UsageError(f"{what}: offset {offset} is not a multiple of the granularity "
                             f"{self.granularity}")
        if offset + size > res.size:
            raise UsageError(f"{what}: [{offset}, {offset + size}) runs past the end of the "
                             f"{res.size}-byte reservation at 0x{res.va:x}")

    # ------------------------------------------------------------------ public: memory

    @property
    def granularity(self) -> int:
        """Allocation granularity in bytes: sizes and offsets must be multiples of it."""
        if self._granularity is None:
            self._granularity = int(self.driver.granularity())
        return self._granularity

    def reserve(self, size: int, alignment: int = 0) -> Reservation:
        """Reserve ``size`` bytes of virtual address space (no physical memory yet)."""
        self._check_size("reserve", size)
        if alignment < 0 or (alignment and (alignment & (alignment - 1))):
            raise UsageError(f"reserve: alignment must be 0 or a power of two, got {alignment}")
        with self._lock:
            va = self._call("reserve", f"reserve {_fmt(size)} of address space",
                            self.driver.reserve, size, alignment)
            res = Reservation(va, size)
            self.ledger.reservations[va] = res
            return res

    def free(self, res: Reservation) -> None:
        """Give a reservation's address range back. Everything in it must be unmapped."""
        with self._lock:
            self._live(res, "free")
            if res.mappings:
                offs = ", ".join(str(o) for o in sorted(res.mappings))
                raise UsageError(f"free: reservation at 0x{res.va:x} still has mappings at "
                                 f"offset(s) {offs}; unmap them first")
            self._call("free", f"free the {_fmt(res.size)} reservation at 0x{res.va:x}",
                       self.driver.free, res.va, res.size)
            res.freed = True
            del self.ledger.reservations[res.va]

    def create(self, size: int) -> Allocation:
        """Create ``size`` bytes of physical backing on the device."""
        self._check_size("create", size)
        with self._lock:
            handle = self._call("create", f"create {_fmt(size)} of physical memory",
                                self.driver.create, size)
            alloc = Allocation(size, handle)
            self.ledger._on_create(alloc)
            return alloc

    def release(self, alloc: Allocation) -> None:
        """Return physical backing to the driver. It must not be mapped anywhere."""
        if not isinstance(alloc, Allocation):
            raise UsageError(f"release: expected an Allocation, got {type(alloc).__name__}")
        with self._lock:
            if alloc.released or alloc not in self.ledger.allocations:
                raise UsageError(f"release: {alloc!r} was already released (double release)")
            if alloc.mapped_at:
                where = ", ".join(f"0x{va + off:x}" for va, off in sorted(alloc.mapped_at))
                raise UsageError(f"release: {alloc!r} is still mapped at {where}; unmap first")
            self._call("release", f"release {_fmt(alloc.size)} of physical memory",
                       self.driver.release, alloc.handle)
            alloc.released = True
            self.ledger._on_release(alloc)

    def map(self, res: Reservation, offset: int, alloc: Allocation) -> None:
        """Map all of ``alloc`` at ``offset`` of ``res``. Access is granted by :meth:`set_access`."""
        with self._lock:
            self._live(res, "map")
            if not isinstance(alloc, Allocation) or alloc.released or alloc not in self.ledger.allocations:
                raise UsageError(f"map: {alloc!r} is not a live allocation of this backend")
            self._range(res, offset, alloc.size, "map")
            for m in res.mappings.values():
                if m.offset < offset + alloc.size and offset < m.offset + m.size:
                    raise UsageError(
                        f"map: [{offset}, {offset + alloc.size}) of the reservation at "
                        f"0x{res.va:x} overlaps the mapping at offset {m.offset} "
                        f"({_fmt(m.size)}); unmap it first")
            va = res.va + offset
            self._call("map", f"map {_fmt(alloc.size)} at 0x{va:x}",
                       self.driver.map, va, alloc.size, alloc.handle)
            res.mappings[offset] = Mapping(offset, alloc.size, alloc)
            alloc.mapped_at.add((res.va, offset))
            self.ledger._on_map(alloc.size)

    def set_access(self, res: Reservation, offset: int, size: int) -> None:
        """Grant the device read/write access to mapped ``[offset, offset + size)``."""
        self._check_size("set_access", size)
        with self._lock:
            self._live(res, "set_access")
            self._range(res, offset, size, "set_access")
            covered = self._mappings_in(res, offset, size, "set_access")
            va = res.va + offset
            self._call("set_access", f"set read/write access on {_fmt(size)} at 0x{va:x}",
                       self.driver.set_access, va, size)
            for m in covered:
                m.accessible = True

    def unmap(self, res: Reservation, offset: int, size: int) -> None:
        """Unmap ``[offset, offset + size)``; the address range stays reserved.

        The range must consist of whole mappings. Make sure no queued work still
        touches it (wait on an event first): the driver does not.
        """
        self._check_size("unmap", size)
        with self._lock:
            self._live(res, "unmap")
            self._range(res, offset, size, "unmap")
            covered = self._mappings_in(res, offset, size, "unmap")
            va = res.va + offset
            self._call("unmap", f"unmap {_fmt(size)} at 0x{va:x}", self.driver.unmap, va, size)
            for m in covered:
                del res.mappings[m.offset]
                m.allocation.mapped_at.discard((res.va, m.offset))
                self.ledger._on_unmap(m.size)

    def _mappings_in(self, res: Reservation, offset: int, size: int, what: str) -> list[Mapping]:
        """The mappings that exactly tile ``[offset, offset + size)``, or a UsageError."""
        out, pos, end = [], offset, offset + size
        while pos < end:
            m = res.mappings.get(pos)
            if m is None:
                raise UsageError(f"{what}: nothing is mapped at offset {pos} (0x{res.va + pos:x}) "
                                 f"of the reservation at 0x{res.va:x}")
            if m.offset + m.size > end:
                raise UsageError(f"{what}: [{offset}, {end}) ends inside the mapping at offset "
                                 f"{m.offset} ({_fmt(m.size)}); use whole mappings")
            out.append(m)
            pos = m.offset + m.size
        return out

    def transaction(self) -> Transaction:
        """A :class:`Transaction`: multi-step VMM work that rolls back on failure."""
        return Transaction(self)

    def map_new(self, res: Reservation, offset: int, size: int) -> Allocation:
        """Create ``size`` bytes, map them at ``offset`` and grant access, all or nothing."""
        with self.transaction() as tx:
            alloc = tx.create(size)
            tx.map(res, offset, alloc)
            tx.set_access(res, offset, size)
        return alloc

    def unmap_release(self, res: Reservation, offset: int) -> None:
        """Unmap the mapping at ``offset`` and release its backing."""
        m = res.mapping_at(offset)
        if m is None:
            raise UsageError(f"unmap_release: nothing is mapped at offset {offset} of {res!r}")
        self.unmap(res, offset, m.size)
        self.release(m.allocation)

    def reserve_mapped(self, size: int) -> tuple[Reservation, Allocation]:
        """Reserve, create, map and grant access to ``size`` bytes, all or nothing."""
        with self.transaction() as tx:
            res = tx.reserve(size)
            alloc = tx.create(size)
            tx.map(res, 0, alloc)
            tx.set_access(res, 0, size)
        return res, alloc

    def pool_region(self, region: Any) -> tuple[int, int, Reservation]:
        """Check a graph pool region ``(va, size)``; returns ``(va, size, its reservation)``."""
        try:
            va, size = (int(v) for v in region)
        except (TypeError, ValueError):
            raise UsageError(f"pool_region must be a (va, size) pair of ints, got {region!r}") from None
        if size <= 0 or va <= 0:
            raise UsageError(f"pool_region (0x{va:x}, {size}) must have a positive address and size")
        res = self.ledger.find(va, size)
        if res is None:
            raise UsageError(f"pool_region [0x{va:x}, 0x{va + size:x}) is not inside a live "
                             "reservation of this backend; reserve it first")
        return va, size, res

    def mem_info(self) -> tuple[int, int]:
        """Driver-level ``(free_bytes, total_bytes)`` of the device."""
        return self.driver.mem_info()

    def empty_cache(self) -> None:
        """Return the framework allocator's cached, unused blocks to the driver (if any)."""

    def footprint_bytes(self) -> int | None:
        """Memory this process really holds on the device, where the backend can tell it
        apart from everyone else's (the cpu backend can); ``None`` means read the driver."""
        return None

    def allocator_stats(self, reset_peak: bool = False) -> dict[str, int | None]:
        """The framework allocator's view of device memory, graph private pools included.

        Keys: ``allocated_bytes``, ``reserved_bytes``, ``peak_reserved_bytes`` and
        ``peak_allocated_bytes`` (since the last ``reset_peak=True``; the figures returned
        are those before the reset), ``graph_pool_reserved_bytes`` and
        ``graph_pool_allocated_bytes``. ``None`` where this backend's allocator cannot see
        a figure. The default sees nothing; backends override it.
        """
        return {"allocated_bytes": None, "reserved_bytes": None, "peak_reserved_bytes": None,
                "peak_allocated_bytes": None, "graph_pool_reserved_bytes": None,
                "graph_pool_allocated_bytes": None}

    _rng_streams_made = 0  #: (per backend object once it makes one: see _rng_stream_seed)

    def new_rng_stream(self) -> RngStream | None:
        """A random stream of graphs' own (:class:`RngStream`), seeded from the framework's
        seed as it is when the stream is made (a later ``torch.manual_seed`` leaves it be);
        None where this backend has none (a recomputed layer's random ops then draw other
        numbers than its forward did)."""
        return None

    def _rng_stream_seed(self, initial_seed: int) -> int:
        """The seed of this backend's next :class:`RngStream`: the framework's seed moved
        on by a count of the streams made, so no two streams draw alike, and a run seeded
        alike makes the same ones."""
        self._rng_streams_made += 1
        return (initial_seed + 0x9E3779B97F4A7C15 * self._rng_streams_made) % (1 << 63)

    #: whether :meth:`make_graphed_callables` exists here (the framework's own, for comparison)
    has_graphed_callables: bool = False

    def make_graphed_callables(self, callables: tuple[Any, ...], sample_args: tuple[Any, ...]) -> Any:
        """The framework's own graphed callables over ``callables`` (on cuda,
        ``torch.cuda.make_graphed_callables``): the peer graphslot is measured against."""
        raise UsageError(f"the {self.name} backend's framework has no graphed callables")

    def graph_pool_segments(self) -> list[tuple[int, int]] | None:
        """``(address, bytes)`` of each segment the framework allocator holds for graph
        private pools, or ``None`` where this backend cannot tell."""
        return None

    def return_to_pool(self, t: torch.Tensor) -> torch.Tensor | None:
        """Give the bytes of ``t`` (allocated during a capture) back to its graph pool, so
        that graphs captured later may reuse them, and return a non-owning view of the same
        address, shape and stride. Only for a tensor the graphs read and write solely while
        the graph that needs it runs (a buffer between two consecutive replays): later
        captures may place their own data there. ``t`` and every tensor sharing its
        storage keep their metadata but no bytes.

        Returns ``None`` (and changes nothing) where the backend's graphs keep what they
        captured for their whole life (the default).
        """
        return None

    # ------------------------------------------------------------------ public: tensors

    def tensor_at(self, va: int, shape: Sequence[int], dtype: torch.dtype,
                  stride: Sequence[int] | None = None) -> torch.Tensor:
        """A tensor view of ``shape``/``dtype``/``stride`` at ``va``; ``data_ptr() == va``.

        The view does not own memory: it is valid only while ``va`` stays reserved.
        Reading it while nothing is mapped faults (the process dies on cpu; the
        device context is lost on a GPU), exactly like a graph replay would.
        """
        import torch

        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise UsageError(f"tensor_at: negative dimension in shape {shape}")
        if stride is None:
            stride = tuple(torch.empty(shape, device="meta").stride()) if shape else ()
        stride = tuple(int(s) for s in stride)
        if len(stride) != len(shape):
            raise UsageError(f"tensor_at: stride {stride} does not match shape {shape}")
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        if va % itemsize:
            raise UsageError(f"tensor_at: address 0x{va:x} is not aligned to {itemsize} bytes for {dtype}")
        nbytes = max(view_extent(shape, stride, itemsize), itemsize)
        if self.ledger.find(va, nbytes) is None:
            raise UsageError(f"tensor_at: [0x{va:x}, 0x{va + nbytes:x}) is not inside a live "
                             "reservation of this backend (freed, or never reserved)")
        flat = self._tensor_at(va, nbytes)
        typed = flat.view(dtype)
        return typed.as_strided(shape, stride)

    def alias_bytes(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A non-owning byte view of ``nbytes`` at ``ptr``: memory the framework allocator
        owns (a graph's private pool, say), not graphslot. Valid only while its owner keeps
        that memory; a graph's pool keeps it for the graph's life."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise UsageError(f"alias_bytes: nbytes must be a positive int, got {nbytes!r}")
        if not isinstance(ptr, int) or ptr <= 0:
            raise UsageError(f"alias_bytes: ptr must be a positive address, got {ptr!r}")
        return self._tensor_at(ptr, nbytes)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host byte buffer of ``nbytes`` for asynchronous copies."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise UsageError(f"pinned_empty: nbytes must be a positive int, got {nbytes!r}")
        t = self._pinned_empty(nbytes)
        # Counted while the buffer lives, so memory.report shows host buffers graphslot holds.
        with self._pinned_lock:
            self.pinned_bytes += nbytes
        weakref.finalize(t, self._unpin, nbytes).atexit = False
        return t

    def _unpin(self, nbytes: int) -> None:
        with self._pinned_lock:
            self.pinned_bytes -= nbytes

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (default: the current stream).

        Works device to pinned host, host to device and device to device. Returns at once;
        record an event on the stream to know when the copy is done. Both tensors must
        stay alive until then.
        """
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise UsageError(f"copy_async: destination {tuple(dst.shape)} {dst.dtype} does not "
                             f"match source {tuple(src.shape)} {src.dtype}")
        self._copy(dst, src, self.current_stream() if stream is None else stream)

    # ------------------------------------------------------------------ public: sync

    def record_event(self, event: Any, stream: Any = None) -> Any:
        """Record ``event`` on ``stream`` (default: current). Returns the event."""
        self._record(event, self.current_stream() if stream is None else stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make future work on ``stream`` wait for ``event``; the host does not block."""
        self._wait(stream, event)

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` completes (counted as a host synchronisation)."""
        self.counters["host_sync"] += 1
        self._event_synchronize(event)

    def synchronize(self) -> None:
        """Block the host until all work on the device finished (counted)."""
        self.counters["host_sync"] += 1
        self._synchronize()

    def is_capturing(self) -> bool:
        """True while the current stream is capturing a graph."""
        return self._is_capturing()

    # ------------------------------------------------------------------ public: info

    def driver_calls(self) -> int:
        """Total VMM driver calls made through this backend so far."""
        return sum(self.counters[op] for op in VMM_OPS)

    def info(self) -> dict[str, Any]:
        """What ``graphslot info`` prints: device, granularity, VMM support, memory, versions."""
        d = self.describe()
        free, total = self.mem_info()
        return {
            "backend": self.name,
            "device": d.get("device"),
            "granularity": self.granularity if d.get("vmm_supported") else None,
            "vmm_supported": bool(d.get("vmm_supported")),
            "free_bytes": free,
            "total_bytes": total,
            "versions": d.get("versions", {}),
        }

    @contextlib.contextmanager
    def timed(self, stream: Any = None) -> Iterator[dict[str, float]]:
        """Context manager measuring device time of the work issued inside it, in ms."""
        out: dict[str, float] = {}
        s = self.current_stream() if stream is None else stream
        a, b = self.new_event(timing=True), self.new_event(timing=True)
        self.record_event(a, s)
        t0 = time.perf_counter()
        yield out
        self.record_event(b, s)
        self._event_synchronize(b)
        out["host_ms"] = (time.perf_counter() - t0) * 1e3
        out["device_ms"] = self.elapsed_ms(a, b)

    def __repr__(self) -> str:
        return f"<graphslot {self.name} backend on {self.device}>"
