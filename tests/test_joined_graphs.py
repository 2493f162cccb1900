"""GraphedLayers joins consecutive small layers into one device graph (``layers_per_graph``).

What the plan must hold to (sizes, the offload boundary, a fixed count), that a joined
stack trains bit for bit as eager does in every mode, several microbatches in flight
included, and that joining changes nothing a user sees of the layers themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch

from graphslot.adapters import torch as gt
from graphslot.adapters.torch import GraphedLayers, plan_graphs
from graphslot.errors import UsageError
from graphslot.memory import saved_bytes_per_layer
from graphslot.offload import ping_pong_banks
from stacks import graphed, small_gpt
from test_graphed_grads import assert_bitwise, run

MODES = ["off", "resident", "remap"]
MiB = 1 << 20


def test_the_plan_joins_while_the_saved_bytes_fit():
    sizes = [10 * MiB, 10 * MiB, 10 * MiB, 10 * MiB, 40 * MiB, 1 * MiB, 1 * MiB]
    plan = plan_graphs(7, set(range(7)), None, sizes, join_bytes=32 * MiB)
    # three of ten fit in 32, the fourth starts a graph, a layer above the bound stands alone
    assert plan == ((0, 1, 2), (3,), (4,), (5, 6))
    assert plan_graphs(3, {0, 1, 2}, None, [0, 0, 0]) == ((0, 1, 2),)


def test_the_plan_never_mixes_layers_in_and_outside_offload_layers():
    assert plan_graphs(6, {0, 1, 4}, None, [0] * 6) == ((0, 1), (2, 3), (4,), (5,))
    assert plan_graphs(6, {0, 1, 4}, 4, None) == ((0, 1), (2, 3), (4,), (5,))


def test_a_fixed_count_per_graph():
    assert plan_graphs(5, set(range(5)), 2, None) == ((0, 1), (2, 3), (4,))
    assert plan_graphs(3, set(range(3)), 1, None) == ((0,), (1,), (2,))
    assert plan_graphs(3, set(range(3)), 8, None) == ((0, 1, 2),)


def test_joining_by_size_needs_every_layers_size():
    with pytest.raises(UsageError, match="every layer's saved bytes"):
        plan_graphs(3, {0, 1, 2}, None, [1, 2])


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_layers_per_graph_must_be_a_positive_integer(clean, bad):
    b = clean
    model = small_gpt(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    with pytest.raises(UsageError, match="layers_per_graph must be a positive integer"):
        GraphedLayers(list(model.blocks), sample, backend=b, layers_per_graph=bad)


def test_small_layers_share_a_graph_by_default_and_large_ones_do_not(clean, monkeypatch):
    b = clean
    model = small_gpt(b, 4)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    with GraphedLayers(list(model.blocks), sample, mode="resident", backend=b) as stack:
        assert stack.graph_layers == ((0, 1, 2, 3),)
        assert [g.name for g in stack.engine.groups] == ["layers0-3"]
        saved = saved_bytes_per_layer(list(model.blocks), sample)
    # What one layer saves is what its own slot holds (up to the slot's alignment).
    with GraphedLayers(list(model.blocks), sample, mode="resident", backend=b,
                       layers_per_graph=1) as apart:
        for s, g in zip(saved, apart.engine.groups):
            assert 0 < s <= g.nbytes <= s + 2 * 256 * len(g.specs)
    # A bound between one and two layers' bytes: one graph per layer.
    monkeypatch.setattr(gt.plan, "JOIN_BYTES", max(saved) + min(saved) - 1)
    with GraphedLayers(list(model.blocks), sample, mode="resident", backend=b) as stack:
        assert stack.graph_layers == ((0,), (1,), (2,), (3,))


def test_offload_layers_split_the_joined_graphs(clean):
    b = clean
    model = small_gpt(b, 4)
    with graphed(model, b, "resident", layers_per_graph=None, offload_layers=[2, 3]) as stack:
        assert stack.graph_layers == ((0, 1), (2, 3))
        assert [g.offloads for g in stack.engine.groups] == [False, True]


@pytest.mark.parametrize("mode", MODES)
def test_a_joined_stack_trains_as_eager_bitwise(clean, mode):
    b = clean
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 3, 2, False)
    model = copy.deepcopy(base)
    with graphed(model, b, mode, layers_per_graph=2) as stack:
        assert stack.graph_layers == ((0, 1), (2, 3))
        assert_bitwise(run(model, b, 3, 2, False), want)
        if mode != "off":
            assert stack.engine.stats["offloaded_bytes"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_several_microbatches_in_flight_through_joined_graphs(clean, mode):
    b = clean
    base = small_gpt(b, 4)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    with graphed(model, b, mode, layers_per_graph=3) as stack:
        assert stack.graph_layers == ((0, 1, 2), (3,))
        for m in (eager, model):
            losses = [m(*m.batch(k, b.device)) for k in range(3)]  # three forwards, then
            for loss in reversed(losses):  # their backwards, newest first
                loss.backward()
        assert_bitwise([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()])


def test_joining_leaves_the_layers_parameters_and_state_dict_alone(clean):
    b = clean
    model = small_gpt(b, 3)
    keys = list(model.blocks.state_dict())
    with graphed(model, b, "off", layers_per_graph=None) as stack:
        assert stack.graph_layers == ((0, 1, 2),)
        assert list(stack.state_dict()) == keys
        assert {id(p) for p in stack.parameters()} == {id(p) for p in model.blocks.parameters()}


def test_a_layer_that_returns_a_tuple_is_named_before_anything_is_joined(clean):
    b = clean
    model = small_gpt(b, 2)

    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    with pytest.raises(UsageError, match="layer 2 returned tuple"):
        GraphedLayers([*model.blocks, Pair()], sample, backend=b)


class _TiedInside(torch.nn.Module):
    """One layer whose two halves share one Linear."""

    def __init__(self) -> None:
        super().__init__()
        lin = torch.nn.Linear(16, 16)
        self.a, self.b = torch.nn.Sequential(lin), torch.nn.Sequential(lin, torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("per_graph", [1, None])
def test_building_keeps_tied_parameters_the_same_objects(clean, per_graph):
    b = clean
    torch.manual_seed(0)
    layers = [_TiedInside().to(b.device), _TiedInside().to(b.device)]
    eager = copy.deepcopy(layers)
    before = [id(p) for m in layers for p in m.parameters()]
    x = torch.randn(4, 16, device=b.device)
    with GraphedLayers(layers, x, mode="resident", backend=b, layers_per_graph=per_graph) as stack:
        assert [id(p) for m in layers for p in m.parameters()] == before
        assert layers[0].a[0].weight is layers[0].b[0].weight
        for _ in range(2):
            stack(x).square().sum().backward()
            y = x
            for m in eager:
                y = m(y)
            y.square().sum().backward()
        assert_bitwise([p.grad for m in layers for p in m.parameters()],
                       [p.grad for m in eager for p in m.parameters()])


def test_the_graphs_that_offload_alternate_banks_in_backward_order(clean):
    """One rule for every adapter (graphslot.offload.ping_pong_banks): among the units that
    offload, in backward order, banks go 0, 1, 0, ...; a unit that keeps gets the bank the
    next offloading one takes."""
    assert ping_pong_banks([]) == []
    assert ping_pong_banks([True, True, True]) == [0, 1, 0]
    assert ping_pong_banks([True, False, True, True]) == [0, 1, 1, 0]
    b = clean
    model = small_gpt(b, 5)
    with graphed(model, b, "resident", offload_layers=[0, 2, 3, 4], layers_per_graph=1) as stack:
        # backward order: 4, 3, 2, (1 keeps), 0
        assert [stack.bank_index(i) for i in (4, 3, 2, 1, 0)] == [0, 1, 0, 1, 1]
