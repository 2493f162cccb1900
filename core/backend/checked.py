"""The checked :class:`Backend`: what users and the rest of graphslot call.

Every virtual-memory call is checked against graphslot's :class:`~graphslot.backend.Ledger`
before the vendor's driver sees it; streams, events, copies, tensors over raw addresses
and graphs go to the vendor's hooks (:class:`~graphslot.backend.DeviceVendor`) behind
argument checks; optional features answer with their defaults where the vendor's
:class:`~graphslot.backend.Capabilities` do not declare them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from ..errors import DriverError, StateError, UsageError
from ..sizes import view_extent
from .driver import VmmDriver
from .events import LentEvent
from .graphs import RngStream
from .ledger import VMM_OPS, Allocation, Ledger, Mapping, Reservation, _fmt
from .transaction import FaultPlan, Transaction
from .vendor import ALLOCATOR_STATS_KEYS, DeviceVendor

if TYPE_CHECKING:  # torch is a runtime dependency, but keep import of this module cheap
    import torch

__all__ = ["Backend"]

T = TypeVar("T")


class Backend(DeviceVendor):
    """One device reached through one vendor's VMM driver, streams and events.

    A vendor subclasses it and implements :class:`~graphslot.backend.DeviceVendor`;
    everything defined here is the same for every vendor.

    Args:
        driver: the vendor's raw VMM calls; a backend that must set the device up first
            may pass None here and assign :attr:`driver` before the first driver call.
    """

    def __init__(self, driver: VmmDriver | None = None) -> None:
        if driver is not None:
            self.driver = driver
        self.ledger = Ledger()
        self.faults = FaultPlan()
        #: driver calls and host synchronisations made through this backend, by name.
        self.counters: Counter[str] = Counter()
        #: serialises every driver call (a vendor's own driver work takes it too)
        self.driver_lock = threading.RLock()
        self._granularity: int | None = None
        #: page-locked host bytes of live buffers made by :meth:`pinned_empty`
        self.pinned_bytes = 0
        self._pinned_lock = threading.Lock()
        self._side: Any = None
        self._side_warm = False
        self._side_lock = threading.RLock()
        self._free_events: list[Any] = []  # events of dropped LentEvents, to record again

    # ------------------------------------------------------------------ helpers

    def _call(self, op: str, desc: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one raw VMM call: fault plan, capture guard, counting, error context."""
        if self.vendor_is_capturing():
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
        with self.driver_lock:
            va = self._call("reserve", f"reserve {_fmt(size)} of address space",
                            self.driver.reserve, size, alignment)
            res = Reservation(va, size)
            self.ledger.reservations[va] = res
            return res

    def free(self, res: Reservation) -> None:
        """Give a reservation's address range back. Everything in it must be unmapped."""
        with self.driver_lock:
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
        with self.driver_lock:
            handle = self._call("create", f"create {_fmt(size)} of physical memory",
                                self.driver.create, size)
            alloc = Allocation(size, handle)
            self.ledger._on_create(alloc)
            return alloc

    def release(self, alloc: Allocation) -> None:
        """Return physical backing to the driver. It must not be mapped anywhere."""
        if not isinstance(alloc, Allocation):
            raise UsageError(f"release: expected an Allocation, got {type(alloc).__name__}")
        with self.driver_lock:
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
        with self.driver_lock:
            self._live(res, "map")
            if not isinstance(alloc, Allocation) or alloc.released or alloc not in self.ledger.allocations:
                raise UsageError(f"map: {alloc!r} is not a live allocation of this backend")
            self._range(res, offset, alloc.size, "map")
            m = res.overlapping(offset, alloc.size)
            if m is not None:
                raise UsageError(
                    f"map: [{offset}, {offset + alloc.size}) of the reservation at "
                    f"0x{res.va:x} overlaps the mapping at offset {m.offset} "
                    f"({_fmt(m.size)}); unmap it first")
            va = res.va + offset
            self._call("map", f"map {_fmt(alloc.size)} at 0x{va:x}",
                       self.driver.map, va, alloc.size, alloc.handle)
            res.add_mapping(Mapping(offset, alloc.size, alloc))
            alloc.mapped_at.add((res.va, offset))
            if len(alloc.mapped_at) == 1:  # (mapped at a second address, it holds no more)
                self.ledger._on_map(alloc.size)

    def set_access(self, res: Reservation, offset: int, size: int) -> None:
        """Grant the device read/write access to mapped ``[offset, offset + size)``."""
        self._check_size("set_access", size)
        with self.driver_lock:
            self._live(res, "set_access")
            self._range(res, offset, size, "set_access")
            covered = self._mappings_in(res, offset, size, "set_access")
            va = res.va + offset
            self._call("set_access", f"set read/write access on {_fmt(size)} at 0x{va:x}",
                       self.driver.set_access, va, size)
            res.grant_access(covered)

    def unmap(self, res: Reservation, offset: int, size: int) -> None:
        """Unmap ``[offset, offset + size)``; the address range stays reserved.

        The range must consist of whole mappings. Make sure no queued work still
        touches it (wait on an event first): the driver does not.
        """
        self._check_size("unmap", size)
        with self.driver_lock:
            self._live(res, "unmap")
            self._range(res, offset, size, "unmap")
            covered = self._mappings_in(res, offset, size, "unmap")
            va = res.va + offset
            self._call("unmap", f"unmap {_fmt(size)} at 0x{va:x}", self.driver.unmap, va, size)
            for m in covered:
                res.remove_mapping(m.offset)
                m.allocation.mapped_at.discard((res.va, m.offset))
                if not m.allocation.mapped_at:
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
        flat = self.vendor_tensor_at(va, nbytes)
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
        return self.vendor_tensor_at(ptr, nbytes)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host byte buffer of ``nbytes`` for asynchronous copies."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise UsageError(f"pinned_empty: nbytes must be a positive int, got {nbytes!r}")
        t = self.vendor_pinned_empty(nbytes)
        # Counted while the buffer lives, so memory.report shows host buffers graphslot holds.
        with self._pinned_lock:
            self.pinned_bytes += nbytes
        # (on the storage: a view or a tensor set_ to it keeps the bytes after t is gone)
        weakref.finalize(t.untyped_storage(), self._unpin, nbytes).atexit = False
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
        self.vendor_copy(dst, src, self.current_stream() if stream is None else stream)

    # ------------------------------------------------------------------ public: streams and events
    # Streams and events are the framework's own objects with torch's method names
    # (``Stream.wait_event``, ``Event.record``, ``query``, ``synchronize``, ``elapsed_time``);
    # a LentEvent speaks the same protocol, so nothing here tells the two apart.

    def side_stream(self) -> Any:
        """This backend's one stream for eager side work, such as the warm-up iterations
        before a capture (made on first use, the same object afterwards).

        Libraries keep state per stream for as long as the process lives (cuBLAS and
        cuBLASLt a workspace of tens of MiB for each stream and thread that ran a matmul),
        so work that needs a stream other than the current one, over and over (every
        graphed stack built), shares this one and pays that state once: made at once,
        before anything is cached for the stream, in memory of its own."""
        with self._side_lock:  # (not the driver lock: the warm-up runs kernels)
            if self._side is None:
                self._side = self.new_stream()
            if not self._side_warm and not self.vendor_is_capturing():
                self.vendor_warm_stream(self._side)  # (made under a capture: the next call)
                self._side_warm = True
            return self._side

    def new_event(self, timing: bool = False) -> Any:
        """An event that nothing recorded yet; ``timing=True`` lets :meth:`elapsed_ms` read it.

        Without timing it is a :class:`LentEvent`: its framework event may be one that an
        earlier, dropped handle recorded, now recorded again (cheaper than a new one). Like
        every stream this backend works with, it is for this backend's device only (a
        framework event keeps the device of its first record)."""
        if timing:
            return self.vendor_new_event(True)
        free = self._free_events
        try:
            ev = free.pop()  # (pop, not a length check first: another thread may take the last)
        except IndexError:
            ev = self.vendor_new_event(False)
        return LentEvent(ev, free)

    def record_event(self, event: Any, stream: Any = None) -> Any:
        """Record ``event`` on ``stream`` (default: current). Returns the event."""
        event.record(self.current_stream() if stream is None else stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make future work on ``stream`` wait for ``event``; the host does not block."""
        stream.wait_event(event)

    def query_event(self, event: Any) -> bool:
        """True when all work before the event's last record has finished."""
        return bool(event.query())

    def synchronize_event(self, event: Any, *, count_as: str = "host_sync") -> None:
        """Block this thread until ``event`` completes, counted in :attr:`counters`.

        Args:
            event: the event to wait for.
            count_as: the counter this wait adds one to; a thread that blocks itself
                and not the training thread (the offload engine's driver worker) counts
                ``"worker_sync"``.
        """
        self.counters[count_as] += 1
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two recorded timing events."""
        return float(start.elapsed_time(end))

    def synchronize(self) -> None:
        """Block the host until all work on the device finished (counted)."""
        self.counters["host_sync"] += 1
        self.vendor_synchronize()

    def is_capturing(self) -> bool:
        """True while the current stream is capturing a graph."""
        return self.vendor_is_capturing()

    # ------------------------------------------------------------------ public: events inside graphs

    @property
    def graph_events(self) -> bool:
        """Whether this backend's graphs can record and wait on events themselves
        (:attr:`Capabilities.graph_events <graphslot.backend.Capabilities.graph_events>`)."""
        return self.capabilities.graph_events

    def new_graph_event(self) -> Any:
        """An event that a graph under capture may record or wait on (:meth:`graph_record`,
        :meth:`graph_wait`) and that streams use outside graphs like any event. It starts
        complete, and it is its owner's for good (never lent to anyone else).

        Raises:
            UsageError: this backend's graphs cannot hold events (``graph_events`` is
                False), or a capture is under way.
        """
        if not self.capabilities.graph_events:
            raise UsageError(f"the {self.name} backend's graphs cannot record or wait on events")
        if self.vendor_is_capturing():
            raise UsageError("new_graph_event: make graph events before the capture that uses them")
        return self.vendor_new_graph_event()

    def _in_graph(self, what: str) -> None:
        if not self.capabilities.graph_events:
            raise UsageError(f"{what}: the {self.name} backend's graphs cannot hold events")
        if not self.vendor_is_capturing():
            raise UsageError(f"{what} adds a node to the graph under capture; no capture is under way")

    def graph_record(self, event: Any) -> None:
        """Inside a capture: the graph records ``event`` at this point of its work, at every
        replay (streams outside wait for that record as for any)."""
        self._in_graph("graph_record")
        self.vendor_graph_record(event)

    def graph_wait(self, event: Any) -> None:
        """Inside a capture: the graph's later work waits, at every replay, for the record
        ``event`` had when that replay was launched."""
        self._in_graph("graph_wait")
        self.vendor_graph_wait(event)

    # ------------------------------------------------------------------ public: optional features
    # Each answers with its default where the vendor's capabilities do not declare it.

    def empty_cache(self) -> None:
        """Return the framework allocator's cached, unused blocks to the driver (if any)."""
        self.vendor_empty_cache()

    def footprint_bytes(self) -> int | None:
        """Memory this process really holds on the device, where the backend can tell it
        apart from everyone else's (the cpu backend can); ``None`` means read the driver."""
        return self.vendor_footprint_bytes() if self.capabilities.footprint else None

    def allocator_stats(self, reset_peak: bool = False) -> dict[str, int | None]:
        """The framework allocator's view of device memory, graph private pools included.

        Args:
            reset_peak: start the peaks anew after reading them.

        Returns:
            ``allocated_bytes``, ``reserved_bytes``, ``peak_reserved_bytes`` and
            ``peak_allocated_bytes`` (since the last ``reset_peak=True``; the figures
            returned are those before the reset), ``graph_pool_reserved_bytes`` and
            ``graph_pool_allocated_bytes``. ``None`` where this backend's allocator cannot
            see a figure (every one, without ``Capabilities.allocator_stats``).
        """
        if not self.capabilities.allocator_stats:
            return dict.fromkeys(ALLOCATOR_STATS_KEYS)
        return self.vendor_allocator_stats(reset_peak)

    def new_rng_stream(self) -> RngStream | None:
        """A random stream of graphs' own (:class:`RngStream`), seeded from the framework's
        seed as it is when the stream is made (a later ``torch.manual_seed`` leaves it be);
        None where this backend has none (a recomputed layer's random ops then draw other
        numbers than its forward did)."""
        return self.vendor_new_rng_stream() if self.capabilities.rng_streams else None

    @property
    def has_graphed_callables(self) -> bool:
        """Whether :meth:`make_graphed_callables` exists here (the framework's own, for comparison)."""
        return self.capabilities.graphed_callables

    def make_graphed_callables(self, callables: tuple[Any, ...], sample_args: tuple[Any, ...]) -> Any:
        """The framework's own graphed callables over ``callables`` (on cuda,
        ``torch.cuda.make_graphed_callables``): the peer graphslot is measured against."""
        if not self.capabilities.graphed_callables:
            raise UsageError(f"the {self.name} backend's framework has no graphed callables")
        return self.vendor_graphed_callables(callables, sample_args)

    def graph_pool_segments(self) -> list[tuple[int, int]] | None:
        """``(address, bytes)`` of each segment the framework allocator holds for graph
        private pools, or ``None`` where this backend cannot tell."""
        return self.vendor_graph_pool_segments() if self.capabilities.pool_segments else None

    def region_reserved_bytes(self) -> int:
        """Bytes of the allocator's graph-pool segments that lie in graphslot reservations
        (the pools of region graphs): the allocator counts them as reserved, and the
        ledger counts the pages behind them, so a total of both counts these once less.
        0 where this backend cannot list its pools' segments."""
        segs = self.graph_pool_segments() or []
        return sum(n for va, n in segs if self.ledger.find(va, n) is not None)

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
        return self.vendor_return_to_pool(t) if self.capabilities.pool_return else None

    def ordinary_capture_kwargs(self) -> dict[str, Any]:
        """``capture()`` arguments under which an ordinary graph captures as this backend's
        region graphs do (``Capabilities.region_graphs``), for fair memory comparisons: on
        cuda, region graphs capture on graphslot's warmed stream, so per-stream library
        workspaces stay out of shared pages, and a baseline captured there too counts
        them alike.

        Returns:
            Keyword arguments for :meth:`DeviceGraph.capture` (none without region graphs).
        """
        return self.vendor_region_capture_kwargs() if self.capabilities.region_graphs else {}

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
    def timed(self, stream: Any = None, ahead_ms: float = 0.0) -> Iterator[dict[str, float]]:
        """Context manager measuring the work issued inside it, in ms: ``device_ms`` from
        device events, ``host_ms`` the host's time in the block (queuing the work).

        Args:
            stream: the stream the work goes to (default: current).
            ahead_ms: where the backend has :attr:`Capabilities.spin`, keep the stream busy
                this long first, so the host queues the whole block before the device
                starts on it and ``device_ms`` leaves out the host's launch gaps (what a
                graph of the same work takes). Give more than the block's host time.
                ``device_alone`` is then 1.0 where the device had not started the block
                when the host finished queuing it (0.0: the gaps may count: give more).

        Raises:
            UsageError: ``ahead_ms`` is negative, or given during a capture.
        """
        if ahead_ms < 0:
            raise UsageError(f"timed: ahead_ms must be 0 or more, not {ahead_ms}")
        spins = ahead_ms > 0 and self.capabilities.spin
        if spins and self.is_capturing():
            raise UsageError("timed: ahead_ms keeps a stream busy; not during a capture")
        out: dict[str, float] = {}
        s = self.current_stream() if stream is None else stream
        a, b = self.new_event(timing=True), self.new_event(timing=True)
        if spins:
            self.vendor_spin(ahead_ms, s)
        self.record_event(a, s)
        t0 = time.perf_counter()
        yield out
        out["host_ms"] = (time.perf_counter() - t0) * 1e3
        out["device_alone"] = 1.0 if spins and not self.query_event(a) else 0.0
        self.record_event(b, s)
        b.synchronize()
        out["device_ms"] = self.elapsed_ms(a, b)

    def __repr__(self) -> str:
        return f"<graphslot {self.name} backend on {self.device}>"
