"""Where a GraphedLayers step spends host time, per layer, by function (cProfile).

    GRAPHSLOT_BACKEND=cuda python benchmarks/profile_host.py [--preset launch] [--modes off resident remap]

On the launch-bound preset the step is host-bound: this shows which bookkeeping costs it.
Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time
from typing import Callable

import torch

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.bench import BenchShape
from graphslot.cli.toy import Block


def stack_inputs(b: graphslot.Backend, preset: str) -> tuple[BenchShape, list[torch.nn.Module],
                                                             torch.Tensor, torch.Tensor]:
    """The bench's layers of ``preset`` (seeded), an input and an output gradient."""
    shape = BenchShape.preset(preset)
    torch.manual_seed(0)
    layers = [Block(shape).to(device=b.device, dtype=shape.dtype) for _ in range(shape.layers)]
    x = torch.randn(shape.batch, shape.seq, shape.hidden, device=b.device, dtype=shape.dtype,
                    requires_grad=True)
    return shape, layers, x, torch.randn_like(x)


def training_step(stack: GraphedLayers, layers: list[torch.nn.Module], x: torch.Tensor,
                  gy: torch.Tensor) -> Callable[[], None]:
    """One forward and backward through ``stack``, gradients dropped after."""
    def step() -> None:
        stack(x).backward(gy)
        for m in layers:
            for p in m.parameters():
                p.grad = None
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="launch")
    ap.add_argument("--modes", nargs="+", default=["off", "resident", "remap"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    b = graphslot.get_backend()
    shape, layers, x, gy = stack_inputs(b, args.preset)
    # Wall time inside each raw driver call, on whichever thread calls it (remap runs
    # them on its worker thread, which cProfile does not see).
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def timed(name: str) -> None:
        fn = getattr(b.driver, name)

        def wrapper(*a: object) -> object:
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[name] += time.perf_counter() - t
                calls[name] += 1
        setattr(b.driver, name, wrapper)

    for name in ("create", "release", "map", "unmap", "set_access"):
        timed(name)
    for mode in args.modes:
        stack = GraphedLayers(layers, x, mode=mode, backend=b)
        step = training_step(stack, layers, x, gy)
        for _ in range(5):
            step()
        b.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        b.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        spent.clear()
        calls.clear()
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
        # Our own functions by cumulative time: what each piece of bookkeeping costs whole.
        ours = io.StringIO()
        pstats.Stats(pr, stream=ours).sort_stats("cumulative").print_stats(r"graphslot|adapters|core/|backends/", 2 * args.top)
        print(f"== {mode}: {wall:.2f} ms a step unprofiled; tottime per layer-step below = "
              f"tottime / {per}")
        for line in out.getvalue().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[1].replace(".", "").isdigit():
                print(f"{float(parts[1]) / per * 1e6:8.1f} us  {parts[0]:>8}  {parts[5][-90:]}")
        print("  -- cumulative, graphslot's own functions")
        for line in ours.getvalue().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[0].split("/")[0].isdigit() and parts[3].replace(".", "").isdigit():
                print(f"{float(parts[3]) / per * 1e6:8.1f} us  {parts[0]:>8}  {parts[5][-90:]}")
        for name in sorted(spent):
            print(f"  driver {name:20s} {calls[name] / per:6.2f} calls  "
                  f"{spent[name] / per * 1e6:8.1f} us per layer-step "
                  f"({spent[name] / max(calls[name], 1) * 1e6:.1f} us each)")
        stack.close()


if __name__ == "__main__":
    main()
