"""Where recompute under graphs holds more than eager activation checkpointing (cuda only).

    GRAPHSLOT_BACKEND=cuda python benchmarks/recompute_memory.py [--preset llama] \
        [--runs checkpoint recompute recompute_remap keep_top3] [--layers N] [--seq N]

Each run (one process each) builds the bench preset's layers, runs two training steps
(forward, backward, SGD step, ``zero_grad()``), empties the cache, and measures a third
with the allocator's history on: the peak reserved and allocated bytes, what was live at
the allocated peak (by pool and allocating frame), and what each pool reserves at the end
with the free bytes inside its segments. Runs: ``checkpoint`` (eager,
``torch.utils.checkpoint`` on every layer), ``recompute`` (GraphedLayers, every layer
recomputed), ``recompute_remap`` (every layer recomputed, its input sent to the host in
remap: the budget planner's least plan), ``keep_topK`` (GraphedLayers, the top K layers
kept, the rest recomputed). GraphedLayers runs also report graphslot's peak mapped pages
and whether the gradients had homes outside the pool.
Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import subprocess
import sys
from typing import Any

from alloc_trace import by_label, events_since, highest_live, live_blocks, pool_of, trace_end

MiB = 1 << 20


def _where(frames: list[dict[str, Any]] | None, depth: int = 3) -> str:
    fr = [f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"
          for f in frames or [] if f.get("filename", "").endswith(".py")]
    return " < ".join(fr[:depth]) or "(no python frame)"


def _blocks(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """Every block of every segment: pool, state, size and the frames that allocated it."""
    out = []
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            out.append({"pool": pool_of(seg), "segment": seg["address"], "segment_size": seg["total_size"],
                        "address": blk["address"], "size": blk["size"], "state": blk["state"],
                        "where": _where(blk.get("frames"), depth=6)})
    return out


def child(run: str, preset: str, layers_n: int | None, seq: int | None,
          blocks_path: str | None = None) -> dict[str, Any]:
    import torch

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import BenchShape, CheckpointedLayer, training_data

    b = get_backend()
    shape = BenchShape.preset(preset)
    if layers_n:
        shape.layers = layers_n
    if seq:
        shape.seq = seq
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    n = len(layers)
    if blocks_path:  # the frames of what the build allocates, graph pools included
        torch.cuda.memory._record_memory_history(max_entries=400000)
    if run == "checkpoint":
        checkpointed = torch.nn.Sequential(*(CheckpointedLayer(m) for m in layers))

        def fwd() -> torch.Tensor:
            return checkpointed(x)
    else:
        mode, offload = "off", ()
        if run == "recompute":
            rec = range(n)
        elif run == "recompute_remap":  # the budget's least plan: inputs to the host too
            rec, mode, offload = range(n), "remap", range(n)
        elif run.startswith("keep_top"):
            rec = range(n - int(run[len("keep_top"):]))
        else:
            raise SystemExit(f"unknown run {run!r}")
        stack = GraphedLayers(layers, x, mode=mode, recompute_layers=rec, offload_layers=offload)

        def fwd() -> torch.Tensor:
            return stack(x)

    for _ in range(2):
        fwd().backward(gy)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=400000)
    snap0 = torch.cuda.memory._snapshot()
    live = live_blocks(snap0, lambda pool, blk: f"{pool} before step")
    t0 = trace_end(snap0)
    torch.cuda.reset_peak_memory_stats()
    b.ledger.reset_peak()
    reserved0 = torch.cuda.memory_reserved()
    fwd().backward(gy)
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    snap1 = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if blocks_path:
        with open(blocks_path, "w") as f:
            json.dump({"run": run, "blocks": _blocks(snap1)}, f)
    events = events_since(snap1, t0)
    best, at_best, best_i = highest_live(live, events, _where)
    pools: dict[str, dict[str, float]] = {}
    for seg in snap1["segments"]:
        pool = pool_of(seg)
        d = pools.setdefault(pool, {"reserved": 0, "active": 0, "free": 0, "segments": 0})
        d["segments"] += 1
        d["reserved"] += seg["total_size"]
        for blk in seg["blocks"]:
            d["active" if blk["state"] == "active_allocated" else "free"] += blk["size"]
    sizes = collections.Counter()
    for seg in snap1["segments"]:
        if pool_of(seg) == "graph":
            sizes[round(seg["total_size"] / MiB)] += 1
    return {
        "run": run,
        "reserved_before_mib": round(reserved0 / MiB, 1),
        "peak_reserved_mib": round(stats["reserved_bytes.all.peak"] / MiB, 1),
        "peak_allocated_mib": round(stats["allocated_bytes.all.peak"] / MiB, 1),
        "replayed_peak_mib": round(best / MiB, 1),
        "peak_event": best_i, "events": len(events),
        "at_peak_mib": by_label(at_best, 14),
        "pools_end_mib": {p: {k: round(v / MiB, 1) if k != "segments" else v for k, v in d.items()}
                          for p, d in pools.items()},
        "graph_segment_sizes_mib": dict(sorted(sizes.items())),
        "weights_mib": round(sum(p.numel() * p.element_size() for p in params) / MiB, 1),
        "graphslot_peak_mapped_mib": round(b.ledger.peak_mapped_bytes / MiB, 1),
        "gradient_homes": bool(getattr(stack, "_grad_homes", False)) if run != "checkpoint" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--runs", nargs="+", default=["checkpoint", "recompute", "keep_top3"])
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--child")
    ap.add_argument("--blocks", metavar="DIR",
                    help="write each run's blocks (pool, state, size, allocating frames) "
                         "to DIR/RUN_blocks.json")
    args = ap.parse_args()
    if args.child:
        path = f"{args.blocks}/{args.child}_blocks.json" if args.blocks else None
        print(json.dumps(child(args.child, args.preset, args.layers, args.seq, path)), flush=True)
        return
    for run in args.runs:
        cmd = [sys.executable, __file__, "--child", run, "--preset", args.preset]
        for k in ("layers", "seq", "blocks"):
            if getattr(args, k):
                cmd += [f"--{k}", str(getattr(args, k))]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        print(line if p.returncode == 0 else json.dumps({"run": run, "error": p.stderr[-3000:]}),
              flush=True)


if __name__ == "__main__":
    main()
