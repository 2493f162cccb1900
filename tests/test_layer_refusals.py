"""What a layer may not do under graphs is refused at the build by name, with the way out,
in every mode and under a budget; the layers then train eagerly as before. The ways out
named work."""

from __future__ import annotations

import copy
import types
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphslot import layer_calls
from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import BudgetError, UsageError

H = 8
KWS = [dict(mode="off"), dict(mode="resident", layers_per_graph=1), dict(mode="remap"),
       dict(memory_budget="auto")]


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.mlp, x, use_reentrant=self.reentrant)


class _Argmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


def _refused(b, layers, kw, match: str) -> None:
    eager = copy.deepcopy(nn.Sequential(*layers))
    before = [p.detach().clone() for m in layers for p in m.parameters()]
    with pytest.raises(UsageError, match=match):
        GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b, **kw)
    # nothing changed: the layers train eagerly as a copy made before
    assert all(torch.equal(p, q) for p, q in zip((p for m in layers for p in m.parameters()), before))
    x = torch.randn(4, H, device=b.device)
    nn.Sequential(*layers)(x).float().sum().backward()
    eager(x).float().sum().backward()
    for p, q in zip((p for m in layers for p in m.parameters()), eager.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("kw", KWS, ids=str)
def test_a_layer_changing_its_input_in_place_is_refused_by_name(clean, kw):
    b = clean
    torch.manual_seed(0)
    layers = [nn.Linear(H, H).to(b.device), nn.ReLU(inplace=True), nn.Linear(H, H).to(b.device)]
    _refused(b, layers, kw, r"layer 1 changes in place .*ReLU\(inplace=True\).*out-of-place")


@pytest.mark.parametrize("kw", KWS, ids=str)
def test_a_reentrant_checkpoint_inside_a_layer_is_refused_by_name(clean, kw):
    b = clean
    torch.manual_seed(0)
    layers = [nn.Linear(H, H).to(b.device), _Checkpointed(reentrant=True).to(b.device)]
    _refused(b, layers, kw, r"layers? (1|0-1) calls torch.utils.checkpoint with use_reentrant=True"
                            r".*use_reentrant=False")


@pytest.mark.parametrize("kw", KWS, ids=str)
def test_an_integer_tensor_between_layers_that_want_gradients_is_refused_by_name(clean, kw):
    b = clean
    torch.manual_seed(0)
    layers = [nn.Linear(H, H).to(b.device), _Argmax(), nn.Embedding(H, H).to(b.device)]
    _refused(b, layers, kw, r"layers? (1|0-1) returns a torch.int64 tensor.*stack of its own")


@pytest.mark.parametrize("kw", KWS, ids=str)
def test_the_ways_out_train_as_eager(clean, kw):
    """The in-place op inside the layer that makes its operand; a non-reentrant checkpoint;
    integer ids into the stack's first layer."""
    b = clean
    torch.manual_seed(0)
    for layers, x in (
            ([nn.Sequential(nn.Linear(H, H), nn.ReLU(inplace=True)), nn.Linear(H, H)],
             torch.randn(4, H, requires_grad=True)),
            ([nn.Linear(H, H), _Checkpointed(reentrant=False)], torch.randn(4, H, requires_grad=True)),
            ([nn.Embedding(H, H), nn.Linear(H, H)], torch.randint(0, H, (4,)))):
        layers = [m.to(b.device) for m in layers]
        x = x.to(b.device).detach().requires_grad_(x.requires_grad)
        eager = copy.deepcopy(nn.Sequential(*layers))
        with GraphedLayers(layers, x, backend=b, **kw) as stack:
            for _ in range(2):
                xg, xe = (x.detach().clone().requires_grad_(x.requires_grad) for _ in range(2))
                stack(xg).square().sum().backward()
                eager(xe).square().sum().backward()
                for p, q in zip(stack.parameters(), eager.parameters()):
                    assert torch.equal(p.grad, q.grad)
                if x.requires_grad:
                    assert torch.equal(xg.grad, xe.grad)


class _Square(torch.autograd.Function):
    """Keeps an intermediate on ctx (``ctx.h``), and the weight's transpose (a view of a
    parameter, the same memory every call)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.h = x * 2
        ctx.wt = [w.t()]
        return ctx.h.square() @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        gh = g @ ctx.wt[0].t()
        return gh * 4 * ctx.h, g.t() @ ctx.h.square()


class _KeepsInput(torch.autograd.Function):
    """Keeps its input on ctx: the buffer the layer below writes at every forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.x, ctx.w = x, w
        return x @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g @ ctx.w, g.t() @ ctx.x


class _KeepsWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.w = w
        ctx.save_for_backward(x)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return g @ ctx.w, g.t() @ x


class _FnLayer(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(torch.tanh(x), self.lin.weight)


def _two_in_flight(f, xs):
    losses = [f(x.clone().requires_grad_()).square().sum() for x in xs]
    for loss in losses:
        loss.backward()


@pytest.mark.parametrize("fn", [_Square, _KeepsInput])
@pytest.mark.parametrize("kw", KWS[:3], ids=str)
def test_a_ctx_attribute_the_forward_makes_refuses_the_backward_of_a_microbatch_it_lost(clean, kw, fn):
    """Another microbatch's forward overwrites the one copy: the older microbatch's
    backward is refused by name before the stack replays anything for it, the newer one's
    trains as eager; one that never has a backward (a skipped step's loss, still held)
    stops nothing."""
    b = clean
    torch.manual_seed(0)
    layers = [nn.Linear(H, H).to(b.device), _FnLayer(fn).to(b.device), nn.Linear(H, H).to(b.device)]
    eager = copy.deepcopy(nn.Sequential(*layers))
    xs = [torch.randn(4, H, device=b.device) for _ in range(3)]
    name = "_Square.h" if fn is _Square else "_KeepsInput.x"

    def grads_equal() -> None:
        for p, q in zip(stack.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad)

    with GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b,
                       **kw) as stack:
        for x in xs[:2]:  # one at a time: eager's gradients
            stack(x.clone().requires_grad_()).square().sum().backward()
            eager(x.clone().requires_grad_()).square().sum().backward()
        grads_equal()
        skipped = stack(xs[2].clone().requires_grad_()).square().sum()  # (no backward ever)
        for lost_by_eval in (False, True):
            first = stack(xs[0].clone().requires_grad_()).square().sum()
            if lost_by_eval:
                with torch.no_grad():
                    stack(xs[2])  # (an evaluation forward overwrites it too)
                second = None
            else:
                second = stack(xs[1].clone().requires_grad_()).square().sum()
            before = [p.grad.clone() for p in stack.parameters()]
            with pytest.raises(UsageError, match=rf"{name} on its ctx.*overwrote.*Nothing of this "
                                                 "backward ran in the stack"):
                first.backward()
            assert all(torch.equal(p.grad, q) for p, q in zip(stack.parameters(), before))
            if second is not None:
                second.backward()
                eager(xs[1].clone().requires_grad_()).square().sum().backward()
                grads_equal()
        del skipped, first


@pytest.mark.parametrize("kw", KWS[:3], ids=str)
def test_a_ctx_attribute_holding_a_parameter_trains_as_eager_with_microbatches_in_flight(clean, kw):
    b = clean
    torch.manual_seed(0)
    layers = [_FnLayer(_KeepsWeight).to(b.device), _FnLayer(_KeepsWeight).to(b.device)]
    eager = copy.deepcopy(nn.Sequential(*layers))
    xs = [torch.randn(4, H, device=b.device) for _ in range(3)]
    with GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b,
                       **kw) as stack:
        _two_in_flight(stack, xs)
        _two_in_flight(eager, xs)
        for p, q in zip(stack.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad)


