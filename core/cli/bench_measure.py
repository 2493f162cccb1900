"""What ``graphslot bench`` measures of one configuration: the training step's time, its
phases, the bytes it copies, its memory over one step and its peak.

A step is one optimizer step, as a training loop runs it: ``accumulate`` microbatches'
forward and backward, the optimizer's step over the layers' parameters (``torch.optim.SGD``,
or ``AdamW``: :data:`OPTIMIZERS`), then ``zero_grad()`` (``set_to_none`` as the run asks). Every time and byte count is per
optimizer step; the peak counts the optimizer step too.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..backend import Backend
from ..memory import report, saved_activation_bytes, saved_bytes_per_layer
from ..profile import copy_bandwidth
from ..trace import Timeline
from .bench_models import BenchShape, training_data
from .output import Progress

__all__ = ["GiB", "MiB", "LR", "OPTIMIZERS", "Inputs", "Built", "prepare", "measure",
           "timed_steps", "memory_breakdown"]

GiB, MiB = 1 << 30, 1 << 20
#: the optimizer's learning rate: small, so that the weights stay near their init over a run
LR = 1e-5
#: the optimizers a run may step with, made (as a training script makes them) before any
#: configuration is built: AdamW's two moments appear at its first step
OPTIMIZERS: dict[str, type[torch.optim.SGD] | type[torch.optim.AdamW]] = {
    "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


#: a configuration's variants follow its name: ``graph_resident@keep@acc4`` runs
#: graph_resident with ``zero_grad(set_to_none=False)`` over four microbatches a step, in
#: the same run and table as graph_resident itself (its report's ``vs_base`` compares them)
VARIANT_SEP = "@"


def base_config(name: str) -> str:
    """The configuration a name runs, its variant aside (``graph@keep`` -> ``graph``)."""
    return name.split(VARIANT_SEP)[0]


@dataclass(eq=False)
class Inputs:
    """What every configuration of one bench run shares: the layers, the data, the
    optimizer, the copy ceiling, the step counts and the progress bar."""

    b: Backend
    shape: BenchShape
    steps: int
    warmup: int
    layers: list[torch.nn.Module]
    params: list[torch.nn.Parameter]
    x: torch.Tensor
    gy: torch.Tensor
    saved: int  #: what one forward saves for its backward
    saved_per_layer: list[int]  #: the same, layer by layer
    ceiling: dict[str, float]
    ceil_gbps: float
    bar: Progress
    opt: torch.optim.Optimizer
    accumulate: int = 1  #: microbatches per optimizer step
    set_to_none: bool = True  #: ``zero_grad``'s
    layers_per_graph: int | None = None  #: GraphedLayers' (None: it joins small layers)

    def zero_grads(self) -> None:
        """The optimizer's ``zero_grad``; the stack's input gradient is dropped (in a model
        it would flow on to the embedding)."""
        self.opt.zero_grad(set_to_none=self.set_to_none)
        self.x.grad = None


@dataclass(eq=False)
class Built:
    """One configuration, built: the graphed stack (None for the eager ones), the forward
    of one microbatch, the modules that forward calls in turn (for memory probes) and what
    undoes the configuration."""

    stack: Any
    fwd: Callable[[], torch.Tensor]
    modules: Sequence[torch.nn.Module]
    tear_down: Callable[[], None] = field(default=lambda: None)


def prepare(b: Backend, shape: BenchShape, steps: int, warmup: int, n_configs: int,
            progress: bool, rounds: int = 1, accumulate: int = 1,
            set_to_none: bool = True, optimizer: str = "sgd") -> Inputs:
    """The layers, data and optimizer every configuration runs on, and the copy ceiling."""
    layers, x, gy = training_data(shape, b.device)
    params = [p for m in layers for p in m.parameters()]
    saved = saved_activation_bytes(layers, x)
    per_layer = saved_bytes_per_layer(layers, x)
    copy_n = min(GiB, max(MiB, saved // shape.layers))
    ceiling = copy_bandwidth(b, copy_n)
    ceil_gbps = min(ceiling["d2h_gbps"], ceiling["h2d_gbps"])
    bar = Progress(n_configs * (warmup + steps + 2 + (rounds - 1) * (warmup + steps)), progress)
    opt = OPTIMIZERS[optimizer](params, lr=LR)
    return Inputs(b, shape, steps, warmup, layers, params, x, gy, saved, per_layer, ceiling, ceil_gbps, bar,
                  opt, accumulate, set_to_none)


def train_step(r: Inputs, built: Built) -> None:
    """One optimizer step: the microbatches' forward and backward, the optimizer's step,
    ``zero_grad``."""
    for _ in range(r.accumulate):
        y = built.fwd()
        y.backward(r.gy)
        del y
    r.opt.step()
    r.zero_grads()


#: what the engine moved, or spared moving, per step (its stats of these names)
_MOVED = ("offloaded_bytes", "restored_bytes", "held_bytes", "kept_in_place_bytes")


def timed_steps(r: Inputs, name: str, built: Built) -> tuple[float, dict[str, int], float]:
    """Warm-up steps, then timed ones: the median step in ms; per step, the bytes copied
    out (``offloaded_bytes``) and back (``restored_bytes``), those held in their slot
    until their backward and so never copied (``held_bytes``), and those copied out whose
    slot still held them at their backward, so not copied back (``kept_in_place_bytes``);
    the VMM driver calls per layer and step."""
    b, bar, stack = r.b, r.bar, built.stack
    for i in range(r.warmup):
        train_step(r, built)
        bar.update(f"{name}: warm-up {i + 1}/{r.warmup}")
    b.synchronize()
    times = []
    stats = stack.engine.stats if stack is not None else Counter()
    before = {k: stats[k] for k in _MOVED}
    calls0 = b.driver_calls()
    for i in range(r.steps):
        t0 = time.perf_counter()
        train_step(r, built)
        b.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        bar.update(f"{name}: step {i + 1}/{r.steps}")
    calls = (b.driver_calls() - calls0) / (r.steps * r.shape.layers)
    return statistics.median(times), {k: (stats[k] - before[k]) // r.steps for k in _MOVED}, calls


def _timeline_step(r: Inputs, built: Built) -> tuple[Timeline, dict[str, float]]:
    """One step with a timeline: the timeline and the phases' times in ms (``fwd_ms``,
    ``bwd_ms``: summed over the microbatches; ``opt_ms``: SGD and ``zero_grad``)."""
    b, stack = r.b, built.stack
    tl = Timeline(b)
    if stack is not None:
        stack.timeline = tl
    b.synchronize()
    tl.start()
    for _ in range(r.accumulate):
        with tl.span("phase", "forward"):
            y = built.fwd()
        with tl.span("phase", "backward"):
            y.backward(r.gy)
        del y
    with tl.span("phase", "optimizer"):
        r.opt.step()
        r.zero_grads()
    b.synchronize()
    if stack is not None:
        stack.engine.wait_idle()
        stack.timeline = None
    spans = [s for s in tl.spans() if s.track == "phase"]
    phases = {f"{k}_ms": sum(s.dur_ms for s in spans if s.name == n)
              for k, n in (("fwd", "forward"), ("bwd", "backward"), ("opt", "optimizer"))}
    return tl, phases


def measure(r: Inputs, name: str, built: Built, timings: dict[str, dict[str, float]],
            saved_on_device: int) -> tuple[dict[str, Any], Timeline, list[tuple[str, int]]]:
    """Time, trace and measure one configuration: its report entry, its timeline and its
    memory curve; records its step and phase times in ``timings``.

    Args:
        saved_on_device: the activation bytes it holds at the forward/backward boundary
            outside graphslot's pages (the offload engine counts those).
    """
    bar, stack = r.bar, built.stack
    step_ms, moved, calls = timed_steps(r, name, built)
    tl, phases = _timeline_step(r, built)
    timings[name] = {"step_ms": step_ms, **phases}
    bar.update(f"{name}: timeline")

    # One step for memory: peaks from a known baseline, and the boundary.
    curve: list[tuple[str, int]] = []
    breakdown: dict[str, int | None] = {}
    parts, context, boundary = _memory_step(r, built, saved_on_device, curve, breakdown)
    bar.update(f"{name}: memory")

    d2h = h2d = None
    if stack is not None:
        ms, n = tl.busy("d2h")
        d2h = n / ms / 1e6 if ms > 0 and n else None
        ms, n = tl.busy("h2d")
        h2d = n / ms / 1e6 if ms > 0 and n else None
    elif base_config(name) == "save_on_cpu":
        moved["offloaded_bytes"] = moved["restored_bytes"] = r.saved * r.accumulate
    result = {
        "step_ms": step_ms, **phases,
        "peak_device_bytes": None if parts is None else sum(parts.values()), "peak_parts": parts,
        "context_bytes": context, "activation_bytes_at_boundary": boundary,
        **moved, "d2h_gbps": d2h, "h2d_gbps": h2d,
        "memory_breakdown": breakdown, "driver_calls_per_layer_step": calls,
        "memory_curve": [[label, n] for label, n in curve], "pid": os.getpid(),
    }
    return result, tl, curve


def _memory_step(r: Inputs, built: Built, saved_on_device: int, curve: list[tuple[str, int]],
                 breakdown: dict[str, int | None]
                 ) -> tuple[dict[str, int] | None, int | None, int]:
    """One step with memory probes after every layer of the first microbatch; returns (the
    peak's two parts, context, boundary bytes) and fills ``curve`` (``start``, ``F<i>``
    after layer i's forward, ``B<i>`` after its backward, ``end`` after the backward,
    ``opt`` after the optimizer step) and ``breakdown`` (:func:`memory_breakdown` after
    the backward). The parts are None where the backend's allocator keeps no peak."""
    b, stack, modules = r.b, built.stack, built.modules

    def in_use() -> int:
        # Bytes held, not reserved: what the allocator hands out plus graphslot's pages
        # (physical: remap's unmapped spare pages count until they are released).
        # The host allocator keeps no figure, so the cpu backend shows the driver's.
        a = b.allocator_stats()["allocated_bytes"]
        if a is None:
            free, total = b.mem_info()
            return total - free
        return a + b.ledger.allocated_bytes

    def probe(label: str) -> None:
        b.synchronize()
        curve.append((label, in_use()))

    # Start from what this configuration holds, not what earlier ones left cached.
    gc.collect()
    b.synchronize()
    b.empty_cache()
    hooks: list[Any] = []

    def unhook() -> None:
        if stack is not None:
            stack.probe = None
        for h in hooks:
            h.remove()
        hooks.clear()

    if stack is not None:
        stack.probe = probe
    else:
        n = len(modules)

        def after_forward(i: int, out: torch.Tensor) -> None:
            probe(f"F{i}")
            if out.requires_grad and i + 1 < n:
                # The gradient of layer i's output exists once layer i+1's backward ran.
                out.register_hook(lambda _g, i=i: probe(f"B{i + 1}"))

        for i, m in enumerate(modules):
            hooks.append(m.register_forward_hook(lambda _m, _a, out, i=i: after_forward(i, out)))

    b.synchronize()
    b.allocator_stats(reset_peak=True)
    b.ledger.reset_peak()
    # (region pools' segments: counted by the allocator and, as pages, by the ledger; no
    # capture runs in a step, so they stay as they are now)
    regions = b.region_reserved_bytes()
    before = report(b, samples=3)
    curve.append(("start", in_use()))
    boundary = saved_on_device
    try:
        for k in range(r.accumulate):
            y = built.fwd()
            if k == 0:
                b.synchronize()
                if stack is not None and stack.mode.value != "off":
                    stack.engine.wait_idle()
                    boundary += stack.engine.resident_device_bytes
            y.backward(r.gy)
            del y
            unhook()  # the curve follows the first microbatch
        b.synchronize()
        if stack is not None:
            stack.engine.wait_idle()
        curve.append(("end", in_use()))
        breakdown.update(memory_breakdown(b, r.layers, stack))
        r.opt.step()
        probe("opt")
    finally:
        unhook()
    r.zero_grads()
    b.synchronize()
    stats = b.allocator_stats()
    if stats["peak_reserved_bytes"] is None or before.allocator_reserved_bytes is None:
        return None, None, boundary  # this backend's allocator keeps no peak
    # What this configuration holds at most: the allocator's peak reserved bytes (outside
    # graphslot's regions) plus graphslot's peak physical pages (each peak on its own, so
    # never less than the real peak). Device memory in use outside both (this process's
    # context, library handles and kernels loaded so far, and whatever other processes
    # hold on the device) is reported apart: it grows with what ran before, here or
    # elsewhere.
    parts = {"allocator_reserved_bytes": stats["peak_reserved_bytes"] - regions,
             "graphslot_pages_bytes": b.ledger.peak_allocated_bytes}
    context = max(0, before.driver_used_bytes - before.allocator_reserved_bytes
                  - before.allocated_bytes + regions)
    return parts, context, boundary


