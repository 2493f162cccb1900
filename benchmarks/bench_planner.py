"""Benchmark: slot-planner quality (arena / lower bound) and planning time on realistic
pipeline-parallel schedules.

    python benchmarks/bench_planner.py [--json] [--reps 3] [--case NAME ...] [--seeds 8]
                                       [--big-seeds 1] [--ablation]

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

A second family (``family_tensors``, ``--seeds`` schedules of 800 to 1,050 tensors, plus
the same generator at 10k and 100k tensors) has few exact size ties: every model
chunk's layers have their own irregular sizes, each tensor a few KiB of its own
variation, three context-parallel branches scaled by 1/cp. Each row also prints the
ratio of the textbook baselines (``graphslot.planner.baselines``) beside the planner's.

Not a test: it asserts nothing except that every plan passes ``verify``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from graphslot.planner import BASELINES, TensorSpec, baselines, lower_bound, plan, verify
from graphslot.planner import heuristics

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


KiB = 1 << 10


@dataclass(frozen=True)
class FamilyCase:
    """One schedule of the irregular context-parallel family (see :func:`family_tensors`)."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    layers_per_chunk: int
    rank: int
    seed: int
    cps: tuple[int, ...] = (1, 2, 4)


def family_case(seed: int, lo: int = 800, hi: int = 1050) -> FamilyCase:
    """A family schedule drawn from ``seed`` with ``lo`` to ``hi`` tensors."""
    rng = random.Random(seed)
    while True:
        pp = rng.choice([2, 4, 8])
        vpp = rng.choice([2, 3, 4])
        m = pp * rng.choice([1, 2, 3])
        L = rng.choice([1, 2, 3])
        rank = rng.randrange(pp)
        if lo <= 3 * m * vpp * (4 + 9 * L) + vpp * L * 2 <= hi:
            return FamilyCase(f"cp-family-s{seed}", pp, vpp, m, L, rank, seed)


