"""GraphedLayers' gradients: eager's ``.grad`` semantics bit for bit.

The backward graphs write parameter gradients into buffers of the graphs' pool; after a
backward with ``.grad`` unset, ``.grad`` is that buffer (no copy). These tests pin eager's
semantics in every case that must not change (issue 30): both ``zero_grad`` flavours,
accumulation over 1 to 8 microbatches and with microbatches in flight, a parameter shared
by two layers, tensor hooks and post-accumulate-grad hooks, an optimizer that keeps
references to ``.grad``, clipping and ``GradScaler``, a ``.grad`` the user assigned (fresh,
or views into one flat buffer), ``torch.autograd.grad``, -0.0 in a fresh gradient; with
``main_grad=True`` the backward graph adds into ``main_grad`` as Megatron does; and what
keeping ``.grad`` costs in memory (one copy of the gradients at most, as eagerly where
activations outweigh gradients; none with ``main_grad``).
"""

from __future__ import annotations

import copy
import gc
import warnings
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(a: list[torch.Tensor], c: list[torch.Tensor]) -> None:
    """Equal bit for bit (so -0.0 and +0.0 differ), dtype and shape included."""
    assert len(a) == len(c)
    for i, (x, y) in enumerate(zip(a, c)):
        assert x.dtype == y.dtype and x.shape == y.shape, (i, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(_bits(x), _bits(y)), \
            f"tensor {i} differs by {float((x.float() - y.float()).abs().max())}"


def run(model: nn.Module, b: graphslot.Backend, steps: int, accumulate: int, set_to_none: bool,
        opt_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        after_backward: Callable[[], None] | None = None) -> list[torch.Tensor]:
    params = list(model.parameters())
    opt = (opt_factory or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)))(params)
    out = []
    for step in range(steps):
        for micro in range(accumulate):
            loss = model(*model.batch(step * accumulate + micro, b.device))
            loss.backward()
            out.append(loss.detach())
            if after_backward is not None:
                after_backward()
        out += [p.grad.detach().clone() for p in params if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return out + [p.detach().clone() for p in params]


def block_params(model: TinyGPT) -> list[nn.Parameter]:
    return [p for blk in model.blocks for p in blk.parameters()]


def buffers(stack: GraphedLayers) -> dict[int, int]:
    """Each parameter's gradient buffer address, by parameter id (one graph per parameter)."""
    return {id(pg.param): pg.ptr for r in stack._runners for pg in r.grads if pg is not None}


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


class SameGradObjects:
    """Called after each backward: records whether every ``.grad`` is the tensor object it
    was after the backward before (eager accumulates in place, so references to ``.grad``
    stay good; the first backward after zero_grad(set_to_none=True) makes new ones)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.last: list[torch.Tensor | None] | None = None
        self.seen: list[bool] = []

    def __call__(self) -> None:
        now = [p.grad for p in self.params]
        if self.last is not None:
            self.seen.append(all(a is c for a, c in zip(now, self.last)))
        self.last = now


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
@pytest.mark.parametrize("accumulate", range(1, 9))
def test_accumulation_over_1_to_8_microbatches_as_in_eager(clean, accumulate, set_to_none):
    """Over 1 to 8 microbatches, either zero_grad: eager's values, and .grad stays the
    same tensor object from one microbatch's backward to the next (and, kept in place,
    from one step to the next), as eagerly."""
    b = clean
    base = small(b)
    want = run(copy.deepcopy(base), b, 2, accumulate, set_to_none)
    eager = copy.deepcopy(base)
    eager_seen = SameGradObjects(block_params(eager))
    run(eager, b, 2, accumulate, set_to_none, after_backward=eager_seen)
    model = copy.deepcopy(base)
    with graphed(model, b, "resident"):
        seen = SameGradObjects(block_params(model))
        got = run(model, b, 2, accumulate, set_to_none, after_backward=seen)
    assert seen.seen == eager_seen.seen
    assert seen.seen.count(True) == 2 * accumulate - (2 if set_to_none else 1)
    assert_bitwise(got, want)


def test_grad_is_the_graph_buffer_not_a_copy(clean):
    b = clean
    model = small(b)
    with graphed(model, b, "off") as stack:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(*model.batch(0, b.device)).backward()
        bufs = set(buffers(stack).values())
        assert bufs and {p.grad.data_ptr() for p in block_params(model)} == bufs


@pytest.mark.parametrize("mode", ["resident", "remap"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
def test_where_every_layer_offloads_grad_is_one_home_for_good(clean, mode, set_to_none):
    """No layer keeps activations in the graphs' pool: each parameter's .grad is a home of
    its own outside it, at the same address every step (the same tensor object when
    zeroed in place), that the backward graph adds into; the pool holds no gradient."""
    b = clean
    model = small(b)
    params = block_params(model)
    opt = torch.optim.SGD(params, lr=0.05)
    with graphed(model, b, mode) as stack:
        assert stack.gradient_buffers == []
        seen: list[list[tuple[int, int]]] = []
        for step in range(3):
            for micro in range(2):
                model(*model.batch(2 * step + micro, b.device)).backward()
            seen.append([(id(p.grad), p.grad.data_ptr()) for p in params])
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        assert seen[0] == seen[1] == seen[2] if not set_to_none else \
            [ptr for _, ptr in seen[0]] == [ptr for _, ptr in seen[2]]
        homes = {h.home.data_ptr() for r in stack._runners for _, h in r.homes}
        assert {ptr for _, ptr in seen[2]} == homes and len(homes) == len(params)


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
@pytest.mark.parametrize("accumulate,set_to_none", [(1, True), (2, False), (3, True)])
def test_an_optimizer_that_keeps_references_to_grad(clean, mode, optimizer, accumulate, set_to_none):
    b = clean
    base = small(b)
    want = run(copy.deepcopy(base), b, 4, accumulate, set_to_none, optimizer)
    model = copy.deepcopy(base)
    frozen = gc.get_freeze_count()
    try:
        with graphed(model, b, mode):
            assert_bitwise(run(model, b, 4, accumulate, set_to_none, optimizer), want)
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
@pytest.mark.parametrize("accumulate,set_to_none", [(1, True), (2, False), (3, True)])
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


@pytest.mark.parametrize("registered", ["before-build", "after-build"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
def test_tensor_hooks_on_parameters_see_each_gradient(clean, registered, set_to_none):
    b = clean
    base = small(b, 2)
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "graphed": []}

    def hook_on(model: TinyGPT, key: str) -> None:
        w = model.blocks[1].fc1.weight
        w.register_hook(lambda g: seen[key].append(g.clone()) or g * 0.5)

    eager = copy.deepcopy(base)
    hook_on(eager, "eager")
    want = run(eager, b, 2, 2, set_to_none)
    model = copy.deepcopy(base)
    if registered == "before-build":
        hook_on(model, "graphed")
    with graphed(model, b, "resident"):
        if registered == "after-build":
            run(model, b, 1, 1, True)  # a step without the hook: .grad was the buffer
            with torch.no_grad():
                for p, q in zip(model.parameters(), base.parameters()):
                    p.copy_(q)
                    p.grad = None
            hook_on(model, "graphed")
        assert_bitwise(run(model, b, 2, 2, set_to_none), want)
    assert len(seen["eager"]) == 4
    assert_bitwise(seen["graphed"], seen["eager"])


@pytest.mark.parametrize("mode", ["off", "remap"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
def test_post_accumulate_grad_hooks_fire_as_often_as_in_eager(clean, mode, set_to_none):
    """Every parameter's post-accumulate-grad hooks run once per backward and see the
    accumulated .grad, as eagerly (an optimizer in backward relies on it)."""
    b = clean
    base = small(b)

    def hooked(model: TinyGPT) -> dict[str, list[torch.Tensor]]:
        calls: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: calls[n].append(p.grad.detach().clone()))
        return calls

    eager = copy.deepcopy(base)
    want_calls = hooked(eager)
    want = run(eager, b, 2, 3, set_to_none)
    model = copy.deepcopy(base)
    with graphed(model, b, mode):
        calls = hooked(model)
        got = run(model, b, 2, 3, set_to_none)
    assert_bitwise(got, want)
    assert {n: len(c) for n, c in calls.items()} == {n: 6 for n in want_calls}
    for n in want_calls:
        assert_bitwise(calls[n], want_calls[n])


def _pipelined(model: nn.Module, b: graphslot.Backend, steps: int, set_to_none: bool,
               after_backward: Callable[[], None] = lambda: None) -> list[torch.Tensor]:
    """1F1B order, three microbatches a step: F1 F2 B1 F3 B2 B3 (two forwards in flight)."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    out: list[torch.Tensor] = []
    for step in range(steps):
        losses = {}
        for op, mb in [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]:
            if op == "F":
                losses[mb] = model(*model.batch(3 * step + mb, b.device))
            else:
                losses[mb].backward()
                out.append(losses.pop(mb).detach())
                after_backward()
        out += [p.grad.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return out + [p.detach().clone() for p in params]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
def test_microbatches_in_flight_accumulate_as_in_eager(clean, mode, set_to_none):
    b = clean
    base = small(b)
    want = _pipelined(copy.deepcopy(base), b, 2, set_to_none)
    model = copy.deepcopy(base)
    with graphed(model, b, mode):
        seen = SameGradObjects(block_params(model))
        got = _pipelined(model, b, 2, set_to_none, seen)
    assert seen.seen == [True, True, not set_to_none, True, True]
    assert_bitwise(got, want)


def _clipped_and_scaled(model: nn.Module, b: graphslot.Backend, set_to_none: bool) -> list[torch.Tensor]:
    """AMP's GradScaler (its scale grows every step), unscale, clip, step; two microbatches."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(b.device.type, init_scale=2.0 ** 6, growth_interval=1)
    out: list[torch.Tensor] = []
    for step in range(3):
        for micro in range(2):
            loss = model(*model.batch(2 * step + micro, b.device))
            scaler.scale(loss).backward()
            out.append(loss.detach())
        scaler.unscale_(opt)
        out.append(torch.nn.utils.clip_grad_norm_(params, 0.05))
        out += [p.grad.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=set_to_none)
    out.append(torch.tensor(scaler.get_scale()))
    return out + [p.detach().clone() for p in params]


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
def test_grad_scaler_and_clipping_as_in_eager(clean, set_to_none):
    b = clean
    base = small(b)
    want = _clipped_and_scaled(copy.deepcopy(base), b, set_to_none)
    model = copy.deepcopy(base)
    with graphed(model, b, "resident"):
        assert_bitwise(_clipped_and_scaled(model, b, set_to_none), want)


def _assigned(model: TinyGPT, b: graphslot.Backend, how: str) -> tuple[list[torch.Tensor], list[bool]]:
    """.grad set by the user before the first backward: fresh tensors holding a value, or
    views into one flat buffer (as DDP's gradient_as_bucket_view), zeroed in place between
    steps. Returns the results and, per backward, whether every .grad is still the
    user's tensor object (and, for views, still in the flat buffer)."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    flat = torch.zeros(sum(p.numel() for p in params), device=b.device)
    mine: list[torch.Tensor] = []
    off = 0
    for p in params:
        if how == "fresh":
            p.grad = torch.full_like(p, 0.125)
        else:
            p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
        mine.append(p.grad)
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    out: list[torch.Tensor] = []
    same: list[bool] = []
    for step in range(2):
        for micro in range(3):
            loss = model(*model.batch(3 * step + micro, b.device))
            loss.backward()
            out.append(loss.detach())
            same.append(all(p.grad is g and (how == "fresh" or lo <= g.data_ptr() < hi)
                            for p, g in zip(params, mine)))
        out += [flat.clone()] if how == "views" else [p.grad.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=False)
    return out + [p.detach().clone() for p in params], same


@pytest.mark.parametrize("how", ["fresh", "views"])
def test_a_grad_the_user_assigned_receives_the_sum(clean, how):
    b = clean
    base = small(b)
    want, _ = _assigned(copy.deepcopy(base), b, how)
    model = copy.deepcopy(base)
    with graphed(model, b, "resident"):
        got, same = _assigned(model, b, how)
    assert same == [True] * 6
    assert_bitwise(got, want)


def test_autograd_grad_through_the_stack_leaves_grad_alone(clean):
    """torch.autograd.grad with respect to the parameters returns eager's gradients and
    leaves .grad as it was, and backward(inputs=...) leaves the other parameters' .grad
    alone; later backwards still accumulate as eagerly."""
    b = clean
    base = small(b)

    def session(model: TinyGPT) -> list[torch.Tensor]:
        ps = block_params(model)
        model(*model.batch(0, b.device)).backward()
        out = list(torch.autograd.grad(model(*model.batch(1, b.device)), ps))
        model(*model.batch(2, b.device)).backward(inputs=list(model.head.parameters()))
        out += [p.grad.detach().clone() for p in model.parameters()]
        model(*model.batch(3, b.device)).backward()
        return out + [p.grad.detach().clone() for p in model.parameters()]

    want = session(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with graphed(model, b, "resident"):
        assert_bitwise(session(model), want)


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


class _Gate(nn.Module):
    """y = tanh(w * x), elementwise: the weight's gradient is g * x, so an input of -0.0
    gives a gradient of -0.0 (a fresh gradient started from +0.0 would read +0.0)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 64).view(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w * x)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zero-in-place"])
def test_a_fresh_gradient_keeps_negative_zeros(clean, set_to_none):
    b = clean
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    x[:, ::3] = -0.0
    x = x.to(b.device)
    eager, model = _Gate().to(b.device), _Gate().to(b.device)
    grads: dict[str, list[torch.Tensor]] = {"eager": [], "graphed": []}
    with GraphedLayers([model], torch.zeros_like(x), mode="off", backend=b) as stack:
        for key, fn, m in [("eager", eager, eager), ("graphed", stack, model)]:
            for _ in range(2):
                m.zero_grad(set_to_none=set_to_none)
                fn(x).sum().backward()
                grads[key].append(m.w.grad.detach().clone())
    assert bool(torch.signbit(grads["eager"][0]).any())  # the case this test is about
    assert_bitwise(grads["graphed"], grads["eager"])


def _megatron_style(model: nn.Module, b: graphslot.Backend, stack: nn.Module, hooks: bool,
                    order: list[tuple[str, int]] | None = None) -> list[torch.Tensor]:
    """Megatron's way: an fp32 main_grad per bf16 parameter, gradients accumulated into it
    (eagerly by a post-accumulate-grad hook that then drops .grad), zeroed in place; two
    steps of three microbatches, the second step's in 1F1B order (two in flight)."""
    params = list(model.parameters())
    if hooks:
        for p in params:
            def into_main(p: nn.Parameter) -> None:
                p.main_grad.add_(p.grad)  # (what Megatron's backward hook does)
                p.grad = None
            p.register_post_accumulate_grad_hook(into_main)
    out: list[torch.Tensor] = []
    for step, ops in enumerate([[("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)],
                                [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]]):
        losses, xs = {}, {}
        for op, mb in ops:
            if op == "F":
                g = torch.Generator().manual_seed(3 * step + mb)
                xs[mb] = torch.randn(4, 16, generator=g).to(b.device, torch.bfloat16).requires_grad_()
                losses[mb] = (stack(xs[mb]).float() ** 2).mean()
                continue
            losses.pop(mb).backward()
            out.append(xs.pop(mb).grad.clone())
            assert all(p.grad is None for p in params)
        out += [p.main_grad.clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.sub_(0.05 * p.main_grad.to(p.dtype))
                p.main_grad.zero_()
    return out + [p.detach().clone() for p in params]


def _bf16_stack(b: graphslot.Backend) -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(*[_Scaled(nn.Linear(16, 16), s) for s in (1.0, 0.7, 1.3)]).to(b.device, torch.bfloat16)


def _with_main_grads(base: nn.Module, b: graphslot.Backend) -> nn.Module:
    m = copy.deepcopy(base)
    g = torch.Generator().manual_seed(2)
    for p in m.parameters():  # (left over from an earlier accumulation: kept, added to)
        p.main_grad = torch.randn(p.shape, generator=g).to(b.device)
    return m


@pytest.mark.parametrize("mode,per_graph,recompute", [
    ("off", 1, False), ("resident", 1, False), ("remap", 1, False), ("resident", None, False),
    ("off", 1, True), ("remap", 1, True)],
    ids=["off", "resident", "remap", "resident-one-graph", "off-recompute", "remap-recompute"])
def test_main_grad_accumulates_in_the_graph_as_megatron_does(clean, mode, per_graph, recompute):
    """main_grad=True: bit for bit what Megatron's eager hook gives (fp32 main_grad += bf16
    gradient), .grad stays None, the input gradient is eager's, microbatches in flight
    included; the graphs keep no gradient buffers; a replaced main_grad is refused."""
    b = clean
    base = _bf16_stack(b)
    eager = _with_main_grads(base, b)
    want = _megatron_style(eager, b, eager, hooks=True)
    model = _with_main_grads(base, b)
    sample = torch.zeros(4, 16, device=b.device, dtype=torch.bfloat16, requires_grad=True)
    with GraphedLayers(list(model), sample, mode=mode, backend=b, main_grad=True,
                       layers_per_graph=per_graph,
                       recompute_layers=[1] if recompute else None) as stack:
        assert stack.gradient_buffers == []  # main_grad is the only gradient storage
        assert_bitwise(_megatron_style(model, b, stack, hooks=False), want)
        model[1].lin.weight.main_grad = torch.zeros_like(model[1].lin.weight.main_grad)
        with pytest.raises(graphslot.StateError, match=r"layers\[1\]\.lin\.weight's main_grad is no longer"):
            stack(sample).float().sum().backward()


def test_main_grad_that_is_grad_accumulates_as_eager_grad(clean):
    """.grad kept and accumulated in graph: each parameter's main_grad of its own dtype,
    assigned as .grad too and zeroed in place, gets eager's ``grad += new`` bit for bit;
    post-accumulate-grad hooks run once per backward, as eagerly."""
    b = clean
    base = small(b)

    def session(model: TinyGPT, stack: nn.Module) -> tuple[list[torch.Tensor], dict[int, int]]:
        params = list(model.parameters())
        calls = {id(p): 0 for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(id(p), calls[id(p)] + 1))
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        out: list[torch.Tensor] = []
        for step in range(3):
            for micro in range(2):
                loss = model(*model.batch(2 * step + micro, b.device))
                loss.backward()
                out.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            out += [p.grad.clone() for p in params]
            opt.step()
            opt.zero_grad(set_to_none=False)
        return out + [p.detach().clone() for p in params], calls

    eager = copy.deepcopy(base)
    for p in eager.parameters():
        p.grad = torch.zeros_like(p)
    want, want_calls = session(eager, eager.stack)
    model = copy.deepcopy(base)
    for p in block_params(model):
        p.main_grad = torch.zeros_like(p)
        p.grad = p.main_grad
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    with GraphedLayers(list(model.blocks), sample, mode="resident", backend=b, main_grad=True,
                       layers_per_graph=1) as stack:
        model.stack = stack
        got, calls = session(model, stack)
    assert all(p.grad is p.main_grad for p in block_params(model))
    assert list(calls.values()) == list(want_calls.values()) == [6] * len(calls)
    assert_bitwise(got, want)


def _scaled_layer(b: graphslot.Backend) -> _Scaled:
    layer = _Scaled(nn.Linear(16, 16), 1.0).to(b.device)
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p)
    return layer


def test_main_grad_must_be_on_every_parameter_and_fit_it(clean):
    b = clean
    x = torch.zeros(4, 16, device=b.device)
    layers = [_scaled_layer(b), _scaled_layer(b)]
    del layers[1].lin.weight.main_grad
    with pytest.raises(graphslot.UsageError, match=r"layers\[1\]\.lin\.weight has no main_grad"):
        GraphedLayers(layers, x, mode="off", backend=b, main_grad=True)
    layers[1].lin.weight.main_grad = torch.zeros(3, device=b.device)
    with pytest.raises(graphslot.UsageError, match=r"layers\[1\]\.lin\.weight's main_grad is \[3\] torch.float32"):
        GraphedLayers(layers, x, mode="off", backend=b, main_grad=True)
    layers[1].lin.weight.main_grad = torch.zeros(16, 16, device=b.device)
    layers[0].lin.bias.requires_grad_(False)  # frozen: needs none
    del layers[0].lin.bias.main_grad
    GraphedLayers(layers, x, mode="off", backend=b, main_grad=True).close()


def test_main_grad_refuses_what_the_graph_would_skip_or_split(clean):
    """Tensor hooks (before the build: UsageError; after: StateError at the backward) and a
    parameter in two graphs (each would add its part where eager adds their sum)."""
    b = clean
    x = torch.zeros(4, 16, device=b.device)
    hooked = _scaled_layer(b)
    handle = hooked.lin.weight.register_hook(lambda g: g)
    with pytest.raises(graphslot.UsageError, match=r"layers\[0\]\.lin\.weight has tensor hooks"):
        GraphedLayers([hooked], x, mode="off", backend=b, main_grad=True)
    handle.remove()
    with GraphedLayers([hooked], x, mode="off", backend=b, main_grad=True) as stack:
        hooked.lin.weight.register_hook(lambda g: g)
        with pytest.raises(graphslot.StateError, match=r"got a tensor hook after the build"):
            stack(x).sum().backward()
    shared = _scaled_layer(b)
    other = _Scaled(shared.lin, 0.5)
    with pytest.raises(graphslot.UsageError, match=r"in several graphs"):
        GraphedLayers([shared, other], x, mode="off", backend=b, main_grad=True, layers_per_graph=1)
    # In one graph autograd sums the two parts inside the capture, as eagerly: accepted.
    GraphedLayers([shared, other], x, mode="off", backend=b, main_grad=True, layers_per_graph=2).close()


class _Wide(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(n, n), nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _peaks(stack: nn.Module, params: list[nn.Parameter], x: torch.Tensor, b: graphslot.Backend,
           main_grad: bool = False) -> dict[str, int]:
    """Peak footprint, sampled after each forward, backward and optimizer step, over two
    steps with zero_grad(set_to_none=True), with .grad zeroed in place, and with four
    microbatches accumulated. With ``main_grad``, .grad is main_grad for the step."""
    from graphslot.memory import used_bytes

    opt = torch.optim.SGD(params, lr=1e-3)
    peaks: dict[str, int] = {}
    for name, accumulate, set_to_none in [("set_to_none", 1, True), ("kept", 1, False),
                                          ("accumulate4", 4, True)]:
        peak = 0
        for _ in range(2):
            for _ in range(accumulate):
                y = stack(x)
                peak = max(peak, used_bytes(b))
                y.square().mean().backward()
                del y
                peak = max(peak, used_bytes(b))
            if main_grad:
                for p in params:
                    p.grad = p.main_grad
            opt.step()
            peak = max(peak, used_bytes(b))
            opt.zero_grad(set_to_none=set_to_none)
            if main_grad and set_to_none:
                for p in params:
                    p.main_grad.zero_()
        peaks[name] = peak
    return peaks


@pytest.mark.parametrize("depth,rows,n,heavy", [(4, 8, 2048, False), (2, 2048, 1024, True)],
                         ids=["gradients-outweigh-activations", "activations-outweigh-gradients"])
def test_what_a_kept_grad_costs_beside_eager(clean, depth, rows, n, heavy):
    """Memory of .grad kept (zeroed in place) or accumulated over four microbatches, against
    zero_grad(set_to_none=True), on four layers. In mode off (activations in the graphs'
    pool, which the gradient buffers share) at most one copy of the gradients more (never
    one per microbatch), none where what the layers keep is tiny beside the gradients (the
    gradients get homes then); where activations outweigh gradients that is what eager pays too
    (its kept gradients sit beside every activation at the forward's end). Where every
    layer offloads (resident), and with main_grad=True (main_grad as .grad), keeping costs
    nothing: the backward graph adds into the one gradient storage."""
    b = clean
    if b.footprint_bytes() is None:
        pytest.skip(f"the {b.name} backend cannot tell this process's footprint")
    torch.manual_seed(0)
    layers = [_Wide(n).to(b.device) for _ in range(depth)]
    params = [p for m in layers for p in m.parameters()]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    x = torch.randn(rows, n, device=b.device)
    eager = _peaks(nn.Sequential(*layers), params, x, b)
    for p in params:
        p.grad = None
    with GraphedLayers(layers, x, mode="off", backend=b, layers_per_graph=1) as stack:
        graph = _peaks(stack, params, x, b)
    for p in params:
        p.grad = None
    with GraphedLayers(layers, x, mode="resident", backend=b, layers_per_graph=1) as stack:
        assert stack.gradient_buffers == []  # each .grad has a home outside the pool
        offloaded = _peaks(stack, params, x, b)
    for p in params:
        p.grad = None
        p.main_grad = torch.zeros_like(p)
    with GraphedLayers(layers, x, mode="resident", backend=b, layers_per_graph=1,
                       main_grad=True) as stack:
        main = _peaks(stack, params, x, b, main_grad=True)
    del stack

    def over(peaks: dict[str, int]) -> dict[str, float]:
        return {k: round((v - peaks["set_to_none"]) / 2**20, 1) for k, v in peaks.items()}

    print(f"gradients {grad_bytes / 2**20:.0f} MiB; MiB over set_to_none: eager {over(eager)}, "
          f"graphed off {over(graph)}, resident {over(offloaded)}, main_grad {over(main)}")
    slack = 8 << 20
    assert grad_bytes >= 2 * slack  # a copy of the gradients shows
    for name in ("kept", "accumulate4"):
        assert graph[name] - graph["set_to_none"] <= grad_bytes + slack, (name, graph)
        assert abs(main[name] - main["set_to_none"]) <= slack, (name, main)
        assert abs(offloaded[name] - offloaded["set_to_none"]) <= slack, (name, offloaded)
        if not heavy:  # what the layers keep is tiny beside the gradients: homes, as offloaded
            assert abs(graph[name] - graph["set_to_none"]) <= slack, (name, graph)
    if heavy:  # activations outweigh gradients: eager pays a copy too
        assert rows * n * x.element_size() * depth * 3 >= 2 * grad_bytes
        for name in ("kept", "accumulate4"):
            assert eager[name] - eager["set_to_none"] >= grad_bytes - slack, (name, eager)
            assert graph[name] - graph["set_to_none"] <= eager[name] - eager["set_to_none"] + slack


def _two_steps_keeping_grad(model: TinyGPT, b: graphslot.Backend) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Two steps with zero_grad(set_to_none=False): each step's .grad of the blocks, and
    the parameters after."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    grads: list[list[torch.Tensor]] = []
    for step in range(2):
        model(*model.batch(step, b.device)).backward()
        grads.append([p.grad.detach().clone() for p in block_params(model)])
        opt.step()
        opt.zero_grad(set_to_none=False)
    return grads, [p.detach().clone() for p in params]


def test_beside_torchs_graphed_callables_with_kept_grad(clean, record_property):
    """The same layers, zero_grad(set_to_none=False), two steps: GraphedLayers is eager bit
    for bit. torch's graphed callables are run beside and what they give is reported (a
    warning and the junit property ``torch_make_graphed_callables``), not asserted: their
    .grad is said to alias the graph's static buffer, which the next replay overwrites
    before autograd adds the same buffer into it (pytorch#181723: g2 + g2)."""
    b = clean
    if b.device.type != "cuda":
        pytest.skip("torch.cuda.make_graphed_callables runs on cuda only")
    base = small(b)
    want_grads, want_params = _two_steps_keeping_grad(copy.deepcopy(base), b)
    model = copy.deepcopy(base)
    with graphed(model, b, "off"):
        got_grads, got_params = _two_steps_keeping_grad(model, b)
    for step in range(2):
        assert_bitwise(got_grads[step], want_grads[step])
    assert_bitwise(got_params, want_params)

    theirs = copy.deepcopy(base)
    with torch.no_grad():
        sample = theirs.hidden_in(theirs.batch(0, b.device)[0])
    try:
        blocks = torch.cuda.make_graphed_callables(
            tuple(theirs.blocks), tuple((sample.clone().requires_grad_(),) for _ in theirs.blocks))
        theirs.stack = nn.Sequential(*blocks)
        t_grads, t_params = _two_steps_keeping_grad(theirs, b)
    except Exception as e:  # what torch does is reported, whatever it is
        t_grads = []
        failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"

    def same(a: list[torch.Tensor], c: list[torch.Tensor]) -> bool:
        return len(a) == len(c) and all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, c))

    if not t_grads:
        seen = f"failed to run ({failed})"
    elif same(t_grads[0], want_grads[0]) and same(t_grads[1], want_grads[1]) and same(t_params, want_params):
        seen = "eager's gradients bit for bit"
    elif same(t_grads[0], want_grads[0]) and same(t_grads[1], [2 * g for g in want_grads[1]]):
        seen = "step 1 eager's, step 2 twice eager's (g2 + g2: .grad aliases the overwritten static buffer)"
    else:
        worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(t_grads[1], want_grads[1]))
        seen = f"gradients differing from eager's (step 2 by up to {worst:g})"
    record_property("torch_make_graphed_callables", seen)
    warnings.warn(f"torch {torch.__version__} make_graphed_callables, zero_grad(set_to_none=False), "
                  f"two steps: {seen}", stacklevel=1)


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad-homes", "main-grad"])
def test_gradients_stay_out_of_the_graphs_pool(clean, main_grad):
    """Where gradients outweigh activations, a default stack gives each gradient a home
    outside the graphs' pool, and with main_grad=True each gradient is added into main_grad
    as it arrives and its memory reused at once: either way the pool is smaller than the
    gradients. (The cpu backend keeps every tensor a capture made, so this shows on
    devices only.)"""
    b = clean
    if b.device.type == "cpu":
        pytest.skip("cpu graphs keep every tensor their capture made: no pool reuse to see")
    torch.manual_seed(0)
    layers = [_Wide(1024).to(b.device) for _ in range(4)]
    params = [p for m in layers for p in m.parameters()]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    x = torch.randn(8, 1024, device=b.device)
    for p in params:
        p.main_grad = torch.zeros_like(p)
    with GraphedLayers(layers, x, mode="resident", backend=b, layers_per_graph=1,
                       main_grad=main_grad) as stack:
        pool = stack.pool_bytes
        assert stack.gradient_buffers == []
    if pool is None:
        pytest.skip(f"the {b.name} backend cannot tell its graphs' pool")
    print(f"pool {pool / 2**20:.1f} MiB, gradients {grad_bytes / 2**20:.1f} MiB")
    assert pool < grad_bytes, (pool, grad_bytes)


# -- gradient homes against eager, where a reviewer broke them -------------------------


@pytest.mark.parametrize("mode", ["resident", "remap", "off"])
def test_a_grad_assigned_over_a_kept_one_leaves_the_kept_one_alone(clean, mode):
    """The old .grad kept (per-task gradients), a fresh .grad assigned, another backward:
    the kept tensors keep their values and the fresh one gets the gradient, as in eager."""
    b = clean

    def session(model: TinyGPT) -> list[torch.Tensor]:
        ps = block_params(model)
        model(*model.batch(0, b.device)).backward()
        kept = [p.grad for p in ps]
        for p in ps:
            p.grad = torch.zeros_like(p)
        model(*model.batch(1, b.device)).backward()
        return [k.clone() for k in kept] + [p.grad.clone() for p in ps]

    base = small(b)
    want = session(copy.deepcopy(base))
    model = copy.deepcopy(base)
    with graphed(model, b, mode):
        assert_bitwise(session(model), want)


@pytest.mark.parametrize("mode", ["resident", "remap"])
@pytest.mark.parametrize("flat", [False, True], ids=["own-tensors", "views-of-one-buffer"])
def test_grads_assigned_before_the_build_and_kept_stay_the_users(clean, mode, flat):
    """.grad assigned before the build (separate tensors, or views into one flat buffer as
    DDP's gradient_as_bucket_view makes) and referenced by the user across
    zero_grad(set_to_none=True): what the user holds is never written by a later backward,
    and every step's .grad is eager's."""
    b = clean

    def session(model: TinyGPT, build: Callable[[TinyGPT], nn.Module] | None = None) -> list[torch.Tensor]:
        ps = block_params(model)
        if flat:
            buf = torch.zeros(sum(p.numel() for p in ps), device=b.device)
            o = 0
            for p in ps:
                p.grad = buf[o:o + p.numel()].view_as(p)
                o += p.numel()
        else:
            for p in ps:
                p.grad = torch.zeros_like(p)
        kept = [p.grad for p in ps]
        stack = build(model) if build is not None else None
        out: list[torch.Tensor] = []
        try:
            for step in range(3):
                model(*model.batch(step, b.device)).backward()
                out += [p.grad.clone() for p in ps]
                if step == 0:
                    view = ps[0].grad.view(-1)  # a view of one old .grad, kept
                for p in ps:
                    p.grad = None
        finally:
            if stack is not None:
                stack.close()
        return out + [k.clone() for k in kept] + [view.clone()]

    base = small(b)
    want = session(copy.deepcopy(base))
    assert_bitwise(session(copy.deepcopy(base), lambda m: graphed(m, b, mode)), want)


class _TiedBlock(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("mode", ["resident", "off"])
def test_a_parameter_also_used_outside_the_stack_accumulates_as_in_eager(clean, mode):
    """A weight used by a graphed layer and again after the stack, four microbatches a
    step: eager adds the two parts together before adding them into .grad, and so must
    the stack (a gradient home added into inside the graph would not)."""
    b = clean
    torch.manual_seed(0)
    tied = nn.Linear(64, 64).to(b.device)
    base = nn.ModuleList([_TiedBlock(tied), _TiedBlock(nn.Linear(64, 64).to(b.device))])

    def session(blocks: nn.ModuleList, stack: nn.Module) -> list[torch.Tensor]:
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        out: list[torch.Tensor] = []
        for step in range(3):
            for k in range(4):
                g = torch.Generator().manual_seed(100 * step + k)
                x = torch.randn(32, 64, generator=g).to(b.device)
                (blocks[0].lin(stack(x)) ** 2).mean().backward()
            out += [p.grad.clone() for p in blocks.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out

    eager = copy.deepcopy(base)
    want = session(eager, nn.Sequential(*eager))
    blocks = copy.deepcopy(base)
    with GraphedLayers(list(blocks), torch.zeros(32, 64, device=b.device), mode=mode,
                       backend=b, layers_per_graph=1) as stack:
        assert_bitwise(session(blocks, stack), want)


class _WithUnused(nn.Module):
    """A layer with a parameter its forward never uses (a head kept for later, a branch
    switched off): eager leaves that parameter's ``.grad`` None."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.used(x))


@pytest.mark.parametrize("build", [dict(mode="off"), dict(mode="resident", offload_layers=[0, 1]),
                                   dict(mode="remap", offload_layers=[0, 1]),
                                   dict(mode="off", recompute_layers=[0, 1]),
                                   dict(mode="resident", offload_layers=[1], recompute_layers=[0])],
                         ids=["keep", "offload-resident", "offload-remap", "recompute", "mixed"])
def test_a_parameter_the_layers_leave_unused_keeps_grad_none(clean, build):
    """Gradient homes included: a zero ``.grad`` would not be eager's, since AdamW's weight
    decay and moments then move the unused parameter."""
    b = clean
    torch.manual_seed(0)
    base = nn.ModuleList([_WithUnused(), _WithUnused()]).to(b.device)
    xs = [torch.randn(4, 16, device=b.device) for _ in range(3)]

    def train(mods: nn.ModuleList, fwd: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        opt = torch.optim.AdamW(mods.parameters(), lr=1e-2, weight_decay=0.1)
        seen = []
        for set_to_none in (True, False, True):
            for x in xs[:2]:
                fwd(x).square().mean().backward()
            assert all(m.unused.weight.grad is None for m in mods), "an unused parameter got a .grad"
            seen += [p.grad.clone() for p in mods.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return seen + [p.detach().clone() for p in mods.parameters()]

    eager, mods = copy.deepcopy(base), copy.deepcopy(base)
    want = train(eager, nn.Sequential(*eager))
    with GraphedLayers(list(mods), torch.randn(4, 16, device=b.device), backend=b, **build) as stack:
        got = train(mods, stack)
    assert_bitwise(got, want)


def test_a_sparse_gradient_is_refused_at_build_naming_the_parameter(clean):
    """An embedding with ``sparse=True`` makes a sparse gradient, which no device graph can
    capture: the build says which parameter and gives back what it made."""
    b = clean
    layers = [nn.Embedding(50, 16, sparse=True).to(b.device), nn.Linear(16, 16).to(b.device)]
    mapped = b.ledger.mapped_bytes
    with pytest.raises(graphslot.UsageError, match=r"layers\[0\]\.weight gets a torch\.sparse_coo "
                                                   r"gradient .*sparse=False"):
        GraphedLayers(layers, torch.randint(0, 50, (4, 8), device=b.device), mode="resident",
                      backend=b)
    assert b.ledger.mapped_bytes == mapped
    assert all(p.grad is None for m in layers for p in m.parameters())
