"""What ``graphslot bench`` derives from its measurements and how it shows them: the copy
bounds, the planned configurations' figures, the ratios to the peers, the tables and the
plot; and the check of its output paths before anything runs.
"""

from __future__ import annotations

import importlib
import os
import statistics
from typing import Any

from ..budget import bound_ms, plan_letters
from ..errors import UsageError
from ..sizes import format_bytes
from .bench_configs import PEERS, base_config, budget_bytes, is_planned
from .bench_measure import OPTIMIZERS, GiB
from .output import table, unwritable

__all__ = ["derive", "lower_bound_ms", "planned_figures", "peer_ratios", "variant_ratios", "median_of_rounds",
           "render_table", "curve_positions", "pareto_points", "plot", "check_output_path",
           "PLOT_EXTRA"]

PLOT_EXTRA = "graphslot[plot]"
#: the file types --plot writes (matplotlib's, with the Agg backend)
PLOT_TYPES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps")
#: the file type --trace writes (Chrome/Perfetto trace events)
TRACE_TYPES = (".json",)


def check_output_path(path: str, option: str) -> None:
    """Refuse an output path before the bench runs: its folder must exist and be writable,
    its extension known; ``--plot`` needs matplotlib.

    Args:
        path: where the file goes.
        option: what the message names: ``"--plot"``/``"plot_path"`` (a figure) or
            ``"--trace"``/``"trace_path"`` (a trace).

    Raises:
        UsageError: one line naming the option and what is wrong.
    """
    kinds = PLOT_TYPES if "plot" in option else TRACE_TYPES
    ext = os.path.splitext(path)[1].lower()
    if ext not in kinds:
        raise UsageError(f"{option} {path}: unknown file type {ext or '(none)'!r}; "
                         f"use {', '.join(kinds)}")
    problem = unwritable(path)
    if problem:
        raise UsageError(f"{option} {path}: {problem}")
    if kinds is PLOT_TYPES:
        try:
            importlib.import_module("matplotlib")
        except ImportError as e:
            raise UsageError(f"{option} needs matplotlib ({e}); install it with: "
                             f"pip install '{PLOT_EXTRA}'") from None


def lower_bound_ms(fwd_ms: float, bwd_ms: float, recompute_ms: float, offloaded_bytes: float,
                   d2h_gbps: float | None, h2d_gbps: float | None) -> float:
    """``max(T_f, V/β_d2h) + max(T_b + T_r, V/β_h2d)``: no schedule that offloads ``V``
    bytes each way and recomputes ``T_r`` of forward is faster than this.

    Args:
        fwd_ms: ``T_f``, the forward's compute.
        bwd_ms: ``T_b``, the backward's compute without recompute.
        recompute_ms: ``T_r``.
        offloaded_bytes: ``V``.
        d2h_gbps: ``β_d2h``, GB/s.
        h2d_gbps: ``β_h2d``, GB/s.
    """
    return bound_ms(fwd_ms, bwd_ms, recompute_ms, offloaded_bytes, offloaded_bytes,
                    d2h_gbps, h2d_gbps)


def derive(out: dict[str, Any], timings: dict[str, dict[str, float]], gbps: float) -> None:
    """Exposed copy time and efficiency against the ideal bound, per configuration, and
    the planned configurations' figures (:func:`planned_figures`)."""
    runs = [timings[n] for n in ("graph", "eager") if n in timings]
    if runs:
        _ideal(out, runs, (timings.get("graph") or timings["eager"])["step_ms"], gbps)
    planned_figures(out, timings.get("graph"))


