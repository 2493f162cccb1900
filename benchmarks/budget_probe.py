"""What the budget planner predicts beside what its plans measure, one process per plan.

    GRAPHSLOT_BACKEND=cuda python benchmarks/budget_probe.py [--preset llama] \
        [--budgets auto,12GiB,...] [--layers N] [--seq N] [--steps 5] [--json OUT]

For each budget (and two references: every layer kept, every layer recomputed) a child
process builds ``GraphedLayers(memory_budget=...)`` over the bench preset's layers, runs
training steps (forward, backward, SGD step, ``zero_grad()``) and reports the plan (its
choices, predicted peak and step, lower bound, the profile it planned from) beside the
median step and the peak as the process holds it (the allocator's peak reserved bytes
plus graphslot's peak pages, counted from after the build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from graphslot.budget import plan_letters

GiB = 1 << 30
SHAPE = ("layers", "seq")  # (the preset's fields this script's options override)


def train(b, stack, opt, x, gy, steps: int) -> tuple[list[float], int | None]:
    """One training step (forward, backward, optimizer step, ``zero_grad()``), then
    ``steps`` timed ones: their times in ms, and the peak as the process holds it from
    after the first (the allocator's peak reserved bytes plus graphslot's peak pages; None
    where the allocator cannot tell)."""
    def step() -> None:
        y = stack(x)
        y.backward(gy)
        opt.step()
        opt.zero_grad()
        x.grad = None

    step()
    b.synchronize()
    b.allocator_stats(reset_peak=True)
    b.ledger.reset_peak()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        b.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    st = b.allocator_stats()
    peak = (None if st["peak_reserved_bytes"] is None
            else st["peak_reserved_bytes"] + b.ledger.peak_allocated_bytes)
    return times, peak


def child_result(argv: list[str], env: dict[str, str], label: dict) -> dict:
    """Run a child process; its last line of output as JSON, or ``label`` with the last
    line of its error output where it failed."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {**label, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_args(ap: argparse.ArgumentParser, steps: int, shape: tuple[str, ...]) -> argparse.Namespace:
    """Add what every probe script takes (``--steps``, an integer override for each field
    of the preset's shape in ``shape``, ``--json``, and its children's ``--run``), then parse."""
    ap.add_argument("--steps", type=int, default=steps)
    for k in shape:
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def child_argv(script: str, args: argparse.Namespace, shape: tuple[str, ...], run: str) -> list[str]:
    """The command line of ``script``'s child for ``run``, with the parent's preset, steps
    and shape overrides."""
    argv = [sys.executable, script, "--preset", args.preset, "--steps", str(args.steps), "--run", run]
    return argv + [a for k in shape if getattr(args, k) for a in (f"--{k}", str(getattr(args, k)))]


def probe_shape(args: argparse.Namespace, shape: tuple[str, ...]) -> Any:
    """The preset's :class:`~graphslot.cli.bench_models.BenchShape`, with the fields in
    ``shape`` the command line overrides."""
    from graphslot.cli.bench_models import BenchShape

    s = BenchShape.preset(args.preset)
    for k in shape:
        if getattr(args, k):
            setattr(s, k, getattr(args, k))
    return s


def record(results: list[dict], r: dict, path: str | None, line: dict | None = None) -> None:
    """Keep a child's result: append it, print ``line`` (default: the result) as JSON and
    write every result so far to ``path`` (so a run cut short keeps what it had)."""
    results.append(r)
    print(json.dumps(r if line is None else line), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def child(args: argparse.Namespace) -> dict:
    import torch

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import training_data

    b = get_backend()
    layers, x, gy = training_data(probe_shape(args, SHAPE), b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    kw: dict = {}
    if args.run == "keep":
        kw = dict(mode="off")
    elif args.run == "recompute":
        kw = dict(mode="off", recompute_layers=range(len(layers)))
    else:
        kw = dict(memory_budget=args.run)
    t0 = time.perf_counter()
    stack = GraphedLayers(layers, x, **kw)
    build_s = time.perf_counter() - t0

    times, peak = train(b, stack, opt, x, gy, args.steps)
    out = {"run": args.run, "build_s": build_s, "step_ms": statistics.median(times),
           "steps_ms": times, "peak_bytes": peak, "peak_gib": None if peak is None else peak / GiB,
           "graphs": [list(g) for g in stack.graph_layers]}
    if stack.plan is not None:
        p = stack.plan
        out["plan"] = p.as_dict()
        out["plan"]["predicted_peak_gib"] = p.predicted_peak_bytes / GiB
        out["profile"] = p.profile.as_dict() if p.profile is not None else None
        out["step_over_bound"] = out["step_ms"] / p.lower_bound_ms
        out["peak_over_predicted"] = None if peak is None else peak / p.predicted_peak_bytes
    stack.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--budgets", default="auto")
    args = probe_args(ap, 5, SHAPE)
    if args.run:
        print(json.dumps(child(args)))
        return 0
    results = []
    for run in ["keep", "recompute", *args.budgets.split(",")]:
        r = child_result(child_argv(__file__, args, SHAPE, run), dict(os.environ), {"run": run})
        line = {k: r.get(k) for k in ("run", "step_ms", "peak_gib", "build_s", "error")}
        if "plan" in r:
            p = r["plan"]
            line.update(choices=plan_letters(p["choices"], p.get("recompute_ops") or ()), mode=p["mode"],
                        pred_peak=round(p["predicted_peak_gib"], 3),
                        pred_step=round(p["predicted_step_ms"], 1),
                        bound=round(p["lower_bound_ms"], 1))
        record(results, r, args.json, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
