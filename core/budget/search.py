"""The search: the fastest plan that fits a budget (:func:`plan_budget`), checked against
what builds hold (:func:`fit_budget`). Imports the model and the costs."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

from ..errors import BudgetError, UsageError
from ..sizes import format_bytes
from .costs import (_ALL_CHOICES, AUTO_MIN_SAVING, AUTO_SLACK, CHOICES, EXHAUSTIVE_LAYERS,
                    FIT_BUILDS, KEEP, MODES, OFFLOAD, RECOMPUTE, RECOMPUTE_CHEAP, SEARCH_STARTS,
                    BudgetPlan, StackProfile, parse_budget, reported, short)
from .model import _has_homes, recompute_ms, score, slot_bytes


@dataclass(frozen=True)
class _Scored:
    """One candidate: its choices, its engine mode and what the model says of them."""

    choices: tuple[str, ...]
    mode: str
    step: float
    bound: float
    peak: int


def _options(profile: StackProfile) -> list[tuple[str, ...]]:
    """The choices the search may give each layer."""
    return [_ALL_CHOICES if c.cheap else CHOICES for c in profile.layers]


def _modes(choices: Sequence[str]) -> tuple[str, ...]:
    # resident: two banks, no driver call per step; remap: one bank, mapped per pass; a
    # recomputed layer's input may go to the host too, or stay (off)
    if OFFLOAD in choices:
        return ("resident", "remap")
    return ("off", "resident", "remap") if RECOMPUTE in choices else ("off",)


def _scored_all(profile: StackProfile, choices: tuple[str, ...]) -> tuple[_Scored, ...]:
    """``choices`` scored in each engine mode it may run in."""
    scored = _scored_unfixed(_unfixed(profile), choices)
    if not profile.fixed_bytes:
        return scored
    fixed = profile.fixed_bytes
    return tuple(_Scored(s.choices, s.mode, s.step, s.bound, s.peak + fixed) for s in scored)


@functools.lru_cache(maxsize=16)
def _unfixed(profile: StackProfile) -> StackProfile:
    # A plan's peak is the profile's fixed memory plus what the plan adds, and nothing
    # else depends on that memory: plans are scored once for every correction of it that
    # fit_budget makes (one object per profile, so that its hash is computed once).
    return replace(profile, fixed_bytes=0)


@functools.lru_cache(maxsize=1 << 17)
def _scored_unfixed(profile: StackProfile, choices: tuple[str, ...]) -> tuple[_Scored, ...]:
    # (cached: the searches score the same plans over and over)
    return tuple(_Scored(choices, m, *score(profile, choices, m)) for m in _modes(choices))


Objective = Callable[[_Scored], tuple]


def _fastest_within(budget: int | None, bound: bool = False) -> Objective:
    """Plans that fit first, the fastest of them (by the bound if ``bound``); of those that
    do not fit, the smallest."""
    def key(s: _Scored) -> tuple:
        t = s.bound if bound else s.step
        if budget is None or s.peak <= budget:
            return (0, t, s.peak)
        return (1, s.peak, t)
    return key


def _smallest(s: _Scored) -> tuple:
    return (s.peak, s.step)


def _smallest_within(limit: float) -> Objective:
    """Plans no slower than ``limit`` first, the smallest of them."""
    def key(s: _Scored) -> tuple:
        return (0, s.peak, s.step) if s.step <= limit else (1, s.step, s.peak)
    return key


def _seeds(n: int, cheap: bool = False) -> list[tuple[str, ...]]:
    """Starting points by position: no offload; the first k layers offloaded; every other
    layer from the first; k layers spread evenly; each with the rest kept or recomputed
    (or, with ``cheap``, recomputed cheaply)."""
    seeds: set[tuple[str, ...]] = set()
    for k in range(n + 1):
        sets = {tuple(range(k)),
                tuple(range(0, 2 * k, 2)) if 2 * k <= n else tuple(range(k)),
                tuple(sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})) if k > 1
                else tuple(range(k))}
        for s in sets:
            for rest in (KEEP, RECOMPUTE) + ((RECOMPUTE_CHEAP,) if cheap else ()):
                seeds.add(tuple(OFFLOAD if i in s else rest for i in range(n)))
    return sorted(seeds)


def _changes(cur: tuple[str, ...], options: Sequence[tuple[str, ...]]
             ) -> Iterable[tuple[str, ...]]:
    """Every plan one layer's choice away (each layer's choice among its ``options``)."""
    for i in range(len(cur)):
        for c in options[i]:
            if c != cur[i]:
                yield cur[:i] + (c,) + cur[i + 1:]


def _swaps(cur: tuple[str, ...], options: Sequence[tuple[str, ...]]
           ) -> Iterable[tuple[str, ...]]:
    """Every plan one swap of two layers' choices away."""
    n = len(cur)
    for i in range(n):
        for j in range(i + 1, n):
            if cur[i] != cur[j] and cur[i] in options[j] and cur[j] in options[i]:
                m = list(cur)
                m[i], m[j] = m[j], m[i]
                yield tuple(m)


