"""Measuring what a layer stack costs, for the budget planner (:mod:`graphslot.budget`).

:func:`profile_units` runs each unit (a layer, or a run of joined layers) eagerly on the
device: its forward and backward time from device events (where the backend can keep the
device busy while the host queues the work, the device's time alone, as a graph of it
runs), what its forward saves for
backward, the working memory its backward needs beyond that, what recomputing it cheaply
keeps and costs (:mod:`graphslot.recompute`), and the copy bandwidth to and from pinned
host memory. It costs a couple of eager steps of the stack, one unit's
activations at a time, and leaves nothing behind but cached allocator blocks (returned).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
import torch.utils.checkpoint

from .backend import Backend
from .budget import LayerCost
from .errors import UsageError
from .layer_calls import naming_refusals
from .memory import run_counting_saved, saved_bytes_by_part
from .offload import leaves_on_device, watching_saved_values
from .precision import without_autocast
from .recompute import (checkpointing_parts, cheap_recompute_contexts, noting_changed_buffers,
                        noting_draws, noting_expensive_outputs, recompute_parts)

__all__ = ["copy_bandwidth", "profile_units", "held_bytes"]

def copy_bandwidth(b: Backend, nbytes: int, reps: int = 5) -> dict[str, float]:
    """GB/s device to pinned host (``d2h_gbps``), pinned host to device (``h2d_gbps``),
    both directions at once (``both_total_gbps``) and device to device (``d2d_gbps``, bytes
    copied): the median of ``reps`` copies of ``nbytes`` each, after one dropped."""
    nbytes = max(1, int(nbytes))
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
            times.append(max(t["device_ms"], 1e-6))
        return nbytes / (statistics.median(times[1:]) / 1e3) / 1e9

    d2h = one_way(host_a, dev_a)
    h2d = one_way(dev_b, host_b)
    d2d = one_way(dev_b, dev_a)
    both = []
    for _ in range(reps + 1):
        b.synchronize()
        t0 = time.perf_counter()
        b.copy_async(host_a, dev_a, s1)
        b.copy_async(dev_b, host_b, s2)
        b.synchronize()
        both.append(max(time.perf_counter() - t0, 1e-9))
    return {"d2h_gbps": d2h, "h2d_gbps": h2d, "d2d_gbps": d2d,
            "both_total_gbps": 2 * nbytes / statistics.median(both[1:]) / 1e9}


def held_bytes(b: Backend) -> int | None:
    """Device memory the process holds now as the budget counts it: the framework
    allocator's reserved bytes outside graphslot's regions plus graphslot's mapped pages
    (None where the allocator cannot tell)."""
    reserved = b.allocator_stats()["reserved_bytes"]
    if reserved is None:
        return None
    # (a region pool's segments are graphslot's pages, which the ledger counts as mapped)
    return reserved - b.region_reserved_bytes() + b.ledger.mapped_bytes


class _Ahead:
    """How long :meth:`Backend.timed <graphslot.backend.Backend.timed>` keeps the device
    busy before each kind of timed region (``ahead_ms``), so the host queues all of it
    first: twice the host time it took before plus a ms, doubled while the device still
    started early. Zero where the backend cannot, and for a kind whose host waited out
    the whole spin twice running and still did not get ahead: its region waits for the
    device itself (a synchronising call), and a longer spin would only cost time. Once
    may be a stall of the host's own (a busy machine), so the first time keeps the spin."""

    LIMIT_MS = 2000.0

    def __init__(self, b: Backend, first_ms: dict[str, float]) -> None:
        self.on = b.capabilities.spin
        self.ms = {k: min(v, self.LIMIT_MS) for k, v in first_ms.items()}
        self.waited: set[str] = set()  # kinds whose host sat out the last spin

    def __call__(self, kind: str) -> float:
        return self.ms[kind] if self.on else 0.0

    def saw(self, kind: str, t: dict[str, float]) -> None:
        if not self.on or self.ms[kind] == 0.0:
            return
        given = self(kind)
        sat_out = not t["device_alone"] and t["host_ms"] >= given
        if t["device_alone"]:
            need = 2 * t["host_ms"] + 1
        elif sat_out:
            need = 0.0 if kind in self.waited else given
        else:
            need = max(2 * t["host_ms"] + 1, 2 * given)
        if sat_out:
            self.waited.add(kind)
        else:
            self.waited.discard(kind)
        self.ms[kind] = min(need, self.LIMIT_MS)


