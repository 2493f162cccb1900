"""The seven-field slot plan of the dynamic context-parallel capture interface:
:class:`SlotPlanEntry` rows, written by :func:`export_slot_plan` and read back by
:func:`import_slot_plan`, with branch indices from :func:`branch_table`.
"""

from __future__ import annotations

from typing import Callable, Collection, Hashable, Mapping, NamedTuple, Sequence

from .blocks import validate
from .lifetimes import lower_bound
from .specs import Plan, PlanError, TensorSpec, is_int
from .verification import verify

__all__ = ["SlotPlanEntry", "branch_table", "export_slot_plan", "import_slot_plan"]


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
    if not is_int(slot_bytes) or slot_bytes <= 0:
        raise PlanError(f"slot_bytes must be a positive integer, got {slot_bytes!r}")
    return slot_bytes


def export_slot_plan(p: Plan, *, arena_id: int = 0, slot_bytes: int | None = None,
                     branches: Sequence[Hashable] | None = None,
                     user_grads: Collection[str] = (),
                     origin: Mapping[str, tuple[int, int]] | Callable[[TensorSpec], tuple[int, int]]
                     | None = None) -> list[SlotPlanEntry]:
    """One :class:`SlotPlanEntry` per tensor of ``p``, in ``p.tensors`` order.

    Args:
        p: the plan (:func:`~graphslot.planner.plan`'s, say) whose tensors are exported.
        arena_id: the id written to the arena field (>= 0).
        slot_bytes: bytes per physical slot; default the smallest ``align`` of the plan,
            which divides every offset. An offset it does not divide is an error.
        branches: the branch table; default the order of first appearance.
        user_grads: names of tensors that are user-visible gradients.
        origin: ``(model_chunk, layer)`` per tensor name, or a function of the spec.
    """
    if not is_int(arena_id) or arena_id < 0:
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
    validate(tensors, None)
    unit = _slot_bytes(tensors, slot_bytes)
    btab = {b: k for k, b in enumerate(branch_table(tensors, branches))}
    atab = _alias_table(tensors)
    arena: int | None = None
    offsets: dict[str, int] = {}
    for k, (raw, t) in enumerate(zip(entries, tensors)):
        who = f"slot plan entry {k} ({t.name!r})"
        if len(raw) != 7 or not all(is_int(x) for x in raw):
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
