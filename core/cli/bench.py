"""``graphslot bench``: memory at speed, side by side, on a transformer layer stack.

In one process (or one per configuration, ``--isolate``), on the same layers and data, it
runs the configurations of :mod:`graphslot.cli.bench_configs` (the peers eager,
save_on_cpu, checkpoint, torch_graphed, torch_graphed_checkpoint; graphslot's graph,
graph_resident, graph_remap, graph_recompute, graph_recompute_parts, graph_auto; and one
planned configuration per ``--budgets`` size). Every step is a training step: ``--accumulate`` microbatches'
forward and backward, an optimizer step over the layers' parameters (SGD, or AdamW with
``--optimizer adamw``) and ``zero_grad()`` (``--zero-grad``); every time is per optimizer
step.

It reports for each: median step time, its phases, peak device memory (the allocator's
peak reserved bytes plus graphslot's peak physical pages; ``context_bytes``, the device
memory in use outside both when the step began, apart), activation bytes left on the
device at the forward/backward boundary, bytes offloaded, achieved copy bandwidth, exposed
copy time and efficiency against the ideal bound (per phase, the larger of the compute
time and the bytes it copies that way over the copy ceiling; "eff all": against the same
bound for every saved activation out and back), ``memory_breakdown`` (what the device
holds after the backward, by owner), ``warnings`` (what it warned while built and run)
and ``vs`` (its step and peak as ratios to each peer that ran). A planned configuration
adds its ``plan`` and the figures of :func:`~graphslot.cli.bench_report.planned_figures`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..backend import Backend
from ..budget import plan_letters
from ..errors import GraphslotError, UsageError
from ..trace import Timeline
from . import positive_int
from .bench_configs import (CONFIGS, PEERS, SWEEP_BUDGETS, base_config, budget_bytes,
                            budget_config, build, check_config, parse_size, plan_report,
                            saved_on_device, split_variant, sweep_budgets, unsupported)
from ..profile import copy_bandwidth
from ..sizes import format_bytes
from .bench_measure import OPTIMIZERS, Inputs, measure, memory_breakdown, prepare, timed_steps
from .bench_models import BenchShape, transformers_missing
from .bench_report import (check_output_path, derive, median_of_rounds, peer_ratios, plot,
                           render_table, variant_ratios)
from .output import Progress, bar_wanted, missing

__all__ = ["BenchShape", "CONFIGS", "PEERS", "run_bench", "copy_bandwidth", "memory_breakdown",
           "check_args", "add_parser"]

#: the configurations whose timeline ``--trace`` writes, the first of them that ran
_TRACED = ("graph_auto", "graph_resident", "graph_remap")
#: the report's ``trace`` where ``--trace`` was asked for and none of those ran
_NO_TRACE = {"config": None, "path": None, "reason": f"none of {', '.join(_TRACED)} ran: nothing written"}
ZERO_GRAD = {"none": True, "keep": False}  #: --zero-grad -> zero_grad's set_to_none


@dataclass(frozen=True)
class _Options:
    """How every configuration of a run is stepped and timed (see :func:`run_bench`)."""

    steps: int
    warmup: int
    rounds: int
    accumulate: int
    set_to_none: bool
    layers_per_graph: int | None
    progress: bool
    optimizer: str = "sgd"


def run_bench(b: Backend, shape: BenchShape, *, steps: int = 10, warmup: int = 3,
              configs: Sequence[str] = CONFIGS, budgets: str | Sequence[str | int] | None = None,
              trace_path: str | None = None, plot_path: str | None = None, progress: bool = True,
              rounds: int = 1, isolate: bool = False, layers_per_graph: int | None = None,
              accumulate: int = 1, zero_grad: str = "none", optimizer: str = "sgd"
              ) -> dict[str, Any]:
    """Run the comparison on backend ``b`` (see the module docstring).

    Args:
        b: the backend.
        shape: the layer stack.
        steps: timed optimizer steps per configuration (after ``warmup`` untimed ones).
        warmup: untimed steps first.
        configs: the configurations, from :data:`CONFIGS` or ``budget:<size>``, in order.
        budgets: memory budgets to run one planned configuration each for (sizes such as
            ``"10GiB"`` or bytes), after ``configs``; ``"graph"`` is added when absent (its
            forward and backward times make the run's lower bound). ``"sweep"``: the
            checkpoint peer's peak, then evenly spaced budgets up to the graph
            configuration's peak; checkpoint and graph then run first.
        trace_path: where to write a Chrome/Perfetto trace of one offloading step (.json).
        plot_path: where to write the figure (needs matplotlib): step time against peak
            memory, and device memory over one step.
        progress: show progress on stderr: a bar on a terminal (needs tqdm, the ``cli``
            extra), plain lines elsewhere.
        rounds: time every configuration this many times, the configurations taking turns
            (built and timed again in each later round), so that a slow spell of the machine
            falls on all of them alike; ``step_ms`` is the median of the rounds' medians,
            ``step_ms_rounds`` lists them. Memory, phases and the trace come from round one.
            A planned configuration's later round counts only if it planned as in round one.
        isolate: run each configuration (in each round) in a process of its own, so that
            none is charged for what an earlier one left in the process (libraries'
            per-stream state, the allocator's segments); this process only gathers the
            reports.
        layers_per_graph: GraphedLayers' (None: it joins small layers).
        accumulate: microbatches (forward and backward) per optimizer step.
        zero_grad: ``"none"`` (``zero_grad(set_to_none=True)``) or ``"keep"`` (zeroed in place).
        optimizer: ``"sgd"`` or ``"adamw"`` (:data:`~graphslot.cli.bench_measure.OPTIMIZERS`),
            made before any configuration is built, as a training script makes it.

    Returns:
        The JSON-able report: ``backend``, ``device``, ``shape``, ``copy_ceiling_gbps``,
        ``configs`` (per configuration its figures, or a ``reason`` it was skipped), ...;
        where the trace or the plot could not be written after the run (a full disk),
        ``write_errors`` says so, a line each, and ``trace`` gives the reason instead of
        the path (the command prints the report, then the lines, and exits 1).

    Raises:
        UsageError: a bad argument or output path; ``progress`` and tqdm is not installed.
    """
    if rounds < 1:
        raise UsageError(f"rounds must be at least 1, got {rounds}")
    if accumulate < 1:
        raise UsageError(f"accumulate must be at least 1, got {accumulate}")
    if zero_grad not in ZERO_GRAD:
        raise UsageError(f"zero_grad must be one of {', '.join(ZERO_GRAD)}, got {zero_grad!r}")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    for path, what in ((trace_path, "trace_path"), (plot_path, "plot_path")):
        if path:
            check_output_path(path, what)
    try:
        names, sweep = _order(configs, budgets)
    except ValueError as e:
        raise UsageError(str(e)) from None
    o = _Options(steps, warmup, rounds, accumulate, ZERO_GRAD[zero_grad], layers_per_graph, progress,
                 optimizer)
    if isolate:
        return _run_isolated(b, shape, names, sweep, trace_path, plot_path, o)
    r = prepare(b, shape, steps, warmup, len(names) + (SWEEP_BUDGETS if sweep else 0), progress,
                rounds, accumulate, o.set_to_none, optimizer)
    r.layers_per_graph = layers_per_graph
    out = {**_head(b, shape, o), "copy_ceiling_gbps": r.ceil_gbps, "copy": r.ceiling,
           "saved_activation_bytes": r.saved, "configs": {}}
    timings: dict[str, dict[str, float]] = {}
    traces: dict[str, Timeline] = {}
    curves: dict[str, list[tuple[str, int]]] = {}
    for name in names:
        _run_one(r, name, out["configs"], timings, traces, curves)
    if sweep:
        for name in _sweep(out):
            _run_one(r, name, out["configs"], timings, traces, curves)
    for rnd in range(2, rounds + 1):
        _another_round(r, out["configs"], rnd)
    median_of_rounds(out["configs"], timings)
    r.bar.close()
    derive(out, timings, r.ceil_gbps)
    if trace_path:
        pick = next((n for n in _TRACED if n in traces), None)
        if pick:
            wrote = _written(out, "the trace", trace_path, lambda: traces[pick].write(trace_path))
            out["trace"] = {"config": pick, "path": trace_path} if wrote else {
                "config": pick, "path": None, "reason": out["write_errors"][-1]}
        else:
            out["trace"] = _NO_TRACE
    if plot_path and _written(out, "the plot", plot_path, lambda: plot(out, curves, plot_path)):
        out["plot"] = plot_path
    peer_ratios(out["configs"], rounds)
    variant_ratios(out["configs"])
    return out


def _order(configs: Sequence[str], budgets: str | Sequence[str | int] | None) -> tuple[list[str], bool]:
    """The configurations to run before any sweep, in order, and whether to sweep."""
    names = _once(configs)
    for name in names:
        check_config(name)
    if budgets is None:
        return names, False
    if budgets == "sweep":
        first = ["checkpoint", "graph"]  # the sweep's budgets come from their peaks
        return first + [n for n in names if n not in first], True
    if isinstance(budgets, str):
        raise ValueError(f"budgets must be 'sweep' or a list of sizes, got {budgets!r}")
    extra = [budget_config(str(size)) for size in budgets]
    if "graph" not in names:
        names.append("graph")  # the run's lower bound takes its forward and backward
    return _once(names + extra), False


def _once(names: Sequence[str]) -> list[str]:
    """``names`` without repeats, in order; budgets are told apart by their bytes (with
    their variant), so ``budget:1GiB`` and ``budget:1024MiB`` run once, as written first."""
    seen: set[Any] = set()
    out = []
    for name in names:
        size = budget_bytes(name)
        key = name if size is None else (size, name[len(base_config(name)):])
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def _sweep(out: dict[str, Any]) -> list[str]:
    """The sweep's budget configurations, from the peaks in ``out`` (recorded there)."""
    got = sweep_budgets(out["configs"])
    if isinstance(got, str):
        out["sweep"] = {"reason": got}
        return []
    out["sweep"] = {"budgets": got}
    return [n for n in got if n not in out["configs"]]


def _head(b: Backend, shape: BenchShape, o: _Options) -> dict[str, Any]:
    return {"backend": b.name, "device": b.info()["device"], "shape": shape.as_dict(),
            "layers_per_graph": o.layers_per_graph or "auto", "steps": o.steps, "rounds": o.rounds,
            "accumulate": o.accumulate, "set_to_none": o.set_to_none, "optimizer": o.optimizer,
            "timing": "per optimizer step"}


def _run_one(r: Inputs, name: str, results: dict[str, Any], timings: dict[str, dict[str, float]],
             traces: dict[str, Timeline], curves: dict[str, list[tuple[str, int]]]) -> None:
    """Build, measure and tear down configuration ``name``; its entry goes in ``results``."""
    b = r.b
    reason = unsupported(b, name)
    if reason:
        results[name] = {"reason": reason}
        r.bar.skip(r.warmup + r.steps + 2)
        return
    seen: list[str] = []
    with _recording_warnings(seen), _variant(r, name):
        built = build(r, name)
        if isinstance(built, str):
            results[name] = {"reason": built}
            r.bar.skip(r.warmup + r.steps + 2)
            return
        c, traces[name], curves[name] = measure(r, name, built, timings,
                                                       saved_on_device(r, name, built.stack))
        if built.stack is not None:
            c["graphs"] = len(built.stack.graph_layers)
            plan = plan_report(built.stack, r.accumulate)
            if plan is not None:
                c["plan"] = plan
        built.tear_down()
        c["accumulate"], c["set_to_none"] = r.accumulate, r.set_to_none  # (the variant's)
    c["warnings"] = seen
    if base_config(name) == "save_on_cpu" and b.name != "cpu":
        c["d2h_gbps"] = c["h2d_gbps"] = None
        c["copy_note"] = "copies issued by torch inside autograd; not timed"
    results[name] = c
    del built
    gc.collect()
    b.empty_cache()


def _count_round(first: dict[str, Any], c: dict[str, Any], rnd: int) -> None:
    """Record round ``rnd``'s result ``c`` in the round-one entry ``first``: its step, or
    why the round does not count (it failed, or its plan differs from round one's)."""
    def planned(r: dict[str, Any]) -> str | None:
        p = r.get("plan")
        return None if p is None else (f"{plan_letters(p['choices'], p.get('recompute_ops') or ())} "
                                       f"({p.get('mode')})")

    mine, then = planned(c), planned(first)
    if "reason" not in c and mine != then:
        c = {"reason": f"planned {mine}, not round one's {then}"}
    if "reason" in c:
        first.setdefault("rounds_not_counted", []).append(f"round {rnd}: {c['reason']}")
    else:
        first.setdefault("step_ms_rounds", [first["step_ms"]]).append(c["step_ms"])
        first.setdefault("rounds_counted", [1]).append(rnd)


def _another_round(r: Inputs, results: dict[str, dict[str, Any]], rnd: int) -> None:
    """Build and time every configuration that ran once more, in the same order."""
    for name, first in results.items():
        if "reason" in first:
            r.bar.skip(r.warmup + r.steps)
            continue
        with warnings.catch_warnings(), _variant(r, name):  # round one reported them
            warnings.simplefilter("ignore")
            built = build(r, name)
            if isinstance(built, str):
                _count_round(first, {"reason": built}, rnd)
                continue
            step_ms, _, _ = timed_steps(r, name, built)
            c: dict[str, Any] = {"step_ms": step_ms}
            plan = plan_report(built.stack, r.accumulate)
            if plan is not None:
                c["plan"] = plan
            built.tear_down()
        _count_round(first, c, rnd)
        del built
        gc.collect()
        r.b.empty_cache()


@contextlib.contextmanager
def _variant(r: Inputs, name: str) -> Iterator[None]:
    """Configuration ``name``'s variant (``@keep``, ``@accN``) in force on ``r`` while it
    runs; the run's own settings after."""
    _, set_to_none, accumulate = split_variant(name)
    before = r.set_to_none, r.accumulate
    r.set_to_none = before[0] if set_to_none is None else set_to_none
    r.accumulate = before[1] if accumulate is None else accumulate
    try:
        yield
    finally:
        r.set_to_none, r.accumulate = before


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


def _phases(c: dict[str, Any]) -> dict[str, float]:
    """A configuration's step and phase times, as :func:`derive` reads them."""
    return {k: c[k] for k in ("step_ms", "fwd_ms", "bwd_ms")}


def _child_argv(shape: BenchShape, configs: str, o: _Options, trace_path: str | None) -> list[str]:
    """The command line of a bench process that runs ``configs`` on ``shape``."""
    argv = [sys.executable, "-m", "graphslot.cli", "bench", "--json", "--quiet",
            "--configs", configs, "--steps", str(o.steps), "--warmup", str(o.warmup),
            "--layers-per-graph", str(o.layers_per_graph or "auto"),
            "--accumulate", str(o.accumulate), "--zero-grad", "none" if o.set_to_none else "keep",
            "--optimizer", o.optimizer]
    d = shape.as_dict()
    argv += ["--preset", "llama" if d.pop("model") == "llama" else "default"]
    for k, v in d.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    if trace_path:
        argv += ["--trace", trace_path]
    return argv


def _run_child(b: Backend, argv: list[str]) -> dict[str, Any]:
    """Run one bench process on ``b``'s backend; its report, or why it could not run."""
    import subprocess

    env = {**os.environ, "GRAPHSLOT_BACKEND": b.name}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    # The report is the last thing printed (indented JSON: it begins with a line "{");
    # a library may have printed before it. A process that ran but could not write its
    # trace reports, then exits 1.
    start = done.stdout.rfind("\n{\n") + 1 if not done.stdout.startswith("{\n") else 0
    try:
        out, _ = json.JSONDecoder().raw_decode(done.stdout, start)
    except ValueError:
        out = None
    if done.returncode != 0 and not (done.returncode == 1 and isinstance(out, dict)
                                     and out.get("write_errors")):
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"reason": f"its process failed: {why}"}
    if out is None:
        tail = (done.stderr.strip().splitlines() or ["nothing on stderr"])[-1]
        return {"reason": f"its process printed no report ({tail})"}
    return dict(out)


def _brief(c: dict[str, Any]) -> str:
    """A finished configuration's figures for the progress line (what a run cut short by
    a time limit still shows)."""
    if "reason" in c:
        return f" (not run: {c['reason']})"
    return (f" (step {c['step_ms']:.1f} ms, peak "
            f"{format_bytes(c['peak_device_bytes'])})" if c.get("step_ms") is not None
            and c.get("peak_device_bytes") is not None else "")


def _run_isolated(b: Backend, shape: BenchShape, names: list[str], sweep: bool,
                  trace_path: str | None, plot_path: str | None, o: _Options) -> dict[str, Any]:
    """:func:`run_bench` with every configuration in a process of its own (``isolate``).

    Later rounds run again only what ran in round one. A sweep's budgets come from the
    checkpoint and graph processes, which run first."""
    index = getattr(b.device, "index", None)
    if index not in (None, 0):
        raise UsageError(f"isolate starts its processes on the backend's default device; "
                         f"{b.device} is not it (make it device 0, e.g. with CUDA_VISIBLE_DEVICES)")
    bar = Progress((len(names) + (SWEEP_BUDGETS if sweep else 0)) * o.rounds, o.progress)
    out: dict[str, Any] = {**_head(b, shape, o), "isolated": True, "configs": {}}
    trace_for = next((n for n in _TRACED if n in names), None)
    ceilings: list[dict[str, Any]] = []
    for rnd in range(1, o.rounds + 1):
        todo = list(names)
        while todo:
            name = todo.pop(0)
            first = out["configs"].get(name)
            reason = unsupported(b, name) or (first or {}).get("reason")
            if reason:
                out["configs"].setdefault(name, {"reason": reason})
                bar.update(f"{name}: skipped")
            else:
                bar.update(f"{name}: round {rnd}/{o.rounds}, own process", advance=False)
                child = _run_child(b, _child_argv(shape, name, o, trace_path if rnd == 1 and
                                                  name == trace_for else None))
                if child.get("write_errors"):
                    out.setdefault("write_errors", []).extend(child.pop("write_errors"))
                c = child.get("configs", {}).get(name) if "reason" not in child else child
                c = c or {"reason": "its process reported nothing for it"}
                bar.update(f"{name}: round {rnd}/{o.rounds} done{_brief(c)}", line=True)
                if first is not None:
                    _count_round(first, c, rnd)
                else:
                    out["configs"][name] = c
                    if "reason" not in c:
                        ceilings.append(child["copy"])
                        out.setdefault("saved_activation_bytes", child["saved_activation_bytes"])
                        if name == trace_for and trace_path and "trace" in child:
                            out["trace"] = child["trace"]  # (written, or why not)
            if rnd == 1 and sweep and not todo and "sweep" not in out:
                todo = _sweep(out)
                names = names + todo  # later rounds run them too
    bar.close()
    median_of_rounds(out["configs"])
    timings = {name: _phases(c) for name, c in out["configs"].items() if "reason" not in c}
    out.setdefault("copy_ceiling_gbps", None)
    out.setdefault("saved_activation_bytes", None)
    if ceilings:  # each process measured the copy ceiling; the report takes their median
        out["copy"] = {k: statistics.median(c[k] for c in ceilings) for k in ceilings[0]}
        out["copy_ceiling_gbps"] = min(out["copy"]["d2h_gbps"], out["copy"]["h2d_gbps"])
        derive(out, timings, out["copy_ceiling_gbps"])
    if trace_path and "trace" not in out:
        out["trace"] = _NO_TRACE
    if plot_path:
        curves = {n: [(p[0], p[1]) for p in c.get("memory_curve", [])]
                  for n, c in out["configs"].items() if "reason" not in c}
        if _written(out, "the plot", plot_path, lambda: plot(out, curves, plot_path)):
            out["plot"] = plot_path
    peer_ratios(out["configs"], o.rounds)
    variant_ratios(out["configs"])
    return out


def _written(out: dict[str, Any], what: str, path: str, write: Callable[[], Any]) -> bool:
    """Run ``write``; where it fails, note why in ``out["write_errors"]`` (the report is
    still printed, then the command exits 1) rather than losing the run."""
    try:
        write()
    except OSError as e:
        out.setdefault("write_errors", []).append(f"{what} {path}: cannot write it ({e.strerror or e})")
        return False
    return True


def _cannot_hold(b: Backend, shape: BenchShape) -> str | None:
    """Why ``shape`` cannot run on ``b``'s device, where its layers' weights and gradients
    and the stack's input and output alone exceed what the device has free (on the cpu
    backend the host's memory, which overcommits rather than failing an allocation: the
    run would take the machine's; a size past what a tensor can index fails inside torch
    with no word of the option)."""
    weights, acts = 2 * shape.weight_bytes(), 2 * shape.boundary_bytes()
    free, _ = b.mem_info()
    if weights + acts <= free:
        return None
    what, options = (("its layers' weights and gradients", "--hidden, --ffn, --layers")
                     if weights >= acts else
                     ("the stack's input and output", "--batch, --seq, --hidden"))
    return (f"shape {shape.as_dict()} needs at least {format_bytes(weights + acts)} on "
            f"{b.device} for {what} and the rest, and it has {format_bytes(free)} free: give "
            f"a smaller shape ({options})")


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or any(k in text for k in (
        "out of memory", "can't allocate", "cannot allocate", "out_of_memory"))


def parse_budgets(text: str | None) -> str | list[str] | None:
    """``--budgets``: None, ``"sweep"``, or its comma-separated sizes, each checked;
    ``ValueError`` naming a bad one."""
    if text is None:
        return None
    if text.strip() == "sweep":
        return "sweep"
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    if not sizes:
        raise ValueError("--budgets: empty list; give sizes such as 10GiB,12GiB or 'sweep'")
    for s in sizes:
        try:
            parse_size(s)
        except ValueError as e:
            raise ValueError(f"--budgets: {e}") from None
    return sizes


def check_args(args: argparse.Namespace) -> tuple[BenchShape, tuple[str, ...], str | list[str] | None]:
    """The shape, configurations and budgets ``args`` ask for; ``ValueError`` naming a bad
    one (the llama preset without transformers included)."""
    shape = BenchShape.preset(args.preset)
    if shape.model == "llama":
        why = transformers_missing()
        if why:
            raise ValueError(why)
    for k in ("hidden", "heads", "kv_heads", "ffn", "seq", "batch", "layers", "dtype", "attention"):
        v = getattr(args, k, None)
        if v is not None:
            setattr(shape, k, getattr(torch, v) if k == "dtype" else v)
    shape.check()
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if getattr(args, "accumulate", 1) < 1:
        raise ValueError(f"--accumulate must be at least 1, got {args.accumulate}")
    parse_layers_per_graph(args)
    configs = (tuple(c.strip() for c in args.configs.split(",") if c.strip())
               if args.configs is not None else CONFIGS)
    if not configs:
        raise ValueError("--configs: empty list; choose from " + ",".join(CONFIGS))
    for c in configs:
        try:
            check_config(c)
        except ValueError as e:
            raise ValueError(f"--configs: {e}") from None
    return shape, configs, parse_budgets(getattr(args, "budgets", None))


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

    try:  # everything the run needs is checked before anything runs
        shape, configs, budgets = check_args(args)
        for path, option in ((args.trace, "--trace"), (args.plot, "--plot")):
            if path:
                check_output_path(path, option)
    except (ValueError, GraphslotError) as e:
        print(f"graphslot bench: error: {e}", file=sys.stderr)
        return 2
    for needed in ((None if args.json else missing("tabulate", "the bench table", "--json")),
                   (None if args.quiet or not bar_wanted() else missing("tqdm", "the progress bar", "--quiet"))):
        if needed:
            print(f"graphslot bench: error: {needed}", file=sys.stderr)
            return 1
    b = get_backend(args.backend)
    too_big = _cannot_hold(b, shape)
    if too_big:
        print(f"graphslot bench: error: {too_big}", file=sys.stderr)
        return 2
    try:
        r = run_bench(b, shape, steps=args.steps, warmup=args.warmup, configs=configs,
                      budgets=budgets, trace_path=args.trace, plot_path=args.plot,
                      progress=not args.quiet, rounds=args.rounds, isolate=args.isolate,
                      layers_per_graph=parse_layers_per_graph(args),
                      accumulate=args.accumulate, zero_grad=args.zero_grad,
                      optimizer=args.optimizer)
    except (RuntimeError, MemoryError) as e:
        if not _is_oom(e):
            raise
        print(f"graphslot bench: error: shape {shape.as_dict()} does not fit on {b.device}: "
              f"{str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if args.json else render_table(r))
    for why in r.get("write_errors", []):
        print(f"graphslot bench: error: {why}", file=sys.stderr)
    return 1 if r.get("write_errors") else 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="graphslot's configurations and their peers side by side")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of one step")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a figure: step time against peak memory, and memory over one step "
                        "(needs matplotlib: pip install 'graphslot[plot]')")
    p.add_argument("--preset", default="default", choices=tuple(BenchShape.PRESETS),
                   help="the layer stack (llama: transformers' LlamaDecoderLayer, needs "
                        "pip install 'graphslot[models]'); the options below override its sizes")
    for k in ("hidden", "heads", "ffn", "seq", "batch", "layers"):
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (llama only)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--attention", default=None, choices=("sdpa", "math"))
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accumulate", type=positive_int, default=1, metavar="N",
                   help="microbatches (forward and backward) per optimizer step; every time "
                        "is per optimizer step")
    p.add_argument("--zero-grad", default="none", choices=tuple(ZERO_GRAD),
                   help="zero_grad(set_to_none=True) (none) or zeroing .grad in place (keep)")
    p.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS),
                   help="the optimizer every step runs (made before the configurations are built)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every configuration this many times, taking turns (median of rounds)")
    p.add_argument("--isolate", action="store_true",
                   help="run each configuration in a process of its own")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated subset of {','.join(CONFIGS)}, or budget:<size>; "
                        "a variant follows a name: @keep (zero_grad(set_to_none=False)), @none, "
                        "@accN (N microbatches a step), e.g. graph_resident@keep@acc4")
    p.add_argument("--budgets", default=None, metavar="A,B,...|sweep",
                   help="one planned configuration (GraphedLayers(memory_budget=...)) per size "
                        "(10GiB, 9.5G, 12000MiB or bytes); sweep: from the checkpoint peer's "
                        "peak up to the graph configuration's")
    p.add_argument("--layers-per-graph", default="auto", metavar="N|auto",
                   help="layers per device graph of the graph configurations (auto: "
                        "GraphedLayers joins small layers)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, lines elsewhere)")
    p.set_defaults(func=main)
