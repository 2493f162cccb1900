"""Benchmark: memory of mutually exclusive graph variants in one shared arena, and of
partial-graph static I/O planned by lifetime, on the backend GRAPHSLOT_BACKEND selects.

    python benchmarks/bench_variants.py [--json] [--preset cpu|cuda] [--hidden N]
        [--seqs A B C] [--dtype bfloat16] [--layers N] [--reps N]

Part 1 captures three variants of one layer (different lengths and code paths: an MLP,
MLP + residual + layer norm, token mixing + MLP), once as ``graphslot.arena.VariantGraphs``
(one physical pool, three VA regions) and once as three ordinary graphs with their own
private pools, and reports each variant's pool, the arena, and the memory each setup
really took (cuda: the driver's used memory; cpu: the process's proportional set size,
which counts a page mapped at three addresses once), plus replay time per variant.

Part 2 runs a chain of ``--layers`` graphs with an eager segment between consecutive
graphs (as partial graph capture does around non-graphable code), once with each graph
owning a static input and keeping its output (naive, as graphed callables do) and once
with every static tensor in a ``graphslot.arena.IOArena`` planned by lifetime, and
reports the static I/O bytes of both, measured with ``graphslot.memory``.

Both parts check replays against eager execution. Not a test: it reports numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import graphslot
from graphslot.arena import IOArena, IOTensor, Step, VariantGraphs, warm_first_capture
from graphslot.memory import measure, release_unused, used_bytes

MiB = 1 << 20
PRESETS = {
    "cpu": {"hidden": 256, "seqs": (3072, 2048, 1024), "dtype": "float32"},
    "cuda": {"hidden": 4096, "seqs": (8192, 4096, 2048), "dtype": "bfloat16"},
}


class Layer:
    """One layer, three code paths (one per variant)."""

    def __init__(self, hidden: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.h = hidden
        self.w1 = (torch.randn(hidden, 4 * hidden, generator=g) / hidden ** 0.5).to(device, dtype)
        self.w2 = (torch.randn(4 * hidden, hidden, generator=g) / (2 * hidden)).to(device, dtype)

    def mlp(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.matmul(F.gelu(x @ self.w1), self.w2, out=out)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x + self.mlp(x), (self.h,))

    def mixing(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.softmax(x @ x.T / math.sqrt(self.h), dim=-1) @ x)


PATHS = ("mlp", "normed", "mixing")






def replay_ms(b: graphslot.Backend, fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        with b.timed() as t:
            fn()
        times.append(t["device_ms"])
    return statistics.median(times)


def max_diff(a: torch.Tensor, c: torch.Tensor) -> float:
    return float((a.float() - c.float()).abs().max())


# --------------------------------------------------------------------------- part 1


def variants(b: graphslot.Backend, hidden: int, seqs: tuple[int, ...], dtype: torch.dtype,
             reps: int) -> dict[str, Any]:
    layer = Layer(hidden, b.device, dtype)
    g = torch.Generator().manual_seed(1)
    xs = {p: torch.randn(s, hidden, generator=g).to(b.device, dtype) for p, s in zip(PATHS, seqs)}
    want = {p: getattr(layer, p)(xs[p]) for p in PATHS}  # also the eager warm-up
    kw = b.ordinary_capture_kwargs()
    warm_first_capture(b)

    before = used_bytes(b)
    with measure(b) as m_shared:
        # Capacity is address space per variant (cpu: sparse host pages while capturing).
        vg = VariantGraphs(b, capacity=(2 if b.name == "cpu" else 32) << 30)
        for p in PATHS:
            vg.capture(p, getattr(layer, p), xs[p])
    shared_used = used_bytes(b) - before
    diffs, shared_ms = {}, {}
    for p in PATHS:
        diffs[p] = max_diff(vg.replay(p), want[p])
        shared_ms[p] = replay_ms(b, functools.partial(vg.replay, p), reps)
    stats = vg.stats()
    vg.close()
    del vg
    release_unused(b)

    before = used_bytes(b)
    graphs, outs = {}, {}
    with measure(b) as m_sep:
        for p in PATHS:
            graphs[p] = b.new_graph()
            with graphs[p].capture(**kw):
                outs[p] = getattr(layer, p)(xs[p])
    separate_used = used_bytes(b) - before
    sep_ms = {}
    for p in PATHS:
        graphs[p].replay()
        diffs[p] = max(diffs[p], max_diff(outs[p], want[p]))
        sep_ms[p] = replay_ms(b, graphs[p].replay, reps)
    separate_pools = {p: graphs[p].pool_bytes for p in PATHS}
    del graphs, outs
    release_unused(b)
    return {
        "hidden": hidden, "seqs": dict(zip(PATHS, seqs)), "dtype": str(dtype).replace("torch.", ""),
        "pool_bytes": stats["pool_bytes"],
        "largest_pool_bytes": stats["largest_pool_bytes"],
        "sum_pool_bytes": stats["sum_pool_bytes"],
        "shared_arena_bytes": stats["shared_bytes"],
        "separate_pool_bytes": separate_pools,
        "measured_used_bytes": {"shared": shared_used, "separate": separate_used},
        "measured_by": "driver used memory" if b.name != "cpu" else "process Pss + memfd pages",
        "ledger_allocated_bytes_shared": m_shared.delta.allocated_bytes,
        "allocator_graph_pool_reserved_bytes": {
            "shared": m_shared.delta.graph_pool_reserved_bytes,
            "separate": m_sep.delta.graph_pool_reserved_bytes},
        "replay_ms": {"shared": shared_ms, "separate": sep_ms},
        "max_abs_diff_vs_eager": diffs,
    }


# --------------------------------------------------------------------------- part 2


def partial_io(b: graphslot.Backend, hidden: int, seq: int, dtype: torch.dtype, layers: int) -> dict[str, Any]:
    stack = [Layer(hidden, b.device, dtype, seed=10 + i) for i in range(layers)]

    def route(h: torch.Tensor) -> torch.Tensor:  # the eager segment between graphs
        return h * torch.sigmoid(h.mean(dim=-1, keepdim=True))

    def eager(x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(stack):
            x = layer.mlp(x)
            if i + 1 < len(stack):
                x = route(x)
        return x

    tensors = [IOTensor("x", (seq, hidden), dtype)]
    steps = []
    for i in range(layers):
        src = "x" if i == 0 else f"mid{i - 1}"
        dst = "y" if i == layers - 1 else f"out{i}"
        tensors.append(IOTensor(dst, (seq, hidden), dtype))
        steps.append(Step(f"graph{i}", reads=(src,), writes=(dst,)))
        if i + 1 < layers:
            tensors.append(IOTensor(f"mid{i}", (seq, hidden), dtype))
            steps.append(Step(f"route{i}", reads=(dst,), writes=(f"mid{i}",)))
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(seq, hidden, generator=gen).to(b.device, dtype)
    want = eager(x0)
    kw = b.ordinary_capture_kwargs()
    buf = seq * hidden * torch.empty((), dtype=dtype).element_size()

    release_unused(b)
    before = used_bytes(b)
    with measure(b) as m_plan:
        io = IOArena(b, tensors, steps)
        first = None
        graphs = []
        for i, layer in enumerate(stack):
            g = b.new_graph(share_pool_with=first)
            src = "x" if i == 0 else f"mid{i - 1}"
            dst = "y" if i == layers - 1 else f"out{i}"
            with g.capture(**kw):  # the result goes straight to its planned address
                layer.mlp(io[src], out=io[dst])
            graphs.append((g, dst))
            first = first or g
    planned_used = used_bytes(b) - before
    io["x"].copy_(x0)
    for i, (g, dst) in enumerate(graphs):
        g.replay()
        if i + 1 < layers:
            io[f"mid{i}"].copy_(route(io[dst]))
    planned_diff = max_diff(io["y"], want)
    rep = io.report()
    del graphs, g, first
    io.close()
    release_unused(b)

    before = used_bytes(b)
    with measure(b) as m_naive:
        static_in = [torch.zeros(seq, hidden, device=b.device, dtype=dtype) for _ in stack]
        outs, ng = [], []
        for i, layer in enumerate(stack):
            g = b.new_graph(share_pool_with=ng[0] if ng else None)
            with g.capture(**kw):
                outs.append(layer.mlp(static_in[i]))
            ng.append(g)
    naive_used = used_bytes(b) - before
    static_in[0].copy_(x0)
    for i, g in enumerate(ng):
        g.replay()
        if i + 1 < layers:
            static_in[i + 1].copy_(route(outs[i]))
    naive_diff = max_diff(outs[-1], want)
    naive_io = sum(t.nbytes for t in static_in) + sum(t.nbytes for t in outs)
    del ng, g, outs, static_in
    release_unused(b)
    return {
        "layers": layers, "seq": seq, "hidden": hidden, "buffer_bytes": buf,
        "static_tensors": rep["tensors"],
        "naive_static_io_bytes": naive_io,
        "one_buffer_per_tensor_bytes": rep["naive_bytes"],
        "planned_arena_bytes": rep["arena_bytes"],
        "planned_mapped_bytes": rep["mapped_bytes"],
        "lower_bound_bytes": rep["lower_bound_bytes"],
        "saved_bytes": naive_io - rep["mapped_bytes"],
        "measured": {
            "planned_ledger_allocated_bytes": m_plan.delta.allocated_bytes,
            "naive_allocator_allocated_bytes": m_naive.delta.allocator_allocated_bytes,
            "planned_graph_pool_reserved_bytes": m_plan.delta.graph_pool_reserved_bytes,
            "naive_graph_pool_reserved_bytes": m_naive.delta.graph_pool_reserved_bytes,
            "planned_used_bytes": planned_used, "naive_used_bytes": naive_used,
        },
        "max_abs_diff_vs_eager": {"planned": planned_diff, "naive": naive_diff},
    }


# --------------------------------------------------------------------------- main


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:9.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="sizes (default: cuda on a GPU backend, else cpu)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--seqs", type=int, nargs=3, metavar=("MLP", "NORMED", "MIXING"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--layers", type=int, default=8, help="graphs in the partial-graph chain")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per variant (median)")
    args = ap.parse_args()
    b = graphslot.get_backend()
    preset = PRESETS[args.preset or ("cpu" if b.name == "cpu" else "cuda")]
    hidden = args.hidden or preset["hidden"]
    seqs = tuple(args.seqs or preset["seqs"])
    dtype = getattr(torch, args.dtype or preset["dtype"])
    t0 = time.perf_counter()
    out = {
        "backend": b.name, **{k: v for k, v in b.info().items() if k in ("device", "versions")},
        "python": platform.python_version(),
        "variants": variants(b, hidden, seqs, dtype, args.reps),
        "partial_io": partial_io(b, hidden, seqs[1], dtype, args.layers),
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    v, p = out["variants"], out["partial_io"]
    print(f"backend {out['backend']}: {out['device']}")
    print(f"\nK=3 variants, hidden {v['hidden']} {v['dtype']}, lengths {v['seqs']}")
    for name in PATHS:
        print(f"  {name:<7} pool {_mib(v['pool_bytes'][name])}  replay "
              f"{v['replay_ms']['shared'][name]:.3f} ms shared / "
              f"{v['replay_ms']['separate'][name]:.3f} ms separate  "
              f"max |diff| {v['max_abs_diff_vs_eager'][name]:.2e}")
    print(f"  largest pool {_mib(v['largest_pool_bytes'])}, sum {_mib(v['sum_pool_bytes'])}, "
          f"shared arena {_mib(v['shared_arena_bytes'])}")
    mu = v["measured_used_bytes"]
    print(f"  measured ({v['measured_by']}): shared {_mib(mu['shared'])}, separate {_mib(mu['separate'])}")
    print(f"\npartial graphs: {p['layers']} graphs with eager segments between, "
          f"{p['static_tensors']} static tensors of {_mib(p['buffer_bytes'])}")
    print(f"  naive static I/O {_mib(p['naive_static_io_bytes'])}, planned arena "
          f"{_mib(p['planned_mapped_bytes'])} (lower bound {_mib(p['lower_bound_bytes'])}), "
          f"saved {_mib(p['saved_bytes'])}")
    m = p["measured"]
    print(f"  measured: planned ledger {_mib(m['planned_ledger_allocated_bytes'])}, naive allocator "
          f"{_mib(m['naive_allocator_allocated_bytes'])}; whole setup planned "
          f"{_mib(m['planned_used_bytes'])} vs naive {_mib(m['naive_used_bytes'])}")
    print(f"  max |diff| vs eager: planned {p['max_abs_diff_vs_eager']['planned']:.2e}, "
          f"naive {p['max_abs_diff_vs_eager']['naive']:.2e}")


if __name__ == "__main__":
    main()
