"""Input gradients handed down through standing buffers (``_standing_grad_buffers``): each
backward graph copies its input gradient into one buffer per kind of layer input, which
the layer below reads; training stays bit for bit eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphslot.adapters import torch as gt
from stacks import graphed, seeded_grads, small_gpt
from test_graphed_grads import assert_bitwise, run


@pytest.fixture
def standing(clean, monkeypatch):
    monkeypatch.setattr(gt.GraphedLayers, "_standing_grad_buffers", True)
    return clean


def _handed_down_through_standing(stack: gt.GraphedLayers) -> None:
    """Every input gradient is its kind's one buffer, and the layer below reads that very
    buffer: no copy between the graphs, one buffer per kind."""
    rs = stack._runners
    kinds: dict[tuple, torch.Tensor] = {}
    for below, r in zip(rs, rs[1:]):
        assert r.grad_in is below.static_grad_out
        key = (tuple(r.static_in.shape), r.static_in.dtype)
        assert kinds.setdefault(key, r.grad_in) is r.grad_in
    if rs[0].grad_in is not None:
        assert kinds.setdefault((tuple(rs[0].static_in.shape), rs[0].static_in.dtype),
                                rs[0].grad_in) is rs[0].grad_in


@pytest.mark.parametrize("mode", ["off", "resident", "remap"])
def test_a_mixed_plan_trains_as_eager_bitwise(standing, mode):
    b = standing
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 3, 2, False)
    model = copy.deepcopy(base)
    offload = [0, 3] if mode != "off" else []
    with graphed(model, b, mode, offload_layers=offload, recompute_layers=[1, 3]) as stack:
        _handed_down_through_standing(stack)
        assert_bitwise(run(model, b, 3, 2, False), want)


@pytest.mark.parametrize("per_graph", [1, None], ids=["graph-per-layer", "joined"])
def test_microbatches_in_flight_train_as_eager(standing, per_graph):
    b = standing
    base = small_gpt(b, 4)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    with graphed(model, b, "remap", offload_layers=[0, 2], recompute_layers=[1],
                 layers_per_graph=per_graph) as stack:
        _handed_down_through_standing(stack)
        for m in (eager, model):
            losses = [m(*m.batch(k, b.device)) for k in range(3)]
            for loss in reversed(losses):
                loss.backward()
        assert_bitwise([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()])


class _Widen(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(n_in, 24), nn.Linear(24, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("mode", ["off", "remap"])
def test_layer_inputs_of_several_shapes_get_a_buffer_each(standing, mode):
    b = standing
    torch.manual_seed(3)
    widths = [8, 16, 16, 8, 8]
    layers = [_Widen(i, o).to(b.device) for i, o in zip(widths, widths[1:])]
    xs = [torch.randn(4, 8, device=b.device) for _ in range(3)]
    kw = {"backend": b, "mode": mode, "recompute_layers": [1, 2]}
    if mode == "remap":
        kw["offload_layers"] = [0, 3]
    got, want = seeded_grads(layers, xs, **kw)
    assert_bitwise(got, want)
    with gt.GraphedLayers(copy.deepcopy(layers), xs[0].clone().requires_grad_(), layers_per_graph=1,
                          **kw) as stack:
        _handed_down_through_standing(stack)
        assert len({id(r.grad_in) for r in stack._runners}) == 2  # inputs of 8 and 16 features


def test_an_input_without_gradient_and_a_kept_input_gradient(standing):
    """The first layer hands no gradient down where its input wants none; where it does, an
    input gradient the caller keeps through the next step is not overwritten by it."""
    b = standing
    base = small_gpt(b, 3)
    for wants in (False, True):
        model = copy.deepcopy(base)
        sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_(wants)
        with gt.GraphedLayers(list(model.blocks), sample, mode="remap", recompute_layers=[0, 2],
                              offload_layers=[1], layers_per_graph=1, backend=b) as stack:
            assert (stack._runners[0].grad_in is not None) == wants
            _handed_down_through_standing(stack)
            eager = nn.Sequential(*copy.deepcopy(list(model.blocks)))
            kept = []
            for step in range(2):
                x = torch.randn_like(sample).requires_grad_(wants)
                ex = x.detach().clone().requires_grad_(wants)
                stack(x).square().sum().backward()
                eager(ex).square().sum().backward()
                if wants:
                    assert_bitwise([x.grad], [ex.grad])
                    kept.append((x.grad, ex.grad))
            for g, e in kept:  # (the first step's, after the second step's backward)
                assert_bitwise([g], [e])
            assert_bitwise([p.grad for p in model.blocks.parameters()],
                           [p.grad for p in eager.parameters()])


class _AddFull(nn.Module):
    """``x + p``, ``p`` of x's whole shape: autograd hands ``p`` its output gradient itself."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p


@pytest.mark.parametrize("on", [False, True], ids=["as-built", "standing"])
def test_a_parameter_whose_gradient_is_its_layers_output_gradient_keeps_its_own(clean, monkeypatch, on):
    """Lent as the layer's output-gradient buffer, such a gradient would be overwritten by
    the layer below's graph (standing buffers) or live on bytes given back to the pool."""
    monkeypatch.setattr(gt.GraphedLayers, "_standing_grad_buffers", on)
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
def test_no_standing_buffer_and_no_gradient_the_graphs_still_use_goes_back_to_the_pool(
        standing, monkeypatch, widths):
    b = standing
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


@pytest.mark.parametrize("on", [False, True], ids=["as-built", "standing"])
@pytest.mark.parametrize("where", [0, 1, 3])
@pytest.mark.parametrize("kind", ["pos", "reshape", "inner", "tanh"])
def test_layers_whose_gradients_share_bytes_keep_them_out_of_the_pool_and_train_as_eager(
        clean, monkeypatch, on, where, kind):
    """A layer handing its output gradient on as its input gradient (first, inside, last),
    one whose parameter's gradient is its input gradient, and one whose parameter's
    gradient is its output gradient while its input gradient differs: nothing the graphs
    still read goes back to the pool, and the gradients are eager's."""
    monkeypatch.setattr(gt.GraphedLayers, "_standing_grad_buffers", on)
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
