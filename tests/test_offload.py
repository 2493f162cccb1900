"""Graph-safe activation offload: the same tests on every backend."""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import CaptureMismatchError, InjectedFault, StateError, UsageError
from graphslot.offload import Mode, OffloadEngine
from graphslot.offload.states import TRANSITIONS, State
from graphslot.cli.toy import GPTConfig, TinyGPT
from devices import spin
from stacks import graphed


def small(b: graphslot.Backend, layers: int) -> tuple[TinyGPT, GPTConfig]:
    c = GPTConfig(hidden=32, heads=2, ffn=64, seq=16, batch=2, layers=layers, vocab=64)
    torch.manual_seed(layers)
    return TinyGPT(c).to(b.device), c


def train(model: TinyGPT, b: graphslot.Backend, steps: int, accumulate: int = 1) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for step in range(steps):
        for micro in range(accumulate):
            tokens, targets = model.batch(step * accumulate + micro, b.device)
            loss = model(tokens, targets)
            loss.backward()
            out.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    out += [p.detach().clone() for p in model.parameters()]
    return out


def assert_bitwise(a: list[torch.Tensor], c: list[torch.Tensor]) -> None:
    assert len(a) == len(c)
    for i, (x, y) in enumerate(zip(a, c)):
        assert torch.equal(x, y), f"tensor {i} differs by {float((x.float() - y.float()).abs().max())}"


@pytest.fixture
def engine_clean(clean):
    yield clean


def slow_copies(monkeypatch: pytest.MonkeyPatch, engine: OffloadEngine, seconds: float) -> None:
    """Make every copy on the engine's copy streams start ``seconds`` late (busy work queued
    on that stream first), so a missing fence shows as corrupted activations."""
    b = engine.backend
    real = b.copy_async

    def slowed(dst, src, stream=None):
        if stream is not None and stream in (engine.d2h_stream, engine.h2d_stream):
            spin(b, seconds, stream)
        return real(dst, src, stream)

    monkeypatch.setattr(b, "copy_async", slowed)


# --------------------------------------------------------------------------- equality with eager


@pytest.mark.parametrize("mode", ["resident", "remap"])
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("section_bytes", [None, 4096])
def test_bitwise_equal_with_eager_for_20_steps(engine_clean, mode, layers, section_bytes):
    b = engine_clean
    base, _ = small(b, layers)
    want = train(copy.deepcopy(base), b, 20)
    model = copy.deepcopy(base)
    kw = {} if section_bytes is None else {"section_bytes": section_bytes}
    with graphed(model, b, mode, **kw) as stack:
        got = train(model, b, 20)
        assert_bitwise(got, want)
        stats = stack.engine.stats
        banks = len(stack.engine.residency.classes[0])
        sections = len(stack.engine.groups[0].sections)
        # Both modes hold the newest forward in its bank, so the last layer's activations,
        # whose backward comes next, are never copied. With two banks alternating (resident;
        # remap with slots of one section) the layer before it goes to the host, but its
        # bank still holds it at its backward, so it is not copied back. Remap with slots
        # that stream in sections (where graphs hold events) has one bank, which the last
        # layer rewrote. Every other layer goes to the host and back.
        assert sections == (1 if section_bytes is None else -(-stack.engine.groups[0].nbytes // 4096))
        assert banks == (1 if mode == "remap" and sections > 1 and b.graph_events else 2)
        one = max(g.host_bytes for g in stack.engine.groups)
        in_place = min(1, layers - 1) if banks == 2 else 0
        assert stats["held_bytes"] == 20 * one
        assert stats["kept_in_place_bytes"] == 20 * in_place * one
        assert stats["offloaded_bytes"] == 20 * (layers - 1) * one
        assert stats["restored_bytes"] == 20 * (layers - 1 - in_place) * one
        g = stack.engine.groups[0]
        assert g.fwd_in_graph == g.bwd_in_graph == b.graph_events


def test_gradient_accumulation_and_mode_off(engine_clean):
    b = engine_clean
    base, _ = small(b, 2)
    want = train(copy.deepcopy(base), b, 4, accumulate=3)
    for mode in ("resident", "off"):
        model = copy.deepcopy(base)
        with graphed(model, b, mode):
            assert_bitwise(train(model, b, 4, accumulate=3), want)


def two_in_flight(model: TinyGPT, b: graphslot.Backend, steps: int) -> list[torch.Tensor]:
    """Two microbatches' forwards, then both backwards (mb 0 first), each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        losses = []
        for micro in range(2):
            tokens, targets = model.batch(2 * step + micro, b.device)
            losses.append(model(tokens, targets))
        for loss in losses:
            loss.backward()
            out.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_two_microbatches_in_flight_never_overwrite_each_other(engine_clean, mode, monkeypatch):
    b = engine_clean
    base, _ = small(b, 4)
    want = two_in_flight(copy.deepcopy(base), b, 3)
    model = copy.deepcopy(base)
    with graphed(model, b, mode, debug_checksums=True) as stack:
        slow_copies(monkeypatch, stack.engine, 0.01)
        assert_bitwise(two_in_flight(model, b, 3), want)


def scheduled(model: TinyGPT, b: graphslot.Backend, steps: int, order: str) -> list[torch.Tensor]:
    """Per step, run ``order``: ``F<k>`` a training forward of microbatch k, ``B<k>`` its
    backward, ``E`` a forward under no_grad in between (evaluation)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        losses: dict[str, torch.Tensor] = {}
        for op in order.split():
            if op == "E":
                with torch.no_grad():
                    out.append(model(*model.batch(1000 + step, b.device)))
            elif op[0] == "F":
                losses[op[1:]] = model(*model.batch(10 * step + int(op[1:]), b.device))
            else:
                loss = losses.pop(op[1:])
                loss.backward()
                out.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode,kw", [("off", {}), ("resident", {"offload_layers": [1, 3]}),
                                     ("remap", {"offload_layers": [0]})])
@pytest.mark.parametrize("order", ["F0 F1 B0 B1", "F0 F1 F2 B2 E B0 B1", "F0 E F1 B1 F2 B0 B2"])
def test_layers_kept_on_the_device_take_several_microbatches_in_flight(engine_clean, mode, kw, order):
    b = engine_clean
    base, _ = small(b, 4)
    want = scheduled(copy.deepcopy(base), b, 2, order)
    model = copy.deepcopy(base)
    with graphed(model, b, mode, **kw):
        assert_bitwise(scheduled(model, b, 2, order), want)


def test_without_parking_a_second_microbatch_overwrites_the_first(engine_clean, monkeypatch):
    """The control for the test above: moving kept activations out is what keeps them."""
    b = engine_clean
    base, _ = small(b, 4)
    order = "F0 F1 B0 B1"
    want = scheduled(copy.deepcopy(base), b, 1, order)
    model = copy.deepcopy(base)
    with graphed(model, b, "off") as stack:
        monkeypatch.setattr(stack.engine.kept, "claim", lambda mb: None)
        got = scheduled(model, b, 1, order)
    assert not all(torch.equal(x, y) for x, y in zip(got, want))


def test_kept_activations_move_out_for_another_microbatch_and_back_for_their_backward(engine_clean):
    b = engine_clean
    eng = OffloadEngine(b, "resident")
    try:
        g = eng.group("kept", offload=False)
        assert not g.wants_offload and not g.offloads
        g.allocate()
        g.begin_capture()
        g.finish_capture()
        mem = torch.zeros(1000, dtype=torch.uint8, device=b.device)  # "the graph's memory"
        g.keep([mem[:600], mem[600:].view(torch.int32)])
        assert g.kept_bytes == 1000 and eng.kept.groups == [g]

        def forward(mb: int, fill: int):
            t = eng.before_forward(g, mb)
            mem.fill_(fill)  # what the replay writes
            eng.after_forward(t)
            return t

        t1 = forward(1, 11)
        assert t1.state is State.KEPT and eng.resident_device_bytes == b.ledger.mapped_bytes
        t2 = forward(2, 22)  # microbatch 1 moved out before this replay wrote
        assert t1.state is State.PARKED and t2.state is State.KEPT
        assert eng.stats["parked_bytes"] == 1000
        assert eng.resident_device_bytes == b.ledger.mapped_bytes + 1000
        eng.wait_restored(eng.ticket(g, 1))  # microbatch 2 moves out, microbatch 1 comes back
        b.synchronize()
        assert t1.state is State.RESTORED and bool((mem == 11).all())
        eng.consumed(t1)
        assert t2.state is State.PARKED
        eng.wait_restored(eng.ticket(g, 2))
        b.synchronize()
        assert bool((mem == 22).all())
        eng.consumed(t2)
        assert not eng.in_flight() and eng.resident_device_bytes == b.ledger.mapped_bytes
        assert eng.stats["parked_bytes"] == 2000  # each moved out once
        # One microbatch at a time moves nothing.
        for mb in (3, 4):
            t = forward(mb, mb)
            eng.wait_restored(eng.ticket(g, mb))
            eng.consumed(t)
        assert eng.stats["parked_bytes"] == 2000
        # A parked forward that is abandoned drops its buffer.
        forward(5, 5)
        forward(6, 6)
        eng.abandon(eng.ticket(g, 5))
        eng.abandon(eng.ticket(g, 6))
        assert not eng.in_flight() and eng.resident_device_bytes == b.ledger.mapped_bytes
    finally:
        eng.close()