def _ideal(out: dict[str, Any], runs: list[dict[str, float]], base_step: float, gbps: float) -> None:
    # The compute of a phase is the faster of eager and graphed (no offload) runs.
    fwd = min(t["fwd_ms"] for t in runs)
    bwd = min(t["bwd_ms"] for t in runs)
    saved = out.get("saved_activation_bytes")
    if saved:
        saved *= out.get("accumulate", 1)  # per optimizer step, as every figure
    for r in out["configs"].values():
        if "reason" in r or r.get("accumulate", out.get("accumulate", 1)) != out.get("accumulate", 1):
            continue  # (a variant of other microbatches a step: the run's bound is not its)
        off = r["offloaded_bytes"]
        # What this configuration copies each way (resident copies fewer bytes back than
        # out when a bank still holds a layer at its backward)...
        ideal = bound_ms(fwd, bwd, 0.0, off, r.get("restored_bytes", off), gbps, gbps)
        r["ideal_ms"] = ideal
        # ...and the same bar for every configuration that offloads: every saved
        # activation out and back, as save_on_cpu moves them.
        r["offload_ideal_ms"] = lower_bound_ms(fwd, bwd, 0.0, saved, gbps, gbps) if off and saved else None
        r["efficiency"] = ideal / r["step_ms"] if r["step_ms"] > 0 else None
        r["exposed_copy_ms"] = max(0.0, r["step_ms"] - base_step) if off else 0.0


def _graph_passes(graph: dict[str, float] | None) -> tuple[float, float] | None:
    """The graph configuration's forward and backward, as the run's bounds take them: from
    its one timeline step, scaled down where they add up to more than its timed step (that
    step's spans and a synchronisation per phase can make it run long; the passes cannot
    take longer than the step that holds them)."""
    if graph is None:
        return None
    fwd, bwd = graph["fwd_ms"], graph["bwd_ms"]
    step = graph.get("step_ms")
    if step and fwd + bwd > step:
        fwd, bwd = fwd * step / (fwd + bwd), bwd * step / (fwd + bwd)
    return fwd, bwd


def planned_figures(out: dict[str, Any], graph: dict[str, float] | None) -> None:
    """For each planned configuration that ran and has a plan: whether its measured peak
    fits its budget (``fits_budget``), its step over the plan's lower bound, the lower
    bound from this run's measurements (:func:`lower_bound_ms` with the ``graph``
    configuration's forward and backward, this configuration's offloaded bytes, the
    plan's recompute time and the run's copy ceiling each way) and its step over it, the
    same two bounds with the rest of the step added (``rest_of_step_ms``: graph's step
    less its forward and backward, what no plan changes; ``step_over_run_step_bound``,
    ``step_over_plan_step_bound``), and the fastest peer whose peak fits the budget.

    Args:
        out: the report.
        graph: the graph configuration's ``fwd_ms``, ``bwd_ms`` (from its timeline step)
            and ``step_ms`` (the median step; None: it did not run); the report's
            ``graph_passes_ms`` says what the bounds took of them.
    """
    copy = out.get("copy") or {}
    configs = out["configs"]
    peers = {n: c for n, c in configs.items() if n in PEERS and "reason" not in c}
    passes = _graph_passes(graph)
    if passes is not None:
        out["graph_passes_ms"] = {"fwd_ms": passes[0], "bwd_ms": passes[1]}
    for name, c in configs.items():
        plan = c.get("plan")
        if "reason" in c or not is_planned(name) or not plan:
            continue
        peak, step = c.get("peak_device_bytes"), c["step_ms"]
        budget = budget_bytes(name) or plan.get("budget_bytes")
        c["budget_bytes"] = budget
        c["fits_budget"] = None if budget is None or peak is None else peak <= budget
        plan_lb = plan.get("lower_bound_ms")
        c["step_over_plan_lower_bound"] = step / plan_lb if plan_lb else None
        run_lb = None
        if passes is not None and copy:
            run_lb = lower_bound_ms(passes[0], passes[1], plan.get("recompute_ms") or 0.0,
                                    c["offloaded_bytes"], copy.get("d2h_gbps"), copy.get("h2d_gbps"))
        c["run_lower_bound_ms"] = run_lb
        c["step_over_run_lower_bound"] = step / run_lb if run_lb else None
        # The bounds cover the forward and backward; a step also runs what no plan changes
        # (the optimizer step, zero_grad(), the input's copy), as graph's step shows it.
        rest = None if passes is None or graph is None or "step_ms" not in graph else max(
            0.0, graph["step_ms"] - passes[0] - passes[1])
        c["rest_of_step_ms"] = rest
        c["step_over_run_step_bound"] = step / (run_lb + rest) if run_lb and rest is not None else None
        c["step_over_plan_step_bound"] = (step / (plan_lb + rest) if plan_lb and rest is not None
                                          else None)
        fitting = [(p["step_ms"], n) for n, p in peers.items()
                   if budget is not None and p.get("peak_device_bytes") is not None
                   and p["peak_device_bytes"] <= budget]
        if fitting:
            best_step, best = min(fitting)
            c["fastest_peer_within_budget"] = {"config": best, "step_ms": best_step,
                                               "step_ratio": step / best_step}
        else:
            c["fastest_peer_within_budget"] = None


