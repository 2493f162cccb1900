"""Shared helpers of the GraphedLayers tests: a small GPT and its stack graphed in place."""

from __future__ import annotations

import copy

import torch

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.toy import GPTConfig, TinyGPT


def small_gpt(b: graphslot.Backend, layers: int = 3, seed: int = 7) -> TinyGPT:
    c = GPTConfig(hidden=32, heads=2, ffn=64, seq=16, batch=2, layers=layers, vocab=64)
    torch.manual_seed(seed)
    return TinyGPT(c).to(b.device)


def graphed(model: TinyGPT, b: graphslot.Backend, mode: str, **kw) -> GraphedLayers:
    """``model``'s blocks as a GraphedLayers stack, installed as ``model.stack``: one graph
    per layer unless ``layers_per_graph`` says otherwise (these layers are small enough for
    the default to join them all, and the tests mean the engine's work between layers)."""
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    kw.setdefault("layers_per_graph", 1)
    stack = GraphedLayers(list(model.blocks), sample, mode=mode, backend=b, **kw)
    model.stack = stack
    return stack


def seeded_grads(layers: list[torch.nn.Module], xs: list[torch.Tensor], **kw) -> tuple[list, list]:
    """The parameters' gradients after a forward and backward per input in ``xs``, seeded
    once beforehand: through copies of ``layers`` as a GraphedLayers stack (built after
    the seed, with ``kw``; one graph per layer unless said) and as eager's Sequential."""
    def train(ls: list[torch.nn.Module], graphed: bool) -> list:
        torch.manual_seed(1)
        kw.setdefault("layers_per_graph", 1)
        f = (GraphedLayers(ls, xs[0].clone().requires_grad_(), **kw) if graphed
             else torch.nn.Sequential(*ls))
        for x in xs:
            f(x.clone().requires_grad_()).square().sum().backward()
        if graphed:
            f.close()
        return [p.grad for m in ls for p in m.parameters()]

    return train(copy.deepcopy(layers), True), train(copy.deepcopy(layers), False)

