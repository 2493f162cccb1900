"""Backwards that do not reach every layer, and parameters several layers share: as in
eager. A layer that stops the gradient leaves the layers below without one (``.grad``
None, not zeros); a backward that stops above the stack's first layer (frozen layers
below, ``backward(inputs=...)``) leaves close() free at once; a parameter shared across
graphs gets eager's gradient bit for bit, however the graphs split the layers."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from graphslot.adapters import torch as gt
from graphslot.adapters.torch.plan import plan_graphs
from stacks import seeded_grads
from test_graphed_grads import assert_bitwise

H = 8


class _StopGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() + 1


class _Tied(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))


KWS = [dict(mode="off"), dict(mode="off", layers_per_graph=1), dict(mode="resident", layers_per_graph=1),
       dict(mode="remap", layers_per_graph=1, recompute_layers=[0])]


@pytest.mark.parametrize("kw", KWS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_a_layer_that_stops_the_gradient_leaves_the_layers_below_none(clean, kw):
    b = clean
    torch.manual_seed(0)
    layers = [_mlp().to(b.device), _StopGrad(), _mlp().to(b.device)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b,
                          **kw) as stack:
        opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=0.1)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=0.1)
        for _ in range(3):
            x = torch.randn(4, H, device=b.device, requires_grad=True)
            xe = x.detach().clone().requires_grad_()
            stack(x).square().sum().backward()
            eager(xe).square().sum().backward()
            assert x.grad is None and xe.grad is None
            assert all(p.grad is None for p in layers[0].parameters())
            assert_bitwise([p.grad for p in layers[2].parameters()], [p.grad for p in eager[2].parameters()])
            opt.step()
            opt_e.step()
            opt.zero_grad()
            opt_e.zero_grad()
        # (AdamW's weight decay would have moved layer 0 had it got zeros)
        assert_bitwise([p.detach() for m in layers for p in m.parameters()],
                       [p.detach() for p in eager.parameters()])


def _closes_at_once(stack: gt.GraphedLayers) -> float:
    t = time.perf_counter()
    stack.close(timeout=10)
    return time.perf_counter() - t


@pytest.mark.parametrize("kw", KWS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_frozen_layers_below_and_an_input_without_gradient(clean, kw):
    """Fine-tuning the top: the backward ends above the stack's first layer; the
    gradients are eager's, training goes on, and close() does not wait for a backward
    that will never come."""
    b = clean
    torch.manual_seed(1)
    layers = [_mlp().to(b.device) for _ in range(3)]
    for p in layers[0].parameters():
        p.requires_grad_(False)
    eager = nn.Sequential(*copy.deepcopy(layers))
    stack = gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device), backend=b, **kw)
    for _ in range(3):
        x = torch.randn(4, H, device=b.device)
        stack(x).square().sum().backward()
        eager(x.clone()).square().sum().backward()
    assert_bitwise([p.grad for m in layers[1:] for p in m.parameters()],
                   [p.grad for m in list(eager)[1:] for p in m.parameters()])
    assert _closes_at_once(stack) < 5


def test_a_backward_to_some_inputs_only_leaves_close_free(clean):
    b = clean
    torch.manual_seed(2)
    layers = [_mlp().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    stack = gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True),
                             layers_per_graph=1, mode="off", backend=b)
    x = torch.randn(4, H, device=b.device, requires_grad=True)
    out = stack(x)  # (kept: its autograd graph lives on past the backward)
    top = list(layers[2].parameters())
    out.square().sum().backward(inputs=top)
    eager(x.detach().clone().requires_grad_()).square().sum().backward(inputs=list(eager[2].parameters()))
    assert_bitwise([p.grad for p in top], [p.grad for p in eager[2].parameters()])
    assert all(p.grad is None for m in layers[:2] for p in m.parameters())
    # and another step trains as usual
    stack(torch.randn(4, H, device=b.device, requires_grad=True)).sum().backward()
    assert all(p.grad is not None for m in layers for p in m.parameters())
    assert _closes_at_once(stack) < 5
    del out


@pytest.mark.parametrize("kw", KWS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_backwards_to_the_top_layer_only_train_as_eager_with_their_losses_kept(clean, kw):
    """A pass that stops above an offloaded layer leaves that layer's look-ahead restore in
    a bank: the next forward (the caller still holding the last loss, as ``loss = model(x)``
    loops do) and another microbatch's backward need that bank, and get it."""
    b = clean
    torch.manual_seed(4)
    layers = [_mlp().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    stack = gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True),
                             backend=b, **kw)
    top, top_e = list(layers[2].parameters()), list(eager[2].parameters())
    xs = [torch.randn(4, H, device=b.device, requires_grad=True) for _ in range(5)]
    loss = None
    for x in xs[:3]:  # one at a time, each loss kept across the next forward
        xe = x.detach().clone().requires_grad_()
        loss = stack(x).square().sum()
        loss.backward(inputs=top)
        eager(xe).square().sum().backward(inputs=top_e)
        assert_bitwise([p.grad for p in top], [p.grad for p in top_e])
        assert x.grad is None and xe.grad is None
    # two in flight: the first to the top layer only, then the second all the way
    a, c = (stack(x).square().sum() for x in xs[3:])
    ea, ec = (eager(x.detach().clone().requires_grad_()).square().sum() for x in xs[3:])
    a.backward(inputs=top)
    ea.backward(inputs=top_e)
    c.backward()
    ec.backward()
    assert_bitwise([p.grad for m in layers for p in m.parameters()],
                   [p.grad for p in eager.parameters()])
    assert _closes_at_once(stack) < 5
    del loss, a, c