def peer_ratios(results: dict[str, dict[str, Any]], rounds: int) -> None:
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


def variant_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Each variant (``graph_resident@keep@acc4``) beside its configuration as run in the
    same run (``graph_resident``): ``vs_base`` has their step per microbatch and their
    peak as ratios."""
    ran = {n: c for n, c in results.items() if "reason" not in c}
    for name, c in ran.items():
        base = ran.get(base_config(name))
        if base is None or base is c or not base["step_ms"] > 0:
            continue
        per, per_base = c.get("accumulate", 1), base.get("accumulate", 1)
        v: dict[str, Any] = {"config": base_config(name),
                             "step_per_microbatch": (c["step_ms"] / per) / (base["step_ms"] / per_base)}
        if base.get("peak_device_bytes") and c.get("peak_device_bytes") is not None:
            v["peak"] = c["peak_device_bytes"] / base["peak_device_bytes"]
            v["peak_more_bytes"] = c["peak_device_bytes"] - base["peak_device_bytes"]
        c["vs_base"] = v


def median_of_rounds(results: dict[str, dict[str, Any]],
                     timings: dict[str, dict[str, float]] | None = None) -> None:
    """Each configuration timed in several rounds takes the median of them as its step (in
    ``timings`` too, where it has an entry)."""
    for name, c in results.items():
        if "step_ms_rounds" in c:
            c["step_ms"] = statistics.median(c["step_ms_rounds"])
            if timings is not None and name in timings:
                timings[name]["step_ms"] = c["step_ms"]


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _plan_text(plan: dict[str, Any]) -> str:
    """``KKORCP (resident)``: a letter per layer (:func:`graphslot.budget.plan_letters`)
    and the mode."""
    letters = plan_letters(plan.get("choices", ()), plan.get("recompute_ops") or ())
    return f"{letters} ({plan.get('mode', '?')})"


def _optimizer_name(key: str) -> str:
    """The optimizer as the table's head names it (its class: ``--optimizer adamw``, AdamW)."""
    cls = OPTIMIZERS.get(key)
    return key if cls is None else cls.__name__


