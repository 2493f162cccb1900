"""Does the caching allocator's ``max_split_size_mb``, set only while the graphs are
captured, shrink the graphs' pool? One process per run (cuda only).

    GRAPHSLOT_BACKEND=cuda python benchmarks/capture_split.py [--preset llama] \
        [--runs checkpoint,least,least@32,...] [--json OUT]

A run is ``checkpoint`` (eager, ``torch.utils.checkpoint`` on every layer) or a plan,
``least`` (every layer recomputed, its input on the host, remap), ``mixed`` (every layer
recomputed but 2, 5 and 7, mode off), ``keep`` (every layer kept, mode off) or ``cheap``
(every layer recomputed cheaply, mode off), optionally
``@MiB``: the allocator's ``max_split_size_mb`` set to that while the stack is built (its
captures allocate), and put back after. Blocks at least that large are then never split
for a smaller request, and a request of that size or more takes a cached block only
within 20 MiB of its size: what a capture frees is reused by requests like the ones that
made it. Each run trains (forward, backward, SGD step, ``zero_grad()``) and reports the
median step, the peak as the process holds it (allocator peak reserved plus graphslot's
peak pages, from after the first step) and the graphs' pool with its segments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from budget_probe import child_argv, child_result, probe_args, probe_shape, record, train

MiB = 1 << 20
SHAPE = ("hidden", "ffn", "seq")  # (smaller shapes for a quick look)
UNLIMITED = "max_split_size_mb:17592186044415"  # (SIZE_MAX / MiB: the allocator's default)


def child(args: argparse.Namespace) -> dict:
    import torch
    from torch import nn

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import CheckpointedLayer, training_data

    b = get_backend()
    layers, x, gy = training_data(probe_shape(args, SHAPE), b.device)
    n = len(layers)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    plan, _, split = args.run.partition("@")
    t0 = time.perf_counter()
    stack: nn.Module
    if plan == "checkpoint":
        stack = nn.Sequential(*(CheckpointedLayer(m) for m in layers))
    else:
        kw = {"least": dict(mode="remap", recompute_layers=range(n)),
              "mixed": dict(mode="off", recompute_layers=[i for i in range(n) if i not in (2, 5, 7)]),
              "keep": dict(mode="off"),
              "cheap": dict(mode="off", recompute_layers=range(n), recompute_ops="cheap")}[plan]
        if split:
            torch._C._accelerator_setAllocatorSettings(f"max_split_size_mb:{int(split)}")
        try:
            stack = GraphedLayers(layers, x, **kw)
        finally:
            if split:
                torch._C._accelerator_setAllocatorSettings(UNLIMITED)
    build_s = time.perf_counter() - t0
    times, peak = train(b, stack, opt, x, gy, args.steps)
    pool = getattr(stack, "pool_bytes", None)
    segments: list[int] = []
    owner = getattr(stack, "_pool_owner", None)
    if owner is not None and getattr(owner, "pool", None) is not None:
        segments = sorted((round(int(seg["total_size"]) / MiB) for seg in torch.cuda.memory_snapshot()
                           if tuple(seg.get("segment_pool_id", (0, 0))) == tuple(owner.pool)),
                          reverse=True)
    if callable(getattr(stack, "close", None)):
        stack.close()
    return {"run": args.run, "build_s": round(build_s, 2), "step_ms": round(statistics.median(times), 2),
            "peak_mib": round((peak or 0) / MiB, 1),
            "pool_mib": None if pool is None else round(pool / MiB, 1), "pool_segments_mib": segments}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--runs", default="checkpoint,least,least@32,least@72,least@240,mixed,mixed@32,mixed@72")
    args = probe_args(ap, 3, SHAPE)
    if args.run:
        print(json.dumps(child(args)))
        return 0
    results = []
    for run in args.runs.split(","):
        record(results, child_result(child_argv(__file__, args, SHAPE, run), dict(os.environ),
                                     {"run": run}), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
