"""The region-graph interface: device graphs whose private pool is a graphslot VA region.

A backend that can draw a graph's private pool from a range of a graphslot reservation
declares ``Capabilities.region_graphs``; its ``new_graph(pool_region=(va, size))`` (and
``new_graph(share_pool_with=g)`` for such a ``g``) returns a :class:`RegionGraph`.
:mod:`graphslot.arena` and :mod:`graphslot.adapters.te` use region graphs only through
this interface, so neither asks a backend its name:

* :attr:`RegionGraph.pool_region`, :attr:`RegionGraph.pool_used_bytes` and
  :meth:`RegionGraph.release_pool`: where the pool lies, its high-water mark and its end;
* ``executes_during_capture`` (declared on every :class:`~graphslot.backend.DeviceGraph`):
  whether the region must be mapped while capturing (the cpu backend runs the work as it
  records it; cuda launches nothing);
* :attr:`RegionGraph.pool_handle` and :meth:`RegionGraph.lend`: what other code that
  captures its own graphs into the pool (TransformerEngine) is given, and the routing of
  the pool's allocations into the region while that code runs;
* ``Backend.ordinary_capture_kwargs()``: the ``capture()`` arguments under which an
  ordinary graph captures as region graphs do, for fair comparisons;
* :meth:`RegionGraph.recording`: the blocks the pool hands out and when each is live,
  for :meth:`graphslot.paged.PagedPool.share`.

This module belongs to the interface layer: it imports only :mod:`graphslot.backend` and
:mod:`graphslot.errors`.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, ContextManager

from .backend import DeviceGraph
from .errors import UsageError

__all__ = ["Block", "RegionGraph"]

#: one block a pool handed out: ``(offset, nbytes, start, end)``, live over the positions
#: ``[start, end)`` of a sequence of the pool's events (``end`` None: for good)
Block = tuple[int, int, int, int | None]


class RegionGraph(DeviceGraph):
    """A device graph whose private pool is ``[va, va + size)`` of a graphslot reservation.

    The caller reserves the region and maps physical memory behind it (see
    :class:`graphslot.arena.SharedArena`); graphs made with ``share_pool_with`` share it.
    """

    @property
    @abc.abstractmethod
    def pool_region(self) -> tuple[int, int]:
        """``(va, size)`` of the region the pool is drawn from."""

    @property
    @abc.abstractmethod
    def pool_used_bytes(self) -> int:
        """The pool's high-water mark in bytes: the physical memory its graphs need."""

    @abc.abstractmethod
    def release_pool(self) -> int:
        """Drop this graph; the pool's last graph lets its memory go.

        Replay is refused afterwards; safe to call again.

        Returns:
            The region bytes that live tensors still reference (0: the region may be
            unmapped and freed).
        """

    @abc.abstractmethod
    def live_ranges(self) -> list[tuple[int, int]]:
        """``(offset, size)`` in the region of every block the pool still hands out (a
        tensor holds it, or a stream may still use it); the rest of the pool is free."""

    def recording(self) -> ContextManager[list[Block]]:
        """Context manager: the blocks the pool hands out while it is open, as
        :func:`graphslot.planner.share_pages` and :meth:`graphslot.paged.PagedPool.share`
        take them. It yields a list that is filled when the block ends: ``(offset, nbytes,
        start, end)`` per block, its offset in the region, and the positions of its
        allocation and of its free in one sequence of the pool's events (``end`` None:
        still handed out at the end; a block handed out before recording began starts at
        0). Graphs that share the pool record into one sequence. A block ends when its
        bytes are free for another: after the work of every stream that used it.

        Raises:
            UsageError: the backend cannot record its pools' blocks.
        """
        raise UsageError(f"{type(self).__name__}: this backend's graph pools cannot record "
                         "the blocks they hand out")

    @property
    def pool_handle(self) -> Any:
        """What to give code that captures its own graphs into this pool.

        Returns:
            The framework's pool handle where it has one (cuda: the ``MemPool`` id that
            ``torch.cuda.graph(pool=...)`` takes), else the graph itself, which a caller
            passes to ``backend.new_graph(share_pool_with=...)``.
        """
        return self

    def lend(self) -> ContextManager[None]:
        """Context manager: route the pool's allocations into the region while other code
        captures its own graphs into :attr:`pool_handle` (with the framework's default
        capture stream). A no-op where captures into the handle already draw from the
        region.

        Raises:
            StateError: the pool was released.
        """
        return contextlib.nullcontext()
