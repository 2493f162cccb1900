"""Does the host's lead over the device change a step's time? (cuda or cpu)

    GRAPHSLOT_BACKEND=cuda python benchmarks/host_pace.py [--preset llama] [--mode resident] \
        [--accumulate 1,4] [--steps 3] > OUT.json

One ``GraphedLayers`` stack in ``--mode`` over the bench preset's layers, trained with SGD
and ``zero_grad()`` as the bench does, timed per microbatch in three ways on the same
stack, each after two warm-up steps:

* ``free``: the host queues the step as fast as it can (the bench's timed steps);
* ``synced``: the host waits for the device after every microbatch's backward;
* ``traced``: a device timeline records events around every replay and copy (the bench's
  phase step), its spans never read;
* ``traced-compute`` / ``traced-copies``: its events around the replays only, or around
  the copies only; ``marked-copies``: events without timing around the copies only.

Where ``free`` is slower than the others, a step pays for the host running ahead of the
device, not for its work: the kept-gradient runs of the resident mode took longer per
microbatch untraced than traced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from graphslot import get_backend
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.bench_models import BenchShape, training_data
from graphslot.trace import Timeline


class _Only(Timeline):
    """A timeline whose spans record events on ``tracks`` alone (with or without timing)."""

    def __init__(self, backend, tracks: tuple[str, ...], timing: bool = True) -> None:  # type: ignore[no-untyped-def]
        super().__init__(backend)
        self.tracks, self.timing = tracks, timing

    @contextlib.contextmanager
    def span(self, track, name, stream=None, nbytes=0):  # type: ignore[no-untyped-def]
        if track not in self.tracks:
            yield
            return
        b = self.backend
        s = b.current_stream() if stream is None else stream
        b.record_event(b.new_event(timing=self.timing), s)
        yield
        b.record_event(b.new_event(timing=self.timing), s)


def timeline(b, how: str) -> Timeline | None:  # type: ignore[no-untyped-def]
    copies = ("d2h", "h2d")
    return {"traced": lambda: Timeline(b),
            "traced-compute": lambda: _Only(b, ("compute",)),
            "traced-copies": lambda: _Only(b, copies),
            "marked-copies": lambda: _Only(b, copies, timing=False)}.get(how, lambda: None)()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--mode", default="resident", choices=("off", "resident", "remap"))
    ap.add_argument("--accumulate", default="1,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ways", default="free,synced,traced,free",
                    help="free, synced, traced, traced-compute, traced-copies, marked-copies")
    args = ap.parse_args()
    b = get_backend()
    shape = BenchShape.preset(args.preset)
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    out: dict = {"preset": args.preset, "mode": args.mode, "ms_per_microbatch": {}}
    with GraphedLayers(layers, x, mode=args.mode) as stack:
        def step(acc: int, how: str) -> None:
            for _ in range(acc):
                stack(x).backward(gy)
                if how == "synced":
                    b.synchronize()
            opt.step()
            opt.zero_grad()

        for acc in (int(a) for a in args.accumulate.split(",")):
            for how in args.ways.split(","):
                tl = timeline(b, how)
                stack.timeline = tl
                times = []
                for i in range(2 + args.steps):
                    if tl is not None:
                        tl.start()
                    b.synchronize()
                    t0 = time.perf_counter()
                    step(acc, how)
                    b.synchronize()
                    if i >= 2:
                        times.append((time.perf_counter() - t0) * 1e3 / acc)
                stack.timeline = None
                key = f"acc{acc} {how}"
                out["ms_per_microbatch"].setdefault(key, []).append(round(statistics.median(times), 2))
                print(key, out["ms_per_microbatch"][key], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
