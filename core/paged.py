"""A graph pool whose free pages go back to the device between steps.

A framework graph pool (torch's private pool of a CUDA graph, say) keeps every byte its
graphs ever used for as long as the graphs live: their working memory, and the blocks of
buffers that the framework has already let go of. Eager code gives the same memory back
after each step. :class:`PagedPool` closes that gap: the pool is drawn from a graphslot
VA region (a :class:`~graphslot.regions.RegionGraph`'s pool), so its physical pages are
graphslot's to map and unmap, while every address the graphs captured stays valid.

The pool's bytes are kept in *chunks*, each one physical allocation mapped at one offset:

* :meth:`grow` maps a new chunk behind the region's high-water mark, before anything
  runs on the bytes a capture or an allocation added;
* :meth:`split_free` (after captures) asks the pool which blocks are still handed out and
  splits every chunk that holds both such *live* blocks and free bytes, copying the live
  bytes across, so that from then on each chunk is wholly live or wholly free;
* :meth:`release` unmaps and releases the free chunks once the given events completed
  (on the driver worker, so the training thread never waits for the device), and
  :meth:`acquire` maps them again before the next replay. An acquire that comes while a
  release still waits for its events calls the release off: no driver call at all.

After captures, :meth:`share` goes further for a pool whose graphs replay in a known
order: given when each block it handed out is live over one step, pages that are never
live at the same time are backed by one physical page (:func:`graphslot.planner.share_pages`),
which recovers what the allocator's order of allocations left unusable. A shared pool
only replays: :meth:`unshare` gives every page its own memory again before anything
allocates into it.

Live chunks are never unmapped: tensors the framework still hands out keep their bytes
(:meth:`share` refuses blocks that leave any of them out).
The contract is the framework's own between steps: no graph of the pool runs and nothing
reads bytes the pool considers free from the release until the next :meth:`acquire`.

Device neutral: only the checked :class:`~graphslot.backend.Backend` methods and the
region-graph interface are used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from .backend import Allocation, Backend, align_up
from .errors import StateError, UsageError
from .planner import PageSharing, PlanError, merge_intervals, share_pages
from .regions import RegionGraph

__all__ = ["PagedPool", "PoolState"]

MiB = 1 << 20


class PoolState(enum.Enum):
    """Where a :class:`PagedPool`'s free chunks are."""

    MAPPED = "mapped"  #: every chunk mapped: graphs may replay and captures allocate
    RELEASING = "releasing"  #: a release waits for its events; an acquire calls it off
    RELEASED = "released"  #: the free chunks are unmapped; live chunks stay
    SHARED = "shared"  #: pages never live at once share memory: graphs replay, nothing allocates
    CLOSED = "closed"


_TRANSITIONS: dict[PoolState, frozenset[PoolState]] = {
    PoolState.MAPPED: frozenset({PoolState.RELEASING, PoolState.SHARED, PoolState.CLOSED}),
    PoolState.SHARED: frozenset({PoolState.MAPPED, PoolState.CLOSED}),
    PoolState.RELEASING: frozenset({PoolState.MAPPED, PoolState.RELEASED, PoolState.CLOSED}),
    PoolState.RELEASED: frozenset({PoolState.MAPPED, PoolState.CLOSED}),
    PoolState.CLOSED: frozenset(),
}


@dataclass(eq=False)
class _Chunk:
    offset: int
    size: int
    alloc: Allocation | None  #: None while released
    live: bool = False  #: holds a block the pool still hands out: never released

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(eq=False)
class _Shared:
    """A shared pool's mapping: each page of ``[0, size)`` and the physical page behind it."""

    size: int
    sharing: PageSharing
    allocs: list[Allocation]  #: the physical pages, by index
    kept: list[tuple[int, int]]  #: the byte runs of pages under blocks live for good


@dataclass(eq=False)
class _Release:
    """One queued release; an acquire sets ``called_off`` before it unmaps anything."""

    called_off: bool = False


