"""The offload states: :class:`Mode`, :class:`State` and the one transition table every
group and ticket steps through (:data:`TRANSITIONS`, :func:`step`). Imports nothing of
the package."""

from __future__ import annotations

import enum
from typing import Callable

from ..errors import StateError

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


def step(owner: str | Callable[[], str], state: State, call: str) -> State:
    """The state after ``call`` in ``state``, or a StateError naming ``owner`` (a string,
    or a callable that makes it: the hot path formats nothing unless it fails)."""
    nxt = TRANSITIONS.get((state, call))
    if nxt is None:
        allowed = sorted(c for (s, c) in TRANSITIONS if s is state)
        who = owner if isinstance(owner, str) else owner()
        raise StateError(f"{who}: cannot {call.split(':')[0]} in state {state.value} "
                         f"(allowed here: {', '.join(allowed) or 'nothing'})")
    return nxt
