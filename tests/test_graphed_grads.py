"""GraphedLayers' gradients: eager's ``.grad`` semantics bit for bit, with no second copy.

The backward graphs write parameter gradients into static buffers; ``.grad`` becomes that
buffer instead of a clone of it. These tests pin what that must not change: gradient
accumulation, both ``zero_grad`` flavours, a parameter shared by two layers, tensor hooks,
and an optimizer that keeps references to ``.grad`` between steps.
"""

from __future__ import annotations

import copy
import gc
from typing import Callable

import pytest
import torch
from torch import nn

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.cli.toy import TinyGPT
from stacks import graphed, small_gpt

MODES = ["off", "resident", "remap"]


def small(b: graphslot.Backend, layers: int = 3) -> TinyGPT:
    return small_gpt(b, layers, seed=7)


def assert_bitwise(a: list[torch.Tensor], c: list[torch.Tensor]) -> None:
    assert len(a) == len(c)
    for i, (x, y) in enumerate(zip(a, c)):
        assert torch.equal(x, y), f"tensor {i} differs by {float((x.float() - y.float()).abs().max())}"


def run(model: nn.Module, b: graphslot.Backend, steps: int, accumulate: int, set_to_none: bool,
        opt_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None) -> list[torch.Tensor]:
    params = list(model.parameters())
    opt = (opt_factory or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)))(params)
    out = []
    for step in range(steps):
        for micro in range(accumulate):
            loss = model(*model.batch(step * accumulate + micro, b.device))
            loss.backward()
            out.append(loss.detach())
        out += [p.grad.detach().clone() for p in params if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return out + [p.detach().clone() for p in params]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accumulate,set_to_none", [(1, True), (3, True), (1, False), (3, False)])
@pytest.mark.parametrize("per_graph", [1, None], ids=["graph-per-layer", "joined"])
def test_gradients_match_eager_bitwise(clean, mode, accumulate, set_to_none, per_graph):
    b = clean
    base = small(b)
    want = run(copy.deepcopy(base), b, 3, accumulate, set_to_none)
    model = copy.deepcopy(base)
    with graphed(model, b, mode, layers_per_graph=per_graph) as stack:
        assert len(stack.graph_layers) == (3 if per_graph == 1 else 1)
        assert_bitwise(run(model, b, 3, accumulate, set_to_none), want)


def test_grad_is_the_graph_buffer_not_a_copy(clean):
    b = clean
    model = small(b)
    with graphed(model, b, "off") as stack:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(*model.batch(0, b.device)).backward()
        bufs = {pg.ptr for r in stack._runners for pg in r.grads if pg is not None}
        block_params = [p for blk in model.blocks for p in blk.parameters()]
        assert bufs and {p.grad.data_ptr() for p in block_params} == bufs


class _KeepsGrads(torch.optim.Optimizer):
    """SGD whose update uses the gradient of the step before, through the very ``.grad``
    tensors it kept (valid in eager: zero_grad(set_to_none=True) leaves them alone)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.05})
        self.kept: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                prev = self.kept.get(id(p))
                update = p.grad if prev is None else p.grad + 0.5 * prev
                p.add_(update, alpha=-group["lr"])
                self.kept[id(p)] = p.grad  # a reference, not a copy


class _KeepsGradsAndFreezes(_KeepsGrads):
    """Keeps references to ``.grad`` and then freezes the garbage collector, as training
    loops do after their first steps to cut collection pauses: what it kept is frozen."""

    def step(self, closure=None):  # type: ignore[override]
        super().step()
        gc.freeze()


@pytest.mark.parametrize("mode", ["off", "resident"])
@pytest.mark.parametrize("optimizer", [_KeepsGrads, _KeepsGradsAndFreezes], ids=["keeps", "keeps-and-freezes-gc"])
def test_an_optimizer_that_keeps_references_to_grad(clean, mode, optimizer):
    b = clean
    base = small(b)
    want = run(copy.deepcopy(base), b, 4, 1, True, optimizer)
    model = copy.deepcopy(base)
    frozen = gc.get_freeze_count()
    try:
        with graphed(model, b, mode):
            assert_bitwise(run(model, b, 4, 1, True, optimizer), want)
    finally:
        if not frozen:
            gc.unfreeze()  # as it was before the test


class _Scaled(nn.Module):
    def __init__(self, lin: nn.Linear, scale: float) -> None:
        super().__init__()
        self.lin, self.scale = lin, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.scale)


class _SharedStack(nn.Module):
    """Three layers, the first and the last sharing one Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        tied = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([_Scaled(tied, 1.0), _Scaled(nn.Linear(16, 16), 0.7), _Scaled(tied, 1.3)])
        self.stack: nn.Module = nn.Sequential(*self.blocks)

    def batch(self, i: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return (torch.randn(4, 16, generator=g).to(device),)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.stack(x) ** 2).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accumulate,set_to_none", [(1, True), (2, False)])
@pytest.mark.parametrize("per_graph", [1, 2, None], ids=["apart", "across-graphs", "one-graph"])
def test_a_parameter_shared_by_two_layers(clean, mode, accumulate, set_to_none, per_graph):
    b = clean
    base = _SharedStack().to(b.device)
    want = run(copy.deepcopy(base), b, 3, accumulate, set_to_none)
    model = copy.deepcopy(base)
    sample = torch.zeros(4, 16, device=b.device)
    with GraphedLayers(list(model.blocks), sample, mode=mode, backend=b,
                       layers_per_graph=per_graph) as stack:
        model.stack = stack
        assert_bitwise(run(model, b, 3, accumulate, set_to_none), want)


def test_tensor_hooks_on_parameters_see_each_gradient(clean):
    b = clean
    base = small(b, 2)
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "graphed": []}

    def hook_on(model: TinyGPT, key: str) -> None:
        w = model.blocks[1].fc1.weight
        w.register_hook(lambda g: seen[key].append(g.clone()) or g * 0.5)

    eager = copy.deepcopy(base)
    hook_on(eager, "eager")
    want = run(eager, b, 2, 2, False)
    model = copy.deepcopy(base)
    hook_on(model, "graphed")
    with graphed(model, b, "resident"):
        assert_bitwise(run(model, b, 2, 2, False), want)
    assert_bitwise(seen["graphed"], seen["eager"])