def test_kept_groups_refuse_what_they_cannot_do(engine_clean):
    b = engine_clean
    eng = OffloadEngine(b, "remap")
    try:
        off = eng.group("offloads")
        with pytest.raises(UsageError, match="keep\\(\\) is for groups that do not offload"):
            off.keep([])
        kept = eng.group("kept", offload=False)
        with pytest.raises(StateError, match="cannot keep in state discovering"):
            kept.keep([])
        kept.discover(torch.ones(4, device=b.device))
        with pytest.raises(UsageError, match="does not offload: its saved tensors stay in the graph's memory"):
            kept.allocate()
        kept2 = eng.group("kept2", offload=False)
        kept2.allocate()
        kept2.begin_capture()
        kept2.finish_capture()
        with pytest.raises(UsageError, match="a kept view must be contiguous"):
            kept2.keep([torch.zeros(4, 4, device=b.device).t()])
        assert b.ledger.mapped_bytes == 0
    finally:
        eng.close()
    assert OffloadEngine(b, "off").group("g").offloads is False


# --------------------------------------------------------------------------- fences


@pytest.mark.parametrize("mode", ["resident", "remap"])
@pytest.mark.parametrize("graph_events", [True, False])
@pytest.mark.parametrize("section_bytes", [None, 16384])
def test_fences_hold_when_the_copy_streams_are_slowed(engine_clean, mode, monkeypatch, graph_events,
                                                      section_bytes):
    """Copies that start late still land in order: in the graphs' own section events where
    the backend has them, and in the host's fences where it has not (or is told so)."""
    b = engine_clean
    if graph_events and not b.graph_events:
        pytest.skip(f"the {b.name} backend's graphs hold no events")
    monkeypatch.setattr(b, "capabilities", dataclasses.replace(b.capabilities, graph_events=graph_events))
    base, _ = small(b, 4)
    want = train(copy.deepcopy(base), b, 3)
    model = copy.deepcopy(base)
    kw = {} if section_bytes is None else {"section_bytes": section_bytes}
    with graphed(model, b, mode, **kw) as stack:
        g = stack.engine.groups[0]
        assert g.fwd_in_graph == g.bwd_in_graph == graph_events
        slow_copies(monkeypatch, stack.engine, 0.05)
        assert_bitwise(train(model, b, 3), want)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_without_the_graphs_section_waits_slowed_copies_corrupt_activations(engine_clean, monkeypatch, mode):
    """The control for the test above: the waits inside the graphs are what keeps it right."""
    b = engine_clean
    if not b.graph_events:
        pytest.skip(f"the {b.name} backend's graphs hold no events")
    base, _ = small(b, 4)
    want = train(copy.deepcopy(base), b, 2)
    model = copy.deepcopy(base)
    monkeypatch.setattr(b, "graph_wait", lambda event: None)  # graphs captured without waits
    with graphed(model, b, mode, section_bytes=16384) as stack:
        slow_copies(monkeypatch, stack.engine, 0.1)
        got = train(model, b, 2)
        stack.engine.wait_idle()
        assert not all(torch.equal(x, y) for x, y in zip(got, want))


def test_resident_mode_makes_no_driver_calls_and_no_host_syncs(engine_clean):
    b = engine_clean
    model, _ = small(b, 3)
    with graphed(model, b, "resident") as stack:
        train(model, b, 2)  # host buffers get made in the first step
        calls, syncs = b.driver_calls(), b.counters["host_sync"]
        buffers = stack.engine.stats["host_buffers_allocated"]
        train(model, b, 5)
        assert b.driver_calls() == calls
        assert b.counters["host_sync"] == syncs
        assert stack.engine.stats["host_buffers_allocated"] == buffers, "host buffers were reallocated"


def test_remap_mode_releases_memory_and_runs_driver_calls_off_the_training_thread(engine_clean, monkeypatch):
    b = engine_clean
    model, _ = small(b, 3)
    stack = graphed(model, b, "remap", section_bytes=4096)
    threads: list[str] = []
    real = b.driver.map

    def spy(*a):
        threads.append(threading.current_thread().name)
        return real(*a)

    try:
        monkeypatch.setattr(b.driver, "map", spy)
        assert b.ledger.mapped_bytes == 0, "remap mode holds pages before any pass"
        banks = stack.engine.residency.banks
        assert len(banks) == (1 if b.graph_events else 2)
        syncs = b.counters["host_sync"]
        tokens, targets = model.batch(0, b.device)
        loss = model(tokens, targets)
        stack.engine.wait_idle()
        # In flight: the bank, one slot's worth where slots stream in sections.
        assert b.ledger.mapped_bytes == sum(bank.size for bank in banks)
        loss.backward()
        stack.engine.wait_idle()
        assert b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
        assert threads and set(threads) == {"graphslot-driver"}
        assert b.counters["host_sync"] - syncs == 2  # only the two wait_idle() calls above
    finally:
        stack.close()


@pytest.mark.parametrize("section_bytes", [None, 4096])
def test_remap_maps_each_bank_once_a_step_and_holds_none_while_idle(engine_clean, section_bytes):
    b = engine_clean
    model, _ = small(b, 4)
    kw = {} if section_bytes is None else {"section_bytes": section_bytes}
    stack = graphed(model, b, "remap", **kw)
    try:
        banks = stack.engine.residency.banks
        ops = ("create", "map", "set_access", "unmap", "release")

        def step() -> None:
            model(*model.batch(0, b.device)).backward()

        step()
        stack.engine.wait_idle()
        before = dict(b.counters)
        steps = 3
        for _ in range(steps):
            step()
            stack.engine.wait_idle()  # the device runs dry: the banks go
            assert b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
        calls = {op: b.counters[op] - before.get(op, 0) for op in ops}
        assert calls == {op: steps * len(banks) for op in ops}, calls
        # Evaluation forwards announce the next layer: the banks stay for the whole pass.
        before = dict(b.counters)
        with torch.no_grad():
            model(*model.batch(0, b.device))
        stack.engine.wait_idle()
        assert b.ledger.mapped_bytes == 0
        assert b.counters["map"] - before.get("map", 0) == len(banks)
        # Steps queued back to back: a pass that comes before the release started takes
        # the banks back as they are (the worker is held up here, as by a busy device).
        gate = threading.Event()
        loss = model(*model.batch(0, b.device))  # maps the banks
        before = dict(b.counters)
        stack.engine.worker.submit(gate.wait)
        loss.backward()  # its release is queued behind the gate...
        step()  # ...and called off by this step's first forward
        gate.set()
        stack.engine.worker.drain()
        assert all(b.counters[op] == before.get(op, 0) for op in ops[:3]), "the banks were mapped again"
        assert b.counters["unmap"] - before.get("unmap", 0) == len(banks)  # the second step's release
        stack.engine.wait_idle()
        assert b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
    finally:
        stack.close()


def test_remap_holds_one_bank_where_slots_stream_and_trains_like_resident(engine_clean):
    b = engine_clean
    layers = 6
    grads = {}
    for mode in ("resident", "remap"):
        model, _ = small(b, layers)
        with graphed(model, b, mode, section_bytes=4096) as stack:
            eng = stack.engine
            banks = eng.residency.banks
            peak = 0
            for step in range(3):
                b.ledger.reset_peak()
                loss = model(*model.batch(step, b.device))
                loss.backward()
                eng.wait_idle()
                peak = max(peak, b.ledger.peak_mapped_bytes)
            assert peak == sum(bank.size for bank in banks)
            if mode == "remap":
                assert b.ledger.mapped_bytes == 0
                assert len(banks) == (1 if b.graph_events else 2)
            grads[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(x, y) for x, y in zip(grads["resident"], grads["remap"]))


def test_section_bytes_is_checked(engine_clean):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="section_bytes must be an integer of bytes, at least 1"):
            OffloadEngine(engine_clean, "remap", section_bytes=bad)


def test_restore_ahead_starts_only_a_restore_the_slot_can_take(engine_clean):
    b = engine_clean
    model, _ = small(b, 3)
    with graphed(model, b, "resident") as stack:
        eng = stack.engine
        loss = model(*model.batch(0, b.device))
        eng.wait_idle()
        g0, g1, g2 = (r.unit.group for r in stack._runners)
        assert g0.bank is g2.bank and g1.bank is not g0.bank
        mb = stack._microbatch
        t0, t1, t2 = (eng.find(g, mb) for g in (g0, g1, g2))
        assert eng.restore_ahead(t2) and t2.state is State.RESTORING
        assert eng.restore_ahead(t2)  # already under way
        assert not eng.restore_ahead(t0) and t0.state is State.RESIDENT_PENDING  # bank holds t2's
        assert eng.restore_ahead(t1) and t1.state is State.RESTORING
        loss.backward()
        assert not eng.in_flight()


def test_resident_banks_hold_two_layers_at_the_boundary(engine_clean):
    b = engine_clean
    model, _ = small(b, 4)
    with graphed(model, b, "resident") as stack:
        groups = stack.engine.groups
        assert {g.bank.index for g in groups} == {0, 1}
        assert groups[-1].bank.index == 0 and groups[-2].bank.index == 1  # backward order
        assert len({g.reservation.va for g in groups}) == 2
        assert b.ledger.mapped_bytes == 2 * groups[0].slot_bytes


