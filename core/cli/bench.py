"""``graphslot bench``: memory at speed, side by side, on a GPT-like layer stack.

In one process, on the same layers and data, it runs

============== ==============================================================
eager          plain autograd
save_on_cpu    eager with ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
torch_graphed  ``torch.cuda.make_graphed_callables`` over the same layers (the peer)
graph          graphed layers, no offload (``GraphedLayers(mode="off")``)
graph_resident graphed, every layer offloaded, two resident banks
graph_remap    graphed, every layer offloaded, pages released between phases
graph_auto     graphed, resident, offloading as many layers as compute can hide
============== ==============================================================

and reports for each: median step time, peak device memory (the allocator's peak reserved
bytes plus graphslot's peak physical pages; ``context_bytes``, the device memory in use
outside both when the step began, apart: the CUDA context, library handles and loaded
kernels, and whatever other processes hold on the device, so it depends on what ran
before), activation
bytes left on the device at the forward/backward boundary, bytes offloaded, achieved
copy bandwidth, exposed copy time and efficiency against the ideal bound
(per phase, the larger of the compute time and the bytes it copies that way over the copy
ceiling; "eff all": against the same bound for every saved activation out and back, the
bar for every configuration that offloads),
``memory_breakdown``: what the device holds after the step's backward, by owner
(see :func:`memory_breakdown`), ``warnings``: what the configuration warned while it
was built and run, and ``vs``: its step and peak as ratios to each peer that ran
(:data:`PEERS`; with rounds, also round by round, see :func:`_peer_ratios`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch

from ..backend import Backend
from ..errors import UsageError
from ..memory import report, saved_activation_bytes
from ..sizes import format_bytes
from ..trace import Timeline
from .output import Progress, missing, table
from .toy import Block, GPTConfig

__all__ = ["BenchShape", "CONFIGS", "run_bench", "copy_bandwidth", "auto_offload_layers",
           "memory_breakdown", "add_parser"]

CONFIGS = ("eager", "save_on_cpu", "torch_graphed", "graph", "graph_resident", "graph_remap",
           "graph_auto")
GiB, MiB = 1 << 30, 1 << 20

#: what users would pick instead, in the order the table compares with the first that ran:
#: each configuration's report says its step and peak as a ratio to each of them (``vs``)
PEERS = ("torch_graphed", "eager", "save_on_cpu")


class BenchShape(GPTConfig):
    """The bench's layer stack: a :class:`~graphslot.cli.toy.GPTConfig` (the layers run
    in its ``dtype``; ``vocab`` is unused), made from a preset by :meth:`preset`."""

    #: Preset name -> the fields that differ from GPTConfig's defaults.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "default": dict(hidden=4096, heads=32, ffn=16384, seq=4096, batch=1, layers=8,
                        dtype=torch.bfloat16, attention="sdpa"),
        # small layers, many of them: launch-bound, where graphs pay
        "launch": dict(hidden=256, heads=4, ffn=1024, seq=128, batch=4, layers=32,
                       dtype=torch.bfloat16, attention="sdpa"),
        # CI size
        "tiny": dict(hidden=64, heads=4, ffn=128, seq=32, batch=2, layers=3,
                     dtype=torch.float32, attention="math"),
    }

    @staticmethod
    def preset(name: str) -> BenchShape:
        """The shape of preset ``name``.

        Raises:
            ValueError: ``name`` is not default, launch or tiny.
        """
        if name not in BenchShape.PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose default, launch or tiny")
        return BenchShape(**BenchShape.PRESETS[name])

    def as_dict(self) -> dict[str, Any]:
        """The shape as the report gives it: every field but ``vocab``, the dtype by name."""
        d = {k: v for k, v in asdict(self).items() if k != "vocab"}
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d


def copy_bandwidth(b: Backend, nbytes: int, reps: int = 5) -> dict[str, float]:
    """GB/s device->pinned host, pinned host->device, and both directions at once (total)."""
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=b.device).fill_(1)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=b.device)
    host_a, host_b = b.pinned_empty(nbytes), b.pinned_empty(nbytes)
    host_b.fill_(2)
    s1, s2 = b.new_stream(), b.new_stream()
    b.synchronize()

    def one_way(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(reps + 1):
            with b.timed(s1) as t:
                b.copy_async(dst, src, s1)
            times.append(t["device_ms"])
        return nbytes / (statistics.median(times[1:]) / 1e3) / 1e9

    d2h = one_way(host_a, dev_a)
    h2d = one_way(dev_b, host_b)
    both = []
    for _ in range(reps + 1):
        b.synchronize()
        t0 = time.perf_counter()
        b.copy_async(host_a, dev_a, s1)
        b.copy_async(dev_b, host_b, s2)
        b.synchronize()
        both.append(time.perf_counter() - t0)
    return {"d2h_gbps": d2h, "h2d_gbps": h2d,
            "both_total_gbps": 2 * nbytes / statistics.median(both[1:]) / 1e9}


def auto_offload_layers(layers: int, layer_bytes: int, fwd_ms: float, bwd_ms: float,
                        gbps: float, margin: float = 0.85) -> list[int]:
    """The layers to offload so that their copies hide under compute.

    A layer's copy out may run under the rest of the forward and the start of the
    backward, and its copy back under the backward graphs before it (the adapter's
    look-ahead reaches from one offloaded layer to the next), so ``n`` layers fit when
    ``2 * n`` layer copies take at most ``margin`` of the step's compute. The chosen
    layers are spread evenly, which keeps a resident bank's two occupants, and two
    consecutive reloads, layers of compute apart, while keeping them early in the forward
    (their copies out start early) and late in the backward (their reloads are needed
    last). One layer always stays on the device: the last forward layer's copy could not
    hide.
    """
    if layer_bytes <= 0 or gbps <= 0 or layers < 2:
        return []
    copy_ms = layer_bytes / (gbps * 1e6)
    n = min(layers - 1, math.floor(margin * (fwd_ms + bwd_ms) / (2 * copy_ms)))
    if n <= 0:
        return []
    if 2 * (n - 1) <= layers - 2:
        return list(range(0, 2 * n, 2))  # every other layer from the first
    return sorted({min(layers - 2, round(i * (layers - 1) / n)) for i in range(n)})


def _forward(layers: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    h = x
    for m in layers:
        h = m(h)
    return h


def _torch_graphed(b: Backend, layers: Sequence[torch.nn.Module], x: torch.Tensor) -> None:
    """The framework's graphed callables (``torch.cuda.make_graphed_callables``) over the
    stack, as PyTorch documents for a sequence of modules: one sample input per layer."""
    samples = tuple((torch.empty_like(x).requires_grad_(i > 0 or x.requires_grad),)
                    for i in range(len(layers)))
    b.make_graphed_callables(tuple(layers), samples)


def _ungraph(layers: Sequence[torch.nn.Module]) -> None:
    """Undo :func:`_torch_graphed`: it replaced each module's ``forward``."""
    for m in layers:
        if "forward" in vars(m):
            del m.forward


