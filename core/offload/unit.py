"""The offload engine's public face for adapters: :class:`OffloadUnit`, one graphed unit
(a layer, or layers joined into one graph) with its policy, and the calls an adapter makes
around that unit's capture and replays, in the order the engine needs them. Imports the
engine and what it hands out; nothing of the package imports this module.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any, Callable, Iterable, Iterator, Union

import torch

from ..errors import UsageError
from .engine import OffloadEngine
from .group import OffloadGroup
from .saved import SavedLayout, never_offloaded, recording_saved_tensors, state_storages
from .states import State
from .tickets import Ticket

#: The policies, the same strings as :data:`graphslot.budget.KEEP`, ``OFFLOAD`` and ``RECOMPUTE``.
KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
POLICIES = (KEEP, OFFLOAD, RECOMPUTE)

#: What a forward replay prefetches for: a unit, or a call made once the forward is admitted
#: that returns one (or None).
Prefetch = Union["OffloadUnit", Callable[[], Union["OffloadUnit", None]], None]


def ping_pong_banks(offloads: Iterable[bool]) -> list[int]:
    """The bank of each unit, given in backward order: the units that offload alternate
    between banks 0 and 1, so one unit's reload fills a bank while the graph before it in
    the backward reads the other (a unit that keeps its activations gets the bank the next
    offloading one will use, and uses none)."""
    banks, seen = [], 0
    for offloads_ in offloads:
        banks.append(seen % 2)
        seen += bool(offloads_)
    return banks


def leaves_on_device(modules: Iterable[Any], device_type: str) -> Callable[[torch.Tensor], bool]:
    """The rule for what a unit's capture never moves into its slot, for ``modules``.

    Args:
        modules: the modules whose parameters and buffers (and views of them) stay put.
        device_type: tensors not on a device of this type (host-side RNG seeds, say) and
            empty ones stay put too: they cost the device nothing.

    Returns:
        A predicate, true for a saved tensor that stays where it is.
    """
    state = state_storages(modules)
    return lambda t: never_offloaded(t, device_type, state)


class OffloadUnit:
    """One graphed unit's saved activations, for an adapter: capture, then replays.

    The unit makes its offload group in ``engine``. An adapter lays it out (:meth:`discovering`
    or :meth:`adopt`, then :meth:`allocate`), captures its forward graph inside
    :meth:`capture_forward` and its backward graph after it, calls :meth:`finish_capture`,
    and then runs every forward replay inside :meth:`forward` and every backward replay
    inside :meth:`backward`. Forwards whose backward will never come are given back with
    :meth:`abandon`.

    Args:
        engine: the :class:`OffloadEngine` that schedules its copies.
        name: the unit's name in messages and reports.
        policy: ``"offload"`` (its saved activations go to the host between forward and
            backward, in an engine that offloads), ``"keep"`` (they stay on the device, in
            the graph's own memory) or ``"recompute"`` (its forward saves only its input,
            which stays on the device unless ``offload_input``).
        offload_input: with ``"recompute"``, send the saved input to the host as well.

    Raises:
        UsageError: an unknown policy, or ``offload_input`` with another policy.
    """

    __slots__ = ("engine", "policy", "_group", "_kept", "_keeping")

    def __init__(self, engine: OffloadEngine, name: str, policy: str = OFFLOAD, *,
                 offload_input: bool = False) -> None:
        if policy not in POLICIES:
            raise UsageError(f"unit {name}: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if offload_input and policy != RECOMPUTE:
            raise UsageError(f"unit {name}: offload_input is for recomputed units, not {policy!r}")
        self.engine = engine
        self.policy = policy
        self._group = engine.group(name, offload=policy == OFFLOAD or offload_input)
        #: keep path of the forward capture: storage pointer -> (pointer, bytes) its
        #: backward graph reads in the graph's own memory
        self._kept: dict[int, tuple[int, int]] | None = None
        #: during a forward capture that keeps (see :meth:`keep_also`)
        self._keeping: dict[int, tuple[int, int]] | None = None

    def __repr__(self) -> str:
        return f"<OffloadUnit {self.name} {self.policy}>"

    @property
    def name(self) -> str:
        return self._group.name

    @property
    def group(self) -> OffloadGroup:
        """The engine's group behind this unit, for inspection (tests, reports); adapters
        drive the unit, never the group."""
        return self._group

    @property
    def wants_offload(self) -> bool:
        """Whether it is to put what it saves in a slot (policy and engine allow it)."""
        return self._group.wants_offload

    @property
    def offloads(self) -> bool:
        """Whether its activations leave the device between forward and backward (once
        allocated: it laid out something to offload)."""
        return self._group.offloads

    @property
    def ready(self) -> bool:
        """Whether its capture is finished and it may replay."""
        return self._group.state is State.READY

    @property
    def saved_tensors(self) -> int:
        """How many tensors its forward saves into its slot."""
        return len(self._group.specs)

    @property
    def slot_bytes(self) -> int:
        return self._group.slot_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of its slot that go to the host at each forward."""
        return self._group.host_bytes

    # -- layout and capture ------------------------------------------------------------

    @contextlib.contextmanager
    def discovering(self, leave: Callable[[torch.Tensor], bool]) -> Iterator[None]:
        """Run a forward that no backward follows (under a throw-away capture, say) and
        record what it saves, except what ``leave`` says stays put (see
        :func:`leaves_on_device`); an earlier discovery is forgotten."""
        g = self._group
        g.restart_discovery()

        def discover(t: torch.Tensor) -> None:
            if not leave(t):
                g.discover(t)

        with recording_saved_tensors(discover):  # autograd keeps none of them
            yield

    def adopt(self, layout: SavedLayout) -> None:
        """Take a layout recorded elsewhere, in a framework's own forward (several units,
        one per graph of the same module, may adopt one layout)."""
        if not layout.recorded:
            raise UsageError(f"unit {self.name}: {layout.name} recorded no forward to lay out")
        self._group.adopt(layout.specs)

    def allocate(self, bank: int = 0) -> None:
        """Outside capture: place the slot, in ping-pong bank ``bank`` (0 or 1)."""
        self._group.allocate(bank_index=bank)

    @contextlib.contextmanager
    def capture_forward(self, leave: Callable[[torch.Tensor], bool]) -> Iterator[None]:
        """Around the forward's capture: each tensor it saves, except what ``leave`` says
        stays put, is copied into the slot and the slot's view saved instead (a unit that
        keeps its activations notes the graph memory its backward will read). The backward
        graph is captured next, reading what was saved (its unpacks teach it the slot's
        sections); then :meth:`finish_capture`."""
        g = self._group
        g.begin_capture()
        if g.wants_offload:
            def pack(t: torch.Tensor) -> torch.Tensor:
                # (what stays put goes back detached: a node's own output, an empty one say,
                # would otherwise hold the node, as in note below)
                return t.detach() if leave(t) else g.save_tensor(t)

            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, g.load_tensor):
                    yield
            finally:
                g.forward_captured()
        else:
            kept: dict[int, tuple[int, int]] = {}  # storage pointer -> (pointer, bytes)

            def note(t: torch.Tensor) -> torch.Tensor:
                if not leave(t):
                    self.keep_also(t)  # what the backward graph will read from the graph's memory
                return t.detach()  # the same memory, no grad_fn: no cycle (see recording_saved_tensors)

            self._keeping = kept
            try:
                with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
                    yield
            finally:
                self._keeping = None
            self._kept = kept

    def slot_snapshot(self) -> list[torch.Tensor | None]:
        """Outside capture, after its forward capture on a backend whose capture runs the
        work (cpu): a host copy of what its slot holds, for :meth:`restore_slot` before its
        backward graph is captured. By then its bank may hold a later layer's bytes, which
        kernels would read as their own: max pooling's backward trusts its indices (a
        write out of bounds), and LU solves check their pivots. Empty where nothing is in
        a slot."""
        return self._group.slot_snapshot() if self._group.wants_offload else []

    def restore_slot(self, copies: list[torch.Tensor | None]) -> None:
        """Outside capture: write back what :meth:`slot_snapshot` copied."""
        self._group.restore_slot(copies)

    def keep_also(self, t: torch.Tensor) -> None:
        """During :meth:`capture_forward` of a unit that keeps its activations on the
        device: ``t``'s memory is read by the backward graph too, though no autograd hook
        sees it saved (a tensor a selective recompute holds, say)."""
        if self._keeping is None:
            raise UsageError(f"unit {self.name}: keep_also outside the forward capture of a "
                             "unit that keeps its activations on the device")
        s = t.untyped_storage()
        self._keeping.setdefault(s.data_ptr(), (s.data_ptr(), s.nbytes()))

    def finish_capture(self) -> None:
        """The backward graph is captured (or there is none): the unit may replay."""
        g = self._group
        g.finish_capture()
        kept, self._kept = self._kept, None
        if kept is not None:
            b = self.engine.backend
            g.keep(b.alias_bytes(ptr, n) for ptr, n in kept.values())

    # -- replay ------------------------------------------------------------------------

    def forward(self, microbatch: int, *, training: bool = True, prefetch: Prefetch = None,
                release_on_error: bool = False) -> _ForwardReplay:
        """Around one forward replay of microbatch ``microbatch``: makes the slot writable
        (moving out what another microbatch keeps in the graph's memory), and after the
        replay holds the activations for the backward (``training``) or gives the slot
        back (no backward follows).

        Args:
            microbatch: the key its backward names again (one forward per key in flight).
            training: whether a backward follows.
            prefetch: the unit whose forward comes next, whose slot is made writable ahead
                (remap: mapped), or a call made once this forward is admitted that returns
                it (or None).
            release_on_error: a replay that raises gives the slot back at once (else the
                forward stays in flight until :meth:`abandon`).
        """
        return _ForwardReplay(self, microbatch, training, prefetch, release_on_error)

    def prefetch(self) -> None:
        """This unit's forward comes next: start making its slot writable (remap: map it)."""
        self.engine.prefetch_forward(self._group)

    def backward(self, microbatch: int, *, ahead: OffloadUnit | None = None,
                 ahead_microbatch: int | None = None) -> _BackwardReplay:
        """Around the backward replay of microbatch ``microbatch``: brings its activations
        back into the slot (or waits for a restore started ahead), and after the replay
        frees the slot and host buffer, then starts restoring ``ahead``'s activations (the
        unit whose backward comes next) under this replay, if it has a forward of that
        microbatch in flight.

        Args:
            microbatch: the key its forward was given.
            ahead: the unit to restore ahead, or None.
            ahead_microbatch: ``ahead``'s key for the forward to restore, where units count
                their forwards apart (default: ``microbatch``).

        Raises:
            StateError: no forward of ``microbatch`` awaits this backward.
        """
        return _BackwardReplay(self, microbatch, ahead,
                               microbatch if ahead_microbatch is None else ahead_microbatch)

    def abandon(self, microbatch: int) -> None:
        """Microbatch ``microbatch``'s backward will never run: give back what it holds
        (nothing if none is in flight, or the engine is closed)."""
        eng = self.engine
        if not eng.closed:
            t = eng.find(self._group, microbatch)
            if t is not None:
                eng.abandon(t)


