"""GraphedLayers under a memory budget: each layer's activations kept, offloaded or
recomputed inside the graphs, as the planner chose, training bit for bit as eager does."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from graphslot import budget as gb
from graphslot.backend import align_up
from graphslot.adapters import torch as gt
from graphslot.errors import BudgetError, CaptureMismatchError, StateError, UsageError
from graphslot.sizes import format_bytes
from stacks import graphed, seeded_grads, small_gpt
from test_graphed_grads import assert_bitwise, run

GiB, MiB = 1 << 30, 1 << 20


def fake_profile(monkeypatch: pytest.MonkeyPatch, costs: list[gb.LayerCost], gbps: float = 10.0) -> None:
    """Plan from ``costs`` instead of what the layers measure (the cpu backend's timings
    say nothing of a device), the stack's fixed memory as the backend reports it. The
    builds measure nothing: measured (on a device, or on cpu by the process's footprint),
    fit_budget would correct the made-up costs by what the small layers really hold and
    plan something else."""
    monkeypatch.setattr(gt.stack, "profile_units", lambda b, mods, sample, **kw: list(costs)[:len(mods)])
    monkeypatch.setattr(gt.stack, "held_bytes", lambda b: None)
    monkeypatch.setattr(gt.stack, "_build_holds", lambda b: None)
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
    with pytest.raises(BudgetError, match=r"smallest peak any plan reaches, .* \(\d+ bytes\)") as e:
        graphed(model, b, None, memory_budget=1)
    assert isinstance(e.value, UsageError) and e.value.budget_bytes == 1
    assert str(e.value.least_bytes) in str(e.value)


def test_the_least_budget_a_refusal_names_builds_again(clean):
    """``least_bytes`` has room for what the process holds moving between builds: a
    script that builds again at it, as it catches the refusal, gets a stack (each of
    several times, a training step between)."""
    b = clean
    model = small_gpt(b, 3)
    for _ in range(3):
        try:
            graphed(model, b, None, memory_budget=1)
        except BudgetError as e:
            assert re.search(rf"a budget of .* \({e.least_bytes} bytes\) fits it", str(e))
            assert e.least_bytes % b.granularity == 0
            with graphed(model, b, None, memory_budget=e.least_bytes) as stack:
                assert stack.plan.predicted_peak_bytes <= e.least_bytes
                held = gt.stack._build_holds(b)  # (cpu: the footprint, which the build checks)
                assert held is None or held <= e.least_bytes
                model(*model.batch(0, b.device)).backward()
        else:
            pytest.fail("a budget of one byte was not refused")
        model.stack = torch.nn.Sequential(*model.blocks)
        model.zero_grad(set_to_none=True)


def test_a_budget_below_what_the_least_plan_holds_built_is_refused_naming_that(clean, monkeypatch):
    """Where the backend measures what a build holds, the least plan is built before the
    budget is refused, and the message names what it held."""
    b = clean
    if gt.stack._build_holds(b) is None:
        pytest.skip(f"the {b.name} backend cannot tell what a build holds")
    model = small_gpt(b, 3)
    with pytest.raises(BudgetError, match=r"below what the plans built for it hold.* the least "
                                          r"built \([KOR]{3}, \w+\) holds .* \(\d+ bytes\)") as e:
        graphed(model, b, None, memory_budget=1)
    assert str(e.value.least_bytes) in str(e.value)
    # (what the least plan says of itself agrees: it holds more than the budget)
    assert e.value.least_plan.reason.endswith("which holds more than it"), e.value.least_plan.reason


def test_a_refusal_names_the_least_plan_per_layer_as_stack_plan_does(clean):
    """Layers joined into graphs are planned per graph; the refusal names the least plan
    with one letter per layer, as ``stack.plan`` does, and carries it."""
    b = clean
    if gt.stack._build_holds(b) is None:
        pytest.skip(f"the {b.name} backend cannot tell what a build holds")
    model = small_gpt(b, 4)
    with pytest.raises(BudgetError, match=r"the least built \([KORC]{4}, \w+\) holds") as e:
        graphed(model, b, None, memory_budget=1, layers_per_graph=2)
    assert len(e.value.least_plan.choices) == 4


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


@pytest.mark.parametrize("kw,match", [
    (dict(mode="resdient"), r"mode must be one of 'off', 'resident', 'remap' or None, got 'resdient'"),
    (dict(mode=["off"]), r"mode must be one of .* got \['off'\]"),
    (dict(mode="off", recompute_ops="cheap"), r"recompute_layers names none")],
    ids=["misspelt-mode", "mode-not-a-string", "cheap-without-layers"])
def test_wrong_arguments_are_named_before_anything_is_built(clean, kw, match):
    with pytest.raises(UsageError, match=match):
        gt.GraphedLayers([torch.nn.Linear(4, 4, device=clean.device)],
                         torch.randn(2, 4, device=clean.device), backend=clean, **kw)


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


class _ConvNorm(torch.nn.Module):
    """A block with batch norm: its forward moves the running statistics (in place, the
    means and variances without a new version)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(c, c, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


@pytest.mark.parametrize("kw", [
    dict(mode="off"), dict(mode="remap", offload_layers=[0, 1]),
    dict(mode="off", recompute_layers=[0, 2]),
    dict(mode="off", recompute_layers=[0, 2], recompute_ops="cheap"),
    dict(mode="remap", recompute_layers=[1])], ids=["keep", "offload", "recompute", "cheap",
                                                   "recompute-input-offloaded"])
def test_running_statistics_move_once_a_step_as_in_eager(clean, kw, monkeypatch):
    """The build (warm-ups, captures) leaves the buffers as it found them, and a recomputed
    layer's backward puts back what its recompute moved: the running statistics end as
    eager's, bit for bit, beside the gradients."""
    b = clean
    # (cuDNN may pick a convolution backward that adds in any order: not bit for bit)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    base = [_ConvNorm().to(b.device) for _ in range(3)]
    xs = [torch.randn(4, 8, 16, device=b.device) for _ in range(3)]

    def train(layers, f):
        for x in xs:
            f(x.clone().requires_grad_()).square().sum().backward()
        return ([t.clone() for m in layers for t in m.buffers()],
                [p.grad for m in layers for p in m.parameters()])

    eager = copy.deepcopy(base)
    want = train(eager, torch.nn.Sequential(*eager))
    layers = copy.deepcopy(base)
    before = [t.clone() for m in layers for t in m.buffers()]
    with gt.GraphedLayers(layers, xs[0].clone().requires_grad_(), layers_per_graph=1, backend=b,
                          **kw) as stack:
        assert_bitwise([t for m in layers for t in m.buffers()], before)  # the build's left none
        got = train(layers, stack)
    assert_bitwise(got[0], want[0])
    assert_bitwise(got[1], want[1])


class _Drop(torch.nn.Module):
    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(h, h), torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.lin(x))


@pytest.mark.parametrize("mode,kw", [
    ("off", {}), ("resident", {}),
    ("off", dict(recompute_layers=[1])), ("off", dict(recompute_layers=[0, 2])),
    ("resident", dict(recompute_layers=[0], offload_layers=[0, 1])),
    ("off", dict(recompute_layers=[1], recompute_ops="cheap"))],
    ids=["keep", "offload", "recompute-middle", "recompute-ends", "recompute-offloaded", "cheap"])
def test_a_seed_set_before_the_build_gives_eagers_dropout_masks(clean, mode, kw):
    """The build's warm-ups and captures draw from a fork of the generators: training
    seeded once, before the stack is built, draws what eager seeded alike draws, in every
    layer: a recomputed layer's forward draws from the default generator as eager's does,
    so the layers after it draw where eager's do, and its recompute draws that again."""
    b = clean
    torch.manual_seed(0)
    base = [_Drop().to(b.device) for _ in range(3)]
    xs = [torch.randn(4, 32, device=b.device) for _ in range(3)]
    got, want = seeded_grads(base, xs, mode=mode, backend=b, **kw)
    assert_bitwise(got, want)


class _NormLinear(torch.nn.Module):
    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.norm, self.lin = torch.nn.LayerNorm(h), torch.nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class _Attention(torch.nn.Module):
    """Self-attention with dropout: under autocast, torch's math path for it runs its
    products in full precision inside the one op."""

    def __init__(self, h: int = 32, heads: int = 4, dropout: float = 0.25) -> None:
        super().__init__()
        self.qkv, self.heads, self.dropout = torch.nn.Linear(h, 3 * h), heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h = x.shape[0], x.shape[-1]
        q, k, v = self.qkv(x).view(b, -1, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)
        return x + o.transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("layer", [_NormLinear, _Attention], ids=["norm-linear", "attention"])
@pytest.mark.parametrize("kw", [dict(mode="off"), dict(mode="resident"),
                                dict(mode="off", recompute_layers=[1])],
                         ids=["keep", "offload", "recompute"])
def test_a_stack_built_under_autocast_trains_under_it_as_eager(clean, kw, layer):
    """Built inside ``torch.autocast``, the graphs run the layers as autocast does (without
    its cast cache, whose copies would outlive the capture); a forward under another
    autocast than the capture's is refused before anything runs."""
    b = clean
    dt = b.device.type
    torch.manual_seed(0)
    mk = layer
    base = [mk().to(b.device) for _ in range(3)]
    xs = [torch.randn(4, 8, 32, device=b.device) for _ in range(3)]

    def train(layers, f):
        outs = []
        torch.manual_seed(1)
        for x in xs:
            with torch.autocast(dt, dtype=torch.bfloat16):
                y = f(x.clone().requires_grad_())
            outs.append(y.detach().clone())
            y.float().square().sum().backward()
        return outs + [p.grad for m in layers for p in m.parameters()]

    want = train(eager := copy.deepcopy(base), torch.nn.Sequential(*eager))
    layers = copy.deepcopy(base)
    with torch.autocast(dt, dtype=torch.bfloat16):
        stack = gt.GraphedLayers(layers, xs[0].clone().requires_grad_(), layers_per_graph=1,
                                 backend=b, **kw)
    with stack:
        assert stack.autocast_dtype == torch.bfloat16
        assert_bitwise(train(layers, stack), want)
        with pytest.raises(CaptureMismatchError, match="captured under autocast to torch.bfloat16, "
                           "and this forward runs without autocast"):
            stack(xs[0].clone().requires_grad_())
    plain = gt.GraphedLayers(copy.deepcopy(base), xs[0].clone().requires_grad_(), mode="off",
                             layers_per_graph=1, backend=b)
    with plain, torch.autocast(dt, dtype=torch.bfloat16):
        with pytest.raises(CaptureMismatchError, match="captured without autocast"):
            plain(xs[0].clone().requires_grad_())


class _DropNorm(torch.nn.Module):
    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.lin, self.drop, self.norm = torch.nn.Linear(h, h), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.norm(self.lin(x)))