class _ReadsOutside(nn.Module):
    """Reads ``source()`` beside its input: a parameter it does not register, or another
    module's output set aside before each call."""

    def __init__(self, source) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.source()


@pytest.mark.parametrize("kw", KWS, ids=str)
def test_a_tensor_read_from_outside_that_wants_a_gradient_is_refused_by_name(clean, kw):
    b = clean
    torch.manual_seed(0)
    bias = nn.Parameter(torch.randn(H, device=b.device))  # (the model's, registered by no layer)
    layers = [_ReadsOutside(lambda: bias).to(b.device), nn.Linear(H, H).to(b.device)]
    with pytest.raises(UsageError, match=r"reads a leaf tensor of shape \(8,\).*nn.Parameter.*"
                                         r"no gradient.*Register it as a parameter"):
        GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b, **kw)
    context = {"t": nn.Linear(H, H).to(b.device)(torch.randn(4, H, device=b.device))}
    layers = [nn.Linear(H, H).to(b.device), _ReadsOutside(lambda: context["t"]).to(b.device)]
    with pytest.raises(UsageError, match=r"reads a tensor made before the layer's forward"):
        GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b, **kw)


@pytest.mark.parametrize("kw", KWS[:3], ids=str)
def test_tensors_read_from_outside_that_want_no_gradient_train_as_eager(clean, kw):
    """A constant, a frozen parameter and a buffer of another module, read from outside,
    are no gradient's way: the stack trains as eager."""
    b = clean
    torch.manual_seed(0)
    frozen = nn.Parameter(torch.randn(H, device=b.device), requires_grad=False)
    const = torch.randn(H, device=b.device)
    layers = [_ReadsOutside(lambda: frozen).to(b.device), _ReadsOutside(lambda: const).to(b.device)]
    eager = copy.deepcopy(nn.Sequential(*layers))
    with GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), backend=b,
                       **kw) as stack:
        for _ in range(2):
            x = torch.randn(4, H, device=b.device)
            stack(x.clone().requires_grad_()).square().sum().backward()
            eager(x.clone().requires_grad_()).square().sum().backward()
        for p, q in zip(stack.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad)


