"""Benchmark: how long the memory budget planner takes to plan a stack, by its length.

    python benchmarks/budget_search.py [--layers 8,16,32,48] [--fractions 0.6,0.8] [--json]

Each stack is that many copies of one Llama-3-8B decoder layer at sequence 8192 as the
H200 profiled it (forward 7.1 ms, backward 14.6 ms, 1,569 MiB saved, 673 MiB of it kept
by a cheap recompute for 1.8 ms; 55 GB/s each way), its fixed memory an eighth of eight
layers' per layer. For each fraction of the every-layer-kept peak, one
:func:`graphslot.budget.plan_budget` call from cold caches: the time it took, the plan
(K keep, O offload, R recompute, C recompute only the cheap ops), its mode and predicted
step. Stacks of more layers than ``EXHAUSTIVE_LAYERS`` are planned by the local search.

Not a test: it asserts nothing. Device neutral: runs anywhere the package imports.
"""

from __future__ import annotations

import argparse
import json
import time

from graphslot.budget import LayerCost, StackProfile, plan_budget, predict_peak_bytes
from graphslot.budget.costs import short
from graphslot.budget.search import _scored_unfixed  # (its cache, cleared per plan)

MiB = 1 << 20

#: one Llama-3-8B decoder layer at sequence 8192, bf16, as profiled on the H200
LAYER = LayerCost(forward_ms=7.13, backward_ms=14.55, saved_bytes=1_645_281_296,
                  work_bytes=150_978_560, input_bytes=64 * MiB, grad_bytes=436_224_000,
                  cheap_saved_bytes=705_691_664, cheap_recompute_ms=1.8)
FIXED_PER_LAYER = 609_714_164  # the eight-layer stack's fixed memory, per layer


def stack(n: int) -> StackProfile:
    return StackProfile((LAYER,) * n, d2h_gbps=55.1, h2d_gbps=55.3,
                        fixed_bytes=FIXED_PER_LAYER * n, d2d_gbps=1947.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="8,16,32,48", help="stack lengths, comma-separated")
    ap.add_argument("--fractions", default="0.6,0.8",
                    help="budgets as fractions of the every-layer-kept peak")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    args = ap.parse_args()
    rows = []
    for n in (int(v) for v in args.layers.split(",")):
        p = stack(n)
        keep_all = predict_peak_bytes(p, ("keep",) * n, "off")
        for frac in (float(v) for v in args.fractions.split(",")):
            _scored_unfixed.cache_clear()
            t0 = time.perf_counter()
            plan = plan_budget(p, int(keep_all * frac))
            took = time.perf_counter() - t0
            row = {"layers": n, "fraction": frac, "seconds": round(took, 2),
                   "plan": short(plan.detailed), "mode": plan.mode,
                   "predicted_step_ms": round(plan.predicted_step_ms, 1)}
            rows.append(row)
            if not args.json:
                print(f"{n:3d} layers at {frac:.2f} x: {took:6.2f} s  {row['plan']} "
                      f"{plan.mode}, {row['predicted_step_ms']} ms", flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