class _ForwardReplay:
    """:meth:`OffloadUnit.forward`'s context manager."""

    __slots__ = ("unit", "microbatch", "training", "prefetch", "release_on_error", "ticket")

    def __init__(self, unit: OffloadUnit, microbatch: int, training: bool, prefetch: Prefetch,
                 release_on_error: bool) -> None:
        self.unit, self.microbatch, self.training = unit, microbatch, training
        self.prefetch, self.release_on_error = prefetch, release_on_error
        self.ticket: Ticket[Any] | None = None

    def __enter__(self) -> None:
        unit = self.unit
        self.ticket = unit.engine.before_forward(unit._group, self.microbatch)
        nxt = self.prefetch
        if nxt is not None and not isinstance(nxt, OffloadUnit):
            nxt = nxt()
        if nxt is not None:
            nxt.prefetch()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        eng, t = self.unit.engine, self.ticket
        assert t is not None
        if kind is not None:
            if self.release_on_error:
                eng.forget(t)  # no backward follows a replay that failed: the slot goes back
            return
        if self.training:
            eng.after_forward(t)
        else:
            eng.forget(t)  # evaluation: no backward will read the slot


class _BackwardReplay:
    """:meth:`OffloadUnit.backward`'s context manager."""

    __slots__ = ("unit", "microbatch", "ahead", "ahead_microbatch", "ticket")

    def __init__(self, unit: OffloadUnit, microbatch: int, ahead: OffloadUnit | None,
                 ahead_microbatch: int) -> None:
        self.unit, self.microbatch, self.ahead = unit, microbatch, ahead
        self.ahead_microbatch = ahead_microbatch
        self.ticket: Ticket[Any] | None = None

    def __enter__(self) -> None:
        unit = self.unit
        eng = unit.engine
        # (brings back this microbatch's activations if another's graphs ran since)
        t = self.ticket = eng.ticket(unit._group, self.microbatch)
        eng.wait_restored(t)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            return
        t = self.ticket
        assert t is not None
        self.unit.engine.consumed(t)
        # Look-ahead: the next offloaded unit's reload runs under this backward graph.
        # Queued after the replay: its copies wait for what this graph records as it goes
        # (the sections it is done with), so the replay must be launched first.
        ahead = self.ahead
        if ahead is not None:
            eng = ahead.engine
            nxt = eng.find(ahead._group, self.ahead_microbatch)
            if nxt is not None:
                eng.restore_ahead(nxt)
