"""Does a stack built after another holds more than one built first? One process per
order (cuda only).

    GRAPHSLOT_BACKEND=cuda python benchmarks/rebuild_held.py [--preset default]

``memory_budget`` builds plans one after another in one process and measures what each
holds; a build that left memory behind would make the next look bigger. Builds the least
plan (every layer recomputed, remap) first in a fresh process, then after a stack that
keeps everything (closed first), then again through ``_unmake`` as ``memory_budget``
does, and prints what the process holds after each (allocator reserved + graphslot
mapped, after a garbage collection and an emptied cache).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 1 << 20


def child(order: str, preset: str) -> dict:
    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import BenchShape, training_data
    from graphslot.memory import release_unused, saved_bytes_per_layer
    from graphslot.profile import held_bytes

    b = get_backend()

    def held(b) -> int:
        return held_bytes(b) or 0

    layers, x, _ = training_data(BenchShape.preset(preset), b.device)
    least = dict(mode="remap", recompute_layers=range(len(layers)))
    release_unused(b)
    out: dict = {"order": order, "before_mib": held(b) / MiB}
    if order == "after_keep":
        with GraphedLayers(layers, x, mode="off"):
            pass
        release_unused(b)
        out["after_close_mib"] = held(b) / MiB
    stack = GraphedLayers(layers, x, **least)
    release_unused(b)
    out["least_mib"] = held(b) / MiB
    if order == "rebuilt":
        mode, off, rec = stack.engine.mode, set(stack.offload_layers), set(stack.recompute_layers)
        stack._unmake()
        out["after_unmake_mib"] = held(b) / MiB
        stack._make(mode, off, rec, None, saved_bytes_per_layer(layers, x), x)
        release_unused(b)
        out["least_again_mib"] = held(b) / MiB
    stack.close()
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="default")
    ap.add_argument("--order", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.order:
        print(json.dumps(child(args.order, args.preset)))
        return 0
    for order in ("fresh", "after_keep", "rebuilt"):
        done = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--order", order],
                              capture_output=True, text=True)
        print(done.stdout.strip().splitlines()[-1] if done.returncode == 0
              else json.dumps({"order": order, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
