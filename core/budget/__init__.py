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
  layer's activations again among it; recomputed part by part, one part's at a time).
  :func:`predict_peak_bytes`.

:func:`plan_budget` searches the choices: every combination for small stacks, a local
search from position patterns above that (tested against the exhaustive search).

The package: :mod:`.costs` (what it plans from and returns), :mod:`.model` (peak, step and
bound of a plan) and :mod:`.search` (the planning), each importing only those before it
(contract ``budget-layers``). Of the rest of graphslot it imports only the interface's
:mod:`~graphslot.backend` (granule sizes), :mod:`~graphslot.errors` and
:mod:`~graphslot.sizes`; :mod:`graphslot.profile`, the adapters and the commands import it.
"""

from __future__ import annotations

from .costs import (AUTO_MIN_SAVING, AUTO_SLACK, CHOICES, EXHAUSTIVE_LAYERS, FIT_BUILDS, KEEP,
                    MODES, OFFLOAD, RECOMPUTE, RECOMPUTE_CHEAP, RECOMPUTE_PARTS, SEARCH_STARTS,
                    BudgetPlan, LayerCost,
                    StackProfile, parse_budget, plan_letters)
from .model import (banks_bytes, banks_for, bound_ms, gradient_homes, has_gradient_homes,
                    lower_bound_ms, predict_peak_bytes, predict_step_ms, slot_bytes)
from .search import fit_budget, plan_budget, refusal_message, smallest_peak

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "CHOICES", "RECOMPUTE_CHEAP", "RECOMPUTE_PARTS",
           "LayerCost", "StackProfile",
           "BudgetPlan", "predict_step_ms", "predict_peak_bytes", "banks_bytes", "slot_bytes",
           "bound_ms", "lower_bound_ms", "plan_budget", "smallest_peak", "parse_budget",
           "fit_budget", "gradient_homes", "has_gradient_homes", "refusal_message", "plan_letters"]
