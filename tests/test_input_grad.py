"""The stack's input gradient: a leaf input keeps its own ``.grad`` through later replays,
with microbatches in flight in any backward order and across steps, as eagerly."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from graphslot.adapters.torch import GraphedLayers


class Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_leaf_inputs_keep_their_gradients_through_later_replays(clean, order):
    b = clean
    layers = [Scale(64).to(b.device) for _ in range(2)]
    x0 = torch.rand(4, 64, device=b.device)
    with GraphedLayers(layers, x0.clone().requires_grad_(), mode="off", backend=b) as stack:
        w = (layers[0].w * layers[1].w).detach()
        xs = [(x0 + k).requires_grad_() for k in range(3)]
        for step in range(2):  # the second step adds into every .grad kept from the first
            ys = [stack(x) for x in xs]
            for k in order:
                ys[k].backward(torch.full_like(ys[k], k + 1.0))
            for k in range(3):
                torch.testing.assert_close(xs[k].grad, (step + 1) * (k + 1.0) * w.expand_as(x0))


def test_a_non_leaf_input_gradient_flows_on(clean):
    b = clean
    layers = [Scale(64).to(b.device) for _ in range(2)]
    x0 = torch.rand(4, 64, device=b.device)
    emb = nn.Parameter(torch.ones(64, device=b.device))
    with GraphedLayers(layers, x0.clone().requires_grad_(), mode="off", backend=b) as stack:
        w = (layers[0].w * layers[1].w).detach()
        ys = [stack(x0 * emb * (k + 1)) for k in range(2)]
        for y in ys:
            y.sum().backward()
        want = sum((k + 1) * (x0 * w).sum(0) for k in range(2))
        torch.testing.assert_close(emb.grad, want)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hook_on_the_input_keeps_what_it_was_handed(clean, when):
    """A hook may keep the gradient it is handed where the stack cannot find it again:
    it gets a copy, whether registered before or after the forward."""
    b = clean
    layers = [Scale(64).to(b.device) for _ in range(2)]
    x0 = torch.rand(4, 64, device=b.device)
    with GraphedLayers(layers, x0.clone().requires_grad_(), mode="off", backend=b) as stack:
        w = (layers[0].w * layers[1].w).detach()
        kept: list[torch.Tensor] = []
        xs = [(x0 + k).requires_grad_() for k in range(2)]
        if when == "before":
            xs[0].register_hook(kept.append)
        ys = [stack(x) for x in xs]
        if when == "after":
            xs[0].register_hook(kept.append)
        for k in range(2):
            ys[k].backward(torch.full_like(ys[k], k + 1.0))
        torch.testing.assert_close(kept[0], w.expand_as(x0))
