"""Internal to :mod:`graphslot.planner`: which placements to try, and in what order.

The candidates (an order, a fit rule, fused or coarse extents; :data:`CANDIDATES`), the
textbook ones among them (:data:`BASELINES`), the work budget that bounds the extra
ones (:func:`extra_work`, :class:`Budget`), :func:`run_candidates` that keeps the
smallest arena, and the squeaky-wheel :func:`refine` after it. :func:`prepare` turns
specs into the blocks they all place.
"""

from __future__ import annotations

import math
from typing import Callable, Collection, Hashable, NamedTuple, Sequence

from .blocks import Block, validate
from .placement import Fit, best_fit, first_fit, pack, pack_sweep
from .specs import TensorSpec

__all__ = ["Candidate", "CANDIDATES", "BASELINES", "Budget", "extra_work", "prepare",
           "run_candidates", "refine"]


def _bundle(blocks: list[Block], unit: int) -> list[Block]:
    """Fuse blocks with identical lifetimes and branch into one contiguous block each.

    Real schedules save many tensors per layer that are born and freed together; packing
    them as one block keeps them from scattering into gaps they fragment, and shrinks
    the problem. Biggest alignment first, so padding stays minimal.
    """
    same: dict[tuple, list[Block]] = {}
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
        out.append(Block(pos, parts[0].align, 0, parts[0].branch, parts[0].spans, members,
                         parts[0].life))
    return out


# Orders: sort keys of a block. Ties left by a key keep input order (sorts are stable).

def _by_size_then_start(b: Block) -> tuple:
    # Equal tensors of successive microbatches then stack into the same few slots.
    return (-b.extent, b.spans[0][0], -b.spans[-1][1])


def _by_lifetime_then_size(b: Block) -> tuple:
    return (-sum(e - s for s, e in b.spans), -b.extent, b.spans[0][0])


def _by_start_larger_first(b: Block) -> tuple:
    # The textbook first-fit order: allocation order of the schedule itself.
    return (b.spans[0][0], -b.extent)


def _by_size_longest_lived_first(b: Block) -> tuple:
    # Greedy by size as in the TFLite and ONNX Runtime offline planners; ties go to the
    # longest-lived tensor (in schedule steps, not compressed ones).
    return (-b.extent, -b.life)


def _sweep(b: Block) -> tuple:
    # Start order, longest-lived first on ties, then larger: what is born together is
    # stacked so the longest stays lowest and the short-lived above it free together.
    return (b.spans[0][0], -b.spans[-1][1], -b.extent)


def _sweep_reversed(b: Block) -> tuple:
    # The same sweep with time running backwards (an end order): schedules are not
    # symmetric, and backward passes free in a different pattern than forwards allocate.
    return (-b.spans[-1][1], b.spans[0][0], -b.extent)


class Candidate(NamedTuple):
    """One way to place: an order, a gap rule, and whether equal lifetimes are fused."""

    name: str
    fuse: bool
    order: Callable[[Block], tuple]
    fit: Fit
    baseline: bool = False  # a textbook planner: always tried, reported by baselines()
    sweep: int = 0  # 1: the order is by first step, -1: by last step descending (see pack_sweep)
    cost: float = 1.0  # budget drawn per block placed (see extra_work); 0: always runs
    coarse: bool = False  # place extents rounded up to _COARSE_BITS significant bits


#: The textbook planners plan() is never worse than, by name.
BASELINES: tuple[str, ...] = ("first-fit", "greedy-by-size")