def _forward_saving_on_cpu(layers: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return _forward(layers, x)


@dataclass(eq=False)
class _Inputs:
    """What every configuration of one bench run shares: the layers, the data, the copy
    ceiling, the step counts and the progress bar."""

    b: Backend
    shape: BenchShape
    steps: int
    warmup: int
    layers: list[Block]
    params: list[torch.nn.Parameter]
    x: torch.Tensor
    gy: torch.Tensor
    saved: int
    layer_bytes: int
    ceiling: dict[str, float]
    ceil_gbps: float
    bar: Progress
    layers_per_graph: int | None = None  #: GraphedLayers' (None: it joins small layers)

    def zero_grads(self) -> None:
        self.x.grad = None
        for p in self.params:
            p.grad = None


def run_bench(b: Backend, shape: BenchShape, *, steps: int = 10, warmup: int = 3,
              configs: tuple[str, ...] = CONFIGS, trace_path: str | None = None,
              plot_path: str | None = None, progress: bool = True,
              rounds: int = 1, isolate: bool = False,
              layers_per_graph: int | None = None) -> dict[str, Any]:
    """Run the comparison on backend ``b`` (see the module docstring).

    Args:
        b: the backend.
        shape: the layer stack.
        steps: timed steps per configuration (after ``warmup`` untimed ones).
        warmup: untimed steps first.
        configs: the configurations, from :data:`CONFIGS`, in order.
        trace_path: where to write a Chrome/Perfetto trace of one offloading step.
        plot_path: where to write a PNG of device memory over one step (needs matplotlib).
        progress: show a progress bar on stderr (needs tqdm, the ``cli`` extra).
        rounds: time every configuration this many times, the configurations taking turns
            (built and timed again in each later round), so that a slow spell of the machine
            falls on all of them alike; ``step_ms`` is the median of the rounds' medians,
            ``step_ms_rounds`` lists them. Memory, phases and the trace come from round one.
        isolate: run each configuration (in each round) in a process of its own, so that
            none is charged for what an earlier one left in the process (libraries'
            per-stream state, the allocator's segments); this process only gathers the
            reports. graph_auto's process runs graph first for its timings.

    Returns:
        The JSON-able report: ``backend``, ``device``, ``shape``, ``copy_ceiling_gbps``,
        ``configs`` (per configuration its figures, or a ``reason`` it was skipped), ...

    Raises:
        UsageError: ``progress`` and tqdm is not installed.
    """
    if rounds < 1:
        raise UsageError(f"rounds must be at least 1, got {rounds}")
    if isolate:
        return _run_isolated(b, shape, steps, warmup, configs, trace_path, plot_path, progress,
                             rounds, layers_per_graph)
    r = _prepare(b, shape, steps, warmup, len(configs), progress, rounds)
    r.layers_per_graph = layers_per_graph
    out: dict[str, Any] = {
        "backend": b.name, "device": b.info()["device"], "shape": shape.as_dict(),
        "layers_per_graph": layers_per_graph or "auto",
        "steps": steps, "rounds": rounds, "copy_ceiling_gbps": r.ceil_gbps, "copy": r.ceiling,
        "saved_activation_bytes": r.saved, "configs": {},
    }
    bar = r.bar
    timings: dict[str, dict[str, float]] = {}
    traces: dict[str, Timeline] = {}
    curves: dict[str, list[tuple[str, int]]] = {}

    for name in configs:
        reason = _unsupported(b, name)
        if reason:
            out["configs"][name] = {"reason": reason}
            bar.skip(warmup + steps + 2)
            continue
        seen: list[str] = []
        with _recording_warnings(seen):
            built = _build(r, name, timings)
            if isinstance(built, str):
                out["configs"][name] = {"reason": built}
                continue
            stack, fwd, kw = built
            out["configs"][name], traces[name], curves[name] = _measure(r, name, stack, fwd, timings)
            if name == "graph_auto":
                out["configs"][name]["offload_layers"] = kw["offload_layers"]
            if stack is not None:
                out["configs"][name]["graphs"] = len(stack.graph_layers)
            _tear_down(r, name, stack)
        out["configs"][name]["warnings"] = seen
        del stack, fwd, built
        gc.collect()
        b.empty_cache()
        if name == "save_on_cpu" and b.name != "cpu":
            out["configs"][name]["d2h_gbps"] = out["configs"][name]["h2d_gbps"] = None
            out["configs"][name]["copy_note"] = "copies issued by torch inside autograd; not timed"
    for _ in range(rounds - 1):
        _another_round(r, out["configs"], timings)
    _median_of_rounds(out["configs"], timings)
    bar.close()
    _finish(out, r, timings, traces, curves, trace_path, plot_path)
    _peer_ratios(out["configs"], rounds)
    return out


#: the configurations whose timeline ``--trace`` writes, the first of them that ran
_TRACED = ("graph_auto", "graph_resident", "graph_remap")


def _phases(c: dict[str, Any]) -> dict[str, float]:
    """A configuration's step and phase times, as :func:`_derive` reads them."""
    return {k: c[k] for k in ("step_ms", "fwd_ms", "bwd_ms")}


def _child_argv(shape: BenchShape, steps: int, warmup: int, configs: str,
                trace_path: str | None, layers_per_graph: int | None = None) -> list[str]:
    """The command line of a bench process that runs ``configs`` on ``shape``."""
    argv = [sys.executable, "-m", "graphslot.cli", "bench", "--json", "--quiet",
            "--configs", configs, "--steps", str(steps), "--warmup", str(warmup),
            "--layers-per-graph", str(layers_per_graph or "auto")]
    for k, v in shape.as_dict().items():
        argv += [f"--{k}", str(v)]
    if trace_path:
        argv += ["--trace", trace_path]
    return argv


def _run_child(b: Backend, argv: list[str]) -> dict[str, Any]:
    """Run one bench process on ``b``'s backend; its report, or why it could not run."""
    import subprocess

    env = {**os.environ, "GRAPHSLOT_BACKEND": b.name}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"reason": f"its process failed: {why}"}
    # The report is the last thing printed (indented JSON: it begins with a line "{");
    # a library may have printed before it.
    start = done.stdout.rfind("\n{\n") + 1 if not done.stdout.startswith("{\n") else 0
    try:
        out, _ = json.JSONDecoder().raw_decode(done.stdout, start)
    except ValueError:
        tail = (done.stderr.strip().splitlines() or ["nothing on stderr"])[-1]
        return {"reason": f"its process printed no report ({tail})"}
    return dict(out)


