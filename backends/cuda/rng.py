"""A random stream of CUDA graphs' own: a graph-safe generator state beside the default,
which takes the default's seed and offset to draw again what a graph drew from it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from graphslot.backend import DeviceGraph, RngStream


class CudaRngStream(RngStream):
    """A clone of the device's default generator state with a seed of its own, attached to
    graphs as an extra generator state (each replay reads its offset and moves it on)."""

    def __init__(self, device_index: int, seed: int) -> None:
        self._gen = torch.cuda.default_generators[device_index]
        self._state = self._gen.clone_state()
        self._state.manual_seed(seed)

    def attach(self, graph: DeviceGraph) -> None:
        graph.graph.register_generator_state(self._state)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        was = self._gen.graphsafe_get_state()
        self._gen.graphsafe_set_state(self._state)
        try:
            yield
        finally:
            self._gen.graphsafe_set_state(was)

    def seek(self, position: Any) -> None:
        self._state.set_state(position)

    def framework_position(self) -> Any:
        # (seed and philox offset: a replay reads the default state's and moves it on)
        return self._gen.get_state()