def test_lookahead_restores_the_next_layer_right_after_this_backward_graph(engine_clean, monkeypatch):
    """The next layer's restore is queued right after this layer's backward graph is
    launched (its section copies wait for what that graph records as it goes), so it runs
    under this graph rather than after it."""
    b = engine_clean
    model, _ = small(b, 3)
    with graphed(model, b, "resident") as stack:
        log: list[str] = []
        eng = stack.engine
        real_restore = eng.restore
        monkeypatch.setattr(eng, "restore", lambda t: (log.append(f"restore {t.group.name}"), real_restore(t))[1])
        for r in stack._runners:
            real = r.bwd.replay
            monkeypatch.setattr(r.bwd, "replay", (lambda real, n: lambda: (log.append(f"bwd layer{n}"), real())[1])(real, r.index))
        loss = model(*model.batch(0, b.device))
        loss.backward()
        assert log == ["restore layer2", "bwd layer2", "restore layer1", "bwd layer1",
                       "restore layer0", "bwd layer0"]
        # layer2 was held in its bank and layer1 still in place in the other: only layer0's
        # copy comes back, queued before layer1's backward graph had even left the host.
        assert eng.stats["restored_bytes"] == eng.groups[0].host_bytes


# --------------------------------------------------------------------------- pointer semantics


