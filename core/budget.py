"""The memory budget planner: for each layer of a graphed stack, keep its saved activations
on the device, offload them to the host, or recompute them in the backward, so that the
step is as fast as the budget allows.

Device neutral: it plans from a :class:`StackProfile` (what each layer costs, measured by
:func:`graphslot.profile.profile_units` or given by hand) and knows nothing of tensors.

The model behind it:

* Time. Forward and backward compute run one layer after another. An offloaded layer's
  bytes leave on the copy engine while the forward goes on (a bank, the fixed-VA staging
  buffer, is written again only once its last occupant's copy out is done) and come back
  under the backward of the layers above it (the restore is queued after the backward of
  the offloaded layer above; a layer's backward waits for its bytes). A recomputed layer
  runs its forward again inside its backward graph. The newest offloaded forward never
  leaves its bank before its backward (and with two banks neither does the one before).
  :func:`predict_step_ms` plays this out; :func:`lower_bound_ms` is the bound no schedule
  beats, ``max(T_f, V_out/β_d2h) + max(T_b + T_r, V_in/β_h2d)``.
* Memory. Graph memory is static: the graphs' pool is as large as it grew while the
  graphs were captured, and the peak is the stack's fixed memory, plus that pool, plus
  the staging banks of the offloaded layers, plus the boundary buffers between graphs
  that the choices keep. The backward graphs are captured last layer first, each one's
  gradient buffers reusing what the layers after it kept (their backward is done with
  it by then), so the pool is the largest, over the layers, of what the layers up to it
  keep, the gradients from it on and its backward's working memory (a recomputed
  layer's activations again among it). :func:`predict_peak_bytes`.

:func:`plan_budget` searches the choices: every combination for small stacks, a local
search from position patterns above that (tested against the exhaustive search).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from .errors import UsageError
from .backend import align_up
from .sizes import format_bytes

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "CHOICES", "LayerCost", "StackProfile", "BudgetPlan",
           "predict_step_ms", "predict_peak_bytes", "banks_bytes", "slot_bytes", "bound_ms", "lower_bound_ms", "plan_budget",
           "smallest_peak", "parse_budget", "fit_budget", "gradient_homes"]

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
CHOICES = (KEEP, OFFLOAD, RECOMPUTE)
#: the offload engine's modes a plan may use (see :class:`BudgetPlan`)
MODES = ("off", "resident", "remap")

#: ``memory_budget="auto"`` takes the least memory among plans at most this much slower
#: than keeping everything (what the model cannot tell apart from free)
AUTO_SLACK = 0.01
#: stacks up to this many layers are planned by trying every combination
EXHAUSTIVE_LAYERS = 8
#: the local search starts from this many of the best position patterns
SEARCH_STARTS = 12
#: :func:`fit_budget` builds at most this many plans (then the one that fitted, again, or
#: before a refusal the least plan that stores the gradients the other way)
FIT_BUILDS = 4


@dataclass(frozen=True)
class LayerCost:
    """What one layer (or one joined graph) costs.

    Args:
        forward_ms: its forward compute.
        backward_ms: its backward compute, without recompute.
        saved_bytes: what its forward saves for backward (parameters and buffers aside).
        recompute_ms: the extra backward time when it is recomputed (its forward again).
        work_bytes: working memory of its backward beyond what it saved (gradients of
            activations, temporaries).
        input_bytes: its input (a boundary buffer between graphs; what a recomputed layer
            saves).
        grad_bytes: its parameters' gradients (the backward graph's buffers, in the
            graphs' pool, where they reuse what the forwards of the layers after it kept).
    """

    forward_ms: float
    backward_ms: float
    saved_bytes: int
    recompute_ms: float | None = None
    work_bytes: int = 0
    input_bytes: int = 0
    grad_bytes: int = 0

    def __post_init__(self) -> None:
        for k in ("forward_ms", "backward_ms", "saved_bytes", "work_bytes", "input_bytes",
                  "grad_bytes"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != v:
                raise UsageError(f"LayerCost.{k} must be a number >= 0, got {v!r}")
        if self.recompute_ms is None:
            object.__setattr__(self, "recompute_ms", float(self.forward_ms))
        elif self.recompute_ms < 0:
            raise UsageError(f"LayerCost.recompute_ms must be >= 0, got {self.recompute_ms!r}")

    @property
    def recompute(self) -> float:
        return float(self.recompute_ms or 0.0)


@dataclass(frozen=True)
class StackProfile:
    """A stack's costs, what the planner decides from.

    Args:
        layers: each layer's (or joined graph's) :class:`LayerCost`, in forward order.
        d2h_gbps: copy bandwidth device to host, GB/s (1e9 bytes per second).
        h2d_gbps: host to device.
        fixed_bytes: device memory the step holds whatever the choices: what the process
            held when the stack was built (weights, optimizer state then) and anything
            else the graphs hold for good; the choices decide the rest: the boundary
            buffers between graphs (each layer's ``input_bytes``) and the graphs' pool
            (what layers keep, their gradients and working memory).
        granularity: the device's VMM granularity (banks are whole granules).
        section_bytes: slots move in sections of at most this many bytes.
        d2d_gbps: device to device copy bandwidth, GB/s of bytes copied (None: free). A
            layer with a slot (an offloaded one, or a recomputed one whose input goes to
            the host) copies into it as its forward runs, which lengthens that forward by
            its slot's bytes at this rate.
    """

    layers: tuple[LayerCost, ...]
    d2h_gbps: float
    h2d_gbps: float
    fixed_bytes: int = 0
    granularity: int = 2 << 20
    section_bytes: int = 32 << 20
    d2d_gbps: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise UsageError("StackProfile needs at least one layer")
        for k in ("d2h_gbps", "h2d_gbps", "d2d_gbps"):
            v = getattr(self, k)
            if v is None and k == "d2d_gbps":
                continue
            if not v > 0:
                raise UsageError(f"StackProfile.{k} must be > 0, got {v!r}")
        if self.granularity < 1 or self.section_bytes < 1 or self.fixed_bytes < 0:
            raise UsageError("StackProfile: granularity and section_bytes must be >= 1, "
                             "fixed_bytes >= 0")

    @property
    def forward_ms(self) -> float:
        return sum(c.forward_ms for c in self.layers)

    @property
    def backward_ms(self) -> float:
        return sum(c.backward_ms for c in self.layers)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(c) for c in self.layers]
        return d


@dataclass(frozen=True)
class BudgetPlan:
    """What the planner chose and what it expects.

    Attributes:
        choices: per layer, ``"keep"``, ``"offload"`` or ``"recompute"``.
        mode: the offload engine's mode the plan needs (``"off"`` without offload,
            ``"resident"``: two banks, or ``"remap"``: one bank, mapped while a pass runs).
        budget_bytes: the budget asked for (None: ``"auto"``).
        predicted_peak_bytes: the step's peak device memory the model expects.
        predicted_step_ms: the step time the model expects (forward and backward).
        lower_bound_ms: the least :func:`lower_bound_ms` over every plan whose predicted
            peak fits the budget: no plan that fits can be faster.
        offloaded_bytes: bytes the plan copies to the host per step.
        recompute_ms: extra backward compute the plan's recomputed layers cost.
        reason: why this plan, in a sentence.
        model_peak_bytes: the model's own figure for the peak, where a build measured it
            (``predicted_peak_bytes`` is then the build's): what the profile said, with
            ``fixed_correction_bytes`` counted.
        fixed_correction_bytes: what builds of earlier plans showed the model's fixed
            memory to be off by (added to the profile's ``fixed_bytes``).
    """

    choices: tuple[str, ...]
    mode: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    predicted_step_ms: float
    lower_bound_ms: float
    offloaded_bytes: int
    recompute_ms: float
    reason: str
    profile: StackProfile | None = field(default=None, repr=False, compare=False)
    model_peak_bytes: int | None = None
    fixed_correction_bytes: int = 0

    def layers(self, choice: str) -> list[int]:
        """The indices of the layers with ``choice``."""
        return [i for i, c in enumerate(self.choices) if c == choice]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choices"] = list(self.choices)
        d.pop("profile")
        return d

    def __str__(self) -> str:
        return (f"{_short(self.choices)} ({self.mode}): peak {format_bytes(self.predicted_peak_bytes)}, "
                f"step {self.predicted_step_ms:.1f} ms (lower bound {self.lower_bound_ms:.1f}); "
                f"{self.reason}")


# -- the model -------------------------------------------------------------------------------

def _check(profile: StackProfile, choices: Sequence[str]) -> None:
    if len(choices) != len(profile.layers):
        raise UsageError(f"{len(choices)} choices for {len(profile.layers)} layers")
    bad = [c for c in choices if c not in CHOICES]
    if bad:
        raise UsageError(f"unknown choices {bad}; each is one of {', '.join(CHOICES)}")


def banks_for(choices: Sequence[str], mode: str) -> int:
    """Staging banks per size class of slots: two in resident, one in remap, none off."""
    if mode == "off" or not any(c in (OFFLOAD, RECOMPUTE) for c in choices):
        return 0
    return 2 if mode == "resident" else 1


def slot_bytes(profile: StackProfile, choices: Sequence[str], mode: str) -> list[int]:
    """What each layer puts in a slot (0: nothing leaves the device). An offloaded layer's
    saved activations; a recomputed layer's input when the mode offloads (its forward
    saves nothing else, and its input buffer then goes back to the graphs' pool)."""
    if mode == "off":
        return [0] * len(choices)
    return [c.saved_bytes if ch == OFFLOAD else c.input_bytes if ch == RECOMPUTE else 0
            for c, ch in zip(profile.layers, choices)]


def _classes(profile: StackProfile, slots: Sequence[int]) -> dict[int, list[int]]:
    """Offloading layers by size class (their slot rounded to the granularity), in order."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(slots):
        if n:
            out.setdefault(align_up(n, profile.granularity), []).append(i)
    return out


def banks_bytes(profile: StackProfile, choices: Sequence[str], mode: str) -> int:
    """Device memory of the staging banks ``choices`` need in ``mode``: each size class of
    slots has its own banks."""
    classes = _classes(profile, slot_bytes(profile, choices, mode))
    return banks_for(choices, mode) * sum(classes)


def _boundaries_held(profile: StackProfile, slots: Sequence[int]) -> int:
    """Bytes of the stack's boundary buffers the graphs hold for good: the input of each
    layer and the last one's output, except where the layers on both sides put what they
    save in slots (nothing then reads the buffer after the forward graph that reads it)."""
    n = len(slots)
    held = 0
    for k in range(n + 1):
        before = slots[k - 1] > 0 if k > 0 else True  # the stack's input: its reader decides
        after = slots[k] > 0 if k < n else True  # the stack's output: its writer decides
        if not (before and after):
            held += profile.layers[min(k, n - 1)].input_bytes
    return held


def predict_peak_bytes(profile: StackProfile, choices: Sequence[str], mode: str = "remap") -> int:
    """The step's peak device memory under ``choices`` (see the module docstring)."""
    _check(profile, choices)
    slots = slot_bytes(profile, choices, mode)
    # The graphs' pool, as the backward graphs are captured (last layer first): at layer
    # i's, what the forwards of layers up to i keep is still live, that of the layers above
    # is free again (their backward graphs, replayed before, are done with it) and holds
    # their gradient buffers, and layer i's backward needs its working memory (and, if
    # recomputed, its activations again). A recomputed layer keeps only its input, in its
    # boundary buffer (counted with the boundaries).
    # Before them, each forward capture: an offloaded layer's activations are made in the
    # pool beside what the layers before it keep, then copied to its slot.
    # Where the stack gives the gradients homes of their own (see gradient_homes), they
    # sit outside the pool for good and the pool holds none.
    layers = profile.layers
    grads = sum(c.grad_bytes for c in layers)
    in_pool = _in_pool(choices, mode)
    homes = _has_homes(profile, choices, mode)
    kept_below = 0
    grads_above = 0 if homes else grads
    pool = 0
    for c, ch, kept in zip(layers, choices, in_pool):
        kept_below += c.saved_bytes if kept else 0
        forward = kept_below + (c.saved_bytes if ch == OFFLOAD else 0)
        backward = (kept_below + grads_above + c.work_bytes
                    + (c.saved_bytes if ch == RECOMPUTE else 0))
        pool = max(pool, forward, backward)
        grads_above -= 0 if homes else c.grad_bytes
    return (profile.fixed_bytes + pool + (grads if homes else 0)
            + banks_bytes(profile, choices, mode) + _boundaries_held(profile, slots))


def _in_pool(choices: Sequence[str], mode: str) -> list[bool]:
    """Which layers keep their saved activations in the graphs' pool."""
    return [ch == KEEP or (ch == OFFLOAD and mode == "off") for ch in choices]


def _has_homes(profile: StackProfile, choices: Sequence[str], mode: str) -> bool:
    """Does the stack give gradients homes under ``choices`` (see :func:`gradient_homes`)?"""
    kept = sum(c.saved_bytes for c, k in zip(profile.layers, _in_pool(choices, mode)) if k)
    return gradient_homes(kept, sum(c.grad_bytes for c in profile.layers))


def gradient_homes(kept_bytes: int, grad_bytes: int) -> bool:
    """Does a stack give its parameters' gradients homes outside the graphs' pool (one
    address each for good, the backward graphs adding into them, so a kept or accumulated
    ``.grad`` is the only copy)? Pool gradient buffers share memory with what the layers
    keep in the pool (``kept_bytes``), so with ``.grad`` set to None they save up to that
    much over homes; with ``.grad`` kept they cost a whole copy of the gradients more.
    Homes, then, where the layers keep at most a sixteenth of the gradients' bytes."""
    return 16 * kept_bytes <= grad_bytes


def _copied(profile: StackProfile, choices: Sequence[str], mode: str
            ) -> tuple[list[int], dict[int, list[int]], set[int], set[int]]:
    """Each layer's slot bytes, the offloading layers by size class, the layer whose bytes
    never go out (the newest forward stays in its bank) and those that need no copy back
    (nothing wrote their bank again before their backward)."""
    slots = slot_bytes(profile, choices, mode)
    classes = _classes(profile, slots)
    off = [i for i, n in enumerate(slots) if n]
    held = set(off[-1:])
    nbanks = banks_for(choices, mode)
    in_place = {i for members in classes.values() for i in members[-nbanks:]} if nbanks else set()
    return slots, classes, held, in_place


def lower_bound_ms(profile: StackProfile, choices: Sequence[str], mode: str = "remap") -> float:
    """``max(T_f, V_out/β_d2h) + max(T_b + T_r, V_in/β_h2d)``: compute and copies each way
    overlapping perfectly, with ``V`` the bytes the plan copies out and back."""
    _check(profile, choices)
    slots, _, held, in_place = _copied(profile, choices, mode)
    out = sum(n for i, n in enumerate(slots) if i not in held)
    back = sum(n for i, n in enumerate(slots) if i not in in_place)
    t_r = sum(c.recompute for c, ch in zip(profile.layers, choices) if ch == RECOMPUTE)
    return bound_ms(profile.forward_ms, profile.backward_ms, t_r, out, back,
                    profile.d2h_gbps, profile.h2d_gbps)


def bound_ms(fwd_ms: float, bwd_ms: float, recompute_ms: float, out_bytes: float,
             back_bytes: float, d2h_gbps: float | None, h2d_gbps: float | None) -> float:
    """``max(T_f, V_out/β_d2h) + max(T_b + T_r, V_in/β_h2d)``: no schedule that copies
    ``out_bytes`` to the host and ``back_bytes`` back, and recomputes ``recompute_ms`` of
    forward, is faster (a link without a figure counts as free)."""
    def ms(n: float, gbps: float | None) -> float:
        return n / (gbps * 1e6) if gbps else 0.0
    return (max(fwd_ms, ms(out_bytes, d2h_gbps))
            + max(bwd_ms + recompute_ms, ms(back_bytes, h2d_gbps)))


def predict_step_ms(profile: StackProfile, choices: Sequence[str], mode: str = "remap") -> float:
    """The forward and backward time under ``choices``, played out layer by layer (see the
    module docstring); never below :func:`lower_bound_ms`."""
    _check(profile, choices)
    layers = profile.layers
    nbanks = max(1, banks_for(choices, mode))
    slots, classes, held, in_place = _copied(profile, choices, mode)
    d2h = profile.d2h_gbps * 1e6  # bytes per ms
    h2d = profile.h2d_gbps * 1e6
    # Within a size class the banks alternate in backward order (its last layer: bank 0);
    # ``prev[i]``: the layer that used i's bank before it, ``nxt[i]``: the one after it.
    bank: dict[int, tuple[int, int]] = {}
    prev: dict[int, int] = {}
    nxt: dict[int, int] = {}
    for size, members in classes.items():
        for k, i in enumerate(members):
            bank[i] = (size, (len(members) - 1 - k) % nbanks)
            if k >= nbanks:
                prev[i] = members[k - nbanks]
                nxt[members[k - nbanks]] = i

    def section_ms(i: int, rate: float) -> float:
        return min(slots[i], profile.section_bytes) / rate

    # Forward: a layer writes its bank once the bank's last occupant has gone out (section
    # by section: it ends one section after that copy), and copies what it saves into its
    # slot as it runs.
    d2d = profile.d2d_gbps * 1e6 if profile.d2d_gbps else None
    t = 0.0
    d2h_free = 0.0
    out_done: dict[int, float] = {}
    for i, c in enumerate(layers):
        start = t
        end = start + c.forward_ms + (slots[i] / d2d if i in bank and d2d else 0.0)
        if i in bank:
            if i in prev:
                end = max(end, out_done.get(prev[i], 0.0) + section_ms(i, d2h))
            if i not in held:  # sections leave as they are written
                cstart = max(d2h_free, start)
                cend = cstart + slots[i] / d2h
                if choices[i] != RECOMPUTE:  # (a recomputed layer's slot is its input,
                    cend = max(cend, end + section_ms(i, d2h))  # there from its start)
                d2h_free = out_done[i] = cend
        t = end
    # Backward: an offloaded layer's restore is queued once the backward of the offloading
    # layer above it has begun, and fills its bank as the bank's occupant (the next layer
    # of its class, with one bank) lets go of it; a layer's backward waits for its bytes.
    h2d_free = t
    bwd_start: dict[int, float] = {}
    bwd_end: dict[int, float] = {}
    above: int | None = None  # the offloading layer above, in backward order
    for i in reversed(range(len(layers))):
        c = layers[i]
        ready = t
        if i in bank and i not in in_place:
            queued = bwd_start[above] if above is not None else t
            # (a recomputed layer reads its input first, for the recompute: it lets go of
            # its bank as its backward begins; an offloaded one as its backward ends)
            freed = queued if i not in nxt else (
                bwd_start[nxt[i]] if choices[nxt[i]] == RECOMPUTE else bwd_end[nxt[i]])
            cstart = max(h2d_free, queued, out_done.get(i, 0.0))
            cend = max(cstart + slots[i] / h2d, freed + section_ms(i, h2d))
            h2d_free = cend
            ready = max(t, cend)
        bwd_start[i] = ready
        t = ready + c.backward_ms + (c.recompute if choices[i] == RECOMPUTE else 0.0)
        bwd_end[i] = t
        if i in bank:
            above = i
    return max(t, lower_bound_ms(profile, choices, mode))


# -- the search ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Scored:
    """One candidate: its choices, its engine mode and what the model says of them."""

    choices: tuple[str, ...]
    mode: str
    step: float
    bound: float
    peak: int


def _modes(choices: Sequence[str]) -> tuple[str, ...]:
    # resident: two banks, no driver call per step; remap: one bank, mapped per pass; a
    # recomputed layer's input may go to the host too, or stay (off)
    if OFFLOAD in choices:
        return ("resident", "remap")
    return ("off", "resident", "remap") if RECOMPUTE in choices else ("off",)


@functools.lru_cache(maxsize=1 << 16)
def _scored_all(profile: StackProfile, choices: tuple[str, ...]) -> tuple[_Scored, ...]:
    # (cached: the searches score the same plans over and over)
    return tuple(_Scored(choices, m, predict_step_ms(profile, choices, m),
                    lower_bound_ms(profile, choices, m), predict_peak_bytes(profile, choices, m))
                 for m in _modes(choices))


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


def _seeds(n: int) -> list[tuple[str, ...]]:
    """Starting points by position: no offload; the first k layers offloaded; every other
    layer from the first; k layers spread evenly; each with the rest kept or recomputed."""
    seeds: set[tuple[str, ...]] = set()
    for k in range(n + 1):
        sets = {tuple(range(k)),
                tuple(range(0, 2 * k, 2)) if 2 * k <= n else tuple(range(k)),
                tuple(sorted({round(j * (n - 1) / (k - 1)) for j in range(k)})) if k > 1
                else tuple(range(k))}
        for s in sets:
            for rest in (KEEP, RECOMPUTE):
                seeds.add(tuple(OFFLOAD if i in s else rest for i in range(n)))
    return sorted(seeds)


def _neighbours(cur: tuple[str, ...]) -> Iterable[tuple[str, ...]]:
    """Every plan one layer's choice, or one swap of two layers' choices, away."""
    n = len(cur)
    for i in range(n):
        for c in CHOICES:
            if c != cur[i]:
                yield cur[:i] + (c,) + cur[i + 1:]
    for i in range(n):
        for j in range(i + 1, n):
            if cur[i] != cur[j]:
                m = list(cur)
                m[i], m[j] = m[j], m[i]
                yield tuple(m)


def _search(profile: StackProfile, key: Objective, exhaustive: bool | None = None,
            modes: Sequence[str] = MODES) -> _Scored:
    """The candidate with the least ``key`` among those in ``modes``: every combination for
    small stacks, else a local search from the best few position patterns."""
    n = len(profile.layers)

    def _scored(profile: StackProfile, choices: tuple[str, ...]) -> list[_Scored]:
        # (a plan without offload runs alike in any engine mode)
        return [s for s in _scored_all(profile, choices) if s.mode in modes or s.mode == "off"]

    if exhaustive is None:
        exhaustive = n <= EXHAUSTIVE_LAYERS
    if exhaustive:
        return min((s for ch in itertools.product(CHOICES, repeat=n) for s in _scored(profile, ch)),
                   key=key)
    starts = sorted((s for ch in _seeds(n) for s in _scored(profile, ch)), key=key)
    best: _Scored | None = None
    seen: set[tuple[str, ...]] = set()
    for s in starts[:SEARCH_STARTS]:
        cur = s
        improved = True
        while improved:
            improved = False
            for m in _neighbours(cur.choices):
                if m in seen:
                    continue
                seen.add(m)
                for cand in _scored(profile, m):
                    if key(cand) < key(cur):
                        cur, improved = cand, True
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
            is free); None: the fastest plan.
        exhaustive: try every combination (default: for stacks of up to
            :data:`EXHAUSTIVE_LAYERS` layers), else a local search.
        modes: the engine modes the plan may use for offload (``("off",)``: keep or
            recompute only; a plan without offload needs no mode of its own).

    Raises:
        UsageError: ``budget`` is below the smallest peak any plan reaches (the message
            names that peak), or is not a size.
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
        return _plan(profile, best, None,
                     f"saves {format_bytes(keep_all.peak - best.peak)} at most "
                     f"{AUTO_SLACK:.0%} slower than keeping everything", exhaustive, modes)
    limit = None if budget is None else parse_budget(budget)
    best = _search(profile, _fastest_within(limit), exhaustive, modes)
    if limit is not None and best.peak > limit:
        least = smallest_peak(profile, exhaustive, modes)
        raise UsageError(
            f"memory budget {format_bytes(limit)} ({limit} bytes) is below the smallest peak "
            f"any plan reaches, {format_bytes(least)} ({least} bytes); of that, the stack's "
            f"fixed memory (weights, gradients, buffers) is {format_bytes(profile.fixed_bytes)}")
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
        if (plan.choices, plan.mode) in tried:
            break
        tried.add((plan.choices, plan.mode))
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
        other = not _has_homes(profile, least.choices, least.mode)
        s = _search(profile, lambda s: (_has_homes(profile, s.choices, s.mode) != other,
                                        s.peak, s.step), exhaustive, modes)
        if (_has_homes(profile, s.choices, s.mode) == other
                and (s.choices, s.mode) not in tried):
            alt = _plan(profile, s, limit, "the least plan whose gradients live elsewhere: "
                        "built, it holds less than the model's least plan", exhaustive, modes)
            tried.add((alt.choices, alt.mode))
            last, got = built(alt)
            if got is not None and got < least.predicted_peak_bytes:
                least = last
            if got is not None and got <= limit:
                fitted = last
    if fitted is None:
        assert least is not None
        raise UsageError(
            f"memory budget {format_bytes(limit)} ({limit} bytes) is below the smallest peak "
            f"any plan reaches: built, the least plan ({_short(least.choices)}, "
            f"{least.mode}) holds {format_bytes(least.predicted_peak_bytes)} "
            f"({least.predicted_peak_bytes} bytes)")
    if last is not fitted:
        got = build(fitted)  # (the last one built did not fit: back to the one that did)
        if got is not None and got > limit:
            raise UsageError(f"memory budget {format_bytes(limit)}: the plan that fitted "
                             f"({_short(fitted.choices)}) holds {format_bytes(got)} when built "
                             "again; the layers' memory moves from one build to the next")
        fitted = fitted if got is None else replace(fitted, predicted_peak_bytes=got)
    return fitted


def _short(choices: Sequence[str]) -> str:
    return "".join({KEEP: "K", OFFLOAD: "O", RECOMPUTE: "R"}[c] for c in choices)


def _plan(profile: StackProfile, s: _Scored, budget: int | None, reason: str,
          exhaustive: bool | None, modes: Sequence[str]) -> BudgetPlan:
    # The budget's bound: the least bound over the plans that fit it (for "auto", those
    # that fit the chosen plan's peak).
    fit = budget if budget is not None else s.peak
    bound = _search(profile, _fastest_within(fit, bound=True), exhaustive, modes).bound
    return BudgetPlan(
        choices=s.choices, mode=s.mode, budget_bytes=budget, predicted_peak_bytes=s.peak,
        predicted_step_ms=s.step, lower_bound_ms=min(bound, s.bound),
        offloaded_bytes=sum(slot_bytes(profile, s.choices, s.mode)),
        recompute_ms=sum(c.recompute for c, ch in zip(profile.layers, s.choices)
                         if ch == RECOMPUTE),
        reason=reason, profile=profile)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_budget(v: int | float | str) -> int:
    """Bytes from a size: an integer, or a number with a unit (``"10GiB"``, ``"9.5G"``,
    ``"12000MiB"``, ``"8e9"``; k, M, G, T alone are binary).

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(v, bool):
        raise UsageError(f"memory budget must be a size in bytes, got {v!r}")
    if isinstance(v, (int, float)):
        n = v
    elif isinstance(v, str):
        s = v.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        try:
            n = float(num) * _UNITS[unit]
        except (ValueError, KeyError):
            raise UsageError(f"memory budget {v!r} is not a size (e.g. 10GiB, 9.5G, "
                             "12000MiB or bytes)") from None
    else:
        raise UsageError(f"memory budget must be bytes, a size string or 'auto', got {v!r}")
    if not n > 0 or n != n or n == math.inf:
        raise UsageError(f"memory budget must be positive, got {v!r}")
    return int(n)
