"""Graph-safe activation offload through fixed-VA slots.

One :class:`OffloadGroup` holds the saved activations of one graphed unit (a layer).
Its life, and the life of each forward pass through it (a *ticket*), follow one state
enum, :class:`State`, and one transition table, :data:`TRANSITIONS`::

    group:   DISCOVERING --allocate--> ALLOCATED --begin_capture--> CAPTURING --finish_capture--> READY
    ticket:  READY --offload--> HELD --offload--> RELEASED (remap) | RESIDENT_PENDING (resident)
             (the newest forward stays HELD until the engine is next asked for more)
             --restore--> RESTORING --wait_restored--> RESTORED --consumed--> DONE
             HELD --restore--> RESTORING (its own backward came next: nothing is copied)
             READY --offload--> KEPT (kept on the device) [--park--> PARKED] --wait_restored--> RESTORED
             READY --forget--> DONE (a forward that no backward follows)

* Discovery: an eager warm-up records each saved tensor's shape, stride, dtype and device.
* Allocation (outside capture): the slot's place in a *bank* (a fixed-VA region shared by
  the groups of its size class, one forward at a time), and reusable host buffers.
* Capture: each saved tensor is copied device to device into its place in the slot; the
  backward graph records the slot's address. Count, order, shape, stride, dtype, device and
  ``data_ptr() == slot VA`` are checked.
* Sections: a bank's bytes move to and from the host in sections of about
  :data:`SECTION_BYTES`, each with events of its own. Where the backend's graphs hold
  events (``Backend.graph_events``), the forward graph itself waits, before it writes a
  section, for the copy that took the previous occupant's bytes of that section out, and
  records when it has written a section; the backward graph waits, before it reads a
  section, for that section's copy back, and records when it is done with one (at the
  next autograd node). So a copy out starts while the forward still runs, the next
  layer's forward starts while the copy out still runs, and a layer's restore fills its
  bank section by section as the backward before it lets go of them: one bank per size
  class is as fast as two. Elsewhere the same section copies are fenced from the host.
* Forward offload: after the forward replay, a copy stream copies the slot to a host
  buffer section by section. No host synchronisation. The newest forward is *held*: its
  copy is queued by the next forward, a restore of another ticket, ``settle`` or ``close``;
  when its own backward comes first (the last layer of a pass), the activations never
  leave the bank and neither copy runs.
* Resident banks (two per size class, mapped for good) make no driver call in a step.
  Remap banks (one per size class where sections stream, else two) are mapped while
  anything is in flight and unmapped and released once nothing is, on a driver worker
  thread, after the device is done with them.
* Backward restore: a host to device copy into the bank at the same VA, section by
  section in the order the backward graph reads them.

Where a group's activations are between forward and backward is a :class:`Residency`:
:class:`ResidentBanks`, :class:`RemapBanks`, or, for groups that do not offload (mode
off, or layers left on the device), :class:`KeptOnDevice` (in the graph's own memory,
moved to a device buffer of their own while another microbatch's graphs run). The engine
does the copies and keeps the tickets; the residency is all that differs between the
modes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import functools
import queue
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .backend import Backend, Reservation, align_up
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
    "SECTION_BYTES",
    "sections_of",
]

_ALIGN = 256  # byte alignment of each saved tensor inside a slot
#: a bank's bytes move to and from the host in sections of about this many bytes, each
#: with events of its own (see the module docstring). A copy's cost is its bytes past a
#: few MiB; below that the calls and events per section start to count.
SECTION_BYTES = 32 << 20


def sections_of(size: int, section_bytes: int = SECTION_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges cutting ``size`` bytes into about equal sections of
    about ``section_bytes`` (as many as ``section_bytes`` asks for, each start 256-byte
    aligned, so a section may be up to 255 bytes longer; the last may be shorter)."""
    n = max(1, -(-size // max(section_bytes, _ALIGN)))
    step = align_up(-(-size // n), _ALIGN)
    return [(a, min(a + step, size)) for a in range(0, size, step)]


class Mode(str, enum.Enum):
    """Where saved activations live between forward and backward."""

    OFF = "off"  #: no offload: saved tensors stay in the graph's own memory
    RESIDENT = "resident"  #: offload to host; two banks per size class, mapped for good
    REMAP = "remap"  #: offload to host; banks mapped only while anything is in flight


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


#: seconds the interpreter's exit waits for the driver workers' queued jobs before dropping the rest
EXIT_WAIT_S = 10.0


class DriverWorker:
    """One thread that runs VMM driver work in submission order.

    Driver calls must not run inside a host callback or a capture, and should not stall
    the training thread; queueing them here keeps all of them on one serialised thread.
    At interpreter exit the thread runs what is queued and ends
    (:meth:`finish_at_exit`); a job submitted after that runs on the caller's thread.
    """

    _live: weakref.WeakSet[DriverWorker] = weakref.WeakSet()  # a running thread keeps its worker
    _exited = False  #: set once finish_at_exit ran

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="graphslot-driver", daemon=True)
        self._thread.start()
        DriverWorker._live.add(self)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            self._do(fn, fut)

    @staticmethod
    def _do(fn: Callable[[], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        if self._closed and not DriverWorker._exited:
            raise StateError("the driver worker was closed (its engine's close() ran); "
                             "build a new engine")
        fut: Future[Any] = Future()
        if DriverWorker._exited:  # the thread is gone: the interpreter is finishing
            self._do(fn, fut)
        else:
            self._q.put((fn, fut))
        return fut

    def wait_event(self, event: Any) -> None:
        """Block this worker (not the training thread) until ``event`` completes."""
        self._backend.synchronize_event(event, count_as="worker_sync")

    def drain(self) -> None:
        self.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=10)

    @classmethod
    def finish_at_exit(cls, timeout: float = EXIT_WAIT_S) -> bool:
        """Run the jobs every worker has queued and end the threads (registered with
        :mod:`atexit`): a daemon thread still inside a driver or framework call when the
        interpreter finalizes can abort the process. Jobs not started within ``timeout``
        seconds are cancelled (their futures say so); memory they would have released
        goes back with the process.

        Args:
            timeout: seconds to wait for the queued jobs in all.

        Returns:
            True when every worker's thread ended.
        """
        workers = [w for w in list(cls._live) if w._thread.is_alive()]
        for w in workers:
            w._closed = True
            w._q.put(None)  # after the jobs already queued
        deadline = time.monotonic() + timeout
        for w in workers:
            w._thread.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w._thread.is_alive():  # stuck in a job: cancel the rest of its queue
                while True:
                    try:
                        item = w._q.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[1].cancel()
                w._q.put(None)
        cls._exited = True
        return not any(w._thread.is_alive() for w in workers)


atexit.register(DriverWorker.finish_at_exit)


# --------------------------------------------------------------------------- slots and stashes


@dataclass(eq=False)
class SlotFences:
    """What orders the uses of one bank's bytes besides its section events (see
    :class:`Bank`): forwards wait for ``written``; a restore waits for ``written`` and for
    the last backward graph that read the bank (``read``, or section by section
    ``read_sections``); neither overwrites ``holder``. (A restore abandoned before its
    backward counts as that backward: the compute stream waited for its copy.)"""

    #: a writer the next forwards and restores wait for (None: none yet), other than a copy
    #: out: an evaluation forward, or a copy in that failed part way
    written: Any = None
    read: Any = None  #: the end of the last backward graph that read the bank
    #: per bank section, when that backward graph was done with it (an event recorded in the
    #: graph, at the autograd node after its last reader), or None: ``read``
    read_sections: list[Any] | None = None
    holder: Ticket | None = None  #: a restore whose backward has not run yet
    #: the forward whose activations these bytes still are: nothing rewrote them since
    #: (its restore then needs no copy)
    fresh: Ticket | None = None


@dataclass(eq=False)
class Bank:
    """A fixed-VA region that backs the slot of each group placed in it, one forward at a
    time (groups of one size class share it; the slots start at its first byte).

    Its bytes move in :attr:`sections`, and per section it keeps the events graphs wait on
    (recorded by the copy streams): ``copied_out[k]``, the latest copy of section ``k`` to
    the host ended (a forward rewrites the section only after it), and ``copied_in[k]``,
    the latest copy back into it ended (a backward reads it only after it).
    """

    index: int
    size: int
    reservation: Reservation
    sections: list[tuple[int, int]]
    copied_out: list[Any]
    copied_in: list[Any]
    fences: SlotFences = field(default_factory=SlotFences)
    members: list[OffloadGroup] = field(default_factory=list)
    captured: int = 0  #: members whose graphs are captured
    # Remap: the pages' state ("mapped", "releasing" or "unmapped", under the residency's
    # lock), the map job under way, and the token of a release queued but not started.
    pages: str = "mapped"
    map_job: Future[Any] | None = None
    pending_release: object | None = None
    #: releases queued since the last drain (a failed one surfaces there)
    release_jobs: list[Future[Any]] = field(default_factory=list)


@dataclass(eq=False)
class Stash:
    """Where one forward pass's activations wait for backward: host and device parts."""

    host: Any  # pinned host bytes for offloaded tensors (or None)
    device: Any  # device bytes for tensors kept on the device (or None)
    free_after: Any = None  # event after which the buffers may be reused
    #: per section of its group's slot, (slot view, stash view) byte pairs (made at first use)
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None


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
    checksums: list[int] = field(default_factory=list)
    #: restored by leaving its forward's bytes where they were (no copy in); its host
    #: buffer, if it has one, was last touched by its copy out
    in_place: bool = False

    def _go(self, call: str) -> None:
        self.state = _step(self._owner, self.state, call)

    def _owner(self) -> str:
        return f"{self.group.name} (microbatch {self.microbatch})"


@dataclass(eq=False)
class _BackwardCapture:
    """What a group learns while its backward graph is captured (see :meth:`OffloadGroup.load_tensor`)."""

    left: list[set[int]]  #: per section, the saved tensors in it not unpacked yet
    task: Any = None  #: the backward's own graph task (its first unpack's)
    node: Any = None  #: the node of that task that unpacked last
    waited: set[int] = field(default_factory=set)  #: sections the graph waits for already
    finished: list[int] = field(default_factory=list)  #: read in full by the nodes so far
    unpacks: int = 0  #: unpacks under capture with graph events
    plain: int = 0  #: unpacks that could not add a wait to the graph
    records: int = 0  #: done events recorded so far


def _current_node() -> tuple[Any, Any]:
    """The autograd node running on this thread and its graph task's id (None where torch
    cannot say)."""
    node = getattr(torch._C, "_current_autograd_node", None)
    task = getattr(torch._C, "_current_graph_task_id", None)
    if node is None or task is None:
        return None, None
    return node(), task()


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
        self.reservation: Reservation | None = None  # its bank's VA
        self.slot_offset = 0  # where the slot starts in that reservation
        self.bank: Bank | None = None
        self.views: list[torch.Tensor] = []
        #: its slot's bytes in each section of its bank (a prefix of the bank's sections)
        self.sections: list[tuple[int, int]] = []
        #: the order its restore copies the sections in: as its backward graph reads them
        self.restore_order: list[int] = []
        #: whether its forward graph itself waits for each section's copy out and records
        #: when it wrote one (else the host fences the whole slot)
        self.fwd_in_graph = False
        #: whether its backward graph itself waits for each section's copy in
        self.bwd_in_graph = False
        #: per section, the event its backward graph records once done with it (None: at the
        #: graph's end, which the engine records after the replay)
        self.done_events: list[Any] = []
        self._written: list[Any] = []  # per section: recorded by its forward graph once written
        self._done_pool: list[Any] = []
        self._spec_sections: list[range] = []
        self._first_write: dict[int, list[int]] = {}  # saved tensor -> sections it writes first
        self._last_write: dict[int, list[int]] = {}  # saved tensor -> sections it completes
        self._view_index: dict[int, int] = {}  # id(slot view) -> saved tensor index
        self._fwd_plain = False  # a save under capture that could not add a wait to the graph
        self._bwd: _BackwardCapture | None = None
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
        self._plan_sections()

    def _plan_sections(self) -> None:
        """Which bank sections the slot covers, which saved tensor writes each first and
        last, and the events its graphs record (made now: never under capture)."""
        bank, b = self.bank, self.engine.backend
        assert bank is not None  # placed
        self.sections = [(a, min(e, self.nbytes)) for a, e in bank.sections if a < self.nbytes]
        step = bank.sections[0][1] - bank.sections[0][0]
        n = len(self.sections)
        self._spec_sections, self._first_write, self._last_write = [], {}, {}
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, sp in enumerate(self.specs):
            end = sp.offset + max(1, sp.nbytes if sp.storage < 0 else sp.extent)
            secs = range(sp.offset // step, min(n, (end - 1) // step + 1))
            self._spec_sections.append(secs)
            for k in secs:
                first.setdefault(k, i)
                last[k] = i
        for k, i in first.items():
            self._first_write.setdefault(i, []).append(k)
        for k, i in last.items():
            self._last_write.setdefault(i, []).append(k)
        self._view_index = {id(v): i for i, v in enumerate(self.views)}
        if b.graph_events:
            self._written = [b.new_graph_event() for _ in range(n)]
            self._done_pool = [b.new_graph_event() for _ in range(n)]
        self.done_events = [None] * n
        self.restore_order = list(reversed(range(n)))  # reverse of the saves: until a backward says

    def stash_pieces(self, st: Stash) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per section of the slot, the (slot bytes, stash bytes) views its copies move: the
        offloaded part goes to the pinned host buffer, the kept part to the device one."""
        if st.pieces is None:
            hb = self.host_bytes
            slot_h, slot_d = self._bytes
            pieces = []
            for a, e in self.sections:
                part = []
                if a < hb:
                    part.append((slot_h[a:min(e, hb)], st.host[a:min(e, hb)]))
                if e > hb:
                    lo = max(a, hb) - hb
                    part.append((slot_d[lo:e - hb], st.device[lo:e - hb]))
                pieces.append(part)
            st.pieces = pieces
        return st.pieces

    # -- capture ---------------------------------------------------------------------

    def begin_capture(self) -> None:
        self._go("begin_capture")
        self._captured = 0
        self._fwd_plain = False
        self._bwd = None
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
        b = self.engine.backend
        in_graph = bool(self._written) and b.is_capturing()
        if in_graph:
            bank = self.bank
            assert bank is not None
            for k in self._first_write.get(i, ()):
                # The graph writes this section only once the copy that took its previous
                # occupant's bytes to the host is done, and the latest copy into it (a
                # restore whose backward never read this section waited for nothing
                # there); both were queued before the launch.
                b.graph_wait(bank.copied_out[k])
                b.graph_wait(bank.copied_in[k])
        else:
            self._fwd_plain = True
        if key not in self._copied:  # a tensor saved twice is copied once
            self._copied.add(key)
            view.copy_(t)
        if in_graph:
            for k in self._last_write.get(i, ()):
                b.graph_record(self._written[k])  # its copy out may start here
        self._captured += 1
        return view

    def load_tensor(self, packed: Any) -> Any:
        """Unpack hook during capture: return what :meth:`save_tensor` packed, and teach the
        backward graph under capture the slot's sections. Before the graph first reads a
        section, it waits for that section's copy in. Once every saved tensor in a section
        has been unpacked and the node that unpacked the last of them is done (seen when
        the next node of the backward's own graph task unpacks: nodes run one after another
        there; a backward nested inside a node, another graph task, is no such sign), the
        graph records so, and a restore into the bank may overwrite that section from then
        on. A node must not hand out a saved tensor (or a view of one) as a gradient: later
        nodes would read it after its section was let go. Anything else passes through.
        """
        i = self._view_index.get(id(packed)) if isinstance(packed, torch.Tensor) else None
        if i is None or self.state is not State.CAPTURING:
            return packed
        b, bank = self.engine.backend, self.bank
        assert bank is not None
        bs = self._bwd
        if bs is None:  # the first unpack of this capture
            bs = self._bwd = _BackwardCapture([set() for _ in self.sections])
            for j, secs in enumerate(self._spec_sections):
                for k in secs:
                    bs.left[k].add(j)
            self.restore_order = []
            self.done_events = [None] * len(self.sections)
        if not (self._written and b.is_capturing()):
            bs.plain += 1
            return packed
        node, task = _current_node()
        if bs.task is None:
            bs.task = task
        own = node is not None and task == bs.task  # (not a backward nested in a node)
        if own and node is not bs.node and bs.finished:
            # Every node of this task before this one is queued: what they read is free.
            ev = self._done_pool[bs.records]  # (each record frees a section: enough of them)
            bs.records += 1
            b.graph_record(ev)
            for k in bs.finished:
                self.done_events[k] = ev
            bs.finished = []
        for k in self._spec_sections[i]:
            if k not in bs.waited:
                bs.waited.add(k)
                self.restore_order.append(k)
                b.graph_wait(bank.copied_in[k])
            if i in bs.left[k]:
                bs.left[k].discard(i)
                if not bs.left[k]:
                    bs.finished.append(k)
        if own:
            bs.node = node
        bs.unpacks += 1
        return packed

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
        self.fwd_in_graph = bool(self._written) and self._captured > 0 and not self._fwd_plain
        bs, self._bwd = self._bwd, None
        self.bwd_in_graph = bool(self._written) and bs is not None and bs.unpacks > 0 and not bs.plain
        if not self.bwd_in_graph:
            self.done_events = [None] * len(self.sections)
        # Sections the backward never read come back last, in reverse order of the saves.
        seen = set(self.restore_order)
        self.restore_order += [k for k in reversed(range(len(self.sections))) if k not in seen]
        if self.reservation is not None:
            self.residency.captured(self)

    # -- host buffers ------------------------------------------------------------------

    def _take_stash(self) -> Stash:
        """A stash for a copy out on the engine's copy-out stream: one given back whose last
        user is done, else the one given back first, the copy stream waiting for its last
        user on the device (the host runs ahead of the device between microbatches, where
        nothing synchronises: asking only whether they are done would pin more host memory
        at each one, hundreds of milliseconds a buffer), else a new one."""
        b = self.engine.backend
        for i, st in enumerate(self._host_pool):
            if st.free_after is None or b.query_event(st.free_after):
                return self._host_pool.pop(i)
        if self._host_pool:
            st = self._host_pool.pop(0)
            b.wait_event(self.engine.d2h_stream, st.free_after)
            return st
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
        """``t``'s backward replays next: bring back what only comes back at the backward
        itself (kept activations moved out for another microbatch)."""

    def free(self, g: OffloadGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        """The slot's last user so far is queued before event ``done``: a backward graph
        that read it (``backward``; ``replayed`` False: a restore abandoned before its
        backward ran) or an evaluation forward that wrote it."""
        raise NotImplementedError

    def abandon(self, g: OffloadGroup, t: Ticket, prev: State) -> None:
        """``t`` (last in state ``prev``) will never be consumed: let its slot go."""
        if self.fences(g).holder is t:  # its restore holds the slot
            self.engine._free_slot(g, backward=True, replayed=False)

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

    def free(self, g: OffloadGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        pass

    def abandon(self, g: OffloadGroup, t: Ticket, prev: State) -> None:
        t.stash = None

    def close(self) -> None:
        self.groups.clear()
        self.holder = None


class ResidentBanks(Residency):
    """Banks per size class of slots, mapped for good, so a step makes no driver call.

    A group goes to the smallest class whose banks fit its slot (a new class if none
    does); groups of a class alternate between its two banks in backward order. A bank's
    section events and :class:`SlotFences` keep its bytes right: a forward rewrites a
    section only after the previous occupant's copy of it reached the host, and a restore
    only after the backward graph that last read it is done with it.
    """

    offload_call = "offload:resident"
    holds_newest = True

    def __init__(self, engine: OffloadEngine) -> None:
        super().__init__(engine)
        self.classes: list[list[Bank]] = []  # the banks of each size class

    @property
    def banks(self) -> list[Bank]:
        return [bank for cls in self.classes for bank in cls]

    def bank_count(self, size: int) -> int:
        """How many banks a size class of ``size`` bytes gets."""
        return 2

    def place(self, g: OffloadGroup, bank_index: int) -> Reservation:
        size = g.slot_bytes
        fit = [cls for cls in self.classes if cls[0].size >= size]
        cls = min(fit, key=lambda c: c[0].size) if fit else self._new_class(size)
        bank = cls[bank_index % len(cls)]
        self._ready(bank)  # (remap: mapped again for this capture)
        bank.members.append(g)
        g.bank = bank
        return bank.reservation

    def _new_class(self, size: int) -> list[Bank]:
        b = self.backend
        secs = sections_of(size, self.engine.section_bytes)
        # Graph events where the graphs can hold them; the host waits on them otherwise.
        make = b.new_graph_event if b.graph_events else b.new_event
        cls: list[Bank] = []
        for _ in range(self.bank_count(size)):
            bank = Bank(len(self.banks) + len(cls), size, b.reserve(size), secs,
                        [make() for _ in secs], [make() for _ in secs], pages="unmapped")
            self._new_pages(bank)
            cls.append(bank)
        self.classes.append(cls)
        return cls

    def _new_pages(self, bank: Bank) -> None:
        """A new bank's pages: mapped for good here."""
        self.backend.map_new(bank.reservation, 0, bank.size)
        bank.pages = "mapped"

    def _ready(self, bank: Bank) -> None:
        """``bank``'s pages are mapped (they always are here)."""

    @staticmethod
    def _bank(g: OffloadGroup) -> Bank:
        assert g.bank is not None  # placed at allocate
        return g.bank

    def fences(self, g: OffloadGroup) -> SlotFences:
        return self._bank(g).fences

    def _where(self, g: OffloadGroup) -> str:
        return f"offload group {g.name}: bank {self._bank(g).index}"

    def before_forward(self, g: OffloadGroup) -> None:
        bank = self._bank(g)
        self._ready(bank)
        f = self._writable(g)
        b = self.backend
        cur = b.current_stream()
        if f.written is not None:  # a writer other than a copy out; the replay comes after it
            # (it stays the bank's: a restore into sections this forward does not reach, a
            # larger slot's, still has to wait for it)
            b.wait_event(cur, f.written)
        if not g.fwd_in_graph:
            # The graph cannot wait section by section: the host fences the whole slot.
            for k in range(len(g.sections)):
                b.wait_event(cur, bank.copied_out[k])
                b.wait_event(cur, bank.copied_in[k])
        f.fresh = None  # the replay rewrites the bank (after_offload names its ticket)

    def after_offload(self, g: OffloadGroup, t: Ticket) -> None:
        # (queued before anything else may touch the bank: the engine lets a held ticket
        # go first thing in every call that could)
        self.fences(g).fresh = t

    def still_holds(self, t: Ticket) -> bool:
        # Two banks alternate in backward order, so the newest forward of each bank (the
        # last two layers of a pass) is still there when its backward comes.
        return self.fences(t.group).fresh is t

    def restore(self, t: Ticket, copy_in: Callable[[Any], None]) -> None:
        bank = self._bank(t.group)
        f = self._restorable(t)
        self._ready(bank)
        f.fresh = None
        copy_in(self.engine.h2d_stream)  # (the engine fences each section's copy)
        f.holder = t

    def free(self, g: OffloadGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        f = self.fences(g)
        if backward:
            f.read, f.holder, f.fresh = done, None, None
            # Per bank section (a larger slot placed in this bank later covers more of them:
            # those this backward did not reach go after its end).
            pad = [None] * (len(self._bank(g).sections) - len(g.done_events))
            f.read_sections = g.done_events + pad if replayed and g.bwd_in_graph else None
        else:
            f.written = done  # an evaluation forward wrote the bank

    def close(self) -> None:
        b = self.backend
        for bank in self.banks:
            for off in sorted(bank.reservation.mappings):
                b.unmap_release(bank.reservation, off)
            b.free(bank.reservation)
        self.classes.clear()


class RemapBanks(ResidentBanks):
    """Banks whose pages are mapped only while anything is in flight.

    Where sections stream (the backend's graphs hold events and a slot has more than one
    section), a size class has one bank: the backward reading a layer's sections and the
    restore of the layer before it share the bank section by section, so the device holds
    one slot of activations per class. Otherwise a class has two, as resident.

    A bank is mapped (created, mapped and made accessible, on one serialised driver
    worker thread, never inside a capture or a host callback) when a forward or restore
    first needs it, and once nothing is in flight and no forward is announced, it is
    unmapped and released on that thread after the device is done with it. A pass that
    comes back before that release started takes the bank back as it is: steps queued
    back to back make no driver call, and whenever the device runs dry between steps
    remap holds no device memory.
    """

    offload_call = "offload:remap"

    def __init__(self, engine: OffloadEngine) -> None:
        super().__init__(engine)
        self._worker = DriverWorker(self.backend)
        self.worker = self._worker
        self._lock = threading.Lock()  # the banks' page states (training and worker threads)
        self._prefetched: set[int] = set()  # groups whose next forward is announced

    def bank_count(self, size: int) -> int:
        streams = self.backend.graph_events and len(sections_of(size, self.engine.section_bytes)) > 1
        return 1 if streams else 2

    # -- build ---------------------------------------------------------------------------

    def captured(self, g: OffloadGroup) -> None:
        bank = self._bank(g)
        bank.captured += 1
        if bank.captured == len(bank.members):
            # Between steps a remap bank holds no memory; a pass maps it when needed.
            self.backend.synchronize()
            with self._lock:
                bank.pages = "releasing"
            self._unmap(bank)

    # -- pages ---------------------------------------------------------------------------

    def _new_pages(self, bank: Bank) -> None:
        pass  # mapped when a capture or a pass first needs it

    def _ready(self, bank: Bank) -> None:
        job = self._queue_map(bank)
        if job is not None:
            job.result()  # raises if the map failed (the next use queues another)

    def _queue_map(self, bank: Bank) -> Future[Any] | None:
        """A map of ``bank`` under way (queued now if needed), or None: it is mapped. A
        release queued but not started is called off instead."""
        with self._lock:
            # A release queued but not started is called off: it would find its token gone
            # (also one queued behind a map still to run, which this pass now waits for).
            bank.pending_release = None
            if bank.pages == "mapped":
                return None
            if bank.map_job is None:
                bank.map_job = self._worker.submit(lambda: self._map(bank))
                self.engine.stats["remaps"] += 1
            return bank.map_job

    def prefetch_forward(self, g: OffloadGroup) -> None:
        self._prefetched.add(g.index)
        self._queue_map(self._bank(g))

    def before_forward(self, g: OffloadGroup) -> None:
        self._prefetched.discard(g.index)
        super().before_forward(g)

    def free(self, g: OffloadGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        super().free(g, done, backward, replayed)
        self.release_when_idle()

    def abandon(self, g: OffloadGroup, t: Ticket, prev: State) -> None:
        super().abandon(g, t, prev)
        self.release_when_idle()  # (after a free that already queued it, a no-op)

    def nothing_in_flight(self) -> None:
        # The last ticket was abandoned (a dropped or interrupted pass): a forward announced
        # for that pass will not come.
        self._prefetched.clear()
        self.release_when_idle()

    def release_when_idle(self) -> None:
        """Nothing in flight and no forward announced (an evaluation forward's next layer
        would take the pages straight back): queue the release of every mapped bank, to
        run on the worker once the device is done with everything queued so far."""
        eng = self.engine
        if eng._pending or self._prefetched or eng.closed:
            return
        b = self.backend
        events = None
        for bank in self.banks:
            with self._lock:
                # (a map still queued is released after it: the worker runs jobs in order)
                mapped = bank.pages == "mapped" or bank.map_job is not None
                if not mapped or bank.pending_release is not None:
                    continue
                token = bank.pending_release = object()
            if events is None:  # the ends of what every stream queued so far
                events = [b.record_event(b.new_event(), s)
                          for s in (b.current_stream(), eng.d2h_stream, eng.h2d_stream)]
            bank.release_jobs.append(
                self._worker.submit(functools.partial(self._release_after, bank, token, events)))

    def drain(self) -> None:
        """Wait for queued driver work; raises the first release that failed since the last
        drain (nobody else waits for a release, so its error would go unseen)."""
        self._worker.drain()
        failed = None
        for bank in self.banks:
            jobs, bank.release_jobs = bank.release_jobs, []
            for job in jobs:
                if failed is None and job.exception() is not None:
                    failed = job.exception()
        if failed is not None:
            raise failed

    def close(self) -> None:
        self._worker.close()
        super().close()

    # -- on the worker thread ------------------------------------------------------------

    def _map(self, bank: Bank) -> None:
        try:
            if bank.reservation.mapping_at(0) is not None:  # a release whose unmap failed
                with self._lock:
                    bank.pages = "mapped"
                return
            self.backend.map_new(bank.reservation, 0, bank.size)
            with self._lock:
                bank.pages = "mapped"
        finally:
            with self._lock:  # (queued under this lock: the job is the bank's by now)
                bank.map_job = None

    def _release_after(self, bank: Bank, token: object, events: list[Any]) -> None:
        for ev in events:  # an event wait before unmapping what a kernel may touch
            self._worker.wait_event(ev)
        with self._lock:
            if bank.pending_release is not token:
                return  # called off: a pass took the bank back before its release started
            bank.pending_release, bank.pages = None, "releasing"
        self._unmap(bank)

    def _unmap(self, bank: Bank) -> None:
        """Unmap and release ``bank``'s pages (its state is "releasing")."""
        try:
            if bank.reservation.mapping_at(0) is not None:
                self.backend.unmap_release(bank.reservation, 0)
        finally:
            with self._lock:
                bank.pages = "mapped" if bank.reservation.mapping_at(0) is not None else "unmapped"


# --------------------------------------------------------------------------- engine


class OffloadEngine:
    """Schedules offload and restore of many groups on one backend.

    Args:
        backend: the device backend.
        mode: :class:`Mode` (``"resident"`` or ``"remap"``; ``"off"`` keeps every
            group's activations on the device, in the graphs' own memory).
        min_bytes: saved tensors smaller than this stay on the device (in a device stash).
        section_bytes: a bank's bytes move to and from the host in sections of at most this
            many bytes, each with events of its own (:data:`SECTION_BYTES`; see the module
            docstring). Smaller sections let copies and compute overlap more finely at the
            cost of more calls per copy.
        debug_checksums: record a checksum of every offloaded activation and verify it
            after restore (slow: host synchronisations; for tests and debugging).

    Raises:
        UsageError: an unknown mode, a negative ``min_bytes``, a ``section_bytes`` that is
            not a positive integer.
    """

    def __init__(self, backend: Backend, mode: Mode | str = Mode.RESIDENT, *, min_bytes: int = 0,
                 section_bytes: int = SECTION_BYTES, debug_checksums: bool = False) -> None:
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise UsageError(f"unknown offload mode {mode!r}; choose off, resident or remap") from None
        if min_bytes < 0:
            raise UsageError(f"min_bytes must be >= 0, got {min_bytes}")
        if isinstance(section_bytes, bool) or not isinstance(section_bytes, int) or section_bytes < 1:
            raise UsageError(f"section_bytes must be a positive integer, got {section_bytes!r}")
        self.backend = backend
        self.section_bytes = section_bytes
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
                                     RemapBanks(self) if self.mode is Mode.REMAP else self.kept)
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
        """After the forward replay: the newest forward is held in its bank. Its copy out is
        queued by the next forward, a restore of another ticket, :meth:`settle` or
        :meth:`close`, and not at all when its own restore comes first (the bank is mapped
        for the pass anyway): the last layer of a training pass never leaves the device.
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
        s = self.d2h_stream
        try:
            with self._span("d2h", f"{g.name} mb{t.microbatch}", s, g.host_bytes):
                self._copy_out(t, s)
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

    def _copy_out(self, t: Ticket, s: Any) -> None:
        """Queue ``t``'s slot to its stash on stream ``s``, section by section: each copy
        waits for its forward graph to have written that section (for the whole forward
        where the graph records no sections) and records the bank's event that lets the
        next forward into the bank rewrite it."""
        b, g = self.backend, t.group
        bank = g.bank
        assert bank is not None and t.stash is not None
        in_graph = g.fwd_in_graph
        if not in_graph:
            b.wait_event(s, t.fwd_done)  # the copy stream waits only on the forward
        for k, part in enumerate(g.stash_pieces(t.stash)):
            if in_graph:  # (a section no saved tensor writes, padding, has no record to wait for)
                b.wait_event(s, g._written[k])
            for slot_bytes, stash_bytes in part:
                b.copy_async(stash_bytes, slot_bytes, s)
            b.record_event(bank.copied_out[k], s)

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
        """Queue ``t``'s stash back into its bank on stream ``s``, section by section in
        the order its backward graph reads them. Each section's copy waits for the bank's
        last reader to be done with that section (the backward graph's own event where it
        records one) and for the section's latest copy out, and records the event the
        backward graph waits for before it reads the section."""
        b, g, st = self.backend, t.group, t.stash
        assert st is not None and g.bank is not None
        bank = g.bank
        f = bank.fences
        try:
            with self._span("h2d", f"{g.name} mb{t.microbatch}", s, g.host_bytes):
                if f.written is not None:  # a writer other than a copy out
                    b.wait_event(s, f.written)
                pieces, read, waited = g.stash_pieces(st), f.read_sections, None
                for k in g.restore_order:
                    r = f.read if read is None or read[k] is None else read[k]
                    if r is not None and r is not waited:  # (the graph's end: waited once)
                        b.wait_event(s, r)
                        waited = r
                    b.wait_event(s, bank.copied_out[k])
                    for slot_bytes, stash_bytes in pieces[k]:
                        b.copy_async(slot_bytes, stash_bytes, s)
                    b.record_event(bank.copied_in[k], s)
        except BaseException:
            # Part of the copy may be queued: the slot's next writer and the host buffer's
            # next user go after it (on whichever thread the copy was queued from).
            t.restore_done = b.record_event(b.new_event(), s)
            g.residency.fences(g).written = t.restore_done
            raise
        t.restore_done = b.record_event(b.new_event(), s)
        self.stats["restored_bytes"] += g.host_bytes

    def wait_restored(self, t: Ticket) -> None:
        """Make the compute stream wait for ``t``'s restore (the host does not block on the
        copy; a backward graph that waits for each section itself needs no wait here).

        A restore that fails (a remap bank's map, a copy) raises with the ticket as it was:
        the host copy is kept and the call may be made again.
        """
        g = t.group
        if t.state is not State.RESTORING and g.offloads:
            self.restore(t)  # (kept activations have nothing to restore ahead of this)
        self.kept.claim(t.microbatch)  # the backward replay may overwrite what another keeps
        g.residency.restored(t)
        t._go("wait_restored")
        if t.restore_done is None:
            return  # nothing was copied in for it (kept on the device, or nothing saved)
        b = self.backend
        if not (g.bwd_in_graph and not t.in_place):
            # (a backward graph that waits for each section itself needs no host fence)
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

    def _free_slot(self, g: OffloadGroup, backward: bool, replayed: bool = True) -> None:
        """The slot's last user so far is queued: the residency lets it go after that
        (``replayed`` False: a backward that held the slot but never ran)."""
        b = self.backend
        g.residency.free(g, b.record_event(b.new_event()), backward, replayed)

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