class Sin3(nn.Module):
    """y = sin(3x); autograd saves 3x, which the backward graph reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * 3.0)


def test_naive_reload_reads_the_wrong_bytes_while_the_slot_path_is_right(engine_clean):
    b = engine_clean
    dev = b.device
    x = torch.linspace(-1, 1, 1024, device=dev).requires_grad_()
    gy = torch.ones(1024, device=dev)
    saved: list[torch.Tensor] = []
    fwd = b.new_graph()
    with fwd.capture():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = Sin3()(x)
    bwd = b.new_graph(share_pool_with=fwd)
    with bwd.capture():
        (gx,) = torch.autograd.grad(y, [x], gy)
    new_x = torch.linspace(-2, 0.5, 1024, device=dev)
    with torch.no_grad():
        x.copy_(new_x)
    fwd.replay()
    b.synchronize()
    # Naive offload: copy to host, let the memory go (an interloper reuses it), reload
    # into a fresh allocation.
    (s,) = saved
    host = s.detach().cpu()
    with torch.no_grad():
        s.fill_(123.0)  # what the allocator's next owner wrote there
    reloaded = torch.empty_like(s)
    reloaded.copy_(host.to(dev))
    assert reloaded.data_ptr() != s.data_ptr()
    bwd.replay()
    b.synchronize()
    right = 3.0 * torch.cos(3.0 * new_x)
    assert not torch.allclose(gx, right, atol=1e-3), "the naive reload should have gone unnoticed by the graph"

    # The slot path: same layer, offloaded through a fixed VA, gradients are right.
    with GraphedLayers([Sin3()], torch.zeros(1024, device=dev).requires_grad_(), mode="remap",
                          backend=b) as stack:
        for lo in (-2.0, -1.0, 0.3):
            xi = torch.linspace(lo, lo + 2.5, 1024, device=dev).requires_grad_()
            stack(xi).backward(gy)
            assert torch.allclose(xi.grad, 3.0 * torch.cos(3.0 * xi.detach()), atol=1e-5)


def test_graph_replay_follows_the_pages_behind_a_fixed_va(engine_clean):
    b = engine_clean
    n = b.granularity // 4
    res = b.reserve(b.granularity)
    b.map_new(res, 0, b.granularity)
    src = b.tensor_at(res.va, (n,), torch.float32)
    src.fill_(1.0)
    out = torch.zeros(n, device=b.device)
    g = b.new_graph()
    with g.capture():
        out.copy_(src * 2.0)
    try:
        for value in (5.0, -3.0, 0.25):
            b.synchronize()
            b.unmap_release(res, 0)
            b.map_new(res, 0, b.granularity)
            b.tensor_at(res.va, (n,), torch.float32).fill_(value)
            g.replay()
            b.synchronize()
            assert torch.all(out == 2.0 * value)
    finally:
        b.synchronize()
        b.unmap_release(res, 0)
        b.free(res)


def test_driver_calls_are_refused_during_capture(engine_clean):
    b = engine_clean
    g = b.new_graph()
    x = torch.ones(4, device=b.device)
    with pytest.raises(StateError, match="refused during graph capture"):
        with g.capture():
            x.mul_(2.0)
            b.create(b.granularity)
    assert b.ledger.allocated_bytes == 0


# --------------------------------------------------------------------------- bad input and state


def test_state_table_names_group_state_and_call(engine_clean):
    b = engine_clean
    eng = OffloadEngine(b, "resident")
    g = eng.group("attn")
    with pytest.raises(StateError, match=r"offload group attn: cannot begin_capture in state discovering"):
        g.begin_capture()
    assert (State.DISCOVERING, "allocate") in TRANSITIONS
    eng.close()


def test_bad_mode_and_bad_arguments(engine_clean):
    b = engine_clean
    with pytest.raises(graphslot.UsageError, match="unknown offload mode 'fast'"):
        OffloadEngine(b, "fast")
    model, _ = small(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    with pytest.raises(graphslot.UsageError, match="offload_layers"):
        GraphedLayers(list(model.blocks), sample, offload_layers=[5], backend=b)


def test_input_shape_or_dtype_changes_after_capture_are_refused(engine_clean):
    b = engine_clean
    model, c = small(b, 2)
    with graphed(model, b, "resident") as stack:
        x = torch.zeros(c.batch, c.seq + 1, c.hidden, device=b.device)
        with pytest.raises(CaptureMismatchError, match="captured for input"):
            stack(x)
        with pytest.raises(CaptureMismatchError, match="float64"):
            stack(torch.zeros(c.batch, c.seq, c.hidden, device=b.device, dtype=torch.float64))


def _allocated_group(b: graphslot.Backend, n: int = 1):
    eng = OffloadEngine(b, "remap")
    g = eng.group("g")
    seen = [torch.zeros(64, device=b.device) for _ in range(n)]  # alive, as autograd keeps them
    for t in seen:
        g.discover(t)
    g.allocate()
    return eng, g


def test_capture_twice_and_more_saved_tensors_than_discovery(engine_clean):
    b = engine_clean
    eng, g = _allocated_group(b)
    try:
        g.begin_capture()
        g.save_tensor(torch.ones(64, device=b.device))
        with pytest.raises(CaptureMismatchError, match="more tensors than discovery saw"):
            g.save_tensor(torch.ones(64, device=b.device))
        with pytest.raises(StateError, match="cannot begin_capture in state capturing"):
            g.begin_capture()
        g.finish_capture()
        with pytest.raises(StateError, match="cannot begin_capture in state ready"):
            g.begin_capture()
    finally:
        eng.close()


def test_saved_tensor_that_changed_shape_at_capture(engine_clean):
    b = engine_clean
    eng, g = _allocated_group(b)
    try:
        g.begin_capture()
        with pytest.raises(CaptureMismatchError, match=r"saved tensor #0 is \[32\]"):
            g.save_tensor(torch.ones(32, device=b.device))
        g.save_tensor(torch.ones(64, device=b.device))
        g.finish_capture()
    finally:
        eng.close()


def test_backward_before_forward_is_refused(engine_clean):
    b = engine_clean
    eng, g = _allocated_group(b)
    try:
        g.begin_capture()
        g.save_tensor(torch.ones(64, device=b.device))
        g.finish_capture()
        with pytest.raises(StateError, match="backward for microbatch 7 before its forward"):
            eng.ticket(g, 7)
    finally:
        eng.close()


def test_empty_groups_cost_nothing(engine_clean):
    b = engine_clean

    class Double(nn.Module):
        def forward(self, x):
            return x * 2.0  # saves nothing for backward

    calls = b.driver_calls()
    with GraphedLayers([Double(), Double()], torch.ones(8, device=b.device).requires_grad_(),
                          mode="remap", backend=b) as stack:
        assert all(g.empty and g.reservation is None for g in stack.engine.groups)
        assert b.driver_calls() == calls
        x = torch.ones(8, device=b.device).requires_grad_()
        stack(x).sum().backward()
        stack.engine.wait_idle()
        assert torch.all(x.grad == 4.0) and b.driver_calls() == calls


# --------------------------------------------------------------------------- failure and recovery


def _captured_groups(b: graphslot.Backend, n: int, mode: str = "remap"):
    """An engine with ``n`` one-tensor groups (alternating banks), captured and ready."""
    eng = OffloadEngine(b, mode)
    groups = []
    for i in range(n):
        g = eng.group(f"g{i}")
        g.discover(torch.zeros(64, device=b.device))
        g.allocate(bank_index=i)
        groups.append(g)
    for g in groups:
        g.begin_capture()
        g.save_tensor(torch.ones(64, device=b.device))
        g.finish_capture()
    return eng, groups


def _forward(eng: OffloadEngine, g, mb: int, value: float):
    t = eng.before_forward(g, mb)
    g.views[0].fill_(value)  # what the forward replay writes
    eng.after_forward(t)
    return t


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_the_newest_forward_stays_in_its_bank_until_something_else_comes(engine_clean, mode):
    b = engine_clean
    eng, (g0, g1) = _captured_groups(b, 2, mode)
    try:
        t0 = _forward(eng, g0, 1, 1.0)
        assert t0.state is State.HELD and eng.stats["offloaded_bytes"] == 0
        t1 = _forward(eng, g1, 1, 2.0)  # another forward first: g0's copy out is queued
        assert t0.state in (State.RELEASED, State.RESIDENT_PENDING) and t1.state is State.HELD
        assert eng.stats["offloaded_bytes"] == g0.host_bytes
        eng.wait_restored(t1)  # its own backward next: no copy either way
        assert t1.stash is None and eng.stats["held_bytes"] == g1.host_bytes
        assert eng.stats["restored_bytes"] == 0
        b.synchronize()
        assert torch.all(g1.views[0] == 2.0)
        eng.consumed(t1)
        eng.wait_restored(t0)  # copied out, but its bank (the other one) was not rewritten
        b.synchronize()
        assert torch.all(g0.views[0] == 1.0)
        assert eng.stats["restored_bytes"] == 0
        assert eng.stats["kept_in_place_bytes"] == eng.stats["offloaded_bytes"] == g0.host_bytes
        eng.consumed(t0)
        # A held forward whose backward never comes gives its slot back like any other.
        t2 = _forward(eng, g0, 2, 3.0)
        assert t2.state is State.HELD
        eng.abandon(t2)
        eng.wait_idle()
        assert not eng.in_flight() and eng.stats["offloaded_bytes"] == g0.host_bytes
        # A held ticket is the engine's newest: another one cannot be restored in place.
        t3 = _forward(eng, g0, 3, 4.0)
        t3.state, t4 = State.HELD, _forward(eng, g1, 3, 5.0)
        with pytest.raises(StateError, match="not the engine's newest"):
            eng.restore(t3)
        eng.abandon(t4)
        eng.abandon(t3)
        eng.wait_idle()
        assert not eng.in_flight()
        if mode == "remap":  # nothing in flight: the banks went
            assert b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
    finally:
        eng.close()


def test_resident_restores_in_place_only_what_nothing_rewrote(engine_clean):
    """A bank that a later forward or another restore rewrote comes back from the host;
    one left alone is read where it is, and its host buffer waits for its copy out."""
    b = engine_clean
    eng, (g0, g1) = _captured_groups(b, 2, "resident")
    try:
        t2 = _forward(eng, g0, 2, 3.0)
        t3 = _forward(eng, g0, 3, 4.0)  # the same bank: microbatch 2's bytes are overwritten
        t3b = _forward(eng, g1, 3, 7.0)  # the other bank: 3 goes to the host, its bytes stay
        eng.wait_restored(t3b)
        eng.consumed(t3b)
        eng.wait_restored(t2)  # the bank holds 3's bytes, not 2's: 2 comes back from the host
        b.synchronize()
        assert torch.all(g0.views[0] == 3.0) and eng.stats["restored_bytes"] == g0.host_bytes
        eng.consumed(t2)
        eng.wait_restored(t3)  # 2's restore rewrote the bank: 3 comes back from the host too
        b.synchronize()
        assert torch.all(g0.views[0] == 4.0) and eng.stats["restored_bytes"] == 2 * g0.host_bytes
        eng.consumed(t3)
        assert eng.stats["held_bytes"] == g1.host_bytes
        eng.stats["held_bytes"] = 0
        assert eng.stats["kept_in_place_bytes"] == eng.stats["held_bytes"] == 0
        # In place, then abandoned: its host buffer goes back after its copy out.
        spin(b, 0.3, eng.d2h_stream)  # the copy out ends late
        t4 = _forward(eng, g0, 4, 5.0)
        t5 = _forward(eng, g1, 4, 6.0)
        assert eng.restore_ahead(t4) and t4.in_place and t4.state is State.RESTORING
        st = t4.stash
        eng.abandon(t4)
        assert st in g0._host_pool and st.free_after is t4.d2h_done
        assert not b.query_event(st.free_after)  # still copying: not taken for the next forward
        eng.abandon(t5)
        eng.wait_idle()
        assert torch.all(st.host.view(torch.float32)[:64] == 5.0)
        assert not eng.in_flight()
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_a_restore_waits_for_a_later_forwards_copy_out_of_the_same_slot(engine_clean, mode):
    b = engine_clean
    eng, (g0, g1) = _captured_groups(b, 2, mode)
    try:
        t1 = _forward(eng, g0, 1, 1.0)
        _forward(eng, g1, 1, 1.0)
        eng.wait_idle()
        spin(b, 0.3, eng.d2h_stream)  # the next copy out starts late
        t2 = _forward(eng, g0, 2, 2.0)  # (remap: g0 is not its unit's last member, so it stays mapped)
        eng.restore(t1)  # microbatch 1's bytes go back into g0's slot...
        eng.wait_restored(t1)
        eng.consumed(t1)
        b.synchronize()
        # ...only after microbatch 2's copy out of that slot read what its forward wrote
        assert torch.all(t2.stash.host.view(torch.float32)[:64] == 2.0)
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_a_forward_whose_copy_out_fails_gives_its_slot_back_when_abandoned(engine_clean, monkeypatch, mode):
    b = engine_clean
    eng, groups = _captured_groups(b, 2, mode)
    try:
        g = groups[0]
        monkeypatch.setattr(g, "take_stash", lambda: (_ for _ in ()).throw(MemoryError("no pinned memory")))
        t = eng.before_forward(g, 1)
        with pytest.raises(MemoryError):  # the copy out is queued at the next call
            eng.after_forward(t)
            eng.wait_idle()
        assert t.state is State.HELD  # nothing moved: it never left the device
        monkeypatch.undo()
        eng.abandon(t)
        eng.wait_idle()
        assert not eng.in_flight()
        if mode == "remap":  # nothing in flight: its banks went
            assert b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
        # a failure after the host buffer was taken: the buffer goes back to the pool
        real_copy = b.copy_async
        monkeypatch.setattr(b, "copy_async", lambda *a: (_ for _ in ()).throw(RuntimeError("no copy")))
        t = eng.before_forward(g, 2)
        with pytest.raises(RuntimeError, match="no copy"):
            eng.after_forward(t)
            eng.before_forward(groups[1], 2)  # resident: the next forward queues it first
        assert t.state is State.HELD
        monkeypatch.setattr(b, "copy_async", real_copy)
        eng.abandon(t)
        assert t.stash is None and len(g._host_pool) == 1
        eng.wait_idle()  # its free-after event is done: the next copy out takes it
        _forward(eng, g, 3, 1.0)  # and is used again
        eng.wait_idle()
        assert eng.stats["host_buffers_allocated"] == 1
    finally:
        eng.close()


def test_a_restore_whose_copy_fails_leaves_its_bank_usable(engine_clean, monkeypatch):
    b = engine_clean
    eng, (g,) = _captured_groups(b, 1)
    try:
        t = _forward(eng, g, 1, 3.0)
        eng.wait_idle()  # on the host
        eng.forget(eng.before_forward(g, 99))  # an evaluation forward rewrites the bank
        real = b.copy_async

        def failing(dst, src, stream=None):
            if stream is eng.h2d_stream:
                raise RuntimeError("copy refused")
            return real(dst, src, stream)

        monkeypatch.setattr(b, "copy_async", failing)
        with pytest.raises(RuntimeError, match="copy refused"):
            eng.wait_restored(t)
        monkeypatch.undo()
        eng.wait_restored(t)  # the retry copies in
        b.synchronize()
        assert torch.all(g.views[0] == 3.0)
        eng.consumed(t)
        eng.wait_idle()
        assert b.ledger.mapped_bytes == 0
    finally:
        eng.close()


def _two_part_groups(b: graphslot.Backend, mode: str, banks: list[int], **kw):
    """Groups whose slot has a host part and a small kept (device) part, so a copy has two
    pieces and the second can fail after the first is queued."""
    eng = OffloadEngine(b, mode, min_bytes=64, **kw)
    try:
        groups = []
        for i, bank in enumerate(banks):
            g = eng.group(f"g{i}")
            # alive together, as a layer's saved tensors are, at discovery and at capture (a
            # freed one's storage may come back as the next one's, which would read as one
            # storage shared by both)
            seen = [torch.zeros(64, device=b.device), torch.zeros(8, device=b.device)]
            for x in seen:
                g.discover(x)
            g.allocate(bank_index=bank)
            groups.append(g)
        for g in groups:
            g.begin_capture()
            saved = [torch.ones(sp.shape, device=b.device) for sp in g.specs]
            for x in saved:
                g.save_tensor(x)
            g.finish_capture()
    except BaseException:
        eng.close()  # a failure here is the test's, not a leak for the ledger fixture
        raise
    return eng, groups


def _second_copy_fails(monkeypatch: pytest.MonkeyPatch, b: graphslot.Backend, stream) -> None:
    """The second copy queued on ``stream`` from now on raises; the first is queued."""
    real, n = b.copy_async, [0]

    def failing(dst, src, s=None):
        if s is stream:
            n[0] += 1
            if n[0] == 2:
                raise RuntimeError("copy refused")
        return real(dst, src, s)

    monkeypatch.setattr(b, "copy_async", failing)


def test_a_copy_in_that_fails_part_way_holds_back_the_next_writer_of_the_bank(engine_clean, monkeypatch):
    """The queued half of a failed restore still writes the bank: the next forward there
    waits for it, so its own bytes (then read in place at its backward) stay its own."""
    b = engine_clean
    eng, (ga, _g1, g0) = _two_part_groups(b, "resident", [0, 1, 0])  # ga and g0 share bank 0
    try:
        ta = eng.before_forward(ga, 1)
        for v in ga.views:
            v.fill_(1.0)
        eng.after_forward(ta)
        eng.wait_idle()  # on the host
        e = eng.before_forward(g0, 99)  # an evaluation forward rewrites bank 0
        eng.forget(e)
        spin(b, 0.3, eng.h2d_stream)  # the copy in starts late
        _second_copy_fails(monkeypatch, b, eng.h2d_stream)
        with pytest.raises(RuntimeError, match="copy refused"):
            eng.restore(ta)
        monkeypatch.undo()
        # ta stays in flight (it may be tried again): only the bank's fence orders the next
        # forward after the stray half
        t0 = eng.before_forward(g0, 2)
        for v in g0.views:
            v.fill_(2.0)  # (on the cpu backend this runs on the host at once)
        eng.after_forward(t0)
        eng.wait_idle()
        eng.wait_restored(t0)
        assert t0.in_place
        b.synchronize()
        assert all(torch.all(v == 2.0) for v in g0.views)
        eng.consumed(t0)
        eng.abandon(ta)
    finally:
        eng.close()


def test_checksums_skip_a_held_forward_whose_copy_out_failed(engine_clean, monkeypatch):
    b = engine_clean
    eng, (g0, g1) = _captured_groups(b, 2, "resident")
    eng.debug_checksums = True
    try:
        t = _forward(eng, g0, 1, 3.0)
        monkeypatch.setattr(b, "copy_async", lambda *a: (_ for _ in ()).throw(RuntimeError("no copy")))
        with pytest.raises(RuntimeError, match="no copy"):
            eng.before_forward(g1, 1)  # lets t go first: its copy out fails, t stays held
        monkeypatch.undo()
        assert t.state is State.HELD and not t.checksums
        eng.wait_restored(t)  # its own backward: in place, with nothing to compare against
        b.synchronize()
        assert torch.all(g0.views[0] == 3.0)
        eng.consumed(t)
    finally:
        eng.close()


@pytest.mark.parametrize("way", ["out", "in"])
def test_remap_unmaps_a_slot_only_after_a_copy_that_failed_part_way(engine_clean, monkeypatch, way):
    """What a failed copy queued still touches the bank: it is unmapped after it."""
    b = engine_clean
    eng, (g,) = _two_part_groups(b, "remap", [0])
    try:
        t = eng.before_forward(g, 1)
        for v in g.views:
            v.fill_(1.0)
        stream = eng.d2h_stream if way == "out" else eng.h2d_stream
        eng.after_forward(t)  # held in its bank
        if way == "in":
            eng.wait_idle()  # on the host
            eng.forget(eng.before_forward(g, 99))  # an evaluation forward rewrites the bank
        spin(b, 0.3, stream)
        _second_copy_fails(monkeypatch, b, stream)
        with pytest.raises(RuntimeError, match="copy refused"):
            if way == "out":
                eng.wait_idle()  # queues the held ticket's copy out
            else:
                eng.wait_restored(t)
        monkeypatch.undo()
        eng.abandon(t)
        eng.wait_idle()  # (unmapped under the copy: a fault here)
        assert not eng.in_flight() and b.ledger.mapped_bytes == 0
    finally:
        eng.close()


def test_abandoning_a_restore_under_way_lets_the_slot_go_only_after_its_copy(engine_clean, monkeypatch):
    b = engine_clean
    eng, (g,) = _captured_groups(b, 1)
    try:
        t = _forward(eng, g, 1, 3.0)
        eng.wait_idle()  # on the host
        eng.forget(eng.before_forward(g, 99))  # an evaluation forward rewrites the bank
        done_at_unmap: list[bool] = []
        real = b.unmap

        def unmap(res, off, size):
            done_at_unmap.append(t.restore_done is not None and b.query_event(t.restore_done))
            return real(res, off, size)

        monkeypatch.setattr(b, "unmap", unmap)
        spin(b, 0.3, eng.h2d_stream)  # the copy in starts late
        eng.restore(t)
        eng.abandon(t)
        eng.wait_idle()
        assert done_at_unmap == [True]
    finally:
        eng.close()


def test_a_restore_the_slot_cannot_take_leaves_the_ticket_as_it_was(engine_clean):
    b = engine_clean
    eng, (g,) = _captured_groups(b, 1)
    try:
        t1, t2 = _forward(eng, g, 1, 1.0), _forward(eng, g, 2, 2.0)
        eng.restore(t2)  # holds the slot until its backward
        with pytest.raises(StateError, match="still holds the restore of microbatch 2"):
            eng.restore(t1)
        assert t1.state is State.RELEASED and not eng.restore_ahead(t1)
        eng.wait_restored(t2)
        eng.consumed(t2)
        eng.wait_restored(t1)  # now it can
        b.synchronize()
        assert torch.all(g.views[0] == 1.0)
        eng.consumed(t1)
    finally:
        eng.close()


def test_an_unmap_that_fails_on_the_worker_surfaces_at_wait_idle_and_close_still_releases(engine_clean):
    b = engine_clean
    eng, (g,) = _captured_groups(b, 1)
    try:
        b.faults.fail("unmap")
        t = _forward(eng, g, 1, 3.0)
        eng.wait_restored(t)
        eng.consumed(t)  # nothing in flight: the bank's release is queued, and its unmap fails
        with pytest.raises(InjectedFault):
            eng.wait_idle()
        eng.wait_idle()  # reported once
        assert b.ledger.mapped_bytes > 0  # still mapped, and known to be
    finally:
        eng.close()  # releases what is still mapped: engine_clean finds nothing left


def test_abandoning_the_last_pass_drops_the_map_it_queued_for_its_next_layer(engine_clean):
    b = engine_clean
    eng, (g0, g1) = _captured_groups(b, 2)  # one unit
    try:
        t = eng.before_forward(g0, 1)
        eng.prefetch_forward(g1)  # the pass is interrupted before g1's forward
        eng.abandon(t)
        eng.wait_idle()
        assert b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
    finally:
        eng.close()


def test_a_failed_map_refuses_the_forward_and_a_retry_succeeds(engine_clean):
    """Remap maps its bank when a pass first needs it (never while a ticket is in flight,
    when the bank stays): a map that fails refuses that forward, with nothing left mapped
    or in flight, and the next try maps again."""
    b = engine_clean
    eng, g = _allocated_group(b, n=2)
    try:
        g.begin_capture()
        for v in (1.0, 2.0):
            g.save_tensor(torch.full((64,), v, device=b.device))
        g.finish_capture()
        assert b.ledger.mapped_bytes == 0
        b.faults.fail("map")
        with pytest.raises(InjectedFault):
            eng.before_forward(g, 1)
        assert not eng.in_flight() and b.ledger.mapped_bytes == 0 and b.ledger.allocated_bytes == 0
        t = eng.before_forward(g, 1)  # the retry maps
        for i, v in enumerate((3.0, 4.0)):
            g.views[i].fill_(v)  # what the forward replay writes
        eng.after_forward(t)
        eng.wait_idle()
        eng.forget(eng.before_forward(g, 99))  # an evaluation forward rewrites the bank
        eng.wait_restored(t)
        b.synchronize()
        assert torch.all(g.views[0] == 3.0) and torch.all(g.views[1] == 4.0)
        eng.consumed(t)
        eng.wait_idle()
        assert b.ledger.mapped_bytes == 0
    finally:
        eng.close()


def test_mode_enum_values():
    assert [m.value for m in Mode] == ["off", "resident", "remap"]


def test_offloading_a_subset_of_layers_reloads_ahead_across_the_others(engine_clean, monkeypatch):
    b = engine_clean
    base, _ = small(b, 4)
    want = train(copy.deepcopy(base), b, 3)
    model = copy.deepcopy(base)
    with graphed(model, b, "resident", offload_layers=[0, 2]) as stack:
        log: list[str] = []
        eng = stack.engine
        real_restore = eng.restore
        monkeypatch.setattr(eng, "restore", lambda t: (log.append(f"restore {t.group.name}"), real_restore(t))[1])
        for r in stack._runners:
            real = r.bwd.replay
            monkeypatch.setattr(r.bwd, "replay", (lambda real, n: lambda: (log.append(f"bwd layer{n}"), real())[1])(real, r.index))
        offloaded = [g for g in eng.groups if g.offloads]
        assert [g.name for g in offloaded] == ["layer0", "layer2"]
        assert [g.bank.index for g in offloaded] == [1, 0]  # bank 0 goes to the first reloaded
        assert_bitwise(train(model, b, 3), want)
        first = log[: log.index("bwd layer0") + 1]
        # Each restore is queued right after the backward graph of the layer above it that
        # offloads or, across a layer that keeps its activations, before that layer's graph.
        assert first == ["bwd layer3", "restore layer2", "bwd layer2", "restore layer0", "bwd layer1",
                         "bwd layer0"]
        # Layers 1 and 3 keep theirs in the graph's memory, and still take a second one.
        assert sorted(g.name for g in eng.kept.groups) == ["layer1", "layer3"]
        model(*model.batch(0, b.device))
        model(*model.batch(1, b.device))


# --------------------------------------------------------------------------- several graphs, one layout


def _capture_square(b: graphslot.Backend, g, x: torch.Tensor):
    """Capture y = x * x through ``g`` (the saved ``x`` goes to the slot) and its backward."""
    fwd, bwd = b.new_graph(), b.new_graph()
    g.begin_capture()
    with fwd.capture():
        with torch.autograd.graph.saved_tensors_hooks(g.save_tensor, lambda t: t):
            y = x * x
    gy = torch.ones_like(y)
    with bwd.capture():
        (gx,) = torch.autograd.grad(y, [x], gy)
    g.finish_capture()
    return fwd, bwd, (y, gy), gx  # keep y and gy: the graphs use their addresses


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_adopted_layout_serves_a_second_graph_and_forget_frees_the_slot(engine_clean, mode):
    """Two graphs of one module (Megatron keeps one per microbatch in flight) share a
    layout discovered once; an evaluation forward with no backward gives its slot back."""
    b = engine_clean
    eng = OffloadEngine(b, mode, debug_checksums=True)
    n = b.granularity // 4
    first, second = eng.group("layer1.graph0"), eng.group("layer1.graph1")
    x0 = torch.randn(n, device=b.device, requires_grad=True)
    x1 = torch.randn(n, device=b.device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (first.discover(t), t)[1], lambda t: t):
        xd = x0.detach().requires_grad_()
        xd * xd  # eager: discovery only (mul saves both operands)
    second.adopt(first.specs)
    assert [s.shape for s in second.specs] == [s.shape for s in first.specs] == [(n,), (n,)]
    first.allocate(bank_index=0)
    second.allocate(bank_index=1)
    f0, b0, y0, g0 = _capture_square(b, first, x0)
    f1, b1, y1, g1 = _capture_square(b, second, x1)
    try:
        for step in range(3):
            with torch.no_grad():
                x0.copy_(torch.full((n,), 1.0 + step, device=b.device))
                x1.copy_(torch.full((n,), -2.0 - step, device=b.device))
            t0 = eng.before_forward(first, step)
            f0.replay()
            eng.after_forward(t0)
            t1 = eng.before_forward(second, step)
            f1.replay()
            eng.after_forward(t1)
            with torch.no_grad():  # overwrite the inputs: backward must read the slots
                x0.zero_()
                x1.zero_()
            for g, t, bg, grad, v in ((second, t1, b1, g1, -2.0 - step), (first, t0, b0, g0, 1.0 + step)):
                eng.wait_restored(t)
                bg.replay()
                eng.consumed(t)
                b.synchronize()
                assert torch.all(grad == 2.0 * v), (g.name, step)
        # Evaluation: a forward that no backward follows.
        t = eng.before_forward(first, 99)
        f0.replay()
        eng.forget(t)
        assert eng.in_flight() == []
        with pytest.raises(StateError, match="cannot forget in state"):
            eng.forget(t)
        eng.wait_idle()
        if mode == "remap":
            assert b.ledger.mapped_bytes == 0  # both slots released between uses
        t = eng.before_forward(first, 100)  # the slot is usable again
        f0.replay()
        eng.after_forward(t)
        eng.wait_restored(t)
        b0.replay()
        eng.consumed(t)
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_a_units_backward_restores_the_next_unit_ahead_under_its_own_key(engine_clean, mode):
    """Through the unit API alone, as an adapter drives it: two units counting their
    forwards apart (Megatron's runners do); the first backward restores the second unit's
    forward of the key it names, and leaves a key it does not name where it is."""
    b = engine_clean
    eng = OffloadEngine(b, mode, debug_checksums=True)
    n = b.granularity // 4
    OffloadUnit = graphslot.offload.OffloadUnit
    leave = graphslot.offload.leaves_on_device([], b.device.type)
    units = [OffloadUnit(eng, "a"), OffloadUnit(eng, "b")]
    xs = [torch.randn(n, device=b.device, requires_grad=True) for _ in units]
    graphs = []
    try:
        for bank, (u, x) in enumerate(zip(units, xs)):
            with u.discovering(leave):
                x * x
            u.allocate(bank)
            fwd, bwd = b.new_graph(), b.new_graph()
            with fwd.capture(), u.capture_forward(leave):
                y = x * x
            gy = torch.ones_like(y)
            with bwd.capture():
                (gx,) = torch.autograd.grad(y, [x], gy)
            u.finish_capture()
            graphs.append((fwd, bwd, y, gy, gx))
        a, bu = units
        for key_a, key_b, named in ((10, 20, 20), (11, 21, 99)):
            for u, x, key, v in ((bu, xs[1], key_b, -3.0), (a, xs[0], key_a, 2.0)):
                with torch.no_grad():
                    x.fill_(v)
                with u.forward(key):
                    graphs[units.index(u)][0].replay()
            for x in xs:
                with torch.no_grad():
                    x.zero_()  # the backwards must read the slots
            with a.backward(key_a, ahead=bu, ahead_microbatch=named):
                graphs[0][1].replay()
            t = eng.find(bu.group, key_b)
            assert (t.state in (State.RESTORING, State.RESTORED)) == (named == key_b), (named, t.state)
            with bu.backward(key_b):
                graphs[1][1].replay()
            b.synchronize()
            assert torch.all(graphs[0][4] == 4.0) and torch.all(graphs[1][4] == -6.0)
            assert eng.in_flight() == []
    finally:
        eng.close()


def test_adopt_after_allocation_is_refused(engine_clean):
    b = engine_clean
    eng = OffloadEngine(b, "resident")
    g = eng.group("x")
    g.allocate()
    with pytest.raises(StateError, match="cannot discover in state allocated"):
        g.adopt([graphslot.offload.SavedTensorSpec((1,), (1,), torch.float32, "cpu", 4)])
    eng.close()


def test_a_saved_layout_records_forwards_autograd_keeps_and_lays_out_units(engine_clean):
    """A framework's recording forward (Megatron's) is trained through, so autograd keeps
    its saved tensors; the layout notes all but what ``leave`` keeps, lays out a unit from
    them, and refuses a pass that saves other tensors."""
    b = engine_clean
    n = b.granularity // 4
    w = torch.randn(n, device=b.device, requires_grad=True)
    layout = graphslot.offload.SavedLayout("layer 3")
    assert not layout.recorded and layout.specs == []
    leave = graphslot.offload.leaves_on_device([], b.device.type)
    for _ in range(2):  # the same tensors every pass
        x = torch.randn(n, device=b.device, requires_grad=True)
        with layout.recording(lambda t: t is w or leave(t)):
            y = (x * w).sin()  # saves x and w, then x * w
        y.sum().backward()  # the saved tensors were kept for it
        assert torch.equal(x.grad, (x * w).cos().detach() * w.detach())
    specs = layout.specs
    assert [s.shape for s in specs] == [(n,), (n,)] and specs[0].storage != specs[1].storage
    eng = OffloadEngine(b, "resident")
    try:
        unit = graphslot.offload.OffloadUnit(eng, "layer3.graph0")
        unit.adopt(layout)
        assert unit.saved_tensors == 2
        unit.allocate(0)
        assert unit.slot_bytes >= 2 * n * 4
        with pytest.raises(UsageError, match="layer 9 recorded no forward"):
            graphslot.offload.OffloadUnit(eng, "other").adopt(graphslot.offload.SavedLayout("layer 9"))
    finally:
        eng.close()
    x = torch.randn(n, device=b.device, requires_grad=True)
    with pytest.raises(StateError, match=r"layer 3 saved different tensors in two forward passes \(2 then 1\)"):
        with layout.recording(leave):
            x.sin()
    assert layout.specs == specs  # the refused pass replaced nothing


def test_watching_a_forward_leaves_no_activations_behind(engine_clean):
    """The hooks that watch an eager forward's saved tensors (the build's checks, the
    profile) hand autograd the saved memory without its grad_fn: handed back a node's own
    output (what tanh and SDPA save), the node would hold itself through C++, out of the
    garbage collector's sight, and the forward's activations would stay for the life of
    the process (an eight-layer Llama build kept 5 GB so)."""
    from graphslot.offload.saved import watching_saved_values

    b = engine_clean
    w = torch.randn(64, 64, device=b.device, requires_grad=True)
    leave = graphslot.offload.leaves_on_device([], b.device.type)
    layout = graphslot.offload.SavedLayout("layer 0")
    for name, watch in (("watching_saved_values", lambda: watching_saved_values(lambda t: True)),
                        ("SavedLayout.recording", lambda: layout.recording(leave))):
        x = torch.randn(8, 64, device=b.device, requires_grad=True)
        with watch():
            y = torch.tanh(x @ w)  # tanh saves its own output
        gone = weakref.ref(y)
        del y
        gc.collect()
        assert gone() is None, f"{name} kept the forward's output alive"
    # Trained through, the watched saved tensors give eager's gradients
    x = torch.randn(8, 64, device=b.device, requires_grad=True)
    with watching_saved_values(lambda t: True) as changed:
        y = torch.tanh(x @ w)
    y.sum().backward()
    assert changed == []
    x2 = x.detach().requires_grad_()
    torch.tanh(x2 @ w).sum().backward()
    assert torch.equal(x.grad, x2.grad)


class _Made(TorchDispatchMode):
    """Notes, by weak reference, every tensor an op makes within."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[weakref.ref[torch.Tensor], str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.made.append((weakref.ref(t), str(func)))
        return out


