"""Layers recomputed cheaply inside the graphs (``recompute_ops="cheap"``): the forward
keeps the outputs of matrix products and attention, the backward runs only the cheap ops
again, and training is bit for bit eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphslot import recompute as gr
from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import UsageError
from stacks import graphed, seeded_grads, small_gpt
from test_graphed_grads import assert_bitwise, run
from test_recompute_rng import DropScale


def test_the_expensive_ops_are_matrix_products_attention_and_convolution():
    aten = torch.ops.aten
    assert gr.is_expensive(aten.mm.default) and gr.is_expensive(aten.addmm)
    assert gr.is_expensive(aten.convolution.default)
    assert not gr.is_expensive(aten.gelu.default) and not gr.is_expensive(aten.add.Tensor)
    assert not gr.is_expensive(aten.native_layer_norm.default)


@pytest.mark.parametrize("mode", ["off", "resident", "remap"])
def test_cheap_recompute_trains_as_eager_bitwise(clean, mode):
    """Layers 1 and 2 recomputed cheaply, beside an offloaded, a kept and a fully recomputed one."""
    b = clean
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 3, 2, False)
    model = copy.deepcopy(base)
    offload = [0] if mode != "off" else []
    with graphed(model, b, mode, offload_layers=offload, recompute_layers=[1, 2],
                 recompute_ops="cheap") as stack:
        assert stack.cheap_layers == {1, 2} and stack.recompute_layers == {1, 2}
        assert not any(r.unit.offloads for r in stack._runners[1:3])  # (inputs stay)
        assert_bitwise(run(model, b, 3, 2, False), want)


def test_a_cheap_recompute_keeps_more_than_a_full_one_and_less_than_keeping(clean):
    """What the backward graph reads of the forward's memory: the input alone for a full
    recompute; the products' and attention's outputs besides for a cheap one; every saved
    activation for a kept layer."""
    b = clean
    kept = {}
    for name, kw in (("keep", {}), ("all", {"recompute_layers": [0, 1, 2]}),
                     ("cheap", {"recompute_layers": [0, 1, 2], "recompute_ops": "cheap"})):
        model = small_gpt(b, 3)
        with graphed(model, b, "off", **kw) as stack:
            kept[name] = [g.kept_bytes for g in stack.engine.groups]
            model(*model.batch(0, b.device)).backward()
    for k in range(3):
        assert kept["all"][k] < kept["cheap"][k] < kept["keep"][k], kept


def test_a_cheaply_recomputed_dropout_uses_its_forwards_mask(clean):
    b = clean
    torch.manual_seed(0)
    layers = [DropScale(256).to(b.device) for _ in range(2)]
    x0 = torch.rand(8, 256, device=b.device) + 0.5
    with GraphedLayers(layers, x0.clone().requires_grad_(), mode="off", recompute_layers=[0, 1],
                       recompute_ops="cheap", layers_per_graph=1, backend=b) as stack:
        xs = [(x0 + k).requires_grad_() for k in range(2)]
        ys = [stack(x).clone() for x in xs]
        for k in (1, 0):
            ys[k].backward(torch.ones_like(ys[k]))
        for k in range(2):
            dropped = ys[k] == 0
            w = layers[0].w * layers[1].w
            torch.testing.assert_close(xs[k].grad, torch.where(dropped, torch.zeros_like(w), 4 * w))


class _TwoDraws(nn.Module):
    """A product, then two dropouts: the second draws after the first. The first is
    aten's fused ``native_dropout``, one op that returns what it drew from, as attention
    with dropout does (plain dropout on cpu is several ops)."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.lin, self.w = nn.Linear(n, n), nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.ops.aten.native_dropout(self.lin(x), 0.5, True)[0]
        return nn.functional.dropout(first * self.w, 0.5) + x


