"""Micro-benchmark: per-call VMM cost (raw driver call vs graphslot's checked call) and
pinned copy bandwidth, on the backend GRAPHSLOT_BACKEND selects.

    python benchmarks/bench_vmm.py [--json] [--sizes-mib 2 64 512] [--reps 20] [--copy-mib 1024]

Not a test: it asserts nothing, it reports medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


import graphslot
from graphslot.cli.bench import copy_bandwidth

MiB = 1 << 20
OPS = ("create", "map", "set_access", "unmap", "release")


def _median_us(xs: list[int]) -> float:
    return statistics.median(xs) / 1e3


def vmm_costs(b: graphslot.Backend, size: int, reps: int) -> dict[str, dict[str, float]]:
    """Median microseconds per call, raw driver call and checked public method."""
    raw: dict[str, list[int]] = {op: [] for op in OPS}
    checked: dict[str, list[int]] = {op: [] for op in OPS}
    res, d = b.reserve(size), b.driver
    try:
        for _ in range(reps + 2):  # two warm-up rounds are dropped below
            t = time.perf_counter_ns
            t0 = t(); h = d.create(size); t1 = t()
            d.map(res.va, size, h); t2 = t()
            d.set_access(res.va, size); t3 = t()
            d.unmap(res.va, size); t4 = t()
            d.release(h); t5 = t()
            for op, ns in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                raw[op].append(ns)
            t0 = t(); a = b.create(size); t1 = t()
            b.map(res, 0, a); t2 = t()
            b.set_access(res, 0, size); t3 = t()
            b.unmap(res, 0, size); t4 = t()
            b.release(a); t5 = t()
            for op, ns in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                checked[op].append(ns)
    finally:
        b.free(res)
    return {op: {"raw_us": _median_us(raw[op][2:]), "graphslot_us": _median_us(checked[op][2:])}
            for op in OPS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 64, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="copy size (default 1024 on a GPU, 128 on cpu)")
    args = ap.parse_args()
    b = graphslot.get_backend()
    out: dict[str, Any] = {"backend": b.name, "info": b.info(), "vmm": {}, "copy": {}}
    for mib in args.sizes_mib:
        size = graphslot.align_up(mib * MiB, b.granularity)
        out["vmm"][f"{mib}MiB"] = vmm_costs(b, size, args.reps)
    copy_mib = args.copy_mib or (128 if b.name == "cpu" else 1024)
    out["copy"] = {"bytes": copy_mib * MiB, **copy_bandwidth(b, copy_mib * MiB)}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"backend {b.name}: {out['info']['device']}")
    print(f"{'size':>8} {'op':<11} {'raw us':>9} {'graphslot us':>13} {'overhead us':>12}")
    for size, ops in out["vmm"].items():
        for op, v in ops.items():
            print(f"{size:>8} {op:<11} {v['raw_us']:9.1f} {v['graphslot_us']:13.1f} "
                  f"{v['graphslot_us'] - v['raw_us']:12.1f}")
    c = out["copy"]
    print(f"copies of {c['bytes'] // MiB} MiB: D2H {c['d2h_gbps']:.1f} GB/s, H2D {c['h2d_gbps']:.1f} GB/s, "
          f"both at once {c['both_total_gbps']:.1f} GB/s total")


if __name__ == "__main__":
    main()
