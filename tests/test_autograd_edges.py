"""What a training script does around a GraphedLayers stack beyond forward and backward:
a double backward, copying or pickling the model, torch.compile over it, batches of
another shape, and the model moved to another dtype. Each works as in eager or is refused
with a message that names the cause and the way out; nothing is silently wrong."""

from __future__ import annotations

import copy
import io
import sys

import pytest
import torch
from torch import nn

from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import CaptureMismatchError, StateError, UsageError

H, B = 32, 8


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(16, H)
        self.stack = nn.Sequential(*[nn.Sequential(nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.GELU(),
                                                   nn.Linear(2 * H, H)) for _ in range(3)])
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.pre(x)))


def _pair(b) -> tuple[Model, Model]:
    """An eager model and a copy whose stack is graphed."""
    eager = Model().to(b.device)
    m = copy.deepcopy(eager)
    m.stack = GraphedLayers(list(m.stack), torch.randn(B, H, device=b.device, requires_grad=True),
                            backend=b)
    return eager, m


def _data(b, n: int = B, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return (torch.randn(n, 16, generator=g).to(b.device), torch.randn(n, 1, generator=g).to(b.device))


def _grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def test_a_double_backward_through_the_stack_is_refused_and_the_stack_trains_on(clean):
    """A gradient penalty through the layers: the replayed backward's gradients have no
    history, so a second backward would silently leave the layers' part out. Refused."""
    b = clean
    eager, m = _pair(b)
    with m.stack:
        x, y = _data(b)
        x.requires_grad_()
        out = m(x)
        with pytest.raises(StateError, match="create_graph=True.*Keep the layers"):
            torch.autograd.grad(out.sum(), x, create_graph=True)
        del out
        for net in (eager, m):  # a plain step after it, as eager's
            nn.functional.mse_loss(net(x.detach()), y).backward()
        assert all(torch.equal(a, c) for a, c in zip(_grads(eager), _grads(m)))


def test_copying_or_pickling_the_stack_is_refused_naming_what_to_do(clean):
    b = clean
    eager, m = _pair(b)
    with m.stack:
        with pytest.raises(UsageError, match="cannot be copied.*before building the stack"):
            copy.deepcopy(m)
        with pytest.raises(UsageError, match="cannot be pickled.*state_dict"):
            torch.save(m, io.BytesIO())
        state = m.state_dict()  # (what to save instead: the layers' own keys)
        assert list(state) == list(eager.state_dict())
        eager.load_state_dict(state)


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="torch.compile needs Python < 3.14 here")
def test_torch_compile_over_a_model_holding_the_stack_trains_as_eager(clean):
    """The stack runs outside the compiled graph (a graph break), its graphs replaying."""
    b = clean
    eager, m = _pair(b)
    compiled = torch.compile(m, backend="aot_eager")
    with m.stack:
        for k in range(2):
            x, y = _data(b, k=k)
            for net in (eager, compiled):
                nn.functional.mse_loss(net(x), y).backward()
            assert all(torch.equal(a, c) for a, c in zip(_grads(eager), _grads(m)))


def test_a_batch_of_another_size_runs_eagerly_without_gradients_and_is_refused_with_them(clean):
    """A validation pass in train mode under no_grad, on a short last batch, runs the layers
    eagerly (no backward can follow); a training forward of that shape is refused, naming
    the ways out."""
    b = clean
    eager, m = _pair(b)
    with m.stack:
        x, _ = _data(b, n=5)
        with torch.no_grad():
            assert torch.equal(m(x), eager(x))
        with pytest.raises(CaptureMismatchError, match=r"captured for input \[8, 32\].*got \[5, 32\]"
                           r".*drop_last=True.*torch\.no_grad\(\)"):
            m(x)


def test_a_model_moved_to_another_dtype_is_refused_naming_the_moved_parameters(clean):
    """``model.double()`` changes the input's dtype too: the parameters that moved are the
    cause, and the message names them, not the input."""
    b = clean
    _, m = _pair(b)
    with m.stack:
        m.double()
        x, _ = _data(b)
        with pytest.raises(CaptureMismatchError, match=r"layer 0\.0\.weight lies elsewhere"):
            m(x.double())


def test_a_shallow_copy_or_a_replica_is_refused_too(clean):
    b = clean
    _, m = _pair(b)
    with m.stack:
        with pytest.raises(UsageError, match="cannot be copied"):
            copy.copy(m.stack)
        with pytest.raises(UsageError, match="cannot be replicated"):
            m.stack._replicate_for_data_parallel()


