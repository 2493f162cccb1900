"""The slot planner: pack tensors with known lifetimes into one fixed arena.

A captured device graph keeps the addresses it saw, so every tensor it touches needs a
fixed byte offset in an arena that graphslot reserves once. Tensors whose lifetimes do
not overlap may share bytes; so may tensors of *mutually exclusive branches* (e.g. the
context-parallel sizes or sequence buckets of one training step, of which exactly one
runs per replay). This package is pure Python and device neutral.

Model:

* A :class:`TensorSpec` lives over the half-open step interval ``[start, end)``.
* ``branch=None`` means common: the tensor conflicts with every branch. Tensors of two
  *different* branches never conflict; tensors of one branch conflict with each other.
* Tensors sharing an ``alias_group`` are views of one storage. The group is placed as
  one block; each member lands at ``group_base + alias_offset``, so relative byte
  offsets and overlaps are kept. The block is live over the union of its members'
  lifetimes; members of one group may overlap each other freely.

:func:`plan` places everything with greedy heuristics (sweeps over time in start
order and its time-reversed twin, first-fit in start order, greedy by size as in the
offline planners of TFLite and ONNX Runtime, all branch aware, and a few other orders;
the smallest arena wins, then squeaky-wheel refinement while a work budget lasts) and
reports :func:`lower_bound`: the most bytes live at any step in any branch, which no
valid plan can beat. :func:`verify` checks any plan, from
:func:`plan` or elsewhere.

Where graphslot maps a pool's physical memory itself, :func:`share_pages` backs pages of
one address range that are never live at once with one physical page each
(:class:`PageSharing`): the blocks stay where they were handed out.

The seven-field slot plan of the dynamic context-parallel capture interface
(:class:`SlotPlanEntry`) is produced by :func:`export_slot_plan` and read back by
:func:`import_slot_plan`.

The package, one concept a module. A module imports only modules on rows below its own,
and two on one row do not import each other (pyproject's contract "planner-layers"):

    slot_plans | planning | pages  the seven-field table | plan(), baselines() |
                              share_pages()
    verification | heuristics verify() | candidate orders, work budget, refinement
    placement                 the packers and fit rules
    blocks                    the checks across tensors, the units the packers place
    lifetimes                 lower_bound(), merge_intervals()
    specs                     TensorSpec, Plan, PlanError

Outside itself it imports :mod:`graphslot.errors` only. ``blocks``, ``placement`` and
``heuristics`` are internal: the public surface is what this package exports.
"""

from __future__ import annotations

from .heuristics import BASELINES
from .lifetimes import lower_bound
from .pages import PageSharing, share_pages
from .lifetimes import merge_intervals as merge_intervals  # graphslot.paged's
from .planning import baselines, plan
from .slot_plans import SlotPlanEntry, branch_table, export_slot_plan, import_slot_plan
from .specs import Plan, PlanError, TensorSpec
from .verification import verify

# As before the split; merge_intervals stays importable but out of __all__.
__all__ = [
    "TensorSpec",
    "Plan",
    "PlanError",
    "plan",
    "verify",
    "lower_bound",
    "baselines",
    "BASELINES",
    "SlotPlanEntry",
    "branch_table",
    "export_slot_plan",
    "import_slot_plan",
    "PageSharing",
    "share_pages",
]
