"""One training step's device timeline under a memory budget's plan (cuda or cpu).

    GRAPHSLOT_BACKEND=cuda python benchmarks/plan_timeline.py BUDGET [--preset llama] \
        [--accumulate N] [--keep-grad] > OUT.json

``BUDGET`` is a size (``16GiB``, ``15.03GB``), ``auto``, ``keep`` (mode off, every layer
kept), or ``resident`` / ``remap`` (that mode, every layer offloaded). Builds
``GraphedLayers(memory_budget=BUDGET)`` over the bench preset's layers, runs three training
steps (``--accumulate`` microbatches' forward and backward, SGD step, ``zero_grad()``, with
``set_to_none=False`` under ``--keep-grad``), then one more with a timeline, and prints
JSON (a ``microbatch`` span on track ``step`` marks where each microbatch was queued): every span (track, name, start ms, duration ms, bytes; compute
spans per layer's graph, copy spans as queued on their streams, so a copy's span includes
its wait), the plan and the profile it was made from. Set beside the planner's model it
shows where the model and the device part (the budget model's bank wait at a layer's start
and the slot copy came from such timelines).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from graphslot import get_backend
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.bench_models import BenchShape, training_data
from graphslot.trace import Timeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("budget")
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--keep-grad", action="store_true")
    args = ap.parse_args()
    b = get_backend()
    shape = BenchShape.preset(args.preset)
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    kw: dict = (dict(mode="off") if args.budget == "keep" else dict(mode=args.budget)
                if args.budget in ("resident", "remap") else dict(memory_budget=args.budget))
    with GraphedLayers(layers, x, **kw) as stack:
        def step() -> None:
            for k in range(args.accumulate):
                tl = stack.timeline
                with tl.span("step", f"microbatch {k}") if tl is not None else contextlib.nullcontext():
                    stack(x).backward(gy)
            opt.step()
            opt.zero_grad(set_to_none=not args.keep_grad)

        for _ in range(3):
            step()
        b.synchronize()
        tl = Timeline(b)
        stack.timeline = tl
        tl.start()
        step()
        b.synchronize()
        stack.timeline = None
        out: dict = {"budget": args.budget,
                     "spans": [(s.track, s.name, round(s.start_ms, 2), round(s.dur_ms, 2), s.nbytes)
                               for s in tl.spans()]}
        if stack.plan is not None:
            out["plan"] = stack.plan.as_dict()
            if stack.plan.profile is not None:
                out["profile"] = stack.plan.profile.as_dict()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
