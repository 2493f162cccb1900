"""Graph-safe activation offload through fixed-VA slots.

One :class:`OffloadGroup` holds the saved activations of one graphed unit (a layer).
Its life, and the life of each forward pass through it (a *ticket*), follow one state
enum, :class:`State`, and one transition table, :data:`TRANSITIONS`::

    group:   DISCOVERING --allocate--> ALLOCATED --begin_capture--> CAPTURING --finish_capture--> READY
    ticket:  READY --offload--> HELD --offload--> RELEASED (remap) | RESIDENT_PENDING (resident)
             (remap leaves HELD at once; resident when the engine is next asked for more)
             --restore--> RESTORING --wait_restored--> RESTORED --consumed--> DONE
             HELD --restore--> RESTORING (its own backward came next: nothing is copied)
             READY --offload--> KEPT (kept on the device) [--park--> PARKED] --wait_restored--> RESTORED
             READY --forget--> DONE (a forward that no backward follows)

* Discovery: an eager warm-up records each saved tensor's shape, stride, dtype and device.
* Allocation (outside capture): the slot's VA and backing, and reusable host buffers.
* Capture: each saved tensor is copied device to device into its place in the slot; the
  backward graph records the slot's address. Count, order, shape, stride, dtype, device and
  ``data_ptr() == slot VA`` are checked.
* Forward offload: after the forward replay, a copy stream waits only on a forward-done
  event and copies the slot to a host buffer. No host synchronisation. Resident banks
  *hold* the newest forward: its copy is queued by the next forward, a restore of another
  ticket, ``settle`` or ``close``; when its own backward comes first (the last layer of a
  pass), the activations never leave the bank and neither copy runs. Remap queues every
  copy at once (a held slot would stay mapped between the passes).
* Remap mode releases the physical backing once that copy finished (small slots of
  consecutive layers share one mapping, a *unit*, so they share its driver calls);
  resident (ping-pong) mode keeps two banks mapped per slot class and never calls the
  driver in a step.
* Backward restore: backing mapped again (remap) or the bank (resident) at the same VA, a
  host to device copy, and the compute stream waits on the restore event.

Where a group's activations are between forward and backward is a :class:`Residency`:
:class:`ResidentBanks` (two mapped banks per slot size, fenced, no driver calls),
:class:`RemapSlots` (pages mapped only while a graph uses them, driver calls on one
serialised worker thread, never inside a host callback or a capture), or, for groups that
do not offload (mode off, or layers left on the device), :class:`KeptOnDevice` (in the
graph's own memory, moved to a device buffer of their own while another microbatch's
graphs run). The engine does the copies and keeps the tickets; the residency is all that
differs between the modes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import queue
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .backend import Allocation, Backend, Reservation, align_up
from .errors import CaptureMismatchError, StateError, UsageError
from .sizes import view_extent

__all__ = [
    "Mode",
    "State",
    "TRANSITIONS",
    "SavedTensorSpec",
    "OffloadGroup",
    "OffloadEngine",
    "DriverWorker",
    "REMAP_UNIT_BYTES",
]

_ALIGN = 256  # byte alignment of each saved tensor inside a slot
#: remap mode's default unit: slots of consecutive layers share one mapping up to this size
REMAP_UNIT_BYTES = 32 << 20


class Mode(str, enum.Enum):
    """Where saved activations live between forward and backward."""

    OFF = "off"  #: no offload: saved tensors stay in the graph's own memory
    RESIDENT = "resident"  #: offload to host; two mapped banks per slot class, no driver calls
    REMAP = "remap"  #: offload to host; physical backing released between forward and backward


class State(enum.Enum):
    # Members are singletons: hash them by identity in C, not by name in Python (enum's
    # default), since every transition looks its state up in the table.
    __hash__ = object.__hash__

    DISCOVERING = "discovering"
    ALLOCATED = "allocated"
    CAPTURING = "capturing"
    READY = "ready"
    HELD = "held"  #: the newest forward's activations, still in its slot, their copy out not queued
    RELEASED = "released"
    RESIDENT_PENDING = "resident-pending"
    KEPT = "kept"  #: in the graph's own memory, on the device
    PARKED = "parked"  #: kept, moved to a device buffer while other graphs run
    RESTORING = "restoring"
    RESTORED = "restored"
    DONE = "done"


S = State
#: (state, call) -> next state. Anything else is a StateError naming group, state and call.
TRANSITIONS: dict[tuple[State, str], State] = {
    (S.DISCOVERING, "discover"): S.DISCOVERING,
    (S.DISCOVERING, "allocate"): S.ALLOCATED,
    (S.ALLOCATED, "begin_capture"): S.CAPTURING,
    (S.CAPTURING, "save_tensor"): S.CAPTURING,
    (S.CAPTURING, "finish_capture"): S.READY,
    (S.READY, "offload:forward"): S.READY,  # a group runs forwards once it is captured
    (S.READY, "keep"): S.READY,  # a kept group learns what its backward reads in the graph's memory
    (S.READY, "offload:held"): S.HELD,
    (S.HELD, "offload:remap"): S.RELEASED,
    (S.HELD, "offload:resident"): S.RESIDENT_PENDING,
    (S.HELD, "restore"): S.RESTORING,  # its own backward came next: the slot still holds them
    (S.RELEASED, "restore"): S.RESTORING,
    (S.RESIDENT_PENDING, "restore"): S.RESTORING,
    (S.RESTORING, "restore"): S.RESTORING,  # a look-ahead already started it
    (S.RESTORING, "wait_restored"): S.RESTORED,
    (S.RESTORING, "restore_failed"): S.RELEASED,  # remap: the mapping failed; the host copy stays
    (S.RESTORED, "consumed"): S.DONE,
    # Kept on the device: moved out while another microbatch's graphs run, and back at the
    # backward itself (nothing to copy ahead, so a restore leaves them where they are).
    (S.READY, "offload:kept"): S.KEPT,
    (S.KEPT, "park"): S.PARKED,
    (S.KEPT, "restore"): S.KEPT,
    (S.PARKED, "restore"): S.PARKED,
    (S.KEPT, "wait_restored"): S.RESTORED,
    (S.PARKED, "wait_restored"): S.RESTORED,
    (S.KEPT, "abandon"): S.DONE,
    (S.PARKED, "abandon"): S.DONE,
    (S.READY, "forget"): S.DONE,  # a forward with no backward (evaluation)
    # A forward whose backward will never come (its autograd graph was dropped, or a step
    # was abandoned part way): whatever it holds goes back.
    (S.HELD, "abandon"): S.DONE,
    (S.RELEASED, "abandon"): S.DONE,
    (S.RESIDENT_PENDING, "abandon"): S.DONE,
    (S.RESTORING, "abandon"): S.DONE,
    (S.RESTORED, "abandon"): S.DONE,
}


def _step(owner: str | Callable[[], str], state: State, call: str) -> State:
    """The state after ``call`` in ``state``, or a StateError naming ``owner`` (a string,
    or a callable that makes it: the hot path formats nothing unless it fails)."""
    nxt = TRANSITIONS.get((state, call))
    if nxt is None:
        allowed = sorted(c for (s, c) in TRANSITIONS if s is state)
        who = owner if isinstance(owner, str) else owner()
        raise StateError(f"{who}: cannot {call.split(':')[0]} in state {state.value} "
                         f"(allowed here: {', '.join(allowed) or 'nothing'})")
    return nxt


@dataclass(frozen=True)
class SavedTensorSpec:
    """What discovery saw of one saved tensor, and where it lives in the slot.

    Saved tensors that view one storage (a tensor saved twice, the q/k/v slices of one
    projection) share one region of the slot laid out like that storage, so their bytes
    are held and moved once, as the graph's own pool would hold them.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    device: str
    nbytes: int
    offset: int = 0  #: slot byte offset of the first element (set by layout)
    offload: bool = True  #: False: kept on the device (below the size threshold)
    storage: int = -1  #: which saved storage it views, in order of first sight; -1: its own region
    storage_offset: int = 0  #: byte offset of the first element inside that storage
    extent: int = 0  #: bytes from the first element to just past the last

    @staticmethod
    def of(t: torch.Tensor, storages: dict[int, int] | None = None) -> SavedTensorSpec:
        """Describe ``t``; with ``storages`` (data pointer -> index, filled in as seen)
        it is placed with the other saved views of its storage."""
        es = t.element_size()
        shape, stride = tuple(t.shape), tuple(t.stride())
        extent = view_extent(shape, stride, es)
        sid = -1
        overlaps = any(st == 0 and n > 1 for n, st in zip(shape, stride))  # expanded: copy densely
        if storages is not None and not overlaps and t.numel():
            sid = storages.setdefault(t.untyped_storage().data_ptr(), len(storages))
        return SavedTensorSpec(shape, stride, t.dtype, str(t.device), t.numel() * es,
                               storage=sid, storage_offset=int(t.storage_offset()) * es, extent=extent)

    def describe(self) -> str:
        return f"{list(self.shape)} stride {list(self.stride)} {self.dtype} on {self.device}"


