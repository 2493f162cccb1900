"""Device graphs and their random streams, as every backend makes them.

:class:`DeviceGraph` is a captured sequence of device work (made by
:meth:`Backend.new_graph <graphslot.backend.Backend.new_graph>`); :class:`RngStream` a
random stream graphs draw from (made by
:meth:`Backend.new_rng_stream <graphslot.backend.Backend.new_rng_stream>`); :func:`no_gc`
the garbage-collector guard captures run under.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, ContextManager, Iterator

__all__ = ["DeviceGraph", "RngStream", "no_gc"]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Collect garbage now, then keep the collector off until the block ends.

    Device graph captures run inside it: a reference cycle that holds device tensors (a
    saved-tensor hook that returns its argument makes one) must not be freed mid-capture,
    where freeing touches streams the capture does not own and invalidates it.
    """
    import gc

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class DeviceGraph(abc.ABC):
    """A captured sequence of device work bound to the addresses it touched.

    Replay reads and writes exactly the addresses seen at capture; whatever physical
    memory is mapped there at replay time is what the graph sees.
    """

    #: Whether capture also runs the work it records (the cpu backend's graphs do), so
    #: what it touches must be mapped, and what it writes is written, while capturing. A
    #: vendor whose capture only records says False; True is the safe answer.
    executes_during_capture: bool = True

    @abc.abstractmethod
    def capture(self, stream: Any = None) -> ContextManager[None]:
        """Context manager: work issued inside is recorded instead of (or as well as) run."""

    @abc.abstractmethod
    def replay(self) -> None:
        """Run the recorded work again on the current stream."""

    @property
    def pool_bytes(self) -> int | None:
        """Bytes reserved by this graph's private memory pool (shared pools count fully)."""
        return None


class RngStream(abc.ABC):
    """A random stream of graphs' own, which can draw again what another graph drew.

    A recomputed layer's backward graph runs its forward again: its random ops (dropout)
    must draw what its forward graph drew at that microbatch's replay, from the
    framework's default generator as in eager, while the next forward draws fresh numbers.
    Graphs attached to the stream draw from it what their captures drew under
    :meth:`drawing`; :meth:`framework_position` (before the forward's replay) and
    :meth:`seek` (before the backward's) point it where the forward drew. Made by
    :meth:`Backend.new_rng_stream`.
    """

    @abc.abstractmethod
    def attach(self, graph: DeviceGraph) -> None:
        """Before ``graph``'s capture: its replays may draw from this stream."""

    @abc.abstractmethod
    def drawing(self) -> ContextManager[None]:
        """Inside the capture of an attached graph: the random ops issued inside draw from
        this stream, at capture and at every replay."""

    @abc.abstractmethod
    def seek(self, position: Any) -> None:
        """Move to ``position`` (a :meth:`framework_position`): the next replay draws what
        was drawn from there before."""

    @abc.abstractmethod
    def framework_position(self) -> Any:
        """Where the framework's default generator is now (outside capture), as a
        position for :meth:`seek`: a graph replayed next that draws from the default
        generator draws from there, and this stream, sought there, draws the same."""