class _Tanh(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))  # (tanh saves its own output)


@pytest.mark.parametrize("kw", [
    dict(mode="off"), dict(mode="off", recompute_layers=[0, 1, 2]),
    dict(mode="remap", recompute_layers=[0, 1, 2], recompute_ops="parts"),
    dict(mode="off", recompute_layers=[0, 1, 2], recompute_ops="cheap"),
    dict(mode="remap", offload_layers=[1, 2]), dict(memory_budget="auto")],
    ids=["keep", "recompute", "parts", "cheap", "remap", "auto"])
def test_a_closed_stack_leaves_only_the_gradients(clean, kw):
    """Built, trained one step and closed, a stack leaves nothing it made alive but the
    gradients it handed over: no eager forward's activations from the build's checks or
    the profile (held through autograd, a leak no garbage collection frees)."""
    b = clean
    d = 64
    layers = nn.ModuleList([_Tanh(d) for _ in range(3)]).to(b.device)
    x = torch.randn(8, d, device=b.device, requires_grad=True)
    made = _Made()
    with made:
        stack = GraphedLayers(layers, x, backend=b, **kw)
        stack(x).sum().backward()
    stack.close()
    del stack
    gc.collect()
    handed = {t.untyped_storage().data_ptr()
              for t in [x.grad, *(p.grad for p in layers.parameters())] if t is not None}
    alive = [(func, tuple(t.shape)) for r, func in made.made
             if (t := r()) is not None and t.untyped_storage().data_ptr() not in handed]
    assert alive == []


