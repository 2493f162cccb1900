"""What a GraphedLayers stack's graph pool holds, block by block, by owner (cuda only).

    GRAPHSLOT_BACKEND=cuda python benchmarks/pool_census.py [--preset default] [--modes off remap]

For each mode it builds the bench stack, runs two steps and sorts the private pool's
blocks into: gradient buffers, static layer I/O, saved activations kept in the pool,
other live blocks (with the frame that allocated them) and free bytes inside the pool's
segments (fragments no later allocation could use). Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
from typing import Any

import torch

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.bench import BenchShape
from graphslot.cli.toy import Block

from alloc_trace import by_label, events_since, highest_live, live_blocks, trace_end

MiB = 1 << 20


def _where(f: dict[str, Any]) -> str:
    return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"


def _frame(block: dict[str, Any]) -> str:
    """The first frame of graphslot's own code that allocated ``block`` (else the first)."""
    frames = block.get("frames") or [{}]
    mine = (f for f in frames if any(k in f.get("filename", "") for k in
                                     ("graphslot", "/core/", "/adapters/", "toy.py")))
    return _where(next(mine, frames[0]))


def _py_stack(frames: list[dict[str, Any]] | None, depth: int = 4) -> str:
    fr = [_where(f) for f in frames or [] if f.get("filename", "").endswith(".py")]
    return " < ".join(fr[:depth]) or "(no python frame)"


def _drop_grads(layers: list[torch.nn.Module]) -> None:
    for m in layers:
        for p in m.parameters():
            p.grad = None


def _step_peak(stack: GraphedLayers, layers: list[torch.nn.Module], x: torch.Tensor,
               gy: torch.Tensor, b: graphslot.Backend) -> dict[str, Any]:
    """Replay the allocator's events of one step: the most bytes allocated at once, and
    what was allocated at that moment outside the graph pools, by allocating frame."""
    b.synchronize()
    snap0 = torch.cuda.memory._snapshot()
    live = live_blocks(snap0, lambda pool, blk: "graph pool" if pool == "graph" else
                       "before step: " + _py_stack(blk.get("frames"), 3))
    t0 = trace_end(snap0)
    b.ledger.reset_peak()
    stack(x).backward(gy)
    _drop_grads(layers)
    b.synchronize()
    snap1 = torch.cuda.memory._snapshot()
    events = events_since(snap1, t0)
    best, at_best, _ = highest_live(live, events, _py_stack)
    return {"allocated_peak_mib": round(best / MiB, 1), "events": len(events),
            "slots_peak_mib": round(b.ledger.peak_mapped_bytes / MiB, 1),
            "at_peak_mib": by_label(at_best, 10)}


def census(mode: str, shape: BenchShape, b: graphslot.Backend) -> dict[str, Any]:
    dtype = shape.dtype
    torch.manual_seed(0)
    layers = [Block(shape).to(device=b.device, dtype=dtype) for _ in range(shape.layers)]
    x = torch.randn(shape.batch, shape.seq, shape.hidden, device=b.device, dtype=dtype,
                    requires_grad=True)
    gy = torch.randn_like(x)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    stack = GraphedLayers(layers, x, mode=mode, backend=b)
    for _ in range(2):
        stack(x).backward(gy)
        _drop_grads(layers)
    b.synchronize()
    gc.collect()
    peak = _step_peak(stack, layers, x, gy, b)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    owners: dict[int, str] = {}
    for buf in stack.gradient_buffers:
        owners[buf.untyped_storage().data_ptr()] = "grad_buffer"
    for r in stack._runners:
        for name in ("static_in", "static_out", "static_grad_out", "grad_in"):
            t = getattr(r, name, None)
            if isinstance(t, torch.Tensor):
                owners.setdefault(t.untyped_storage().data_ptr(), "static_io")
        for v in ([] if r.group.offloads else r.group.views):  # kept in the graphs' memory
            owners.setdefault(v.data_ptr(), "saved_in_pool")
    sums: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    own_pool = tuple(stack._pool_owner.pool) if stack._pool_owner is not None else None
    stacks: collections.Counter[str] = collections.Counter()
    segs = 0
    for seg in snap["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
            continue
        segs += 1
        foreign = tuple(seg["segment_pool_id"]) != own_pool
        sums["reserved" if not foreign else "reserved_other_pools"] += seg["total_size"]
        for blk in seg["blocks"]:
            size = blk["size"]
            if blk["state"] != "active_allocated":
                sums["free"] += size
                continue
            kind = owners.get(blk["address"])
            if kind is None:
                kind = "other_pool_live" if foreign else "other"
                others[_frame(blk)] += size
                stacks[_py_stack(blk.get("frames"), 6)] += size
            sums[kind] += size
    out = {"mode": mode, "segments": segs, **{k: round(v / MiB, 1) for k, v in sums.items()},
           "other_by_frame_mib": {k: round(v / MiB, 1) for k, v in others.most_common(12)},
           "other_by_stack_mib": {k: round(v / MiB, 1) for k, v in stacks.most_common(6)},
           "reserved_total_mib": round(torch.cuda.memory_reserved() / MiB, 1), "step_peak": peak}
    stack.close()
    del stack, layers, x, gy
    gc.collect()
    b.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--modes", nargs="+", default=["off", "resident", "remap"])
    args = ap.parse_args()
    b = graphslot.get_backend()
    shape = BenchShape.preset(args.preset)
    for mode in args.modes:
        print(json.dumps(census(mode, shape, b)), flush=True)


if __name__ == "__main__":
    main()
