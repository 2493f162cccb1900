"""Would recomputing a layer's parts one at a time lower its backward's working memory
below whole-layer recompute, and at what cost? (plain torch, no graphslot; measures,
asserts nothing but equal gradients)

    python benchmarks/recompute_parts.py [--preset llama] [--parts self_attn,mlp]
        [--variants whole,parts,kept] [--seq N] [--batch N] [--hidden N] [--ffn N]
        [--heads N] [--kv-heads N] [--repeats N] [--json]

The budget planner's least plan recomputes every layer, and its step then peaks early in
the bottom layer's backward: the layer's recomputed activations and its first gradient
temporaries (2,081 MiB live on the llama preset) beside every gradient. That live figure
alone keeps the plan above eager checkpointing's peak, whatever the graphs' pool does
with it (BENCHMARKS.md, twentieth session). One layer of the preset, each variant in a
process of its own:

- ``whole``: ``torch.utils.checkpoint`` over the layer, as graphslot's recompute captures
  it;
- ``parts``: the same, with each named part (attention, MLP) checkpointed inside it too:
  the backward's recompute keeps only the parts' inputs, and each part runs once more as
  its backward comes, so one part's activations are live at a time, at the cost of a
  second forward of the parts;
- ``kept``: each part checkpointed with no checkpoint around the layer: the forward keeps
  the parts' inputs (what a plan would send to the host), and the backward runs each part
  once more;
- ``children``: as ``kept``, with each of graphslot's parts of the layer checkpointed (norms
  too), which a library could do to any layer without being told its parts;
- ``none``: no checkpoint (the layer keeps all it saves), for reference.

For each: the bytes the forward leaves (``kept_mib``); the backward's live peak above
them (``backward_peak_mib``, the allocator's peak allocated); forward and backward times
(median of ``--repeats``); and on cuda the pool of a device graph pair captured into a
fresh pool (forward, then backward by ``torch.autograd.grad``: graphslot's captures;
``graph_pool_mib``, reserved) and their replay times. On a machine without cuda it runs
eagerly, for the gradients and the times. Every variant's gradients are compared with
``whole``'s (``equal_to_whole``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from typing import Any

MiB = 1 << 20
VARIANTS = ("whole", "parts", "kept", "children", "none")


def _checkpointed(module: Any) -> None:
    """Run ``module``'s forward under a non-reentrant checkpoint from now on."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    module.forward = run


def _layer(variant: str, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    import torch

    from graphslot.cli.bench_models import BenchShape, make_layers

    shape = BenchShape.preset(args.preset)
    shape.layers = 1
    for k in ("hidden", "heads", "kv_heads", "ffn", "seq", "batch"):
        if getattr(args, k) is not None:
            setattr(shape, k, getattr(args, k))
    shape.check()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (layer,) = make_layers(shape, device)
    parts = [m for name, m in layer.named_modules() if name.rsplit(".", 1)[-1] in args.parts]
    if len(parts) != len(args.parts):
        raise SystemExit(f"--parts {','.join(args.parts)}: the layer has "
                         f"{[n for n, _ in layer.named_modules() if n]}")
    if variant in ("parts", "kept"):
        for m in parts:
            _checkpointed(m)
    if variant == "children":
        from graphslot.recompute import recompute_parts

        # (graphslot's parts: down through single-child wrappers, as the bench preset's
        # Llama layer is one; its direct children were the whole layer)
        for m in recompute_parts(layer):
            _checkpointed(m)
    run = layer
    if variant in ("whole", "parts"):
        def run(x: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False,
                                                     preserve_rng_state=False)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, dtype=shape.dtype,
                    generator=g).requires_grad_()
    gy = torch.randn(x.shape, device=device, dtype=shape.dtype, generator=g)
    return layer, run, x, gy


def child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    layer, run, x, gy = _layer(variant, args)
    params = list(layer.parameters())
    cuda = x.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn: Any) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    fwd_ms, bwd_ms = [], []
    out: dict[str, Any] = {"variant": variant, "device": str(x.device), "parts": args.parts}
    for i in range(args.repeats + 1):
        for p in params:
            p.grad = None
        x.grad = None
        sync()
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        held: list[Any] = []
        fwd_ms.append(timed(lambda: held.append(run(x))))
        y = held.pop()
        if cuda:
            after = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        bwd_ms.append(timed(lambda: y.backward(gy)))
        if cuda and i == args.repeats:
            out["kept_mib"] = round((after - base) / MiB, 1)
            out["backward_peak_mib"] = round((torch.cuda.max_memory_allocated() - after) / MiB, 1)
        del y
    out["forward_ms"] = round(statistics.median(fwd_ms[1:]), 3)
    out["backward_ms"] = round(statistics.median(bwd_ms[1:]), 3)
    out["grads"] = [x.grad.detach().cpu()] + [p.grad.detach().cpu() for p in params]
    if cuda:
        out.update(_graphed(run, x, gy, params, args.repeats, timed))
    return out


def _graphed(run: Any, x: Any, gy: Any, params: list[Any], repeats: int, timed: Any) -> dict[str, Any]:
    """A forward graph and a backward graph captured into one fresh pool, as graphslot's."""
    import torch

    static_x = x.detach().clone().requires_grad_()
    static_g = gy.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up: libraries initialise)
        for _ in range(2):
            y = run(static_x)
            torch.autograd.grad(y, [static_x, *params], static_g)
            del y
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle()
    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd, pool=pool):
        y = run(static_x)
    with torch.cuda.graph(bwd, pool=pool):
        grads = torch.autograd.grad(y, [static_x, *params], static_g)
    torch.cuda.synchronize()
    pool_mib = round((torch.cuda.memory_reserved() - reserved) / MiB, 1)
    f_ms = [timed(fwd.replay) for _ in range(repeats + 1)]
    b_ms = [timed(bwd.replay) for _ in range(repeats + 1)]
    del grads, y
    return {"graph_pool_mib": pool_mib, "graph_forward_ms": round(statistics.median(f_ms[1:]), 3),
            "graph_backward_ms": round(statistics.median(b_ms[1:]), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama")
    p.add_argument("--parts", default="self_attn,mlp",
                   help="the submodules (by attribute name) checkpointed one by one")
    p.add_argument("--variants", default=",".join(VARIANTS))
    for k in ("seq", "batch", "hidden", "ffn", "heads", "kv-heads"):
        p.add_argument(f"--{k}", type=int)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--grads-to", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.parts = [s for s in args.parts.split(",") if s]
    if args.one:
        import torch

        r = child(args.one, args)
        torch.save(r.pop("grads"), args.grads_to)
        print(json.dumps(r))
        return 0
    import tempfile

    import torch

    results, grads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variants.split(","):
            if v not in VARIANTS:
                raise SystemExit(f"--variants: {v!r} is none of {', '.join(VARIANTS)}")
            path = os.path.join(tmp, f"{v}.pt")
            argv = [sys.executable, __file__, "--one", v, "--grads-to", path] + [
                a for a in sys.argv[1:] if a != "--json"]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                results.append({"variant": v, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            grads[v] = torch.load(path)
    for r in results:
        if "whole" in grads and r["variant"] in grads and r["variant"] != "whole":
            r["equal_to_whole"] = all(torch.equal(a, b) for a, b in zip(grads[r["variant"]], grads["whole"]))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