def _is_block(b: Any) -> bool:
    """Whether ``b`` has an integer offset and size (share_pages names what else is wrong)."""
    return (isinstance(b, tuple) and len(b) == 4 and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in b[:2]))


def _runs(ranges: Sequence[tuple[int, int]], granule: int, limit: int) -> list[tuple[int, int]]:
    """The granule-aligned ``(start, end)`` runs covering ``ranges`` (offset, size), merged."""
    return merge_intervals((o // granule * granule, min(limit, align_up(o + n, granule)))
                           for o, n in ranges if n > 0)


def _own_page_each_untouched(sharing: PageSharing) -> PageSharing:
    """``sharing`` with a physical page of its own for each page no block touches.

    A device graph may touch any byte of what its pool used (cuda checks all of it before
    a replay), and a segment's tail that no block of the list covers is still the pool's:
    it keeps memory of its own, as it had, rather than none.
    """
    physical = list(sharing.physical)
    n = sharing.physical_pages
    for page, k in enumerate(physical):
        if k < 0:
            physical[page], n = n, n + 1
    return dataclasses.replace(sharing, physical=tuple(physical), physical_pages=n)


class PagedPool:
    """A graph pool over a reserved VA region whose free pages come and go.

    Args:
        backend: the graphslot backend; its graphs must draw pools from regions.
        capacity: VA bytes to reserve: the most the pool can ever use (VA is cheap;
            physical memory follows what the graphs use).
        worker: the :class:`~graphslot.offload.DriverWorker` that runs the driver calls
            (an offload engine's ``worker``), so they stay on one thread; default: one of
            the pool's own, closed by :meth:`close`.

    Raises:
        UsageError: a capacity that is not a positive int, or a backend without region
            graphs.
    """

    def __init__(self, backend: Backend, capacity: int, *, worker: Any = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise UsageError(f"PagedPool: capacity must be a positive int, got {capacity!r}")
        from .offload import DriverWorker  # (offload imports nothing of this module)

        self._own_worker = worker is None
        worker = DriverWorker(backend) if worker is None else worker
        self._backend = backend
        self._granule = backend.granularity
        self.capacity = align_up(capacity, self._granule)
        self._worker = worker
        self.reservation = backend.reserve(self.capacity)
        try:
            graph = backend.new_graph(pool_region=(self.reservation.va, self.capacity))
            if not isinstance(graph, RegionGraph):
                raise UsageError(f"the {backend.name} backend's graphs do not draw pools from regions")
        except BaseException:
            backend.free(self.reservation)
            if self._own_worker:
                worker.close()
            raise
        #: the pool's owner graph (never captured): its pool handle is the pool
        self.graph: RegionGraph = graph
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        self._state = PoolState.MAPPED
        self._job: _Release | None = None
        self._pending: Future[Any] | None = None
        self._lending = False
        self._shared: _Shared | None = None
        self.counters = {"releases": 0, "called_off": 0, "acquires": 0, "split_chunks": 0,
                         "released_bytes_last": 0, "shares": 0}

    # -- state ----------------------------------------------------------------------------

    @property
    def state(self) -> PoolState:
        return self._state

    def _move(self, to: PoolState) -> None:
        if to not in _TRANSITIONS[self._state]:
            raise StateError(f"paged pool: {self._state.value} -> {to.value} is not a transition")
        self._state = to

    def _check_open(self, what: str) -> None:
        if self._state is PoolState.CLOSED:
            raise StateError(f"paged pool: {what} after close()")

    def _check_mapped(self, what: str) -> None:
        self._check_open(what)
        if self._state is PoolState.SHARED:
            raise StateError(f"paged pool: {what} while shared (pages never live at once "
                             "share memory, so nothing may allocate into it); unshare() first")
        if self._state is not PoolState.MAPPED:
            raise StateError(f"paged pool: {what} while {self._state.value}; acquire() first")

    @property
    def pool_handle(self) -> Any:
        """What a framework captures into (``torch.cuda.graph(pool=...)`` on cuda)."""
        return self.graph.pool_handle

    @property
    def used_bytes(self) -> int:
        """The pool's high-water mark in the region."""
        return self.graph.pool_used_bytes

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes behind the pool now (shared pages once)."""
        if self._shared is not None:
            return sum(a.size for a in self._shared.allocs)
        return sum(c.size for c in self._chunks if c.alloc is not None)

    @property
    def live_bytes(self) -> int:
        """Bytes of the chunks that hold live blocks (as of the last :meth:`split_free`)."""
        return sum(c.size for c in self._chunks if c.live)

    @property
    def free_bytes(self) -> int:
        """Bytes of the chunks a release gives back."""
        return sum(c.size for c in self._chunks if not c.live)

    # -- growing and settling ---------------------------------------------------------------

    @contextlib.contextmanager
    def lend(self) -> Iterator[None]:
        """Route the pool's allocations into its region while other code captures into
        :attr:`pool_handle` (or allocates into it); the pool must be mapped."""
        self._check_mapped("lend()")
        if self._lending:  # nested (an allocation inside a graph's creation): already routed
            yield
            return
        self._lending = True
        try:
            with self.graph.lend():
                yield
        finally:
            self._lending = False

    @contextlib.contextmanager
    def allocating(self, extra: int = 0) -> Iterator[None]:
        """For code that allocates into the pool and runs on what it allocated at once
        (outside a capture): map the pool and ``extra`` bytes beyond its high-water mark,
        route the pool's allocations into the region for the block, and map what the
        block allocated at its end."""
        self.acquire()
        self.grow(extra)
        with self.lend():
            yield
        self.grow()

    def grow(self, extra: int = 0) -> None:
        """Map a chunk from the mapped end to the high-water mark plus ``extra`` bytes,
        before anything runs on bytes the pool handed out since the last call."""
        self._check_mapped("grow()")
        end = self._chunks[-1].end if self._chunks else 0
        want = min(self.capacity, align_up(self.used_bytes + max(0, int(extra)), self._granule))
        if want <= end:
            return
        res, size = self.reservation, want - end
        alloc = self._worker.submit(lambda: self._backend.map_new(res, end, size)).result()
        self._chunks.append(_Chunk(end, size, alloc))

    @contextlib.contextmanager
    def headroom(self, nbytes: int) -> Iterator[None]:
        """Map ``nbytes`` beyond the high-water mark for the block, then keep only what the
        pool handed out in it. For a capture: it runs nothing, but the nodes it records
        may check their addresses (a memory copy's do), so what it allocates must be
        mapped already. Nothing may run on the pool's new bytes inside the block: they
        are mapped anew at its end."""
        self._check_mapped("headroom()")
        self.grow()
        res, end = self.reservation, (self._chunks[-1].end if self._chunks else 0)
        size = min(align_up(max(0, int(nbytes)), self._granule), self.capacity - end)
        room = None
        if size > 0:
            alloc = self._worker.submit(lambda: self._backend.map_new(res, end, size)).result()
            room = _Chunk(end, size, alloc)
            self._chunks.append(room)
        try:
            yield
        except BaseException as e:
            if self.used_bytes > end + size:
                raise StateError(f"paged pool: the capture took {self.used_bytes - end} bytes of the "
                                 f"pool beyond what was there, more than the {size} mapped ahead of "
                                 "it") from e
            raise
        finally:
            if room is not None:
                self._chunks.remove(room)
                self._worker.submit(lambda: self._backend.unmap_release(res, end)).result()
            self.grow()

    def split_free(self) -> None:
        """Split every chunk that holds live blocks and free bytes (copying the live bytes
        over), so each chunk is wholly live or wholly free. Waits for the device; call it
        after captures, with the pool mapped."""
        self._check_mapped("split_free()")
        self.grow()
        live = _runs(self.graph.live_ranges(), self._granule, self.capacity)
        chunks: list[_Chunk] = []
        for c in self._chunks:
            parts = [(max(s, c.offset), min(e, c.end)) for s, e in live if s < c.end and e > c.offset]
            if not parts:
                c.live = False
                chunks.append(c)
            elif parts == [(c.offset, c.end)]:
                c.live = True
                chunks.append(c)
            else:
                chunks.extend(self._split(c, parts))
        self._chunks = chunks

    def _split(self, c: _Chunk, parts: list[tuple[int, int]]) -> list[_Chunk]:
        b, res = self._backend, self.reservation
        b.synchronize()
        kept = [(s, b.alias_bytes(res.va + s, e - s).clone()) for s, e in parts]
        b.synchronize()
        cuts = sorted({c.offset, c.end, *(x for p in parts for x in p)})
        live = {s for s, _ in parts}

        def remap() -> list[_Chunk]:
            b.unmap_release(res, c.offset)
            return [_Chunk(s, e - s, b.map_new(res, s, e - s), s in live)
                    for s, e in zip(cuts, cuts[1:])]

        out: list[_Chunk] = self._worker.submit(remap).result()
        for s, data in kept:
            b.alias_bytes(res.va + s, data.numel()).copy_(data)
        b.synchronize()
        self.counters["split_chunks"] += 1
        return out

    # -- sharing pages ----------------------------------------------------------------------

    def share(self, blocks: Sequence[tuple[int, int, int, int | None]]) -> PageSharing:
        """Back pages of the pool that are never live at the same time with one physical
        page each (after captures; waits for the device).

        Safe where the graphs replay in the order the lifetimes were taken: two pages then
        share memory only as two blocks would that the allocator placed one after the
        other. Bytes of blocks live for good are kept; the rest are rewritten by the
        replays before they are read. Until :meth:`unshare`, nothing may capture or
        allocate into the pool (its free blocks may lie on shared pages); replays,
        :meth:`release` and :meth:`acquire` are fine (the last two do nothing).

        Args:
            blocks: ``(offset, nbytes, start, end)`` per block the pool handed out: its
                offset in the pool, live over the steps ``[start, end)`` of one round of
                replays; ``end`` None: live for good.

        Returns:
            The :class:`~graphslot.planner.PageSharing` now mapped.

        Raises:
            PlanError: a block outside what the pool used, a lifetime that is not one, or
                bytes the pool still hands out in no block (the pool is left as it was).
            StateError: the pool is not mapped, or the driver failed part way (the pool
                is mapped page for page again, its kept bytes restored).
        """
        self._check_mapped("share()")
        if self._lending:
            raise StateError("paged pool: share() while its allocations are routed (inside "
                             "lend() or allocating())")
        self.grow()
        blocks = list(blocks)
        g = self._granule
        # (up to the high-water mark or the last block's end: room mapped beyond them for
        # a capture goes too, and an unshare() maps no more than that)
        need = max([self.used_bytes] + [b[0] + b[1] for b in blocks if _is_block(b)])
        size = min(self._chunks[-1].end, align_up(need, g)) if self._chunks else 0
        touched = share_pages(blocks, size, g)
        # Bytes the pool still hands out must be in a block (whose end says whether they
        # matter between steps): a page under none would lose its memory.
        for start, end in _runs(self.graph.live_ranges(), g, size):
            bare = [p for p in range(start // g, end // g) if touched.physical[p] < 0]
            if bare:
                raise PlanError(f"paged pool: share(): bytes [{start}, {end}) of the pool are "
                                f"still handed out, and no block covers page {bare[0]} of them; "
                                "list every block still held (end None keeps its bytes)")
        sharing = _own_page_each_untouched(touched)
        kept = _runs([(off, n) for off, n, _, end in blocks if end is None], g, size)
        saved = self._save_pages(kept)
        allocs: list[Allocation] = []

        def remap() -> None:
            # (the old chunks go first: the pool never holds both at once)
            b, res = self._backend, self.reservation
            self._unmap(self._chunks)
            for _ in range(sharing.physical_pages):
                allocs.append(b.create(g))
            for page, k in enumerate(sharing.physical):  # (every page has one)
                b.map(res, page * g, allocs[k])
            for start, end in _runs([(0, size)], g, size):
                b.set_access(res, start, end - start)

        try:
            self._worker.submit(remap).result()
        except BaseException as e:
            self._recover(allocs, size, saved)
            raise StateError(f"paged pool: sharing its pages failed part way ({e}); every "
                             "page has its own memory again and the kept bytes are back") from e
        # (the books first: whatever the copy back does, they say what is mapped)
        self._shared = _Shared(size, sharing, allocs, kept)
        self._chunks = []
        self.counters["shares"] += 1
        self._move(PoolState.SHARED)
        self._restore_pages(saved)
        return sharing

    def unshare(self, keep_all: bool = False) -> None:
        """Give every page of the pool its own memory again, keeping the bytes of the
        blocks live for good (waits for the device); a pool that is not shared is left
        as it is.

        Args:
            keep_all: keep every mapped page's bytes, as they read now: for a pool left
                between two replays of the order its sharing was made for, whatever
                blocks are live at that point keep their bytes (each page gets a copy of
                the physical page behind it; a block not live there reads another's
                bytes, which no replay of that order reads before writing).
        """
        self._check_open("unshare()")
        shared = self._shared
        if shared is None:
            return
        g = self._granule
        saved = self._save_pages(
            _runs([(0, shared.size)], g, shared.size) if keep_all else shared.kept)

        def remap() -> None:
            self._unmap_shared(shared)
            # (live until split_free() says which bytes are free: a release keeps it)
            self._chunks = ([_Chunk(0, shared.size, self._backend.map_new(self.reservation, 0, shared.size),
                                    live=True)] if shared.size else [])

        try:
            self._worker.submit(remap).result()
        except BaseException as e:
            self._recover(shared.allocs, shared.size, saved)
            raise StateError(f"paged pool: unsharing failed part way ({e}); every page has "
                             "its own memory again and the kept bytes are back") from e
        self._shared = None
        self._move(PoolState.MAPPED)
        self._restore_pages(saved)

    def _save_pages(self, runs: Sequence[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
        """Host copies of the pool's byte ``runs``, once the device is done with them."""
        b, va = self._backend, self.reservation.va
        b.synchronize()
        return [(start, b.alias_bytes(va + start, end - start).to("cpu", copy=True))
                for start, end in runs]

    def _restore_pages(self, saved: list[tuple[int, torch.Tensor]]) -> None:
        b, va = self._backend, self.reservation.va
        for start, data in saved:
            b.alias_bytes(va + start, data.numel()).copy_(data)
        b.synchronize()

    def _recover(self, allocs: list[Allocation], size: int, saved: list[tuple[int, torch.Tensor]]) -> None:
        """After a failed remap: every page its own memory again, the kept bytes back."""
        def remap() -> None:
            b, res = self._backend, self.reservation
            for off in sorted(res.mappings):
                b.unmap(res, off, res.mappings[off].size)
            for a in allocs + [c.alloc for c in self._chunks if c.alloc is not None]:
                if not a.released and not a.mapped_at:
                    b.release(a)
            self._chunks = [_Chunk(0, size, b.map_new(res, 0, size), live=True)] if size else []

        self._worker.submit(remap).result()
        self._shared = None
        if self._state is PoolState.SHARED:
            self._move(PoolState.MAPPED)
        self._restore_pages(saved)

    def _unmap_shared(self, shared: _Shared) -> None:
        """Unmap every shared page and release the physical pages (driver worker)."""
        b, res, g = self._backend, self.reservation, self._granule
        for page in range(len(shared.sharing.physical)):
            if page * g in res.mappings:  # (a retry after a failure: some are gone)
                b.unmap(res, page * g, g)
        for a in shared.allocs:
            if not a.released:
                b.release(a)

    # -- releasing and acquiring ------------------------------------------------------------

    def release(self, after: Sequence[Any] = ()) -> None:
        """Give the free chunks back once every event in ``after`` completed (the last
        work that may touch them). Returns at once; the driver worker does the rest."""
        self._check_open("release()")
        with self._lock:
            if self._state is not PoolState.MAPPED:
                return  # already released or on its way
            job = _Release()
            self._job = job
            self._move(PoolState.RELEASING)
        events = list(after)
        self._pending = self._worker.submit(lambda: self._release(job, events))

    def _release(self, job: _Release, events: list[Any]) -> None:
        for ev in events:
            self._worker.wait_event(ev)
        with self._lock:
            if job.called_off or self._state is not PoolState.RELEASING:
                return
            try:
                self._unmap([c for c in self._chunks if not c.live])
            finally:
                self.counters["released_bytes_last"] = sum(
                    c.size for c in self._chunks if not c.live and c.alloc is None)
                self.counters["releases"] += 1
                self._move(PoolState.RELEASED)

    def acquire(self) -> None:
        """Make every chunk mapped again (calling off a release still waiting); returns
        once the pool may be used. Cheap when the pool is mapped."""
        self._check_open("acquire()")
        if self._state in (PoolState.MAPPED, PoolState.SHARED):
            return  # (a shared pool gives nothing back between steps: it is replay-ready)
        with self._lock:
            if self._state is PoolState.RELEASING and self._job is not None:
                self._job.called_off = True  # nothing was unmapped yet: nothing to map
                self._job = None
                self.counters["called_off"] += 1
                self._move(PoolState.MAPPED)
                return
        pending, self._pending = self._pending, None
        failed: BaseException | None = None
        if pending is not None:
            try:
                pending.result()
            except BaseException as e:  # the release failed part way: map, then say so
                failed = e
        # RELEASED now, and only this thread leaves it: map without holding the lock, so a
        # called-off release still waiting on the worker can finish.
        self._worker.submit(self._map_released).result()
        with self._lock:
            self.counters["acquires"] += 1
            self._move(PoolState.MAPPED)
        if failed is not None:
            raise StateError(f"paged pool: the last release failed part way ({failed}); "
                             "the pool is mapped again") from failed

    def _unmap(self, chunks: Sequence[_Chunk]) -> int:
        """Unmap and release the mapped ones of ``chunks`` (driver worker); their bytes."""
        freed = 0
        for c in chunks:
            if c.alloc is not None:
                self._backend.unmap_release(self.reservation, c.offset)
                c.alloc = None
                freed += c.size
        return freed

    def _map_released(self) -> None:
        for c in self._chunks:
            if c.alloc is None:
                c.alloc = self._backend.map_new(self.reservation, c.offset, c.size)

    def drain(self) -> None:
        """Wait for a queued release to finish (or to see it was called off)."""
        pending = self._pending
        if pending is not None:
            pending.exception()  # a failure is raised by the next acquire()

    # -- reporting and teardown ---------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {"state": self._state.value, "capacity_bytes": self.capacity,
                "used_bytes": self.used_bytes if self._state is not PoolState.CLOSED else 0,
                "mapped_bytes": self.mapped_bytes, "live_bytes": self.live_bytes,
                "free_bytes": self.free_bytes, "chunks": len(self._chunks), **self.counters}

    def close(self) -> int:
        """Drop the pool once no graph captured into it lives. Returns the region bytes
        that live tensors still reference; while any do, the region stays reserved and
        mapped (nothing is lost) and a later close() tries again."""
        if self._state is PoolState.CLOSED:
            return 0
        self.acquire()
        still = self.graph.release_pool()
        if still:
            return still
        self._backend.synchronize()

        shared = self._shared

        def unmap_all() -> None:
            if shared is not None:
                self._unmap_shared(shared)
            self._unmap(self._chunks)
            self._backend.free(self.reservation)

        self._worker.submit(unmap_all).result()
        self._shared = None
        if self._own_worker:
            self._worker.close()
        self._chunks = []
        self._move(PoolState.CLOSED)
        return 0
