"""Checking a plan: :func:`verify`, for any :class:`~graphslot.planner.Plan`, from
:func:`~graphslot.planner.plan` or elsewhere. Independent of how plans are made.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Hashable, Iterable, Mapping, Sequence

from .blocks import validate
from .specs import Plan, PlanError, TensorSpec, is_int

__all__ = ["verify"]


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
    validate(tensors, None)
    if not is_int(p.arena_bytes) or p.arena_bytes < 0:
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
        if not is_int(o) or o < 0:
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