def test_a_forward_in_eval_mode_runs_the_layers_as_eager_evaluates(clean):
    """Graphs captured in training mode hold its dropout and batch statistics: after
    ``model.eval()`` the stack runs its layers eagerly (any batch size), and after
    ``model.train()`` the graphs again, training as eager trains."""
    b = clean
    torch.manual_seed(0)
    base = [_DropNorm().to(b.device) for _ in range(3)]
    xs = [torch.randn(4, 32, device=b.device) for _ in range(2)]
    val = torch.randn(7, 32, device=b.device)  # (another batch size)

    def session(layers, f):
        out = []
        torch.manual_seed(1)
        for x in xs:
            f.train()
            f(x.clone().requires_grad_()).square().sum().backward()
            f.eval()
            with torch.no_grad():
                out.append(f(val))
        return out + [t.clone() for m in layers for t in (*(p.grad for p in m.parameters()),
                                                           *m.buffers())]

    want = session(eager := copy.deepcopy(base), torch.nn.Sequential(*eager))
    layers = copy.deepcopy(base)
    with gt.GraphedLayers(layers, xs[0].clone().requires_grad_(), mode="resident",
                          layers_per_graph=1, backend=b) as stack:
        got = session(layers, stack)
        assert stack.engine.stats["offloaded_bytes"] > 0  # (the training forwards were graphed)
        stack.eval()
        with pytest.warns(UserWarning, match="not in the training mode their graphs were captured in"):
            y = stack(xs[0].clone().requires_grad_())
        y.sum().backward()  # (eagerly, through autograd)
    assert_bitwise(got, want)


