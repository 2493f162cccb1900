"""Would backward graphs that share physical pages, each captured into a pool of its own,
hold less than the one shared pool? (cuda only; measures, asserts nothing)

    GRAPHSLOT_BACKEND=cuda python benchmarks/pool_split.py [--preset llama] [--mode remap]
        [--max-split-mib 256]

Backward graphs replay one after another on one stream: their working memory is never
live at once. In the shared pool of today, every capture's blocks land beside what the
captures before it left, and the pool reserves more than any one backward needs at its
highest (a fragmentation the seeded and expandable pools did not cure). If each backward
graph drew its pool from a region of its own and all those regions were mapped onto one
physical allocation (as :class:`graphslot.arena.VariantGraphs` does for exclusive
variants), the backward graphs would cost the largest of them, with their outputs (the
input gradients) copied out to buffers of their own.

Each variant runs in a process of its own, builds the preset's stack with every layer
recomputed (``--mode`` remap: the least plan, inputs to the host; off: graph_recompute),
trains three steps and reports its peak (allocator reserved + graphslot mapped) and every
graph pool's reserved and live bytes:

- ``shared``: as the library builds it today;
- ``split``: every backward graph in a pool of its own (no sharing, so this variant holds
  more; what it tells is each pool's size: the forward pool plus the largest backward
  pool is what the shared-pages design would hold);
- ``maxsplit``: shared, with the allocator's ``max_split_size_mb`` set before the build
  (large cached blocks then serve only requests of their own size class), a setting of
  the process the user could make;
- ``fixed``: a budgeted build (``memory_budget="auto"``), reporting what the process held
  when the budget's profile measured the stack's fixed memory (``fixed_bytes``): the
  allocator's reserved and allocated bytes, the weights, and the largest live blocks and
  their frames. On the llama preset that figure was 1.1 GiB over the weights, which the
  process's inputs, library workspaces and outputs do not explain.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 1 << 20


def child(variant: str, preset: str, mode: str, max_split_mib: int, steps: int) -> dict:
    import torch

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.adapters.torch.runner import GraphRunner
    from graphslot.cli.bench_models import BenchShape, training_data

    from budget_probe import train

    if variant == "maxsplit":
        torch.cuda.memory._set_allocator_settings(f"max_split_size_mb:{max_split_mib}")
    b = get_backend()
    if variant == "fixed":  # (from the start: the blocks' frames)
        torch.cuda.memory._record_memory_history(max_entries=200000)
    layers, x, gy = training_data(BenchShape.preset(preset), b.device)
    if variant == "fixed":
        return _fixed(b, layers, x)
    backward_pools: list = []
    if variant == "split":
        build_backward = GraphRunner.build_backward

        shared_new_graph = GraphedLayers._new_graph

        def own_pool(self, *args, **kwargs):  # the backward graph in a pool of its own
            def new_graph(stack):
                g = b.new_graph()
                backward_pools.append(g)
                return g
            GraphedLayers._new_graph = new_graph  # (what the runner's host calls)
            try:
                return build_backward(self, *args, **kwargs)
            finally:
                GraphedLayers._new_graph = shared_new_graph
        GraphRunner.build_backward = own_pool
    n = len(layers)
    # (remap: every recomputed layer's input goes to the host, as in the least plan)
    stack = GraphedLayers(layers, x, mode=mode, recompute_layers=range(n),
                          offload_layers=range(n) if mode != "off" else [])
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=1e-3)
    times, peak = train(b, stack, opt, x, gy, steps)
    pools: dict[str, dict] = {}
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        key = "default" if pid == (0, 0) else f"pool {pid}"
        p = pools.setdefault(key, {"reserved_mib": 0.0, "live_mib": 0.0, "segments": []})
        p["reserved_mib"] += seg["total_size"] / MiB
        p["live_mib"] += sum(blk["size"] for blk in seg["blocks"]
                             if blk["state"] == "active_allocated") / MiB
        p["segments"].append(round(seg["total_size"] / MiB))
    graph_pools = [k for k in pools if k != "default"]
    for p in pools.values():
        p["reserved_mib"] = round(p["reserved_mib"], 1)
        p["live_mib"] = round(p["live_mib"], 1)
        p["segments"].sort(reverse=True)
    out = {"variant": variant, "preset": preset, "mode": mode, "plan": str(stack.plan),
           "step_ms": round(min(times), 2), "peak_mib": None if peak is None else round(peak / MiB, 1),
           "graph_pools_mib": round(sum(pools[k]["reserved_mib"] for k in graph_pools), 1),
           "pools": pools}
    if variant == "split":
        each = [round((g.pool_bytes or 0) / MiB, 1) for g in backward_pools]
        forward = round((stack._pool_owner.pool_bytes or 0) / MiB, 1)
        out["forward_pool_mib"] = forward
        out["backward_pools_mib"] = each
        # what backward graphs on shared physical pages would hold with the forward pool
        out["forward_plus_largest_backward_mib"] = round(forward + max(each, default=0.0), 1)
    stack.close()
    return out


def _fixed(b, layers, x) -> dict:
    """What the process held when a budgeted build's profile measured its fixed memory."""
    import torch

    from graphslot.adapters.torch import GraphedLayers
    from graphslot.adapters.torch import stack as stack_module

    seen: list[dict] = []
    holds = stack_module._build_holds

    def recording(backend):
        held = holds(backend)
        if not seen:  # (the first call: the profile's, before any graph exists)
            snap = torch.cuda.memory._snapshot()
            params = {p.data_ptr() for m in layers for p in m.parameters()}
            live = sorted(((blk["size"], _where(blk.get("frames")), seg["stream"])
                           for seg in snap["segments"] for blk in seg["blocks"]
                           if blk["state"] == "active_allocated" and blk["address"] not in params),
                          reverse=True)
            seen.append({"held_mib": None if held is None else round(held / MiB, 1),
                         "reserved_mib": round(torch.cuda.memory_reserved() / MiB, 1),
                         "allocated_mib": round(torch.cuda.memory_allocated() / MiB, 1),
                         "live_besides_weights_mib": round(sum(n for n, _, _ in live) / MiB, 1),
                         "largest_live": [(round(n / MiB, 2), w, f"{s:#x}") for n, w, s in live[:25]]})
        return held

    stack_module._build_holds = recording
    weights = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    stack = GraphedLayers(layers, x, memory_budget="auto")
    out = {"variant": "fixed", "weights_mib": round(weights / MiB, 1), "plan": str(stack.plan),
           "fixed_mib": round(stack.plan.profile.fixed_bytes / MiB, 1), "at_profile": seen[:1]}
    stack.close()
    return out


def _where(frames) -> str:
    fr = [f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')}" for f in frames or []
          if str(f.get("filename", "")).endswith(".py")]
    return " < ".join(fr[:4]) or "(no python frame)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--mode", default="remap", choices=["remap", "off"])
    ap.add_argument("--max-split-mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default="shared,split,maxsplit,fixed")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.preset, a.mode, a.max_split_mib, a.steps)))
        return 0
    for variant in a.variants.split(","):
        r = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--mode", a.mode,
                            "--max-split-mib", str(a.max_split_mib), "--steps", str(a.steps),
                            "--child", variant], capture_output=True, text=True)
        if r.returncode:
            print(json.dumps({"variant": variant, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}))
            continue
        print(r.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
