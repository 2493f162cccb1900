"""The slot planner: pack tensors with known lifetimes into one fixed arena.

A captured device graph keeps the addresses it saw, so every tensor it touches needs a
fixed byte offset in an arena that graphslot reserves once. Tensors whose lifetimes do
not overlap may share bytes; so may tensors of *mutually exclusive branches* (e.g. the
context-parallel sizes or sequence buckets of one training step, of which exactly one
runs per replay). This module is pure Python and device neutral.

Model:

* A :class:`TensorSpec` lives over the half-open step interval ``[start, end)``.
* ``branch=None`` means common: the tensor conflicts with every branch. Tensors of two
  *different* branches never conflict; tensors of one branch conflict with each other.
* Tensors sharing an ``alias_group`` are views of one storage. The group is placed as
  one block; each member lands at ``group_base + alias_offset``, so relative byte
  offsets and overlaps are kept. The block is live over the union of its members'
  lifetimes; members of one group may overlap each other freely.

:func:`plan` places everything with greedy heuristics (sweeps over time in start
order and its time-reversed twin, first-fit in start order, greedy by size as in the
offline planners of TFLite and ONNX Runtime, all branch aware, and a few other orders;
the smallest arena wins, then squeaky-wheel refinement while a work budget lasts) and
reports :func:`lower_bound`: the most bytes live at any step in any branch, which no
valid plan can beat. :func:`verify` checks any plan, from
:func:`plan` or elsewhere.

The seven-field slot plan of the dynamic context-parallel capture interface
(:class:`SlotPlanEntry`) is produced by :func:`export_slot_plan` and read back by
:func:`import_slot_plan`.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from heapq import heappop, heappush
from dataclasses import dataclass
from itertools import accumulate, chain, compress, count
from operator import sub
from typing import Callable, Collection, Hashable, Iterable, Iterator, Mapping, NamedTuple, Sequence

from ..errors import UsageError

__all__ = [
    "TensorSpec",
    "Plan",
    "PlanError",
    "plan",
    "verify",
    "lower_bound",
    "baselines",
    "BASELINES",
    "SlotPlanEntry",
    "branch_table",
    "export_slot_plan",
    "import_slot_plan",
]


class PlanError(UsageError):
    """A tensor list or a plan breaks a planner rule; the message names the tensors."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place.

    Attributes:
        name: unique within a plan.
        size: bytes, > 0.
        start, end: the tensor is live over schedule steps ``[start, end)``; ``end > start``.
        align: the offset must be a multiple of this power of two.
        branch: id of the mutually exclusive alternative the tensor belongs to, or
            ``None`` for a tensor common to all of them. Must be hashable.
        alias_group: tensors with the same (hashable, non-``None``) id are views of one
            storage, placed ``alias_offset`` bytes after a shared group base.
        alias_offset: byte offset inside the alias group, >= 0; 0 without a group.
    """

    name: str
    size: int
    start: int
    end: int
    align: int = 256
    branch: Hashable | None = None
    alias_group: Hashable | None = None
    alias_offset: int = 0

    def __post_init__(self) -> None:
        # Checked here so a TensorSpec that exists is well formed by itself; rules that
        # involve several tensors (names, groups, branches) are checked by plan().
        who = f"tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not _is_int(self.size) or self.size <= 0:
            raise PlanError(f"{who}: size must be a positive integer, got {self.size!r}")
        if not _is_int(self.start) or not _is_int(self.end):
            raise PlanError(f"{who}: start and end must be integers, got "
                            f"{self.start!r} and {self.end!r}")
        if self.end <= self.start:
            raise PlanError(f"{who}: lifetime [{self.start}, {self.end}) is empty; "
                            f"end must be greater than start")
        if not _is_int(self.align) or self.align <= 0 or self.align & (self.align - 1):
            raise PlanError(f"{who}: align must be a power of two, got {self.align!r}")
        if not _is_int(self.alias_offset) or self.alias_offset < 0:
            raise PlanError(f"{who}: alias_offset must be a non-negative integer, "
                            f"got {self.alias_offset!r}")
        if self.alias_offset and self.alias_group is None:
            raise PlanError(f"{who}: alias_offset {self.alias_offset} needs an alias_group")
        for field_name in ("branch", "alias_group"):
            try:
                hash(getattr(self, field_name))
            except TypeError:
                raise PlanError(f"{who}: {field_name} must be hashable, got "
                                f"{getattr(self, field_name)!r}") from None


@dataclass(frozen=True)
class Plan:
    """Byte offsets for every tensor in one arena of ``arena_bytes``.

    ``lower_bound_bytes`` is :func:`lower_bound` of ``tensors``; ``offsets`` maps each
    tensor name to its offset from the arena base.
    """

    arena_bytes: int
    offsets: dict[str, int]
    lower_bound_bytes: int
    tensors: tuple[TensorSpec, ...]

    @property
    def efficiency(self) -> float:
        """``lower_bound_bytes / arena_bytes``: 1.0 is optimal (and an empty plan)."""
        return self.lower_bound_bytes / self.arena_bytes if self.arena_bytes else 1.0


# --------------------------------------------------------------------------- validation


@dataclass(eq=False, slots=True)
class _Block:
    """What the packer places: one tensor, or one alias group as a unit."""

    extent: int  # bytes from the block start to the end of its last member
    align: int  # block start must be ≡ phase (mod align)
    phase: int
    branch: Hashable | None
    spans: list[tuple[int, int]]  # merged lifetime intervals, in steps
    members: list[tuple[int, int]]  # (index into tensors, byte offset from block start)
    life: int  # steps live (the sum of spans, in schedule steps)
    nodes: tuple[int, list[int], list[int]] | None = None  # cached: (n, *_tree_nodes(n, spans))


def merge_intervals(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of half-open intervals, as sorted disjoint non-touching intervals."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _validate(tensors: Sequence[TensorSpec],
              branches: Collection[Hashable] | None) -> list[_Block]:
    """Check the rules that involve several tensors and build the blocks to place."""
    allowed = None if branches is None else set(branches)
    seen: dict[str, int] = {}
    groups: dict[Hashable, list[int]] = {}
    blocks: list[_Block] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, TensorSpec):
            raise PlanError(f"tensors[{i}] is a {type(t).__name__}, not a TensorSpec")
        if t.name in seen:
            raise PlanError(f"tensors[{i}] {t.name!r}: duplicate name (also tensors[{seen[t.name]}])")
        seen[t.name] = i
        if allowed is not None and t.branch is not None and t.branch not in allowed:
            raise PlanError(f"tensors[{i}] {t.name!r}: unknown branch {t.branch!r}; "
                            f"known branches: {sorted(map(repr, allowed))}")
        if t.alias_group is None:
            blocks.append(_Block(t.size, t.align, 0, t.branch, [(t.start, t.end)], [(i, 0)],
                                 t.end - t.start))
        else:
            groups.setdefault(t.alias_group, []).append(i)
    for gid, idx in groups.items():
        first = tensors[idx[0]]
        for i in idx[1:]:
            if tensors[i].branch != first.branch:
                raise PlanError(f"alias group {gid!r}: {first.name!r} is in branch "
                                f"{first.branch!r} but {tensors[i].name!r} is in branch "
                                f"{tensors[i].branch!r}; views of one storage share a branch")
        base = min(tensors[i].alias_offset for i in idx)
        # All aligns are powers of two, so the strictest one (the anchor) fixes the block
        # start modulo it; every other member must then be aligned for free.
        anchor = max(idx, key=lambda i: tensors[i].align)
        a = tensors[anchor]
        phase = (base - a.alias_offset) % a.align
        for i in idx:
            t = tensors[i]
            if (phase + t.alias_offset - base) % t.align:
                raise PlanError(
                    f"alias group {gid!r}: {t.name!r} (alias_offset {t.alias_offset}, align "
                    f"{t.align}) and {a.name!r} (alias_offset {a.alias_offset}, align {a.align}) "
                    f"cannot both be aligned at any group base")
        spans = merge_intervals((tensors[i].start, tensors[i].end) for i in idx)
        blocks.append(_Block(
            extent=max(tensors[i].alias_offset + tensors[i].size for i in idx) - base,
            align=a.align, phase=phase, branch=first.branch, spans=spans,
            members=[(i, tensors[i].alias_offset - base) for i in idx],
            life=sum(e - s for s, e in spans)))
    return blocks


# --------------------------------------------------------------------------- lower bound


def _live_bytes_events(tensors: Sequence[TensorSpec]) -> dict[Hashable | None, list[tuple[int, int]]]:
    """Per branch (``None`` = common): ``(step, delta)`` changes of the bytes live."""
    ev: dict[Hashable | None, list[tuple[int, int]]] = {}
    groups: dict[Hashable, list[TensorSpec]] = {}
    for t in tensors:
        if t.alias_group is not None:
            groups.setdefault(t.alias_group, []).append(t)
            continue
        lst = ev.setdefault(t.branch, [])
        lst.append((t.start, t.size))
        lst.append((t.end, -t.size))
    for members in groups.values():
        # Views overlap, so a group holds the union of its live members' byte ranges,
        # which changes only at its members' boundaries.
        lst = ev.setdefault(members[0].branch, [])
        cuts = sorted({p for t in members for p in (t.start, t.end)})
        prev = 0
        for s, e in zip(cuts, cuts[1:]):
            live = merge_intervals((t.alias_offset, t.alias_offset + t.size)
                          for t in members if t.start <= s and e <= t.end)
            now = sum(b - a for a, b in live)
            if now != prev:
                lst.append((s, now - prev))
                prev = now
        if prev:
            lst.append((cuts[-1], -prev))
    return ev


def lower_bound(tensors: Sequence[TensorSpec]) -> int:
    """The most bytes live at any step in any branch; common tensors count in every one.

    No valid plan has a smaller arena. Alias groups count the union of their live
    members' byte ranges.

    Args:
        tensors: the specs, assumed valid (see :func:`plan`).

    Returns:
        The bound in bytes.
    """
    ev = _live_bytes_events(tensors)
    if not ev:
        return 0
    steps = sorted({s for lst in ev.values() for s, _ in lst})
    index = {s: k for k, s in enumerate(steps)}

    def profile(lst: list[tuple[int, int]]) -> list[int]:
        d = [0] * len(steps)
        for s, delta in lst:
            d[index[s]] += delta
        return list(accumulate(d))

    common = profile(ev.pop(None, []))
    best = max(common)
    for lst in ev.values():
        # A branch adds a constant between consecutive own events; pair that with the
        # highest common level over the same steps (a C-speed slice max).
        lst.sort()
        level = 0
        for k in range(len(lst)):
            s, delta = lst[k]
            level += delta
            if k + 1 < len(lst) and lst[k + 1][0] == s:
                continue
            if level > 0 and k + 1 < len(lst):
                lo, hi = index[s], index[lst[k + 1][0]]
                best = max(best, level + max(common[lo:hi]))
    return best


# --------------------------------------------------------------------------- packing


def _tree_nodes(n: int, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """For segment trees with ``n`` leaves over compressed steps: the canonical nodes
    covering ``spans``, and the nodes on the paths from each span's first step up to
    the root (see :class:`_Occupancy`)."""
    canon: list[int] = []
    for lo, hi in spans:
        lo += n
        hi += n
        while lo < hi:
            if lo & 1:
                canon.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                canon.append(hi)
            lo >>= 1
            hi >>= 1
    path: list[int] = []
    seen: set[int] = set()
    for s, _ in spans:
        c = s + n
        while c and c not in seen:
            seen.add(c)
            path.append(c)
            c >>= 1
    return canon, path


class _Occupancy:
    """Which byte ranges are taken during which steps, for one branch key.

    Two segment trees over compressed steps whose nodes keep unions of byte intervals
    as flat sorted lists ``[s0, e0, s1, e1, ...]``: ``cover`` holds a block at the
    canonical nodes of its steps, ``born`` at every node above its first step. Two
    lifetimes overlap exactly when one starts inside the other, so what conflicts with
    a block is what ``born`` holds at its canonical nodes (started during it) and what
    ``cover`` holds on the path above its first step (live when it starts). A placed
    block so shows up at most twice in a query (nodes from :func:`_tree_nodes`), and
    each union stays compact because packing is dense.
    """

    __slots__ = ("cover", "born")

    def __init__(self, n: int) -> None:
        self.cover: list[list[int] | None] = [None] * (2 * n)
        self.born: list[list[int] | None] = [None] * (2 * n)

    def taken(self, canon: list[int], path: list[int], out: list[list[int]]) -> None:
        """Append to ``out`` the unions that conflict with a block at these nodes."""
        born, cover = self.born, self.cover
        out.extend([x for x in [born[c] for c in canon] if x])
        out.extend([x for x in [cover[p] for p in path] if x])

    def add(self, canon: list[int], path: list[int], a: int, b: int) -> None:
        """Mark bytes ``[a, b)`` taken at these nodes."""
        cover, born = self.cover, self.born
        for c in canon:
            _union_add(cover, c, a, b)
        for p in path:
            _union_add(born, p, a, b)


def _union_add(lists: list[list[int] | None], k: int, a: int, b: int) -> None:
    """Add ``[a, b)`` to the union ``lists[k]`` of disjoint, non-touching intervals."""
    flat = lists[k]
    if flat is None:
        lists[k] = [a, b]
        return
    top = flat[-1]
    if a >= top:  # the common case: placed at or above everything here
        if a == top:
            flat[-1] = b
        else:
            flat += (a, b)
        return
    lo = bisect_left(flat, a)
    hi = bisect_right(flat, b)
    if lo & 1:  # a falls inside (or at the end of) an interval: extend it
        lo -= 1
        a = flat[lo]
    if hi & 1:  # b falls inside (or at the start of) an interval
        b = flat[hi]
        hi += 1
    flat[lo:hi] = (a, b)


# A fit rule picks a start for ``size`` bytes at ``phase`` mod ``align`` given the free
# gaps ``[los[i], his[i])`` in address order and ``top``, above which all is free.
# ``los`` may be one longer than ``his`` (the extra entry is unused).
_Fit = Callable[[list[int], list[int], int, int, int, int], int]


def _first_fit(los: list[int], his: list[int], top: int, size: int, align: int,
               phase: int) -> int:
    """The lowest start where ``size`` bytes fit."""
    # Gap widths compared with size and filtered to indices, all C-level iterators.
    for i in compress(count(), map(size.__le__, map(sub, his, los))):
        lo = los[i]
        start = lo + (phase - lo) % align
        if start + size <= his[i]:
            return start
    return top + (phase - top) % align


def _best_fit(los: list[int], his: list[int], top: int, size: int, align: int,
              phase: int) -> int:
    """The lowest start in the smallest gap where ``size`` bytes fit; above
    everything when none does."""
    widths = list(map(sub, his, los))
    # The smallest wide-enough gap, found at C speed; the lowest of equal ones.
    narrowest = min(filter(size.__le__, widths), default=-1)
    if narrowest >= 0:
        i = widths.index(narrowest)
        lo = los[i]
        start = lo + (phase - lo) % align
        if start + size <= his[i]:
            return start
        # Alignment padding left that gap too small: look at every gap.
        best = -1
        best_gap = 0
        for i in compress(count(), map(size.__le__, widths)):
            lo, hi = los[i], his[i]
            start = lo + (phase - lo) % align
            if start + size <= hi and (best < 0 or hi - lo < best_gap):
                best, best_gap = start, hi - lo
        if best >= 0:
            return best
    return top + (phase - top) % align


def _union_gaps(taken: list[list[int]]) -> tuple[list[int], list[int], int]:
    """The free gaps below the top of the union of ``taken`` (see :data:`_Fit`), and
    that top. Gaps may be empty or negative; fit rules skip them."""
    if len(taken) == 1:
        starts, ends = taken[0][::2], taken[0][1::2]
    else:
        # Gaps of a union of intervals without sorting pairs: with starts and ends sorted
        # separately (C-speed merges of sorted runs), [ends[i], starts[i + 1]) is free
        # exactly when it is non-empty.
        starts = sorted(chain.from_iterable([f[::2] for f in taken]))
        ends = sorted(chain.from_iterable([f[1::2] for f in taken]))
    top = ends[-1]
    ends.insert(0, 0)  # the gap below everything; the last end is unused
    return ends, starts, top


def _nodes(blk: _Block, n: int) -> tuple[list[int], list[int]]:
    nodes = blk.nodes
    if nodes is None or nodes[0] != n:
        nodes = blk.nodes = (n, *_tree_nodes(n, blk.spans))
    return nodes[1], nodes[2]


def _pack(blocks: list[_Block], order: Sequence[int], nsteps: int, fit: _Fit = _best_fit,
          limit: float = math.inf) -> list[int] | None:
    """Place blocks in ``order``, each into the free gap ``fit`` picks; their starts, or
    ``None`` as soon as the arena would reach ``limit`` (a better plan is known)."""
    n = 1
    while n < nsteps:
        n *= 2
    common = _Occupancy(n)
    per_branch: dict[Hashable, _Occupancy] = {}
    # A common block must avoid every branch. With few common blocks, each queries the
    # branches one by one; with many, the union over all branches is kept as well
    # (while a common block is still to come). The unions are the same either way.
    commons = [pos for pos, k in enumerate(order) if blocks[k].branch is None]
    last_common = commons[-1] if commons else -1
    nbranches = len({b.branch for b in blocks}) - (1 if commons else 0)
    if len(commons) * nbranches * 4 <= last_common - len(commons):
        last_common = -1
    any_branch = _Occupancy(n)
    starts = [0] * len(blocks)
    for pos, k in enumerate(order):
        blk = blocks[k]
        canon, path = _nodes(blk, n)
        taken: list[list[int]] = []
        common.taken(canon, path, taken)
        if blk.branch is None:
            own = common
            if last_common < 0:
                for occ in per_branch.values():
                    occ.taken(canon, path, taken)
            else:
                any_branch.taken(canon, path, taken)
        else:
            own = per_branch.get(blk.branch) or per_branch.setdefault(blk.branch, _Occupancy(n))
            own.taken(canon, path, taken)
        if taken:
            start = fit(*_union_gaps(taken), blk.extent, blk.align, blk.phase)
        else:
            start = blk.phase
        starts[k] = start
        if start + blk.extent >= limit:
            return None
        own.add(canon, path, start, start + blk.extent)
        if blk.branch is not None and pos < last_common:
            any_branch.add(canon, path, start, start + blk.extent)
    return starts


class _Free:
    """The bytes free now for one branch key during a sweep: the gaps
    ``[los[i], his[i])`` below ``top`` in address order, and everything from ``top``."""

    __slots__ = ("los", "his", "top")

    def __init__(self, other: _Free | None = None) -> None:
        if other is None:
            self.los: list[int] = []
            self.his: list[int] = []
            self.top = 0
        else:
            self.los, self.his, self.top = list(other.los), list(other.his), other.top

    def take(self, a: int, b: int) -> None:
        """Mark the free bytes ``[a, b)`` taken."""
        top = self.top
        if a >= top:
            if a > top:
                self.los.append(top)
                self.his.append(a)
            self.top = b
            return
        los, his = self.los, self.his
        i = bisect_right(los, a) - 1  # the gap holding [a, b): it ends below top
        lo, hi = los[i], his[i]
        if lo < a:
            his[i] = a
            if b < hi:
                los.insert(i + 1, b)
                his.insert(i + 1, hi)
        elif b < hi:
            los[i] = b
        else:
            del los[i], his[i]

    def give(self, a: int, b: int) -> None:
        """Mark the taken bytes ``[a, b)`` free."""
        los, his = self.los, self.his
        i = bisect_left(los, b)
        left = i > 0 and his[i - 1] == a
        if b == self.top:
            if left:
                self.top = los[i - 1]
                del los[i - 1], his[i - 1]
            else:
                self.top = a
            return
        if i < len(los) and los[i] == b:
            if left:
                his[i - 1] = his[i]
                del los[i], his[i]
            else:
                los[i] = a
        elif left:
            his[i - 1] = b
        else:
            los.insert(i, a)
            his.insert(i, b)


def _meet(frees: Iterable[_Free]) -> tuple[list[int], list[int], int]:
    """What is free in all of ``frees``, as fit rules take it."""
    it = iter(frees)
    f = next(it)
    los, his, top = f.los, f.his, f.top
    for g in it:
        # Two-pointer intersection of sorted disjoint gaps, the tops as open intervals.
        alo, ahi = los + [top], his + [math.inf]
        blo, bhi = g.los + [g.top], g.his + [math.inf]
        los, his = [], []
        i = j = 0
        na, nb = len(alo), len(blo)
        while i < na and j < nb:
            lo = alo[i] if alo[i] > blo[j] else blo[j]
            hi = ahi[i] if ahi[i] < bhi[j] else bhi[j]
            if lo < hi:
                los.append(lo)
                his.append(hi)  # type: ignore[arg-type]
            if ahi[i] < bhi[j]:
                i += 1
            else:
                j += 1
        top = los.pop()
        his.pop()
    return los, his, top


def _pack_sweep(blocks: list[_Block], order: Sequence[int], nsteps: int,
                fit: _Fit = _first_fit, limit: float = math.inf,
                reverse: bool = False) -> list[int] | None:
    """:func:`_pack` for an ``order`` sorted by first step (by last step, descending,
    when ``reverse``): a sweep over time that keeps only the free gaps of what is live
    now, per branch key, so a placement looks at a few gaps instead of at a tree of
    unions. A block counts as live from its first to its last step (a view group's idle
    gaps are not reused), which is conservative, so plans stay valid."""
    del nsteps  # the sweep needs no step tree
    starts = [0] * len(blocks)
    # Free now: among common blocks, and per branch among its own and the common ones.
    common = _Free()
    view: dict[Hashable, _Free] = {}
    ends: list[tuple[int, int]] = []  # heap of (time the block dies, block)
    for k in order:
        b = blocks[k]
        if reverse:
            t0, t1 = -b.spans[-1][1], -b.spans[0][0]
        else:
            t0, t1 = b.spans[0][0], b.spans[-1][1]
        while ends and ends[0][0] <= t0:
            j = heappop(ends)[1]
            a, br = starts[j], blocks[j].branch
            e = a + blocks[j].extent
            if br is None:
                common.give(a, e)
                for f in view.values():
                    f.give(a, e)
            else:
                view[br].give(a, e)
        br = b.branch
        if br is None:
            if len(view) > 1:
                start = fit(*_meet(view.values()), b.extent, b.align, b.phase)
            else:
                f = next(iter(view.values()), common)
                start = fit(f.los, f.his, f.top, b.extent, b.align, b.phase)
        else:
            f = view.get(br) or view.setdefault(br, _Free(common))
            start = fit(f.los, f.his, f.top, b.extent, b.align, b.phase)
        starts[k] = start
        stop = start + b.extent
        if stop >= limit:
            return None
        if br is None:
            common.take(start, stop)
            for f in view.values():
                f.take(start, stop)
        else:
            f.take(start, stop)
        heappush(ends, (t1, k))
    return starts


def _bundle(blocks: list[_Block], unit: int) -> list[_Block]:
    """Fuse blocks with identical lifetimes and branch into one contiguous block each.

    Real schedules save many tensors per layer that are born and freed together; packing
    them as one block keeps them from scattering into gaps they fragment, and shrinks
    the problem. Biggest alignment first, so padding stays minimal.
    """
    same: dict[tuple, list[_Block]] = {}
    for b in blocks:
        same.setdefault((b.branch, tuple(b.spans)), []).append(b)
    if len(same) == len(blocks):
        return blocks  # nothing to fuse; plan() then skips repeating an order
    out = []
    for parts in same.values():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        parts.sort(key=lambda b: (-b.align, -b.extent))
        pos = 0
        members: list[tuple[int, int]] = []
        for b in parts:
            pos += (b.phase - pos) % b.align
            members += [(i, pos * unit + rel) for i, rel in b.members]
            pos += b.extent
        out.append(_Block(pos, parts[0].align, 0, parts[0].branch, parts[0].spans, members,
                          parts[0].life))
    return out


# Orders: sort keys of a block. Ties left by a key keep input order (sorts are stable).

def _by_size_then_start(b: _Block) -> tuple:
    # Equal tensors of successive microbatches then stack into the same few slots.
    return (-b.extent, b.spans[0][0], -b.spans[-1][1])


def _by_lifetime_then_size(b: _Block) -> tuple:
    return (-sum(e - s for s, e in b.spans), -b.extent, b.spans[0][0])


def _by_start_larger_first(b: _Block) -> tuple:
    # The textbook first-fit order: allocation order of the schedule itself.
    return (b.spans[0][0], -b.extent)


def _by_size_longest_lived_first(b: _Block) -> tuple:
    # Greedy by size as in the TFLite and ONNX Runtime offline planners; ties go to the
    # longest-lived tensor (in schedule steps, not compressed ones).
    return (-b.extent, -b.life)


def _sweep(b: _Block) -> tuple:
    # Start order, longest-lived first on ties, then larger: what is born together is
    # stacked so the longest stays lowest and the short-lived above it free together.
    return (b.spans[0][0], -b.spans[-1][1], -b.extent)


def _sweep_reversed(b: _Block) -> tuple:
    # The same sweep with time running backwards (an end order): schedules are not
    # symmetric, and backward passes free in a different pattern than forwards allocate.
    return (-b.spans[-1][1], b.spans[0][0], -b.extent)


class _Candidate(NamedTuple):
    """One way to place: an order, a gap rule, and whether equal lifetimes are fused."""

    name: str
    fuse: bool
    order: Callable[[_Block], tuple]
    fit: _Fit
    baseline: bool = False  # a textbook planner: always tried, reported by baselines()
    sweep: int = 0  # 1: the order is by first step, -1: by last step descending (see _pack_sweep)
    cost: float = 1.0  # budget drawn per block placed (see _extra_work); 0: always runs
    coarse: bool = False  # place extents rounded up to _COARSE_BITS significant bits


#: The textbook planners plan() is never worse than, by name.
BASELINES: tuple[str, ...] = ("first-fit", "greedy-by-size")

#: Refinement runs in turn, while the budget lasts: (coarse extents, first order, bump).
#: Coarse extents first: near-equal tensors then trade places cleanly.
_REFINE_RUNS: tuple[tuple[bool, Callable[[_Block], tuple], float], ...] = (
    (True, _sweep, 0.7),
    (False, _sweep, 0.7),
    (True, _sweep_reversed, 0.7),
    (False, _sweep_reversed, 0.7),
    (True, _sweep, 0.5),
    (False, _sweep, 0.5),
)

#: What a sweep placement costs next to a step-tree one, in the work budget.
_SWEEP_COST = 0.125
#: Coarse candidates place every extent rounded up to this many significant bits (at
#: most 1/4096 more): tensors that differ by a few KiB (the same layer in another
#: microbatch or model chunk) then fit each other's freed gaps exactly, instead of
#: creeping upwards because each is slightly too big for the last one's hole.
_COARSE_BITS = 12


def _coarse(blocks: list[_Block]) -> list[_Block]:
    """``blocks`` with extents rounded up as :data:`_COARSE_BITS` says; same order and
    members, so their starts place the real blocks (each inside its rounded one)."""
    out = []
    for b in blocks:
        g = 1 << max(0, b.extent.bit_length() - _COARSE_BITS)
        out.append(_Block(-(-b.extent // g) * g, b.align, b.phase, b.branch, b.spans,
                          b.members, b.life, b.nodes))
    return out

#: Tried in turn; plan() keeps the smallest arena. The sweeps come first: they cost little
#: (a placement reads only what is live) and usually win, so the step-tree candidates
#: after them are abandoned early. Once a plan is within _GOOD_ENOUGH of the lower bound
#: only the baselines not yet tried still run (each abandoned as soon as it cannot win);
#: at the lower bound itself nothing more runs. Step-tree candidates that are not
#: baselines, and the refinement, draw on a work budget (see _extra_work).
_CANDIDATES: tuple[_Candidate, ...] = (
    _Candidate("sweep", False, _sweep, _first_fit, sweep=1, cost=0),
    _Candidate("sweep-coarse", False, _sweep, _first_fit, sweep=1, cost=_SWEEP_COST,
               coarse=True),
    _Candidate("sweep-reversed-coarse", False, _sweep_reversed, _first_fit, sweep=-1,
               cost=_SWEEP_COST, coarse=True),
    _Candidate("sweep-best-fit", False, _sweep, _best_fit, sweep=1, cost=_SWEEP_COST),
    _Candidate("sweep-reversed", False, _sweep_reversed, _first_fit, sweep=-1, cost=_SWEEP_COST),
    _Candidate("sweep-best-fit-coarse", False, _sweep, _best_fit, sweep=1, cost=_SWEEP_COST,
               coarse=True),
    _Candidate("sweep-reversed-best-fit", False, _sweep_reversed, _best_fit, sweep=-1,
               cost=_SWEEP_COST),
    _Candidate("first-fit", False, _by_start_larger_first, _first_fit, baseline=True, sweep=1,
               cost=0),
    _Candidate("greedy-by-size", False, _by_size_longest_lived_first, _best_fit, baseline=True,
               cost=0),
    _Candidate("size-start-fused", True, _by_size_then_start, _best_fit),
    _Candidate("lifetime-size", False, _by_lifetime_then_size, _best_fit),
    _Candidate("size-start", False, _by_size_then_start, _best_fit),
)
_GOOD_ENOUGH = 1.01
_REFINE_ROUNDS = 40
_REFINE_BUMP = 0.7
#: A refinement run stops after this many rounds in a row without a smaller arena.
_REFINE_PATIENCE = 16
_REFINE_FRUITLESS = 3
#: Step-tree placements allowed beyond the baselines and the first sweep: _EXTRA_WORK at
#: no tensors, fewer as inputs grow, down to a _EXTRA_FLOOR share of the tensors. A
#: step-tree placement costs about as much as there are tensors live at once, so small
#: inputs get the extra orders and the refinement rounds (which is where they pay),
#: while big ones are planned by the sweeps and the baselines, in time close to linear.
#: The floor pays for two coarse sweeps (forwards and time-reversed, the next two
#: candidates): at 100k tensors neither wins on every schedule.
_EXTRA_WORK = 80_000
_EXTRA_SLOPE = 8
_EXTRA_FLOOR = 0.25


def _extra_work(n: int) -> float:
    """The work budget for ``n`` blocks, in step-tree block placements."""
    return max(_EXTRA_WORK - _EXTRA_SLOPE * n, _EXTRA_FLOOR * n)


class _Budget:
    """Step-tree placements left for candidates that are not baselines and refinement."""

    __slots__ = ("left",)

    def __init__(self, left: float) -> None:
        self.left = left

    def spend(self, n: int) -> bool:
        """Take ``n`` placements if they are left."""
        if n > self.left:
            return False
        self.left -= n
        return True


def _prepare(specs: tuple[TensorSpec, ...],
             branches: Collection[Hashable] | None) -> tuple[list[_Block], int, int]:
    """Validated blocks with spans in compressed steps, the number of steps, and the
    byte unit the blocks are measured in.

    The unit is the largest power of two dividing every extent and phase, so every
    start a fit rule can pick is a multiple of it; extents, aligns and phases are
    divided by it (an align below the unit becomes 1). Packing is unchanged, only
    faster: offsets of realistic arenas stay below 2**30 units, which CPython compares
    and sorts as single-digit integers."""
    blocks = _validate(specs, branches)
    steps = sorted({p for b in blocks for s in b.spans for p in s})
    index = {s: k for k, s in enumerate(steps)}
    g = 0
    for b in blocks:
        b.spans = [(index[s], index[e]) for s, e in b.spans]
        g = math.gcd(g, b.extent, b.phase)
    unit = g & -g if g else 1
    if unit > 1:
        for b in blocks:
            b.extent //= unit
            b.phase //= unit
            b.align = max(b.align // unit, 1)
    return blocks, max(len(steps) - 1, 1), unit


def _arena(cand: list[_Block], starts: list[int]) -> int:
    return max((s + b.extent for s, b in zip(starts, cand)), default=0)


def _run(cands: Sequence[_Candidate], blocks: list[_Block], nsteps: int, unit: int,
         lb: float, early_stop: bool = True,
         budget: _Budget | None = None) -> tuple[int, list[_Block], list[int]]:
    """The smallest arena of ``cands``: (arena, the blocks placed, their starts), in
    units of ``unit`` bytes, as ``lb`` is. Candidates with a cost run only while
    ``budget`` has a full pass left (without one, all run)."""
    best: tuple[int, list[_Block], list[int]] | None = None
    fused: list[_Block] | None = None
    coarse: list[_Block] | None = None
    tried: set[tuple[int, Callable, Callable]] = set()
    for c in cands:
        if best is not None and early_stop and (
                best[0] <= lb or (best[0] <= lb * _GOOD_ENOUGH and not c.baseline)):
            continue
        if c.cost and budget is not None and budget.left < c.cost * len(blocks) / 4:
            continue  # (a fused problem is smaller: up to a few blocks in one)
        cand = blocks
        if c.fuse:
            fused = cand = _bundle(blocks, unit) if fused is None else fused
        placed = cand
        if c.coarse:
            coarse = placed = _coarse(cand) if coarse is None else coarse
        if (id(placed), c.order, c.fit) in tried:
            continue
        if c.cost and budget is not None and not budget.spend(math.ceil(c.cost * len(cand))):
            continue
        tried.add((id(placed), c.order, c.fit))
        order = sorted(range(len(placed)), key=lambda k: c.order(placed[k]))
        limit = math.inf if best is None else best[0]
        if c.sweep:
            starts = _pack_sweep(placed, order, nsteps, c.fit, limit, c.sweep < 0)
        else:
            starts = _pack(placed, order, nsteps, c.fit, limit)
        if starts is not None and (best is None or _arena(cand, starts) < best[0]):
            best = (_arena(cand, starts), cand, starts)
    if best is None:  # no tensors
        return 0, blocks, []
    return best


def _refine(blocks: list[_Block], nsteps: int, lb: float,
            best: tuple[int, list[_Block], list[int]],
            budget: _Budget) -> tuple[int, list[_Block], list[int]]:
    """Squeaky-wheel rounds of first-fit: every block that ended above the lower bound
    moves up in the order, and first-fit places again. Deterministic; each round is a
    pass of ``budget``. A run stops after _REFINE_PATIENCE rounds without progress and
    the next one starts over (see _REFINE_RUNS); all stop after _REFINE_FRUITLESS runs
    in a row without progress, or once a plan is within _GOOD_ENOUGH of the lower
    bound."""
    fruitless = 0
    for coarse, start_key, bump in _REFINE_RUNS:
        if (best[0] <= lb * _GOOD_ENOUGH or budget.left < 2 * len(blocks)
                or fruitless >= _REFINE_FRUITLESS):
            break
        before = best[0]
        placed = _coarse(blocks) if coarse else blocks
        order = sorted(range(len(blocks)), key=lambda k: start_key(placed[k]))
        priority = [0.0] * len(blocks)
        for pos, k in enumerate(order):
            priority[k] = float(pos)
        stalled = 0
        for _ in range(_REFINE_ROUNDS):
            if stalled >= _REFINE_PATIENCE or not budget.spend(len(blocks)):
                break
            stalled += 1
            # Bumped blocks leave start order, so this needs the general packer.
            starts = _pack(placed, order, nsteps, _first_fit)
            assert starts is not None
            arena = _arena(blocks, starts)
            if arena < best[0]:
                best = (arena, blocks, starts)
                stalled = 0
                if arena <= lb * _GOOD_ENOUGH:
                    break
            for k, b in enumerate(placed):
                if starts[k] + b.extent > lb:
                    priority[k] *= bump
            order.sort(key=priority.__getitem__)
        fruitless = fruitless + 1 if best[0] == before else 0
    return best


def _offsets(specs: Sequence[TensorSpec], cand: list[_Block], starts: list[int],
             unit: int) -> dict[str, int]:
    offsets: dict[str, int] = {}
    for b, start in zip(cand, starts):
        for i, rel in b.members:
            offsets[specs[i].name] = start * unit + rel
    # Offsets in input order, so plans print and serialise predictably.
    return {t.name: offsets[t.name] for t in specs}


def plan(tensors: Iterable[TensorSpec], *,
         branches: Collection[Hashable] | None = None) -> Plan:
    """Place ``tensors`` in one arena; see the module docstring for the rules.

    Args:
        tensors: what to place; names must be unique.
        branches: the valid branch ids; when given, a tensor naming any other branch is
            an error (catches typos that would silently drop conflicts).

    Greedy placement under several orders and gap rules, the smallest arena winning.
    The candidates always include the textbook planners of :data:`BASELINES` (first-fit
    in start order, larger first on ties; greedy by size, longest-lived first), so the
    arena is never larger than theirs (see :func:`baselines`). An order is abandoned once
    it cannot win; once a plan is within 1% of the lower bound only the baselines still
    run, and at the lower bound nothing more does. Candidates beyond the first sweep and
    the baselines, and the refinement, share a work budget counted in placements that
    shrinks as inputs grow, so time stays close to linear in the number of tensors.
    Deterministic (the budget counts work, not seconds). Returns a :class:`Plan` that passes :func:`verify`; raises
    :class:`PlanError` for invalid input, naming the tensor or alias group at fault.
    """
    specs = tuple(tensors)
    blocks, nsteps, unit = _prepare(specs, branches)
    lb = lower_bound(specs)
    budget = _Budget(_extra_work(len(blocks)))
    best = _run(_CANDIDATES, blocks, nsteps, unit, lb / unit, budget=budget)
    arena, cand, starts = _refine(blocks, nsteps, lb / unit, best, budget)
    return Plan(arena * unit, _offsets(specs, cand, starts, unit), lb, specs)


def baselines(tensors: Iterable[TensorSpec], *,
              branches: Collection[Hashable] | None = None) -> dict[str, Plan]:
    """The plans of the textbook planners that :func:`plan` is never worse than, by name
    (see :data:`BASELINES`): ``first-fit`` places tensors in start order (larger first
    on ties) at the lowest offset that fits; ``greedy-by-size`` places them largest
    first (longest-lived first on ties) into the smallest gap that fits. Both respect
    branches and alias groups as :func:`plan` does.

    Args:
        tensors: the specs.
        branches: branch ids in index order (default: order of first appearance).

    Returns:
        ``{name: Plan}`` for each baseline.

    Raises:
        PlanError: invalid specs, as :func:`plan` raises.
    """
    specs = tuple(tensors)
    blocks, nsteps, unit = _prepare(specs, branches)
    lb = lower_bound(specs)
    out = {}
    for c in _CANDIDATES:
        if c.baseline:
            arena, cand, starts = _run([c], blocks, nsteps, unit, lb / unit)
            out[c.name] = Plan(arena * unit, _offsets(specs, cand, starts, unit), lb, specs)
    return out


# --------------------------------------------------------------------------- verify


def verify(p: Plan) -> None:
    """Raise :class:`PlanError` unless ``p`` is a valid placement of ``p.tensors``.

    Checks: every tensor has exactly one integer offset, aligned, inside the arena;
    alias group members keep their relative offsets; and no two tensors that are live
    at the same step, in conflicting branches and not views of one alias group, share
    a byte.

    Args:
        p: the plan to check.

    Raises:
        PlanError: the first violation; a conflict names both tensors, the bytes and
            the step.
    """
    tensors = p.tensors
    _validate(tensors, None)
    if not _is_int(p.arena_bytes) or p.arena_bytes < 0:
        raise PlanError(f"arena_bytes must be a non-negative integer, got {p.arena_bytes!r}")
    names = {t.name for t in tensors}
    extra = [n for n in p.offsets if n not in names]
    if extra:
        raise PlanError(f"offsets name tensors that the plan does not have: {extra[:5]}")
    group_base: dict[Hashable, tuple[int, str]] = {}
    for t in tensors:
        if t.name not in p.offsets:
            raise PlanError(f"tensor {t.name!r} has no offset")
        o = p.offsets[t.name]
        if not _is_int(o) or o < 0:
            raise PlanError(f"tensor {t.name!r}: offset must be a non-negative integer, got {o!r}")
        if o % t.align:
            raise PlanError(f"tensor {t.name!r}: offset {o} is not a multiple of its align {t.align}")
        if o + t.size > p.arena_bytes:
            raise PlanError(f"tensor {t.name!r}: bytes [{o}, {o + t.size}) run past the "
                            f"arena of {p.arena_bytes} bytes")
        if t.alias_group is not None:
            base = o - t.alias_offset
            other = group_base.setdefault(t.alias_group, (base, t.name))
            if other[0] != base:
                raise PlanError(
                    f"alias group {t.alias_group!r}: {other[1]!r} and {t.name!r} do not keep "
                    f"their alias offsets (group base {other[0]} vs {base})")
    _check_conflicts(tensors, p.offsets)


def _check_conflicts(tensors: Sequence[TensorSpec], offsets: Mapping[str, int]) -> None:
    # Sweep over steps, ends before starts (lifetimes are half-open). Per branch key, the
    # live tensors sorted by offset. The first conflict raises, so everything live in one
    # key list is pairwise disjoint except views of one group; then only the neighbours
    # of a new tensor can overlap it (see _check_against).
    events = []
    for i, t in enumerate(tensors):
        events.append((t.start, 1, i))
        events.append((t.end, 0, i))
    events.sort()
    live: dict[Hashable | None, list[tuple[int, int, int]]] = {}
    for step, starting, i in events:
        t = tensors[i]
        o = offsets[t.name]
        entry = (o, o + t.size, i)
        if not starting:
            lst = live[t.branch]
            del lst[bisect_left(lst, entry)]
            continue
        if t.branch is None:
            keys: Iterable = live.keys()
        else:
            keys = (k for k in (None, t.branch) if k in live)
        for k in keys:
            _check_against(live[k], entry, tensors, step)
        insort(live.setdefault(t.branch, []), entry)


def _check_against(lst: list[tuple[int, int, int]], entry: tuple[int, int, int],
                   tensors: Sequence[TensorSpec], step: int) -> None:
    o, e, i = entry
    t = tensors[i]

    def clash(oo: int, ee: int, j: int) -> None:
        other = tensors[j]
        if t.alias_group is not None and other.alias_group == t.alias_group:
            return  # views of one storage overlap by design
        where = "" if t.branch is None and other.branch is None else (
            f" (branches {other.branch!r} and {t.branch!r})")
        raise PlanError(f"tensors {other.name!r} and {t.name!r} overlap: both use bytes "
                        f"[{max(o, oo)}, {min(e, ee)}) and both are live at step {step}{where}")

    pos = bisect_left(lst, (o,))
    # Everything starting inside [o, e) overlaps the new tensor.
    j = pos
    while j < len(lst) and lst[j][0] < e:
        clash(*lst[j])
        j += 1
    # Before it: the nearest entry, then earlier ones only while they are views of the
    # nearest entry's group. An earlier entry reaching past o would contain the nearest
    # entry's start, and only a view of the same group may overlap it.
    j = pos - 1
    if j < 0:
        return
    near_group = tensors[lst[j][2]].alias_group
    while j >= 0:
        oo, ee, jj = lst[j]
        if j < pos - 1 and (near_group is None or tensors[jj].alias_group != near_group):
            break
        if ee > o:
            clash(oo, ee, jj)
        j -= 1


# --------------------------------------------------------------------------- slot plans


class SlotPlanEntry(NamedTuple):
    """One tensor of a plan in the seven-field form of the dynamic-CP capture interface.

    How :func:`export_slot_plan` fills the fields (``-1`` means "not applicable"):

    * ``saved_arena_id``: the arena holding the tensor when it is a saved tensor
      (activation, graph I/O, input staging: anything not in ``user_grads``); else -1.
    * ``physical_slot``: the tensor's offset in units of ``slot_bytes``. Equal slots in
      different branches are the same physical bytes, which is what lets exclusive
      alternatives share memory.
    * ``io_branch_id``: index of the tensor's branch in the branch table (see
      :func:`branch_table`); -1 for a tensor common to all branches.
    * ``model_chunk``, ``layer``: where the tensor comes from in the model, as given by
      the caller (``origin``); -1 when unknown. They do not affect placement.
    * ``warmup_alias_group``: index of the tensor's alias group in order of first
      appearance in ``plan.tensors``; -1 for a tensor without one.
    * ``user_grad_arena_id``: the arena holding the tensor when it is a user-visible
      gradient (named in ``user_grads``); else -1.

    Exactly one of the two arena ids is set.
    """

    saved_arena_id: int
    physical_slot: int
    io_branch_id: int
    model_chunk: int
    layer: int
    warmup_alias_group: int
    user_grad_arena_id: int


def branch_table(tensors: Sequence[TensorSpec],
                 branches: Sequence[Hashable] | None = None) -> list[Hashable]:
    """Branch ids in index order.

    Args:
        tensors: the specs whose branches are listed.
        branches: the order to use, if given.

    Returns:
        ``branches`` if given, else the branch ids in order of first appearance.
    """
    if branches is not None:
        return list(branches)
    out: dict[Hashable, None] = {}
    for t in tensors:
        if t.branch is not None:
            out.setdefault(t.branch, None)
    return list(out)


def _alias_table(tensors: Sequence[TensorSpec]) -> dict[Hashable, int]:
    out: dict[Hashable, int] = {}
    for t in tensors:
        if t.alias_group is not None:
            out.setdefault(t.alias_group, len(out))
    return out


def _slot_bytes(tensors: Sequence[TensorSpec], slot_bytes: int | None) -> int:
    if slot_bytes is None:
        # Every offset is a multiple of its tensor's align, hence of the smallest one.
        return min((t.align for t in tensors), default=1)
    if not _is_int(slot_bytes) or slot_bytes <= 0:
        raise PlanError(f"slot_bytes must be a positive integer, got {slot_bytes!r}")
    return slot_bytes


def export_slot_plan(p: Plan, *, arena_id: int = 0, slot_bytes: int | None = None,
                     branches: Sequence[Hashable] | None = None,
                     user_grads: Collection[str] = (),
                     origin: Mapping[str, tuple[int, int]] | Callable[[TensorSpec], tuple[int, int]]
                     | None = None) -> list[SlotPlanEntry]:
    """One :class:`SlotPlanEntry` per tensor of ``p``, in ``p.tensors`` order.

    Args:
        arena_id: the id written to the arena field (>= 0).
        slot_bytes: bytes per physical slot; default the smallest ``align`` of the plan,
            which divides every offset. An offset it does not divide is an error.
        branches: the branch table; default the order of first appearance.
        user_grads: names of tensors that are user-visible gradients.
        origin: ``(model_chunk, layer)`` per tensor name, or a function of the spec.
    """
    if not _is_int(arena_id) or arena_id < 0:
        raise PlanError(f"arena_id must be a non-negative integer, got {arena_id!r}")
    tensors = p.tensors
    unit = _slot_bytes(tensors, slot_bytes)
    btab = {b: k for k, b in enumerate(branch_table(tensors, branches))}
    atab = _alias_table(tensors)
    grads = set(user_grads)
    unknown = grads - {t.name for t in tensors}
    if unknown:
        raise PlanError(f"user_grads names tensors that the plan does not have: {sorted(unknown)[:5]}")
    out = []
    for t in tensors:
        o = p.offsets[t.name]
        if o % unit:
            raise PlanError(f"tensor {t.name!r}: offset {o} is not a multiple of "
                            f"slot_bytes {unit}; pass a smaller slot_bytes")
        if t.branch is not None and t.branch not in btab:
            raise PlanError(f"tensor {t.name!r}: branch {t.branch!r} is not in the branch table")
        if origin is None:
            chunk, layer = -1, -1
        elif callable(origin):
            chunk, layer = origin(t)
        else:
            chunk, layer = origin.get(t.name, (-1, -1))
        is_grad = t.name in grads
        out.append(SlotPlanEntry(
            saved_arena_id=-1 if is_grad else arena_id,
            physical_slot=o // unit,
            io_branch_id=-1 if t.branch is None else btab[t.branch],
            model_chunk=chunk,
            layer=layer,
            warmup_alias_group=-1 if t.alias_group is None else atab[t.alias_group],
            user_grad_arena_id=arena_id if is_grad else -1))
    return out


def import_slot_plan(entries: Sequence[Sequence[int]], tensors: Sequence[TensorSpec], *,
                     slot_bytes: int | None = None,
                     branches: Sequence[Hashable] | None = None,
                     arena_bytes: int | None = None) -> Plan:
    """The :class:`Plan` that ``entries`` describe for ``tensors`` (same order, same length).

    ``slot_bytes`` and ``branches`` must be what the export used. The entries decide the
    offsets; their branch and alias indices must agree with the specs, and all entries
    must name one arena.

    Args:
        entries: seven-field slot-plan rows, one per tensor.
        tensors: the specs the export was made from.
        slot_bytes: bytes per physical slot, as at export.
        branches: branch ids in index order, as at export.
        arena_bytes: the arena's size (default: the end of the highest tensor).

    Returns:
        The plan, checked with :func:`verify`.

    Raises:
        PlanError: entries that disagree with the specs or with each other, or a plan
            that does not verify.
    """
    tensors = tuple(tensors)
    if len(entries) != len(tensors):
        raise PlanError(f"{len(entries)} slot plan entries for {len(tensors)} tensors")
    _validate(tensors, None)
    unit = _slot_bytes(tensors, slot_bytes)
    btab = {b: k for k, b in enumerate(branch_table(tensors, branches))}
    atab = _alias_table(tensors)
    arena: int | None = None
    offsets: dict[str, int] = {}
    for k, (raw, t) in enumerate(zip(entries, tensors)):
        who = f"slot plan entry {k} ({t.name!r})"
        if len(raw) != 7 or not all(_is_int(x) for x in raw):
            raise PlanError(f"{who}: expected seven integers, got {tuple(raw)!r}")
        e = SlotPlanEntry(*raw)
        ids = [x for x in (e.saved_arena_id, e.user_grad_arena_id) if x >= 0]
        if len(ids) != 1:
            raise PlanError(f"{who}: exactly one of saved_arena_id and user_grad_arena_id "
                            f"must be set (>= 0), got {e.saved_arena_id} and {e.user_grad_arena_id}")
        if arena is None:
            arena = ids[0]
        elif ids[0] != arena:
            raise PlanError(f"{who}: arena {ids[0]} differs from arena {arena} of entry 0; "
                            f"a plan is one arena")
        if t.branch is not None and t.branch not in btab:
            raise PlanError(f"{who}: branch {t.branch!r} is not in the branch table")
        want_branch = -1 if t.branch is None else btab[t.branch]
        if e.io_branch_id != want_branch:
            raise PlanError(f"{who}: io_branch_id {e.io_branch_id} but the tensor's branch "
                            f"{t.branch!r} has index {want_branch}")
        want_group = -1 if t.alias_group is None else atab[t.alias_group]
        if e.warmup_alias_group != want_group:
            raise PlanError(f"{who}: warmup_alias_group {e.warmup_alias_group} but the tensor's "
                            f"alias group {t.alias_group!r} has index {want_group}")
        if e.physical_slot < 0:
            raise PlanError(f"{who}: physical_slot must be >= 0, got {e.physical_slot}")
        offsets[t.name] = e.physical_slot * unit
    top = max((offsets[t.name] + t.size for t in tensors), default=0)
    if arena_bytes is None:
        arena_bytes = top
    p = Plan(arena_bytes, offsets, lower_bound(tensors), tensors)
    verify(p)
    return p