class _Routed(torch.nn.Module):
    """Routes each row to one of two experts by its data (a mixture of experts)."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.router, self.experts = torch.nn.Linear(h, 2), torch.nn.ModuleList(
            torch.nn.Linear(h, h) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pick = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            rows = (pick == k).nonzero(as_tuple=True)
            out[rows] = expert(x[rows])
        return x + out


def test_a_layer_whose_work_depends_on_its_data_is_named_at_build(clean):
    """Capturing fails for data-dependent work; the error names the layer and the reason,
    and the build gives back what it made."""
    b = clean
    torch.manual_seed(0)
    layers = [_NormLinear().to(b.device), _Routed().to(b.device)]
    x = torch.randn(8, 32, device=b.device, requires_grad=True)
    mapped = b.ledger.mapped_bytes
    with pytest.raises(StateError, match=r"layer 1: capturing the forward graph failed .* "
                       "keep such a layer outside GraphedLayers"):
        gt.GraphedLayers(layers, x, mode="resident", layers_per_graph=1, backend=b)
    assert b.ledger.mapped_bytes == mapped
    assert all(p.grad is None for m in layers for p in m.parameters())
    # and the process goes on: random numbers draw, and a stack built next trains (its
    # bitwise match with eager is the other tests' business)
    torch.manual_seed(1)
    drawn = torch.rand(16, device=b.device)
    torch.manual_seed(1)
    assert torch.equal(drawn, torch.rand(16, device=b.device))
    with gt.GraphedLayers(layers[:1], x, mode="resident", backend=b) as stack:
        stack(x).sum().backward()
    got = [p.grad.clone() for p in layers[0].parameters()]
    layers[0].zero_grad(set_to_none=True)
    layers[0](x).sum().backward()
    torch.testing.assert_close(got, [p.grad for p in layers[0].parameters()])


def test_weights_loaded_in_place_are_used_and_weights_put_elsewhere_are_refused(clean):
    """The graphs read the parameters where the capture found them: new values copied in
    (``load_state_dict``) train as eager with them; a parameter given new memory
    (``assign=True``) is refused at the next forward, naming it, before anything runs."""
    b = clean
    torch.manual_seed(0)
    layers = [_NormLinear().to(b.device) for _ in range(2)]
    other = [_NormLinear().to(b.device) for _ in range(2)]
    x = torch.randn(4, 32, device=b.device)
    with gt.GraphedLayers(layers, x.clone().requires_grad_(), mode="resident",
                          layers_per_graph=1, backend=b) as stack:
        stack(x.clone().requires_grad_()).sum().backward()
        for m, o in zip(layers, other):
            m.load_state_dict(o.state_dict())
            m.zero_grad()
        stack(x.clone().requires_grad_()).square().sum().backward()
        torch.nn.Sequential(*other)(x.clone().requires_grad_()).square().sum().backward()
        assert_bitwise([p.grad for m in layers for p in m.parameters()],
                       [p.grad for m in other for p in m.parameters()])
        layers[1].load_state_dict(other[1].state_dict(), assign=True)
        with pytest.raises(CaptureMismatchError, match=r"layer 1\.norm\.weight lies elsewhere"):
            stack(x.clone().requires_grad_())


def test_the_stack_where_its_sequential_was_keeps_the_models_checkpoint_keys(clean):
    """A model whose ``nn.Sequential`` of layers is replaced by the stack keeps its
    state_dict keys: eager training's checkpoint loads strictly into the graphed model (in
    place) and trains on as eager; the graphed model's loads strictly into an eager one."""
    b = clean

    def model() -> torch.nn.Module:
        m = torch.nn.Module()
        m.blocks = torch.nn.ModuleList(_NormLinear() for _ in range(3))
        m.stack = torch.nn.Sequential(*m.blocks)
        m.head = torch.nn.Linear(32, 1)
        return m.to(b.device)

    torch.manual_seed(0)
    eager, graphed_model, other = model(), model(), model()
    x = torch.randn(4, 32, device=b.device)
    keys = list(eager.state_dict())
    with gt.GraphedLayers(list(graphed_model.blocks), x.clone().requires_grad_(),
                          mode="resident", layers_per_graph=1, backend=b) as stack:
        graphed_model.stack = stack
        assert list(graphed_model.state_dict()) == keys
        graphed_model.load_state_dict(eager.state_dict())
        for m in (eager, graphed_model):
            m.head(m.stack(x.clone().requires_grad_())).square().sum().backward()
        assert_bitwise([p.grad for p in graphed_model.parameters()],
                       [p.grad for p in eager.parameters()])
        other.load_state_dict(graphed_model.state_dict())
        assert_bitwise(list(other.state_dict().values()), list(eager.state_dict().values()))