@pytest.mark.parametrize("kw", KWS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_a_backward_that_fails_part_way_leaves_close_free_and_training_goes_on(clean, kw):
    """A hook raising between two layers ends autograd's pass with no callback run: the
    pass is over all the same (close() does not wait for it), the layers below it keep
    nothing that stops the next step, and that step is eager's."""
    b = clean
    torch.manual_seed(3)
    layers = [_mlp().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    stack = gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True),
                             backend=b, **kw)

    def fail(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a hook failed")

    hook = layers[1][0].weight.register_hook(fail)
    out = stack(torch.randn(4, H, device=b.device, requires_grad=True))  # (kept alive)
    with pytest.raises(RuntimeError, match="a hook failed"):
        out.sum().backward()
    hook.remove()
    for m in (*layers, eager):
        m.zero_grad()
    x = torch.randn(4, H, device=b.device, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    stack(x).square().sum().backward()
    eager(xe).square().sum().backward()
    assert_bitwise([x.grad, *(p.grad for m in layers for p in m.parameters())],
                   [xe.grad, *(p.grad for p in eager.parameters())])
    assert _closes_at_once(stack) < 5
    del out


CONFIGS = [dict(mode="resident"), dict(mode="resident", recompute_layers=[0]),
           dict(mode="resident", recompute_layers=[0, 1]), dict(mode="off", recompute_layers=[3]),
           dict(mode="off", recompute_layers=[0, 1, 2, 3]), dict(mode="remap", recompute_layers=[1, 2])]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_a_parameter_several_layers_share_gets_eagers_gradient_bitwise(clean, kw):
    b = clean
    torch.manual_seed(0)
    shared = nn.Linear(16, 16).to(b.device)
    layers = [_Tied(shared), _Tied(shared), nn.Sequential(nn.Linear(16, 16), nn.Tanh()).to(b.device),
              _Tied(shared)]
    eager = copy.deepcopy(nn.Sequential(*layers))
    x = torch.randn(6, 16, device=b.device, requires_grad=True)
    with gt.GraphedLayers(layers, x.detach().clone().requires_grad_(), backend=b, **kw) as stack:
        stack(x).square().mean().backward()
    eager(x.detach().clone().requires_grad_()).square().mean().backward()
    assert_bitwise([p.grad for p in nn.Sequential(*layers).parameters()],
                   [p.grad for p in eager.parameters()])


@pytest.mark.parametrize("recomputed, joined, want", [
    # (eager adds 3's part, then 1's, then 0's; a graph adds the parts it covers first)
    ({0, 1}, ((0, 1), (2, 3)), ((0,), (1,), (2, 3))),
    ({3}, ((0, 1, 2), (3,)), ((0,), (1,), (2,), (3,))),
    ({0}, ((0,), (1, 2, 3)), ((0,), (1, 2, 3))),  # the topmost graph may add 3's and 1's first
    ({0, 1, 2, 3}, ((0, 1, 2, 3),), ((0, 1, 2, 3),)),  # one graph adds as eager does
])
def test_graphs_split_where_a_shared_parameters_parts_would_add_in_another_order(recomputed, joined, want):
    assert plan_graphs(4, set(), None, [1] * 4, recomputed=recomputed) == joined
    assert plan_graphs(4, set(), None, [1] * 4, recomputed=recomputed, tied=[{0, 1, 3}]) == want


def test_a_stack_of_one_shared_layer_stays_one_graph_with_one_gradient_buffer(clean):
    """Every layer the same module (ALBERT's layer sharing): one graph, as eager adds the
    parts, and one buffer for the shared gradient, not one per layer."""
    b = clean
    torch.manual_seed(8)
    block = _mlp().to(b.device)
    layers = [block] * 6
    xs = [torch.randn(4, H, device=b.device) for _ in range(2)]
    got, want = seeded_grads(layers, xs, backend=b, mode="off", layers_per_graph=None)
    assert_bitwise(got[:len(list(block.parameters()))], want[:len(list(block.parameters()))])
    with gt.GraphedLayers(layers, xs[0].clone().requires_grad_(), mode="off", backend=b) as stack:
        assert stack.graph_layers == ((0, 1, 2, 3, 4, 5),)


def test_layers_frozen_after_the_build_with_microbatches_in_flight(clean):
    """Frozen since the build (as fine-tuning does), below the layers that train: they
    keep nothing for a backward, and the microbatches in flight train as eager's."""
    b = clean
    torch.manual_seed(5)
    layers = [_mlp().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    for mode in ("off", "resident"):
        stack = gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device), mode=mode,
                                 layers_per_graph=1, backend=b)
        for m in (layers[0], eager[0]):
            m.requires_grad_(False)
        xs = [torch.randn(4, H, device=b.device) for _ in range(2)]
        outs = [stack(x) for x in xs]
        assert stack._runners[0].pending == set() and not stack._abandoned
        for y in reversed(outs):
            y.square().sum().backward()
        for x in reversed(xs):
            eager(x).square().sum().backward()
        assert_bitwise([p.grad for m in layers[1:] for p in m.parameters()],
                       [p.grad for m in list(eager)[1:] for p in m.parameters()])
        assert all(r.pending == set() for r in stack._runners)
        assert _closes_at_once(stack) < 5
        for m in (layers[0], eager[0]):
            m.requires_grad_(True)
        for p in [*eager.parameters(), *(p for m in layers for p in m.parameters())]:
            p.grad = None


class _TwoParams(nn.Module):
    """``tanh(x + p + q)``: x's, p's and q's gradients are one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, H))
        self.q = nn.Parameter(torch.randn(4, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.p + self.q)


@pytest.mark.parametrize("wants", [False, True], ids=["input-without-grad", "input-with-grad"])
def test_gradients_autograd_hands_out_as_one_tensor_get_bytes_each(clean, wants):
    """Clipping scales each .grad in place once, and zeroing the input's gradient leaves
    the parameters' alone, as in eager."""
    b = clean
    torch.manual_seed(6)
    layers = [_TwoParams().to(b.device), _mlp().to(b.device)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=wants),
                          layers_per_graph=1, mode="off", backend=b) as stack:
        x = torch.randn(4, H, device=b.device, requires_grad=wants)
        xe = x.detach().clone().requires_grad_(wants)
        stack(x).square().sum().backward()
        eager(xe).square().sum().backward()
        grads = [layers[0].p.grad, layers[0].q.grad] + ([x.grad] if wants else [])
        assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)
        if wants:
            x.grad.zero_()
            xe.grad.zero_()
        for m in (nn.Sequential(*layers), eager):
            nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        assert_bitwise([p.grad for m in layers for p in m.parameters()],
                       [p.grad for p in eager.parameters()])