def profile_units(b: Backend, units: Sequence[torch.nn.Module], sample: torch.Tensor, *,
                  iters: int = 2, labels: Sequence[str] | None = None,
                  parts: Sequence[Sequence[torch.nn.Module]] | None = None) -> list[LayerCost]:
    """Each unit's :class:`~graphslot.budget.LayerCost`, measured eagerly on ``b``'s device.

    Args:
        b: the backend.
        units: modules applied in order, each one tensor to one tensor.
        sample: the stack's input (shape, dtype and device as at run time).
        iters: timed repetitions per unit after one warm-up (the least is taken; one
            more where the backend times the device alone, the first finding how long
            the host takes).
        labels: what errors call each unit (default ``"layer K"``, K its index).
        parts: each unit's parts, recomputed one at a time where the plan says so
            (default: :func:`~graphslot.recompute.recompute_parts` of each unit; a unit
            of several layers has theirs).

    Raises:
        UsageError: a unit does not return one tensor.
    """
    costs: list[LayerCost] = []
    x = sample.detach().requires_grad_(sample.requires_grad)
    seen: set[int] = set()  # parameters counted already (a tied one has one gradient)
    sees_peak = b.allocator_stats()["peak_allocated_bytes"] is not None
    for k, m in enumerate(units):
        label = f"layer {k}" if labels is None else labels[k]
        params = [p for p in m.parameters() if p.requires_grad]
        inputs = ([x] if x.requires_grad else []) + params
        state = leaves_on_device([m], x.device.type)
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        # A first, untimed forward counts what it saves (and warms the unit up), and what
        # its expensive ops return (what a cheap recompute keeps).
        kept: dict[int, int] = {}

        def note(t: torch.Tensor) -> None:
            if t.device.type == x.device.type:
                s = t.untyped_storage()
                kept[s.data_ptr()] = s.nbytes()

        t0 = time.perf_counter()
        with noting_changed_buffers(m) as buffers, noting_expensive_outputs(note) as changed, \
                noting_draws() as drawn:
            with naming_refusals(label):
                y, saved = run_counting_saved(lambda: m(x), x.device.type, [m])
        # (a recompute saves, with the input, the buffers the forward changes as it found
        # them: it runs again from those)
        changed_bytes = sum(t.numel() * t.element_size() for t in buffers)
        # (the host's time for a forward, counting hooks and all, is the measure to start
        # with; a cheap recompute runs a forward twice and dispatches each op in Python)
        host = (time.perf_counter() - t0) * 1e3
        ahead = _Ahead(b, {"forward": 4 * host + 2, "backward": 4 * host + 2,
                           "cheap": 8 * host + 2, "parts_forward": 4 * host + 2,
                           "parts_backward": 8 * host + 2})
        reps = iters + 1 if ahead.on else iters
        cheap_bytes = sum(kept.values())
        if not isinstance(y, torch.Tensor):
            raise UsageError(f"{label} returned {type(y).__name__}; graphed layers must "
                             "return one tensor")
        del y
        with naming_refusals(label):  # (its backward: a reentrant checkpoint)
            fwd_ms, bwd_ms, work, out = _passes(b, m, x, inputs, grad_bytes, ahead, reps)
        if not sees_peak:
            work = 2 * out.numel() * out.element_size()  # an output's gradient and a temporary
        # A forward that fills a tensor after saving it (RReLU's noise) keeps its
        # activations on the device: a slot would copy the tensor unfilled, and a
        # recompute's backward reads it unfilled too. (One more forward, after the timed
        # ones: the counting one keeps nothing autograd could watch.)
        with naming_refusals(label), watching_saved_values(
                lambda t: not state(t)) as late:
            y_watch = m(x)
        del y_watch
        cheap_ms: float | None = None
        recompute_calls = frozenset(changed)
        if cheap_bytes and inputs and recompute_calls:
            # Outputs the forward changes in place are made again, not kept: count what
            # the cheap recompute keeps then.
            kept.clear()
            y = torch.utils.checkpoint.checkpoint(
                m, x, use_reentrant=False, context_fn=cheap_recompute_contexts(note, recompute_calls))
            del y
            cheap_bytes = sum(kept.values())
        if 0 < cheap_bytes < saved and inputs:
            # Recomputed cheaply, forward and backward take this much more than plainly.
            both = []
            for _ in range(reps):
                b.synchronize()
                with b.timed(ahead_ms=ahead("cheap")) as tc:
                    y = torch.utils.checkpoint.checkpoint(
                        m, x, use_reentrant=False,
                        context_fn=cheap_recompute_contexts(recompute_calls=recompute_calls))
                    with without_autocast(x.device.type):
                        torch.autograd.grad(y, inputs, torch.ones_like(y), allow_unused=True)
                    del y
                ahead.saw("cheap", tc)
                both.append(tc["device_ms"])
            cheap_ms = min(max(0.0, min(both) - min(fwd_ms) - min(bwd_ms)), min(fwd_ms))
        # Recomputed part by part (not where a part would draw other random numbers or
        # change buffers a second time, nor where it saves no less than whole)
        these = list(recompute_parts(m) if parts is None else parts[k])
        if not inputs or late or buffers or drawn:
            these = []
        parts_cost: dict[str, Any] = {}  # (LayerCost's parts_* figures, where offered)
        if these:
            inplace: list[str] = []  # (a part's saved input changed in place: not offered)
            with checkpointing_parts(these, inplace), naming_refusals(label):
                y = m(x)  # (judges which parts are cheap, for what is counted next)
            del y
            with checkpointing_parts(these), naming_refusals(label):
                y, parts_saved = run_counting_saved(lambda: m(x), x.device.type, [m])
            del y
            if parts_saved < saved and not inplace:
                with checkpointing_parts(these), naming_refusals(label):
                    pf, pb, parts_work, _ = _passes(b, m, x, inputs, grad_bytes, ahead, reps,
                                                    ("parts_forward", "parts_backward"))
                parts_ms = min(f + g for f, g in zip(pf, pb))
                if not sees_peak:  # (the largest part's activations again, beside the rest)
                    parts_work = work + max(saved_bytes_by_part(
                        lambda: m(x), x.device.type, [m], these))
                parts_cost = dict(parts_saved_bytes=parts_saved, parts_work_bytes=parts_work,
                                  parts_recompute_ms=min(max(0.0, parts_ms - min(fwd_ms) - min(bwd_ms)),
                                                         min(fwd_ms)))
        own = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in own)
        costs.append(LayerCost(forward_ms=min(fwd_ms), backward_ms=min(bwd_ms),
                               saved_bytes=saved, work_bytes=max(0, work),
                               input_bytes=x.numel() * x.element_size() + changed_bytes,
                               grad_bytes=sum(p.numel() * p.element_size() for p in own),
                               cheap_saved_bytes=None if cheap_ms is None else cheap_bytes,
                               cheap_recompute_ms=cheap_ms, keep_only=bool(late), **parts_cost))
        x = out.requires_grad_(x.requires_grad or bool(params))
    b.synchronize()
    return costs