def _run_isolated(b: Backend, shape: BenchShape, steps: int, warmup: int,
                  configs: tuple[str, ...], trace_path: str | None, plot_path: str | None,
                  progress: bool, rounds: int, layers_per_graph: int | None = None
                  ) -> dict[str, Any]:
    """:func:`run_bench` with every configuration in a process of its own (``isolate``).

    Later rounds run again only what ran in round one; graph_auto picks its layers from
    graph's timing in its own process, so a later round counts only if it picked the same."""
    index = getattr(b.device, "index", None)
    if index not in (None, 0):
        raise UsageError(f"isolate starts its processes on the backend's default device; "
                         f"{b.device} is not it (make it device 0, e.g. with CUDA_VISIBLE_DEVICES)")
    bar = Progress(len(configs) * rounds, progress)
    out: dict[str, Any] = {"backend": b.name, "device": b.info()["device"], "shape": shape.as_dict(),
                           "layers_per_graph": layers_per_graph or "auto",
                           "steps": steps, "rounds": rounds, "isolated": True, "configs": {}}
    trace_for = next((n for n in _TRACED if n in configs), None)
    ceilings: list[dict[str, Any]] = []
    graph_for_auto: dict[str, Any] | None = None  # graph's timing from graph_auto's process
    for rnd in range(rounds):
        for name in configs:
            first = out["configs"].get(name)
            reason = _unsupported(b, name) or (first or {}).get("reason")
            if reason:
                out["configs"].setdefault(name, {"reason": reason})
                bar.update(f"{name}: skipped")
                continue
            bar.update(f"{name}: round {rnd + 1}/{rounds}, own process", advance=False)
            run = "graph,graph_auto" if name == "graph_auto" else name
            child = _run_child(b, _child_argv(shape, steps, warmup, run,
                                              trace_path if rnd == 0 and name == trace_for else None,
                                              layers_per_graph))
            c = child.get("configs", {}).get(name) if "reason" not in child else child
            if c is None:
                c = {"reason": "its process reported nothing for it"}
            bar.update(f"{name}: round {rnd + 1}/{rounds} done")
            if first is None:  # round one
                out["configs"][name] = c
                if "reason" not in c:
                    ceilings.append(child["copy"])
                    out.setdefault("saved_activation_bytes", child["saved_activation_bytes"])
                    if name == "graph_auto":
                        graph_for_auto = child["configs"]["graph"]
                    if name == trace_for and trace_path:
                        out["trace"] = {"config": name, "path": trace_path}
                continue
            if "reason" not in c and c.get("offload_layers") != first.get("offload_layers"):
                c = {"reason": f"picked offload layers {c['offload_layers']}, not round one's "
                               f"{first['offload_layers']}"}
            if "reason" in c:  # the round does not count; the report says why
                first.setdefault("rounds_not_counted", []).append(f"round {rnd + 1}: {c['reason']}")
            else:
                first.setdefault("step_ms_rounds", [first["step_ms"]]).append(c["step_ms"])
                first.setdefault("rounds_counted", [1]).append(rnd + 1)
    bar.close()
    _median_of_rounds(out["configs"])
    timings = {name: _phases(c) for name, c in out["configs"].items() if "reason" not in c}
    if graph_for_auto is not None and "graph" not in configs:  # graph_auto's own baseline
        timings["graph"] = _phases(graph_for_auto)
    out.setdefault("copy_ceiling_gbps", None)
    out.setdefault("saved_activation_bytes", None)
    if ceilings:  # each process measured the copy ceiling; the report takes their median
        out["copy"] = {k: statistics.median(c[k] for c in ceilings) for k in ceilings[0]}
        out["copy_ceiling_gbps"] = min(out["copy"]["d2h_gbps"], out["copy"]["h2d_gbps"])
        _derive(out, timings, out["copy_ceiling_gbps"])
    if plot_path:
        curves = {n: [(p[0], p[1]) for p in c.get("memory_curve", [])]
                  for n, c in out["configs"].items() if "reason" not in c}
        _plot(curves, plot_path, b.name)
        out["plot"] = plot_path
    _peer_ratios(out["configs"], rounds)
    return out