# --------------------------------------------------------------------------- shared storages


class SplitMix(nn.Module):
    """Saves views of one storage (q, k, v slices of one projection) and one tensor twice."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).chunk(3, dim=-1)
        a = torch.tanh(q * k)  # mul saves q and k; tanh saves its output
        return a * a + v * x  # a saved twice (once per operand)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_views_of_one_storage_share_one_region_and_train_bitwise(engine_clean, mode):
    b = engine_clean
    torch.manual_seed(0)
    d, n = 64, 96
    layers = [SplitMix(d).to(b.device) for _ in range(2)]
    ref = copy.deepcopy(layers)
    sample = torch.randn(n, d, device=b.device, requires_grad=True)
    with GraphedLayers(layers, sample, mode=mode, backend=b, debug_checksums=True,
                       layers_per_graph=1) as stack:
        g = stack._runners[0].unit.group
        assert g is not None
        per_tensor = sum(s.nbytes for s in g.specs)
        # q, k, v live in one qkv region; 'a' saved twice is held once.
        assert len({s.storage for s in g.specs if s.storage >= 0}) < len(g.specs)
        assert g.nbytes < per_tensor
        qkv = [s for s in g.specs if s.shape == (n, d) and s.stride == (3 * d, 1)]
        assert len(qkv) >= 2 and len({s.storage for s in qkv}) == 1
        assert max(s.offset for s in qkv) - min(s.offset for s in qkv) in (d * 4, 2 * d * 4)
        opt_a = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.01)
        opt_b = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.01)
        for step in range(4):
            x = torch.randn(n, d, device=b.device, generator=None, requires_grad=True)
            xa = x.detach().clone().requires_grad_()
            out = stack(xa)
            h = x
            for m in ref:
                h = m(h)
            out.tanh().sum().backward()
            h.tanh().sum().backward()
            assert torch.isfinite(out).all() and torch.equal(out, h) and torch.equal(xa.grad, x.grad), step
            opt_a.step(); opt_b.step(); opt_a.zero_grad(); opt_b.zero_grad()
        for p, q in zip([p for m in layers for p in m.parameters()], [p for m in ref for p in m.parameters()]):
            assert torch.equal(p, q)


def test_a_capture_that_shares_storage_differently_is_refused(engine_clean):
    b = engine_clean
    eng = OffloadEngine(b, "resident")
    g = eng.group("mix")
    t = torch.randn(256, device=b.device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: (g.discover(x), x)[1], lambda x: x):
        u = t * 1.0
        u * u  # one storage saved twice
    assert g.specs[0].storage == g.specs[1].storage >= 0
    g.allocate()
    assert g.nbytes == 256 * 4  # held once
    a = torch.randn(256, device=b.device, requires_grad=True)
    c = torch.randn(256, device=b.device, requires_grad=True)
    g.begin_capture()
    graph = b.new_graph()
    with pytest.raises(CaptureMismatchError, match="does not view its storage as at discovery"):
        with graph.capture():
            with torch.autograd.graph.saved_tensors_hooks(g.save_tensor, lambda x: x):
                a * c  # two storages where discovery saw one
    eng.close()


# --------------------------------------------------------------------------- capture saves other tensors


class _SavesMoreUnderCapture(torch.autograd.Function):
    """Like SDPA's memory-efficient kernel: under capture it saves a tensor (there, an RNG
    offset on the device) that it does not save when run eagerly."""

    backend: graphslot.Backend

    @staticmethod
    def forward(ctx, x, w):
        if _SavesMoreUnderCapture.backend.is_capturing():
            ctx.save_for_backward(x, w, torch.full((4,), 0.25, device=x.device, dtype=x.dtype))
        else:
            ctx.save_for_backward(x, w)
        return torch.tanh(x * w)

    @staticmethod
    def backward(ctx, g):
        x, w, *extra = ctx.saved_tensors
        t = torch.tanh(x * w)
        d = g * (1 - t * t)
        scale = extra[0].sum() * 0 + 1 if extra else 1  # the extra must read back intact
        return d * w * scale, (d * x).sum(0) * scale


class _ShyLayer(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return _SavesMoreUnderCapture.apply(x, self.w)


@pytest.mark.parametrize("mode", ["resident", "remap", "off"])
def test_a_layer_that_saves_more_under_capture_than_eagerly(engine_clean, mode):
    b = engine_clean
    _SavesMoreUnderCapture.backend = b
    torch.manual_seed(0)
    base = nn.ModuleList([_ShyLayer(64) for _ in range(3)]).to(b.device)

    def steps(layers, stack=None):
        opt = torch.optim.SGD(layers.parameters(), lr=0.1)
        out = []
        for i in range(4):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(b.device)
            h = stack(x) if stack is not None else x
            if stack is None:
                for m in layers:
                    h = m(h)
            loss = (h ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.detach())
        return out + [p.detach().clone() for p in layers.parameters()]

    want = steps(copy.deepcopy(base))
    layers = copy.deepcopy(base)
    with GraphedLayers(list(layers), torch.zeros(8, 64, device=b.device), mode=mode, backend=b,
                       layers_per_graph=1) as stack:
        assert_bitwise(steps(layers, stack), want)
        if mode != "off":
            # x and the extra (w is a parameter): the extra was seen only because discovery
            # ran under capture
            assert all(len(g.specs) == 2 for g in stack.engine.groups)


# --------------------------------------------------------------------------- sections


def test_sections_cut_a_bank_evenly_and_aligned():
    from graphslot.offload import sections_of

    assert sections_of(4096, 32 << 20) == [(0, 4096)]
    secs = sections_of(514 << 20, 32 << 20)
    assert len(secs) == 17 and secs[0][0] == 0 and secs[-1][1] == 514 << 20
    assert all(a % 256 == 0 for a, _ in secs)
    assert all(e - a <= 32 << 20 for a, e in secs)
    assert all(secs[i][1] == secs[i + 1][0] for i in range(len(secs) - 1))
    assert sections_of(1000, 300) == [(0, 256), (256, 512), (512, 768), (768, 1000)]


def test_the_backward_graph_learns_which_sections_it_reads_first_and_lets_go_of(engine_clean):
    b = engine_clean
    model, _ = small(b, 2)
    with graphed(model, b, "remap", section_bytes=1024) as stack:
        for g in stack.engine.groups:
            n = len(g.sections)
            assert n > 4 and sorted(g.restore_order) == list(range(n))
            assert g.sections[0][0] == 0 and g.sections[-1][1] == g.nbytes
            if not b.graph_events:
                continue
            # The backward reads the newest saves first, so the restore copies the slot's
            # last sections first and its first sections (the layer's input) last.
            assert g.restore_order[0] > g.restore_order[-1]
            # Sections are let go of as the backward moves on, not only at its end...
            early = [k for k in range(n) if g.done_events[k] is not None]
            assert early, "no section is free before the backward graph's end"
            # ...each with the event recorded when the node after its last reader began.
            assert len({id(g.done_events[k]) for k in early}) > 1
            # The first saves are read by the backward's last nodes.
            assert g.done_events[g.restore_order[-1]] is None


def _linear_stack(widths: list[int], seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(16, w), nn.Tanh(), nn.Linear(w, 16)) for w in widths]


@pytest.mark.parametrize("mode", ["resident", "remap"])
@pytest.mark.parametrize("widths", [[512, 16, 16], [16, 512, 64, 512, 16]])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_layers_of_different_sizes_share_banks_and_train_like_eager(engine_clean, monkeypatch, mode,
                                                                    widths, in_flight):
    """A slot goes to the smallest class whose banks fit it, so slots of different sizes and
    section counts share a bank: each restore is fenced by whichever layer read the bank
    last, section by section, with copies slowed, microbatches in flight and an evaluation
    forward in between."""
    b = engine_clean
    layers = _linear_stack(widths)
    eager = copy.deepcopy(layers)
    x = torch.randn(8, 16, device=b.device)
    with GraphedLayers([m.to(b.device) for m in layers], x, mode=mode, backend=b, layers_per_graph=1,
                       section_bytes=1024) as stack:
        eager = [m.to(b.device) for m in eager]
        assert len({g.bank.index for g in stack.engine.groups}) < len(widths)  # banks are shared
        slow_copies(monkeypatch, stack.engine, 0.003)
        for step in range(3):
            xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + i)).to(b.device)
                  for i in range(in_flight)]
            ys = [stack(xi) for xi in xs]
            with torch.no_grad():
                stack(xs[0])
            for y in reversed(ys):
                y.square().sum().backward()
            hs = []
            for xi in xs:
                h = xi
                for m in eager:
                    h = m(h)
                hs.append(h)
            for h in reversed(hs):
                h.square().sum().backward()
            got = [p.grad for m in layers for p in m.parameters()]
            want = [p.grad for m in eager for p in m.parameters()]
            assert_bitwise(got, want)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_graphs_of_uneven_joins_share_a_bank(engine_clean, mode):
    b = engine_clean
    base, _ = small(b, 3)
    want = train(copy.deepcopy(base), b, 3)
    model = copy.deepcopy(base)
    with graphed(model, b, mode, layers_per_graph=2, section_bytes=4096) as stack:
        assert stack.graph_layers == ((0, 1), (2,))
        assert_bitwise(train(model, b, 3), want)


class _SavesUnread(torch.autograd.Function):
    """Saves its input (into the slot) and never unpacks it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


