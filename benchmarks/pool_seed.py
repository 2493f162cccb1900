"""Does seeding the graphs' pool with one block shrink what it reserves? One process per
run (cuda only).

    GRAPHSLOT_BACKEND=cuda python benchmarks/pool_seed.py [--preset llama] \
        [--seeds 0,2048,2304] [--expandable] [--json OUT]

Runs eager checkpointing, then the least plan (every layer recomputed, its input on the
host, remap) with the graphs' pool seeded with each size in MiB before the captures
(0: not seeded). Each run trains (forward, backward, SGD step, ``zero_grad()``) and
reports the median step, the peak as the process holds it (the allocator's peak
reserved bytes plus graphslot's peak pages, counted from after the build) and what the
graphs' pool reserves. ``--expandable`` runs each again under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from budget_probe import child_result, record, train

MiB = 1 << 20


def child(args: argparse.Namespace) -> dict:
    import torch
    from torch import nn

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import BenchShape, CheckpointedLayer, training_data

    b = get_backend()
    shape = BenchShape.preset(args.preset)
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    t0 = time.perf_counter()
    stack: nn.Module
    if args.run == "checkpoint":
        stack = nn.Sequential(*(CheckpointedLayer(m) for m in layers))
    else:
        GraphedLayers._pool_seed_bytes = int(args.run) * MiB
        stack = GraphedLayers(layers, x, mode="remap", recompute_layers=range(len(layers)))
    build_s = time.perf_counter() - t0

    times, peak = train(b, stack, opt, x, gy, args.steps)
    peak = peak or 0
    pool = getattr(stack, "pool_bytes", None)
    segments = []
    owner = getattr(stack, "_pool_owner", None)
    if owner is not None and getattr(owner, "pool", None) is not None and torch.cuda.is_available():
        segments = sorted((round(int(seg["total_size"]) / MiB) for seg in torch.cuda.memory_snapshot()
                           if tuple(seg.get("segment_pool_id", (0, 0))) == tuple(owner.pool)),
                          reverse=True)
    if callable(getattr(stack, "close", None)):
        stack.close()
    return {"run": args.run, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "build_s": round(build_s, 2), "step_ms": round(statistics.median(times), 2),
            "peak_mib": round(peak / MiB, 1), "pool_mib": None if pool is None else round(pool / MiB, 1),
            "pool_segments_mib": segments}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--seeds", default="0,2048,2304")
    ap.add_argument("--expandable", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(child(args)))
        return 0
    confs = [""] + (["expandable_segments:True"] if args.expandable else [])
    runs = ["checkpoint", *args.seeds.split(",")]
    results = []
    for conf in confs:
        env = dict(os.environ)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        for run in runs:
            argv = [sys.executable, __file__, "--preset", args.preset, "--steps", str(args.steps),
                    "--run", run]
            record(results, child_result(argv, env, {"run": run, "alloc_conf": conf}), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
