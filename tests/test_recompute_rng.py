"""Random ops in recomputed layers: the backward graph's recompute draws the numbers the
forward graph drew for that microbatch, and every forward draws fresh ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import UsageError


class DropScale(nn.Module):
    """``dropout(x) * w``: the output shows the mask the forward drew (zeros where it
    dropped), and the input's gradient shows the mask the backward used."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x) * self.w


def _layers(b, n_layers: int = 2, n: int = 256) -> list[nn.Module]:
    torch.manual_seed(0)
    return [DropScale(n).to(b.device) for _ in range(n_layers)]


@pytest.mark.parametrize("mode,recompute", [("off", [0, 1]), ("off", [1]), ("resident", [0])])
def test_a_recomputed_dropout_uses_its_forwards_mask_with_microbatches_in_flight(clean, mode, recompute):
    b = clean
    layers = _layers(b)
    x0 = torch.rand(8, 256, device=b.device) + 0.5  # no zeros: a zero in the output is a drop
    sample = x0.clone().requires_grad_()
    offload = [0] if mode != "off" else []
    with GraphedLayers(layers, sample, mode=mode, recompute_layers=recompute,
                       offload_layers=offload, layers_per_graph=1, backend=b) as stack:
        masks = []
        for step in range(3):
            xs = [(x0 + k).requires_grad_() for k in range(3)]
            ys = [stack(x).clone() for x in xs]  # three microbatches in flight
            gys = [torch.rand_like(y) + 0.5 for y in ys]
            for k in (1, 2, 0):  # backward out of forward order
                ys_k = ys[k]
                # the stack's output is a buffer later forwards overwrite: run the backward
                # of the clone, whose graph still leads to microbatch k's nodes
                ys_k.backward(gys[k])
            for k in range(3):
                dropped = ys[k] == 0
                # d out / d x = mask * 2 * w0 * mask' * 2 * w1: zero exactly where either
                # layer dropped, so the gradient is zero where the output is
                assert torch.equal(xs[k].grad == 0, dropped), (step, k)
                w = layers[0].w * layers[1].w
                want = torch.where(dropped, torch.zeros_like(ys[k]), 4 * w * gys[k])
                torch.testing.assert_close(xs[k].grad, want)
                masks.append(dropped)
        # every forward drew fresh numbers
        assert all(not torch.equal(masks[0], m) for m in masks[1:])
    for p in (layers[0].w, layers[1].w):
        assert p.grad is not None


def test_two_recomputed_layers_draw_different_numbers(clean):
    b = clean
    layers = _layers(b)
    ones = torch.ones(8, 256, device=b.device)
    sample = ones.clone().requires_grad_()
    with GraphedLayers(layers, sample, mode="off", recompute_layers=[0, 1], layers_per_graph=1,
                       backend=b) as stack:
        stack(ones.clone().requires_grad_()).sum().backward()
        # each layer's output is its own buffer: the first layer's mask shows there
        out0 = stack._runners[0].static_out
        out1 = stack._runners[1].static_out
        m0, m1 = out0 == 0, (out1 == 0) & (out0 != 0)
        assert m0.any() and m1.any()
        assert not torch.equal(out0 == 0, out1 == 0)


def test_forwards_without_a_backward_leave_no_stream_positions_behind(clean):
    """A forward whose output is dropped (validation with grad enabled) is abandoned: its
    recorded stream position goes with it, and close() forgets the rest."""
    b = clean
    layers = _layers(b)
    x = torch.rand(8, 256, device=b.device) + 0.5
    stack = GraphedLayers(layers, x.clone().requires_grad_(), mode="off", recompute_layers=[0, 1],
                          layers_per_graph=1, backend=b)
    for _ in range(5):
        stack(x.clone().requires_grad_())  # dropped: no backward
    y = stack(x.clone().requires_grad_())
    y.sum().backward()
    assert all(len(r._rng_at) == 0 for r in stack._runners)
    stack(x.clone().requires_grad_())
    runners = list(stack._runners)
    assert any(len(r._rng_at) == 1 for r in runners)
    stack.close()
    assert all(len(r._rng_at) == 0 for r in runners)


class _OwnDraws(nn.Module):
    """Draws its mask from a generator of its own (``draws``) or only holds one."""

    def __init__(self, draws: bool, gen: torch.Generator) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.draws = draws
        self.gen = gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.draws:
            h = h * (torch.rand(h.shape, generator=self.gen, device=h.device) > 0.5)
        return h


@pytest.mark.parametrize("recompute", [[], [1]])
def test_a_layer_drawing_from_a_generator_of_its_own_is_refused_by_name(clean, recompute):
    """Its graph cannot draw from it as eager does: refused at the build, which leaves
    that generator where it was."""
    b = clean
    layers = [_OwnDraws(False, torch.Generator(b.device)).to(b.device),
              _OwnDraws(True, torch.Generator(b.device).manual_seed(1234)).to(b.device)]
    before = layers[1].gen.get_state().clone()
    with pytest.raises(UsageError, match=r"layer 1 draws random numbers from a torch.Generator of its own \(gen\)"):
        GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True),
                      mode="off", recompute_layers=recompute, backend=b)
    assert torch.equal(layers[1].gen.get_state(), before)


def test_a_layer_holding_a_generator_it_does_not_draw_from_or_the_default_one_builds(clean):
    b = clean
    default = (torch.default_generator if b.device.type == "cpu" else
               getattr(torch, b.device.type).default_generators[b.device.index or 0])
    layers = [_OwnDraws(False, torch.Generator(b.device)).to(b.device),
              _OwnDraws(True, default).to(b.device)]
    torch.manual_seed(5)
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True),
                       mode="off", backend=b) as stack:
        stack(torch.ones(4, 8, device=b.device)).sum().backward()
