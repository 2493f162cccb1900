"""Benchmark: slot-planner quality (arena / lower bound) and planning time on realistic
pipeline-parallel schedules.

    python benchmarks/bench_planner.py [--json] [--reps 3] [--case NAME ...] [--ablation]

Each case is the memory one pipeline rank sees in one training step of an interleaved
1F1B schedule (Megatron order: warm-up forwards, steady one-forward-one-backward,
cool-down backwards) with virtual stages, so several microbatches are in flight. Per
(microbatch, model chunk) it creates input staging, an output send buffer, per-layer
saved activations (q/k/v as three views of one storage: an alias group), forward
workspaces, backward gradient transients and grad send/receive buffers; per chunk,
parameter-gradient buckets that live from the chunk's first backward to the end of the
step. Branches are mutually exclusive alternatives of the whole step (sequence buckets
or context-parallel sizes) whose activations scale with their per-rank sequence length;
parameter gradients are common to all of them. Two stress cases (sizes that change per
microbatch; random tensors) show the planner off its home ground.

Not a test: it asserts nothing except that every plan passes ``verify``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from graphslot import planner
from graphslot.planner import TensorSpec, plan, verify

MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    name: str
    pp: int  # pipeline size
    vpp: int  # model chunks (virtual stages) per rank
    microbatches: int
    layers_per_chunk: int
    hidden: int
    seq: tuple[int, ...]  # per-rank sequence length of each branch; one entry = no branches
    rank: int = 0  # rank 0 holds the most microbatches in flight
    moe_jitter: float = 0.0  # relative spread of MLP activation sizes per microbatch
    seed: int = 0
    random_tensors: int = 0  # > 0: ignore the schedule, draw this many random tensors


CASES = {
    c.name: c for c in (
        Case("dense-1f1b", pp=4, vpp=4, microbatches=64, layers_per_chunk=3, hidden=4096,
             seq=(4096,)),
        Case("seq-buckets-3", pp=4, vpp=4, microbatches=32, layers_per_chunk=2, hidden=4096,
             seq=(8192, 4096, 2048)),
        Case("cp-1-2-4-8", pp=8, vpp=2, microbatches=32, layers_per_chunk=3, hidden=5120,
             seq=(16384, 8192, 4096, 2048)),
        # Stress cases, not graph-capturable schedules: captured graphs have static
        # shapes, so sizes do not change from one microbatch to the next, and real
        # lifetimes are not random.
        Case("moe-jitter-2", pp=4, vpp=4, microbatches=32, layers_per_chunk=3, hidden=4096,
             seq=(4096, 2048), moe_jitter=0.5, seed=1),
        Case("random-10k", pp=1, vpp=1, microbatches=1, layers_per_chunk=1, hidden=0,
             seq=(0, 0, 0), seed=2, random_tensors=10_000),
    )
}
STRESS = {"moe-jitter-2", "random-10k"}


def random_tensors(case: Case) -> list[TensorSpec]:
    """Random sizes (256 B .. 1 MiB) and lifetimes (1 .. 50 of 2000 steps), a quarter
    of them common and the rest spread over the case's branches."""
    rng = random.Random(case.seed)
    branches = [None] + [f"b{i}" for i in range(len(case.seq))]
    out = []
    for i in range(case.random_tensors):
        start = rng.randrange(2000)
        out.append(TensorSpec(f"t{i}", 256 * rng.randint(1, 4096), start,
                              start + rng.randint(1, 50), branch=rng.choice(branches)))
    return out