def _search(profile: StackProfile, key: Objective, exhaustive: bool | None = None,
            modes: Sequence[str] = MODES, starts: int = SEARCH_STARTS,
            also: Sequence[tuple[str, ...]] = ()) -> _Scored:
    """The candidate with the least ``key`` among those in ``modes``: every combination for
    small stacks, else a local search from the best ``starts`` position patterns and the
    plans in ``also``."""
    n = len(profile.layers)

    def _scored(profile: StackProfile, choices: tuple[str, ...]) -> list[_Scored]:
        # (a plan without offload runs alike in any engine mode)
        return [s for s in _scored_all(profile, choices) if s.mode in modes or s.mode == "off"]

    options = _options(profile)
    if exhaustive is None:
        # (as many combinations as three choices over EXHAUSTIVE_LAYERS layers)
        exhaustive = math.prod(len(o) for o in options) <= len(CHOICES) ** EXHAUSTIVE_LAYERS
    if exhaustive:
        return min((s for ch in itertools.product(*options) for s in _scored(profile, ch)),
                   key=key)
    seeds = [ch for ch in _seeds(n, any(c.cheap for c in profile.layers))
             if all(c in o for c, o in zip(ch, options))]
    firsts = sorted((s for ch in seeds for s in _scored(profile, ch)), key=key)[:starts]
    firsts += [s for ch in also for s in _scored(profile, tuple(ch))]
    best: _Scored | None = None
    seen: set[tuple[str, ...]] = set()
    # Plans an earlier start's climb stood on: a climb that reaches one would mostly
    # retrace that climb, so it stops there.
    climbed: set[tuple[tuple[str, ...], str]] = set()
    cur = firsts[0]

    def climb(near: Callable[..., Iterable[tuple[str, ...]]]) -> bool:
        """One pass over ``near``'s plans from ``cur``, moving to each better one."""
        nonlocal cur
        was = cur
        for m in near(cur.choices, options):
            if m in seen:  # (it lost to a plan no better than ``cur``)
                continue
            seen.add(m)
            for cand in _scored(profile, m):
                if key(cand) < key(cur):
                    cur = cand
        return cur is not was

    for s in firsts:
        cur = s
        # Single changes until none helps, then swaps (n times as many) until one does.
        while (cur.choices, cur.mode) not in climbed:
            climbed.add((cur.choices, cur.mode))
            if not climb(_changes) and not climb(_swaps):
                break
        if best is None or key(cur) < key(best):
            best = cur
        seen.clear()
    assert best is not None
    return best


def smallest_peak(profile: StackProfile, exhaustive: bool | None = None,
                  modes: Sequence[str] = MODES) -> int:
    """The least predicted peak any plan (in ``modes``) reaches."""
    return _search(profile, _smallest, exhaustive, modes).peak