def family_tensors(case: FamilyCase) -> list[TensorSpec]:
    """Interleaved 1F1B with virtual stages where every model chunk's layers have their
    own hidden size (0.5x to 1.5x of 4096, multiples of 64: not multiples of each
    other), each tensor a random 0 to 4 KiB larger (then rounded up to 256 bytes),
    three mutually exclusive context-parallel branches (cp 1, 2, 4) whose activations
    scale by 1/cp, input/output staging and gradient send/receive tensors, backward
    transients, and weight-gradient tensors common to all branches (alive from the
    chunk's first backward to the end of the step). Few sizes tie exactly."""
    rng = random.Random(case.seed * 7919 + 1)
    L = case.layers_per_chunk
    ops = schedule(case.pp, case.vpp, case.microbatches, case.rank)
    span = 2 * L + 2
    fwd_at: dict[tuple[int, int], int] = {}
    bwd_at: dict[tuple[int, int], int] = {}
    for k, (kind, mb, c) in enumerate(ops):
        (fwd_at if kind == "F" else bwd_at)[(mb, c)] = k * span
    step_end = len(ops) * span + 1
    hid = {(c, layer): int(4096 * rng.uniform(0.5, 1.5)) // 64 * 64
           for c in range(case.vpp) for layer in range(L)}
    out: list[TensorSpec] = []

    def add(name: str, size: int, start: int, end: int, branch: Any) -> None:
        size += rng.randrange(4 * KiB + 1)
        out.append(TensorSpec(name, -(-size // 256) * 256, start, end, 256, branch))

    for cp in case.cps:
        br, s = f"cp{cp}", 8192 // cp
        for (mb, c), f in fwd_at.items():
            b = bwd_at[(mb, c)]
            p = f"{br}.m{mb}.c{c}"
            a0, aL = s * hid[(c, 0)] * 2, s * hid[(c, L - 1)] * 2
            add(f"{p}.in", a0, f, f + 1, br)
            add(f"{p}.out", aL, f + 2 * L, f + 2 * L + 2, br)
            add(f"{p}.gin", aL, b, b + 1, br)
            add(f"{p}.gout", a0, b + 2 * L, b + 2 * L + 2, br)
            for layer in range(L):
                act = s * hid[(c, layer)] * 2
                fa = f + 1 + 2 * layer
                bm = b + 1 + 2 * (L - 1 - layer)
                q = f"{p}.l{layer}"
                add(f"{q}.ln1", act, fa, bm + 2, br)
                add(f"{q}.qkv", 3 * act, fa, bm + 2, br)
                add(f"{q}.attn", act, fa, bm + 2, br)
                add(f"{q}.ln2", act, fa + 1, bm + 1, br)
                add(f"{q}.fc1", 4 * act, fa + 1, bm + 1, br)
                add(f"{q}.act", 4 * act, fa + 1, bm + 1, br)
                add(f"{q}.fwd_ws", 4 * act, fa + 1, fa + 2, br)
                add(f"{q}.dgrad", 4 * act, bm, bm + 1, br)
                add(f"{q}.wgrad_ws", 2 * act, bm + 1, bm + 2, br)
    for c in range(case.vpp):
        first_b = min(t for (mb, cc), t in bwd_at.items() if cc == c)
        for layer in range(L):
            h = hid[(c, layer)]
            for j in range(2):
                add(f"grad.c{c}.l{layer}.{j}", 6 * h * h * 2, first_b, step_end, None)
    return out


#: The family at scale, for planning time: same generator, more microbatches and layers.
FAMILY_BIG = {
    c.name: c for c in (
        FamilyCase("cp-family-10k", pp=8, vpp=4, microbatches=32, layers_per_chunk=3, rank=0, seed=0),
        FamilyCase("cp-family-100k", pp=8, vpp=4, microbatches=272, layers_per_chunk=3, rank=0,
                   seed=0),
    )
}


def run_case(name: str, kind: str, ts: list[TensorSpec], reps: int) -> dict[str, Any]:
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        p = plan(ts)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    t0 = time.perf_counter()
    verify(p)
    verify_s = time.perf_counter() - t0
    base = {n: b.arena_bytes for n, b in baselines(ts).items()}
    assert p.arena_bytes <= min(base.values(), default=0), (name, p.arena_bytes, base)
    return {
        "case": name,
        "kind": kind,
        "tensors": len(ts),
        "branches": len({t.branch for t in ts if t.branch is not None}),
        "steps": len({x for t in ts for x in (t.start, t.end)}),
        "arena_bytes": p.arena_bytes,
        "lower_bound_bytes": p.lower_bound_bytes,
        "ratio": p.arena_bytes / p.lower_bound_bytes,
        "baselines": {n: {"arena_bytes": a, "ratio": a / p.lower_bound_bytes} for n, a in base.items()},
        "plan_s": statistics.median(times),
        "plan_cpu_s": statistics.median(cpu),
        "verify_s": verify_s,
    }


def ablation(ts: list[TensorSpec]) -> dict[str, float]:
    """Arena / lower bound of each candidate of the planner alone, without refinement
    (reaches into the planner's internal candidate list on purpose: this is what the
    portfolio buys)."""
    specs = tuple(ts)
    blocks, nsteps, unit = heuristics.prepare(specs, None)
    lb = lower_bound(specs) / unit
    return {c.name: heuristics.run_candidates([c], blocks, nsteps, unit, lb)[0] / lb
            for c in heuristics.CANDIDATES}


def all_cases(args: argparse.Namespace) -> list[tuple[str, str, list[TensorSpec]]]:
    out = []
    for n in args.case:
        if n in CASES:
            out.append((n, "stress" if n in STRESS else "realistic", tensors_for(CASES[n])))
        else:
            for seed in range(args.big_seeds):
                c = FAMILY_BIG[n]
                if seed:
                    c = replace(c, name=f"{c.name}-s{seed}", seed=seed)
                out.append((c.name, "family", family_tensors(c)))
    for seed in range(args.seeds):
        c = family_case(seed)
        out.append((c.name, "family", family_tensors(c)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--reps", type=int, default=3, help="planning runs per case (median)")
    ap.add_argument("--case", nargs="*", choices=sorted(CASES) + sorted(FAMILY_BIG),
                    default=list(CASES) + list(FAMILY_BIG))
    ap.add_argument("--seeds", type=int, default=8,
                    help="how many ~1,000-tensor schedules of the irregular cp family")
    ap.add_argument("--big-seeds", type=int, default=1,
                    help="how many seeds of each cp-family-10k/100k case (other seeds draw "
                         "other per-chunk sizes and variations)")
    ap.add_argument("--ablation", action="store_true",
                    help="also report the ratio of each candidate order alone")
    args = ap.parse_args()
    cases = all_cases(args)
    rows = [run_case(n, kind, ts, args.reps) for n, kind, ts in cases]
    if args.ablation:
        for r, (_, _, ts) in zip(rows, cases):
            r["ablation"] = ablation(ts)
    if args.json:
        print(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                          "cases": rows}, indent=2))
        return
    names = list(BASELINES)
    print(f"{'case':<18} {'kind':<9} {'tensors':>7} {'branches':>8} {'steps':>5} "
          f"{'lower bound':>12} {'arena':>12} {'ratio':>6} "
          + " ".join(f"{n:>14}" for n in names) + f" {'plan s':>7} {'cpu s':>7} {'verify s':>8}")
    for r in rows:
        print(f"{r['case']:<18} {r['kind']:<9} {r['tensors']:>7} {r['branches']:>8} {r['steps']:>5} "
              f"{r['lower_bound_bytes'] / MiB:>8.0f} MiB {r['arena_bytes'] / MiB:>8.0f} MiB "
              f"{r['ratio']:>6.3f} "
              + " ".join(f"{r['baselines'][n]['ratio']:>14.3f}" for n in names)
              + f" {r['plan_s']:>7.3f} {r['plan_cpu_s']:>7.3f} {r['verify_s']:>8.3f}")
    fam = [r for r in rows if r["case"].startswith("cp-family-s")]
    big = [r for r in rows if r["case"].startswith(("cp-family-10k", "cp-family-100k"))]
    if big:
        print(f"\ncp family at scale, {len(big)} cases: planner ratio max "
              f"{max(r['ratio'] for r in big):.4f}, plan s max "
              + ", ".join(f"{k} {max(r['plan_s'] for r in big if r['case'].startswith(k + '-') or r['case'] == k):.2f}"
                          for k in ("cp-family-10k", "cp-family-100k")
                          if any(r['case'].startswith(k) for r in big)))
    if fam:
        print(f"\ncp family, {len(fam)} seeds: planner ratio max {max(r['ratio'] for r in fam):.4f}, "
              f"mean {statistics.mean(r['ratio'] for r in fam):.4f}; "
              + ", ".join(f"{n} max {max(r['baselines'][n]['ratio'] for r in fam):.4f}"
                          for n in names))
    if args.ablation:
        cand = list(rows[0]["ablation"])
        print()
        print("arena / lower bound of each candidate alone (no refinement):")
        print(f"{'case':<18} " + " ".join(f"{n:>16}" for n in cand))
        for r in rows:
            print(f"{r['case']:<18} " + " ".join(f"{r['ablation'][n]:>16.3f}" for n in cand))


if __name__ == "__main__":
    main()
