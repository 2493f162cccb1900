"""Internal to :mod:`graphslot.planner`: the checks that involve several tensors, and
the blocks the packers place (one per tensor, or one per alias group).

:func:`validate` is shared by planning, :func:`~graphslot.planner.verify` and the slot
plan import, which use it for the checks alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Hashable, Sequence

from .lifetimes import merge_intervals
from .specs import PlanError, TensorSpec

__all__ = ["Block", "validate"]


@dataclass(eq=False, slots=True)
class Block:
    """What the packer places: one tensor, or one alias group as a unit."""

    extent: int  # bytes from the block start to the end of its last member
    align: int  # block start must be ≡ phase (mod align)
    phase: int
    branch: Hashable | None
    spans: list[tuple[int, int]]  # merged lifetime intervals, in steps
    members: list[tuple[int, int]]  # (index into tensors, byte offset from block start)
    life: int  # steps live (the sum of spans, in schedule steps)
    nodes: tuple[int, list[int], list[int]] | None = None  # cached by the packers: n, tree nodes


def validate(tensors: Sequence[TensorSpec],
             branches: Collection[Hashable] | None) -> list[Block]:
    """Check the rules that involve several tensors and build the blocks to place."""
    allowed = None if branches is None else set(branches)
    seen: dict[str, int] = {}
    groups: dict[Hashable, list[int]] = {}
    blocks: list[Block] = []
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
            blocks.append(Block(t.size, t.align, 0, t.branch, [(t.start, t.end)], [(i, 0)],
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
        blocks.append(Block(
            extent=max(tensors[i].alias_offset + tensors[i].size for i in idx) - base,
            align=a.align, phase=phase, branch=first.branch, spans=spans,
            members=[(i, tensors[i].alias_offset - base) for i in idx],
            life=sum(e - s for s, e in spans)))
    return blocks
