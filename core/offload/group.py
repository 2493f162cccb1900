"""One graphed unit's saved activations: :class:`OffloadGroup` (discovery, slot layout,
capture of its forward and backward graphs, its host buffers). It sees the engine that
made it only through :class:`GroupHost`, defined here: it imports :mod:`.states`,
:mod:`.tickets`, :mod:`.saved` and :mod:`.residency`, never the engine module.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..backend import Backend, Reservation, align_up
from ..errors import CaptureMismatchError, StateError, UsageError
from .residency import Bank, KeptOnDevice, Residency
from .saved import SLOT_ALIGN, SavedTensorSpec
from .states import State, step
from .tickets import Stash


class GroupHost(Protocol):
    """What a group asks of the engine that made it
    (:class:`~graphslot.offload.OffloadEngine` implements it)."""

    @property
    def backend(self) -> Backend: ...
    @property
    def min_bytes(self) -> int: ...
    @property
    def kept(self) -> KeptOnDevice: ...
    @property
    def residency(self) -> Residency: ...
    @property
    def groups(self) -> Sequence[Any]: ...
    @property
    def stats(self) -> Counter[str]: ...
    @property
    def d2h_stream(self) -> Any: ...


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

    def __init__(self, engine: GroupHost, name: str, offload: bool = True) -> None:
        self.engine = engine
        self.name = name
        #: whether it is to offload what it saves (asked to, in an engine that offloads);
        #: :attr:`offloads` says whether it does (it laid out something to offload)
        self.wants_offload = offload
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
        #: per section, the event its forward graph records once it wrote it (none: the
        #: backend's graphs hold no events)
        self.written_events: list[Any] = []
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

    def advance(self, call: str) -> None:
        """Take the transition ``call`` (a StateError, naming the group, if refused)."""
        self.state = step(self.who, self.state, call)

    def who(self) -> str:
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
        if self.wants_offload:
            raise UsageError(f"offload group {self.name}: keep() is for groups that do not offload")
        vs = list(views)
        for v in vs:
            if not v.is_contiguous():
                raise UsageError(f"offload group {self.name}: a kept view must be contiguous, "
                                 f"got shape {list(v.shape)} stride {list(v.stride())}")
        self.advance("keep")
        self.views = [v.reshape(-1).view(torch.uint8) for v in vs]
        self.kept_bytes = sum(v.numel() for v in self.views)
        self.engine.kept.track(self)

    # -- discovery ---------------------------------------------------------------

    def discover(self, t: torch.Tensor) -> None:
        """Record one saved tensor seen during the eager warm-up (autograd is untouched)."""
        self.advance("discover")
        self.specs.append(SavedTensorSpec.of(t, self._seen_storages))

    def adopt(self, specs: list[SavedTensorSpec]) -> None:
        """Take a layout discovered elsewhere (another graph of the same module)."""
        for sp in specs:
            self.advance("discover")
            self.specs.append(dataclasses.replace(sp, offset=0, offload=True))

    def restart_discovery(self) -> None:
        """Forget what an earlier warm-up iteration recorded (each iteration must agree)."""
        if self.state is not State.DISCOVERING:
            step(f"offload group {self.name}", self.state, "discover")
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
            off = self.wants_offload and end - start >= eng.min_bytes
            spans.append((not off, members, own, start, end))
        spans.sort(key=lambda x: x[0])  # stable: offloaded regions first, in order of first sight
        placed: dict[int, SavedTensorSpec] = {}
        pos = host = 0
        for kept, members, own, start, end in spans:
            # Keep each view's address alignment as it was in its storage (kernels choose
            # their vector width from it), so slot and pool run the very same kernels.
            base = align_up(pos, SLOT_ALIGN) + start % SLOT_ALIGN
            for i in members:
                sp = self.specs[i]
                placed[i] = dataclasses.replace(sp, offset=base + (0 if own else sp.storage_offset - start),
                                                offload=not kept)
            pos = align_up(base + end - start, SLOT_ALIGN)
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
        self.advance("allocate")
        self.layout()
        eng = self.engine
        if not self.wants_offload and not self.empty:
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

    def slot_snapshot(self) -> list[torch.Tensor | None]:
        """Outside capture: a host copy of the slot's bytes (see
        :meth:`OffloadUnit.slot_snapshot`), in anonymous mappings of its own, which go back
        to the system once dropped (the heap would keep them in the process's footprint)."""
        if self.engine.backend.is_capturing():
            raise StateError(f"offload group {self.name}: slot_snapshot must run outside graph capture")
        copies: list[torch.Tensor | None] = []
        for t in self._bytes:
            host = None
            if t is not None and t.numel():
                host = torch.frombuffer(mmap.mmap(-1, t.numel()), dtype=torch.uint8)
                host.copy_(t)
            copies.append(host)
        return copies

    def restore_slot(self, copies: list[torch.Tensor | None]) -> None:
        """Outside capture: write back what :meth:`slot_snapshot` copied."""
        if self.engine.backend.is_capturing():
            raise StateError(f"offload group {self.name}: restore_slot must run outside graph capture")
        for t, host in zip(self._bytes, copies):
            if t is not None and host is not None:
                t.copy_(host)

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
            self.written_events = [b.new_graph_event() for _ in range(n)]
            self._done_pool = [b.new_graph_event() for _ in range(n)]
        self.done_events = [None] * n
        self.restore_order = list(reversed(range(n)))  # reverse of the saves: until a backward says

    def stash_pieces(self, stash: Stash) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per section of the slot, the (slot bytes, stash bytes) views its copies move: the
        offloaded part goes to the pinned host buffer, the kept part to the device one."""
        if stash.pieces is None:
            hb = self.host_bytes
            slot_h, slot_d = self._bytes
            pieces = []
            for a, e in self.sections:
                part = []
                if a < hb:
                    part.append((slot_h[a:min(e, hb)], stash.host[a:min(e, hb)]))
                if e > hb:
                    lo = max(a, hb) - hb
                    part.append((slot_d[lo:e - hb], stash.device[lo:e - hb]))
                pieces.append(part)
            stash.pieces = pieces
        return stash.pieces

    # -- capture ---------------------------------------------------------------------

    def begin_capture(self) -> None:
        self.advance("begin_capture")
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
        self.advance("save_tensor")
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
            storage = t.untyped_storage()
            ptr = storage._cdata
            self._identities.append(StorageWeakRef(storage))
            had = self._capture_storages.setdefault(spec.storage, ptr)
            other = self._capture_ptrs.setdefault(ptr, spec.storage)
            if had != ptr or other != spec.storage or t.storage_offset() * t.element_size() != spec.storage_offset:
                raise CaptureMismatchError(
                    f"offload group {self.name}: saved tensor #{i} does not view its storage as at "
                    "discovery (which saved tensors share memory, or where, changed); the layer must "
                    "save the same tensors every time")
            key = (ptr, spec.storage_offset, spec.shape, spec.stride)
        b = self.engine.backend
        in_graph = bool(self.written_events) and b.is_capturing()
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
                b.graph_record(self.written_events[k])  # its copy out may start here
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
        if not (self.written_events and b.is_capturing()):
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
        self.advance("finish_capture")
        self.fwd_in_graph = bool(self.written_events) and self._captured > 0 and not self._fwd_plain
        bs, self._bwd = self._bwd, None
        self.bwd_in_graph = bool(self.written_events) and bs is not None and bs.unpacks > 0 and not bs.plain
        if not self.bwd_in_graph:
            self.done_events = [None] * len(self.sections)
        # Sections the backward never read come back last, in reverse order of the saves.
        seen = set(self.restore_order)
        self.restore_order += [k for k in reversed(range(len(self.sections))) if k not in seen]
        if self.reservation is not None:
            self.residency.captured(self)

    # -- host buffers ------------------------------------------------------------------

    def take_stash(self) -> Stash:
        """A stash for a copy out on the engine's copy-out stream: one given back whose last
        user is done, else the one given back first, the copy stream waiting for its last
        user on the device (the host runs ahead of the device between microbatches, where
        nothing synchronises: asking only whether they are done would pin more host memory
        at each one, hundreds of milliseconds a buffer), else a new one."""
        b = self.engine.backend
        for i, stash in enumerate(self._host_pool):
            if stash.free_after is None or b.query_event(stash.free_after):
                return self._host_pool.pop(i)
        if self._host_pool:
            stash = self._host_pool.pop(0)
            b.wait_event(self.engine.d2h_stream, stash.free_after)
            return stash
        host = b.pinned_empty(self.host_bytes) if self.host_bytes else None
        kept = self.nbytes - self.host_bytes
        dev = None
        if kept:
            dev = torch.empty(kept, dtype=torch.uint8, device=b.device)
        self.engine.stats["host_buffers_allocated"] += 1
        return Stash(host, dev)

    def give_back_stash(self, stash: Stash, free_after: Any) -> None:
        """``stash``'s last user is queued before event ``free_after``: a later copy out
        may take it (:meth:`take_stash`)."""
        stash.free_after = free_after
        self._host_pool.append(stash)

    @property
    def pooled_stashes(self) -> list[Stash]:
        """The stashes given back and not taken again."""
        return list(self._host_pool)

    def release_memory(self) -> None:
        """The engine closed: drop the slot's views and address, and the host buffers."""
        self.reservation = None
        self.views = []
        self._bytes = (None, None)
        self._host_pool.clear()


def _dense_stride(s: SavedTensorSpec) -> tuple[int, ...] | None:
    """Slot views are dense: the original stride if it is dense, else contiguous."""
    # Dense means the strides are a permutation of some contiguous layout's.
    dims = sorted((gap, n) for gap, n in zip(s.stride, s.shape) if n != 1)
    expect = 1
    for gap, n in dims:
        if gap != expect:
            return None
        expect *= n
    return s.stride
