"""What the budget planner plans from and what it returns: the choices, each layer's
:class:`LayerCost`, the stack's :class:`StackProfile`, the :class:`BudgetPlan`, and budgets
as sizes (:func:`parse_budget`). Imports nothing of the package but errors and sizes."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

from ..errors import UsageError
from ..sizes import format_bytes

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
CHOICES = (KEEP, OFFLOAD, RECOMPUTE)
#: The model's and the search's name for a layer recomputed cheaply (see
#: :mod:`graphslot.recompute`): it keeps the outputs of its expensive ops on the device,
#: in the graphs' pool (``LayerCost.cheap_saved_bytes``), and runs only its cheap ops
#: again in its backward (``LayerCost.cheap_recompute_ms``); its input stays on the
#: device. Offered for layers whose profile has those figures. A plan reports such a
#: layer as ``"recompute"`` in ``choices``, with ``"cheap"`` in ``recompute_ops``.
RECOMPUTE_CHEAP = "recompute_cheap"
#: The model's and the search's name for a layer recomputed part by part (see
#: :func:`graphslot.recompute.recompute_parts`): its forward saves what each part is given
#: (``LayerCost.parts_saved_bytes``), which goes to the host in a mode that offloads, and
#: its backward holds one part's activations at a time (``LayerCost.parts_work_bytes``)
#: for about a whole recompute's time (``LayerCost.parts_recompute_ms``). Offered for
#: layers whose profile has those figures. A plan reports such a layer as
#: ``"recompute"`` in ``choices``, with ``"parts"`` in ``recompute_ops``.
RECOMPUTE_PARTS = "recompute_parts"
_ALL_CHOICES = CHOICES + (RECOMPUTE_CHEAP, RECOMPUTE_PARTS)
#: each detailed choice's letter in a plan's short form (:func:`short`)
_LETTERS = {KEEP: "K", OFFLOAD: "O", RECOMPUTE: "R", RECOMPUTE_CHEAP: "C", RECOMPUTE_PARTS: "P"}
#: a recomputed layer's ``recompute_ops`` entry by detailed choice
_OPS = {RECOMPUTE: "all", RECOMPUTE_CHEAP: "cheap", RECOMPUTE_PARTS: "parts"}
_KINDS = {op: choice for choice, op in _OPS.items()}
#: the offload engine's modes a plan may use (see :class:`BudgetPlan`)
MODES = ("off", "resident", "remap")

#: ``memory_budget="auto"`` takes the least memory among plans at most this much slower
#: than keeping everything (what the model cannot tell apart from free)
AUTO_SLACK = 0.01
#: ... and saves at least this share of keeping everything's peak (and a whole granule):
#: less is within the model's error on memory, and not worth the host's work per
#: offloading layer and step, which the model does not count
AUTO_MIN_SAVING = 0.01
#: stacks up to this many layers are planned by trying every combination
EXHAUSTIVE_LAYERS = 8
#: the local search starts from this many of the best position patterns
SEARCH_STARTS = 12
#: :func:`fit_budget` builds at most this many plans as it corrects the model; before a
#: refusal at most one more per kind of plan and the least plan, and where one of those
#: fitted a faster one; then the one that fitted, again, if it was not built last
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
        cheap_saved_bytes: what it keeps when recomputed cheaply (the outputs of its
            expensive ops; see :data:`RECOMPUTE_CHEAP`); None: not offered.
        cheap_recompute_ms: the extra backward time of recomputing it cheaply (its cheap
            ops again); None: not offered.
        keep_only: its activations must stay on the device, neither offloaded nor
            recomputed (its forward fills a tensor after saving it, as ``nn.RReLU`` does).
        parts_saved_bytes: what its forward saves when recomputed part by part (what each
            part is given; see :data:`RECOMPUTE_PARTS`); None: not offered.
        parts_work_bytes: the working memory of its backward then, beyond what that
            forward saved (one part's activations again, and the gradients' temporaries);
            None: not offered.
        parts_recompute_ms: the extra backward time then; None: not offered.
    """

    forward_ms: float
    backward_ms: float
    saved_bytes: int
    recompute_ms: float | None = None
    work_bytes: int = 0
    input_bytes: int = 0
    grad_bytes: int = 0
    cheap_saved_bytes: int | None = None
    cheap_recompute_ms: float | None = None
    keep_only: bool = False
    parts_saved_bytes: int | None = None
    parts_work_bytes: int | None = None
    parts_recompute_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keep_only, bool):
            raise UsageError(f"LayerCost.keep_only must be a bool, got {self.keep_only!r}")
        for k in ("forward_ms", "backward_ms", "saved_bytes", "work_bytes", "input_bytes",
                  "grad_bytes", "cheap_saved_bytes", "cheap_recompute_ms", "parts_saved_bytes",
                  "parts_work_bytes", "parts_recompute_ms"):
            v = getattr(self, k)
            if v is None and k.startswith(("cheap", "parts")):
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != v:
                raise UsageError(f"LayerCost.{k} must be a number >= 0, got {v!r}")
        if (self.cheap_saved_bytes is None) != (self.cheap_recompute_ms is None):
            raise UsageError("LayerCost: cheap_saved_bytes and cheap_recompute_ms go together "
                             "(both, or neither)")
        if len({self.parts_saved_bytes is None, self.parts_work_bytes is None,
                self.parts_recompute_ms is None}) > 1:
            raise UsageError("LayerCost: parts_saved_bytes, parts_work_bytes and "
                             "parts_recompute_ms go together (all three, or none)")
        if self.recompute_ms is None:
            object.__setattr__(self, "recompute_ms", float(self.forward_ms))
        elif self.recompute_ms < 0:
            raise UsageError(f"LayerCost.recompute_ms must be >= 0, got {self.recompute_ms!r}")

    @property
    def recompute(self) -> float:
        return float(self.recompute_ms or 0.0)

    @property
    def cheap(self) -> bool:
        """Whether recomputing it cheaply is offered (its profile has the figures)."""
        return self.cheap_saved_bytes is not None

    @property
    def parts(self) -> bool:
        """Whether recomputing it part by part is offered (its profile has the figures)."""
        return self.parts_saved_bytes is not None

    def recompute_for(self, choice: str) -> float:
        """Its extra backward time under ``choice``."""
        if choice == RECOMPUTE:
            return self.recompute
        if choice == RECOMPUTE_CHEAP:
            return float(self.cheap_recompute_ms or 0.0)
        if choice == RECOMPUTE_PARTS:
            return float(self.parts_recompute_ms or 0.0)
        return 0.0

    def kept_for(self, choice: str, mode: str) -> int:
        """What it keeps in the graphs' pool between its forward and backward under
        ``choice`` (a recomputed layer's input is a boundary buffer, counted apart; what a
        layer recomputed by parts saves goes to a slot where the mode offloads)."""
        if choice == KEEP or (choice == OFFLOAD and mode == "off"):
            return self.saved_bytes
        if choice == RECOMPUTE_CHEAP:
            return int(self.cheap_saved_bytes or 0)
        if choice == RECOMPUTE_PARTS and mode == "off":
            return int(self.parts_saved_bytes or 0)
        return 0


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
        optimizer_state_bytes: of ``fixed_bytes``, the state the process's optimizers had
            still to make on the device when the stack was built (torch's optimizers make
            theirs at their first step; see :mod:`graphslot.optimizer_state`).
        keep_grads: the training loop keeps ``.grad`` through the next forward (it
            accumulates microbatches into it, or zeroes it in place): every plan gives the
            gradients homes of their own (see :func:`~graphslot.budget.gradient_homes`).
    """

    layers: tuple[LayerCost, ...]
    d2h_gbps: float
    h2d_gbps: float
    fixed_bytes: int = 0
    granularity: int = 2 << 20
    section_bytes: int = 32 << 20
    d2d_gbps: float | None = None
    optimizer_state_bytes: int = 0
    keep_grads: bool = False

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
        if self.optimizer_state_bytes < 0:
            raise UsageError("StackProfile: optimizer_state_bytes must be >= 0, got "
                             f"{self.optimizer_state_bytes!r}")

    def __hash__(self) -> int:
        # (the planner looks plans up by profile tens of thousands of times: hashed once)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

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
        recompute_ops: per layer, for a recomputed one, ``"all"`` (its whole forward
            again, keeping only its input), ``"cheap"`` (its cheap ops again, keeping
            its expensive ops' outputs: :mod:`graphslot.recompute`) or ``"parts"`` (its
            whole forward again, one part at a time, keeping what each part is given);
            None for the others. Empty: every recomputed layer ``"all"``.
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
        fixed_correction_bytes: what builds of earlier plans of its kind (whether it
            offloads, where the gradients live) showed the model's peak to be off by
            (counted in ``predicted_peak_bytes`` as planned; the newest build's, where
            none of its kind was built).
        builds: the plans built on the way to this one, in order, each as ``(short
            form, mode, bytes its build held)`` (:func:`~graphslot.budget.fit_budget`;
            empty where nothing was built).
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
    recompute_ops: tuple[str | None, ...] = ()
    builds: tuple[tuple[str, str, int], ...] = ()

    def layers(self, choice: str) -> list[int]:
        """The indices of the layers with ``choice`` (``"recompute"``: every kind;
        :data:`RECOMPUTE_CHEAP`: those recomputed cheaply; :data:`RECOMPUTE_PARTS`: those
        recomputed part by part)."""
        return [i for i, c in enumerate(self.detailed) if c == choice
                or (choice == RECOMPUTE and c in _OPS)]

    @property
    def detailed(self) -> tuple[str, ...]:
        """``choices`` with :data:`RECOMPUTE_CHEAP` and :data:`RECOMPUTE_PARTS` for the
        layers recomputed cheaply or part by part (what the model's functions take)."""
        return _detailed(self.choices, self.recompute_ops)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choices"] = list(self.choices)
        d["recompute_ops"] = list(self.recompute_ops)
        d["builds"] = [list(b) for b in self.builds]
        d.pop("profile")
        return d

    def __str__(self) -> str:
        return (f"{short(self.detailed)} ({self.mode}): peak {format_bytes(self.predicted_peak_bytes)}, "
                f"step {self.predicted_step_ms:.1f} ms (lower bound {self.lower_bound_ms:.1f}); "
                f"{self.reason}")


def reported(choices: Sequence[str]) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """``choices`` as a plan reports them, ``(choices, recompute_ops)``: the inverse of
    :attr:`BudgetPlan.detailed`."""
    ops = tuple(_OPS.get(c) for c in choices)
    return (tuple(RECOMPUTE if c in _OPS else c for c in choices),
            ops if any(o not in (None, "all") for o in ops) else ())


def short(choices: Sequence[str]) -> str:
    """A letter per layer of detailed ``choices``: K keeps, O offloads, R recomputes, C
    recomputes only the cheap ops, P recomputes part by part."""
    return "".join(_LETTERS[c] for c in choices)


def plan_letters(choices: Sequence[str], recompute_ops: Sequence[str | None] = ()) -> str:
    """:func:`short` of a plan as reported (``choices`` and ``recompute_ops``, as in
    :meth:`BudgetPlan.as_dict`)."""
    return short(_detailed(choices, recompute_ops))


def _detailed(choices: Sequence[str], recompute_ops: Sequence[str | None]) -> tuple[str, ...]:
    """Reported ``choices`` and ``recompute_ops`` as the model's detailed choices."""
    ops = tuple(recompute_ops) + (None,) * (len(choices) - len(recompute_ops))
    return tuple(_KINDS.get(op or "all", c) if c == RECOMPUTE else c for c, op in zip(choices, ops))




_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40, "p": 1 << 50, "pb": 10**15, "pib": 1 << 50, "e": 1 << 60,
          "eb": 10**18, "eib": 1 << 60}


