"""One forward pass through a group (:class:`Ticket`) and where its activations wait
for its backward (:class:`Stash`). Imports only :mod:`.states`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from .states import State, step


class Named(Protocol):
    """What a ticket needs of its group here: a name for its errors. (The group's module
    sits above this one; who holds a ticket says which group type it carries.)"""

    @property
    def name(self) -> str: ...


G = TypeVar("G", bound=Named, covariant=True)


@dataclass(eq=False)
class Stash:
    """Where one forward pass's activations wait for backward: host and device parts."""

    host: Any  # pinned host bytes for offloaded tensors (or None)
    device: Any  # device bytes for tensors kept on the device (or None)
    free_after: Any = None  # event after which the buffers may be reused
    #: per section of its group's slot, (slot view, stash view) byte pairs (made at first use)
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None


@dataclass(eq=False)
class Ticket(Generic[G]):
    """One forward pass through a group, from offload to the backward that consumes it."""

    group: G
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

    def advance(self, call: str) -> None:
        """Take the transition ``call`` (a StateError, naming the ticket, if refused)."""
        self.state = step(self.who, self.state, call)

    def who(self) -> str:
        return f"{self.group.name} (microbatch {self.microbatch})"
