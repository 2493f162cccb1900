"""What a stack holds after its build, by the stream of the allocator's segments (cuda
only): is what a budgeted build holds beyond a plain one per-stream state its profile
left? One process per variant.

    GRAPHSLOT_BACKEND=cuda python benchmarks/held_by_stream.py [--preset launch]

Builds the preset's stack keeping every layer (``mode="off"``) and with
``memory_budget="auto"`` (which profiles the layers first), each in a fresh process, and
prints what the process holds after the build (allocator reserved + graphslot mapped,
after an emptied cache) and the allocator's segments by stream: their bytes, the bytes
of live blocks in them, and the largest live blocks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict

MiB = 1 << 20


def child(variant: str, preset: str) -> dict:
    import torch

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import BenchShape, training_data
    from graphslot.memory import release_unused
    from graphslot.profile import held_bytes

    b = get_backend()
    layers, x, _ = training_data(BenchShape.preset(preset), b.device)
    kw = dict(mode="off") if variant == "keep" else dict(memory_budget="auto")
    stack = GraphedLayers(layers, x, **kw)
    release_unused(b)
    by_stream: dict[str, dict] = defaultdict(lambda: {"segments_mib": 0.0, "live_mib": 0.0,
                                                      "largest_live_mib": []})
    for seg in torch.cuda.memory_snapshot():
        s = by_stream[f"{seg['stream']:#x}{' (pool)' if seg.get('segment_pool_id', (0, 0)) != (0, 0) else ''}"]
        s["segments_mib"] += seg["total_size"] / MiB
        live = [blk["size"] for blk in seg["blocks"] if blk["state"] == "active_allocated"]
        s["live_mib"] += sum(live) / MiB
        s["largest_live_mib"] += [round(n / MiB, 2) for n in live]
    for s in by_stream.values():
        s["largest_live_mib"] = sorted(s["largest_live_mib"], reverse=True)[:6]
        s["segments_mib"] = round(s["segments_mib"], 1)
        s["live_mib"] = round(s["live_mib"], 1)
    out = {"variant": variant, "held_mib": round((held_bytes(b) or 0) / MiB, 1),
           "plan": str(stack.plan) if stack.plan is not None else None,
           "by_stream": dict(by_stream)}
    stack.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="launch")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.preset)))
        return 0
    for variant in ("keep", "auto"):
        r = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--child", variant],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stdout, r.stderr, file=sys.stderr)
            return r.returncode
        print(json.dumps(json.loads(r.stdout.strip().splitlines()[-1]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
