"""One training step's device timeline under a memory budget's plan (cuda or cpu).

    GRAPHSLOT_BACKEND=cuda python benchmarks/plan_timeline.py BUDGET [--preset llama] > OUT.json

``BUDGET`` is a size (``16GiB``, ``15.03GB``), ``auto``, or ``keep`` (mode off, every layer
kept). Builds ``GraphedLayers(memory_budget=BUDGET)`` over the bench preset's layers, runs
three training steps (forward, backward, SGD step, ``zero_grad()``), then one more with a
timeline, and prints JSON: every span (track, name, start ms, duration ms, bytes; compute
spans per layer's graph, copy spans as queued on their streams, so a copy's span includes
its wait), the plan and the profile it was made from. Set beside the planner's model it
shows where the model and the device part (the budget model's bank wait at a layer's start
and the slot copy came from such timelines).
"""

from __future__ import annotations

import argparse
import json

import torch

from graphslot import get_backend
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.bench_models import BenchShape, training_data
from graphslot.trace import Timeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("budget")
    ap.add_argument("--preset", default="llama")
    args = ap.parse_args()
    b = get_backend()
    shape = BenchShape.preset(args.preset)
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    kw: dict = dict(mode="off") if args.budget == "keep" else dict(memory_budget=args.budget)
    with GraphedLayers(layers, x, **kw) as stack:
        def step() -> None:
            stack(x).backward(gy)
            opt.step()
            opt.zero_grad()

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
