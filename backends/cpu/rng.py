"""A random stream of cpu graphs' own: the host generator's state, swapped in around the
random ops captured under it, at capture and at every replay."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from graphslot.backend import DeviceGraph, RngStream

if TYPE_CHECKING:
    from .backend import CpuBackend


class CpuRngStream(RngStream):
    """See the module docstring; a cpu graph replays host steps in place, so the swap in
    and out are two of them."""

    def __init__(self, backend: CpuBackend, seed: int) -> None:
        self._backend = backend
        g = torch.Generator()
        g.manual_seed(seed)
        self._state = g.get_state()

    def attach(self, graph: DeviceGraph) -> None:
        pass  # (a cpu graph's host steps need no registration)

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        graph = self._backend._capturing_graph()
        held: list[torch.Tensor] = []

        def swap_in() -> None:
            held.append(torch.get_rng_state())
            torch.set_rng_state(self._state)

        def swap_out() -> None:
            self._state = torch.get_rng_state()
            torch.set_rng_state(held.pop())

        graph.host_step(swap_in)
        try:
            yield
        finally:
            graph.host_step(swap_out)

    def seek(self, position: Any) -> None:
        self._state = position.clone()

    def framework_position(self) -> Any:
        # (a cpu graph replays on the calling thread: nothing queued draws before it)
        return torch.get_rng_state()
