"""Graph memory that graphslot owns: shared variant pools and planned static I/O.

**Mutually exclusive variants** (:class:`VariantGraphs`, over :class:`SharedArena`).
Several captured variants of one computation (sequence buckets, context-parallel sizes,
a branch with an extra op) of which exactly one runs at a time need not each keep a
private pool. graphslot shares *physical memory, not addresses*: every variant gets its
own VA region, and one physical allocation is mapped at offset 0 of all of them. Each
variant's graphs draw their private pool from their own region
(``backend.new_graph(pool_region=...)``), so the framework allocator never sees one
address twice, while the K regions share the same pages. K variants cost the largest
variant's pool plus graph metadata, not the sum.

The contract that makes this safe: variants are **mutually exclusive at replay time**.
Replaying a variant overwrites what any other variant left in the pool, so consume or
copy a variant's outputs before another variant replays, and replay the variants of one
arena in order on one stream (or fence between streams). Static inputs live outside the
pools (the caller's tensors, or an :class:`IOArena`).

Sizing: with ``size=None`` the shared allocation follows the largest variant: after each
capture it is resized to the largest pool high-water mark seen, keeping its contents. On
a backend whose capture runs the work (cpu) the allocation is first widened to
``capacity`` for the capture (host pages appear only when touched). With ``size`` given,
the allocation is fixed and a variant that does not fit fails to capture with a
:class:`~graphslot.errors.UsageError` naming it. Outside :meth:`VariantGraphs.capture`
every byte a pool used is mapped, so outputs may be read at once (they hold valid values
only after a replay on backends whose capture does not run the work).

**Partial-graph static I/O** (:class:`IOArena`). When a step is split into several graphs
with eager code between them, each graph's static inputs and outputs are usually kept
alive for the whole step. Given the order of the steps that write and read each static
tensor, :func:`io_specs` derives its lifetime (from its first write, or the read of a
host-filled input, to its last reader) and :class:`IOArena` places every tensor with
:func:`graphslot.planner.plan` in one mapped range, so tensors whose lifetimes do not
overlap share bytes: a buffer is in effect released as soon as its last consumer ran.

Device neutral: this module uses only the checked :class:`~graphslot.backend.Backend`
methods and the region-graph interface (:class:`~graphslot.regions.RegionGraph`) that the
backends' region graphs implement.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator, Sequence

from .backend import Allocation, Backend, DeviceGraph, Reservation, align_up
from .errors import PoolFullError, StateError, UsageError
from .planner import Plan, PlanError, TensorSpec, plan, verify
from .regions import RegionGraph

if TYPE_CHECKING:
    import torch

__all__ = ["PoolFullError", "SharedArena", "VariantGraphs", "IOTensor", "Step", "io_specs",
           "IOArena", "warm_first_capture"]

GiB = 1 << 30


def _positive_int(what: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UsageError(f"{what} must be a positive int, got {v!r}")
    return v


# --------------------------------------------------------------------------- shared arena


class SharedArena:
    """Named VA regions of ``capacity`` bytes sharing one physical allocation.

    The allocation (``mapped_bytes`` long, a multiple of the granularity) is mapped at
    offset 0 of every region; the rest of each region stays reserved and unmapped, so a
    stray access there faults instead of reading another variant's bytes.

    Args:
        backend: the graphslot backend.
        capacity: VA bytes per region, the most any one region can ever use.
        size: physical bytes to map from the start (``None``: none until :meth:`resize`).
    """

    def __init__(self, backend: Backend, capacity: int, size: int | None = None) -> None:
        self.backend = backend
        g = backend.granularity
        self.capacity = align_up(_positive_int("capacity", capacity), g)
        self._regions: dict[Hashable, Reservation] = {}
        self._alloc: Allocation | None = None
        self._closed = False
        if size is not None:
            size = align_up(_positive_int("size", size), g)
            if size > self.capacity:
                raise UsageError(f"size {size} exceeds capacity {self.capacity}")
            self.resize(size)

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes of the shared allocation (each region maps all of them)."""
        return 0 if self._alloc is None else self._alloc.size

    @property
    def regions(self) -> dict[Hashable, Reservation]:
        return dict(self._regions)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise StateError(f"{what}: this arena was closed; its regions and memory are gone")

    def add_region(self, name: Hashable) -> Reservation:
        """Reserve a region for ``name`` and map the shared allocation at its start."""
        self._check_open("add_region")
        if name in self._regions:
            raise UsageError(f"add_region: {name!r} already has a region")
        with self.backend.transaction() as tx:
            res = tx.reserve(self.capacity)
            if self._alloc is not None:
                tx.map(res, 0, self._alloc)
                tx.set_access(res, 0, self._alloc.size)
        self._regions[name] = res
        return res

    def remove_region(self, name: Hashable) -> None:
        """Unmap and free ``name``'s region; nothing may use its addresses any more."""
        self._check_open("remove_region")
        if name not in self._regions:
            known = ", ".join(map(repr, self._regions)) or "none"
            raise UsageError(f"remove_region: no region {name!r} (known: {known})")
        res = self._regions.pop(name)
        if res.mappings:
            self.backend.unmap(res, 0, res.mappings[0].size)
        self.backend.free(res)

    def resize(self, nbytes: int, keep: int | None = None) -> None:
        """Make the shared allocation ``nbytes`` (rounded up to the granularity) long.

        The first ``keep`` bytes (default: all that fit) are copied into the new
        allocation before every region switches to it, so whatever a graph's pool holds
        survives. Waits for all queued device work first. All or nothing: on failure every
        region maps the old allocation again.
        """
        self._check_open("resize")
        b, g = self.backend, self.backend.granularity
        nbytes = align_up(_positive_int("resize", nbytes), g)
        if nbytes > self.capacity:
            raise UsageError(f"resize: {nbytes} bytes exceed the region capacity {self.capacity}; "
                             "make the arena with a larger capacity")
        old = self._alloc
        if old is not None and old.size == nbytes:
            return
        keep = min(nbytes, old.size if old else 0, nbytes if keep is None else max(keep, 0))
        b.synchronize()  # no queued work may still touch the old pages
        new = b.create(nbytes)
        done: list[Reservation] = []
        try:
            if keep and self._regions:
                self._copy_into(new, next(iter(self._regions.values())).va, keep)
            for res in self._regions.values():
                if old is not None:
                    b.unmap(res, 0, old.size)
                done.append(res)
                b.map(res, 0, new)
                b.set_access(res, 0, nbytes)
        except BaseException as e:
            try:
                for res in done:
                    if res.mappings:
                        b.unmap(res, 0, nbytes)
                    if old is not None:
                        b.map(res, 0, old)
                        b.set_access(res, 0, old.size)
                b.release(new)
            except Exception as undo:  # report, but keep the original error
                e.add_note(f"graphslot: restoring the old arena allocation also failed: {undo!r}")
            raise
        if old is not None:
            b.release(old)
        self._alloc = new

    def release_memory(self) -> None:
        """Unmap the shared allocation from every region and release it (regions stay)."""
        self._check_open("release_memory")
        if self._alloc is None:
            return
        self.backend.synchronize()
        for res in self._regions.values():
            self.backend.unmap(res, 0, self._alloc.size)
        self.backend.release(self._alloc)
        self._alloc = None

    def _copy_into(self, new: Allocation, src_va: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src_va`` into ``new`` through a temporary mapping."""
        import torch

        b = self.backend
        tmp = b.reserve(new.size)
        try:
            b.map(tmp, 0, new)
            try:
                b.set_access(tmp, 0, new.size)
                dst = b.tensor_at(tmp.va, (nbytes,), torch.uint8)
                dst.copy_(b.tensor_at(src_va, (nbytes,), torch.uint8))
                b.synchronize()
            finally:
                b.unmap(tmp, 0, new.size)
        finally:
            b.free(tmp)

    def close(self, keep_reserved: Iterable[Hashable] = ()) -> None:
        """Unmap everything, release the allocation and free the regions.

        Regions named in ``keep_reserved`` stay reserved (unmapped): addresses that
        something may still hold then fault instead of reaching memory reused later.
        """
        if self._closed:
            return
        keep = set(keep_reserved)
        b = self.backend
        b.synchronize()
        for name, res in list(self._regions.items()):
            if res.mappings:
                b.unmap(res, 0, res.mappings[0].size)
            if name not in keep:
                b.free(res)
        if self._alloc is not None:
            b.release(self._alloc)
            self._alloc = None
        self._regions.clear()
        self._closed = True


# --------------------------------------------------------------------------- variants


@dataclass(eq=False)
class _Variant:
    name: Hashable
    region: Reservation
    graphs: dict[Hashable, DeviceGraph] = field(default_factory=dict)
    outputs: dict[Hashable, Any] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return max((_used(g) for g in self.graphs.values()), default=0)


def _region_graph(g: DeviceGraph) -> RegionGraph:
    if not isinstance(g, RegionGraph):
        raise UsageError(f"{type(g).__name__} has no pool_used_bytes: this backend's graphs "
                         "cannot draw their pool from a region")
    return g


def _used(g: DeviceGraph) -> int:
    return int(_region_graph(g).pool_used_bytes)


def _release(g: DeviceGraph) -> int:
    """Release a variant graph's pool; the bytes live tensors still hold in its region."""
    return g.release_pool() if isinstance(g, RegionGraph) else 0


class VariantGraphs:
    """Capture mutually exclusive variants whose graph pools share one physical arena.

    ::

        vg = VariantGraphs(backend, capacity=1 << 30)       # or size=... to fix the arena
        out_s = vg.capture("short", lambda: layer(x_short))
        out_l = vg.capture("long", lambda: layer_with_norm(x_long))
        x_short.copy_(batch)
        y = vg.replay("short")                              # out_s, freshly computed
        vg.close()

    Several graphs of one variant (e.g. forward and backward) share the variant's pool:
    capture each under its own ``part`` name. The variants' contract (mutually exclusive
    replay; consume outputs before another variant replays) is in the module docstring.

    Args:
        backend: the graphslot backend (its graphs must support ``pool_region``).
        capacity: VA bytes reserved per variant: the most one variant's pool may need
            (default: ``size`` when given, else 4 GiB; address space only, except while a
            cpu capture runs, when untouched host pages still cost nothing).
        size: fixed physical bytes for the shared pool; ``None`` follows the largest variant.
    """

    def __init__(self, backend: Backend, *, capacity: int | None = None,
                 size: int | None = None) -> None:
        self.backend = backend
        if capacity is None:
            capacity = 4 * GiB if size is None else size
        self.arena = SharedArena(backend, capacity, size)
        self.fixed = size is not None
        self._variants: dict[Hashable, _Variant] = {}
        # Failed first captures whose region tensors are still referenced (by a traceback,
        # say): their regions are freed at close, once release_pool() reports them unused.
        self._parked: dict[Hashable, DeviceGraph] = {}
        self._state = "open"
        self.current: Hashable | None = None  #: the variant replayed last

    # -- capture -------------------------------------------------------------------------

    def capture(self, name: Hashable, fn: Callable[..., Any], *args: Any, part: Hashable = "main",
                stream: Any = None, **kwargs: Any) -> Any:
        """Capture ``fn(*args, **kwargs)`` as graph ``part`` of variant ``name``.

        After a failed capture the arena's physical memory is as before; a new variant's
        region is freed at once, or, while the exception's traceback still references
        tensors in it, by a later :meth:`capture` or :meth:`close`.

        Args:
            name: the variant (a new one gets its own region).
            fn: the work to capture, called once with ``*args`` and ``**kwargs``.
            *args: positional arguments for ``fn``.
            part: the graph's name within the variant (forward, backward, ...).
            stream: the capture stream (default: the backend's choice).
            **kwargs: keyword arguments for ``fn`` (other than ``part`` and ``stream``).

        Returns:
            What ``fn`` returned (tensors in the variant's pool, or static tensors it
            wrote to).

        Raises:
            PoolFullError: the variant's pool does not fit the arena.
            UsageError: the variant already has a graph ``part``, or this backend's graphs
                cannot draw their pool from a region.
            StateError: the arena was closed.
        """
        widen = lambda g: g.executes_during_capture  # noqa: E731
        with self._new_graph("capture", name, part, widen) as (v, g):
            with g.capture(stream):
                out = fn(*args, **kwargs)
            v.graphs[part] = g
            v.outputs[part] = out
        return out

    @contextlib.contextmanager
    def _new_graph(self, what: str, name: Hashable, part: Hashable,
                   widen: Callable[[DeviceGraph], bool]) -> Iterator[tuple[_Variant, DeviceGraph]]:
        """A new graph over variant ``name``'s pool for the block; on failure the part is
        dropped and the arena's memory is as before; on success the arena is fitted."""
        self._check_open(what)
        self._reap()
        known = self._variants.get(name)
        if known is not None and part in known.graphs:
            raise UsageError(f"variant {name!r} already has a graph {part!r}; "
                             "use another part name")
        new_variant = known is None
        v = _Variant(name, self.arena.add_region(name)) if known is None else known
        limit = self.arena.mapped_bytes if self.fixed else self.arena.capacity
        try:
            g = (self.backend.new_graph(pool_region=(v.region.va, limit)) if not v.graphs else
                 self.backend.new_graph(share_pool_with=next(iter(v.graphs.values()))))
        except BaseException:
            if new_variant:
                self.arena.remove_region(name)
            raise
        if new_variant:
            self._variants[name] = v
        widened = False
        try:
            if not self.fixed and widen(g) and self.arena.mapped_bytes < self.arena.capacity:
                # The graph's work writes as it goes: give it the whole region, keep what is there.
                self.arena.resize(self.arena.capacity, keep=self._largest())
                widened = True
            yield v, g
        except BaseException as e:
            self._drop_failed(v, g, new_variant)
            if widened:
                self._fit()
            if isinstance(e, PoolFullError):
                where = (f"the arena's fixed {self.arena.mapped_bytes} bytes" if self.fixed else
                         f"the {self.arena.capacity}-byte region capacity")
                raise PoolFullError(f"variant {name!r} (graph {part!r}) does not fit {where}: {e}") from e
            raise
        self._fit()

    @contextlib.contextmanager
    def lend_pool(self, name: Hashable, part: Hashable = "main") -> Iterator[RegionGraph]:
        """Lend variant ``name``'s pool to graphs that other code captures in the block.

        For libraries that capture their own graphs into a pool handle they are given
        (TransformerEngine's ``make_graphed_callables(pool=...)``; see
        :mod:`graphslot.adapters.te`). Yields an uncaptured
        :class:`~graphslot.regions.RegionGraph` over the variant's region, registered as
        graph ``part``: give the other code ``graph.pool_handle`` (cuda: the ``MemPool`` id
        for ``torch.cuda.graph(pool=...)``; elsewhere the graph, for
        ``backend.new_graph(share_pool_with=graph)``) and run it under ``graph.lend()``,
        which routes the pool's allocations into the region. The graph holds the pool for
        the variant's life and reports its high-water mark, so :meth:`stats`, sizing and
        :meth:`close` count what the other captures used; it cannot be replayed (the other
        code replays its own graphs).

        An auto-sized arena is widened to ``capacity`` for the block, since the other code
        may also run eager work on pool memory between its captures, and fitted to the
        largest pool afterwards. If the block raises, the part is dropped as after a
        failed :meth:`capture`.

        Args:
            name: the variant.
            part: the name under which the lent pool's graph is registered.

        Returns:
            A context manager yielding the :class:`~graphslot.regions.RegionGraph`.

        Raises:
            PoolFullError: the other code's captures did not fit the arena.
            UsageError: as for :meth:`capture`.
        """
        with self._new_graph("lend_pool", name, part, lambda g: True) as (v, g):
            yield _region_graph(g)
            v.graphs[part] = g
            v.outputs[part] = None

    def _largest(self) -> int:
        return max((v.used for v in self._variants.values()), default=0)

    def _fit(self) -> None:
        """Resize the shared allocation to the largest pool (auto-sized arenas only)."""
        if self.fixed:
            return
        need = self._largest()
        if need == 0:
            self.arena.release_memory()  # nothing captured (or only a failed capture)
        else:
            self.arena.resize(need, keep=need)

    def _drop_failed(self, v: _Variant, g: DeviceGraph, new_variant: bool) -> None:
        live = _release(g)
        if not new_variant:
            return
        del self._variants[v.name]
        if live:
            self._parked[v.name] = g
        else:
            self.arena.remove_region(v.name)

    def _reap(self) -> None:
        """Free the regions of failed captures that nothing references any more."""
        for name, g in list(self._parked.items()):
            if not _release(g):
                del self._parked[name]
                self.arena.remove_region(name)

    # -- replay --------------------------------------------------------------------------

    def _get(self, name: Hashable, part: Hashable) -> tuple[_Variant, DeviceGraph]:
        v = self._variants.get(name)
        if v is None:
            known = ", ".join(map(repr, self._variants)) or "none"
            raise UsageError(f"no variant {name!r} was captured (known: {known})")
        g = v.graphs.get(part)
        if g is None:
            raise UsageError(f"variant {name!r} has no graph {part!r} "
                             f"(it has {', '.join(map(repr, v.graphs))})")
        return v, g

    def replay(self, name: Hashable, part: Hashable = "main") -> Any:
        """Replay graph ``part`` of variant ``name`` on the current stream; returns its
        outputs, valid until a graph of another variant replays."""
        self._check_open("replay")
        v, g = self._get(name, part)
        g.replay()
        self.current = name
        return v.outputs[part]

    def outputs(self, name: Hashable, part: Hashable = "main") -> Any:
        """What ``fn`` returned when ``part`` of ``name`` was captured."""
        self._check_open("outputs")
        return self._get(name, part)[0].outputs[part]

    # -- accounting ----------------------------------------------------------------------

    @property
    def names(self) -> list[Hashable]:
        return list(self._variants)

    def pool_bytes(self) -> dict[Hashable, int]:
        """Each variant's pool high-water mark in bytes (what it would need alone)."""
        return {n: v.used for n, v in self._variants.items()}

    def stats(self) -> dict[str, Any]:
        """Pool bytes per variant, their largest and sum, the shared physical bytes, and
        ``separate_bytes`` (the sum rounded as separate arenas would be) minus it."""
        g = self.backend.granularity
        pools = self.pool_bytes()
        separate = sum(align_up(u, g) for u in pools.values())
        return {
            "variants": len(pools),
            "pool_bytes": {str(k): u for k, u in pools.items()},
            "largest_pool_bytes": max(pools.values(), default=0),
            "sum_pool_bytes": sum(pools.values()),
            "shared_bytes": self.arena.mapped_bytes,
            "separate_bytes": separate,
            "saved_bytes": separate - self.arena.mapped_bytes,
            "capacity_bytes": self.arena.capacity,
            "fixed_size": self.fixed,
        }

    # -- teardown ------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._state == "closing":
            raise StateError(f"{what}: close() was called and refused (tensors from the pools "
                             "were alive): the graphs are released, and the arena's memory is "
                             "held only until close() succeeds, so nothing can be captured or "
                             "replayed any more")
        if self._state != "open":
            raise StateError(f"{what}: these variant graphs were closed; the arena's memory is "
                             "gone, so nothing can be captured or replayed any more")

    def close(self) -> None:
        """Release every graph and pool, then the arena's memory and regions.

        Raises :class:`StateError` while tensors from a variant's pool are still alive
        somewhere (outputs held by the caller, say): the graphs are released by then, the
        arena's memory is kept so those tensors stay valid, and nothing can be captured or
        replayed any more; drop them and call again. Idempotent once it succeeded.
        """
        if self._state == "closed":
            return
        self._state = "closing"
        self.current = None
        held: dict[Hashable, int] = {}
        for v in self._variants.values():
            v.outputs.clear()
        gc.collect()
        groups = [(v.name, list(v.graphs.values())) for v in self._variants.values()]
        for name, graphs in [*groups, *((n, [g]) for n, g in self._parked.items())]:
            live = 0
            for g in graphs:  # the pool is shared: the last release reports what is left
                live = _release(g)
            if live:
                held[name] = live
        if held:
            where = ", ".join(f"{n!r}: {b} bytes" for n, b in held.items())
            raise StateError(f"close: tensors from the pools of variant(s) {where} are still "
                             "alive (outputs kept by the caller?); drop them and call close() again")
        self.arena.close()
        self._variants.clear()
        self._parked.clear()
        self._state = "closed"

    def __enter__(self) -> VariantGraphs:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- static I/O


@dataclass(frozen=True)
class IOTensor:
    """A static input or output of the graphs of one step sequence.

    ``branch`` marks tensors of one mutually exclusive variant (see the planner);
    ``keep`` keeps the tensor to the end of the sequence (a result the host reads).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    branch: Hashable | None = None
    keep: bool = False

    @property
    def itemsize(self) -> int:
        """Bytes of one element."""
        import torch

        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * self.itemsize


@dataclass(frozen=True)
class Step:
    """One graph replay or eager segment, in execution order: what it reads and writes."""

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


def io_specs(tensors: Sequence[IOTensor], steps: Sequence[Step], *,
             align: int = 256) -> list[TensorSpec]:
    """Planner specs for static graph I/O, lifetimes from the steps that use it.

    Step ``i`` is schedule step ``i``. A tensor is live from its first write (or from the
    first read, for an input the host fills before that step) through its last read; a
    tensor no step reads after its last write, or one with ``keep``, is a result and
    stays live to the end (the host reads it after the last step, and must consume it
    before the sequence runs again).

    Args:
        tensors: the graph I/O tensors, by name.
        steps: the schedule, each naming the tensors it reads and writes.
        align: byte alignment of each tensor's offset (at least its element's size).

    Returns:
        One :class:`~graphslot.planner.TensorSpec` per tensor, for the planner.

    Raises:
        PlanError: a tensor no step uses, a step naming an unknown tensor, or duplicate
            names.
    """
    by_name: dict[str, IOTensor] = {}
    for t in tensors:
        if not isinstance(t, IOTensor):
            raise PlanError(f"expected IOTensor, got {type(t).__name__}")
        if t.name in by_name:
            raise PlanError(f"duplicate I/O tensor name {t.name!r}")
        by_name[t.name] = t
    reads: dict[str, list[int]] = {n: [] for n in by_name}
    writes: dict[str, list[int]] = {n: [] for n in by_name}
    for i, s in enumerate(steps):
        for kind, names, table in (("reads", s.reads, reads), ("writes", s.writes, writes)):
            if isinstance(names, str):
                raise PlanError(f"step {s.name!r}: {kind} must be a sequence of names, not a string")
            for n in names:
                if n not in table:
                    raise PlanError(f"step {s.name!r} {kind} unknown tensor {n!r}")
                table[n].append(i)
    n_steps = len(steps)
    specs = []
    for name, t in by_name.items():
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in t.shape):
            raise PlanError(f"I/O tensor {name!r}: shape {tuple(t.shape)!r} must be non-negative "
                            "integers")
        r, w = reads[name], writes[name]
        if not r and not w:
            raise PlanError(f"I/O tensor {name!r} is used by no step")
        start = min(r + w)
        last_read = max(r, default=-1)
        last_write = max(w, default=-1)
        end = n_steps if (t.keep or last_write > last_read) else last_read + 1
        # (an element never straddles its alignment: a float64 lands on 8 bytes at least)
        specs.append(TensorSpec(name, max(t.nbytes, 1), start, max(end, start + 1),
                                align=max(align, t.itemsize), branch=t.branch))
    return specs


class IOArena:
    """Static graph inputs and outputs at planned offsets of one graphslot range.

    ``arena[name]`` is a tensor view at the tensor's planned address (``data_ptr()`` fixed
    for the arena's life): capture graphs reading and writing these views. Tensors whose
    lifetimes (:func:`io_specs`) do not overlap share bytes, so run the steps in the
    order given; writing a tensor outside its lifetime clobbers another.

    Args:
        backend: the graphslot backend.
        tensors: the static tensors.
        steps: the step sequence that defines their lifetimes.
        align: byte alignment of every tensor (at least its element's size).
    """

    def __init__(self, backend: Backend, tensors: Sequence[IOTensor], steps: Sequence[Step], *,
                 align: int = 256) -> None:
        self.backend = backend
        self.tensors = {t.name: t for t in tensors}
        self.specs = io_specs(tensors, steps, align=align)
        self.plan: Plan = plan(self.specs)
        verify(self.plan)
        #: bytes a capture holding one buffer per tensor needs (aligned like the arena).
        self.naive_bytes = sum(align_up(s.size, align) for s in self.specs)
        size = align_up(max(self.plan.arena_bytes, 1), backend.granularity)
        self.reservation, self.allocation = backend.reserve_mapped(size)
        try:
            self._views = {n: backend.tensor_at(self.reservation.va + self.plan.offsets[n], t.shape,
                                                t.dtype)
                           for n, t in self.tensors.items()}
        except BaseException:  # (all or nothing: the range goes back)
            backend.unmap_release(self.reservation, 0)
            backend.free(self.reservation)
            raise
        self._closed = False

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._closed:
            raise StateError(f"IOArena[{name!r}]: the arena was closed")
        try:
            return self._views[name]
        except KeyError:
            raise UsageError(f"no I/O tensor {name!r} (known: {', '.join(self._views)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes behind the arena (plan rounded up to the granularity)."""
        return self.allocation.size

    def report(self) -> dict[str, int]:
        """Planned vs naive bytes: ``naive_bytes`` (one buffer per tensor),
        ``arena_bytes`` (the plan), ``lower_bound_bytes`` (most bytes live at once),
        ``mapped_bytes`` and ``saved_bytes`` (naive minus mapped)."""
        return {"tensors": len(self.specs), "naive_bytes": self.naive_bytes,
                "arena_bytes": self.plan.arena_bytes, "lower_bound_bytes": self.plan.lower_bound_bytes,
                "mapped_bytes": self.mapped_bytes, "saved_bytes": self.naive_bytes - self.mapped_bytes}

    def close(self) -> None:
        """Unmap and release the arena; the views must no longer be used."""
        if self._closed:
            return
        self.backend.synchronize()
        self._views.clear()
        self.backend.unmap_release(self.reservation, 0)
        self.backend.free(self.reservation)
        self._closed = True

    def __enter__(self) -> IOArena:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def warm_first_capture(backend: Backend) -> None:
    """Pay a first capture's one-time costs before measuring.

    On cpu, entering a dispatch mode the first time imports about 70 MiB of Python
    modules, which a measurement would otherwise count.

    Args:
        backend: the backend to capture one tiny graph on (then freed).
    """
    import torch

    from .memory import release_unused

    g = backend.new_graph()
    x = torch.ones(4, device=backend.device)
    with g.capture(**backend.ordinary_capture_kwargs()):
        x * 2
    del g
    release_unused(backend)
