"""Where a group's activations wait between forward and backward: a :class:`Residency`.

:class:`ResidentBanks` (banks mapped for good), :class:`RemapBanks` (mapped only while
anything is in flight, on a driver worker) and :class:`KeptOnDevice` (groups that do not
offload). A residency places slots in banks, fences their bytes, and does the
section-by-section copies between a slot and its stash itself; the engine decides when.
It sees its groups and its engine only through :class:`SlotGroup` and
:class:`EngineHooks`, defined here: it imports :mod:`.states`, :mod:`.tickets`,
:mod:`.saved` and :mod:`.worker`, never the group or engine modules.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Protocol

import torch

from ..backend import Backend, Reservation
from ..errors import StateError
from .saved import sections_of
from .states import State, step
from .tickets import Stash, Ticket
from .worker import DriverWorker


class SlotGroup(Protocol):
    """What a residency reads of a group (:class:`~graphslot.offload.OffloadGroup`)."""

    bank: Bank | None  #: set by :meth:`ResidentBanks.place`

    @property
    def name(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def host_bytes(self) -> int: ...
    @property
    def kept_bytes(self) -> int: ...
    @property
    def views(self) -> list[torch.Tensor]: ...
    @property
    def sections(self) -> list[tuple[int, int]]: ...
    @property
    def restore_order(self) -> list[int]: ...
    @property
    def fwd_in_graph(self) -> bool: ...
    @property
    def bwd_in_graph(self) -> bool: ...
    @property
    def done_events(self) -> list[Any]: ...
    @property
    def written_events(self) -> list[Any]: ...

    def stash_pieces(self, stash: Stash) -> list[list[tuple[torch.Tensor, torch.Tensor]]]: ...


class EngineHooks(Protocol):
    """What a residency asks of the engine that schedules it
    (:class:`~graphslot.offload.OffloadEngine` implements it)."""

    @property
    def backend(self) -> Backend: ...
    @property
    def section_bytes(self) -> int: ...
    @property
    def stats(self) -> Counter[str]: ...
    @property
    def d2h_stream(self) -> Any: ...
    @property
    def h2d_stream(self) -> Any: ...
    @property
    def closed(self) -> bool: ...
    @property
    def has_in_flight(self) -> bool: ...

    def in_flight_ticket(self, group_index: int, microbatch: int) -> Ticket[Any] | None: ...

    def copy_span(self, track: str, name: str, stream: Any, nbytes: int) -> ContextManager[Any]: ...


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
    holder: Ticket[Any] | None = None  #: a restore whose backward has not run yet
    #: the forward whose activations these bytes still are: nothing rewrote them since
    #: (its restore then needs no copy)
    fresh: Ticket[Any] | None = None


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
    members: list[SlotGroup] = field(default_factory=list)
    captured: int = 0  #: members whose graphs are captured
    # Remap: the pages' state ("mapped", "releasing" or "unmapped", under the residency's
    # lock), the map job under way, and the token of a release queued but not started.
    pages: str = "mapped"
    map_job: Future[Any] | None = None
    pending_release: object | None = None
    #: releases queued since the last drain (a failed one surfaces there)
    release_jobs: list[Future[Any]] = field(default_factory=list)




class Residency:
    """Where the engine keeps a slot's pages between forward and backward: all that
    differs between the offload modes. The engine keeps the tickets and decides when;
    a residency places slots, makes them writable for a forward and readable for a
    backward, copies them out and back, and lets them go. Its methods run on the
    training thread."""

    #: the ticket transition of an offload in this residency
    offload_call: str
    #: whether the newest forward may stay in its slot until the engine's next call (its
    #: bytes are mapped anyway), so that a backward coming next needs no copy either way
    holds_newest = False
    #: the thread its driver calls run on, if it makes any in a step
    worker: DriverWorker | None = None

    def __init__(self, engine: EngineHooks) -> None:
        self.engine = engine
        self.backend = engine.backend

    @property
    def mapped_bytes(self) -> int:
        """Device bytes of its banks mapped now (none where it keeps no banks)."""
        return 0

    def place(self, g: SlotGroup, bank_index: int) -> Reservation:
        """Outside capture: the VA ``g``'s slot lives at, mapped for the capture."""
        raise NotImplementedError

    def fences(self, g: SlotGroup) -> SlotFences:
        """The fences of the bytes ``g``'s slot occupies."""
        raise NotImplementedError

    def _where(self, g: SlotGroup) -> str:
        return f"offload group {g.name}: its slot"

    @staticmethod
    def _whose(g: SlotGroup, t: Ticket[SlotGroup]) -> str:
        return (f"microbatch {t.microbatch}" if t.group is g else
                f"{t.group.name} (microbatch {t.microbatch})")

    def _writable(self, g: SlotGroup) -> SlotFences:
        """``g``'s fences, or a StateError if a restore its backward awaits is in them."""
        f = self.fences(g)
        if f.holder is not None:
            raise StateError(f"{self._where(g)} holds activations restored for "
                             f"{self._whose(g, f.holder)} whose backward has not run; a forward "
                             "cannot overwrite them")
        return f

    def _restorable(self, t: Ticket[SlotGroup]) -> SlotFences:
        """``t``'s slot fences, or a StateError if another restore holds them (the caller
        makes ``t`` their holder once its restore is under way)."""
        f = self.fences(t.group)
        if f.holder is not None and f.holder is not t:
            raise StateError(f"{self._where(t.group)} still holds the restore of "
                             f"{self._whose(t.group, f.holder)}")
        return f

    def captured(self, g: SlotGroup) -> None:
        """``g``'s graphs are captured."""

    def prefetch_forward(self, g: SlotGroup) -> None:
        """``g``'s forward comes soon: start making its slot writable (look-ahead)."""

    def before_forward(self, g: SlotGroup) -> None:
        """Make the compute stream's next forward replay of ``g`` safe to write the slot."""
        raise NotImplementedError

    def after_offload(self, g: SlotGroup, t: Ticket[SlotGroup]) -> None:
        """``t``'s copy out is queued (``t.d2h_done`` marks its end)."""
        raise NotImplementedError

    def copy_out(self, t: Ticket[SlotGroup], s: Any) -> None:
        """Queue ``t``'s slot to its stash on stream ``s`` (the engine records its end)."""
        raise NotImplementedError

    def restore(self, t: Ticket[SlotGroup]) -> None:
        """Start bringing ``t``'s activations back (queues the copy in, where there is one)."""
        raise NotImplementedError

    def still_holds(self, t: Ticket[SlotGroup]) -> bool:
        """Whether ``t``'s slot still holds the bytes its forward wrote (nothing rewrote
        them since), so that its restore may leave them in place."""
        return False

    def keep_in_place(self, t: Ticket[SlotGroup]) -> None:
        """``t``'s backward may read its forward's bytes where they are (it was held, or
        :meth:`still_holds`): the slot is now its restore's."""
        self._restorable(t).holder = t

    def can_restore(self, t: Ticket[SlotGroup]) -> bool:
        """Whether ``t``'s restore could start now without waiting for another ticket."""
        held = self.fences(t.group).holder
        return held is None or held is t

    def restored(self, t: Ticket[SlotGroup]) -> None:
        """``t``'s backward replays next: bring back what only comes back at the backward
        itself (kept activations moved out for another microbatch)."""

    def free(self, g: SlotGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        """The slot's last user so far is queued before event ``done``: a backward graph
        that read it (``backward``; ``replayed`` False: a restore abandoned before its
        backward ran) or an evaluation forward that wrote it."""
        raise NotImplementedError

    def free_after_queued(self, g: SlotGroup, backward: bool, replayed: bool = True) -> None:
        """:meth:`free` after everything queued on the compute stream so far."""
        b = self.backend
        self.free(g, b.record_event(b.new_event()), backward, replayed)

    def abandon(self, g: SlotGroup, t: Ticket[SlotGroup], prev: State) -> None:
        """``t`` (last in state ``prev``) will never be consumed: let its slot go."""
        if self.fences(g).holder is t:  # its restore holds the slot
            self.free_after_queued(g, backward=True, replayed=False)

    def nothing_in_flight(self) -> None:
        """The last ticket in flight was abandoned: whatever a pass prepared goes too."""

    def drain(self) -> None:
        """Wait for the driver work this residency queued; raise what failed unseen."""

    def close(self) -> None:
        """Release what this residency made (the engine is idle)."""


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

    def __init__(self, engine: EngineHooks) -> None:
        super().__init__(engine)
        self.holder: int | None = None  #: the microbatch whose activations the graphs' memory holds
        self.groups: list[SlotGroup] = []  #: kept groups whose backward reads that memory

    def track(self, g: SlotGroup) -> None:
        if g.views and g not in self.groups:
            self.groups.append(g)

    def place(self, g: SlotGroup, bank_index: int) -> Reservation:
        raise StateError(f"offload group {g.name}: kept on the device, it has no slot")

    def can_restore(self, t: Ticket[SlotGroup]) -> bool:
        return True

    def claim(self, microbatch: int) -> None:
        """Graphs are about to replay for ``microbatch``: park what the previous holder keeps."""
        held = self.holder
        if held == microbatch:
            return
        if held is not None:
            for g in self.groups:
                t = self.engine.in_flight_ticket(g.index, held)
                if t is not None and t.state is State.KEPT:
                    self._park(t)
        self.holder = microbatch  # only now: a park that failed is tried again next time

    @staticmethod
    def _packed(g: SlotGroup, buf: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(view, its place in ``buf``) for each of ``g``'s kept views, packed end to end."""
        pos = 0
        for v in g.views:
            n = v.numel()
            yield v, buf[pos:pos + n]
            pos += n

    def _park(self, t: Ticket[SlotGroup]) -> None:
        nxt = step(t.who, t.state, "park")
        g, b = t.group, self.backend
        buf = torch.empty(g.kept_bytes, dtype=torch.uint8, device=b.device)
        s = b.current_stream()
        for v, place in self._packed(g, buf):
            b.copy_async(place, v, s)
        t.stash = Stash(None, buf)
        self.engine.stats["parked_bytes"] += g.kept_bytes
        t.state = nxt

    def before_forward(self, g: SlotGroup) -> None:
        pass  # the engine claimed the graphs' memory for this forward's microbatch

    def restore(self, t: Ticket[SlotGroup]) -> None:
        pass  # they come back at the backward itself (restored)

    def restored(self, t: Ticket[SlotGroup]) -> None:
        stash = t.stash
        if stash is None:
            return  # never moved: still where the graph wrote them
        b = self.backend
        s = b.current_stream()
        for v, place in self._packed(t.group, stash.device):
            b.copy_async(v, place, s)
        t.stash = None  # the buffer's uses are all on this stream: the allocator orders its reuse

    def free(self, g: SlotGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        pass

    def abandon(self, g: SlotGroup, t: Ticket[SlotGroup], prev: State) -> None:
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

    def __init__(self, engine: EngineHooks) -> None:
        super().__init__(engine)
        self.classes: list[list[Bank]] = []  # the banks of each size class

    @property
    def banks(self) -> list[Bank]:
        return [bank for cls in self.classes for bank in cls]

    @property
    def mapped_bytes(self) -> int:
        return sum(m.size for bank in self.banks for m in bank.reservation.mappings.values())

    def bank_count(self, size: int) -> int:
        """How many banks a size class of ``size`` bytes gets."""
        return 2

    def place(self, g: SlotGroup, bank_index: int) -> Reservation:
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
    def _bank(g: SlotGroup) -> Bank:
        assert g.bank is not None  # placed at allocate
        return g.bank

    def fences(self, g: SlotGroup) -> SlotFences:
        return self._bank(g).fences

    def _where(self, g: SlotGroup) -> str:
        return f"offload group {g.name}: bank {self._bank(g).index}"

    def before_forward(self, g: SlotGroup) -> None:
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

    def after_offload(self, g: SlotGroup, t: Ticket[SlotGroup]) -> None:
        # (queued before anything else may touch the bank: the engine lets a held ticket
        # go first thing in every call that could)
        self.fences(g).fresh = t

    def still_holds(self, t: Ticket[SlotGroup]) -> bool:
        # Two banks alternate in backward order, so the newest forward of each bank (the
        # last two layers of a pass) is still there when its backward comes.
        return self.fences(t.group).fresh is t

    def restore(self, t: Ticket[SlotGroup]) -> None:
        bank = self._bank(t.group)
        f = self._restorable(t)
        self._ready(bank)
        f.fresh = None
        self._copy_in(t, self.engine.h2d_stream)
        f.holder = t

    # -- copies --------------------------------------------------------------------------

    def copy_out(self, t: Ticket[SlotGroup], s: Any) -> None:
        """Queue ``t``'s slot to its stash on stream ``s``, section by section: each copy
        waits for its forward graph to have written that section (for the whole forward
        where the graph records no sections) and records the bank's event that lets the
        next forward into the bank rewrite it."""
        b, g = self.backend, t.group
        bank = g.bank
        assert bank is not None and t.stash is not None
        with self.engine.copy_span("d2h", f"{g.name} mb{t.microbatch}", s, g.host_bytes):
            in_graph = g.fwd_in_graph
            if not in_graph:
                b.wait_event(s, t.fwd_done)  # the copy stream waits only on the forward
            for k, part in enumerate(g.stash_pieces(t.stash)):
                if in_graph:  # (a section no saved tensor writes, padding, has no record to wait for)
                    b.wait_event(s, g.written_events[k])
                for slot_bytes, stash_bytes in part:
                    b.copy_async(stash_bytes, slot_bytes, s)
                b.record_event(bank.copied_out[k], s)

    def _copy_in(self, t: Ticket[SlotGroup], s: Any) -> None:
        """Queue ``t``'s stash back into its bank on stream ``s``, section by section in
        the order its backward graph reads them. Each section's copy waits for the bank's
        last reader to be done with that section (the backward graph's own event where it
        records one) and for the section's latest copy out, and records the event the
        backward graph waits for before it reads the section."""
        b, g, stash = self.backend, t.group, t.stash
        assert stash is not None and g.bank is not None
        bank = g.bank
        f = bank.fences
        try:
            with self.engine.copy_span("h2d", f"{g.name} mb{t.microbatch}", s, g.host_bytes):
                if f.written is not None:  # a writer other than a copy out
                    b.wait_event(s, f.written)
                pieces, read, waited = g.stash_pieces(stash), f.read_sections, None
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
            self.fences(g).written = t.restore_done
            raise
        t.restore_done = b.record_event(b.new_event(), s)
        self.engine.stats["restored_bytes"] += g.host_bytes

    def free(self, g: SlotGroup, done: Any, backward: bool, replayed: bool = True) -> None:
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

    def __init__(self, engine: EngineHooks) -> None:
        super().__init__(engine)
        self._worker = DriverWorker(self.backend)
        self.worker = self._worker
        self._lock = threading.Lock()  # the banks' page states (training and worker threads)
        self._prefetched: set[int] = set()  # groups whose next forward is announced

    def bank_count(self, size: int) -> int:
        streams = self.backend.graph_events and len(sections_of(size, self.engine.section_bytes)) > 1
        return 1 if streams else 2

    # -- build ---------------------------------------------------------------------------

    def captured(self, g: SlotGroup) -> None:
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

    def prefetch_forward(self, g: SlotGroup) -> None:
        self._prefetched.add(g.index)
        self._queue_map(self._bank(g))

    def before_forward(self, g: SlotGroup) -> None:
        self._prefetched.discard(g.index)
        super().before_forward(g)

    def free(self, g: SlotGroup, done: Any, backward: bool, replayed: bool = True) -> None:
        super().free(g, done, backward, replayed)
        self.release_when_idle()

    def abandon(self, g: SlotGroup, t: Ticket[SlotGroup], prev: State) -> None:
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
        if eng.has_in_flight or self._prefetched or eng.closed:
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
