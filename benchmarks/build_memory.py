"""What a built GraphedLayers stack holds, and how much of its graphs' pool was ever live
at once (cuda only; asserts nothing).

    GRAPHSLOT_BACKEND=cuda python benchmarks/build_memory.py PLAN [PLAN ...] [--preset llama]

``PLAN`` is one of ``keep`` (mode off), ``recompute`` (every layer recomputed, mode off),
``parts`` (every layer recomputed part by part, inputs to the host, remap: the bench's
``graph_recompute_parts``) or ``budget:GIB`` (``memory_budget`` of that many GiB; ``auto``
for "auto"). Each runs in a process of its own, with the allocator's history on from
before the build. After the build and two SGD steps it prints:

- allocated and reserved bytes before the build, after it and after the steps;
- the blocks live then, grouped by size and allocating frames, outside the graphs' pool
  and in it (an eager forward's activations outside the pool, once the build is over,
  are a leak);
- the pool's segments against the most of it that was ever live at once over the build
  (its segments less that peak is what the captures' order of allocations left unusable),
  against the same allocations laid out by lifetime with graphslot's slot planner (what a
  pool placed by graphslot instead of the caching allocator would need), and against the
  segments as placed with pages never live at once sharing physical memory (what
  graphslot mapping the pool itself would need).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import subprocess
import sys
from typing import Any

from alloc_trace import pool_of

MiB = 1 << 20
MAX_ENTRIES = 1_000_000  # (the history is a ring: past this the build's start is lost)


def _frames(frames: list[dict[str, Any]] | None) -> tuple[str, ...]:
    """The model's, graphslot's and autograd's frames, innermost first (up to seven)."""
    keep = ("graphslot", "bench", "transformers", "torch/utils", "autograd")
    return tuple(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
                 for f in frames or [] if any(k in f["filename"] for k in keep))[:7]


def _kwargs(plan: str, n: int) -> dict[str, Any]:
    if plan == "keep":
        return dict(mode="off")
    if plan == "recompute":
        return dict(mode="off", recompute_layers=range(n))
    if plan == "parts":
        return dict(mode="remap", recompute_layers=range(n), recompute_ops="parts",
                    offload_layers=range(n))
    if plan.startswith("budget:"):
        size = plan.split(":", 1)[1]
        return dict(memory_budget="auto" if size == "auto" else int(float(size) * (1 << 30)))
    raise SystemExit(f"unknown plan {plan!r}: keep, recompute, parts or budget:GIB")


def _child(plan: str, preset: str) -> None:
    import torch

    from graphslot.adapters.torch import GraphedLayers
    from graphslot.budget import plan_letters
    from graphslot.cli.bench_models import BenchShape, training_data

    layers, x, gy = training_data(BenchShape.preset(preset), torch.device("cuda"))
    kw = _kwargs(plan, len(layers))
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def report(tag: str) -> None:
        gc.collect()
        print(f"[{tag}] allocated {torch.cuda.memory_allocated() / MiB:.0f} MiB, reserved "
              f"{torch.cuda.memory_reserved() / MiB:.0f} MiB", flush=True)

    report("before the build")
    stack = GraphedLayers(layers, x, warmup_iters=2, **kw)
    report("built")
    plan_ = getattr(stack, "plan", None)
    if plan_ is not None:
        print("plan", plan_letters(plan_.choices, plan_.recompute_ops), plan_.mode)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=1e-4)
    for _ in range(2):
        y = stack(x)
        y.backward(gy)
        opt.step()
        opt.zero_grad()
        del y
    torch.cuda.synchronize()
    report("after two steps")
    snap = torch.cuda.memory._snapshot()

    live: collections.Counter[tuple[bool, int, tuple[str, ...]]] = collections.Counter()
    for seg in snap["segments"]:
        in_pool = pool_of(seg) == "graph"
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                live[(in_pool, blk["size"], _frames(blk.get("frames")))] += 1
    total: collections.Counter[bool] = collections.Counter()
    for (in_pool, size, _), count in live.items():
        total[in_pool] += size * count
    print(f"live outside the graphs' pool {total[False] / MiB:.0f} MiB, in it {total[True] / MiB:.0f} MiB")
    for (in_pool, size, frames), count in sorted(live.items(), key=lambda kv: -kv[0][1] * kv[1])[:14]:
        print(f"{'pool' if in_pool else 'main'} {size / MiB:8.1f} MiB x{count}")
        for f in frames:
            print("       ", f)

    # The pool over the build: bytes live in its segments at each event, at their highest.
    # An address counts for a segment only from that segment's own allocation on (the
    # build's probes and eager passes used addresses that later segments took again).
    events = snap["device_traces"][0]
    if len(events) >= MAX_ENTRIES:
        print(f"warning: the history holds its last {MAX_ENTRIES} events only; the pool's "
              "highest below may miss the build's start")
    segs = [(s["address"], s["address"] + s["total_size"]) for s in snap["segments"]
            if pool_of(s) == "graph"]
    made = {ev["addr"]: i for i, ev in enumerate(events) if ev["action"] == "segment_alloc"}
    print(f"pool segments {sum(hi - lo for lo, hi in segs) / MiB:.0f} MiB in {len(segs)}: "
          f"{sorted(round((hi - lo) / MiB) for lo, hi in segs)} MiB")
    blocks, size = pool_blocks(events, [(lo, hi, made.get(lo, -1)) for lo, hi in segs])
    arena, peak = lifetime_layout(blocks, len(events) + 1)
    print(f"pool live at its highest over the build {peak / MiB:.0f} MiB")
    print(f"the same allocations laid out by lifetime (graphslot.planner) {arena / MiB:.0f} MiB")
    shared, least = shared_pages(blocks, size)
    print(f"the pool's segments, 2 MiB pages never live at once sharing physical pages "
          f"(graphslot.planner.share_pages) {shared / MiB:.0f} MiB; pages live at once at "
          f"most {least / MiB:.0f} MiB")