def test_module_hooks_are_named_at_build_since_they_do_not_run_at_each_replay(clean):
    """A forward hook's Python runs while the graphs are built and not at the replays (its
    tensor work is in the graphs): the build warns, naming the hooked modules; a stack
    without hooks builds without that warning."""
    b = clean
    layers = [_NormLinear().to(b.device) for _ in range(2)]
    calls: list[int] = []
    layers[1].lin.register_forward_hook(lambda m, i, o: calls.append(1))
    x = torch.randn(4, 32, device=b.device)
    with pytest.warns(UserWarning, match=r"layers\[1\]\.lin have module hooks\. They run while "
                                         r"the graphs are built, not at each replay"):
        stack = gt.GraphedLayers(layers, x, mode="resident", backend=b)
    with stack:
        built = len(calls)
        stack(x).sum().backward()
        assert len(calls) == built  # what the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gt.GraphedLayers([_NormLinear().to(b.device)], x, mode="resident", backend=b).close()


@pytest.mark.parametrize("accumulate,set_to_none", [(3, True), (1, False)])
def test_keep_grads_gives_the_gradients_homes_whatever_the_layers_keep(clean, accumulate, set_to_none):
    """With keep_grads=True even mode off, whose layers keep every activation in the pool,
    gives the gradients homes: a kept .grad stays at one address through every forward
    (nothing copies it out of the pool), and training matches eager bit for bit."""
    b = clean
    base = small_gpt(b, 3)
    want = run(copy.deepcopy(base), b, 2, accumulate, set_to_none)
    for keep in (False, True):
        model = copy.deepcopy(base)
        with graphed(model, b, "off", keep_grads=keep) as stack:
            where: list[dict[int, int]] = []
            got = run(model, b, 2, accumulate, set_to_none,
                      after_backward=lambda: where.append(
                          {id(p): p.grad.data_ptr() for p in stack.parameters() if p.grad is not None}))
            assert_bitwise(got, want)
            # (.grad lives through the step's microbatches, or with set_to_none=False
            # through every step: compare the backwards it lived through)
            spans = ([where[s * accumulate:(s + 1) * accumulate] for s in range(2)]
                     if set_to_none else [where])
            moved = any(w[k] != span[0][k] for span in spans for w in span[1:] for k in w)
            assert moved is not keep, f"keep_grads={keep}: .grad moved: {moved}"