def test_an_expensive_call_that_draws_random_numbers_runs_again(clean, monkeypatch):
    """Attention with dropout is one expensive op that draws (on a GPU: flash or efficient
    attention). Kept, it would draw nothing in the recompute and the dropouts after it
    would draw other masks than the forward's: it runs again, and training is eager's.
    Here dropout itself stands in for such an op, counted as expensive."""
    b = clean
    monkeypatch.setattr(gr, "EXPENSIVE_OPS", gr.EXPENSIVE_OPS | {torch.ops.aten.native_dropout})
    call = (torch.ops.aten.native_dropout.default, (torch.ones(2), 0.5, True))
    assert gr.is_expensive(call[0]) and not gr._kept(*call, {})
    assert gr._kept(torch.ops.aten.native_dropout.default, (torch.ones(2), 0.0, True), {})
    torch.manual_seed(0)
    base = [_TwoDraws().to(b.device) for _ in range(3)]
    xs = [torch.randn(8, 64, device=b.device) for _ in range(3)]
    got, want = seeded_grads(base, xs, mode="off", recompute_layers=[0, 1], recompute_ops="cheap",
                             backend=b)
    assert_bitwise(got, want)


def test_bad_recompute_ops_are_named(clean):
    b = clean
    model = small_gpt(b, 2)
    with pytest.raises(UsageError, match="recompute_ops must be 'all', 'cheap' or 'parts'"):
        graphed(model, b, "off", recompute_layers=[0], recompute_ops="some")
    with pytest.raises(UsageError, match=r"layers \[0\] are recomputed cheaply"):
        graphed(model, b, "remap", recompute_layers=[0], offload_layers=[0], recompute_ops="cheap")
    with pytest.raises(UsageError, match="recompute_ops is for recompute_layers"):
        graphed(model, b, None, memory_budget="auto", recompute_ops="cheap")


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(torch.sigmoid(x)))


def test_noting_sees_what_the_selective_forward_keeps(clean):
    """The outputs noted are exactly those of the expensive ops: here one convolution."""
    b = clean
    m = _Conv().to(b.device)
    x = torch.randn(2, 4, 8, device=b.device, requires_grad=True)
    noted: list[torch.Tensor] = []
    y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False,
                                          context_fn=gr.cheap_recompute_contexts(noted.append))
    assert [t.shape for t in noted] == [torch.Size([2, 4, 8])]
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    m(x).sum().backward()
    assert torch.equal(g, x.grad)


def test_a_budget_that_chooses_cheap_recompute_builds_it_and_trains_as_eager(clean, monkeypatch):
    from graphslot import budget as gb
    from test_budget_stack import fake_profile

    b = clean
    MiB = 1 << 20
    # Keeping a layer costs 64 MiB, recomputing it cheaply 16 MiB for little time, fully
    # a whole forward: room for about two layers' worth recomputes cheaply.
    layer = gb.LayerCost(4.0, 8.0, 64 * MiB, recompute_ms=4.0, work_bytes=0,
                         cheap_saved_bytes=16 * MiB, cheap_recompute_ms=0.2)
    fake_profile(monkeypatch, [layer] * 4, gbps=1.0)
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 2, 1, True)
    with graphed(copy.deepcopy(base), b, None, memory_budget="auto") as probe:
        fixed = probe.plan.profile.fixed_bytes
    model = copy.deepcopy(base)
    with graphed(model, b, None, memory_budget=fixed + 2 * 64 * MiB) as stack:
        plan = stack.plan
        assert plan is not None and plan.layers(gb.RECOMPUTE_CHEAP)
        assert stack.cheap_layers == set(plan.layers(gb.RECOMPUTE_CHEAP))
        assert stack.recompute_layers == set(plan.layers(gb.RECOMPUTE))
        assert not any(r.unit.offloads for r in stack._runners if r.cheap)
        assert_bitwise(run(model, b, 2, 1, True), want)


