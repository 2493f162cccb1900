"""Why a kept ``.grad`` cannot simply be the backward graph's buffer (issue 30), on a device.

    GRAPHSLOT_BACKEND=cuda python benchmarks/kept_grad_probe.py [--layers 8] [--hidden 1024] \
        [--ffn 4096] [--tokens 8192] [--json OUT]

Layers of ``Linear(hidden, ffn)``, GELU, ``Linear(ffn, hidden)`` in bf16. It prints:

* ``overwritten``: per mode, after a backward with ``.grad`` unset (each ``.grad`` is then
  its backward graph's buffer), how many of those buffers one forward replay changes. More
  than none: the buffers share pool memory with what the forward graphs write (as in
  torch's graphed callables; that sharing is what makes them cost nothing beside the
  activations), so no backward graph can accumulate into them across microbatches or steps.
* ``peaks``: the peak the process holds (allocator peak reserved plus graphslot's pages,
  from after the build) over three steps with ``zero_grad()`` and with
  ``zero_grad(set_to_none=False)``, for eager (peak allocated), GraphedLayers, and
  GraphedLayers with ``main_grad=True`` where each ``.grad`` is its ``main_grad`` (cuda only).
  On the cpu backend, whose graphs keep every tensor their capture made, nothing is
  overwritten: the sharing shows on devices only.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers

    b = get_backend()
    dev, dt = b.device, torch.bfloat16
    torch.manual_seed(0)
    base = [nn.Sequential(nn.Linear(args.hidden, args.ffn), nn.GELU(),
                          nn.Linear(args.ffn, args.hidden)).to(dev, dt) for _ in range(args.layers)]
    xs = [torch.randn(args.tokens, args.hidden, device=dev, dtype=dt) for _ in range(3)]
    grad_bytes = sum(p.numel() * p.element_size() for m in base for p in m.parameters())
    result: dict = {"args": vars(args), "grad_mib": grad_bytes / MiB, "overwritten": {}, "peaks": {}}

    def params(layers: list[nn.Module]) -> list[nn.Parameter]:
        return [p for m in layers for p in m.parameters()]

    def steps(fn, layers: list[nn.Module], keep: bool, main_grad: bool = False) -> None:
        for x in xs:
            fn(x).float().square().mean().backward()
            for p in params(layers):
                if main_grad:
                    p.main_grad.zero_()
                elif keep:
                    p.grad.zero_()
                else:
                    p.grad = None

    cuda = dev.type == "cuda"  # (peaks from torch.cuda's allocator; elsewhere only the first figure)

    def peak_of(run) -> float:
        if not cuda:
            return float("nan")
        b.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mapped = b.ledger.mapped_bytes
        run()
        b.synchronize()
        return (torch.cuda.max_memory_reserved() + b.ledger.mapped_bytes - mapped) / MiB

    for keep in (False, True) if cuda else ():
        layers = copy.deepcopy(base)
        seq = nn.Sequential(*layers)
        b.synchronize()
        torch.cuda.reset_peak_memory_stats()
        steps(seq, layers, keep)
        b.synchronize()
        result["peaks"][f"eager keep={keep}"] = torch.cuda.max_memory_allocated() / MiB
        del layers, seq

    for mode in ("off", "remap"):
        layers = copy.deepcopy(base)
        with GraphedLayers(layers, xs[0], mode=mode, backend=b, layers_per_graph=1) as stack:
            stack(xs[0]).float().square().mean().backward()
            bufs = {id(pg.param): pg.buf for r in stack._runners for pg in r.grads if pg is not None}
            before = [(bufs[id(p)], bufs[id(p)].clone()) for p in params(layers)]
            with torch.no_grad():
                stack(xs[1])  # the forward graphs replay
            b.synchronize()
            changed = sum(not torch.equal(buf, was) for buf, was in before)
            result["overwritten"][mode] = f"{changed} of {len(before)}"
            for keep in (False, True):
                for p in params(layers):
                    p.grad = None
                result["peaks"][f"graphed {mode} keep={keep}"] = peak_of(
                    lambda: steps(stack, layers, keep))
        layers = copy.deepcopy(base)
        for p in params(layers):
            p.main_grad = p.grad = torch.zeros_like(p)
        with GraphedLayers(layers, xs[0], mode=mode, backend=b, layers_per_graph=1,
                           main_grad=True) as stack:
            result["peaks"][f"graphed {mode} main_grad as .grad"] = peak_of(
                lambda: steps(stack, layers, True, main_grad=True))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