def test_keep_grads_is_a_bool(clean):
    with pytest.raises(UsageError, match="keep_grads must be True or False"):
        graphed(small_gpt(clean, 2), clean, "off", keep_grads="yes")


@pytest.mark.parametrize("keep", [False, True])
def test_a_kept_grad_that_takes_a_budgets_step_over_it_is_named_unless_planned_for(clean, monkeypatch, keep):
    """A plan whose gradients share the pool with kept activations counts them as gone by
    the next forward: a loop that accumulates into .grad then holds them beside it. Without
    keep_grads, that is named once, with the figures, where it takes the step over the
    budget; with keep_grads the plan gives them homes and counts them."""
    b = clean
    fake_profile(monkeypatch, [gb.LayerCost(1.0, 2.0, 4 * MiB, recompute_ms=4.0)] * 3)
    base = small_gpt(b, 3)
    with graphed(copy.deepcopy(base), b, None, memory_budget="auto", keep_grads=keep) as probe:
        budget = probe.plan.predicted_peak_bytes + 64 * 1024  # (kept everything: nothing pays)
        assert probe.plan.choices == ("keep",) * 3 and probe._grad_homes is keep
    model = copy.deepcopy(base)
    with graphed(model, b, None, memory_budget=budget, keep_grads=keep) as stack:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            run(model, b, 2, 3, True)
    said = [str(m.message) for m in w if ".grad was kept through a forward" in str(m.message)]
    if keep:
        assert said == []
    else:
        assert len(said) == 1 and "keep_grads=True" in said[0]
        grads = sum(p.numel() * p.element_size() for p in stack.parameters())
        assert f"the gradients ({format_bytes(grads)})" in said[0]