def state_storages(modules: Iterable[Any]) -> set[int]:
    """Data pointers of the storages of ``modules``' parameters and buffers (a wrapper
    tensor subclass with no storage of its own to ask is skipped)."""
    out = set()
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            with contextlib.suppress(Exception):
                out.add(t.untyped_storage().data_ptr())
    return out


def never_offloaded(t: torch.Tensor, device_type: str, state: set[int]) -> bool:
    """The one rule for what activation offload leaves where it is: parameters and buffers
    (and views of them: their storage is in ``state``, see :func:`state_storages`), and
    tensors that cost the device nothing (empty, or not on a ``device_type`` device, such
    as the host-side RNG seeds some kernels save)."""
    return t.device.type != device_type or t.numel() == 0 or t.untyped_storage().data_ptr() in state


@contextlib.contextmanager
def recording_saved_tensors(record: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Run a forward that no backward follows, handing each tensor autograd saves to
    ``record``.

    The tensors are held here until the block ends, so no storage is freed and its address
    reused meanwhile (saved views are told apart by address), and autograd keeps none of
    them: a hook that returned a node's own output (SDPA saves its result) would tie the
    node to itself through C++, where no garbage collection sees it, and the memory would
    stay allocated for the life of the process.
    """
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> None:
        record(t)
        held.append(t)

    def unpack(_packed: None) -> torch.Tensor:
        raise AssertionError("graphslot: a recording forward is never differentiated")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
    held.clear()


# --------------------------------------------------------------------------- driver worker


class DriverWorker:
    """One thread that runs VMM driver work in submission order.

    Driver calls must not run inside a host callback or a capture, and should not stall
    the training thread; queueing them here keeps all of them on one serialised thread.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="graphslot-driver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        if self._closed:
            raise StateError("the driver worker was closed (its engine's close() ran); "
                             "build a new engine")
        fut: Future[Any] = Future()
        self._q.put((fn, fut))
        return fut

    def wait_event(self, event: Any) -> None:
        """Block this worker (not the training thread) until ``event`` completes."""
        self._backend.counters["worker_sync"] += 1
        self._backend._event_synchronize(event)

    def drain(self) -> None:
        self.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=10)


# --------------------------------------------------------------------------- slots and stashes


@dataclass(eq=False)
class SlotFences:
    """What orders the uses of one slot's bytes (a resident bank's, shared by the groups
    of its slot class, or a remap slot's): a forward rewrites them only after ``written``,
    a restore only after ``read`` and ``written``, and neither overwrites ``holder``."""

    written: Any = None  #: the latest writer's end: an occupant's copy out, or an evaluation forward
    read: Any = None  #: the last backward graph that read them
    holder: Ticket | None = None  #: a restore whose backward has not run yet
    #: the forward whose activations these bytes still are: nothing rewrote them since
    #: (resident banks; its restore then needs no copy)
    fresh: Ticket | None = None


@dataclass(eq=False)
class Bank:
    """A fixed-VA region with resident backing, shared by the groups of one slot class."""

    index: int
    reservation: Reservation
    allocation: Allocation | None
    fences: SlotFences = field(default_factory=SlotFences)


@dataclass(eq=False)
class Stash:
    """Where one forward pass's activations wait for backward: host and device parts."""

    host: Any  # pinned host bytes for offloaded tensors (or None)
    device: Any  # device bytes for tensors kept on the device (or None)
    free_after: Any = None  # event after which the buffers may be reused


@dataclass(eq=False)
class Ticket:
    """One forward pass through a group, from offload to the backward that consumes it."""

    group: OffloadGroup
    microbatch: int
    state: State = State.READY
    stash: Stash | None = None
    fwd_done: Any = None  #: the forward replay's end, which its copy out waits for
    d2h_done: Any = None
    restore_done: Any = None
    restore_job: Future[Any] | None = None
    map_job: Future[Any] | None = None  # remap: the mapping its restore copies into
    checksums: list[int] = field(default_factory=list)
    #: restored by leaving its forward's bytes where they were (no copy in); its host
    #: buffer, if it has one, was last touched by its copy out
    in_place: bool = False

    def _go(self, call: str) -> None:
        self.state = _step(self._owner, self.state, call)

    def _owner(self) -> str:
        return f"{self.group.name} (microbatch {self.microbatch})"


