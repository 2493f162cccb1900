"""Gradient buffers in the graphs' pool: a gradient that shares bytes with a buffer between
two layers (a parameter's gradient that is its layer's output or input gradient, a layer
handing its output gradient on) keeps bytes of its own, nothing the graphs still read goes
back to the pool, and training stays bit for bit eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphslot.adapters import torch as gt
from stacks import seeded_grads
from test_graphed_grads import assert_bitwise


class _Widen(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(n_in, 24), nn.Linear(24, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _AddFull(nn.Module):
    """``x + p``, ``p`` of x's whole shape: autograd hands ``p`` its output gradient itself."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p


def test_a_parameter_whose_gradient_is_its_layers_output_gradient_keeps_its_own(clean):
    """Lent as the layer's output-gradient buffer, such a gradient would live on bytes
    given back to the pool."""
    b = clean
    torch.manual_seed(5)
    layers = [_Widen(8, 8).to(b.device), _AddFull((4, 8)).to(b.device), _Widen(8, 8).to(b.device)]
    xs = [torch.randn(4, 8, device=b.device) for _ in range(2)]
    got, want = seeded_grads(layers, xs, backend=b, mode="off")
    assert_bitwise(got, want)


def _returning_like_cuda(b, monkeypatch) -> list[torch.Tensor]:
    """The cpu backend keeps what its graphs captured; give it cuda's ``return_to_pool``,
    recording what went back: the caller gets a stand-in for a view of the same address,
    and the storage given back counts as holding no bytes (its bytes stay: cpu kernels
    would read freed memory), which the build's own check looks for. For builds alone: the
    graphs captured before a return read bytes the stand-in does not hold."""
    from graphslot.adapters.torch import stack as stack_module

    returned: list[torch.Tensor] = []
    gone: set[int] = set()

    def back(t: torch.Tensor) -> torch.Tensor | None:
        if t.untyped_storage()._cdata in gone:
            return None  # (cuda: a storage given back already has no bytes left to give)
        returned.append(t)
        gone.add(t.untyped_storage()._cdata)
        return torch.empty_like(t)

    monkeypatch.setattr(b, "return_to_pool", back)
    monkeypatch.setattr(stack_module, "_given_back", lambda t: t.untyped_storage()._cdata in gone)
    return returned


def _still_used(stack: gt.GraphedLayers, returned: list[torch.Tensor]) -> list[tuple]:
    """The buffers the stack still uses that went back to the pool."""
    gone = {t.untyped_storage()._cdata for t in returned}
    used = [(i, what) for i, r in enumerate(stack._runners)
            for what, t in (("static_grad_out", r.static_grad_out), ("grad_in", r.grad_in),
                            *((f"grad {k}", pg.buf) for k, pg in enumerate(r.grads) if pg))
            if t is not None and t.untyped_storage()._cdata in gone]
    if stack._input_grad is not None and stack._input_grad.buf.untyped_storage()._cdata in gone:
        used.append(("the stack's input gradient",))
    return used


@pytest.mark.parametrize("widths", [[8, 16, 8, 8], [8, 16, 16, 8, 8]])
def test_no_gradient_the_graphs_still_use_goes_back_to_the_pool(clean, monkeypatch, widths):
    b = clean
    returned = _returning_like_cuda(b, monkeypatch)
    torch.manual_seed(0)
    layers = [nn.Linear(i, o).to(b.device) for i, o in zip(widths, widths[1:])]
    layers.insert(1, _AddFull((4, widths[1])).to(b.device))
    with gt.GraphedLayers(layers, torch.randn(4, widths[0], device=b.device, requires_grad=True),
                          mode="off", layers_per_graph=1, backend=b) as stack:
        assert _still_used(stack, returned) == []


class _PosAdd(nn.Module):
    """``x + pos``, a table broadcast over the batch: x's gradient is the output's itself."""

    def __init__(self, t: int, d: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos


class _Reshaped(nn.Module):
    """Hands on a reshaped view of its input plus a bias: its input gradient views the
    output's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).view(x.shape) + self.bias


class _InnerAddFull(nn.Module):
    """``tanh(x + p)``, ``p`` of x's shape: x's gradient and p's are one tensor."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.p)


class _TanhAddFull(_InnerAddFull):
    """``tanh(x) + p``: p's gradient is the output's, x's another."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + self.p


@pytest.mark.parametrize("where", [0, 1, 3])
@pytest.mark.parametrize("kind", ["pos", "reshape", "inner", "tanh"])
def test_layers_whose_gradients_share_bytes_keep_them_out_of_the_pool_and_train_as_eager(
        clean, monkeypatch, where, kind):
    """A layer handing its output gradient on as its input gradient (first, inside, last),
    one whose parameter's gradient is its input gradient, and one whose parameter's
    gradient is its output gradient while its input gradient differs: nothing the graphs
    still read goes back to the pool, and the gradients are eager's."""
    b = clean
    torch.manual_seed(7)
    make = {"pos": lambda: _PosAdd(4, 8), "reshape": lambda: _Reshaped(8),
            "inner": lambda: _InnerAddFull((2, 4, 8)), "tanh": lambda: _TanhAddFull((2, 4, 8))}[kind]
    layers = [nn.Linear(8, 8) for _ in range(3)]
    layers.insert(where, make())
    layers = [m.to(b.device) for m in layers]
    xs = [torch.randn(2, 4, 8, device=b.device) for _ in range(2)]
    got, want = seeded_grads(layers, xs, backend=b, mode="off")
    assert_bitwise(got, want)
    returned = _returning_like_cuda(b, monkeypatch)
    with gt.GraphedLayers(copy.deepcopy(layers), xs[0].clone().requires_grad_(), mode="off",
                          layers_per_graph=1, backend=b) as stack:
        assert _still_used(stack, returned) == []