def memory_breakdown(b: Backend, layers: Sequence[torch.nn.Module], stack: Any = None) -> dict[str, int | None]:
    """What the device holds now, by owner, in bytes (each byte counted once).

    ``weights_bytes``: the layers' parameters. ``grad_bytes``: their ``.grad`` tensors,
    wherever they live (a graph's gradient buffer included). ``graph_pool_bytes``: graph
    private pools as the allocator reserves them, less the ``.grad`` bytes inside them.
    ``slot_bytes``: device pages graphslot has mapped (slots, banks). ``host_pinned_bytes``:
    pinned host buffers graphslot's offload engine holds (host memory, not device).
    ``other_bytes``: the rest of what the allocator reserves (inputs, caches, fragments).
    ``None`` where the backend's allocator cannot see a figure.
    """
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for m in layers for p in m.parameters()}
    grads: dict[int, int] = {}
    for m in layers:
        for p in m.parameters():
            if p.grad is not None:
                storage = p.grad.untyped_storage()
                grads[storage.data_ptr()] = storage.nbytes()
    stats = b.allocator_stats()
    pool = stats["graph_pool_reserved_bytes"]
    segments = b.graph_pool_segments()
    # (region pools' segments, and gradient buffers in them, are graphslot's pages:
    # counted in slot_bytes)
    regions = in_region = 0
    if segments is not None:
        regions = sum(n for a, n in segments if b.ledger.find(a, n) is not None)
        segments = [(a, n) for a, n in segments if b.ledger.find(a, n) is None]
        in_region = sum(n for ptr, n in grads.items() if b.ledger.find(ptr, n) is not None)
        in_pool = sum(n for ptr, n in grads.items() if any(a <= ptr < a + size for a, size in segments))
    elif stack is not None:  # the stack knows its gradient buffers
        bufs = {buf.data_ptr() for buf in stack.gradient_buffers}
        in_pool = sum(n for ptr, n in grads.items() if ptr in bufs)
    else:
        in_pool = 0
    if pool is None and stack is not None:
        pool = stack.pool_bytes or 0
    elif pool is not None:
        pool -= regions
    slot = b.ledger.mapped_bytes
    host = stack.engine.host_bytes if stack is not None else 0
    graph_pool = None if pool is None else max(0, pool - in_pool)
    reserved = stats["reserved_bytes"]
    if reserved is not None:
        reserved -= regions
    else:  # a host "device": what the process holds, less graphslot's pages
        fp = b.footprint_bytes()
        reserved = None if fp is None else fp - slot
    weights, grad = sum(params.values()), sum(grads.values())
    other = None
    if reserved is not None and graph_pool is not None:
        outside = reserved - graph_pool - in_pool  # the ordinary allocator's share
        other = max(0, outside - weights - (grad - in_pool - in_region))
    return {"weights_bytes": weights, "grad_bytes": grad, "graph_pool_bytes": graph_pool,
            "slot_bytes": slot, "host_pinned_bytes": host, "other_bytes": other}