def test_without_gradients_another_autocast_runs_eagerly_and_a_non_tensor_is_named(clean):
    b = clean
    eager, m = _pair(b)
    with m.stack:
        x, _ = _data(b)
        with torch.no_grad(), torch.autocast(b.device.type, dtype=torch.bfloat16):
            assert torch.equal(m(x), eager(x))
        with torch.no_grad(), pytest.raises(CaptureMismatchError, match="one tensor input, got list"):
            m.stack([x])


def test_tensors_without_memory_alive_in_the_process_do_not_trip_the_holders_scan(clean):
    """Before graphslot writes a gradient buffer again, it finds who else holds it among
    every tensor alive; torch.compile leaves fake tensors in its caches, which have no
    memory to ask about."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from graphslot.adapters.torch.grads import give_holders_own_bytes

    with FunctionalTensorMode():
        functional = torch.empty(4)  # noqa: F841 (alive, as compile's caches keep them)
    t = torch.arange(8.0)
    view = t[2:4]
    lo = t.data_ptr()
    give_holders_own_bytes(t, lo, lo + t.untyped_storage().nbytes(), (t,))
    assert view.data_ptr() != t.data_ptr() + 8 and torch.equal(view, torch.tensor([2.0, 3.0]))


def test_a_layer_frozen_at_the_build_and_unfrozen_later_is_refused_and_freezing_later_trains(clean):
    """The graphs compute gradients for the parameters that wanted one at the build: one
    unfrozen since would silently get none (eager gives it one), so the forward is refused
    before anything runs; frozen after the build, a layer trains as in eager (no gradient)."""
    b = clean
    eager = Model().to(b.device)
    m = copy.deepcopy(eager)
    m.stack[1].requires_grad_(False)
    m.stack = GraphedLayers(list(m.stack), torch.randn(B, H, device=b.device, requires_grad=True),
                            backend=b)
    with m.stack:
        x, y = _data(b)
        nn.functional.mse_loss(m(x), y).backward()
        m.stack.layers[1].requires_grad_(True)
        with pytest.raises(CaptureMismatchError, match=r"parameter 1\.0\.weight \(and 5 more\) wants a "
                                                      r"gradient.*build the stack again"):
            m(x)
        with torch.no_grad():
            m(x)  # (no gradient wanted: runs)
        m.stack.layers[1].requires_grad_(False)
        nn.functional.mse_loss(m(x), y).backward()  # frozen again: trains on
    eager2, m2 = _pair(b)
    with m2.stack:
        for net in (eager2, m2):
            net.stack[2].requires_grad_(False) if net is eager2 else m2.stack.layers[2].requires_grad_(False)
            nn.functional.mse_loss(net(x), y).backward()
        assert all((a is None and c is None) or torch.equal(a, c) for a, c in zip(_grads(eager2), _grads(m2)))
        assert all(p.grad is None for p in m2.stack.layers[2].parameters())


def test_a_parameter_replaced_by_another_object_at_the_same_address_is_refused(clean):
    """The graphs' backward hands each gradient to the parameter object captured: a new
    object (same bytes, as ``nn.Parameter(p.detach())`` makes) would silently get none."""
    b = clean
    eager, m = _pair(b)
    with m.stack:
        x, y = _data(b)
        lin = m.stack.layers[0][1]
        lin.weight = nn.Parameter(lin.weight.detach())
        with pytest.raises(CaptureMismatchError, match=r"0\.1\.weight is another parameter object"):
            m(x)


class _Broadcast(nn.Module):
    """Returns an expanded view (one element standing for two): the layer above's input
    gradient is then an expanded view too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + 1).expand(2, 4, 8)


class _SumFirst(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


@pytest.mark.parametrize("mode", ["off", "resident", "remap"])
def test_an_expanded_output_trains_as_eager_with_microbatches_in_flight(clean, mode):
    b = clean
    torch.manual_seed(0)
    layers = [_Broadcast().to(b.device), _SumFirst(), nn.Linear(8, 8).to(b.device)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    xs = [torch.randn(4, 8, device=b.device) for _ in range(2)]
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True), mode=mode,
                       layers_per_graph=1, backend=b) as stack:
        xg = [x.clone().requires_grad_() for x in xs]
        xe = [x.clone().requires_grad_() for x in xs]
        outs = [stack(x).square().sum() for x in xg]
        outs_e = [eager(x).square().sum() for x in xe]
        for o, oe in zip(reversed(outs), reversed(outs_e)):
            o.backward()
            oe.backward()
        for a, e in zip([*xg, *stack.parameters()], [*xe, *eager.parameters()]):
            assert torch.equal(a.grad, e.grad)


