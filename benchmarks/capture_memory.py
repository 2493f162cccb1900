"""What a recomputed layer's backward holds at its most, eagerly and under capture (cuda only).

    GRAPHSLOT_BACKEND=cuda python benchmarks/capture_memory.py [--preset llama] [--layers 2]

Two runs, each in a process of its own, on the bench preset's layers:

- ``eager``: ``torch.utils.checkpoint`` on every layer; after two steps, one more with the
  allocator's history on, and what its backward allocated above what was live when it
  began, at its highest, by allocating frame (Python and the aten/autograd function).
- ``graph``: GraphedLayers with every layer recomputed; each backward graph's capture
  measured the same way (what the capture allocated above what was live when it began),
  and the graphs' pool after the build.

The backward graphs' pool is sized by their captures, so where the two differ is where
recompute under graphs holds more than eager checkpointing. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from typing import Any, Callable

from alloc_trace import by_label, events_since, highest_live, live_blocks, pool_of, trace_end

MiB = 1 << 20
BEFORE = "(live at the start)"


def _where(frames: list[dict[str, Any]] | None) -> str:
    """The first Python frame and the first aten or autograd function that allocated."""
    frames = frames or []
    py = next((f for f in frames if f.get("filename", "").endswith(".py")), None)
    cpp = next((f for f in frames if any(k in f.get("name", "") for k in
                                         ("at::native::", "at::_ops::", "torch::autograd::"))), None)
    parts = []
    if py:
        parts.append(f"{py['filename'].rsplit('/', 1)[-1]}:{py.get('line')}:{py.get('name')}")
    if cpp:
        parts.append(cpp["name"][:90])
    return " | ".join(parts) or "(no frame)"


class Window:
    """Allocations between :meth:`start` and :meth:`stop`: their highest sum above what
    was live at the start, and what made it up."""

    def __init__(self) -> None:
        import torch
        self.torch = torch
        self.results: list[dict[str, Any]] = []

    def start(self) -> None:
        snap = self.torch.cuda.memory._snapshot()
        self.t0 = trace_end(snap)
        self.live = live_blocks(snap, lambda pool, blk: BEFORE)
        self.live0 = sum(v[0] for v in self.live.values())

    def stop(self, label: str) -> None:
        snap = self.torch.cuda.memory._snapshot()
        best, at_best, _ = highest_live(self.live, events_since(snap, self.t0), _where)
        new = {a: v for a, v in at_best.items() if v[1] != BEFORE}
        pools: collections.Counter[str] = collections.Counter()
        for s in snap["segments"]:
            pools[pool_of(s)] += s["total_size"]
        self.results.append({
            "window": label, "live_at_start_mib": round(self.live0 / MiB, 1),
            "highest_above_start_mib": round((best - self.live0) / MiB, 1),
            "allocated_in_window_at_highest_mib": round(sum(v[0] for v in new.values()) / MiB, 1),
            "freed_from_before_mib": round((self.live0 - sum(v[0] for v in self.live.values()
                                                             if v[1] == BEFORE)) / MiB, 1),
            "at_highest_mib": by_label(new, 16),
            "reserved_after_mib": {k: round(v / MiB, 1) for k, v in pools.items()},
        })


def child(run: str, preset: str, layers_n: int) -> list[dict[str, Any]]:
    import torch

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.adapters.torch import runner as runner_mod
    from graphslot.cli.bench_models import BenchShape, CheckpointedLayer, training_data

    b = get_backend()
    shape = BenchShape.preset(preset)
    shape.layers = layers_n
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
    w = Window()
    if run == "eager":
        checkpointed = torch.nn.Sequential(*(CheckpointedLayer(m) for m in layers))

        def fwd() -> torch.Tensor:
            return checkpointed(x)

        for _ in range(2):
            fwd().backward(gy)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        y = fwd()
        w.start()
        y.backward(gy)
        torch.cuda.synchronize()
        w.stop("eager backward")
    else:
        orig: Callable[..., Any] = runner_mod.GraphRunner.build_backward

        def build_backward(self: Any, *a: Any, **k: Any) -> Any:
            torch.cuda.synchronize()
            w.start()
            try:
                return orig(self, *a, **k)
            finally:
                torch.cuda.synchronize()
                w.stop(f"capture backward {self.name}")

        runner_mod.GraphRunner.build_backward = build_backward  # type: ignore[method-assign]
        stack = GraphedLayers(layers, x, mode="off", recompute_layers=range(layers_n))
        w.results.append({"pool_mib": round((stack.pool_bytes or 0) / MiB, 1),
                          "homes": bool(getattr(stack, "_grad_homes", False))})
    torch.cuda.memory._record_memory_history(enabled=None)
    return w.results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--runs", nargs="+", default=["eager", "graph"])
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.preset, args.layers)), flush=True)
        return
    for run in args.runs:
        p = subprocess.run([sys.executable, __file__, "--child", run, "--preset", args.preset,
                            "--layers", str(args.layers)], capture_output=True, text=True)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        print(json.dumps({"run": run, "result": json.loads(line)}) if p.returncode == 0 and line
              else json.dumps({"run": run, "error": p.stderr[-3000:]}), flush=True)


if __name__ == "__main__":
    main()