def plan_budget(profile: StackProfile, budget: int | str | None, *,
                exhaustive: bool | None = None, modes: Sequence[str] = MODES) -> BudgetPlan:
    """The fastest plan whose predicted peak fits ``budget``.

    Args:
        profile: what each layer costs.
        budget: bytes the step may hold at its peak (or a size string, see
            :func:`parse_budget`); ``"auto"``: the least memory among plans at most
            :data:`AUTO_SLACK` slower than keeping everything (memory saved where saving
            is free), or everything kept where that saves less than
            :data:`AUTO_MIN_SAVING` of the peak; None: the fastest plan.
        exhaustive: try every combination (default: for stacks of up to
            :data:`EXHAUSTIVE_LAYERS` layers), else a local search.
        modes: the engine modes the plan may use for offload (``("off",)``: keep or
            recompute only; a plan without offload needs no mode of its own).

    Raises:
        BudgetError: ``budget`` is below the smallest peak any plan reaches (the message
            names that peak; ``least_bytes`` holds it).
        UsageError: ``budget`` is not a size.
    """
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"modes {list(modes)}: each is one of {', '.join(MODES)}")
    n = len(profile.layers)
    keep_all = _scored_all(profile, (KEEP,) * n)[0]
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        best = _search(profile, _smallest_within(keep_all.step * (1 + AUTO_SLACK)), exhaustive,
                       modes)
        if best.peak >= keep_all.peak:
            return _plan(profile, keep_all, None, "nothing pays: every plan that saves memory is "
                         "predicted slower than keeping every layer's activations", exhaustive,
                         modes)
        floor = max(profile.granularity, int(AUTO_MIN_SAVING * keep_all.peak))
        if keep_all.peak - best.peak < floor:
            return _plan(profile, keep_all, None,
                         f"nothing pays: the plans at most {AUTO_SLACK:.0%} slower than keeping "
                         f"everything save at most {format_bytes(keep_all.peak - best.peak)}, "
                         f"under {format_bytes(floor)} ({AUTO_MIN_SAVING:.0%} of the peak, at "
                         "least a granule)", exhaustive, modes)
        return _plan(profile, best, None,
                     f"saves {format_bytes(keep_all.peak - best.peak)} at most "
                     f"{AUTO_SLACK:.0%} slower than keeping everything", exhaustive, modes)
    limit = None if budget is None else parse_budget(budget)
    best = _search(profile, _fastest_within(limit), exhaustive, modes)
    if limit is not None and best.peak > limit:
        least = smallest_peak(profile, exhaustive, modes)
        raise BudgetError(
            f"memory budget {format_bytes(limit)} ({limit} bytes) is below the smallest peak "
            f"any plan reaches, {format_bytes(least)} ({least} bytes); of that, the stack's "
            f"fixed memory (weights, gradients, buffers) is {format_bytes(profile.fixed_bytes)}",
            budget_bytes=limit, least_bytes=least)
    if all(c == KEEP for c in best.choices):
        reason = "everything fits on the device: nothing to save"
    elif best.step <= keep_all.step * (1 + AUTO_SLACK):
        reason = "the copies hide under compute"
    else:
        reason = (f"the fastest plan that fits: {best.step / keep_all.step:.2f} x the step "
                  "that keeps everything")
    return _plan(profile, best, limit, reason, exhaustive, modes)