class _TransposeInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)  # (4, 8)
        z = y.clone()
        z.t_()  # (8, 4): shape and strides changed in place
        return torch.tanh(y @ z) @ y


class _Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)  # (calls transpose_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x.view(4, 1, 8))[0].view(4, 8)


class _Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # (on cpu, oneDNN's kernel keeps the workspace its backward reads only with grad
        # mode on, which a forward replay inside the stack's autograd Function is not)
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x.view(2, 2, 8))[0].reshape(4, 8)


class _Conjugate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.complex64) @ self.w.conj()).imag  # (a lazily conjugated view)


class _SavesConjugate(nn.Module):
    """Saves a lazily conjugated view beside the tensor it views (``k * c``), and a
    negated view (``c.conj().imag``) of it: offloaded, each once read the plain bytes or
    wrote its values over them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.view_as_complex(self.lin(x).view(4, 4, 2))
        k = c.conj()
        im = c.conj().imag
        out = torch.view_as_real(k * c * self.w).reshape(4, 8)
        return out + torch.cat([im * im.sin(), im], 1)


@pytest.mark.parametrize("layer", [_TransposeInPlace, _Gru, _Lstm, _Conjugate, _SavesConjugate])
@pytest.mark.parametrize("mode", ["off", "resident", "remap"])
def test_in_place_view_ops_lazy_conjugates_and_grad_mode_kernels_train_as_eager(clean, layer, mode):
    b = clean
    torch.manual_seed(0)
    layers = [layer().to(b.device), nn.Linear(8, 8).to(b.device)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True), mode=mode,
                       layers_per_graph=1, backend=b) as stack:
        for _ in range(3):
            x = torch.randn(4, 8, device=b.device)
            xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            out, want = stack(xg), eager(xe)
            assert torch.equal(out, want)
            out.square().sum().backward()
            want.square().sum().backward()
            for a, e in zip([xg, *stack.parameters()], [xe, *eager.parameters()]):
                assert torch.equal(a.grad, e.grad)


def test_the_stack_indexes_and_iterates_its_layers_as_a_sequential_would(clean):
    b = clean
    layers = [nn.Linear(8, 8).to(b.device) for _ in range(3)]
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True),
                       backend=b) as stack:
        assert len(stack) == 3 and list(stack) == layers
        assert stack[1] is layers[1] and stack[-1] is layers[2] and stack[1:] == layers[1:]
        with pytest.raises(IndexError):
            stack[3]
        # (the modules themselves, registered once: the state_dict is a Sequential's)
        assert list(stack.state_dict()) == list(nn.Sequential(*layers).state_dict())


class _Down(nn.Module):
    """A conv block whose max pooling saves its indices, which its backward trusts."""

    def __init__(self, ci: int, co: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(ci, co, 3, stride=2, padding=1)
        self.pool = nn.MaxPool1d(2, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.conv(x)))


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class _Seen(torch.autograd.Function):
    """Saves a tensor of indices naming its layer, and notes what its backward reads."""

    read: list[tuple[int, list[int]]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor, tag: int) -> torch.Tensor:  # type: ignore[override]
        ctx.tag = tag
        ctx.save_for_backward(torch.full((64,), tag, dtype=torch.int64, device=x.device))
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        # (numpy reads the bytes without an op the capture would record or refuse)
        _Seen.read.append((ctx.tag, sorted(set(idx.detach().numpy().tolist()))))
        return g * 2, None


class _Tagged(nn.Module):
    def __init__(self, tag: int) -> None:
        super().__init__()
        self.tag = tag
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Seen.apply(self.lin(x), self.tag)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_no_backward_capture_reads_another_layers_saved_tensors(clean, mode):
    """Layers offloading through shared banks: a backend whose capture runs the work (cpu)
    once captured a layer's backward over a later layer's bytes in its bank, and max
    pooling's backward, trusting those as indices, wrote out of bounds (a segfault)."""
    # (the max pooling test below shows the crash itself, which ends the test run)
    b = clean
    if not b.new_graph().executes_during_capture:
        pytest.skip(f"the {b.name} backend's capture runs no work")
    torch.manual_seed(0)
    _Seen.read = []
    layers = [_Tagged(k).to(b.device) for k in (1, 2, 3, 4)]
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True), mode=mode,
                       layers_per_graph=1, backend=b) as stack:
        # (the warm-ups' backwards, then the captures', last layer first)
        assert [tag for tag, _ in _Seen.read[-4:]] == [4, 3, 2, 1]
        assert all(read == [tag] for tag, read in _Seen.read), _Seen.read
        _Seen.read = []
        stack(torch.randn(4, 8, device=b.device)).square().sum().backward()
        assert _Seen.read == []  # (replays run no Python)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_max_pooling_layers_offloaded_through_shared_banks_train_as_eager(clean, mode):
    b = clean
    torch.manual_seed(0)
    layers = [_Down(4, 8).to(b.device), _Down(8, 16).to(b.device), _Flat(),
              nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).to(b.device)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with GraphedLayers(layers, torch.zeros(4, 4, 16, device=b.device, requires_grad=True),
                       mode=mode, layers_per_graph=1, backend=b) as stack:
        for _ in range(2):
            x = torch.randn(4, 4, 16, device=b.device)
            _steps_as_eager(stack, eager, x)


