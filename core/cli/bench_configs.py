"""The configurations ``graphslot bench`` compares, and how each is built.

============================ ================================================================
eager                        plain autograd
save_on_cpu                  eager with ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
checkpoint                   eager, ``torch.utils.checkpoint`` (non-reentrant) on every layer
torch_graphed                ``torch.cuda.make_graphed_callables`` over the layers
torch_graphed_checkpoint     ``make_graphed_callables`` over checkpointed layers
graph                        ``GraphedLayers(mode="off")``: graphs, no offload
graph_resident               graphed, every layer offloaded, two resident banks
graph_remap                  graphed, every layer offloaded, pages released between phases
graph_recompute              ``GraphedLayers(mode="off", recompute_layers=every layer)``
graph_recompute_parts        every layer recomputed part by part (``recompute_ops="parts"``),
                             its parts' inputs to the host (remap)
graph_auto                   ``GraphedLayers(memory_budget="auto")``
``budget:<size>``            ``GraphedLayers(memory_budget=<size>)``, e.g. ``budget:10GiB``
============================ ================================================================

The last two are *planned*: the library's budget planner picks, per layer, keep, offload or
recompute, and the stack's ``plan`` says what it chose and expects. In a run whose steps keep
``.grad`` through the next forward (``--zero-grad keep``, ``--accumulate`` above one, or
those variants), every ``GraphedLayers`` is built with ``keep_grads=True``, as a training
script that does so would build it. The ``@pages`` variant of a graphslot configuration
(``graph@pages``, ``budget:10GiB@pages``) builds it with ``share_pool_pages=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Sequence

import torch

from ..backend import Backend
from ..budget import parse_budget
from ..errors import UsageError
from ..sizes import format_bytes
from .bench_measure import VARIANT_SEP, GiB, Built, Inputs, MiB, base_config
from .bench_models import CheckpointedLayer

__all__ = ["CONFIGS", "PEERS", "BUDGET_PREFIX", "SWEEP_BUDGETS", "parse_size", "budget_bytes",
           "budget_config", "split_variant", "shares_pages", "base_config", "VARIANT_SEP", "is_planned",
           "check_config", "sweep_budgets", "unsupported", "build", "saved_on_device",
           "plan_report", "forward"]

CONFIGS = ("eager", "save_on_cpu", "checkpoint", "torch_graphed", "torch_graphed_checkpoint",
           "graph", "graph_resident", "graph_remap", "graph_recompute", "graph_recompute_parts",
           "graph_auto")

#: what users would pick instead, in the order the table compares with the first that ran:
#: each configuration's report says its step and peak as a ratio to each of them (``vs``)
PEERS = ("torch_graphed", "eager", "save_on_cpu", "checkpoint", "torch_graphed_checkpoint")

BUDGET_PREFIX = "budget:"
#: the variant that builds a GraphedLayers configuration with ``share_pool_pages=True``
PAGES = "pages"
#: how many budgets ``--budgets sweep`` runs: the checkpoint peer's peak, then this many
#: less one evenly spaced up to the graph configuration's peak
SWEEP_BUDGETS = 6

def parse_size(text: str) -> int:
    """Bytes from a size: ``"10GiB"``, ``"9.5G"``, ``"12000MiB"``, ``"8e9"`` or plain bytes
    (k, M, G, T alone are binary, kB, MB, GB, TB decimal; case and spaces do not matter).

    Raises:
        ValueError: not a positive size.
    """
    try:
        return parse_budget(text)  # (the library's reading of a budget, as the planner's)
    except UsageError as e:  # (its words, for a size the bench runs a budget for)
        said = str(e).replace("memory budget must", "a size must", 1)
        raise ValueError(said.replace("memory budget ", "", 1)) from None


def budget_config(size: str) -> str:
    """The configuration name of a budget as written (``"10GiB"`` -> ``"budget:10GiB"``).

    Raises:
        ValueError: ``size`` is not a size.
    """
    text = size.strip().replace(" ", "")
    parse_size(text)
    return BUDGET_PREFIX + text


def budget_bytes(name: str) -> int | None:
    """The budget in bytes of configuration ``name``; None for one that has none."""
    name = base_config(name)
    return parse_size(name[len(BUDGET_PREFIX):]) if name.startswith(BUDGET_PREFIX) else None


def split_variant(name: str) -> tuple[str, bool | None, int | None]:
    """``name``'s configuration, and its variant's ``zero_grad`` set_to_none (``@keep``:
    False, ``@none``: True) and microbatches per step (``@accN``), each None where the
    variant leaves the run's own.

    Raises:
        ValueError: a variant that is none of these.
    """
    base, *parts = name.split(VARIANT_SEP)
    set_to_none: bool | None = None
    accumulate: int | None = None
    for part in parts:
        if part == PAGES:
            if parts.count(PAGES) > 1:
                raise ValueError(f"{name!r}: {VARIANT_SEP}{PAGES} twice; give it once")
            continue  # (read by shares_pages)
        if part in ("keep", "none"):
            if set_to_none is not None:
                raise ValueError(f"{name!r}: two zero_grad variants; give {VARIANT_SEP}keep or "
                                 f"{VARIANT_SEP}none once")
            set_to_none = part == "none"
        elif re.fullmatch(r"acc[1-9][0-9]*", part):
            if accumulate is not None:
                raise ValueError(f"{name!r}: two {VARIANT_SEP}accN variants; give one")
            accumulate = int(part[3:])
        else:
            raise ValueError(f"{name!r}: unknown variant {VARIANT_SEP}{part}; variants are "
                             f"{VARIANT_SEP}keep, {VARIANT_SEP}none, {VARIANT_SEP}accN "
                             f"(N microbatches a step) and {VARIANT_SEP}{PAGES}")
    return base, set_to_none, accumulate


def shares_pages(name: str) -> bool:
    """Whether ``name``'s variant builds its stack with ``share_pool_pages=True``
    (``@pages``)."""
    return PAGES in name.split(VARIANT_SEP)[1:]


def is_planned(name: str) -> bool:
    """Whether ``name`` builds its stack from the budget planner."""
    name = base_config(name)
    return name == "graph_auto" or name.startswith(BUDGET_PREFIX)


def check_config(name: str) -> None:
    """``ValueError`` naming ``name`` when it is no configuration."""
    base = split_variant(name)[0]
    if shares_pages(name) and not (base.startswith("graph") or base.startswith(BUDGET_PREFIX)):
        raise ValueError(f"{name!r}: {VARIANT_SEP}{PAGES} puts a GraphedLayers stack's graph pool "
                         f"on shared pages; {base} builds none")
    name = base
    if name.startswith(BUDGET_PREFIX):
        try:
            budget_bytes(name)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None
    elif name not in CONFIGS:
        raise ValueError(f"unknown {name!r}; choose from {','.join(CONFIGS)} or "
                         f"{BUDGET_PREFIX}<size>")


def _round_up_name(n: float) -> str:
    """A budget name for ``n`` bytes: rounded up to a hundredth of its unit (GiB, MiB or
    KiB), so that the name reads well and says exactly the bytes it stands for."""
    unit, scale = next(((u, s) for u, s in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10))
                        if n >= s), ("KiB", 1 << 10))
    hundredths = math.ceil(round(n / scale * 100, 6))
    return budget_config(f"{hundredths / 100:.2f}{unit}")


def sweep_budgets(configs: dict[str, dict[str, Any]], n: int = SWEEP_BUDGETS) -> list[str] | str:
    """``--budgets sweep``: the checkpoint peer's measured peak, then ``n - 1`` budgets
    evenly spaced up to the ``graph`` configuration's peak, as configuration names (each
    rounded up to a hundredth of its unit, duplicates dropped); or why there are none.

    Args:
        configs: the report's configurations so far (checkpoint's and graph's entries).
        n: how many budgets.
    """
    peaks = {}
    for name in ("checkpoint", "graph"):
        c = configs.get(name)
        if c is None:
            return f"the sweep needs the {name} configuration, which did not run"
        if "reason" in c:
            return f"the sweep needs {name}'s peak; it did not run: {c['reason']}"
        if c.get("peak_device_bytes") is None:
            return f"the sweep needs {name}'s peak, which this backend's allocator does not keep"
        peaks[name] = c["peak_device_bytes"]
    lo, hi = peaks["checkpoint"], max(peaks["checkpoint"], peaks["graph"])
    names = [_round_up_name(lo + (hi - lo) * i / (n - 1)) for i in range(n)] if n > 1 else \
        [_round_up_name(lo)]
    return list(dict.fromkeys(names))


def unsupported(b: Backend, name: str) -> str | None:
    """Why configuration ``name`` cannot run on ``b`` (whatever the shape), or None."""
    try:
        check_config(name)
    except ValueError as e:
        return str(e)
    name = base_config(name)
    if name in ("torch_graphed", "torch_graphed_checkpoint") and not b.has_graphed_callables:
        return (f"torch.cuda.make_graphed_callables needs CUDA; the {b.name} backend's framework "
                "has no graphed callables to compare with")
    if name == "save_on_cpu" and b.device.type == "cpu":
        return ("save_on_cpu moves device tensors to pinned host memory; on the cpu backend "
                "they already are on the host")
    return None


def saved_on_device(r: Inputs, name: str, stack: Any = None) -> int:
    """What configuration ``name`` holds of the saved activations at the forward/backward
    boundary outside graphslot's pages (which its offload engine counts): every layer's,
    but an offloaded layer's, and a recomputed (checkpointed) layer's input only."""
    inp = r.x.numel() * r.x.element_size()
    if stack is not None:
        offloaded: set[int] = stack.offload_layers if stack.mode.value != "off" else set()
        recomputed: set[int] = stack.recompute_layers
        if not offloaded and not recomputed:
            return r.saved
        return sum(s for i, s in enumerate(r.saved_per_layer)
                   if i not in offloaded and i not in recomputed) + len(recomputed) * inp
    name = base_config(name)
    if name in ("eager", "torch_graphed"):
        return r.saved
    if name in ("checkpoint", "torch_graphed_checkpoint"):
        return r.shape.layers * inp
    return 0  # save_on_cpu


def forward(modules: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The eager forward: ``modules`` in turn."""
    h = x
    for m in modules:
        h = m(h)
    return h