class _Node:
    """An autograd node's Python object as torch hands it out: made on demand, one per node
    while it lives (a weak cache), gone once nothing holds it."""

    cache: "weakref.WeakValueDictionary[int, _Node]" = weakref.WeakValueDictionary()

    def __init__(self, key: int, children: dict[int, list[int]]) -> None:
        self.key, self._children = key, children

    @classmethod
    def of(cls, key: int, children: dict[int, list[int]]) -> "_Node":
        node = cls.cache.get(key)
        if node is None:
            node = cls.cache[key] = cls(key, children)
        return node

    @property
    def next_functions(self) -> tuple[tuple["_Node", int], ...]:
        return tuple((_Node.of(k, self._children), 0) for k in self._children.get(self.key, []))


def test_the_graph_walk_reaches_every_node_though_their_python_objects_come_and_go():
    """The walk once told nodes apart by id alone: a node object made after another was
    freed could take its id and be passed over (on a GPU, a joined stack's check missed a
    parameter no layer registers)."""
    children = {k: [2 * k + 1, 2 * k + 2] for k in range(63)}  # a binary tree of 127 nodes
    children[1].append(2)  # and one node reached twice
    out = types.SimpleNamespace(grad_fn=_Node.of(0, children))
    keys = [n.key for n in layer_calls._nodes(out, lambda n: True)]  # type: ignore[arg-type]
    assert sorted(keys) == list(range(127))


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_a_layer_filling_a_tensor_after_saving_it_is_not_offloaded_or_recomputed_silently(clean, mode):
    """RReLU's kernel fills the noise it saved, without a new version: a slot copied the
    unfilled tensor, and a recompute's backward read it unfilled; both trained wrong.
    Refused by name; kept, it trains as eager."""
    b = clean
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(H, H), nn.RReLU()).to(b.device) for _ in range(2)]
    with pytest.raises(UsageError, match=r"layer 0: its forward changes a tensor in place after "
                                         r"saving it.*leave it out of offload_layers"):
        GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), mode=mode,
                      layers_per_graph=1, backend=b)
    # (recomputed: torch.utils.checkpoint's backward reads the noise unfilled as well)
    with pytest.raises(UsageError, match=r"layer 1: its forward changes a tensor in place after "
                                         r"saving it.*leave this layer out of recompute_layers"):
        GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), mode=mode,
                      offload_layers=[], recompute_layers=[1], layers_per_graph=1, backend=b)
    eager = copy.deepcopy(nn.Sequential(*layers))
    with GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True), mode=mode,
                       offload_layers=[], layers_per_graph=1, backend=b) as stack:
        x = torch.randn(4, H, device=b.device)
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(1)
        stack(xg).square().sum().backward()
        torch.manual_seed(1)
        eager(xe).square().sum().backward()
        for p, q in zip([xg, *stack.parameters()], [xe, *eager.parameters()]):
            assert torch.equal(p.grad, q.grad)



def test_under_a_budget_a_layer_filling_a_tensor_after_saving_it_is_kept(clean):
    """The profile marks such a layer keep_only: the planner neither offloads nor
    recomputes it (it chose to, and the build then refused its own plan)."""
    from graphslot.profile import profile_units

    b = clean
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(H, 4 * H), act, nn.Linear(4 * H, H)).to(b.device)
              for act in (nn.RReLU(), nn.GELU(), nn.RReLU(), nn.GELU())]
    sample = torch.zeros(64, H, device=b.device, requires_grad=True)
    assert [c.keep_only for c in profile_units(b, layers, sample)] == [True, False, True, False]
    with pytest.raises(BudgetError) as refused:  # (the least plan is built, and named)
        GraphedLayers(layers, sample, memory_budget=1, layers_per_graph=1, backend=b)
    least = refused.value.least_plan.choices
    assert least[0] == least[2] == "keep" and {least[1], least[3]} != {"keep"}, least
