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
from .costs import (AUTO_MIN_SAVING, AUTO_SLACK, CHOICES, EXHAUSTIVE_LAYERS,
                    FIT_BUILDS, KEEP, MODES, OFFLOAD, RECOMPUTE, RECOMPUTE_CHEAP, RECOMPUTE_PARTS,
                    SEARCH_STARTS,
                    BudgetPlan, StackProfile, parse_budget, reported, short)
from .model import has_gradient_homes, recompute_ms, score, slot_bytes

#: A kind of plan, as the model errs by it: (whether it offloads a layer, whether the
#: stack gives the gradients homes of their own). Staging and the forward's copies are
#: where the model misses most for the first; where gradients live, for the second.
Kind = tuple[bool, bool]
_KINDS: tuple[Kind, ...] = ((False, False), (False, True), (True, False), (True, True))


@dataclass(frozen=True)
class _Scored:
    """One candidate: its choices, its engine mode, what the model says of them and its
    kind."""

    choices: tuple[str, ...]
    mode: str
    step: float
    bound: float
    peak: int
    kind: Kind = (False, False)


#: the recompute kinds a layer's profile may offer beyond the three choices, each with
#: whether a layer's cost offers it
_OFFERED = ((RECOMPUTE_CHEAP, lambda c: c.cheap), (RECOMPUTE_PARTS, lambda c: c.parts))


def _options(profile: StackProfile) -> list[tuple[str, ...]]:
    """The choices the search may give each layer."""
    return [(KEEP,) if c.keep_only else CHOICES + tuple(k for k, offered in _OFFERED if offered(c))
            for c in profile.layers]


def _modes(choices: Sequence[str]) -> tuple[str, ...]:
    # resident: two banks, no driver call per step; remap: one bank, mapped per pass; a
    # recomputed layer's input may go to the host too, or stay (off)
    if OFFLOAD in choices:
        return ("resident", "remap")
    return (("off", "resident", "remap") if RECOMPUTE in choices or RECOMPUTE_PARTS in choices
            else ("off",))


def _scored_all(profile: StackProfile, choices: tuple[str, ...]) -> tuple[_Scored, ...]:
    """``choices`` scored in each engine mode it may run in."""
    scored = _scored_unfixed(_unfixed(profile), choices)
    if not profile.fixed_bytes:
        return scored
    fixed = profile.fixed_bytes
    return tuple(_Scored(s.choices, s.mode, s.step, s.bound, s.peak + fixed, s.kind)
                 for s in scored)  # (not dataclasses.replace: ten times slower, here hot)


@functools.lru_cache(maxsize=16)
def _unfixed(profile: StackProfile) -> StackProfile:
    # A plan's peak is the profile's fixed memory plus what the plan adds, and nothing
    # else depends on that memory: plans are scored once for every correction of it that
    # fit_budget makes (one object per profile, so that its hash is computed once).
    return replace(profile, fixed_bytes=0)


@functools.lru_cache(maxsize=1 << 17)
def _scored_unfixed(profile: StackProfile, choices: tuple[str, ...]) -> tuple[_Scored, ...]:
    # (cached: the searches score the same plans over and over)
    return tuple(_Scored(choices, m, *score(profile, choices, m), kind=_kind(profile, choices, m))
                 for m in _modes(choices))


def _kind(profile: StackProfile, choices: Sequence[str], mode: str) -> Kind:
    """The :data:`Kind` of ``choices`` (each layer's, as the model's functions take them)
    in ``mode``."""
    return (OFFLOAD in choices, has_gradient_homes(profile, choices, mode))


def _check_modes(modes: Sequence[str]) -> None:
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"modes {list(modes)}: each is one of {', '.join(MODES)}")


class _Corrections:
    """What builds showed the model's peak to be off by, per :data:`Kind` of plan (the
    model errs by kind: counted for all, one kind's error would hide plans of another
    that fit). A kind not built yet takes the newest build's error."""

    def __init__(self) -> None:
        self.by_kind: dict[Kind, int] = {}
        self.newest = 0

    def __call__(self, kind: Kind) -> int:
        return self.by_kind.get(kind, self.newest)

    def saw(self, kind: Kind, error: int) -> None:
        self.by_kind[kind] = self.newest = error


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