def _peer_ratios(results: dict[str, dict[str, Any]], rounds: int) -> None:
    """Each configuration's step and peak as ratios to every peer that ran (``vs``).

    With rounds, ``step_rounds`` pairs the rounds both counted (by round number): the
    configurations of one round ran one after the other, so a round's ratio leaves out a
    slow spell of the machine that lasts a round. It does not leave out what moves from
    one process to the next: on the H200's launch-bound shape both move by a third.
    """
    def by_round(c: dict[str, Any]) -> dict[int, float]:
        times = c.get("step_ms_rounds", [c["step_ms"]])
        return dict(zip(c.get("rounds_counted", range(1, len(times) + 1)), times))

    ran = {n: c for n, c in results.items() if "reason" not in c}
    for peer in PEERS:
        p = ran.get(peer)
        if p is None or not p["step_ms"] > 0:
            continue
        p_rounds = by_round(p)
        for name, c in ran.items():
            if name == peer:
                continue
            mine = by_round(c)
            paired = [mine[k] / p_rounds[k] for k in sorted(mine) if k in p_rounds and p_rounds[k] > 0]
            v: dict[str, Any] = {"step": c["step_ms"] / p["step_ms"]}
            if p.get("peak_device_bytes") and c.get("peak_device_bytes") is not None:
                v["peak"] = c["peak_device_bytes"] / p["peak_device_bytes"]
            if rounds > 1:
                v["step_rounds"] = paired
                v["step_median_round"] = statistics.median(paired) if paired else None
            c.setdefault("vs", {})[peer] = v


def _median_of_rounds(results: dict[str, dict[str, Any]],
                      timings: dict[str, dict[str, float]] | None = None) -> None:
    """Each configuration timed in several rounds takes the median of them as its step (in
    ``timings`` too, where it has an entry)."""
    for name, c in results.items():
        if "step_ms_rounds" in c:
            c["step_ms"] = statistics.median(c["step_ms_rounds"])
            if timings is not None and name in timings:
                timings[name]["step_ms"] = c["step_ms"]


def _another_round(r: _Inputs, results: dict[str, dict[str, Any]],
                   timings: dict[str, dict[str, float]]) -> None:
    """Build and time every configuration that ran once more, in the same order; append
    each median step to its ``step_ms_rounds``."""
    for name, c in results.items():
        if "reason" in c:
            r.bar.skip(r.warmup + r.steps)
            continue
        c.setdefault("step_ms_rounds", [c["step_ms"]])
        with warnings.catch_warnings():  # round one reported them
            warnings.simplefilter("ignore")
            built = _build(r, name, timings)
            assert not isinstance(built, str)  # it was built in round one
            stack, fwd, _kw = built
            step_ms, _, _ = _timed_steps(r, name, stack, fwd)
            c["step_ms_rounds"].append(step_ms)
            _tear_down(r, name, stack)
        del stack, fwd, built
        gc.collect()
        r.b.empty_cache()


