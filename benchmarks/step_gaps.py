"""Where the device idles inside one training step (cuda only): a torch profiler trace of
one step, its device work merged into busy intervals, and the gaps between them.

    GRAPHSLOT_BACKEND=cuda python benchmarks/step_gaps.py [--preset llama] \
        [--run eager|graph|resident|remap] [--accumulate N] [--keep-grad] [--top 12] [--json OUT]

The step is the bench's: ``--accumulate`` microbatches of forward and backward, SGD's
step, ``zero_grad()`` (``set_to_none=False`` with ``--keep-grad``). Two warm-up steps,
then one profiled. It prints the step's wall time, the time from its first device work to
its last, how much of that the device was busy (kernels, copies, memsets on any stream),
and the longest gaps with the host ops running when each began: what the rest of a step
beyond its forward, backward and optimizer phases is made of. It also sums device time per
kernel name (per microbatch, so runs with other ``--accumulate`` compare), and counts the
host's device-wide waits in the step (``torch.cuda.synchronize``, stream and event
``synchronize``) by the call site that asked for them.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections import Counter

from budget_probe import probe_shape

SHAPE = ("layers", "seq")


def busy_intervals(events: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(start, end)`` intervals merged where they overlap or touch."""
    merged: list[list[float]] = []
    for s, e in sorted(events):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama")
    ap.add_argument("--run", default="graph", choices=("eager", "graph", "resident", "remap"))
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--keep-grad", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    for k in SHAPE:
        ap.add_argument(f"--{k}", type=int, default=None)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from graphslot import get_backend
    from graphslot.adapters.torch import GraphedLayers
    from graphslot.cli.bench_models import training_data

    b = get_backend()
    if b.name != "cuda":
        raise SystemExit(f"step_gaps: the profiler's device timeline needs cuda, not {b.name}")
    layers, x, gy = training_data(probe_shape(args, SHAPE), b.device)
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-6)
    if args.run == "eager":
        def fwd() -> torch.Tensor:
            y = x
            for m in layers:
                y = m(y)
            return y
    else:
        stack = GraphedLayers(layers, x, mode={"graph": "off"}.get(args.run, args.run), backend=b)
        fwd = lambda: stack(x)  # noqa: E731

    def step() -> None:
        for _ in range(args.accumulate):
            y = fwd()
            y.backward(gy)
            del y
        opt.step()
        opt.zero_grad(set_to_none=not args.keep_grad)
        x.grad = None

    for _ in range(2):
        step()
    b.synchronize()
    waits: Counter[str] = Counter()

    def counted(fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            frames = [f for f in traceback.extract_stack()[:-1] if "graphslot" in f.filename
                      or "step_gaps" in f.filename]
            waits[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                              for f in frames[::-1][:3]) or "?"] += 1
            return fn(*a, **k)
        return wrapper

    patched = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
               (torch.cuda.Event, "synchronize")]
    saved = [getattr(o, n) for o, n in patched]
    for (o, n), f in zip(patched, saved):
        setattr(o, n, counted(f))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        b.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    for (o, n), f in zip(patched, saved):
        setattr(o, n, f)
    kernels: Counter[str] = Counter()
    device, host = [], []
    for e in prof.events():  # (kernels, copies and memsets are the events on the device)
        start, end = e.time_range.start / 1e3, e.time_range.end / 1e3  # us -> ms
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device.append((start, end))
            kernels[e.name[:80]] += (end - start) / args.accumulate
        else:
            host.append((start, end, e.name))
    if not device:
        raise SystemExit("step_gaps: the profiler recorded no device work")
    busy = busy_intervals(device)
    first, last = busy[0][0], busy[-1][1]
    gaps = sorted(((s2 - e1, e1, s2) for (_, e1), (s2, _) in zip(busy, busy[1:])), reverse=True)

    def host_at(t: float) -> list[str]:
        names = sorted({n for s, e, n in host if s <= t <= e}, key=len)
        return names[:4]

    out = {"preset": args.preset, "run": args.run, "accumulate": args.accumulate,
           "keep_grad": args.keep_grad, "wall_ms": wall_ms, "device_span_ms": last - first,
           "device_busy_ms": sum(e - s for s, e in busy),
           "gaps": [{"ms": g, "at_ms": s - first, "host": host_at(s)} for g, s, _ in gaps[:args.top]],
           "kernel_ms_per_microbatch": dict(kernels.most_common()),
           "waits": dict(waits.most_common())}
    print(f"{args.run} ({args.preset}, {args.accumulate} microbatch(es)"
          f"{', .grad kept' if args.keep_grad else ''}): wall {wall_ms:.2f} ms, device span "
          f"{out['device_span_ms']:.2f} ms, busy {out['device_busy_ms']:.2f} ms")
    for g in out["gaps"]:
        print(f"  gap {g['ms']:7.3f} ms at {g['at_ms']:8.2f} ms: {', '.join(g['host'])}")
    for name, ms in kernels.most_common(args.top):
        print(f"  {ms:8.3f} ms/microbatch  {name}")
    for site, n in waits.most_common():
        print(f"  {n:4d} waits  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