#: the largest budget :func:`parse_budget` takes (an exbibyte: beyond any device's memory)
MAX_BUDGET_BYTES = 1 << 60


def _python_number(v: Any) -> Any:
    """``v`` as Python's number where it is numpy's or torch's (a scalar, a 0-d array or
    tensor, not a bool one), or where it is another real number (a Fraction, a Decimal)
    that a float holds; ``v`` itself otherwise, for the caller to judge."""
    if isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "dtype") and hasattr(v, "item"):
        if getattr(v, "ndim", None) != 0 or "bool" in str(v.dtype):
            return v
        try:
            return v.item()
        except (RuntimeError, ValueError):  # (a meta tensor has no value to read)
            return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        try:
            return float(v)
        except (OverflowError, ValueError):
            return math.inf
    return v


def parse_budget(v: int | float | str) -> int:
    """Bytes from a size: an integer, or a number with a unit (``"10GiB"``, ``"9.5G"``,
    ``"12000MiB"``, ``"8e9"``; k, M, G, T, P, E alone are binary). numpy's and torch's
    numbers (a 0-d array or tensor too) count as Python's.

    Raises:
        UsageError: not a positive size.
    """
    given = v
    v = _python_number(v)
    if isinstance(v, bool):
        raise UsageError(f"memory budget must be a size in bytes, got {given!r}")
    if isinstance(v, (int, float)):
        n = v
    elif isinstance(v, str):
        s = v.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        try:
            n = float(num) * _UNITS[unit]
        except (ValueError, KeyError):
            raise UsageError(f"memory budget {given!r} is not a size (e.g. 10GiB, 9.5G, "
                             "12000MiB or bytes)") from None
    else:
        raise UsageError(f"memory budget must be bytes, a size string or 'auto', got {given!r}")
    if n != n or n in (math.inf, -math.inf):
        raise UsageError(f"memory budget {given!r} is not a size: give a finite number of bytes "
                         "(e.g. 10GiB, 9.5G, 12000MiB or bytes)")
    if not n > 0:
        raise UsageError(f"memory budget must be positive, got {given!r}")
    if n > MAX_BUDGET_BYTES:
        raise UsageError(f"memory budget {given!r} is beyond any device's memory (over 1 EiB): "
                         "give the device memory the step may hold")
    if n < 1:
        raise UsageError(f"memory budget {given!r} is less than a byte; give bytes or a size "
                         "with a unit (e.g. 0.5GiB)")
    return int(n)
