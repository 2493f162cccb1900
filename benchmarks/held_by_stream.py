"""What a stack holds after its build, by the stream of the allocator's segments (cuda
only): is what a budgeted build holds beyond a plain one per-stream state its profile
left? One process per variant.

    GRAPHSLOT_BACKEND=cuda python benchmarks/held_by_stream.py [--preset launch] \
        [--variants keep,budget,auto,pages]

Variants, each in a fresh process: ``keep`` builds the preset's stack keeping every layer
(``mode="off"``); ``budget`` builds it through the budget planner with a budget every plan
fits (so the planner keeps every layer too, after profiling the layers); ``auto`` with
``memory_budget="auto"``; ``pages`` keeps every layer on a pool of shared pages
(``share_pool_pages=True``). Each prints what the process holds after the build (allocator
reserved + graphslot mapped, after an emptied cache) and the allocator's segments by
stream: their bytes, the bytes of live blocks in them, and the largest live blocks; for
the planned variants, the same right after the profile (before any build); and the peak
of one training step after the build (forward, backward, SGD step, ``zero_grad()``),
counted as the bench counts it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from typing import Any

MiB = 1 << 20


def by_stream() -> dict[str, dict]:
    import torch

    if not torch.cuda.is_available():
        return {}  # (the cpu backend's allocator keeps no segments: a dry run of the rest)
    out: dict[str, dict] = defaultdict(lambda: {"segments_mib": 0.0, "live_mib": 0.0,
                                                "largest_live_mib": []})
    for seg in torch.cuda.memory_snapshot():
        s = out[f"{seg['stream']:#x}{' (pool)' if seg.get('segment_pool_id', (0, 0)) != (0, 0) else ''}"]
        s["segments_mib"] += seg["total_size"] / MiB
        live = [blk["size"] for blk in seg["blocks"] if blk["state"] == "active_allocated"]
        s["live_mib"] += sum(live) / MiB
        s["largest_live_mib"] += [round(n / MiB, 2) for n in live]
    for s in out.values():
        s["largest_live_mib"] = sorted(s["largest_live_mib"], reverse=True)[:6]
        s["segments_mib"] = round(s["segments_mib"], 1)
        s["live_mib"] = round(s["live_mib"], 1)
    return dict(out)


def child(variant: str, preset: str) -> dict:
    import torch

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.adapters.torch import stack as stack_module
    from graphslot.cli.bench_models import BenchShape, training_data
    from graphslot.memory import release_unused
    from graphslot.profile import held_bytes

    b = get_backend()
    layers, x, gy = training_data(BenchShape.preset(preset), b.device)
    release_unused(b)
    out: dict[str, Any] = {"variant": variant, "before_mib": round((held_bytes(b) or 0) / MiB, 1)}
    profile = stack_module.GraphedLayers._profile

    def profiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        p = profile(self, *args, **kwargs)
        release_unused(b)
        out["after_profile_mib"] = round((held_bytes(b) or 0) / MiB, 1)
        out["after_profile_by_stream"] = by_stream()
        return p

    stack_module.GraphedLayers._profile = profiled  # type: ignore[method-assign]
    kw: dict[str, Any] = {"keep": dict(mode="off"), "budget": dict(memory_budget=1 << 50),
                          "auto": dict(memory_budget="auto"),
                          "pages": dict(mode="off", share_pool_pages=True)}[variant]
    stack = GraphedLayers(layers, x, **kw)
    release_unused(b)
    out["held_mib"] = round((held_bytes(b) or 0) / MiB, 1)
    out["grad_homes"] = stack._grad_homes
    out["plan"] = str(stack.plan) if stack.plan is not None else None
    out["builds"] = [list(bd) for bd in stack.plan.builds] if stack.plan is not None else None
    out["by_stream"] = by_stream()
    # One training step, its peak counted from here as the bench counts it.
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=1e-3)
    regions = 0
    for k in range(2):
        if k == 1:
            release_unused(b)
            b.allocator_stats(reset_peak=True)
            b.ledger.reset_peak()
            regions = b.region_reserved_bytes()  # (counted as pages: see held_bytes)
        y = stack(x)
        y.backward(gy)
        del y
        opt.step()
        opt.zero_grad()
        b.synchronize()
    peak = b.allocator_stats()["peak_reserved_bytes"]
    out["step_peak_mib"] = (None if peak is None
                            else round((peak - regions + b.ledger.peak_allocated_bytes) / MiB, 1))
    stack.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="launch")
    ap.add_argument("--variants", default="keep,budget,auto,pages")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.preset)))
        return 0
    for variant in a.variants.split(","):
        r = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--child", variant],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stdout, r.stderr, file=sys.stderr)
            return r.returncode
        print(json.dumps(json.loads(r.stdout.strip().splitlines()[-1]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
