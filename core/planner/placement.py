"""Internal to :mod:`graphslot.planner`: placing blocks in a given order.

Two packers: :func:`pack` keeps what is taken in segment trees over the steps and takes
any order; :func:`pack_sweep` takes an order by first step (or by last step, backwards)
and keeps only the free gaps of what is live now, which is much cheaper. Both put each
block where a fit rule (:func:`first_fit`, :func:`best_fit`) says, and give up as soon
as the arena would reach a limit. Which orders to try is :mod:`.heuristics`' business.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from heapq import heappop, heappush
from itertools import chain, compress, count
from operator import sub
from typing import Callable, Hashable, Iterable, Sequence

from .blocks import Block

__all__ = ["Fit", "first_fit", "best_fit", "pack", "pack_sweep"]


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
Fit = Callable[[list[int], list[int], int, int, int, int], int]


def first_fit(los: list[int], his: list[int], top: int, size: int, align: int,
              phase: int) -> int:
    """The lowest start where ``size`` bytes fit."""
    # Gap widths compared with size and filtered to indices, all C-level iterators.
    for i in compress(count(), map(size.__le__, map(sub, his, los))):
        lo = los[i]
        start = lo + (phase - lo) % align
        if start + size <= his[i]:
            return start
    return top + (phase - top) % align


def best_fit(los: list[int], his: list[int], top: int, size: int, align: int,
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
    """The free gaps below the top of the union of ``taken`` (see :data:`Fit`), and
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


def _nodes(blk: Block, n: int) -> tuple[list[int], list[int]]:
    nodes = blk.nodes
    if nodes is None or nodes[0] != n:
        nodes = blk.nodes = (n, *_tree_nodes(n, blk.spans))
    return nodes[1], nodes[2]


def pack(blocks: list[Block], order: Sequence[int], nsteps: int, fit: Fit = best_fit,
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


def pack_sweep(blocks: list[Block], order: Sequence[int], nsteps: int,
               fit: Fit = first_fit, limit: float = math.inf,
               reverse: bool = False) -> list[int] | None:
    """:func:`pack` for an ``order`` sorted by first step (by last step, descending,
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