def _input_gradients(model: TinyGPT, stack: nn.Module, b: graphslot.Backend,
                     lent: Callable[[torch.Tensor], None] = lambda g: None) -> list[torch.Tensor]:
    """The stack's input gradients through a leaf input: accumulated over three backwards,
    then a reference kept while the next backward makes a new one."""
    x = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    out = []
    for k in range(3):
        stack(x).square().mean().backward()
        if k == 0:
            lent(x.grad)
        out.append(x.grad.detach().clone())
    kept, x.grad = x.grad, None
    stack(x).square().mean().backward()
    return out + [kept.detach().clone(), x.grad.detach().clone()]


@pytest.mark.parametrize("mode", MODES)
def test_the_input_gradient_is_the_first_layers_buffer_with_eager_semantics(clean, mode):
    """No copy of the stack's input gradient: it is the first layer's gradient buffer, lent
    as parameter gradients are, and accumulation and a kept reference behave as eagerly."""
    b = clean
    base = small(b)
    eager = copy.deepcopy(base)
    want = _input_gradients(eager, nn.Sequential(*eager.blocks), b)
    model = copy.deepcopy(base)
    with graphed(model, b, mode) as stack:
        lent: list[bool] = []
        got = _input_gradients(model, stack, b,
                               lambda g: lent.append(g.data_ptr() == stack._input_grad.ptr))
        assert lent == [True]
    assert_bitwise(got, want)