Block = tuple[int, int, int, int | None]  # (offset, bytes, start, end or None: for good)


def pool_blocks(events: list[dict[str, Any]], segs: list[tuple[int, int, int]],
                page: int = 2 * MiB) -> tuple[list[Block], int]:
    """The pool's blocks as :func:`graphslot.planner.share_pages` takes them, over its
    segments laid end to end (each from a page boundary), and that range's size.
    ``segs``: ``(start, end, index of the segment's allocation event)``. A block counts
    from its ``alloc`` within a segment made before it, and is live until its
    ``free_completed`` (a free the captures deferred ends later than it was asked for),
    for good where that never came."""
    base, at = 0, []
    for lo, hi, made in sorted(segs):
        at.append((lo, hi, made, base))
        base += -(-(hi - lo) // page) * page

    def offset(a: int, i: int) -> int | None:
        for lo, hi, made, b in at:
            if lo <= a < hi and made < i:
                return b + a - lo
        return None

    blocks: list[Block] = []
    opened: dict[int, tuple[int, int, int]] = {}
    for i, ev in enumerate(events):
        a = ev.get("addr", 0)
        if ev["action"] == "alloc":
            off = offset(a, i)
            if off is not None:
                opened[a] = (off, ev["size"], i)
        elif ev["action"] == "free_completed" and a in opened:
            off, size, start = opened.pop(a)
            blocks.append((off, size, start, i + 1))
    blocks += [(off, size, start, None) for off, size, start in opened.values()]
    return blocks, base


def shared_pages(blocks: list[Block], size: int, page: int = 2 * MiB) -> tuple[int, int]:
    """What the pool would map if its blocks (:func:`pool_blocks`) stayed where the caching
    allocator put them but pages never live at the same time shared one physical page
    (:func:`graphslot.planner.share_pages`): the bytes it maps, and the most pages live at
    once (no sharing maps fewer)."""
    from graphslot.planner import share_pages

    got = share_pages(blocks, size, page)
    return got.physical_bytes, got.least_bytes


def lifetime_layout(blocks: list[Block], horizon: int) -> tuple[int, int]:
    """The arena graphslot's slot planner gives the same blocks (:func:`pool_blocks`),
    those live for good until ``horizon``, and the most of them live at once (the
    planner's lower bound)."""
    from graphslot.planner import TensorSpec, plan

    if not blocks:
        return 0, 0
    laid = plan([TensorSpec(f"b{k}", n, start, horizon if end is None else end)
                 for k, (_, n, start, end) in enumerate(blocks)])
    return laid.arena_bytes, laid.lower_bound_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.plans[0], args.preset)
        return
    for plan in args.plans:
        _kwargs(plan, 1)  # (a bad name fails before any work)
    failed = []
    for plan in args.plans:
        print(f"=== {plan}", flush=True)
        rc = subprocess.run([sys.executable, __file__, plan, "--preset", args.preset,
                             "--child"], check=False).returncode
        if rc:
            failed.append(plan)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