#: Refinement runs in turn, while the budget lasts: (coarse extents, first order, bump).
#: Coarse extents first: near-equal tensors then trade places cleanly.
_REFINE_RUNS: tuple[tuple[bool, Callable[[Block], tuple], float], ...] = (
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


def _coarse(blocks: list[Block]) -> list[Block]:
    """``blocks`` with extents rounded up as :data:`_COARSE_BITS` says; same order and
    members, so their starts place the real blocks (each inside its rounded one)."""
    out = []
    for b in blocks:
        g = 1 << max(0, b.extent.bit_length() - _COARSE_BITS)
        out.append(Block(-(-b.extent // g) * g, b.align, b.phase, b.branch, b.spans,
                         b.members, b.life, b.nodes))
    return out

#: Tried in turn; plan() keeps the smallest arena. The sweeps come first: they cost little
#: (a placement reads only what is live) and usually win, so the step-tree candidates
#: after them are abandoned early. Once a plan is within _GOOD_ENOUGH of the lower bound
#: only the baselines not yet tried still run (each abandoned as soon as it cannot win);
#: at the lower bound itself nothing more runs. Step-tree candidates that are not
#: baselines, and the refinement, draw on a work budget (see extra_work).
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("sweep", False, _sweep, first_fit, sweep=1, cost=0),
    Candidate("sweep-coarse", False, _sweep, first_fit, sweep=1, cost=_SWEEP_COST,
              coarse=True),
    Candidate("sweep-reversed-coarse", False, _sweep_reversed, first_fit, sweep=-1,
              cost=_SWEEP_COST, coarse=True),
    Candidate("sweep-best-fit", False, _sweep, best_fit, sweep=1, cost=_SWEEP_COST),
    Candidate("sweep-reversed", False, _sweep_reversed, first_fit, sweep=-1, cost=_SWEEP_COST),
    Candidate("sweep-best-fit-coarse", False, _sweep, best_fit, sweep=1, cost=_SWEEP_COST,
              coarse=True),
    Candidate("sweep-reversed-best-fit", False, _sweep_reversed, best_fit, sweep=-1,
              cost=_SWEEP_COST),
    Candidate("first-fit", False, _by_start_larger_first, first_fit, baseline=True, sweep=1,
              cost=0),
    Candidate("greedy-by-size", False, _by_size_longest_lived_first, best_fit, baseline=True,
              cost=0),
    Candidate("size-start-fused", True, _by_size_then_start, best_fit),
    Candidate("lifetime-size", False, _by_lifetime_then_size, best_fit),
    Candidate("size-start", False, _by_size_then_start, best_fit),
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


def extra_work(n: int) -> float:
    """The work budget for ``n`` blocks, in step-tree block placements."""
    return max(_EXTRA_WORK - _EXTRA_SLOPE * n, _EXTRA_FLOOR * n)


class Budget:
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


def prepare(specs: tuple[TensorSpec, ...],
            branches: Collection[Hashable] | None) -> tuple[list[Block], int, int]:
    """Validated blocks with spans in compressed steps, the number of steps, and the
    byte unit the blocks are measured in.

    The unit is the largest power of two dividing every extent and phase, so every
    start a fit rule can pick is a multiple of it; extents, aligns and phases are
    divided by it (an align below the unit becomes 1). Packing is unchanged, only
    faster: offsets of realistic arenas stay below 2**30 units, which CPython compares
    and sorts as single-digit integers."""
    blocks = validate(specs, branches)
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


def _arena(cand: list[Block], starts: list[int]) -> int:
    return max((s + b.extent for s, b in zip(starts, cand)), default=0)


def run_candidates(cands: Sequence[Candidate], blocks: list[Block], nsteps: int,
                   unit: int, lb: float, early_stop: bool = True,
                   budget: Budget | None = None) -> tuple[int, list[Block], list[int]]:
    """The smallest arena of ``cands``: (arena, the blocks placed, their starts), in
    units of ``unit`` bytes, as ``lb`` is. Candidates with a cost run only while
    ``budget`` has a full pass left (without one, all run)."""
    best: tuple[int, list[Block], list[int]] | None = None
    fused: list[Block] | None = None
    coarse: list[Block] | None = None
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
            starts = pack_sweep(placed, order, nsteps, c.fit, limit, c.sweep < 0)
        else:
            starts = pack(placed, order, nsteps, c.fit, limit)
        if starts is not None and (best is None or _arena(cand, starts) < best[0]):
            best = (_arena(cand, starts), cand, starts)
    if best is None:  # no tensors
        return 0, blocks, []
    return best


def refine(blocks: list[Block], nsteps: int, lb: float,
           best: tuple[int, list[Block], list[int]],
           budget: Budget) -> tuple[int, list[Block], list[int]]:
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
            starts = pack(placed, order, nsteps, first_fit)
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