class _Unread(nn.Module):
    def forward(self, x):
        return _SavesUnread.apply(x)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_a_section_the_backward_never_reads_still_fences_the_next_forward(engine_clean, monkeypatch, mode):
    """A restore copies every section, read or not; the backward graph waits only for those
    it reads. The next forward into the bank waits for the copy into the others too, or a
    layer whose bytes sit there would be overwritten by that stale copy."""
    b = engine_clean
    torch.manual_seed(0)
    d = 256
    layers = [nn.Sequential(nn.Linear(d, d), _Unread()), nn.Sequential(nn.Linear(d, d), _Unread()),
              nn.Sequential(_Unread(), nn.Linear(d, d))]
    layers = [m.to(b.device) for m in layers]
    eager = copy.deepcopy(layers)
    x = torch.randn(64, d, device=b.device)
    with GraphedLayers(layers, x, mode=mode, backend=b, layers_per_graph=1, section_bytes=4096) as stack:
        eng = stack.engine
        real = b.copy_async

        def slowed(dst, src, stream=None):
            if stream is eng.h2d_stream:
                spin(b, 0.02, stream)
            return real(dst, src, stream)

        monkeypatch.setattr(b, "copy_async", slowed)
        for step in range(3):
            xs = torch.randn(64, d, generator=torch.Generator().manual_seed(step)).to(b.device)
            for p in stack.parameters():
                p.grad = None
            stack(xs).square().sum().backward()
            for p in (q for m in eager for q in m.parameters()):
                p.grad = None
            h = xs
            for m in eager:
                h = m(h)
            h.square().sum().backward()
            assert_bitwise([p.grad for m in layers for p in m.parameters()],
                           [p.grad for m in eager for p in m.parameters()])