def test_a_planned_build_gives_gradient_homes_as_the_model_counted(clean, monkeypatch):
    """A plan's build decides gradient homes as the model did (has_gradient_homes): here
    the model knows that layers recomputed cheaply keep little and gives homes, which a
    build judging by the layers' whole saved bytes did not; the plan then trains as eager."""
    b = clean
    cost = gb.LayerCost(1.0, 2.0, 4 * MiB, recompute_ms=4.0, grad_bytes=64 * MiB,
                        cheap_saved_bytes=1024, cheap_recompute_ms=0.1)
    fake_profile(monkeypatch, [cost] * 3)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                  torch.nn.Linear(256, 64)).to(b.device) for _ in range(3)]
    x = torch.randn(256, 64, device=b.device, requires_grad=True)
    ref = copy.deepcopy(layers)
    with gt.GraphedLayers(layers, x, mode="off", memory_budget="auto", layers_per_graph=1,
                          backend=b) as probe:
        profile = probe.plan.profile
    cheap = (gb.RECOMPUTE_CHEAP,) * 3
    budget = gb.predict_peak_bytes(profile, cheap, "off") + 1024
    with gt.GraphedLayers(layers, x, mode="off", memory_budget=budget, layers_per_graph=1,
                          backend=b) as stack:
        # (the top layer is kept: its backward comes first, at no cost to the peak)
        assert stack.plan.detailed == cheap[:2] + (gb.KEEP,)
        assert gb.has_gradient_homes(profile, stack.plan.detailed, "off") and stack._grad_homes
        # (square: a plain sum's gradient reaches eager's top layer as an expanded tensor,
        # which cuBLAS reduces in another order than the graph's contiguous buffer)
        stack(x).square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    h = xr
    for m in ref:
        h = m(h)
    h.square().sum().backward()
    assert_bitwise([x.grad, *(p.grad for m in layers for p in m.parameters())],
                   [xr.grad, *(p.grad for m in ref for p in m.parameters())])


def test_with_main_grad_the_plan_counts_no_gradient_buffers(clean, monkeypatch):
    """With main_grad=True the backward graphs add into main_grad, which the process holds
    before the build: the plan counts no gradient buffers of the stack's (before, every
    plan counted the gradients a second time, in homes or in the pool)."""
    b = clean
    fake_profile(monkeypatch, [gb.LayerCost(1.0, 2.0, 4 * MiB, grad_bytes=8 * MiB)] * 3)
    peaks = {}
    for main in (False, True):
        model = small_gpt(b, 3)
        if main:
            for p in model.parameters():
                p.main_grad = torch.zeros_like(p)
        with graphed(model, b, None, memory_budget="auto", main_grad=main) as stack:
            assert all(c.grad_bytes == (0 if main else 8 * MiB) for c in stack.plan.profile.layers)
            peaks[main] = gb.predict_peak_bytes(stack.plan.profile, stack.plan.detailed, stack.plan.mode)
    assert peaks[True] < peaks[False]


def test_a_kept_input_gradient_is_no_kept_parameter_gradient(clean, monkeypatch):
    """A leaf input used again keeps its .grad (the first layer's buffer, copied out at the
    next forward): that is the caller's tensor, not the parameters' gradients, and no
    keep_grads would change it: nothing is said."""
    b = clean
    fake_profile(monkeypatch, [gb.LayerCost(1.0, 2.0, 4 * MiB, recompute_ms=4.0)] * 3)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to(b.device)
              for _ in range(3)]
    x = torch.randn(16, 64, device=b.device, requires_grad=True)
    with gt.GraphedLayers(layers, x, memory_budget="auto", layers_per_graph=1, backend=b) as probe:
        budget = probe.plan.predicted_peak_bytes + 1024  # (less than the gradients' bytes)
        assert not probe._grad_homes
    with gt.GraphedLayers(layers, x, memory_budget=budget, layers_per_graph=1, backend=b) as stack:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                stack(x).sum().backward()  # (x.grad kept and accumulated; parameters' too)
                for m in layers:
                    m.zero_grad(set_to_none=True)
        assert x.grad is not None
    assert not [m for m in w if ".grad was kept through a forward" in str(m.message)]