def fit_budget(profile: StackProfile, budget: int | str | None,
               build: Callable[[BudgetPlan], int | None], *, measured: bool = True,
               exhaustive: bool | None = None, modes: Sequence[str] = MODES) -> BudgetPlan:
    """The fastest plan whose peak, as built, fits ``budget``: plan from the model, build,
    and where what the build holds differs from the model's figure, count the difference
    in the profile's fixed memory and plan again (the model's figure is an estimate; the
    build's is what the step will hold). A budget the model calls too small gets its
    least plan built before it is refused, and where that holds too much, the least plan
    that stores the gradients the other way (see :func:`gradient_homes`) too.

    Args:
        profile, budget, exhaustive, modes: as :func:`plan_budget`.
        build: builds a plan and returns the peak it will hold, measured (None: it cannot
            tell, and the model's figure stands). The plan of its last call is the one
            returned: the caller holds what it built last.
        measured: whether ``build`` can measure (False: the model decides, and a budget it
            calls too small is refused without building anything).

    Returns:
        The plan, its ``predicted_peak_bytes`` the measured figure where there is one.

    Raises:
        UsageError: as :func:`plan_budget`; or no plan fits once built (the message
            names the least that a built plan held).
    """
    fixed = profile.fixed_bytes

    def built(plan: BudgetPlan) -> tuple[BudgetPlan, int | None]:
        got = build(plan)
        if got is None:
            return plan, None
        return replace(plan, predicted_peak_bytes=got, model_peak_bytes=plan.predicted_peak_bytes,
                       fixed_correction_bytes=profile.fixed_bytes - fixed), got

    if (not measured or budget is None
            or (isinstance(budget, str) and budget.strip().lower() == "auto")):
        return built(plan_budget(profile, budget, exhaustive=exhaustive, modes=modes))[0]
    limit = parse_budget(budget)
    refusal: UsageError | None = None  # the model's, where it called the budget too small
    fitted: BudgetPlan | None = None  # the fastest plan that fitted once built
    least: BudgetPlan | None = None   # the least a built plan held
    tried: set[tuple[tuple[str, ...], str]] = set()
    last: BudgetPlan | None = None
    for _ in range(FIT_BUILDS):
        try:
            plan = plan_budget(profile, limit, exhaustive=exhaustive, modes=modes)
        except UsageError as e:
            # The model calls the budget too small, up front or once a build corrected it.
            # A correction is one plan's error counted for all, and the model errs by plan
            # (offload's staging more than recompute's), so its least plan is built before
            # the budget is refused, unless that plan was built already.
            refusal = refusal or e
            # (the least plan the model knows: planned for its own predicted peak)
            plan = plan_budget(profile, smallest_peak(profile, exhaustive, modes),
                               exhaustive=exhaustive, modes=modes)
            plan = replace(plan, budget_bytes=limit, reason="the least plan the model knows: "
                           "its estimate is over the budget, what it holds built is under")
        if (plan.detailed, plan.mode) in tried:
            break
        tried.add((plan.detailed, plan.mode))
        last, got = built(plan)
        if got is None:  # (a build that could not measure after all: the model decides)
            if refusal is not None:
                raise refusal
            return last
        if least is None or got < least.predicted_peak_bytes:
            least = last
        if got <= limit and (fitted is None or last.predicted_step_ms < fitted.predicted_step_ms):
            fitted = last
        over = got - plan.predicted_peak_bytes
        if over == 0 or (over > 0 and got <= limit):
            break  # the model was right, or low where the plan fits: no faster plan fits
        profile = replace(profile, fixed_bytes=max(0, profile.fixed_bytes + over))
    if fitted is None and least is not None and any(c.grad_bytes for c in profile.layers):
        # Where the gradients live (homes of their own, or the graphs' pool beside the
        # last backward's workspace) moves what a plan holds by about a layer's gradients,
        # and the model errs there most: build the least plan that stores them the other
        # way too before refusing.
        other = not _has_homes(profile, least.detailed, least.mode)
        s = _search(profile, lambda s: (_has_homes(profile, s.choices, s.mode) != other,
                                        s.peak, s.step), exhaustive, modes)
        if (_has_homes(profile, s.choices, s.mode) == other
                and (s.choices, s.mode) not in tried):
            alt = _plan(profile, s, limit, "the least plan whose gradients live elsewhere: "
                        "built, it holds less than the model's least plan", exhaustive, modes)
            tried.add((alt.detailed, alt.mode))
            last, got = built(alt)
            if got is not None and got < least.predicted_peak_bytes:
                least = last
            if got is not None and got <= limit:
                fitted = last
    if fitted is None:
        assert least is not None
        raise BudgetError(
            f"memory budget {format_bytes(limit)} ({limit} bytes) is below the smallest peak "
            f"any plan reaches: built, the least plan ({short(least.detailed)}, "
            f"{least.mode}) holds {format_bytes(least.predicted_peak_bytes)} "
            f"({least.predicted_peak_bytes} bytes)",
            budget_bytes=limit, least_bytes=least.predicted_peak_bytes)
    if last is not fitted:
        got = build(fitted)  # (the last one built did not fit: back to the one that did)
        if got is not None and got > limit:
            raise UsageError(f"memory budget {format_bytes(limit)}: the plan that fitted "
                             f"({short(fitted.detailed)}) holds {format_bytes(got)} when built "
                             "again; the layers' memory moves from one build to the next")
        fitted = fitted if got is None else replace(fitted, predicted_peak_bytes=got)
    return fitted


def _plan(profile: StackProfile, s: _Scored, budget: int | None, reason: str,
          exhaustive: bool | None, modes: Sequence[str]) -> BudgetPlan:
    # The budget's bound: the least bound over the plans that fit it (for "auto", those
    # that fit the chosen plan's peak).
    fit = budget if budget is not None else s.peak
    # (from the plan itself too: its bound is one that the budget allows)
    bound = _search(profile, _fastest_within(fit, bound=True), exhaustive, modes,
                    also=[s.choices]).bound
    choices, ops = reported(s.choices)
    return BudgetPlan(
        choices=choices, recompute_ops=ops, mode=s.mode, budget_bytes=budget, predicted_peak_bytes=s.peak,
        predicted_step_ms=s.step, lower_bound_ms=min(bound, s.bound),
        offloaded_bytes=sum(slot_bytes(profile, s.choices, s.mode)),
        recompute_ms=recompute_ms(profile, s.choices),
        reason=reason, profile=profile)