@contextlib.contextmanager
def _recording_warnings(into: list[str]) -> Iterator[None]:
    """Collect the warnings one configuration raises (each message once, first line), so
    the report says which configuration raised what. Warnings that torch raises once per
    process show under the first configuration that triggers them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                msg = f"{w.category.__name__}: {str(w.message).strip().splitlines()[0]}"
                if msg not in into:
                    into.append(msg)


def _prepare(b: Backend, shape: BenchShape, steps: int, warmup: int, n_configs: int,
             progress: bool, rounds: int = 1) -> _Inputs:
    """The layers and data every configuration runs on, and the copy ceiling."""
    dtype = shape.dtype
    torch.manual_seed(0)
    layers = [Block(shape).to(device=b.device, dtype=dtype) for _ in range(shape.layers)]
    params = [p for m in layers for p in m.parameters()]
    g = torch.Generator().manual_seed(0)  # host generator: the same data on every backend
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=g).to(b.device, dtype)
    x.requires_grad_()
    gy = torch.randn(x.shape, generator=g).to(b.device, dtype)
    saved = saved_activation_bytes(layers, x)
    layer_bytes = saved // shape.layers
    copy_n = min(GiB, max(MiB, layer_bytes))
    ceiling = copy_bandwidth(b, copy_n)
    ceil_gbps = min(ceiling["d2h_gbps"], ceiling["h2d_gbps"])
    bar = Progress(n_configs * (warmup + steps + 2 + (rounds - 1) * (warmup + steps)), progress)
    return _Inputs(b, shape, steps, warmup, layers, params, x, gy, saved, layer_bytes,
                   ceiling, ceil_gbps, bar)


def _build(r: _Inputs, name: str, timings: dict[str, dict[str, float]]
           ) -> tuple[Any, Callable[[], torch.Tensor], dict[str, Any]] | str:
    """Configuration ``name``'s graphed stack (``None`` for the eager ones), its forward and
    the stack's keyword arguments; or why it cannot run yet."""
    from graphslot.adapters.torch import GraphedLayers

    b, layers, x, bar = r.b, r.layers, r.x, r.bar
    stack: Any = None
    fwd: Callable[[], torch.Tensor]
    kw: dict[str, Any] = {}
    if name == "torch_graphed":
        bar.update(f"{name}: capture", advance=False)
        _torch_graphed(b, layers, x)
        fwd = functools.partial(_forward, layers, x)
    elif name.startswith("graph"):
        mode = {"graph": "off", "graph_resident": "resident", "graph_remap": "remap",
                "graph_auto": "resident"}[name]
        if name == "graph_auto":
            t = timings.get("graph") or timings.get("eager")
            if t is None:
                return "needs the graph or eager config first to time compute"
            kw["offload_layers"] = auto_offload_layers(r.shape.layers, r.layer_bytes, t["fwd_ms"],
                                                       t["bwd_ms"], r.ceil_gbps)
        bar.update(f"{name}: capture", advance=False)
        stack = GraphedLayers(layers, x, mode=mode, backend=b, warmup_iters=2,
                              layers_per_graph=r.layers_per_graph, **kw)

        fwd = functools.partial(stack, x)
    elif name == "save_on_cpu":
        fwd = functools.partial(_forward_saving_on_cpu, layers, x)
    elif name == "eager":
        fwd = functools.partial(_forward, layers, x)
    else:
        raise AssertionError(name)
    return stack, fwd, kw


def _measure(r: _Inputs, name: str, stack: Any, fwd: Callable[[], torch.Tensor],
             timings: dict[str, dict[str, float]]
             ) -> tuple[dict[str, Any], Timeline, list[tuple[str, int]]]:
    """Time, trace and measure configuration ``name``: its report entry, its timeline and
    its memory curve; records its phase times in ``timings``."""
    b, gy, bar = r.b, r.gy, r.bar
    step_ms, moved, calls = _timed_steps(r, name, stack, fwd)
    tl, fwd_ms, bwd_ms = _timeline_step(r, stack, fwd)
    timings[name] = {"step_ms": step_ms, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms}
    bar.update(f"{name}: timeline")

    # One step for memory: peaks from a known baseline, and the boundary.
    curve: list[tuple[str, int]] = []
    breakdown: dict[str, int | None] = {}
    parts, context, boundary = _memory_step(b, fwd, gy, stack, r.layers,
                                  r.saved if name in ("eager", "torch_graphed", "graph") else 0,
                                  curve, r.zero_grads, breakdown)
    bar.update(f"{name}: memory")

    d2h = h2d = None
    if stack is not None:
        ms, n = tl.busy("d2h")
        d2h = n / ms / 1e6 if ms > 0 and n else None
        ms, n = tl.busy("h2d")
        h2d = n / ms / 1e6 if ms > 0 and n else None
    elif name == "save_on_cpu":
        moved["offloaded_bytes"] = moved["restored_bytes"] = r.saved
    result = {
        "step_ms": step_ms, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
        "peak_device_bytes": None if parts is None else sum(parts.values()), "peak_parts": parts,
        "context_bytes": context, "activation_bytes_at_boundary": boundary,
        **moved, "d2h_gbps": d2h, "h2d_gbps": h2d,
        "memory_breakdown": breakdown, "driver_calls_per_layer_step": calls,
        "memory_curve": [[label, n] for label, n in curve], "pid": os.getpid(),
    }
    return result, tl, curve


#: what the engine moved, or spared moving, per step (its stats of these names)
_MOVED = ("offloaded_bytes", "restored_bytes", "held_bytes", "kept_in_place_bytes")