def test_the_profile_measures_what_a_cheap_recompute_keeps(clean):
    from graphslot.profile import profile_units

    b = clean
    model = small_gpt(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    costs = profile_units(b, list(model.blocks), sample)
    for c in costs:
        assert c.cheap and 0 < c.cheap_saved_bytes < c.saved_bytes
        assert 0 <= c.cheap_recompute_ms <= c.forward_ms


class _InPlaceAct(nn.Module):
    """A block whose activation changes the first product's output in place (as
    ``nn.ReLU(inplace=True)`` does): the selective policy cannot keep that output."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(torch.tanh(x))))


def test_an_output_changed_in_place_is_found_and_made_again_instead_of_kept(clean):
    b = clean
    torch.manual_seed(0)
    m = _InPlaceAct().to(b.device)
    x = torch.randn(8, 32, device=b.device, requires_grad=True)
    with gr.noting_expensive_outputs() as changed:
        m(x)
    addmm = torch.ops.aten.addmm
    assert changed == {(addmm, 0)}  # the up projection's; the down one's is left as made
    noted: list[torch.Tensor] = []
    y = torch.utils.checkpoint.checkpoint(
        m, x, use_reentrant=False, context_fn=gr.cheap_recompute_contexts(noted.append, frozenset(changed)))
    assert [t.shape for t in noted] == [torch.Size([8, 32])]  # the down projection's alone
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    m(x).sum().backward()
    assert torch.equal(g, x.grad)


@pytest.mark.parametrize("mode", ["off", "remap"])
def test_a_layer_with_an_in_place_activation_recomputes_cheaply_as_eager(clean, mode):
    b = clean
    torch.manual_seed(0)
    base = [_InPlaceAct().to(b.device) for _ in range(3)]
    xs = [torch.randn(8, 32, device=b.device) for _ in range(2)]
    want = _grads(copy.deepcopy(base), xs)
    layers = copy.deepcopy(base)
    offload = [0] if mode != "off" else []
    with GraphedLayers(layers, xs[0].clone().requires_grad_(), mode=mode, offload_layers=offload,
                       recompute_layers=[1, 2], recompute_ops="cheap", layers_per_graph=1,
                       backend=b) as stack:
        assert_bitwise(_grads(layers, xs, stack), want)


def _grads(layers: list[nn.Module], xs: list[torch.Tensor], stack: nn.Module | None = None
           ) -> list[torch.Tensor]:
    """The layers' gradients after a backward of each of ``xs`` through ``stack`` (or the
    layers eagerly)."""
    f = stack or nn.Sequential(*layers)
    for x in xs:
        f(x.clone().requires_grad_()).square().sum().backward()
    return [p.grad for m in layers for p in m.parameters()]


class _UnsafeChunks(nn.Module):
    """Changes a product's output in place through ``unsafe_chunk`` views, which share no
    version counter with it (as a GRU cell does on cpu): only the values tell."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.gates = nn.Linear(h, 2 * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.gates(x).unsafe_chunk(2, -1)
        return x + a.sigmoid_() * g.tanh_()


@pytest.mark.parametrize("layer", [_UnsafeChunks, lambda: nn.GRU(32, 32, batch_first=True)])
def test_an_output_changed_through_views_sharing_no_version_is_made_again(clean, layer):
    b = clean
    torch.manual_seed(0)
    base = [layer().to(b.device) for _ in range(2)]
    base = [_First(m) if isinstance(m, nn.GRU) else m for m in base]
    xs = [torch.randn(4, 8, 32, device=b.device) for _ in range(2)]
    want = _grads(copy.deepcopy(base), xs)
    layers = copy.deepcopy(base)
    with GraphedLayers(layers, xs[0].clone().requires_grad_(), mode="off", recompute_layers=[0, 1],
                       recompute_ops="cheap", layers_per_graph=1, backend=b) as stack:
        assert_bitwise(_grads(layers, xs, stack), want)


class _First(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_the_profile_counts_an_output_changed_in_place_as_made_again(clean):
    from graphslot.profile import profile_units

    b = clean
    torch.manual_seed(0)
    m = _InPlaceAct().to(b.device)
    x = torch.randn(8, 32, device=b.device, requires_grad=True)
    (cost,) = profile_units(b, [m], x)
    assert cost.cheap  # it can still recompute cheaply, keeping the down projection's output
    assert cost.cheap_saved_bytes == x.numel() * x.element_size()