def _steps_as_eager(stack: GraphedLayers, eager: nn.Module, x: torch.Tensor) -> None:
    """One backward of ``x`` through each: the input's and parameters' gradients equal."""
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    stack(xg).square().sum().backward()
    eager(xe).square().sum().backward()
    for a, e in zip([xg, *stack.parameters()], [xe, *eager.parameters()]):
        assert torch.equal(a.grad, e.grad)


class _Solve(nn.Module):
    """An LU solve, whose backward checks the pivots it saved."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.lin(x).view(4, 4, 4) + 3 * torch.eye(4, device=x.device)
        return x + torch.linalg.solve(m, x.view(4, 4, 4)).reshape(4, 16)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_lu_solves_offloaded_through_shared_banks_train_as_eager(clean, mode):
    """(a backend whose capture runs the work read another layer's pivots: refused)"""
    b = clean
    if not b.new_graph().executes_during_capture:
        pytest.skip(f"the {b.name} backend's capture runs no work (and LU checks sync)")
    torch.manual_seed(0)
    layers = [_Solve().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with GraphedLayers(layers, torch.zeros(4, 16, device=b.device, requires_grad=True),
                       mode=mode, layers_per_graph=1, backend=b) as stack:
        x = torch.randn(4, 16, device=b.device)
        _steps_as_eager(stack, eager, x)


class _NoOneDnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.backends.mkldnn.flags(enabled=False):
            y = self.conv(x.view(4, 4, 2, 2))
        return y.reshape(4, 16) + x


class _DoubleDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        was = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            d = x.device
            noise = torch.randn(4, 16, device=d)  # (float64: the default dtype when it runs)
            y = (self.lin(x).double() * torch.full((16,), 0.1, device=d)
                 + torch.arange(16, device=d) * 0.1 + noise)
        finally:
            torch.set_default_dtype(was)
        return y.float()


@pytest.mark.parametrize("layer", [_NoOneDnn, _DoubleDefault])
@pytest.mark.parametrize("mode", ["off", "resident"])
def test_layers_that_set_global_state_around_their_ops_train_as_eager(clean, layer, mode):
    """The cpu backend's graphs once replayed such ops under the state of the replay (a
    convolution through oneDNN, a factory op in float32)."""
    b = clean
    torch.manual_seed(0)
    layers = [layer().to(b.device), layer().to(b.device)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with GraphedLayers(layers, torch.zeros(4, 16, device=b.device, requires_grad=True), mode=mode,
                       layers_per_graph=1, backend=b) as stack:
        for step in range(2):
            torch.manual_seed(step)
            x = torch.randn(4, 16, device=b.device)
            xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            torch.manual_seed(10 + step)
            out = stack(xg)
            torch.manual_seed(10 + step)
            want = eager(xe)
            assert torch.equal(out, want)
            out.square().sum().backward()
            want.square().sum().backward()
            for a, e in zip([xg, *stack.parameters()], [xe, *eager.parameters()]):
                assert torch.equal(a.grad, e.grad)
        assert torch.get_default_dtype() == torch.float32 and torch.backends.mkldnn.enabled
