"""Soak: many training steps through GraphedLayers with checksums on, memory every N steps.

    GRAPHSLOT_BACKEND=cpu python benchmarks/soak.py --steps 10000 --every 1000 [--mode remap]

Each step mixes what a training loop does: a training forward and backward, a forward
under no_grad every 7th step, a dropped forward every 11th, an abandoned step (forward,
then an interrupt) every 13th, and an optimizer step. Every restored activation is
checksummed (``debug_checksums``). Every ``--every`` steps it prints one JSON line: the
step, tickets in flight, host bytes of the engine, pinned host bytes, graphslot's mapped
device bytes, reservations and the process RSS, so a leak shows as a rising column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import graphslot
from graphslot import memory
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.toy import GPTConfig, TinyGPT


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--mode", default="resident", choices=("resident", "remap", "off"))
    p.add_argument("--layers", type=int, default=3)
    a = p.parse_args(argv)
    if a.steps < 1 or a.every < 1 or a.layers < 1:
        p.error("--steps, --every and --layers must be at least 1")
    b = graphslot.get_backend()
    c = GPTConfig(hidden=32, heads=2, ffn=64, seq=16, batch=2, layers=a.layers, vocab=64)
    torch.manual_seed(0)
    model = TinyGPT(c).to(b.device)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.perf_counter()
    with GraphedLayers(list(model.blocks), sample, mode=a.mode, backend=b, debug_checksums=True) as stack:
        model.stack = stack
        for step in range(1, a.steps + 1):
            data = model.batch(step, b.device)
            if step % 7 == 0:
                with torch.no_grad():
                    model(*data)
            if step % 11 == 0:
                model(*data)  # dropped
            if step % 13 == 0:
                try:
                    model(*data)
                    raise KeyboardInterrupt
                except KeyboardInterrupt:
                    pass
            loss = model(*data)
            loss.backward()
            if not torch.isfinite(loss):
                print(json.dumps({"step": step, "error": "loss is not finite"}))
                return 1
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % a.every == 0 or step == a.steps:
                stack.engine.wait_idle()
                r = memory.report(b, samples=1)
                print(json.dumps({
                    "step": step, "seconds": round(time.perf_counter() - t0, 1),
                    "loss": float(loss.detach()), "tickets_in_flight": len(stack.engine.in_flight()),
                    "engine_host_bytes": stack.engine.host_bytes,
                    "host_pinned_bytes": r.host_pinned_bytes, "mapped_bytes": r.mapped_bytes,
                    "reservations": len(b.ledger.reservations), "rss_bytes": _rss()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