def _forward_saving_on_cpu(modules: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return forward(modules, x)


def _torch_graphed(b: Backend, modules: Sequence[torch.nn.Module], x: torch.Tensor) -> None:
    """The framework's graphed callables (``torch.cuda.make_graphed_callables``) over
    ``modules``, as PyTorch documents for a sequence of modules: one sample input each."""
    samples = tuple((torch.empty_like(x).requires_grad_(i > 0 or x.requires_grad),)
                    for i in range(len(modules)))
    b.make_graphed_callables(tuple(modules), samples)


def _ungraph(modules: Sequence[torch.nn.Module]) -> None:
    """Undo :func:`_torch_graphed`: it replaced each module's ``forward``."""
    for m in modules:
        if "forward" in vars(m):
            del m.forward


def build(r: Inputs, name: str) -> Built | str:
    """Configuration ``name`` built on ``r``'s layers, or why it cannot be (a budget the
    planner cannot reach: its UsageError's message).

    Raises:
        UsageError: anything else the library refused.
    """
    from graphslot.adapters.torch import GraphedLayers

    b, layers, x, bar = r.b, r.layers, r.x, r.bar
    label, name = name, base_config(name)
    if name in ("eager", "save_on_cpu", "checkpoint"):
        mods: Sequence[torch.nn.Module] = layers
        if name == "checkpoint":
            mods = [CheckpointedLayer(m) for m in layers]
        fwd = _forward_saving_on_cpu if name == "save_on_cpu" else forward
        return Built(None, functools.partial(fwd, mods, x), mods)
    if name in ("torch_graphed", "torch_graphed_checkpoint"):
        # the device's RNG state cannot be read while a graph is captured
        mods = layers if name == "torch_graphed" else [
            CheckpointedLayer(m, preserve_rng_state=False) for m in layers]
        bar.update(f"{label}: capture", advance=False)
        _torch_graphed(b, mods, x)
        return Built(None, functools.partial(forward, mods, x), mods,
                     functools.partial(_ungraph, mods))
    kw: dict[str, Any] = {}
    if name in ("graph", "graph_resident", "graph_remap"):
        kw["mode"] = {"graph": "off", "graph_resident": "resident", "graph_remap": "remap"}[name]
    elif name == "graph_recompute":
        kw.update(mode="off", recompute_layers=range(len(layers)))
    elif name == "graph_recompute_parts":
        every = range(len(layers))
        kw.update(mode="remap", recompute_layers=every, recompute_ops="parts", offload_layers=every)
    elif name == "graph_auto":
        kw["memory_budget"] = "auto"
    else:
        kw["memory_budget"] = budget_bytes(name)
    bar.update(f"{label}: capture", advance=False)
    try:
        # (a loop that keeps .grad through the next forward says so: see keep_grads)
        stack = GraphedLayers(layers, x, backend=b, warmup_iters=2,
                              layers_per_graph=r.layers_per_graph,
                              keep_grads=not r.set_to_none or r.accumulate > 1,
                              share_pool_pages=shares_pages(label), **kw)
    except UsageError as e:
        if name == "graph_recompute_parts":
            return str(e)  # (layers without parts, or that draw random numbers)
        if "memory_budget" not in kw:
            raise
        least = getattr(e, "least_plan", None)  # (what it built on the way, and held)
        tried = "; ".join(f"{s} {m} {format_bytes(h)}" for s, m, h in getattr(least, "builds", ()))
        return (f"the planner refused the budget: {e}"  # below the smallest reachable
                + (f" (built on the way: {tried})" if tried else ""))
    return Built(stack, functools.partial(stack, x), layers, stack.close)


def plan_report(stack: Any, accumulate: int) -> dict[str, Any] | None:
    """What a planned stack's ``plan`` says (``BudgetPlan.as_dict()``), or None without one.

    The plan's times are per pass (one forward and backward); with ``accumulate``
    microbatches per step they are multiplied to per step, as the bench reports every time
    (``predicted_step_ms``, ``lower_bound_ms``, ``recompute_ms``; the plan's own figures
    stay under ``per_pass``)."""
    plan = getattr(stack, "plan", None)
    if plan is None:
        return None
    d = dict(plan.as_dict())
    d["choices"] = list(d["choices"])
    if plan.profile is not None:  # what the planner decided from (the model's inputs)
        d["profile"] = dataclasses.asdict(plan.profile)
    d["per_pass"] = {k: d[k] for k in ("predicted_step_ms", "lower_bound_ms", "recompute_ms",
                                       "offloaded_bytes")}
    for k in ("predicted_step_ms", "lower_bound_ms", "recompute_ms", "offloaded_bytes"):
        d[k] = d[k] * accumulate
    return d
