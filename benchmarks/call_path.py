"""The call path of one resident training step through graphslot (not a test; asserts nothing).

    python benchmarks/call_path.py [--layers 4] [--mode resident]

Builds a small GraphedLayers stack (each layer its own graph, every layer offloaded),
trains it a few steps, then traces one more step's forward and backward with
``sys.setprofile`` and counts the Python calls into graphslot's own files: in all, per
file, and the entries into the offload package's unit API (calls of ``offload/unit.py``
from outside the offload package). One JSON object per pass; ``per_layer`` divides by the
layer count (the first and last layers differ a little from the middle ones).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
from typing import Any

import torch

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.toy import GPTConfig, TinyGPT

import graphslot.adapters
import graphslot.backends

#: where each part of the package lies (an editable install may map them apart), by name
ROOTS = {os.path.dirname(m.__file__) + os.sep: name for m, name in (
    (graphslot.adapters, "adapters"), (graphslot.backends, "backends"), (graphslot, ""))}
UNIT = os.path.join("offload", "unit.py")


def _where(filename: str) -> str | None:
    """``filename`` relative to graphslot (``adapters/...``, ``backends/...``), or None."""
    for root, name in ROOTS.items():
        if filename.startswith(root):
            return os.path.join(name, filename[len(root):])
    return None


def traced(fn: Any) -> dict[str, Any]:
    calls: collections.Counter[str] = collections.Counter()
    unit_entries: collections.Counter[str] = collections.Counter()
    def prof(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        rel = _where(frame.f_code.co_filename)
        if rel is None:
            return
        calls[rel] += 1
        if rel == UNIT:
            back = frame.f_back
            caller = _where(back.f_code.co_filename) if back is not None else None
            if caller is None or not caller.startswith("offload" + os.sep):
                unit_entries[frame.f_code.co_name] += 1

    # Autograd runs a device's backward on a thread of its own: trace every thread.
    every = getattr(threading, "setprofile_all_threads", None)
    (every or sys.setprofile)(prof)
    try:
        out = fn()
    finally:
        (every or sys.setprofile)(None)
    return {"calls": sum(calls.values()), "files": len(calls), "per_file": dict(calls.most_common()),
            "unit_entries": sum(unit_entries.values()), "unit_calls": dict(unit_entries), "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mode", default="resident")
    a = ap.parse_args()
    b = graphslot.get_backend()
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(layers=a.layers)).to(b.device)
    tokens, _ = model.batch(0, b.device)
    x0 = model.hidden_in(tokens).detach()
    stack = GraphedLayers(list(model.blocks), x0, mode=a.mode, layers_per_graph=1, backend=b)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        stack(x0.clone()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    b.synchronize()
    fwd = traced(lambda: stack(x0.clone()))
    y = fwd.pop("out")
    loss = y.float().square().mean()
    bwd = traced(lambda: loss.backward())
    bwd.pop("out")
    for name, rec in (("forward", fwd), ("backward", bwd)):
        rec["per_layer"] = {k: round(rec[k] / a.layers, 1) for k in ("calls", "unit_entries")}
        print(json.dumps({"pass": name, "mode": a.mode, "layers": a.layers, "backend": b.name, **rec}))
    stack.close()


if __name__ == "__main__":
    main()
