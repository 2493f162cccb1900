"""Where a GraphedLayers step spends host time, per layer, by function (cProfile).

    GRAPHSLOT_BACKEND=cuda python benchmarks/profile_host.py [--preset launch] [--modes off resident remap]

On the launch-bound preset the step is host-bound: this shows which bookkeeping costs it.
Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.bench import BenchShape
from graphslot.cli.toy import Block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="launch")
    ap.add_argument("--modes", nargs="+", default=["off", "resident", "remap"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    b = graphslot.get_backend()
    shape = BenchShape.preset(args.preset)
    torch.manual_seed(0)
    layers = [Block(shape).to(device=b.device, dtype=shape.dtype) for _ in range(shape.layers)]
    x = torch.randn(shape.batch, shape.seq, shape.hidden, device=b.device, dtype=shape.dtype,
                    requires_grad=True)
    gy = torch.randn_like(x)
    for mode in args.modes:
        stack = GraphedLayers(layers, x, mode=mode, backend=b)

        def step() -> None:
            stack(x).backward(gy)
            for m in layers:
                for p in m.parameters():
                    p.grad = None

        for _ in range(5):
            step()
        b.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        b.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step()
        b.synchronize()
        pr.disable()
        out = io.StringIO()
        st = pstats.Stats(pr, stream=out)
        st.sort_stats("tottime").print_stats(args.top)
        per = shape.layers * args.steps
        print(f"== {mode}: {wall:.2f} ms a step unprofiled; tottime per layer-step below = "
              f"tottime / {per}")
        for line in out.getvalue().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[1].replace(".", "").isdigit():
                print(f"{float(parts[1]) / per * 1e6:8.1f} us  {parts[0]:>8}  {parts[5][-90:]}")
        stack.close()


if __name__ == "__main__":
    main()
