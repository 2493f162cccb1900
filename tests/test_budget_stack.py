"""GraphedLayers under a memory budget: each layer's activations kept, offloaded or
recomputed inside the graphs, as the planner chose, training bit for bit as eager does."""

from __future__ import annotations

import copy

import pytest
import torch

from graphslot import budget as gb
from graphslot.backend import align_up
from graphslot.adapters import torch as gt
from graphslot.errors import UsageError
from stacks import graphed, small_gpt
from test_graphed_grads import assert_bitwise, run

GiB, MiB = 1 << 30, 1 << 20


def fake_profile(monkeypatch: pytest.MonkeyPatch, costs: list[gb.LayerCost], gbps: float = 10.0) -> None:
    """Plan from ``costs`` instead of what the layers measure (the cpu backend's timings
    say nothing of a device), the stack's fixed memory as the backend reports it. The
    builds measure nothing (as on the cpu backend): on a device, fit_budget would correct
    the made-up costs by what the small layers really hold and plan something else."""
    monkeypatch.setattr(gt.stack, "profile_units", lambda b, mods, sample: list(costs)[:len(mods)])
    monkeypatch.setattr(gt.stack, "held_bytes", lambda b: None)
    monkeypatch.setattr(gt.stack, "copy_bandwidth", lambda b, n, reps=3: {
        "d2h_gbps": gbps, "h2d_gbps": gbps, "both_total_gbps": gbps})


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_a_mixed_plan_trains_as_eager_bitwise(clean, mode):
    """Layer 0 offloaded, 1 recomputed, 2 kept, 3 recomputed with its input offloaded."""
    b = clean
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 3, 2, False)
    model = copy.deepcopy(base)
    with graphed(model, b, mode, offload_layers=[0, 3], recompute_layers=[1, 3]) as stack:
        assert stack.recompute_layers == {1, 3} and stack.offload_layers == {0, 3}
        assert [g.offloads for g in stack.engine.groups] == [True, False, False, True]
        # what layer 3 sends to the host is its input alone
        sample = stack._runners[0].static_in
        act = sample.numel() * sample.element_size()
        assert stack.engine.groups[3].slot_bytes <= align_up(act + 512, b.granularity)
        assert_bitwise(run(model, b, 3, 2, False), want)
        assert stack.engine.stats["offloaded_bytes"] > 0


@pytest.mark.parametrize("ops", ["all", "cheap"])
@pytest.mark.parametrize("per_graph", [1, None], ids=["graph-per-layer", "joined"])
def test_recomputed_layers_train_as_eager_with_microbatches_in_flight(clean, per_graph, ops):
    b = clean
    base = small_gpt(b, 4)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    with graphed(model, b, "off", recompute_layers=[0, 1, 3], recompute_ops=ops,
                 layers_per_graph=per_graph) as stack:
        if per_graph is None:  # recomputed and kept layers never share a graph
            assert stack.graph_layers == ((0, 1), (2,), (3,))
        for m in (eager, model):
            losses = [m(*m.batch(k, b.device)) for k in range(3)]
            for loss in reversed(losses):
                loss.backward()
        assert_bitwise([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()])
        # what the older microbatches keep in the graphs' memory (inputs, and a cheap
        # recompute's kept outputs) was moved aside and back
        assert stack.engine.stats["parked_bytes"] > 0


def test_recompute_keeps_only_the_input_for_the_backward(clean):
    """What a recomputed layer's backward graph reads of its forward's memory is its input
    alone; a kept layer's is every activation it saved."""
    b = clean
    kept = {}
    for name, kw in (("keep", {}), ("recompute", {"recompute_layers": [0, 1, 2]})):
        model = small_gpt(b, 3)
        with graphed(model, b, "off", **kw) as stack:
            kept[name] = [g.kept_bytes for g in stack.engine.groups]
            sample = stack._runners[0].static_in
            model(*model.batch(0, b.device)).backward()
    act = sample.numel() * sample.element_size()
    assert all(k <= act for k in kept["recompute"])  # the input, nothing more
    assert all(k >= 4 * act for k in kept["keep"])  # norms, attention, the MLP's


@pytest.mark.parametrize("room,want", [(1, "recompute"), (3, "mixed")])
def test_the_budget_chooses_and_the_stack_does_what_it_chose(clean, monkeypatch, room, want):
    b = clean
    # A slow link (a layer's copy takes three of its forwards): room for one layer's
    # activations recomputes all but the last; room for three mixes choices.
    layer = gb.LayerCost(4.0, 8.0, 64 * MiB, recompute_ms=3.0, work_bytes=0)
    fake_profile(monkeypatch, [layer] * 4, gbps=5.0)
    base = small_gpt(b, 4)
    want_train = run(copy.deepcopy(base), b, 2, 1, True)
    model = copy.deepcopy(base)
    with graphed(copy.deepcopy(base), b, None, memory_budget="auto") as probe:
        fixed = probe.plan.profile.fixed_bytes
    budget = fixed + room * 64 * MiB + 24 * MiB  # (the process's footprint moves a little)
    with graphed(model, b, None, memory_budget=budget) as stack:
        plan = stack.plan
        assert plan is not None and plan.budget_bytes == budget
        assert plan.predicted_peak_bytes <= budget
        if want == "recompute":
            # (the last layer's kept activations are free again by the time the others
            # recompute theirs: the pool holds one layer's either way)
            assert plan.choices[:3] == ("recompute",) * 3 and "offload" not in plan.choices
        else:
            assert len(set(plan.choices)) >= 2
        assert stack.offload_layers == set(plan.layers("offload"))
        assert stack.recompute_layers == set(plan.layers("recompute"))
        assert [g.offloads for g in stack.engine.groups] == [c == "offload" for c in plan.choices]
        assert stack.mode.value == (plan.mode if "offload" in plan.choices else stack.mode.value)
        assert_bitwise(run(model, b, 2, 1, True), want_train)


