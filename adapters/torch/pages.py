"""The graphs' pool of a :class:`~graphslot.adapters.torch.GraphedLayers` stack on pages
of graphslot's own (``share_pool_pages=True``): :class:`PoolPages`. Imports nothing of
the package.

A framework's graph pool keeps every segment its captures made, for as long as the graphs
live, and the order in which the captures asked for memory leaves parts of those segments
that no block fills at once. Here the pool is a :class:`~graphslot.paged.PagedPool` over a
graphslot VA region instead: the build records when each block the captures hand out is
live (:meth:`~graphslot.regions.RegionGraph.recording`), and pages of the pool that are
never live at the same time are then backed by one physical page each
(:meth:`~graphslot.paged.PagedPool.share`), so the pool holds about what its blocks need at
their highest, whatever the allocator's order left.

That is safe while the graphs replay in the order they were captured, every layer's
forward and then every layer's backward from the top: that is what the lifetimes say. A
step that leaves it (a second microbatch's forward before the first one's backward) gets
every page its own memory back first, with the bytes every page holds then
(:meth:`~graphslot.paged.PagedPool.unshare`), and a warning; the stack then runs on a pool
as large as the captures made it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

from graphslot.backend import Backend, align_up
from graphslot.errors import GraphslotError
from graphslot.paged import PagedPool, PoolState
from graphslot.regions import RegionGraph
from graphslot.sizes import format_bytes

__all__ = ["PoolPages"]

#: the least room mapped ahead of a capture; then twice the most any capture took
ROOM_BYTES = 256 << 20
#: device memory a capture's room leaves free for everyone else
SPARE_BYTES = 1 << 30

#: pools whose bytes tensors still held when their stack closed (a ``.grad`` that is a
#: pool buffer, say): closed again at the next stack's teardown
_KEPT: list[PagedPool] = []


class PoolPages:
    """One stack's graphs' pool on shared pages (see the module docs).

    Args:
        backend: the stack's backend; its graphs must draw pools from regions.
        room_bytes: what one capture may take, as far as the caller can tell (what the
            largest layer's forward saves, say): the room mapped ahead of the first.

    Raises:
        UsageError: the backend's graphs cannot draw their pool from a region
            (:class:`~graphslot.paged.PagedPool` says so).
    """

    def __init__(self, backend: Backend, room_bytes: int = 0) -> None:
        self._backend = backend
        _close_kept()
        total = backend.mem_info()[1]
        # (a worker of the pool's own: a pool kept past its stack's close must still reach
        # one, after the stack's engine closed its own)
        self.pool = PagedPool(backend, align_up(total, backend.granularity))
        #: every graph made in the pool (each released before the pool closes)
        self.graphs: list[RegionGraph] = []
        self._grown = max(0, room_bytes) // 2  # the most one capture took (or may take)
        self._last: tuple[str, int] | None = None  # the last replay: ("fwd" | "bwd", graph index)
        #: what the sharing saves, once shared: the pool's pages before, and after
        self.pages_bytes: tuple[int, int] | None = None

    @property
    def shared(self) -> bool:
        return self.pool.state is PoolState.SHARED

    def new_graph(self) -> RegionGraph:
        g = self._backend.new_graph(share_pool_with=self.pool.graph)
        assert isinstance(g, RegionGraph)  # (a region graph's pool is shared by region graphs)
        self.graphs.append(g)
        return g

    @contextlib.contextmanager
    def room(self) -> Iterator[None]:
        """Around a capture, or an allocation into the pool that is used at once: the
        pool mapped ahead by twice what a capture took at most (or ``room_bytes`` before
        the first; at least :data:`ROOM_BYTES`, leaving :data:`SPARE_BYTES` of the device
        free), so the capture's nodes find their addresses mapped (on cpu it runs the
        work in them). What the build maps beyond the pool's blocks goes when it shares
        them. A capture that takes more than its room fails the build: on cpu at the
        first byte past it, on cuda where a copy node's address is not mapped."""
        free = max(0, self._backend.mem_info()[0] - SPARE_BYTES)
        extra = min(max(ROOM_BYTES, 2 * self._grown), free)
        before = self.pool.used_bytes
        self.pool.grow(extra=extra)
        yield
        self._grown = max(self._grown, self.pool.used_bytes - before)
        self.pool.grow()

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Around the build (every capture and every buffer given back to the pool): the
        pool's blocks recorded, and once the build is done, its pages shared by them."""
        with self.pool.graph.recording() as blocks:
            yield
        self.pool.grow()
        # (before: the pool's bytes up to its high-water mark, as a plain pool holds them)
        before = align_up(self.pool.used_bytes, self._backend.granularity)
        self.pool.share(blocks)
        self.pages_bytes = (before, self.pool.mapped_bytes)

    def replaying(self, kind: str, index: int, last_index: int, owed: bool) -> None:
        """Before graph ``index``'s ``kind`` replay (``"fwd"`` or ``"bwd"``; ``last_index``
        the stack's last graph; ``owed``: a backward is still owed for an earlier
        forward): where it leaves the order the pages were shared for, every page gets its
        own memory first."""
        if not self.shared:
            return
        last = self._last
        if kind == "fwd":
            fits = last == ("fwd", index - 1) if index else not owed
        else:
            fits = last == ("bwd", index + 1) or (index == last_index and last == ("fwd", index))
        if not fits:
            self.unshare(f"graph {index}'s {'forward' if kind == 'fwd' else 'backward'} "
                         f"replays after {_said(last)}")
        self._last = (kind, index)

    def unshare(self, why: str) -> None:
        """Every page its own memory again, with what it holds now; and a warning."""
        shared = self.pool.mapped_bytes
        self.pool.unshare(keep_all=True)
        warnings.warn(
            f"GraphedLayers (share_pool_pages=True): {why}, out of the order the graphs were "
            f"captured in, for which pages of their pool share memory; every page has its own "
            f"memory again ({format_bytes(shared)} -> {format_bytes(self.pool.mapped_bytes)}) "
            "and stays so. Run each microbatch's backward before the next forward to keep "
            "the pages shared", stacklevel=5)

    def close(self) -> None:
        """Release the graphs and the pool; a pool whose bytes tensors still hold (a
        ``.grad`` that is a pool buffer) stays until a later stack's close finds them
        gone."""
        for g in self.graphs:
            g.release_pool()
        self.graphs = []
        if self.pool.close():
            _KEPT.append(self.pool)
        else:
            _close_kept()


def _close_kept() -> None:
    """Close the kept pools whose bytes no tensor holds any longer (a failure keeps the
    pool for the next try: it is another stack's, not the caller's)."""
    for p in list(_KEPT):
        try:
            if p.state is PoolState.CLOSED or not p.close():
                _KEPT.remove(p)
        except GraphslotError:
            pass


def _said(last: tuple[str, int] | None) -> str:
    if last is None:
        return "the build"
    return f"graph {last[1]}'s {'forward' if last[0] == 'fwd' else 'backward'}"