def schedule(pp: int, vpp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The ops of ``rank``: ("F"|"B", microbatch, chunk), in Megatron's interleaved order."""
    total = m * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def mb(k: int) -> int:
        return (k // (pp * vpp)) * pp + k % pp

    def fchunk(k: int) -> int:
        return (k % (pp * vpp)) // pp

    ops = [("F", mb(k), fchunk(k)) for k in range(warmup)]
    for i in range(total - warmup):
        ops.append(("F", mb(warmup + i), fchunk(warmup + i)))
        ops.append(("B", mb(i), vpp - 1 - fchunk(i)))
    for i in range(total - warmup, total):
        ops.append(("B", mb(i), vpp - 1 - fchunk(i)))
    return ops


def tensors_for(case: Case) -> list[TensorSpec]:
    """The tensors of one step of ``case`` on its rank (sizes rounded up to 256 bytes)."""
    if case.random_tensors:
        return random_tensors(case)
    rng = random.Random(case.seed)
    L = case.layers_per_chunk
    # Steps per op: receive, then attention and MLP sub-steps per layer, then send.
    span = 2 * L + 2
    ops = schedule(case.pp, case.vpp, case.microbatches, case.rank)
    fwd_at: dict[tuple[int, int], int] = {}
    bwd_at: dict[tuple[int, int], int] = {}
    for k, (kind, m, c) in enumerate(ops):
        (fwd_at if kind == "F" else bwd_at)[(m, c)] = k * span
    step_end = len(ops) * span + 1
    branched = len(case.seq) > 1
    h, heads = case.hidden, case.hidden // 128
    out: list[TensorSpec] = []

    def add(name: str, size: int, start: int, end: int, branch: Any, **kw: Any) -> None:
        out.append(TensorSpec(name, -(-size // 256) * 256, start, end, 256, branch, **kw))

    for bi, s in enumerate(case.seq):
        branch = f"b{bi}" if branched else None
        act = s * h * 2  # one [s, 1, h] bf16 activation
        for (m, c), f in fwd_at.items():
            b = bwd_at[(m, c)]
            p = f"{branch or ''}.m{m}.c{c}"
            mlp = 4 * act
            if case.moe_jitter:
                mlp = int(mlp * (1 + case.moe_jitter * (2 * rng.random() - 1)))
            add(f"{p}.in", act, f, f + 1, branch)
            add(f"{p}.out", act, f + 2 * L, f + 2 * L + 2, branch)
            add(f"{p}.gin", act, b, b + 1, branch)
            add(f"{p}.gout", act, b + 2 * L, b + 2 * L + 2, branch)
            for layer in range(L):
                fa = f + 1 + 2 * layer  # forward attention sub-step; MLP is fa + 1
                bm = b + 1 + 2 * (L - 1 - layer)  # backward MLP sub-step; attention is bm + 1
                q = f"{p}.l{layer}"
                # Saved by attention: freed after the attention backward.
                add(f"{q}.ln1", act, fa, bm + 2, branch)
                for j, v in enumerate("qkv"):  # q, k, v: views of one fused projection
                    add(f"{q}.{v}", act, fa, bm + 2, branch, alias_group=f"{q}.qkv",
                        alias_offset=j * act)
                add(f"{q}.lse", s * heads * 4, fa, bm + 2, branch)
                add(f"{q}.attn", act, fa, bm + 2, branch)
                # Saved by the MLP: born a sub-step later, freed a sub-step earlier.
                add(f"{q}.ln2", act, fa + 1, bm + 1, branch)
                add(f"{q}.fc1", mlp, fa + 1, bm + 1, branch)
                add(f"{q}.act", mlp, fa + 1, bm + 1, branch)
                add(f"{q}.fwd_ws", mlp, fa + 1, fa + 2, branch)
                add(f"{q}.dgrad", mlp, bm, bm + 1, branch)
                add(f"{q}.wgrad_ws", 2 * act, bm + 1, bm + 2, branch)
    # Parameter-gradient buckets, common to all branches: live from the chunk's first
    # backward until the optimizer step at the end.
    per_layer = 12 * h * h * 2
    for c in range(case.vpp):
        first_b = min(t for (m, cc), t in bwd_at.items() if cc == c)
        for layer in range(L):
            for j in range(2):
                add(f"grad.c{c}.l{layer}.{j}", per_layer // 2, first_b, step_end, None)
    return out


def run_case(case: Case, reps: int) -> dict[str, Any]:
    ts = tensors_for(case)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        p = plan(ts)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    verify(p)
    verify_s = time.perf_counter() - t0
    branches = len(case.seq) if len(case.seq) > 1 else 0
    return {
        "case": case.name,
        "kind": "stress" if case.name in STRESS else "realistic",
        "tensors": len(ts),
        "branches": branches,
        "steps": len({x for t in ts for x in (t.start, t.end)}),
        "arena_bytes": p.arena_bytes,
        "lower_bound_bytes": p.lower_bound_bytes,
        "ratio": p.arena_bytes / p.lower_bound_bytes,
        "plan_s": statistics.median(times),
        "verify_s": verify_s,
    }


def greedy_by_size_longest_first(b: Any) -> tuple:
    """The textbook greedy-by-size order (ties: longest-lived first), for comparison."""
    return (-b.extent, -sum(e - s for s, e in b.spans), b.spans[0][0])


def ablation(case: Case) -> dict[str, float]:
    """Arena / lower bound of each placement order alone (reaches into the planner's
    private strategy list on purpose: this is what the portfolio buys)."""
    ts = tensors_for(case)
    saved = planner._STRATEGIES
    out = {}
    try:
        for fuse, key in saved + ((False, greedy_by_size_longest_first),):
            planner._STRATEGIES = ((fuse, key),)
            p = plan(ts)
            out[f"{key.__name__.lstrip('_')}{'+fused' if fuse else ''}"] = p.arena_bytes / p.lower_bound_bytes
    finally:
        planner._STRATEGIES = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--reps", type=int, default=3, help="planning runs per case (median)")
    ap.add_argument("--case", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--ablation", action="store_true",
                    help="also report the ratio of each placement order alone")
    args = ap.parse_args()
    rows = [run_case(CASES[n], args.reps) for n in args.case]
    if args.ablation:
        for r in rows:
            r["ablation"] = ablation(CASES[r["case"]])
    if args.json:
        print(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                          "cases": rows}, indent=2))
        return
    print(f"{'case':<14} {'kind':<9} {'tensors':>7} {'branches':>8} {'steps':>5} "
          f"{'lower bound':>12} {'arena':>12} {'ratio':>6} {'plan s':>7} {'verify s':>8}")
    for r in rows:
        print(f"{r['case']:<14} {r['kind']:<9} {r['tensors']:>7} {r['branches']:>8} {r['steps']:>5} "
              f"{r['lower_bound_bytes'] / MiB:>8.0f} MiB {r['arena_bytes'] / MiB:>8.0f} MiB "
              f"{r['ratio']:>6.3f} {r['plan_s']:>7.3f} {r['verify_s']:>8.3f}")
    if args.ablation:
        names = list(rows[0]["ablation"])
        print()
        print("arena / lower bound of each order alone:")
        print(f"{'case':<14} " + " ".join(f"{n:>30}" for n in names))
        for r in rows:
            print(f"{r['case']:<14} " + " ".join(f"{r['ablation'][n]:>30.3f}" for n in names))


if __name__ == "__main__":
    main()
