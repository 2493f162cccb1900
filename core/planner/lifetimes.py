"""Lifetimes and the lower bound: :func:`lower_bound`, the most bytes live at any step
in any branch, which no valid plan can beat; and :func:`merge_intervals`, the union of
lifetimes (also used by :mod:`graphslot.paged`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Hashable, Iterable, Sequence

from .specs import TensorSpec

__all__ = ["merge_intervals", "lower_bound"]


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