def _timed_steps(r: _Inputs, name: str, stack: Any, fwd: Callable[[], torch.Tensor]
                 ) -> tuple[float, dict[str, int], float]:
    """Warm-up training steps (``fwd``, its backward, gradients dropped), then timed ones:
    the median step in ms; per step, the bytes copied out (``offloaded_bytes``) and back
    (``restored_bytes``), those held in their slot until their backward and so never
    copied (``held_bytes``), and those copied out whose slot still held them at their
    backward, so not copied back (``kept_in_place_bytes``); the VMM driver calls per layer
    and step."""
    b, bar, warmup, steps = r.b, r.bar, r.warmup, r.steps

    def step() -> None:
        y = fwd()
        y.backward(r.gy)
        r.zero_grads()

    for i in range(warmup):
        step()
        bar.update(f"{name}: warm-up {i + 1}/{warmup}")
    b.synchronize()
    times = []
    stats = stack.engine.stats if stack is not None else Counter()
    before = {k: stats[k] for k in _MOVED}
    calls0 = b.driver_calls()
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        b.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        bar.update(f"{name}: step {i + 1}/{steps}")
    step_ms = statistics.median(times)
    calls = (b.driver_calls() - calls0) / (steps * r.shape.layers)
    return step_ms, {k: (stats[k] - before[k]) // steps for k in _MOVED}, calls


def _timeline_step(r: _Inputs, stack: Any, fwd: Callable[[], torch.Tensor]
                   ) -> tuple[Timeline, float, float]:
    """One step with a timeline: the timeline and the forward and backward phase times."""
    b, gy = r.b, r.gy
    tl = Timeline(b)
    if stack is not None:
        stack.timeline = tl
    b.synchronize()
    tl.start()
    with tl.span("phase", "forward"):
        y = fwd()
    with tl.span("phase", "backward"):
        y.backward(gy)
    b.synchronize()
    if stack is not None:
        stack.engine.settle()
        stack.timeline = None
    r.zero_grads()
    del y
    spans = tl.spans()
    fwd_ms = sum(s.dur_ms for s in spans if s.track == "phase" and s.name == "forward")
    bwd_ms = sum(s.dur_ms for s in spans if s.track == "phase" and s.name == "backward")
    return tl, fwd_ms, bwd_ms


def _tear_down(r: _Inputs, name: str, stack: Any) -> None:
    """Undo configuration ``name``: close its stack, or restore the layers' forwards."""
    if stack is not None:
        stack.close()
    if name == "torch_graphed":
        _ungraph(r.layers)


def _finish(out: dict[str, Any], r: _Inputs, timings: dict[str, dict[str, float]],
            traces: dict[str, Timeline], curves: dict[str, list[tuple[str, int]]],
            trace_path: str | None, plot_path: str | None) -> None:
    """Derived figures, the trace of one offloading configuration and the memory plot."""
    _derive(out, timings, r.ceil_gbps)
    if trace_path:
        pick = next((n for n in _TRACED if n in traces), None)
        if pick:
            traces[pick].write(trace_path)
            out["trace"] = {"config": pick, "path": trace_path}
    if plot_path:
        _plot(curves, plot_path, r.b.name)
        out["plot"] = plot_path


def _unsupported(b: Backend, name: str) -> str | None:
    if name == "torch_graphed" and not b.has_graphed_callables:
        return (f"torch.cuda.make_graphed_callables needs CUDA; the {b.name} backend's framework "
                "has no graphed callables to compare with")
    if name == "save_on_cpu" and b.device.type == "cpu":
        return ("save_on_cpu moves device tensors to pinned host memory; on the cpu backend "
                "they already are on the host")
    if name not in CONFIGS:
        return f"unknown configuration {name!r}"
    return None


def _memory_step(b: Backend, fwd: Callable[[], torch.Tensor], gy: torch.Tensor, stack: Any,
                 layers: Sequence[torch.nn.Module], saved_on_device: int,
                 curve: list[tuple[str, int]],
                 zero_grads: Callable[[], None],
                 breakdown: dict[str, int | None]
                 ) -> tuple[dict[str, int] | None, int | None, int]:
    """One step with memory probes after every layer; returns (the peak's two parts,
    context, boundary bytes) and fills ``breakdown`` (:func:`memory_breakdown` after the
    backward). The parts are None where the backend's allocator keeps no peak."""

    def in_use() -> int:
        # Bytes held, not reserved: what the allocator hands out plus graphslot's pages
        # (physical: remap's unmapped spare pages count until they are released).
        # The host allocator keeps no figure, so the cpu backend shows the driver's.
        a = b.allocator_stats()["allocated_bytes"]
        if a is None:
            return b.mem_info()[1] - b.mem_info()[0]
        return a + b.ledger.allocated_bytes

    def probe(label: str) -> None:
        b.synchronize()
        curve.append((label, in_use()))

    # Start from what this configuration holds, not what earlier ones left cached.
    gc.collect()
    b.synchronize()
    b.empty_cache()
    hooks = []
    if stack is not None:
        stack.probe = probe
    else:
        n = len(layers)

        def after_forward(i: int, out: torch.Tensor) -> None:
            probe(f"F{i}")
            if out.requires_grad and i + 1 < n:
                # The gradient of layer i's output exists once layer i+1's backward ran.
                out.register_hook(lambda _g, i=i: probe(f"B{i + 1}"))

        for i, m in enumerate(layers):
            hooks.append(m.register_forward_hook(lambda _m, _a, out, i=i: after_forward(i, out)))

    b.synchronize()
    b.allocator_stats(reset_peak=True)
    b.ledger.reset_peak()
    before = report(b, samples=3)
    curve.append(("start", in_use()))
    try:
        y = fwd()
        b.synchronize()
        if stack is not None and stack.mode.value != "off":
            stack.engine.settle()
            boundary = stack.engine.resident_device_bytes
        else:  # eager, or graphs without offload: every saved activation is still on the device
            boundary = saved_on_device
        y.backward(gy)
        del y
        b.synchronize()
        if stack is not None:
            stack.engine.settle()
        curve.append(("end", in_use()))
        breakdown.update(memory_breakdown(b, layers, stack))
    finally:
        if stack is not None:
            stack.probe = None
        for h in hooks:
            h.remove()
    zero_grads()
    stats = b.allocator_stats()
    if stats["peak_reserved_bytes"] is None or before.allocator_reserved_bytes is None:
        return None, None, boundary  # this backend's allocator keeps no peak
    # What this configuration holds at most: the allocator's peak reserved bytes plus
    # graphslot's peak physical pages (each peak on its own, so never less than the real
    # peak). Device memory in use outside both (this process's context, library handles
    # and kernels loaded so far, and whatever other processes hold on the device) is
    # reported apart: it grows with what ran before, here or elsewhere.
    parts = {"allocator_reserved_bytes": stats["peak_reserved_bytes"],
             "graphslot_pages_bytes": b.ledger.peak_allocated_bytes}
    context = max(0, before.driver_used_bytes - before.allocator_reserved_bytes - before.allocated_bytes)
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
                st = p.grad.untyped_storage()
                grads[st.data_ptr()] = st.nbytes()
    stats = b.allocator_stats()
    pool = stats["graph_pool_reserved_bytes"]
    segments = b.graph_pool_segments()
    if segments is not None:
        in_pool = sum(n for ptr, n in grads.items() if any(a <= ptr < a + size for a, size in segments))
    else:  # (a GraphedLayers stack's gradient buffers live outside its graphs' pool)
        in_pool = 0
    if pool is None and stack is not None:
        pool = stack.pool_bytes or 0
    slot = b.ledger.mapped_bytes
    host = stack.engine.host_bytes if stack is not None else 0
    graph_pool = None if pool is None else max(0, pool - in_pool)
    reserved = stats["reserved_bytes"]
    if reserved is None:  # a host "device": what the process holds, less graphslot's pages
        fp = b.footprint_bytes()
        reserved = None if fp is None else fp - slot
    weights, grad = sum(params.values()), sum(grads.values())
    other = None
    if reserved is not None and graph_pool is not None:
        outside = reserved - graph_pool - in_pool  # the ordinary allocator's share
        other = max(0, outside - weights - (grad - in_pool))
    return {"weights_bytes": weights, "grad_bytes": grad, "graph_pool_bytes": graph_pool,
            "slot_bytes": slot, "host_pinned_bytes": host, "other_bytes": other}


def _derive(out: dict[str, Any], timings: dict[str, dict[str, float]], gbps: float) -> None:
    """Exposed copy time and efficiency against the ideal bound, per configuration."""
    runs = [timings[n] for n in ("graph", "eager") if n in timings]
    if not runs:
        return
    # The compute of a phase is the faster of eager and graphed (no offload) runs.
    fwd = min(t["fwd_ms"] for t in runs)
    bwd = min(t["bwd_ms"] for t in runs)
    base_step = (timings.get("graph") or timings["eager"])["step_ms"]

    def bound(out_bytes: int, back_bytes: int) -> float:
        def ms(n: int) -> float:
            return n / (gbps * 1e6) if gbps > 0 else 0.0
        return max(fwd, ms(out_bytes)) + max(bwd, ms(back_bytes))

    saved = out.get("saved_activation_bytes")
    for r in out["configs"].values():
        if "reason" in r:
            continue
        off = r["offloaded_bytes"]
        # What this configuration copies each way (resident copies fewer bytes back than
        # out when a bank still holds a layer at its backward)...
        ideal = bound(off, r.get("restored_bytes", off))
        r["ideal_ms"] = ideal
        # ...and the same bar for every configuration that offloads: every saved
        # activation out and back, as save_on_cpu moves them.
        r["offload_ideal_ms"] = bound(saved, saved) if off and saved else None
        r["efficiency"] = ideal / r["step_ms"] if r["step_ms"] > 0 else None
        r["exposed_copy_ms"] = max(0.0, r["step_ms"] - base_step) if off else 0.0


def _plot(curves: dict[str, list[tuple[str, int]]], path: str, backend: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"graphslot bench --plot needs matplotlib ({e}); "
                         "pip install 'graphslot[plot]'") from None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, pts in curves.items():
        if pts:  # absolute: the memory graphs hold before the step starts shows too
            ax.plot(range(len(pts)), [v / GiB for _, v in pts], marker=".", label=name)
    longest = max(curves.values(), key=len, default=[])
    ax.set_xticks(range(len(longest)), [p[0] for p in longest], rotation=90, fontsize=7)
    ax.set_xlabel("after each layer's forward (F) and backward (B)")
    ax.set_ylabel("device memory in use (GiB)")
    ax.set_title(f"graphslot bench: memory over one step ({backend}; allocator + graphslot pages)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(r: dict[str, Any]) -> str:
    head = [f"graphslot bench on {r['backend']} ({r['device']}); shape {r['shape']}"
            + ("; each configuration in a process of its own" if r.get("isolated") else "")]
    if r.get("copy_ceiling_gbps") is not None:
        head.append(f"copy ceiling {r['copy_ceiling_gbps']:.1f} GB/s; saved activations "
                    f"{format_bytes(r['saved_activation_bytes'])} per step")

    def f(v: float | None, fmt: str = ".1f") -> str:
        return "-" if v is None else format(v, fmt)

    ran = [n for n, c in r["configs"].items() if "reason" not in c]
    peer = next((p for p in PEERS if p in ran), None)

    def vs(name: str, c: dict[str, Any]) -> str:
        v = c.get("vs", {}).get(peer or "")
        if name == peer:
            return "1"
        if not v:
            return "-"
        spread = v.get("step_rounds") or []
        if len(spread) < 2:
            return f"{v['step']:.2f}"
        # the median of the paired rounds, inside their range (the two medians may come
        # from different rounds when a round did not count for one of them)
        return f"{v['step_median_round']:.2f} ({min(spread):.2f}-{max(spread):.2f})"

    rows, skipped = [], []
    for name, c in r["configs"].items():
        if "reason" in c:
            skipped.append(f"{name} skipped: {c['reason']}")
            continue
        rows.append([name, f(c["step_ms"], ".2f"), vs(name, c), format_bytes(c["peak_device_bytes"]),
                     format_bytes(c["activation_bytes_at_boundary"]), format_bytes(c["offloaded_bytes"]),
                     f(c["d2h_gbps"]), f(c["h2d_gbps"]), f(c.get("exposed_copy_ms")),
                     f(c.get("efficiency"), ".2f"),
                     f(c["offload_ideal_ms"] / c["step_ms"] if c.get("offload_ideal_ms") else None, ".2f")])
    body = table(rows, ("config", "step ms", f"step / {peer or 'peer'}", "peak dev", "act@bound",
                        "offload", "D2H GB/s", "H2D GB/s", "exposed", "eff", "eff all"),
                 "lrrrrrrrrrr")
    warned = [f"{name} warned: {w}" for name, c in r["configs"].items() for w in c.get("warnings", ())]
    return "\n".join([*head, body, *skipped, *warned])


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or any(k in text for k in (
        "out of memory", "can't allocate", "cannot allocate", "out_of_memory"))


def check_args(args: argparse.Namespace) -> tuple[BenchShape, tuple[str, ...]]:
    """The shape and configurations ``args`` ask for; ``ValueError`` naming a bad one."""
    shape = BenchShape.preset(args.preset)
    for k in ("hidden", "heads", "ffn", "seq", "batch", "layers", "dtype", "attention"):
        v = getattr(args, k)
        if v is not None:
            setattr(shape, k, getattr(torch, v) if k == "dtype" else v)
    for k in ("hidden", "heads", "ffn", "seq", "batch", "layers"):
        if getattr(shape, k) < 1:
            raise ValueError(f"--{k} must be at least 1, got {getattr(shape, k)}")
    if shape.hidden % shape.heads:
        raise ValueError(f"--hidden {shape.hidden} is not a multiple of --heads {shape.heads}")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    parse_layers_per_graph(args)
    configs = (tuple(c.strip() for c in args.configs.split(",") if c.strip())
               if args.configs is not None else CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"--configs: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                         f"choose from {','.join(CONFIGS)}")
    return shape, configs


def parse_layers_per_graph(args: argparse.Namespace) -> int | None:
    """``--layers-per-graph``: a positive integer, or None for ``auto``; ``ValueError`` else."""
    v = str(getattr(args, "layers_per_graph", "auto"))
    if v == "auto":
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"--layers-per-graph must be a positive integer or 'auto', got {v!r}")
    return int(v)


def main(args: argparse.Namespace) -> int:
    from ..selection import get_backend

    try:
        shape, configs = check_args(args)
    except ValueError as e:
        print(f"graphslot bench: error: {e}", file=sys.stderr)
        return 2
    for needed in ((None if args.json else missing("tabulate", "the bench table", "--json")),
                   (None if args.quiet else missing("tqdm", "the progress bar", "--quiet"))):
        if needed:  # before the run, not after it
            print(f"graphslot bench: error: {needed}", file=sys.stderr)
            return 1
    b = get_backend(args.backend)
    try:
        r = run_bench(b, shape, steps=args.steps, warmup=args.warmup, configs=configs,
                      trace_path=args.trace, plot_path=args.plot, progress=not args.quiet,
                      rounds=args.rounds, isolate=args.isolate,
                      layers_per_graph=parse_layers_per_graph(args))
    except (RuntimeError, MemoryError) as e:
        if not _is_oom(e):
            raise
        print(f"graphslot bench: error: shape {shape.as_dict()} does not fit on {b.device}: "
              f"{str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(_table(r))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="eager, save_on_cpu and graphed offload side by side")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of one step")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of device memory over one step")
    p.add_argument("--preset", default="default", choices=("default", "launch", "tiny"))
    for k, t in (("hidden", int), ("heads", int), ("ffn", int), ("seq", int), ("batch", int),
                 ("layers", int)):
        p.add_argument(f"--{k}", type=t, default=None)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--attention", default=None, choices=("sdpa", "math"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every configuration this many times, taking turns (median of rounds)")
    p.add_argument("--isolate", action="store_true",
                   help="run each configuration in a process of its own")
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--layers-per-graph", default="auto", metavar="N|auto",
                   help="layers per device graph of the graph configurations (auto: "
                        "GraphedLayers joins small layers)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)