class _UnpacksTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        a = x.sin()
        ctx.save_for_backward(x, a)
        return a * x

    @staticmethod
    def backward(ctx, g):
        x, a = ctx.saved_tensors
        x2, _ = ctx.saved_tensors  # unpacked again
        return g * (a + x2 * x.cos())


class _NestedBackward(torch.autograd.Function):
    """Its backward runs a backward of its own over nodes saved under the forward's hooks,
    then reads its own saved tensors again."""

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = (xd.exp() * xd).sum(-1, keepdim=True)
        ctx.save_for_backward(x, xd, y)
        return y.detach() * x

    @staticmethod
    def backward(ctx, g):
        x, xd, y = ctx.saved_tensors
        (gx,) = torch.autograd.grad(y, xd, (g * x).sum(-1, keepdim=True))
        return gx * 0.5 + g * y + x * 0.0


class _Wrap(nn.Module):
    def __init__(self, fn, d: int) -> None:
        super().__init__()
        self.fn, self.lin = fn, nn.Linear(d, d)

    def forward(self, x):
        return self.fn.apply(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("fn", [_UnpacksTwice, _NestedBackward], ids=["unpacked-twice", "nested-backward"])
def test_the_backward_graph_lets_go_of_a_section_only_after_its_last_reader(engine_clean, fn):
    """The cpu graph holds its ops and its records: no op after a section's done record
    touches that section (a restore queued after the launch may overwrite it from there)."""
    b = engine_clean
    if b.name != "cpu":
        pytest.skip("reads the cpu backend's recorded graph")
    from graphslot.backends.cpu.graph import _HostStep, _Ref

    d = 64
    torch.manual_seed(0)
    x = torch.randn(32, d, requires_grad=True)
    with GraphedLayers([_Wrap(fn, d), _Wrap(fn, d)], x, mode="remap", backend=b, layers_per_graph=1,
                       section_bytes=256) as stack:
        for r in stack._runners:
            g = r.unit.group
            base = g.reservation.va + g.slot_offset
            by_event: dict[int, list[int]] = {}
            for k, ev in enumerate(g.done_events):
                if ev is not None:
                    by_event.setdefault(id(ev), []).append(k)
            assert by_event, "no section was let go of before the graph's end"
            free: set[int] = set()
            for op in r.bwd._ops:
                if isinstance(op, _HostStep):
                    cells = dict(zip(op.fn.__code__.co_freevars, (c.cell_contents for c in op.fn.__closure__)))
                    if "record" in op.fn.__code__.co_names:
                        free |= set(by_event.get(id(cells["event"]), ()))
                    continue
                for ref in [*op.in_refs, *op.out_refs]:
                    if isinstance(ref, _Ref) and ref.nbytes:
                        lo, hi = ref.ptr - base, ref.ptr - base + ref.nbytes
                        hit = [k for k in free if lo < g.sections[k][1] and g.sections[k][0] < hi]
                        assert not hit, f"{op.func} touches sections {hit} after they were let go"
        got = []
        for _ in range(2):
            stack(x).square().sum().backward()
            got.append(x.grad.clone())
            x.grad = None
    assert not torch.equal(got[0], torch.zeros_like(got[0]))


def test_a_pass_waiting_for_a_queued_map_calls_off_the_release_queued_behind_it(engine_clean):
    """The worker is busy; a pass announces its next layer (a map queued), is dropped
    (nothing in flight: a release queued behind that map), and a new pass comes: it waits
    for the map and must not find its bank released under it."""
    b = engine_clean
    eng, (g0, g1) = _captured_groups(b, 2, "remap")
    gate = threading.Event()
    try:
        t0 = _forward(eng, g0, 1, 1.0)
        eng.worker.submit(gate.wait)
        eng.prefetch_forward(g1)
        eng.abandon(t0)
        assert g1.bank.pending_release is not None
        threading.Timer(0.2, gate.set).start()
        t1 = eng.before_forward(g1, 2)
        eng.worker.drain()
        assert g1.bank.reservation.mapping_at(0) is not None and g1.bank.pages == "mapped"
        g1.views[0].fill_(2.0)  # (the replay would fault on an unmapped bank)
        eng.abandon(t1)
        eng.wait_idle()
        assert b.ledger.mapped_bytes == 0
    finally:
        gate.set()
        eng.close()


def test_a_pass_after_a_release_whose_unmap_failed_finds_its_bank_mapped(engine_clean, monkeypatch):
    b = engine_clean
    eng, (g,) = _captured_groups(b, 1, "remap")
    try:
        t = _forward(eng, g, 1, 1.0)
        eng.wait_restored(t)
        real = b.unmap_release
        started = threading.Event()

        def slow_failing(res, off):
            started.set()
            time.sleep(0.2)
            b.faults.fail("unmap")
            return real(res, off)

        monkeypatch.setattr(b, "unmap_release", slow_failing)
        eng.consumed(t)  # nothing in flight: the release is queued, and its unmap will fail
        assert started.wait(10)
        t2 = eng.before_forward(g, 2)  # queued behind the release; the bank stays mapped
        monkeypatch.undo()
        assert g.bank.pages == "mapped"
        eng.abandon(t2)
        with pytest.raises(InjectedFault):
            eng.wait_idle()  # the failed release is reported
    finally:
        eng.close()


def test_byte_counts_of_numpy_or_torch_integers_are_taken_as_ints(engine_clean):
    eng = OffloadEngine(engine_clean, "remap", min_bytes=torch.tensor(0), section_bytes=torch.tensor(1 << 20))
    try:
        assert (eng.min_bytes, eng.section_bytes) == (0, 1 << 20)
        assert type(eng.min_bytes) is int and type(eng.section_bytes) is int
    finally:
        eng.close()