def test_a_budget_below_any_plan_is_refused_at_build_naming_the_least(clean, monkeypatch):
    b = clean
    fake_profile(monkeypatch, [gb.LayerCost(1.0, 2.0, 8 * MiB)] * 3)
    model = small_gpt(b, 3)
    with pytest.raises(UsageError, match=r"smallest peak any plan reaches, .* \(\d+ bytes\)"):
        graphed(model, b, None, memory_budget=1)


def test_a_budget_below_what_the_least_plan_holds_built_is_refused_naming_that(clean, monkeypatch):
    """Where the backend measures what a build holds, the least plan is built before the
    budget is refused, and the message names what it held."""
    b = clean
    if gt.stack.held_bytes(b) is None:
        pytest.skip(f"the {b.name} backend's allocator keeps no figure to measure a build by")
    model = small_gpt(b, 3)
    with pytest.raises(UsageError, match=r"below the smallest peak any plan reaches: built, the "
                                         r"least plan \([KOR]{3}, \w+\) holds .* \(\d+ bytes\)"):
        graphed(model, b, None, memory_budget=1)


def test_budget_and_explicit_layer_lists_do_not_mix(clean):
    model = small_gpt(clean, 3)
    with pytest.raises(UsageError, match="not both"):
        graphed(model, clean, None, memory_budget="auto", offload_layers=[0])
    with pytest.raises(UsageError, match=r"recompute_layers \[7\]"):
        graphed(model, clean, "off", recompute_layers=[7])


def test_mode_off_with_a_budget_never_offloads(clean, monkeypatch):
    b = clean
    fake_profile(monkeypatch, [gb.LayerCost(4.0, 8.0, 64 * MiB, work_bytes=0)] * 3, gbps=1000.0)
    model = small_gpt(b, 3)
    with graphed(model, b, "off", memory_budget="auto") as stack:
        assert "offload" not in stack.plan.choices and stack.mode.value == "off"


def test_an_input_wanting_a_gradient_the_capture_never_computed_is_refused(clean):
    """A sample without requires_grad captures no input gradient: an input that requires
    grad would silently get none, so it is refused naming the difference."""
    b = clean
    model = small_gpt(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    with gt.GraphedLayers(list(model.blocks), sample, mode="off", backend=b) as stack:
        x = sample.clone().requires_grad_()
        with pytest.raises(gt.CaptureMismatchError, match="requires grad"):
            stack(x)
        stack(sample.clone()).sum().backward()  # the captured kind still trains
        with torch.no_grad():
            stack(x)  # no gradient wanted: fine
    # The other way round works as eager: the input gradient is computed and dropped.
    model2 = small_gpt(b, 2)
    with gt.GraphedLayers(list(model2.blocks), sample.clone().requires_grad_(), mode="off",
                          backend=b) as stack:
        stack(sample.clone()).sum().backward()
        assert all(p.grad is not None for p in model2.blocks.parameters())


@pytest.mark.parametrize("layers,match", [(5, "sequence of torch.nn.Module, got int"),
                                          ([torch.nn.Linear(4, 4), "relu"], r"layers\[1\] is str"),
                                          (torch.nn.Linear(4, 4), "wrap it in a list"),
                                          ([], "at least one layer")])
def test_wrong_layers_are_named(clean, layers, match):
    with pytest.raises(UsageError, match=match):
        gt.GraphedLayers(layers, torch.randn(2, 4), backend=clean)


def test_a_sample_that_is_not_a_tensor_is_named(clean):
    with pytest.raises(UsageError, match="sample_input must be a torch.Tensor.*got list"):
        gt.GraphedLayers([torch.nn.Linear(4, 4)], [[1.0] * 4] * 2, backend=clean)


def test_a_bad_budget_fails_before_the_stack_measures_anything(clean, monkeypatch):
    def no_profile(*a, **k):
        raise AssertionError("profiled a stack whose budget is not a size")

    monkeypatch.setattr(gt.stack, "profile_units", no_profile)
    model = small_gpt(clean, 2)
    with pytest.raises(UsageError, match="not a size"):
        graphed(model, clean, None, memory_budget="plenty")