def _passes(b: Backend, m: torch.nn.Module, x: torch.Tensor, inputs: list[torch.Tensor],
            grad_bytes: int, ahead: _Ahead, reps: int,
            kinds: tuple[str, str] = ("forward", "backward"),
            ) -> tuple[list[float], list[float], int, torch.Tensor]:
    """``reps`` timed forwards and backwards of ``m`` (``kinds``: their names in ``ahead``):
    each one's device time, the backward's working memory beyond what the forward left
    (its saved tensors and output) and the parameter gradients (0 where the allocator
    keeps no peak), and the last output, detached."""
    fwd_ms: list[float] = []
    bwd_ms: list[float] = []
    work = 0
    for _ in range(reps):
        b.synchronize()
        b.allocator_stats(reset_peak=True)
        with b.timed(ahead_ms=ahead(kinds[0])) as tf:
            y = m(x)
        gy = torch.ones_like(y)
        after_fwd = b.allocator_stats()["allocated_bytes"]
        with b.timed(ahead_ms=ahead(kinds[1])) as tb, without_autocast(x.device.type):
            if inputs and y.requires_grad:
                grads = torch.autograd.grad(y, inputs, gy, allow_unused=True)
                del grads
        ahead.saw(kinds[0], tf)
        ahead.saw(kinds[1], tb)
        fwd_ms.append(tf["device_ms"])
        bwd_ms.append(tb["device_ms"])
        peak = b.allocator_stats()["peak_allocated_bytes"]
        if peak is not None and after_fwd is not None:
            work = max(work, peak - after_fwd - grad_bytes)
        out = y.detach()
        del y, gy
    return fwd_ms, bwd_ms, work, out