def render_table(r: dict[str, Any]) -> str:
    """The report as text: a head, every configuration's row, the planned configurations'
    table, then what was skipped and what warned."""
    per = r.get("accumulate", 1)
    head = [f"graphslot bench on {r['backend']} ({r['device']}); shape {r['shape']}"
            + ("; each configuration in a process of its own" if r.get("isolated") else "")]
    head.append("times per optimizer step (" + (f"{per} microbatches' forward and backward, "
                if per > 1 else "forward, backward, ")
                + f"{_optimizer_name(r.get('optimizer', 'sgd'))}, "
                f"zero_grad(set_to_none={r.get('set_to_none', True)}))")
    if r.get("copy_ceiling_gbps") is not None:
        head.append(f"copy ceiling {r['copy_ceiling_gbps']:.1f} GB/s; saved activations "
                    f"{format_bytes(r['saved_activation_bytes'])} per forward")
    if isinstance(r.get("sweep"), dict) and "reason" in r["sweep"]:
        head.append(f"budget sweep: none run: {r['sweep']['reason']}")

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

    rows, planned, skipped = [], [], []
    for name, c in r["configs"].items():
        if "reason" in c:
            skipped.append(f"{name} skipped: {c['reason']}")
            continue
        rows.append([name, _f(c["step_ms"], ".2f"), vs(name, c), format_bytes(c["peak_device_bytes"]),
                     format_bytes(c["activation_bytes_at_boundary"]), format_bytes(c["offloaded_bytes"]),
                     _f(c["d2h_gbps"]), _f(c["h2d_gbps"]), _f(c.get("exposed_copy_ms")),
                     _f(c.get("efficiency"), ".2f"),
                     _f(c["offload_ideal_ms"] / c["step_ms"] if c.get("offload_ideal_ms") else None, ".2f")])
        plan = c.get("plan")
        if plan:
            fits = c.get("fits_budget")
            best = c.get("fastest_peer_within_budget")
            planned.append([name, _plan_text(plan), format_bytes(c.get("budget_bytes")),
                            format_bytes(c["peak_device_bytes"]), format_bytes(plan.get("predicted_peak_bytes")),
                            format_bytes(plan.get("model_peak_bytes")),
                            "-" if fits is None else ("yes" if fits else "NO"),
                            _f(c["step_ms"], ".2f"), _f(plan.get("predicted_step_ms"), ".2f"),
                            _f(plan.get("lower_bound_ms"), ".2f"), _f(c.get("step_over_plan_lower_bound"), ".2f"),
                            _f(c.get("run_lower_bound_ms"), ".2f"), _f(c.get("step_over_run_lower_bound"), ".2f"),
                            _f(c.get("step_over_run_step_bound"), ".2f"),
                            f"{best['config']} {best['step_ratio']:.2f}" if best else "-"])
    body = table(rows, ("config", "step ms", f"step / {peer or 'peer'}", "peak dev", "act@bound",
                        "offload", "D2H GB/s", "H2D GB/s", "exposed", "eff", "eff all"),
                 "lrrrrrrrrrr")
    parts = [*head, body]
    if planned:
        parts += ["", "planned (K keep, O offload, R recompute; predicted: the peak its build "
                      "measured, where it could, model: the model's figure for it; LB: lower "
                      "bound of the forward and "
                      "backward, the plan's and this run's; +rest: with the rest of graph's step "
                      "added; last column: the fastest peer whose peak fits, and step / its step)",
                  table(planned, ("config", "plan", "budget", "peak dev", "predicted", "model", "fits",
                                  "step ms", "predicted", "LB plan", "step/LB", "LB run",
                                  "step/LB run", "step/(LB run+rest)", "peer in budget"), "llrrrrlrrrrrrrl")]
    variants = [[name, v["config"], _f(v["step_per_microbatch"], ".3f"), _f(v.get("peak"), ".3f"),
                 format_bytes(v.get("peak_more_bytes"))]
                for name, c in r["configs"].items() if (v := c.get("vs_base"))]
    if variants:
        parts += ["", "variants beside their configuration in this run (@keep: zero_grad("
                      "set_to_none=False); @accN: N microbatches a step)",
                  table(variants, ("variant", "of", "step/microbatch ratio", "peak ratio",
                                   "peak more"), "llrrr")]
    warned = [f"{name} warned: {w}" for name, c in r["configs"].items() for w in c.get("warnings", ())]
    written = []
    tr = r.get("trace")
    if isinstance(tr, dict):
        written.append(f"trace of {tr['config']}'s step: {tr['path']}" if tr.get("path")
                       else f"trace: {tr.get('reason', 'not written')}")
    if r.get("plot"):
        written.append(f"plot: {r['plot']}")
    return "\n".join([*parts, *skipped, *warned, *written])


