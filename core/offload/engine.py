"""The scheduling of offload and restore: :class:`OffloadEngine` keeps the tickets in
flight, decides when a held forward's copy out is queued, and hands the copies, fences and
pages to its residencies. Imports every other module of the package; none imports it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, ContextManager

import torch

from ..backend import Backend
from ..errors import CaptureMismatchError, StateError, UsageError
from ..sizes import whole_count
from .group import OffloadGroup
from .residency import KeptOnDevice, RemapBanks, Residency, ResidentBanks
from .saved import SECTION_BYTES
from .states import Mode, State, step
from .tickets import Ticket
from .worker import DriverWorker


class OffloadEngine:
    """Schedules offload and restore of many groups on one backend.

    Args:
        backend: the device backend.
        mode: :class:`Mode` (``"resident"`` or ``"remap"``; ``"off"`` keeps every
            group's activations on the device, in the graphs' own memory).
        min_bytes: saved tensors smaller than this stay on the device (in a device stash).
        section_bytes: a bank's bytes move to and from the host in sections of at most this
            many bytes, each with events of its own (:data:`SECTION_BYTES`; see the package
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
        min_bytes = whole_count(min_bytes, "min_bytes", of=" of bytes")
        section_bytes = whole_count(section_bytes, "section_bytes", least=1, of=" of bytes")
        self.backend = backend
        self.section_bytes = section_bytes
        self.min_bytes = min_bytes
        self.debug_checksums = debug_checksums
        self.groups: list[OffloadGroup] = []
        self.d2h_stream = backend.new_stream()
        self.h2d_stream = backend.new_stream()
        self._pending: dict[tuple[int, int], Ticket[OffloadGroup]] = {}  # (group index, microbatch) -> ticket
        self._held: Ticket[OffloadGroup] | None = None  # the newest forward, whose copy out is not queued yet
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
    def mapped_bytes(self) -> int:
        """Device bytes of this engine's banks (and the slots in them) mapped now: its own
        pages, not the process's (another stack's, a graph pool's on graphslot's pages)."""
        return self.residency.mapped_bytes

    @property
    def resident_device_bytes(self) -> int:
        """Device bytes graphslot holds for activations right now (banks, slots, stashes)."""
        n = self.mapped_bytes
        for t in self._pending.values():
            if t.stash is not None and t.stash.device is not None:
                n += t.stash.device.numel()
        return n

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes this engine holds (buffers in flight and reusable ones)."""
        stashes = [stash for g in self.groups for stash in g.pooled_stashes]
        stashes += [t.stash for t in self._pending.values() if t.stash is not None]
        return sum(stash.host.numel() for stash in stashes if stash.host is not None)

    # -- what the residencies ask of the engine (EngineHooks) -----------------------------

    @property
    def has_in_flight(self) -> bool:
        """Whether any forward awaits its backward (or its end)."""
        return bool(self._pending)

    def in_flight_ticket(self, group_index: int, microbatch: int) -> Ticket[OffloadGroup] | None:
        """The ticket in flight of group number ``group_index`` for ``microbatch``, if any."""
        return self._pending.get((group_index, microbatch))

    def copy_span(self, track: str, name: str, stream: Any, nbytes: int) -> ContextManager[Any]:
        """A span on :attr:`timeline` for a copy (a no-op without one)."""
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(track, name, stream, nbytes)

    # -- forward -------------------------------------------------------------------------

    def prefetch_forward(self, g: OffloadGroup) -> None:
        """Start making ``g``'s slot writable for its next forward (remap: map it)."""
        self._queue_held_copy_out()
        g.residency.prefetch_forward(g)

    def before_forward(self, g: OffloadGroup, microbatch: int) -> Ticket[OffloadGroup]:
        """Make ``g``'s slot writable for a forward replay; returns that forward's ticket."""
        self._check_open("forward")
        self._queue_held_copy_out()  # the replay may write its bank or take its pages' place
        if g.state is not State.READY:
            g.advance("offload:forward")  # refused, naming the state
        key = (g.index, microbatch)
        if key in self._pending:
            raise StateError(f"offload group {g.name}: microbatch {microbatch} ran forward again "
                             "before its backward")
        t = Ticket(g, microbatch)
        self.kept.claim(microbatch)  # the replay may overwrite what another microbatch keeps
        g.residency.before_forward(g)
        self._pending[key] = t
        return t

    def after_forward(self, t: Ticket[OffloadGroup]) -> None:
        """After the forward replay: the newest forward is held in its bank. Its copy out is
        queued by the next forward, a restore of another ticket, :meth:`wait_idle` or
        :meth:`close`, and not at all when its own restore comes first (the bank is mapped
        for the pass anyway): the last layer of a training pass never leaves the device.
        """
        slots = t.group.residency
        if slots is self.kept:
            t.advance(slots.offload_call)  # nothing leaves the device
            return
        self._queue_held_copy_out()
        nxt = step(t.who, t.state, "offload:held")  # refused before anything is recorded
        b = self.backend
        t.fwd_done = b.record_event(b.new_event())
        t.state = nxt
        self._held = t
        if not slots.holds_newest:
            self._queue_held_copy_out()

    def _queue_held_copy_out(self) -> None:
        """Queue the held ticket's copy out (if one is held): something else comes first."""
        t = self._held
        if t is None:
            return
        g, slots = t.group, t.group.residency
        nxt = step(t.who, t.state, slots.offload_call)
        b = self.backend
        if t.stash is None:  # (a copy out that failed before took it already)
            t.stash = g.take_stash()
        s = self.d2h_stream
        try:
            slots.copy_out(t, s)
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

    def find(self, g: OffloadGroup, microbatch: int) -> Ticket[OffloadGroup] | None:
        """The ticket of ``g``'s forward for ``microbatch`` if it is still in flight."""
        return self._pending.get((g.index, microbatch))

    def ticket(self, g: OffloadGroup, microbatch: int) -> Ticket[OffloadGroup]:
        self._check_open("backward")
        t = self._pending.get((g.index, microbatch))
        if t is None:
            raise StateError(f"offload group {g.name}: backward for microbatch {microbatch} "
                             "before its forward (nothing was offloaded for it)")
        return t

    def restore(self, t: Ticket[OffloadGroup]) -> None:
        """Start bringing ``t``'s activations back into the slot (may run ahead: look-ahead)."""
        self._check_open("restore")
        if t.state is State.RESTORING or t.state is State.RESTORED:
            return
        held = t.state is State.HELD
        if held or t.group.residency.still_holds(t):
            # Its backward came before anything rewrote its slot: nothing to copy in (and,
            # when it was held, nothing was copied out either).
            nxt = step(t.who, t.state, "restore")
            if held and self._held is not t:  # never: a held ticket is the engine's newest
                raise StateError(f"{t.who()}: held, but not the engine's newest forward")
            t.group.residency.keep_in_place(t)
            if held:
                self._held = None
            # The backward waits for the forward that wrote the slot (the same stream in
            # both adapters, but nothing here relies on that).
            t.restore_done, t.in_place = t.fwd_done, True
            t.state = nxt
            self.stats["held_bytes" if held else "kept_in_place_bytes"] += t.group.host_bytes
            return
        self._queue_held_copy_out()  # its copy may go into the held ticket's bank or pages
        nxt = step(t.who, t.state, "restore")  # refused here before anything is queued
        t.group.residency.restore(t)
        t.state = nxt

    def restore_ahead(self, t: Ticket[OffloadGroup]) -> bool:
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

    def wait_restored(self, t: Ticket[OffloadGroup]) -> None:
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
        t.advance("wait_restored")
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

    def _retire(self, t: Ticket[OffloadGroup], call: str) -> OffloadGroup:
        """``t`` ends by ``call``: it leaves the tickets in flight; returns its group."""
        t.advance(call)
        g = t.group
        del self._pending[(g.index, t.microbatch)]
        return g

    def consumed(self, t: Ticket[OffloadGroup]) -> None:
        """After the backward replay read the slot: free the bank/slot and the stash."""
        g = self._retire(t, "consumed")
        if not g.offloads:
            return
        if t.stash is not None:  # None: it was held until its backward, never copied out
            # (restored in place: the copy out was the host buffer's last use)
            g.give_back_stash(t.stash, t.d2h_done if t.in_place else t.restore_done)
            t.stash = None
        self._free_slot(g, backward=True)

    def forget(self, t: Ticket[OffloadGroup]) -> None:
        """A forward replay that no backward will follow (evaluation): drop its ticket.

        The slot is free again once the forward is done (remap: released after it).
        """
        g = self._retire(t, "forget")
        if g.offloads:
            if t.stash is not None:  # an after_forward that failed part way: a copy may be queued
                b = self.backend
                g.give_back_stash(t.stash, b.record_event(b.new_event(), self.d2h_stream))
                t.stash = None
            self._free_slot(g, backward=False)

    def _free_slot(self, g: OffloadGroup, backward: bool, replayed: bool = True) -> None:
        """The slot's last user so far is queued: the residency lets it go after that
        (``replayed`` False: a backward that held the slot but never ran)."""
        g.residency.free_after_queued(g, backward, replayed)

    # -- inspection ----------------------------------------------------------------------

    def _checksums(self, g: OffloadGroup) -> list[int]:
        self.backend.synchronize()
        return [int(v.contiguous().view(torch.uint8).to(torch.int64).sum()) for v in g.views]

    def in_flight(self) -> list[Ticket[OffloadGroup]]:
        return list(self._pending.values())

    def wait_idle(self) -> None:
        """Wait for queued driver work (remap) and copies; for tests and teardown.

        Raises:
            DriverError: an unmap on the driver worker failed since the last wait_idle.
        """
        try:
            if not self.closed:
                self._queue_held_copy_out()
                self.residency.drain()
        finally:
            self.backend.synchronize()

    def abandon(self, t: Ticket[OffloadGroup]) -> None:
        """``t``'s backward will never run: give back its host buffer and slot, in any state.

        Copies already queued finish first (their events order the reuse), so nothing is
        freed under a copy or a replay.
        """
        try:
            self._abandon(t)
        finally:
            if not self._pending and not self.closed:
                self.residency.nothing_in_flight()

    def _abandon(self, t: Ticket[OffloadGroup]) -> None:
        if t.state is State.READY:  # a forward and nothing after it: exactly a forget
            self.forget(t)
            return
        if t.state is State.HELD:  # still in its slot, nothing queued for it (or a copy out that failed)
            if self._held is t:
                self._held = None
            g = self._retire(t, "abandon")
            if t.stash is not None:
                b = self.backend
                g.give_back_stash(t.stash, b.record_event(b.new_event(), self.d2h_stream))
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
            g.give_back_stash(t.stash, t.d2h_done if t.in_place else t.restore_done or t.d2h_done)
            t.stash = None
        slots.abandon(g, t, prev)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise StateError(f"offload engine: {what} after close(); the slots and buffers are "
                             "gone, build a new engine (or GraphedLayers)")

    def close(self) -> None:
        """Release every slot, bank and buffer this engine made (after :meth:`wait_idle`).

        Safe to call again; any use afterwards is a StateError naming close().
        """
        if self.closed:
            return
        try:
            self.wait_idle()
        except Exception as e:  # a failed unmap: close() still releases what the ledger holds
            failed: Exception | None = e
        else:
            failed = None
        self.closed = True
        self.residency.close()
        self.kept.close()
        for g in self.groups:
            g.release_memory()
        self._pending.clear()
        # Streams may own threads (the cpu backend's do): let them go with their last user.
        self.d2h_stream = self.h2d_stream = None
        if failed is not None:
            raise failed