class _Fused(torch.autograd.Function):
    """``x * a + x * b`` whose backward hands ``a`` and ``b`` two halves of one buffer."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(x)
        return x * a + x * b

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        both = torch.stack([(g * x).sum(0), (g * x).sum(0)])
        return g * 2, both[0], both[1]


class _FusedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(H))
        self.b = nn.Parameter(torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fused.apply(x, self.a, self.b)


@pytest.mark.parametrize("kw", [dict(mode="off"), dict(mode="off", keep_grads=True),
                                dict(mode="resident", recompute_layers=[0])], ids=["lent", "homes", "recomputed"])
def test_gradients_in_one_buffer_train_as_eager_over_accumulated_microbatches(clean, kw):
    """A fused kernel's gradients, two views of one buffer."""
    b = clean
    torch.manual_seed(7)
    layers = [_FusedLayer().to(b.device), _mlp().to(b.device)]
    xs = [torch.randn(4, H, device=b.device) for _ in range(3)]
    got, want = seeded_grads(layers, xs, backend=b, **kw)
    assert_bitwise(got, want)


def test_a_layer_frozen_with_a_microbatch_in_flight_gets_no_gradient_from_its_home(clean):
    """Frozen between two forwards: autograd drops what the first microbatch's backward
    brings it, as in eager, also where the graph adds into a gradient home."""
    b = clean
    torch.manual_seed(9)
    layers = [_mlp().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device), mode="resident",
                          layers_per_graph=1, keep_grads=True, backend=b) as stack:
        xs = [torch.randn(4, H, device=b.device) for _ in range(2)]
        ys = [stack(xs[0])]
        ye = [eager(xs[0])]
        for m in (layers[0], eager[0]):
            m.requires_grad_(False)
        ys.append(stack(xs[1]))
        ye.append(eager(xs[1]))
        for y in (*reversed(ys), *reversed(ye)):
            y.square().sum().backward()
        assert all(p.grad is None for p in layers[0].parameters())
        assert_bitwise([p.grad for m in layers[1:] for p in m.parameters()],
                       [p.grad for m in list(eager)[1:] for p in m.parameters()])


def test_main_grad_refuses_a_layer_frozen_after_the_build_that_a_backward_reaches(clean):
    """Its graph would add into main_grad regardless; below every layer that trains, with
    an input that wants no gradient, it runs without a backward and is fine."""
    b = clean
    torch.manual_seed(10)
    layers = [_mlp().to(b.device) for _ in range(3)]
    params = [p for m in layers for p in m.parameters()]
    for p in params:
        p.main_grad = torch.zeros_like(p)
    with gt.GraphedLayers(layers, torch.zeros(4, H, device=b.device), mode="off",
                          layers_per_graph=1, main_grad=True, backend=b) as stack:
        layers[1].requires_grad_(False)
        with pytest.raises(gt.CaptureMismatchError, match=r"layers\[1\]\.0\.weight was frozen after the build"):
            stack(torch.randn(4, H, device=b.device))
        layers[1].requires_grad_(True)
        layers[0].requires_grad_(False)
        stack(torch.randn(4, H, device=b.device)).sum().backward()
        assert all(p.main_grad.abs().sum() == 0 for p in layers[0].parameters())
        assert all(p.main_grad.abs().sum() > 0 for m in layers[1:] for p in m.parameters())