def _label_key(label: str, seen: dict[str, int]) -> tuple[float, int]:
    """Where a memory-curve label goes on the step's time axis: start, the forwards in
    layer order, the backwards in reverse layer order, end, the optimizer step."""
    if label == "start":
        return (0, 0)
    if label[:1] in "FB" and label[1:].isdigit():
        i = int(label[1:])
        return (1, i) if label[0] == "F" else (2, -i)
    fixed = {"end": (3, 0), "opt": (4, 0)}
    return fixed.get(label, (5, seen.setdefault(label, len(seen))))


def curve_positions(curves: dict[str, list[tuple[str, int]]]
                    ) -> tuple[list[str], dict[str, list[int]]]:
    """Every label any curve has, in step order, and each curve's points' x positions:
    the place of their own label (a graph configuration probes once per graph, so its
    labels are fewer than eager's, and not a prefix of them)."""
    seen: dict[str, int] = {}
    labels = sorted({lab for pts in curves.values() for lab, _ in pts},
                    key=lambda lab: _label_key(lab, seen))
    at = {lab: i for i, lab in enumerate(labels)}
    return labels, {name: [at[lab] for lab, _ in pts] for name, pts in curves.items()}


def pareto_points(configs: dict[str, dict[str, Any]]) -> list[tuple[str, int, float]]:
    """``(name, peak bytes, step ms)`` of every configuration with both, by peak."""
    pts = [(n, c["peak_device_bytes"], c["step_ms"]) for n, c in configs.items()
           if "reason" not in c and c.get("peak_device_bytes") is not None]
    return sorted(pts, key=lambda p: (p[1], p[2]))


def pareto_front(points: list[tuple[str, int, float]]) -> list[str]:
    """The names no other point beats in both peak and step (by peak)."""
    front, best = [], float("inf")
    for name, _peak, step in sorted(points, key=lambda p: (p[1], p[2])):
        if step < best:
            front.append(name)
            best = step
    return front


def plot(report: dict[str, Any], curves: dict[str, list[tuple[str, int]]], path: str) -> None:
    """Write the bench's figure to ``path``: step time against peak memory, one labelled
    point per configuration, the budgets as vertical lines and the Pareto front joined
    (where the backend keeps peaks); and device memory over one step per configuration,
    each point at its own label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = pareto_points(report["configs"])
    fig, axes = plt.subplots(1, 2 if pts else 1, figsize=(16 if pts else 9, 5), squeeze=False)
    if pts:
        ax = axes[0][0]
        for name, peak, step in pts:
            ax.scatter(peak / GiB, step, s=18, zorder=3)
            ax.annotate(name, (peak / GiB, step), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = set(pareto_front(pts))
        fx = [(peak / GiB, step) for name, peak, step in pts if name in front]
        ax.plot([p[0] for p in fx], [p[1] for p in fx], color="gray", lw=0.8, ls=":",
                label="Pareto front")
        for i, name in enumerate(n for n in report["configs"] if budget_bytes(n)):
            ax.axvline((budget_bytes(name) or 0) / GiB, color="tab:red", lw=0.7, ls="--", alpha=0.6,
                       label="budgets" if i == 0 else None)
        ax.set_xlabel("peak device memory (GiB; allocator peak reserved + graphslot pages)")
        ax.set_ylabel("step time (ms per optimizer step)")
        ax.set_title("step time against peak memory")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    labels, xs = curve_positions(curves)
    for name, pts_ in curves.items():
        if pts_:  # absolute: the memory graphs hold before the step starts shows too
            ax.plot(xs[name], [v / GiB for _, v in pts_], marker=".", label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_xlabel("after each layer's forward (F) and backward (B), of the first microbatch")
    ax.set_ylabel("device memory in use (GiB)")
    ax.set_title(f"memory over one step ({report.get('backend')}; allocator + graphslot pages)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
