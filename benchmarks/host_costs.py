"""What a GraphedLayers step costs the host, piece by piece (not a test; asserts nothing).

    GRAPHSLOT_BACKEND=cuda python benchmarks/host_costs.py [--preset launch] [--modes off resident remap]

Three readings, one JSON line each:

- ``primitives``: microseconds of host time per backend call (event creation, record,
  wait, a small pinned copy, the current stream, a one-kernel graph replay);
- per mode, ``step``: the step's wall time with the device synchronised, the host time to
  queue it (no synchronisation), and the device's own span of it (events at both ends);
  when the host takes about as long to queue a step as the step takes, the step is
  host-bound and every microsecond of bookkeeping shows;
- per mode, ``calls``: host microseconds per layer pass inside each engine and runner call
  (wall time around the call, its callees included), and how much of a step Python's
  cyclic garbage collector takes (it runs inside whichever call allocated last).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import statistics
import time
from typing import Any, Callable

import torch

import graphslot
from graphslot.adapters import torch as gt
from graphslot.offload import OffloadEngine
from profile_host import stack_inputs, training_step  # (this folder: the same stack and step)


def _per_call_us(fn: Callable[[], Any], n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def primitives(b: Any, n: int) -> dict[str, float]:
    s = b.new_stream()
    ev = b.record_event(b.new_event())
    host = b.pinned_empty(4096)
    dev = torch.empty(4096, dtype=torch.uint8, device=b.device)
    big = 4 << 20
    res, alloc = b.reserve_mapped(big)  # a slot's kind of memory: driver VMM pages
    slot = b.tensor_at(res.va, (big,), torch.uint8)
    plain = torch.empty(big, dtype=torch.uint8, device=b.device)
    host_big = b.pinned_empty(big)
    out = {
        "new_event": _per_call_us(b.new_event, n),
        "new_event+record": _per_call_us(lambda: b.record_event(b.new_event()), n),
        "new_framework_event+record": _per_call_us(lambda: b.vendor_new_event(False).record(s), n),
        "record_reused": _per_call_us(lambda: b.record_event(ev), n),
        "wait_event": _per_call_us(lambda: b.wait_event(s, ev), n),
        "copy_async_4k_d2h": _per_call_us(lambda: b.copy_async(host, dev, s), n),
        "copy_async_4m_d2h_vmm": _per_call_us(lambda: b.copy_async(host_big, slot, s), n // 10),
        "copy_async_4m_h2d_vmm": _per_call_us(lambda: b.copy_async(slot, host_big, s), n // 10),
        "copy_async_4m_d2h": _per_call_us(lambda: b.copy_async(host_big, plain, s), n // 10),
        "current_stream": _per_call_us(b.current_stream, n),
    }
    if b.name == "cuda":  # the driver's own calls, arguments made beforehand
        from cuda.bindings import driver as cu
        h, d, sh = host_big.data_ptr(), slot.data_ptr(), s.cuda_stream
        out["raw_cuMemcpyAsync_4m_d2h_vmm"] = _per_call_us(lambda: cu.cuMemcpyAsync(h, d, big, sh), n // 10)
        out["raw_cuMemcpyDtoHAsync_4m_vmm"] = _per_call_us(lambda: cu.cuMemcpyDtoHAsync(h, d, big, sh), n // 10)
        out["raw_cuMemcpyAsync_4k_d2h"] = _per_call_us(
            lambda: cu.cuMemcpyAsync(host.data_ptr(), dev.data_ptr(), 4096, sh), n // 10)
    b.synchronize()
    del slot
    b.unmap_release(res, 0)
    b.free(res)
    x = torch.zeros(16, device=b.device)
    g = b.new_graph()
    b.synchronize()
    with g.capture():
        x.add_(1)
    out["graph_replay_1_kernel"] = _per_call_us(g.replay, n)
    b.synchronize()
    return out


def _watched(b: Any) -> list[tuple[Any, list[str]]]:
    """The calls timed per layer pass: the runner's, the engine's, and what they call."""
    from graphslot.backend import Backend
    from graphslot.offload.group import OffloadGroup
    from graphslot.offload.residency import KeptOnDevice, ResidentBanks

    return [
        (OffloadEngine, ["before_forward", "after_forward", "prefetch_forward",
                         "_queue_held_copy_out", "restore", "wait_restored", "restore_ahead",
                         "consumed", "ticket", "_free_slot"]),
        (gt.runner.GraphRunner, ["forward", "_replay_backward", "_grads_out"]),
        (OffloadGroup, ["take_stash"]),
        (KeptOnDevice, ["claim"]),
        (ResidentBanks, ["before_forward", "restore", "copy_out", "_copy_in"]),
        (Backend, ["copy_async", "record_event", "wait_event", "query_event", "new_event"]),
        (type(b), ["vendor_new_event", "current_stream"]),
    ]


def _watch(spent: collections.Counter[str], calls: collections.Counter[str],
           watched: list[tuple[Any, list[str]]]) -> list[tuple[Any, str, Any]]:
    undo = []
    for cls, names in watched:
        for name in names:
            fn = cls.__dict__[name]

            @functools.wraps(fn)
            def wrapper(*a: Any, __fn: Any = fn, __name: str = f"{cls.__name__}.{name}", **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return __fn(*a, **k)
                finally:
                    spent[__name] += time.perf_counter() - t
                    calls[__name] += 1
            setattr(cls, name, wrapper)
            undo.append((cls, name, fn))
    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="launch")
    ap.add_argument("--modes", nargs="+", default=["off", "resident", "remap"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    b = graphslot.get_backend()
    print(json.dumps({"primitives_us": primitives(b, args.calls)}), flush=True)
    shape, layers, x, gy = stack_inputs(b, args.preset)
    for mode in args.modes:
        stack = gt.GraphedLayers(layers, x, mode=mode, backend=b)
        step = training_step(stack, layers, x, gy)
        for _ in range(5):
            step()
        b.synchronize()
        wall, queue, device = [], [], []
        collecting: list[float] = []
        gc_s = [0.0, 0]

        def gc_timer(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                collecting.append(time.perf_counter())
            elif collecting:
                gc_s[0] += time.perf_counter() - collecting.pop()
                gc_s[1] += 1
        gc.callbacks.append(gc_timer)
        for _ in range(args.steps):
            e0, e1 = b.new_event(timing=True), b.new_event(timing=True)
            t0 = time.perf_counter()
            b.record_event(e0)
            step()
            b.record_event(e1)
            t1 = time.perf_counter()
            b.synchronize()
            t2 = time.perf_counter()
            wall.append((t2 - t0) * 1e3)
            queue.append((t1 - t0) * 1e3)
            device.append(e0.elapsed_time(e1))
        gc.callbacks.remove(gc_timer)
        spent: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()
        undo = _watch(spent, calls, _watched(b))
        try:
            for _ in range(args.steps):
                step()
            b.synchronize()
        finally:
            for cls, name, fn in undo:
                setattr(cls, name, fn)
        per = shape.layers * args.steps
        print(json.dumps({
            "mode": mode, "preset": args.preset,
            "step_ms": statistics.median(wall), "queue_ms": statistics.median(queue),
            "device_span_ms": statistics.median(device),
            "gc_ms_per_step": round(gc_s[0] / args.steps * 1e3, 3),
            "gc_collections_per_step": round(gc_s[1] / args.steps, 2),
            "us_per_layer_pass": {k: round(v / per * 1e6, 2) for k, v in spent.most_common()},
            "calls_per_layer_pass": {k: round(calls[k] / per, 2) for k, _ in spent.most_common()},
        }), flush=True)
        stack.close()


if __name__ == "__main__":
    main()