def _seeds(n: int, recomputes: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Starting points by position: no offload; the first k layers offloaded; every other
    layer from the first; k layers spread evenly; each with the rest kept or recomputed
    (whole, or by each of ``recomputes``, other recompute kinds)."""
    seeds: set[tuple[str, ...]] = set()
    for k in range(n + 1):
        sets = {tuple(range(k)),
                tuple(range(0, 2 * k, 2)) if 2 * k <= n else tuple(range(k)),
                tuple(sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})) if k > 1
                else tuple(range(k))}
        for s in sets:
            for rest in (KEEP, RECOMPUTE) + recomputes:
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
            also: Sequence[tuple[str, ...]] = (), adjust: _Corrections | None = None) -> _Scored:
    """The candidate with the least ``key`` among those in ``modes``: every combination for
    small stacks, else a local search from the best ``starts`` position patterns and the
    plans in ``also``; peaks with ``adjust``'s correction for their kind counted."""
    n = len(profile.layers)

    def _scored(profile: StackProfile, choices: tuple[str, ...]) -> list[_Scored]:
        # (a plan without offload runs alike in any engine mode)
        out = [s for s in _scored_all(profile, choices) if s.mode in modes or s.mode == "off"]
        if adjust is not None:
            out = [_Scored(s.choices, s.mode, s.step, s.bound, s.peak + adjust(s.kind), s.kind)
                   for s in out]
        return out

    options = _options(profile)
    if exhaustive is None:
        # (as many combinations as three choices over EXHAUSTIVE_LAYERS layers)
        exhaustive = math.prod(len(o) for o in options) <= len(CHOICES) ** EXHAUSTIVE_LAYERS
    if exhaustive:
        return min((s for ch in itertools.product(*options) for s in _scored(profile, ch)),
                   key=key)
    offered = tuple(k for k, _ in _OFFERED if any(k in o for o in options))
    seeds = [ch for ch in _seeds(n, offered) if all(c in o for c, o in zip(ch, options))]
    firsts = sorted((s for ch in seeds for s in _scored(profile, ch)), key=key)[:starts]
    firsts += [s for ch in also if all(c in o for c, o in zip(ch, options))
               for s in _scored(profile, tuple(ch))]
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
    return _least(profile, exhaustive, modes, None).peak


def _least(profile: StackProfile, exhaustive: bool | None, modes: Sequence[str],
           adjust: _Corrections | None, kind: Kind | None = None) -> _Scored:
    """The plan of least peak (of ``kind``, where one is given and any plan is of it)."""
    if kind is None:
        return _search(profile, _smallest, exhaustive, modes, adjust=adjust)
    return _search(profile, lambda s: (s.kind != kind, s.peak, s.step), exhaustive, modes,
                   adjust=adjust)


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
    return _plan_budget(profile, budget, exhaustive, modes, None)


def _plan_budget(profile: StackProfile, budget: int | str | None, exhaustive: bool | None,
                 modes: Sequence[str], adjust: _Corrections | None) -> BudgetPlan:
    """:func:`plan_budget`, with ``adjust``'s corrections counted in every plan's peak."""
    _check_modes(modes)
    n = len(profile.layers)
    keep_all = _scored_all(profile, (KEEP,) * n)[0]
    if adjust is not None:
        keep_all = replace(keep_all, peak=keep_all.peak + adjust(keep_all.kind))
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        best = _search(profile, _smallest_within(keep_all.step * (1 + AUTO_SLACK)), exhaustive,
                       modes, adjust=adjust)
        if best.peak >= keep_all.peak:
            return _plan(profile, keep_all, None, "nothing pays: every plan that saves memory is "
                         "predicted slower than keeping every layer's activations", exhaustive,
                         modes, adjust)
        floor = max(profile.granularity, int(AUTO_MIN_SAVING * keep_all.peak))
        if keep_all.peak - best.peak < floor:
            return _plan(profile, keep_all, None,
                         f"nothing pays: the plans at most {AUTO_SLACK:.0%} slower than keeping "
                         f"everything save at most {format_bytes(keep_all.peak - best.peak)}, "
                         f"under {format_bytes(floor)} ({AUTO_MIN_SAVING:.0%} of the peak, at "
                         "least a granule)", exhaustive, modes, adjust)
        return _plan(profile, best, None,
                     f"saves {format_bytes(keep_all.peak - best.peak)} at most "
                     f"{AUTO_SLACK:.0%} slower than keeping everything", exhaustive, modes,
                     adjust)
    limit = None if budget is None else parse_budget(budget)
    # Where keeping everything fits it is the plan: nothing is faster, and a plan the
    # model calls as fast (a cheap recompute timed at nothing) would cost time and memory.
    best = (keep_all if limit is None or keep_all.peak <= limit else
            _search(profile, _fastest_within(limit), exhaustive, modes, adjust=adjust))
    if limit is not None and best.peak > limit:
        least = _least(profile, exhaustive, modes, adjust).peak
        raise BudgetError(
            f"memory budget {format_bytes(limit)} ({limit} bytes) is below the smallest peak "
            f"any plan reaches, {format_bytes(least)} ({least} bytes); of that, the stack's "
            f"fixed memory (weights, gradients, buffers) is {format_bytes(profile.fixed_bytes)}",
            budget_bytes=limit, least_bytes=least)
    if all(c == KEEP for c in best.choices):
        reason = "everything fits on the device: nothing to save"
    elif best.step <= keep_all.step * (1 + AUTO_SLACK):
        reason = ("the copies hide under compute" if best.kind[0] else
                  f"what it recomputes costs at most {AUTO_SLACK:.0%} of the step")
    else:
        reason = (f"the fastest plan that fits: {best.step / keep_all.step:.2f} x the step "
                  "that keeps everything" if keep_all.step > 0 else "the fastest plan that fits")
    return _plan(profile, best, limit, reason, exhaustive, modes, adjust)


def fit_budget(profile: StackProfile, budget: int | str | None,
               build: Callable[[BudgetPlan], int | None], *, measured: bool = True,
               exhaustive: bool | None = None, modes: Sequence[str] = MODES) -> BudgetPlan:
    """The fastest plan whose peak, as built, fits ``budget``: plan from the model, build,
    and where what the build holds differs from the model's figure, count the difference
    for plans of that kind (whether they offload, where the gradients live: the model
    errs by kind) and plan again (the model's figure is an estimate; the build's is
    what the step will hold). Before a budget is refused, more is built, one plan at a
    time until one fits: what the corrected model says fits, else the least plan of a
    kind not built yet, else the least plan as now corrected; where one fits, the
    fastest plan the corrections then allow, if it is clearly faster.

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
    history: list[tuple[str, str, int]] = []  # (short form, mode, held) per build

    def recorded(plan: BudgetPlan) -> int | None:
        got = build(plan)
        if got is not None:
            history.append((short(plan.detailed), plan.mode, got))
        return got

    try:
        plan = _fit_budget(profile, budget, recorded, measured, exhaustive, modes)
    except BudgetError as e:
        if isinstance(e.least_plan, BudgetPlan):
            e.least_plan = replace(e.least_plan, builds=tuple(history))
        raise
    return replace(plan, builds=tuple(history))


def _fit_budget(profile: StackProfile, budget: int | str | None,
                build: Callable[[BudgetPlan], int | None], measured: bool,
                exhaustive: bool | None, modes: Sequence[str]) -> BudgetPlan:
    """:func:`fit_budget`, its builds recorded by ``build``."""
    auto = isinstance(budget, str) and budget.strip().lower() == "auto"
    if not measured or budget is None or auto:
        plan = plan_budget(profile, budget, exhaustive=exhaustive, modes=modes)
        got = build(plan)
        if got is None:
            return plan
        done = replace(plan, predicted_peak_bytes=got, model_peak_bytes=plan.predicted_peak_bytes)
        if auto and measured and any(c != KEEP for c in plan.choices):
            return _auto_checked(profile, done, build, exhaustive, modes)
        return done
    limit = parse_budget(budget)
    _check_modes(modes)  # (before the loop, which reads a UsageError as a refusal)
    corrections = _Corrections()
    refusal: UsageError | None = None  # the model's, where it called the budget too small
    fitted: BudgetPlan | None = None  # the fastest plan that fitted once built
    least: BudgetPlan | None = None   # the least a built plan held
    tried: set[tuple[tuple[str, ...], str]] = set()
    last: BudgetPlan | None = None
    fits_built: list[BudgetPlan] = []  # every plan that fitted once built

    def built(plan: BudgetPlan) -> int | None:
        """Build ``plan``; count what it showed of the model's error for its kind."""
        nonlocal last, least, fitted
        tried.add((plan.detailed, plan.mode))
        got = build(plan)
        if got is None:
            last = plan
            return None
        last = replace(plan, predicted_peak_bytes=got, model_peak_bytes=plan.predicted_peak_bytes)
        corrections.saw(_kind(profile, plan.detailed, plan.mode), got - (plan.predicted_peak_bytes - plan.fixed_correction_bytes))
        if least is None or got < least.predicted_peak_bytes:
            least = last
        if got <= limit:
            fits_built.append(last)
            if fitted is None or last.predicted_step_ms < fitted.predicted_step_ms:
                fitted = last
        return got

    def least_plan() -> BudgetPlan:
        # (the least plan the model knows: its estimate is over the budget, what it holds
        # built may be under)
        s = _least(profile, exhaustive, modes, corrections)
        return _plan(profile, s, limit, "the least plan the model knows: its estimate is over "
                     "the budget, what it holds built is under", exhaustive, modes, corrections)

    for _ in range(FIT_BUILDS):
        try:
            plan = _plan_budget(profile, limit, exhaustive, modes, corrections)
        except UsageError as e:
            # The model calls the budget too small, up front or once a build corrected it:
            # its least plan is built before the budget is refused, unless it was already.
            refusal = refusal or e
            plan = least_plan()
        if (plan.detailed, plan.mode) in tried:
            break
        got = built(plan)
        if got is None:  # (a build that could not measure after all: the model decides)
            if refusal is not None:
                raise refusal
            return plan
        over = got - plan.predicted_peak_bytes
        if over == 0 or (over > 0 and got <= limit):
            break  # the model was right, or low where the plan fits: no faster plan fits
    if fitted is None and least is not None:
        # The model errs by kind of plan, and the kinds not built yet carry the error of
        # the newest build: before refusing, build what the corrections now say fits, or
        # else the least plan of a kind not built yet (the least first), until one fits
        # or every kind was built; where one fits, plan once more with its kind's error
        # known.
        for _ in range(len(_KINDS) + 1):  # (a kind learnt per build, the least last)
            fits: BudgetPlan | None
            try:
                fits = _plan_budget(profile, limit, exhaustive, modes, corrections)
            except UsageError:
                fits = None
            if fits is not None and (fits.detailed, fits.mode) not in tried:
                plan = fits
            else:
                others = [s for s in (_least(profile, exhaustive, modes, corrections, k)
                                      for k in _KINDS if k not in corrections.by_kind)
                          if s.kind not in corrections.by_kind and (s.choices, s.mode) not in tried]
                if not others:
                    # every kind built: the refusal names what the least plan, as the
                    # corrections now see it, holds
                    s = _least(profile, exhaustive, modes, corrections)
                    if (s.choices, s.mode) in tried:
                        break
                    others = [s]
                s = min(others, key=_smallest)
                plan = _plan(profile, s, limit, f"the least plan of its kind "
                             f"({_kind_name(s.kind)}), which the model, corrected by the "
                             "builds of other kinds, put over the budget: built, it fitted",
                             exhaustive, modes, corrections)
            if built(plan) is None or fitted is not None:
                break
        if fitted is not None:
            try:
                plan = _plan_budget(profile, limit, exhaustive, modes, corrections)
            except UsageError:
                plan = fitted
            # (a build or two for a plan the model calls faster by less than its error
            # on time: not worth it)
            if ((plan.detailed, plan.mode) not in tried
                    and plan.predicted_step_ms < fitted.predicted_step_ms * (1 - AUTO_SLACK)):
                built(plan)
    if fitted is None:
        assert least is not None
        raise BudgetError(refusal_message(limit, least), budget_bytes=limit,
                          least_bytes=least.predicted_peak_bytes,
                          least_plan=replace(least, reason=_OVER))
    if last is fitted:
        return fitted
    # The last one built is not the fastest that fitted (it did not fit, or was slower):
    # back to that one. Built again, the layers' memory may have moved; then the next
    # that fitted, the most room first.
    again = [fitted] + sorted((f for f in fits_built if f is not fitted),
                              key=lambda f: f.predicted_peak_bytes)
    held = []
    for f in again:
        got = build(f)
        if got is None or got <= limit:
            return f if got is None else replace(f, predicted_peak_bytes=got)
        held.append((got, f))
    got, f = min(held, key=lambda h: h[0])
    least = replace(f, predicted_peak_bytes=got, reason=_MOVED)
    raise BudgetError(refusal_message(limit, least), budget_bytes=limit, least_bytes=got,
                      least_plan=least)


#: a refusal's least plan, as it says why it is that plan
_OVER = "the least plan built for the budget, which holds more than it"
_MOVED = ("the least of the plans that fitted the budget, which held more than it when "
          "built again")


def refusal_message(limit: int, least: BudgetPlan) -> str:
    """What a refusal of ``limit`` says where ``least`` held the least built (its
    ``predicted_peak_bytes``)."""
    if least.reason == _MOVED:
        return (f"memory budget {format_bytes(limit)} ({limit} bytes): the plans that fitted it "
                f"hold more when built again (the layers' memory moves from one build to the "
                f"next); the least of them, {short(least.detailed)} ({least.mode}), holds "
                f"{format_bytes(least.predicted_peak_bytes)} ({least.predicted_peak_bytes} bytes)")
    # (what the plans built held, not what every plan would: the model's order within a
    # kind of plan is a model's, and only the plans it puts least are built)
    return (f"memory budget {format_bytes(limit)} ({limit} bytes) is below what the plans built "
            f"for it hold, and the model, corrected by those builds, puts no plan lower: the "
            f"least built ({short(least.detailed)}, {least.mode}) holds "
            f"{format_bytes(least.predicted_peak_bytes)} ({least.predicted_peak_bytes} bytes)")


def _auto_checked(profile: StackProfile, plan: BudgetPlan, build: Callable[[BudgetPlan], int | None],
                  exhaustive: bool | None, modes: Sequence[str]) -> BudgetPlan:
    """``"auto"``'s plan, built (``plan``), against keeping everything: where what it holds
    is not clearly less than the model, corrected by that build, says keeping everything
    holds, keeping everything is built too, and the plan stands only if it saves at least
    :data:`AUTO_MIN_SAVING` of that (the model's memory errs by hundreds of MiB on a device,
    more than the saving it planned)."""
    n = len(profile.layers)
    got = plan.predicted_peak_bytes
    assert plan.model_peak_bytes is not None
    error = got - plan.model_peak_bytes
    keep = _scored_all(profile, (KEEP,) * n)[0]
    same = keep.kind == _kind(profile, plan.detailed, plan.mode)
    # keeping everything as the model says it, with the build's error where the kinds
    # agree, else with as much of it as makes the plan's saving smaller
    keep_held = keep.peak + (error if same else min(0, error))
    floor = max(profile.granularity, int(AUTO_MIN_SAVING * keep_held))
    if got + floor <= keep_held:
        return plan  # (clearly less)
    kept = _plan(profile, keep, None, "", exhaustive, modes)
    held = build(kept)
    if held is not None and held - got < floor:
        return replace(kept, predicted_peak_bytes=held, model_peak_bytes=kept.predicted_peak_bytes,
                       reason=f"nothing pays: built, the plan that saves memory at most "
                       f"{AUTO_SLACK:.0%} slower ({short(plan.detailed)}, {plan.mode}) held "
                       f"{format_bytes(got)}, keeping everything {format_bytes(held)}")
    again = build(plan)  # (it saves memory after all: back to it)
    return plan if again is None else replace(plan, predicted_peak_bytes=again)


def _kind_name(kind: Kind) -> str:
    return (("offloading" if kind[0] else "no offload") + ", "
            + ("gradients in homes of their own" if kind[1] else "gradients in the graphs' pool"))


def _plan(profile: StackProfile, s: _Scored, budget: int | None, reason: str,
          exhaustive: bool | None, modes: Sequence[str], adjust: _Corrections | None = None
          ) -> BudgetPlan:
    # The budget's bound: the least bound over the plans that fit it (for "auto", those
    # that fit the chosen plan's peak).
    fit = budget if budget is not None else s.peak
    # (from the plan itself too: its bound is one that the budget allows)
    bound = _search(profile, _fastest_within(fit, bound=True), exhaustive, modes,
                    also=[s.choices], adjust=adjust).bound
    choices, ops = reported(s.choices)
    correction = adjust(s.kind) if adjust is not None else 0
    return BudgetPlan(
        choices=choices, recompute_ops=ops, mode=s.mode, budget_bytes=budget, predicted_peak_bytes=s.peak,
        predicted_step_ms=s.step, lower_bound_ms=min(bound, s.bound),
        offloaded_bytes=sum(slot_bytes(profile, s.choices, s.mode)),
        recompute_ms=recompute_ms(profile, s.choices),
        reason=reason, profile=profile, fixed_correction_bytes=correction)
