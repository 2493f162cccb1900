"""The planning entry points: :func:`plan`, and :func:`baselines` (the textbook plans
that :func:`plan` is never worse than).
"""

from __future__ import annotations

from typing import Collection, Hashable, Iterable, Sequence

from .blocks import Block
from .heuristics import CANDIDATES, Budget, extra_work, prepare, refine, run_candidates
from .lifetimes import lower_bound
from .specs import Plan, TensorSpec

__all__ = ["plan", "baselines"]


def _offsets(specs: Sequence[TensorSpec], cand: list[Block], starts: list[int],
             unit: int) -> dict[str, int]:
    offsets: dict[str, int] = {}
    for b, start in zip(cand, starts):
        for i, rel in b.members:
            offsets[specs[i].name] = start * unit + rel
    # Offsets in input order, so plans print and serialise predictably.
    return {t.name: offsets[t.name] for t in specs}


def plan(tensors: Iterable[TensorSpec], *,
         branches: Collection[Hashable] | None = None) -> Plan:
    """Place ``tensors`` in one arena; see :mod:`graphslot.planner` for the rules.

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
    blocks, nsteps, unit = prepare(specs, branches)
    lb = lower_bound(specs)
    budget = Budget(extra_work(len(blocks)))
    best = run_candidates(CANDIDATES, blocks, nsteps, unit, lb / unit, budget=budget)
    arena, cand, starts = refine(blocks, nsteps, lb / unit, best, budget)
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
    blocks, nsteps, unit = prepare(specs, branches)
    lb = lower_bound(specs)
    out = {}
    for c in CANDIDATES:
        if c.baseline:
            arena, cand, starts = run_candidates([c], blocks, nsteps, unit, lb / unit)
            out[c.name] = Plan(arena * unit, _offsets(specs, cand, starts, unit), lb, specs)
    return out