class OffloadGroup:
    """The saved activations of one graphed unit; see the module docstring."""

    def __init__(self, engine: OffloadEngine, name: str, offload: bool = True) -> None:
        self.engine = engine
        self.name = name
        self.offload_enabled = offload
        #: where its activations wait for backward (an offloading residency once its
        #: allocate() laid out something to offload; until then, and for ever if not,
        #: the engine's kept-on-device one)
        self.residency: Residency = engine.kept
        self.state = State.DISCOVERING
        self.specs: list[SavedTensorSpec] = []
        self.nbytes = 0  # slot bytes (all specs, aligned)
        self.host_bytes = 0  # bytes of offloaded specs (they come first in the slot)
        self.reservation: Reservation | None = None  # remap: its unit's VA; resident: the bank's
        self.slot_offset = 0  # where the slot starts in that reservation
        self.bank: Bank | None = None
        self.unit: RemapUnit | None = None
        self.views: list[torch.Tensor] = []
        self._host_pool: list[Stash] = []
        self._captured = 0
        self._bytes: tuple[Any, Any] = (None, None)
        self._seen_storages: dict[int, int] = {}  # discovery: data pointer -> storage index
        self.kept_bytes = 0  # kept groups: bytes their backward reads in the graph's memory
        self.index = len(engine.groups)  # key of this group's tickets in the engine

    def __repr__(self) -> str:
        return f"<OffloadGroup {self.name} {self.state.value} {len(self.specs)} tensors {self.nbytes} B>"

    def _go(self, call: str) -> None:
        self.state = _step(self._owner, self.state, call)

    def _owner(self) -> str:
        return f"offload group {self.name}"

    @property
    def empty(self) -> bool:
        return not self.specs

    @property
    def offloads(self) -> bool:
        """Whether this group's activations leave the device between forward and backward."""
        return self.residency is not self.engine.kept

    def keep(self, views: Iterable[torch.Tensor]) -> None:
        """A group that does not offload, once captured: the memory its backward graph
        reads in the graph's own memory, which other graphs may overwrite. Each view is a
        contiguous tensor over such bytes; while another microbatch's graphs run they are
        moved to a device buffer of their own and back before this group's backward.

        Raises:
            UsageError: the group offloads, or a view is not contiguous.
            StateError: the group is not captured yet.
        """
        if self.offload_enabled:
            raise UsageError(f"offload group {self.name}: keep() is for groups that do not offload")
        vs = list(views)
        for v in vs:
            if not v.is_contiguous():
                raise UsageError(f"offload group {self.name}: a kept view must be contiguous, "
                                 f"got shape {list(v.shape)} stride {list(v.stride())}")
        self._go("keep")
        self.views = [v.reshape(-1).view(torch.uint8) for v in vs]
        self.kept_bytes = sum(v.numel() for v in self.views)
        self.engine.kept.track(self)

    # -- discovery ---------------------------------------------------------------

    def discover(self, t: torch.Tensor) -> None:
        """Record one saved tensor seen during the eager warm-up (autograd is untouched)."""
        self._go("discover")
        self.specs.append(SavedTensorSpec.of(t, self._seen_storages))

    def adopt(self, specs: list[SavedTensorSpec]) -> None:
        """Take a layout discovered elsewhere (another graph of the same module)."""
        for sp in specs:
            self._go("discover")
            self.specs.append(dataclasses.replace(sp, offset=0, offload=True))

    def restart_discovery(self) -> None:
        """Forget what an earlier warm-up iteration recorded (each iteration must agree)."""
        if self.state is not State.DISCOVERING:
            _step(f"offload group {self.name}", self.state, "discover")
        self.specs.clear()
        self._seen_storages.clear()

    # -- allocation ----------------------------------------------------------------

    def layout(self) -> None:
        """Assign slot offsets: one region per saved storage (or per tensor of its own),
        offloaded regions first (one host copy), kept ones after."""
        eng = self.engine
        regions: dict[Any, list[int]] = {}
        for i, sp in enumerate(self.specs):
            regions.setdefault(("own", i) if sp.storage < 0 else sp.storage, []).append(i)
        spans = []
        for members in regions.values():
            own = self.specs[members[0]].storage < 0
            start = 0 if own else min(self.specs[i].storage_offset for i in members)
            end = (self.specs[members[0]].nbytes if own else
                   max(self.specs[i].storage_offset + self.specs[i].extent for i in members))
            off = self.offload_enabled and end - start >= eng.min_bytes
            spans.append((not off, members, own, start, end))
        spans.sort(key=lambda x: x[0])  # stable: offloaded regions first, in order of first sight
        placed: dict[int, SavedTensorSpec] = {}
        pos = host = 0
        for kept, members, own, start, end in spans:
            # Keep each view's address alignment as it was in its storage (kernels choose
            # their vector width from it), so slot and pool run the very same kernels.
            base = align_up(pos, _ALIGN) + start % _ALIGN
            for i in members:
                sp = self.specs[i]
                placed[i] = dataclasses.replace(sp, offset=base + (0 if own else sp.storage_offset - start),
                                                offload=not kept)
            pos = align_up(base + end - start, _ALIGN)
            if not kept:
                host = pos
        self.specs = [placed[i] for i in range(len(self.specs))]
        self.nbytes = pos
        self.host_bytes = host

    @property
    def slot_bytes(self) -> int:
        return align_up(self.nbytes, self.engine.backend.granularity) if self.nbytes else 0

    def allocate(self, bank_index: int = 0) -> None:
        """Outside capture: VA, physical backing and tensor views for the slot."""
        if self.engine.backend.is_capturing():
            raise StateError(f"offload group {self.name}: allocate must run outside graph capture")
        self._go("allocate")
        self.layout()
        eng = self.engine
        if not self.offload_enabled and not self.empty:
            raise UsageError(f"offload group {self.name} does not offload: its saved tensors stay in "
                             "the graph's memory, so it discovers none (tell it what its backward "
                             "reads with keep() after the capture)")
        if self.empty:
            return  # kept on the device: no slot (empty groups cost nothing)
        self.residency = eng.residency
        self.reservation = self.residency.place(self, bank_index)
        va = self.reservation.va + self.slot_offset
        self.views = [eng.backend.tensor_at(va + s.offset, s.shape, s.dtype,
                                            _dense_stride(s) if s.storage < 0 else s.stride)
                      for s in self.specs]
        # The VA never changes (remap swaps only the backing), so the flat byte views the
        # copies use are made once here, not per offload and restore.
        b, kept = eng.backend, self.nbytes - self.host_bytes
        self._bytes = (b.tensor_at(va, (self.host_bytes,), torch.uint8) if self.host_bytes else None,
                       b.tensor_at(va + self.host_bytes, (kept,), torch.uint8) if kept else None)

    # -- capture ---------------------------------------------------------------------

    def begin_capture(self) -> None:
        self._go("begin_capture")
        self._captured = 0
        self._capture_storages: dict[int, int] = {}  # region -> storage identity at capture
        self._capture_ptrs: dict[int, int] = {}  # storage identity -> region
        self._copied: set[tuple[Any, ...]] = set()
        # Storages are told apart by identity, not address: the pool may hand a freed
        # original's address to a later tensor. A weak reference pins the identity (the
        # storage object's own memory) without keeping the original's bytes alive, so the
        # pool reuses them at once, as it does for an eager forward.
        self._identities: list[Any] = []

    def save_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Pack hook during capture: copy ``t`` into its slot place and return the slot view."""
        self._go("save_tensor")
        i = self._captured
        if i >= len(self.specs):
            raise CaptureMismatchError(
                f"offload group {self.name}: capture saved more tensors than discovery saw "
                f"({len(self.specs)}); the layer must save the same tensors every time")
        spec = self.specs[i]
        got = SavedTensorSpec.of(t)
        if (got.shape, got.stride, got.dtype, got.device) != (spec.shape, spec.stride, spec.dtype, spec.device):
            raise CaptureMismatchError(
                f"offload group {self.name}: saved tensor #{i} is {got.describe()} at capture but "
                f"was {spec.describe()} at discovery")
        view = self.views[i]
        assert self.reservation is not None  # allocate() placed the slot
        want = self.reservation.va + self.slot_offset + spec.offset
        if view.data_ptr() != want:
            raise CaptureMismatchError(f"offload group {self.name}: slot view #{i} is at "
                                       f"0x{view.data_ptr():x}, not the slot address 0x{want:x}")
        key: tuple[Any, ...] = ("own", i)
        if spec.storage >= 0:
            # Views share a region only if they share a storage now as they did at discovery.
            st = t.untyped_storage()
            ptr = st._cdata
            self._identities.append(StorageWeakRef(st))
            had = self._capture_storages.setdefault(spec.storage, ptr)
            other = self._capture_ptrs.setdefault(ptr, spec.storage)
            if had != ptr or other != spec.storage or t.storage_offset() * t.element_size() != spec.storage_offset:
                raise CaptureMismatchError(
                    f"offload group {self.name}: saved tensor #{i} does not view its storage as at "
                    "discovery (which saved tensors share memory, or where, changed); the layer must "
                    "save the same tensors every time")
            key = (ptr, spec.storage_offset, spec.shape, spec.stride)
        if key not in self._copied:  # a tensor saved twice is copied once
            self._copied.add(key)
            view.copy_(t)
        self._captured += 1
        return view

    def forward_captured(self) -> None:
        """The forward capture is over: drop the storage identities it pinned."""
        self._identities = []

    def finish_capture(self) -> None:
        self._identities = []
        if self._captured != len(self.specs):
            raise CaptureMismatchError(
                f"offload group {self.name}: capture saved {self._captured} tensors, discovery "
                f"saw {len(self.specs)}")
        self._go("finish_capture")
        if self.reservation is not None:
            self.residency.captured(self)

    # -- host buffers ------------------------------------------------------------------

    def _take_stash(self) -> Stash:
        b = self.engine.backend
        for i, st in enumerate(self._host_pool):
            if st.free_after is None or b.query_event(st.free_after):
                return self._host_pool.pop(i)
        host = b.pinned_empty(self.host_bytes) if self.host_bytes else None
        kept = self.nbytes - self.host_bytes
        dev = None
        if kept:
            dev = torch.empty(kept, dtype=torch.uint8, device=b.device)
        self.engine.stats["host_buffers_allocated"] += 1
        return Stash(host, dev)

    def _give_stash(self, st: Stash, free_after: Any) -> None:
        st.free_after = free_after
        self._host_pool.append(st)

    def _slot_bytes_view(self) -> tuple[Any, Any]:
        """(offloaded part, kept part) of the slot as flat byte views (made at allocate)."""
        return self._bytes


def _dense_stride(s: SavedTensorSpec) -> tuple[int, ...] | None:
    """Slot views are dense: the original stride if it is dense, else contiguous."""
    # Dense means the strides are a permutation of some contiguous layout's.
    dims = sorted((st, n) for st, n in zip(s.stride, s.shape) if n != 1)
    expect = 1
    for st, n in dims:
        if st != expect:
            return None
        expect *= n
    return s.stride


# --------------------------------------------------------------------------- residency


class Residency:
    """Where the engine keeps a slot's pages between forward and backward: all that
    differs between the offload modes. The engine does the copies and keeps the tickets;
    a residency places slots, makes them writable for a forward and readable for a
    backward, and lets them go. Its methods run on the training thread."""

    #: the ticket transition of an offload in this residency
    offload_call: str
    #: whether the newest forward may stay in its slot until the engine's next call (its
    #: bytes are mapped anyway), so that a backward coming next needs no copy either way
    holds_newest = False
    #: the thread its driver calls run on, if it makes any in a step
    worker: DriverWorker | None = None

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine
        self.backend = engine.backend

    def place(self, g: OffloadGroup, bank_index: int) -> Reservation:
        """Outside capture: the VA ``g``'s slot lives at, mapped for the capture."""
        raise NotImplementedError

    def fences(self, g: OffloadGroup) -> SlotFences:
        """The fences of the bytes ``g``'s slot occupies."""
        raise NotImplementedError

    # -- the fences, the same in every residency ---------------------------------------

    def _where(self, g: OffloadGroup) -> str:
        return f"offload group {g.name}: its slot"

    @staticmethod
    def _whose(g: OffloadGroup, t: Ticket) -> str:
        return (f"microbatch {t.microbatch}" if t.group is g else
                f"{t.group.name} (microbatch {t.microbatch})")

    def _writable(self, g: OffloadGroup) -> SlotFences:
        """``g``'s fences, or a StateError if a restore its backward awaits is in them."""
        f = self.fences(g)
        if f.holder is not None:
            raise StateError(f"{self._where(g)} holds activations restored for "
                             f"{self._whose(g, f.holder)} whose backward has not run; a forward "
                             "cannot overwrite them")
        return f

    def _restorable(self, t: Ticket) -> SlotFences:
        """``t``'s slot fences, or a StateError if another restore holds them (the caller
        makes ``t`` their holder once its restore is under way)."""
        f = self.fences(t.group)
        if f.holder is not None and f.holder is not t:
            raise StateError(f"{self._where(t.group)} still holds the restore of "
                             f"{self._whose(t.group, f.holder)}")
        return f

    def fence_forward(self, f: SlotFences) -> None:
        """Fence 1: the slot's latest writer (its previous occupant's copy out) is done
        before a forward rewrites it."""
        if f.written is not None:
            b = self.backend
            b.wait_event(b.current_stream(), f.written)

    def fence_restore(self, f: SlotFences, stream: Any) -> None:
        """Fence 2: the backward graph that last read the slot, and its latest writer, are
        done before a restore copies into it. The latest writer is this activation's own
        copy out or a later forward's end, which waited for it (fence 1), so one wait also
        covers this activation's trip to the host."""
        b = self.backend
        if f.read is not None:
            b.wait_event(stream, f.read)
        if f.written is not None:
            b.wait_event(stream, f.written)

    def _freed(self, g: OffloadGroup, done: Any, backward: bool) -> None:
        f = self.fences(g)
        if backward:
            f.read, f.holder, f.fresh = done, None, None
        else:
            f.written = done  # an evaluation forward wrote the slot

    def captured(self, g: OffloadGroup) -> None:
        """``g``'s graphs are captured."""

    def prefetch_forward(self, g: OffloadGroup) -> None:
        """``g``'s forward comes soon: start making its slot writable (look-ahead)."""

    def before_forward(self, g: OffloadGroup) -> None:
        """Make the compute stream's next forward replay of ``g`` safe to write the slot."""
        raise NotImplementedError

    def after_offload(self, g: OffloadGroup, t: Ticket) -> None:
        """``t``'s copy out is queued (``t.d2h_done`` marks its end)."""
        raise NotImplementedError

    def restore(self, t: Ticket, copy_in: Callable[[Any], None]) -> None:
        """Start bringing ``t``'s activations back: ``copy_in(stream)`` queues the copy."""
        raise NotImplementedError

    def still_holds(self, t: Ticket) -> bool:
        """Whether ``t``'s slot still holds the bytes its forward wrote (nothing rewrote
        them since), so that its restore may leave them in place."""
        return False

    def keep_in_place(self, t: Ticket) -> None:
        """``t``'s backward may read its forward's bytes where they are (it was held, or
        :meth:`still_holds`): the slot is now its restore's."""
        self._restorable(t).holder = t

    def can_restore(self, t: Ticket) -> bool:
        """Whether ``t``'s restore could start now without waiting for another ticket."""
        held = self.fences(t.group).holder
        return held is None or held is t

    def restored(self, t: Ticket) -> None:
        """The host side of ``t``'s restore is done (remap: its mapping); raises if it failed."""

    def free(self, g: OffloadGroup, done: Any, backward: bool) -> None:
        """The slot's last user so far is queued before event ``done``: a backward graph
        that read it (``backward``) or an evaluation forward that wrote it."""
        raise NotImplementedError

    def abandon(self, g: OffloadGroup, t: Ticket, prev: State) -> None:
        """``t`` (last in state ``prev``) will never be consumed: let its slot go."""
        if self.fences(g).holder is t:  # its restore holds the slot
            self.engine._free_slot(g, backward=True)

    def nothing_in_flight(self) -> None:
        """The last ticket in flight was abandoned: whatever a pass prepared goes too."""

    def drain(self) -> None:
        """Wait for the driver work this residency queued; raise what failed unseen."""

    def close(self) -> None:
        """Release what this residency made (the engine has settled)."""


