"""``graphslot demo``: train a small GPT-like stack eagerly and graphed with offload, compare.

On the selected backend it trains the same model from the same weights on the same
batches three ways: eagerly, graphed with ``resident`` offload and graphed with
``remap`` offload, then reports whether losses and gradients match eager bit for bit,
the saved-activation bytes, what stays on the device at the forward/backward boundary,
driver calls and host synchronisations per step, and step times.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

from ..backend import Backend
from ..errors import UsageError
from ..memory import saved_activation_bytes
from ..sizes import format_bytes
from . import int_range
from .output import missing, table
from .toy import GPTConfig, TinyGPT

__all__ = ["run_demo", "add_parser", "MAX_STEPS", "MAX_LAYERS"]

#: The most training steps ``graphslot demo`` runs (``--steps``); the demo is a quick check.
MAX_STEPS = 10_000
#: The most layers of the demo's model (``--layers``); larger stacks are ``graphslot bench``'s.
MAX_LAYERS = 64


def _train(b: Backend, model: TinyGPT, steps: int) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, times, grads = [], [], []
    calls0 = syncs0 = 0
    for step in range(steps):
        if step == 1:  # the first step pays one-time costs (host buffers, warm caches)
            calls0, syncs0 = b.driver_calls(), b.counters["host_sync"]
        tokens, targets = model.batch(step, b.device)
        t0 = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        if step == steps - 1:
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # a host sync, outside the counted driver work
        times.append((time.perf_counter() - t0) * 1e3)
    n = steps - 1
    return {
        "losses": losses,
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "step_ms": statistics.median(times[1:] or times),
        # float(loss) above is the loop's own sync, one per step; the rest is graphslot's.
        "host_syncs_per_step": (b.counters["host_sync"] - syncs0) / n,
        "driver_calls_per_step": (b.driver_calls() - calls0) / n,
    }


def _boundary_bytes(b: Backend, model: TinyGPT, stack: Any) -> int:
    """Device bytes graphslot holds for activations after a forward, before its backward."""
    tokens, targets = model.batch(10_000, b.device)
    loss = model(tokens, targets)
    stack.engine.wait_idle()
    held = stack.engine.resident_device_bytes
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def run_demo(b: Backend, config: GPTConfig | None = None, steps: int = 6) -> dict[str, Any]:
    """Run the comparison on backend ``b`` and return the report (see the module docstring)."""
    from graphslot.adapters.torch import GraphedLayers

    c = config or GPTConfig()
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise UsageError(f"run_demo: steps must be an int of at least 2 (the first step pays "
                         f"one-time costs and is not counted), got {steps!r}")
    if isinstance(c.layers, bool) or not isinstance(c.layers, int) or c.layers < 1:
        raise UsageError(f"run_demo: config.layers must be a positive int, got {c.layers!r}")
    torch.manual_seed(0)
    base = TinyGPT(c).to(b.device)
    eager_model = copy.deepcopy(base)
    x0 = eager_model.hidden_in(eager_model.batch(0, b.device)[0]).detach().requires_grad_()
    saved = saved_activation_bytes(list(eager_model.blocks), x0)
    eager = _train(b, eager_model, steps)
    report: dict[str, Any] = {
        "backend": b.name,
        "device": b.info()["device"],
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(c).items()},
        "steps": steps,
        "saved_activation_bytes": saved,
        "eager": {"step_ms": eager["step_ms"], "device_activation_bytes_at_boundary": saved,
                  "losses": eager["losses"]},
        "modes": {},
    }
    for mode in ("resident", "remap"):
        model = copy.deepcopy(base)
        sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
        # One graph per layer: the toy's layers are small enough for GraphedLayers to join
        # them all, and one graph's activations would stay in its bank; the demo shows
        # them leaving the device between layers.
        stack = GraphedLayers(list(model.blocks), sample, mode=mode, backend=b, layers_per_graph=1)
        model.stack = stack
        res = _train(b, model, steps)
        diffs = [float((x - y).abs().max()) if x.numel() else 0.0
                 for x, y in zip(res["grads"] + res["params"], eager["grads"] + eager["params"])]
        same = res["losses"] == eager["losses"] and all(
            torch.equal(x, y) for x, y in zip(res["grads"] + res["params"], eager["grads"] + eager["params"]))
        offloaded = stack.engine.stats["offloaded_bytes"] // steps
        report["modes"][mode] = {
            "matches_eager": same,
            "max_abs_diff": max(diffs + [abs(x - y) for x, y in zip(res["losses"], eager["losses"])]),
            "step_ms": res["step_ms"],
            "device_activation_bytes_at_boundary": _boundary_bytes(b, model, stack),
            "offloaded_bytes_per_step": offloaded,
            "driver_calls_per_step": res["driver_calls_per_step"],
            "host_syncs_per_step": res["host_syncs_per_step"],
            "losses": res["losses"],
        }
        stack.close()
    return report


def _print(r: dict[str, Any]) -> None:
    print(f"graphslot demo on {r['backend']} ({r['device']}), {r['steps']} training steps, "
          f"{r['config']['layers']} layers")
    print(f"saved activations per step: {format_bytes(r['saved_activation_bytes'])}")
    e = r["eager"]
    rows = [["eager", "-", "-", f"{e['step_ms']:.2f}",
             format_bytes(e["device_activation_bytes_at_boundary"]), "-", "-", "-"]]
    for name, m in r["modes"].items():
        rows.append([name, "yes (bitwise)" if m["matches_eager"] else "NO", f"{m['max_abs_diff']:.3g}",
                     f"{m['step_ms']:.2f}", format_bytes(m["device_activation_bytes_at_boundary"]),
                     format_bytes(m["offloaded_bytes_per_step"]), f"{m['driver_calls_per_step']:.1f}",
                     f"{m['host_syncs_per_step']:.1f}"])
    print(table(rows, ("run", "matches eager", "max |diff|", "step ms", "on device at boundary",
                       "offloaded/step", "driver calls", "host syncs"), "lrrrrrrr"))
    print("host syncs count graphslot's own; the training loop's float(loss) is not counted.")


def main(args: argparse.Namespace) -> int:
    from ..selection import get_backend

    needed = None if args.json else missing("tabulate", "the demo table", "--json")
    if needed:  # before training, not after it
        print(f"graphslot demo: error: {needed}", file=sys.stderr)
        return 1
    b = get_backend(args.backend)
    c = GPTConfig(layers=args.layers)
    r = run_demo(b, c, steps=args.steps)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        _print(r)
    ok = all(m["matches_eager"] for m in r["modes"].values())
    return 0 if ok or not args.strict else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small GPT-like stack eagerly and graphed with offload")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int_range(2, MAX_STEPS), default=6, metavar="N",
                   help=f"training steps per run, 2 to {MAX_STEPS} (default 6; the first pays "
                   "one-time costs and is not counted)")
    p.add_argument("--layers", type=int_range(1, MAX_LAYERS), default=4, metavar="N",
                   help=f"transformer blocks in the model, 1 to {MAX_LAYERS} (default 4)")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every mode matches eager")
    p.set_defaults(func=main)