class KeptOnDevice(Residency):
    """Activations that never leave the device: they stay in the graph's own memory, where
    the backward graph reads them. That memory is shared by every graph of the engine's
    user, so before graphs replay for another microbatch, the activations of the
    microbatch that holds it (still waiting for their backwards) are moved to device
    buffers of their own (*parked*), and each is moved back right before its backward
    replays. One microbatch at a time, as in plain training, costs nothing: a pipeline
    schedule's several forwards in flight cost a device-to-device copy each way.
    Copies run on the current (compute) stream, in its order with the replays."""

    offload_call = "offload:kept"

    def __init__(self, engine: OffloadEngine) -> None:
        super().__init__(engine)
        self.holder: int | None = None  #: the microbatch whose activations the graphs' memory holds
        self.groups: list[OffloadGroup] = []  #: kept groups whose backward reads that memory

    def track(self, g: OffloadGroup) -> None:
        if g.views and g not in self.groups:
            self.groups.append(g)

    def place(self, g: OffloadGroup, bank_index: int) -> Reservation:
        raise StateError(f"offload group {g.name}: kept on the device, it has no slot")

    def can_restore(self, t: Ticket) -> bool:
        return True

    def claim(self, microbatch: int) -> None:
        """Graphs are about to replay for ``microbatch``: park what the previous holder keeps."""
        held = self.holder
        if held == microbatch:
            return
        if held is not None:
            pending = self.engine._pending
            for g in self.groups:
                t = pending.get((g.index, held))
                if t is not None and t.state is State.KEPT:
                    self._park(t)
        self.holder = microbatch  # only now: a park that failed is tried again next time

    @staticmethod
    def _packed(g: OffloadGroup, buf: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(view, its place in ``buf``) for each of ``g``'s kept views, packed end to end."""
        pos = 0
        for v in g.views:
            n = v.numel()
            yield v, buf[pos:pos + n]
            pos += n

    def _park(self, t: Ticket) -> None:
        nxt = _step(t._owner, t.state, "park")
        g, b = t.group, self.backend
        buf = torch.empty(g.kept_bytes, dtype=torch.uint8, device=b.device)
        s = b.current_stream()
        for v, place in self._packed(g, buf):
            b.copy_async(place, v, s)
        t.stash = Stash(None, buf)
        self.engine.stats["parked_bytes"] += g.kept_bytes
        t.state = nxt

    def before_forward(self, g: OffloadGroup) -> None:
        pass  # the engine claimed the graphs' memory for this forward's microbatch

    def restore(self, t: Ticket, copy_in: Callable[[Any], None]) -> None:
        pass  # they come back at the backward itself (restored)

    def restored(self, t: Ticket) -> None:
        st = t.stash
        if st is None:
            return  # never moved: still where the graph wrote them
        b = self.backend
        s = b.current_stream()
        for v, place in self._packed(t.group, st.device):
            b.copy_async(v, place, s)
        t.stash = None  # the buffer's uses are all on this stream: the allocator orders its reuse

    def free(self, g: OffloadGroup, done: Any, backward: bool) -> None:
        pass

    def abandon(self, g: OffloadGroup, t: Ticket, prev: State) -> None:
        t.stash = None

    def close(self) -> None:
        self.groups.clear()
        self.holder = None


class ResidentBanks(Residency):
    """Two mapped banks per slot size; groups of one size alternate between them in
    backward order, so a step makes no driver call. A bank's :class:`SlotFences` keep its
    bytes right: a forward rewrites it only after the previous occupant reached the host,
    and a restore only after the backward graph that last read it is done."""

    offload_call = "offload:resident"
    holds_newest = True

    def __init__(self, engine: OffloadEngine) -> None:
        super().__init__(engine)
        self.banks: dict[int, list[Bank]] = {}

    def place(self, g: OffloadGroup, bank_index: int) -> Reservation:
        pair = self.banks.get(g.slot_bytes)
        if pair is None:
            pair = []
            for i in range(2):
                res, alloc = self.backend.reserve_mapped(g.slot_bytes)
                pair.append(Bank(i, res, alloc))
            self.banks[g.slot_bytes] = pair
        g.bank = pair[bank_index % 2]
        return g.bank.reservation

    def _bank(self, g: OffloadGroup) -> Bank:
        assert g.bank is not None  # placed at allocate
        return g.bank

    def fences(self, g: OffloadGroup) -> SlotFences:
        return self._bank(g).fences

    def _where(self, g: OffloadGroup) -> str:
        return f"offload group {g.name}: bank {self._bank(g).index}"

    def before_forward(self, g: OffloadGroup) -> None:
        f = self._writable(g)
        self.fence_forward(f)
        f.fresh = None  # the replay rewrites the bank (after_forward names its ticket)

    def after_offload(self, g: OffloadGroup, t: Ticket) -> None:
        f = self.fences(g)
        # (queued before anything else may touch the bank: the engine lets a held ticket
        # go first thing in every call that could)
        f.written, f.fresh = t.d2h_done, t

    def still_holds(self, t: Ticket) -> bool:
        # Two banks alternate in backward order, so the newest forward of each bank (the
        # last two layers of a pass) is still there when its backward comes.
        return self.fences(t.group).fresh is t

    def restore(self, t: Ticket, copy_in: Callable[[Any], None]) -> None:
        f = self._restorable(t)
        s = self.engine.h2d_stream
        self.fence_restore(f, s)
        f.fresh = None
        copy_in(s)
        f.holder = t

    def free(self, g: OffloadGroup, done: Any, backward: bool) -> None:
        self._freed(g, done, backward)

    def close(self) -> None:
        b = self.backend
        for pair in self.banks.values():
            for bank in pair:
                b.unmap_release(bank.reservation, 0)
                b.free(bank.reservation)
        self.banks.clear()


@dataclass(eq=False)
class RemapUnit:
    """Remap slots of consecutive groups in one VA range, mapped and unmapped as one.

    A map, an access grant and an unmap cost about the same for 2 MiB as for 512 MiB, so
    slots much smaller than a unit's target size share one mapping: the driver calls per
    layer fall with the number of layers in a unit, and a unit is at most that target
    (or one slot) of device memory.
    """

    reservation: Reservation
    limit: int  #: bytes of slots it may take: the unit target, or its one larger slot
    members: list[OffloadGroup] = field(default_factory=list)
    used: int = 0  #: bytes placed (slots packed at the saved-tensor alignment)
    size: int = 0  #: bytes one mapping covers (granular)
    users: int = 0  #: forwards writing a member's slot and restores holding one
    mapped: Future[Any] | None = None  #: the current mapping's map job; None: unmapped
    fences: list[Any] = field(default_factory=list)  #: events the next unmap waits for
    unmapping: Future[Any] | None = None  #: the last unmap queued (its error surfaces at drain)
    captured: int = 0  #: members whose graphs are captured (build time)


class RemapSlots(Residency):
    """Slots backed only while a forward writes them or a backward reads them.

    Slots live in units (:class:`RemapUnit`): a unit is mapped when a forward or restore
    first needs one of its slots, stays mapped while the pass moves through its members,
    and is unmapped after the last of them (in that pass's direction) is done with it.
    Driver calls run on one serialised worker thread (:class:`DriverWorker`), never
    inside a capture or a host callback. Unmapped pages go to a free list that the next
    unit of that size maps again, so a step costs a map, an access grant and an unmap per
    unit and pass; backing is created only when the free list is empty, and everything is
    unmapped and released whenever nothing is in flight, so between steps remap holds no
    device memory.

    A mapping can outlive one member's use of it, so each slot is fenced as a bank is: a
    forward rewrites it only after its previous copy out, a restore only after the
    backward graph that last read it.
    """

    offload_call = "offload:remap"

    def __init__(self, engine: OffloadEngine, unit_bytes: int) -> None:
        super().__init__(engine)
        self.unit_bytes = unit_bytes
        self._worker = DriverWorker(self.backend)
        self.worker = self._worker
        self.units: list[RemapUnit] = []
        self._open: RemapUnit | None = None  # the unit new slots are packed into (build)
        self._current: RemapUnit | None = None  # the unit the latest pass went to
        self._lingering: set[RemapUnit] = set()  # mapped, unused, the pass may come back
        self._spare: dict[int, list[Allocation]] = {}  # unmapped pages by size (worker only)
        self._prefetched: set[int] = set()  # groups whose next forward's map is queued
        self._fences: dict[int, SlotFences] = {}  # group index -> its slot's fences

    @staticmethod
    def _unit(g: OffloadGroup) -> RemapUnit:
        assert g.unit is not None  # placed at allocate
        return g.unit

    def fences(self, g: OffloadGroup) -> SlotFences:
        f = self._fences.get(g.index)
        if f is None:
            f = self._fences[g.index] = SlotFences()
        return f

    # -- build ---------------------------------------------------------------------------

    def place(self, g: OffloadGroup, bank_index: int) -> Reservation:
        b, gran = self.backend, self.backend.granularity
        u = self._open
        off = 0 if u is None else align_up(u.used, _ALIGN)
        if u is None or off + g.nbytes > u.limit:
            limit = max(g.nbytes, self.unit_bytes)
            u = RemapUnit(b.reserve(align_up(limit, gran)), limit)
            self.units.append(u)
            self._open, off = u, 0
        end = align_up(off + g.nbytes, gran)
        if end > u.size:  # mapped for the capture; unmapped once every member is captured
            b.map_new(u.reservation, u.size, end - u.size)
            u.size = end
        u.used = off + g.nbytes
        u.members.append(g)
        g.unit, g.slot_offset = u, off
        return u.reservation

    def captured(self, g: OffloadGroup) -> None:
        u = self._unit(g)
        if self._open is u:
            self._open = None  # its mapping is going: nothing more is packed into it
        u.captured += 1
        if u.captured == len(u.members):
            # Between steps a remap unit holds no memory; a pass maps it when needed.
            self.backend.synchronize()
            for off in sorted(u.reservation.mappings):
                self.backend.unmap_release(u.reservation, off)

    # -- passes --------------------------------------------------------------------------

    def _queue_map(self, u: RemapUnit) -> Future[Any]:
        if u.mapped is None:
            res, size = u.reservation, u.size
            u.mapped = self._worker.submit(lambda: self._map(res, size))
            self.engine.stats["remaps"] += 1
        return u.mapped

    def _map_job(self, u: RemapUnit, step: int) -> Future[Any]:
        """``u``'s map job, queued unless ``u`` is mapped or queued; the pass is at ``u`` and
        goes on in direction ``step`` (+1 forward, -1 backward)."""
        job = self._queue_map(u)
        if u is not self._current:
            self._current = u
            self._unmap_lingering()  # the pass left them
            # Entering a unit of packed small slots: queue the next one's map now, so the
            # worker has done it (a map and an access grant, more than a small layer's
            # compute) by the time the pass gets there. At most one unit target more is
            # mapped; a unit of one large slot is never mapped ahead (its memory counts).
            i = self.units.index(u) + step
            if 0 <= i < len(self.units) and self.units[i].size <= self.unit_bytes:
                self._queue_map(self.units[i])
        return job

    def _hold(self, u: RemapUnit) -> None:
        u.users += 1
        self._lingering.discard(u)

    def _let_go(self, u: RemapUnit, fence: Any, last: bool) -> None:
        """One use of ``u`` ends before ``fence``; ``last``: no member after it in this pass."""
        u.users -= 1
        if fence is not None:
            u.fences.append(fence)
        if u.users == 0 and u.mapped is not None:
            soon = any(m.index in self._prefetched for m in u.members)  # a forward is coming
            if (last or u is not self._current) and not soon:
                self._unmap(u)
            else:
                self._lingering.add(u)

    def _unmap(self, u: RemapUnit) -> None:
        res, fences = u.reservation, u.fences
        u.mapped, u.fences = None, []
        self._lingering.discard(u)
        u.unmapping = self._worker.submit(lambda: self._unmap_after(res, fences))

    def _unmap_lingering(self) -> None:
        busy = {id(self.engine.groups[i].unit) for i in self._prefetched}
        for u in list(self._lingering):
            if u is not self._current and id(u) not in busy:
                self._unmap(u)

    def _failed(self, u: RemapUnit, job: Future[Any]) -> None:
        if u.mapped is job:
            u.mapped = None  # nothing is mapped: the next use queues a new map

    def prefetch_forward(self, g: OffloadGroup) -> None:
        self._map_job(self._unit(g), +1)
        self._prefetched.add(g.index)

    def before_forward(self, g: OffloadGroup) -> None:
        f = self._writable(g)
        u = self._unit(g)
        self._prefetched.discard(g.index)
        job = self._map_job(u, +1)
        try:
            job.result()
        except BaseException:
            self._failed(u, job)
            raise
        self._hold(u)
        self.fence_forward(f)  # the unit may have stayed mapped since this slot's last copy out

    def after_offload(self, g: OffloadGroup, t: Ticket) -> None:
        u = self._unit(g)
        self.fences(g).written = t.d2h_done
        self._let_go(u, t.d2h_done, last=g is u.members[-1])

    def restore(self, t: Ticket, copy_in: Callable[[Any], None]) -> None:
        g = t.group
        held = self._restorable(t)
        u = self._unit(g)
        mapped = self._map_job(u, -1)
        self._hold(u)
        held.holder = t
        eng = self.engine
        # The fences as they are now: the copy may run later, on the worker.
        f = dataclasses.replace(held)

        def copy() -> None:
            s = eng.h2d_stream
            self.fence_restore(f, s)
            copy_in(s)

        if mapped.done() and mapped.exception() is None:
            copy()  # the unit is mapped (an earlier member's restore): no worker round trip
            return

        def job() -> None:
            mapped.result()  # queued before this job, so done; raises if the map failed
            copy()

        t.restore_job, t.map_job = self._worker.submit(job), mapped

    def restored(self, t: Ticket) -> None:
        if t.restore_job is None:
            return
        job, mapped, t.restore_job, t.map_job = t.restore_job, t.map_job, None, None
        try:
            job.result()
        except BaseException:
            g = t.group
            u = self._unit(g)
            if mapped is not None and mapped.exception() is not None:
                self._failed(u, mapped)  # nothing is mapped; a copy that failed leaves it mapped
            # the hold ends; a copy in that failed part way (its end is the slot's latest
            # writer, _copy_in saw to that) may still write the slot
            self.fences(g).holder = None
            self._let_go(u, t.restore_done, last=False)
            raise

    def free(self, g: OffloadGroup, done: Any, backward: bool) -> None:
        u = self._unit(g)
        self._freed(g, done, backward)
        self._let_go(u, done, last=g is (u.members[0] if backward else u.members[-1]))
        self.release_spare_when_idle()

    def abandon(self, g: OffloadGroup, t: Ticket, prev: State) -> None:
        if self.fences(g).holder is t:  # its restore holds the unit
            self.engine._free_slot(g, backward=True)
        else:
            self.release_spare_when_idle()

    def nothing_in_flight(self) -> None:
        # The last ticket was abandoned (a dropped or interrupted pass): a map queued for
        # the next layer of that pass has no forward to wait for.
        self._prefetched.clear()
        self.release_spare_when_idle()

    def release_spare_when_idle(self) -> None:
        """Nothing in flight and no forward's map queued (an evaluation forward's next
        layer would take the pages straight back): unmap every unit nobody holds and give
        the free list back, queued after every unmap, so it runs once they are done."""
        if not self.engine._pending and not self._prefetched:
            for u in self.units:
                if u.mapped is not None and u.users == 0:
                    self._unmap(u)
            self._current = None
            self._worker.submit(self._release_spare)

    def drain(self) -> None:
        """Wait for queued driver work; raises the first unmap that failed since the last
        drain (nobody else waits for an unmap, so its error would go unseen)."""
        self._worker.drain()
        for u in self.units:
            job, u.unmapping = u.unmapping, None
            if job is not None and job.exception() is not None:
                raise job.exception()  # type: ignore[misc]

    def close(self) -> None:
        self._worker.close()
        self._release_spare()  # the worker is gone: nobody else touches the free list
        b = self.backend
        for u in self.units:
            for off in sorted(u.reservation.mappings):
                b.unmap_release(u.reservation, off)
            b.free(u.reservation)
        self.units.clear()
        self._lingering.clear()

    # -- on the worker thread ------------------------------------------------------------

    def _map(self, res: Reservation, size: int) -> None:
        spare = self._spare.get(size)
        if not spare:
            self.backend.map_new(res, 0, size)
            return
        alloc = spare.pop()
        try:
            self.backend.map(res, 0, alloc)
        except BaseException:
            spare.append(alloc)
            raise
        try:
            self.backend.set_access(res, 0, size)
        except BaseException:
            self.backend.unmap(res, 0, size)
            spare.append(alloc)
            raise

    def _unmap_after(self, res: Reservation, events: list[Any]) -> None:
        for ev in events:  # an event wait before unmapping what a kernel may touch
            self._worker.wait_event(ev)
        m = res.mapping_at(0)
        if m is None:
            raise StateError(f"offload engine: nothing is mapped at the slot 0x{res.va:x} to unmap")
        self.backend.unmap(res, 0, m.size)
        self._spare.setdefault(m.size, []).append(m.allocation)

    def _release_spare(self) -> None:
        for spare in self._spare.values():
            while spare:
                self.backend.release(spare.pop())


# --------------------------------------------------------------------------- engine


class OffloadEngine:
    """Schedules offload and restore of many groups on one backend.

    Args:
        backend: the device backend.
        mode: :class:`Mode` (``"resident"`` or ``"remap"``; ``"off"`` keeps every
            group's activations on the device, in the graphs' own memory).
        min_bytes: saved tensors smaller than this stay on the device (in a device stash).
        remap_unit_bytes: remap mode packs the slots of consecutive groups into one
            mapping of up to this many bytes, so small layers share their driver calls
            (0: a mapping per slot). At most this much more device memory is mapped at
            once than with a mapping per slot.
        debug_checksums: record a checksum of every offloaded activation and verify it
            after restore (slow: host synchronisations; for tests and debugging).

    Raises:
        UsageError: an unknown mode, a negative ``min_bytes`` or ``remap_unit_bytes``.
    """

    def __init__(self, backend: Backend, mode: Mode | str = Mode.RESIDENT, *, min_bytes: int = 0,
                 remap_unit_bytes: int = REMAP_UNIT_BYTES, debug_checksums: bool = False) -> None:
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise UsageError(f"unknown offload mode {mode!r}; choose off, resident or remap") from None
        if min_bytes < 0:
            raise UsageError(f"min_bytes must be >= 0, got {min_bytes}")
        if isinstance(remap_unit_bytes, bool) or not isinstance(remap_unit_bytes, int) or remap_unit_bytes < 0:
            raise UsageError(f"remap_unit_bytes must be an integer >= 0, got {remap_unit_bytes!r}")
        self.backend = backend
        self.min_bytes = min_bytes
        self.debug_checksums = debug_checksums
        self.groups: list[OffloadGroup] = []
        self.d2h_stream = backend.new_stream()
        self.h2d_stream = backend.new_stream()
        self._pending: dict[tuple[int, int], Ticket] = {}  # (group index, microbatch) -> ticket
        self._held: Ticket | None = None  # the newest forward, whose copy out is not queued yet
        #: where the activations of groups that do not offload wait (every group in mode off)
        self.kept = KeptOnDevice(self)
        #: where offloaded groups' slots live between forward and backward (mode off: ``kept``)
        self.residency: Residency = (ResidentBanks(self) if self.mode is Mode.RESIDENT else
                                     RemapSlots(self, remap_unit_bytes) if self.mode is Mode.REMAP
                                     else self.kept)
        self.stats: Counter[str] = Counter()
        #: a :class:`graphslot.trace.Timeline` to record copy spans on, or None
        self.timeline: Any = None
        self.closed = False

    @property
    def worker(self) -> DriverWorker | None:
        """The driver worker thread (remap mode), or None."""
        return self.residency.worker

    @property
    def offloads(self) -> bool:
        """Whether this engine's groups may move activations off the device (not mode off)."""
        return self.residency is not self.kept

    def group(self, name: str, offload: bool = True) -> OffloadGroup:
        """A new group; ``offload=False`` (or mode off): its activations stay on the device
        (see :meth:`OffloadGroup.keep`)."""
        g = OffloadGroup(self, name, offload and self.offloads)
        self.groups.append(g)
        return g

    @property
    def resident_device_bytes(self) -> int:
        """Device bytes graphslot holds for activations right now (banks, slots, stashes)."""
        n = self.backend.ledger.mapped_bytes
        for t in self._pending.values():
            if t.stash is not None and t.stash.device is not None:
                n += t.stash.device.numel()
        return n

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes this engine holds (buffers in flight and reusable ones)."""
        stashes = [st for g in self.groups for st in g._host_pool]
        stashes += [t.stash for t in self._pending.values() if t.stash is not None]
        return sum(st.host.numel() for st in stashes if st.host is not None)

    # -- forward -------------------------------------------------------------------------

    def prefetch_forward(self, g: OffloadGroup) -> None:
        """Start making ``g``'s slot writable for its next forward (remap: map it)."""
        self._let_held_go()
        g.residency.prefetch_forward(g)

    def before_forward(self, g: OffloadGroup, microbatch: int) -> Ticket:
        """Make ``g``'s slot writable for a forward replay; returns that forward's ticket."""
        self._check_open("forward")
        self._let_held_go()  # the replay may write its bank or take its pages' place
        if g.state is not State.READY:
            g._go("offload:forward")  # refused, naming the state
        key = (g.index, microbatch)
        if key in self._pending:
            raise StateError(f"offload group {g.name}: microbatch {microbatch} ran forward again "
                             "before its backward")
        t = Ticket(g, microbatch)
        self.kept.claim(microbatch)  # the replay may overwrite what another microbatch keeps
        g.residency.before_forward(g)
        self._pending[key] = t
        return t

    def after_forward(self, t: Ticket) -> None:
        """After the forward replay: queue the slot's copy out; the slot goes after it.

        Resident banks hold the newest forward instead: its copy out is queued by the next
        forward, a restore of another ticket, :meth:`settle` or :meth:`close`, and not at all
        when its own restore comes first (its bank is mapped anyway). Remap queues it at
        once: holding would keep a unit mapped between the passes, where remap holds none.
        """
        g, slots = t.group, t.group.residency
        if slots is self.kept:
            t._go(slots.offload_call)  # nothing leaves the device
            return
        self._let_held_go()
        nxt = _step(t._owner, t.state, "offload:held")  # refused before anything is recorded
        b = self.backend
        t.fwd_done = b.record_event(b.new_event())
        t.state = nxt
        self._held = t
        if not slots.holds_newest:
            self._let_held_go()

    def _let_held_go(self) -> None:
        """Queue the held ticket's copy out (if one is held): something else comes first."""
        t = self._held
        if t is None:
            return
        g, slots = t.group, t.group.residency
        nxt = _step(t._owner, t.state, slots.offload_call)
        b = self.backend
        if t.stash is None:  # (a copy out that failed before took it already)
            t.stash = g._take_stash()
        src_host, src_dev = g._slot_bytes_view()
        s = self.d2h_stream
        b.wait_event(s, t.fwd_done)  # the copy stream waits only on the forward
        try:
            with self._span("d2h", f"{g.name} mb{t.microbatch}", s, g.host_bytes):
                if src_host is not None:
                    b.copy_async(t.stash.host, src_host, s)
                if src_dev is not None:
                    b.copy_async(t.stash.device, src_dev, s)
        except BaseException:
            # Part of the copy may be queued and still read the slot: whatever the compute
            # stream does next (a forward into the slot, the event that lets it go or
            # unmaps it) comes after it, and so does the stash's next user.
            t.d2h_done = b.record_event(b.new_event(), s)
            b.wait_event(b.current_stream(), t.d2h_done)
            raise
        t.d2h_done = b.record_event(b.new_event(), s)
        self.stats["offloaded_bytes"] += g.host_bytes
        self.stats["kept_bytes"] += g.nbytes - g.host_bytes
        if self.debug_checksums:
            t.checksums = self._checksums(g)
        slots.after_offload(g, t)
        # Only now: should anything above fail, the ticket is still held (the next call
        # tries again), and abandoning it lets the slot go, its stash with it.
        t.state = nxt
        self._held = None

    # -- backward ------------------------------------------------------------------------

    def find(self, g: OffloadGroup, microbatch: int) -> Ticket | None:
        """The ticket of ``g``'s forward for ``microbatch`` if it is still in flight."""
        return self._pending.get((g.index, microbatch))

    def ticket(self, g: OffloadGroup, microbatch: int) -> Ticket:
        self._check_open("backward")
        t = self._pending.get((g.index, microbatch))
        if t is None:
            raise StateError(f"offload group {g.name}: backward for microbatch {microbatch} "
                             "before its forward (nothing was offloaded for it)")
        return t

    def restore(self, t: Ticket) -> None:
        """Start bringing ``t``'s activations back into the slot (may run ahead: look-ahead)."""
        self._check_open("restore")
        if t.state is State.RESTORING or t.state is State.RESTORED:
            return
        held = t.state is State.HELD
        if held or t.group.residency.still_holds(t):
            # Its backward came before anything rewrote its slot: nothing to copy in (and,
            # when it was held, nothing was copied out either).
            nxt = _step(t._owner, t.state, "restore")
            if held and self._held is not t:  # never: a held ticket is the engine's newest
                raise StateError(f"{t._owner()}: held, but not the engine's newest forward")
            t.group.residency.keep_in_place(t)
            if held:
                self._held = None
            # The backward waits for the forward that wrote the slot (the same stream in
            # both adapters, but nothing here relies on that).
            t.restore_done, t.in_place = t.fwd_done, True
            t.state = nxt
            self.stats["held_bytes" if held else "kept_in_place_bytes"] += t.group.host_bytes
            return
        self._let_held_go()  # its copy may go into the held ticket's bank or pages
        nxt = _step(t._owner, t.state, "restore")  # refused here before anything is queued
        t.group.residency.restore(t, lambda s: self._copy_in(t, s))
        t.state = nxt

    def restore_ahead(self, t: Ticket) -> bool:
        """Look-ahead: start ``t``'s restore now if it is waiting on the host and its slot
        can take it (a resident bank may still hold another ticket's restore, e.g. under a
        pipeline schedule). Returns whether the restore is under way."""
        if t.state is State.RESTORING or t.state is State.RESTORED:
            return True
        if t.state not in (State.HELD, State.RELEASED, State.RESIDENT_PENDING):
            return False
        if not t.group.residency.can_restore(t):
            return False
        self.restore(t)
        return True

    def _copy_in(self, t: Ticket, s: Any) -> None:
        b, g, st = self.backend, t.group, t.stash
        assert st is not None
        dst_host, dst_dev = g._slot_bytes_view()
        try:
            with self._span("h2d", f"{g.name} mb{t.microbatch}", s, g.host_bytes):
                if dst_host is not None:
                    b.copy_async(dst_host, st.host, s)
                if dst_dev is not None:
                    b.copy_async(dst_dev, st.device, s)
        except BaseException:
            # Part of the copy may be queued: the slot's next writer and the host buffer's
            # next user go after it (on whichever thread the copy was queued from).
            t.restore_done = b.record_event(b.new_event(), s)
            g.residency.fences(g).written = t.restore_done
            raise
        t.restore_done = b.record_event(b.new_event(), s)
        self.stats["restored_bytes"] += g.host_bytes

    def wait_restored(self, t: Ticket) -> None:
        """Make the compute stream wait for ``t``'s restore (the host does not block on the copy).

        In remap mode a failed mapping surfaces here; the host copy is kept and
        :meth:`restore` may be called again.
        """
        g = t.group
        if t.state is not State.RESTORING and g.offloads:
            self.restore(t)  # (kept activations have nothing to restore ahead of this)
        self.kept.claim(t.microbatch)  # the backward replay may overwrite what another keeps
        try:
            g.residency.restored(t)
        except BaseException:
            if t.state is State.RESTORING:
                t._go("restore_failed")  # nothing lost: the stash still holds the bytes
            raise
        t._go("wait_restored")
        if t.restore_done is None:
            return  # nothing was copied in for it (kept on the device, or nothing saved)
        b = self.backend
        b.wait_event(b.current_stream(), t.restore_done)
        if self.debug_checksums and t.checksums:  # (none: never copied out, or its copy out failed)
            got = self._checksums(g)
            if got != t.checksums:
                bad = [i for i, (x, y) in enumerate(zip(got, t.checksums)) if x != y]
                raise CaptureMismatchError(f"offload group {g.name}: restored activations "
                                           f"{bad} of microbatch {t.microbatch} differ from "
                                           "what was offloaded")

    def _retire(self, t: Ticket, call: str) -> OffloadGroup:
        """``t`` ends by ``call``: it leaves the tickets in flight; returns its group."""
        t._go(call)
        g = t.group
        del self._pending[(g.index, t.microbatch)]
        return g

    def consumed(self, t: Ticket) -> None:
        """After the backward replay read the slot: free the bank/slot and the stash."""
        g = self._retire(t, "consumed")
        if not g.offloads:
            return
        if t.stash is not None:  # None: it was held until its backward, never copied out
            # (restored in place: the copy out was the host buffer's last use)
            g._give_stash(t.stash, t.d2h_done if t.in_place else t.restore_done)
            t.stash = None
        self._free_slot(g, backward=True)

    def forget(self, t: Ticket) -> None:
        """A forward replay that no backward will follow (evaluation): drop its ticket.

        The slot is free again once the forward is done (remap: released after it).
        """
        g = self._retire(t, "forget")
        if g.offloads:
            if t.stash is not None:  # an after_forward that failed part way: a copy may be queued
                b = self.backend
                g._give_stash(t.stash, b.record_event(b.new_event(), self.d2h_stream))
                t.stash = None
            self._free_slot(g, backward=False)

    def _free_slot(self, g: OffloadGroup, backward: bool) -> None:
        """The slot's last user so far is queued: the residency lets it go after that."""
        b = self.backend
        g.residency.free(g, b.record_event(b.new_event()), backward)

    # -- inspection ----------------------------------------------------------------------

    def _span(self, track: str, name: str, stream: Any, nbytes: int) -> Any:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(track, name, stream, nbytes)

    def _checksums(self, g: OffloadGroup) -> list[int]:
        self.backend.synchronize()
        return [int(v.contiguous().view(torch.uint8).to(torch.int64).sum()) for v in g.views]

    def in_flight(self) -> list[Ticket]:
        return list(self._pending.values())

    def settle(self) -> None:
        """Wait for queued driver work (remap) and copies; for tests and teardown.

        Raises:
            DriverError: an unmap on the driver worker failed since the last settle.
        """
        try:
            if not self.closed:
                self._let_held_go()
                self.residency.drain()
        finally:
            self.backend.synchronize()

    def abandon(self, t: Ticket) -> None:
        """``t``'s backward will never run: give back its host buffer and slot, in any state.

        Copies already queued finish first (their events order the reuse), so nothing is
        freed under a copy or a replay.
        """
        try:
            self._abandon(t)
        finally:
            if not self._pending and not self.closed:
                self.residency.nothing_in_flight()

    def _abandon(self, t: Ticket) -> None:
        if t.state is State.READY:  # a forward and nothing after it: exactly a forget
            self.forget(t)
            return
        if t.state is State.HELD:  # still in its slot, nothing queued for it (or a copy out that failed)
            if self._held is t:
                self._held = None
            g = self._retire(t, "abandon")
            if t.stash is not None:
                b = self.backend
                g._give_stash(t.stash, b.record_event(b.new_event(), self.d2h_stream))
                t.stash = None
            self._free_slot(g, backward=False)  # as after a forward that no backward follows
            return
        prev = t.state
        g = self._retire(t, "abandon")
        slots = g.residency
        if slots is self.kept:
            slots.abandon(g, t, prev)
            return
        try:
            slots.restored(t)
        except BaseException:  # the mapping failed: nothing was mapped for it
            prev = State.RELEASED
        if t.restore_done is not None:  # (also a copy in that failed part way)
            # The copy into the slot may still run: what lets the slot go comes after it.
            b = self.backend
            b.wait_event(b.current_stream(), t.restore_done)
        if t.stash is not None:
            g._give_stash(t.stash, t.d2h_done if t.in_place else t.restore_done or t.d2h_done)
            t.stash = None
        slots.abandon(g, t, prev)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise StateError(f"offload engine: {what} after close(); the slots and buffers are "
                             "gone, build a new engine (or GraphedLayers)")

    def close(self) -> None:
        """Release every slot, bank and buffer this engine made (after :meth:`settle`).

        Safe to call again; any use afterwards is a StateError naming close().
        """
        if self.closed:
            return
        try:
            self.settle()
        except Exception as e:  # a failed unmap: close() still releases what the ledger holds
            failed: Exception | None = e
        else:
            failed = None
        self.closed = True
        self.residency.close()
        self.kept.close()
        for g in self.groups:
            g.reservation = None
            g.views = []
            g._bytes = (None, None)
            g._host_pool.clear()
        self._pending.clear()
        # Streams may own threads (the cpu backend's do): let them go with their last user.
        self.d2h_stream = self.h2d_stream = None
        if failed is not None:
            raise failed
