"""GraphedLayers used carelessly: forwards without a backward, close() in any order,
stacks dropped without close(), failed constructions, abandoned steps."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading
import time
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import graphslot
from graphslot import memory
from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import StateError, UsageError
from graphslot.offload import OffloadUnit
from graphslot.cli.toy import TinyGPT
from stacks import graphed, small_gpt

MODES = ["off", "resident", "remap"]
_BASE_THREADS = threading.active_count()


def small(b: graphslot.Backend, layers: int = 3) -> TinyGPT:
    return small_gpt(b, layers, seed=11)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resources(b: graphslot.Backend) -> tuple[int, int, int, int]:
    # The backend's side stream (a thread on cpu) is made once and kept for the backend's
    # life: no stack's to release, so it exists before anything is counted.
    side = b.side_stream()
    kept = 1 if isinstance(getattr(side, "_thread", None), threading.Thread) else 0
    gc.collect()
    for _ in range(100):  # threads of collected streams exit on their own, soon after
        if threading.active_count() <= _BASE_THREADS + kept:
            break
        time.sleep(0.02)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    return (b.ledger.mapped_bytes, len(b.ledger.reservations), threading.active_count(), fds)


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_forwards_without_a_backward_hold_nothing_after_them(clean, mode):
    b = clean
    model = small(b)
    with graphed(model, b, mode) as stack:
        eng = stack.engine
        for i in range(3):  # settle: host buffers for the training forwards exist
            model(*model.batch(i, b.device)).backward()
        eng.wait_idle()
        host0, pending0 = eng.host_bytes, len(eng.in_flight())
        pinned0, rss0 = memory.report(b).host_pinned_bytes, _rss()
        for i in range(1000 if mode == "resident" else 300):
            tokens, targets = model.batch(i, b.device)
            kind = i % 3
            if kind == 0:
                with torch.no_grad():
                    model(tokens, targets)
            elif kind == 1:
                model(tokens, targets)  # the output is dropped: no backward will come
            else:
                model(tokens, targets).backward()
        model(*model.batch(0, b.device)).backward()  # a forward reaps what was dropped
        eng.wait_idle()
        assert len(eng.in_flight()) == pending0 == 0
        assert eng.host_bytes <= host0 * 2, (eng.host_bytes, host0)
        assert all(not r.pending for r in stack._runners)
        assert memory.report(b).host_pinned_bytes <= max(2 * pinned0, pinned0 + (1 << 20))
        assert _rss() - rss0 < 64 << 20, (rss0, _rss())


@pytest.mark.parametrize("mode", MODES)
def test_close_is_idempotent_and_any_use_after_it_names_close(clean, mode):
    b = clean
    model = small(b)
    stack = graphed(model, b, mode)
    loss = model(*model.batch(0, b.device))  # in flight when close() comes
    stack.close()
    stack.close()
    with pytest.raises(StateError, match=r"close\(\)"):
        model(*model.batch(1, b.device))
    with pytest.raises(StateError, match=r"close\(\)"):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
def test_close_lets_the_graphs_go_while_the_stack_is_still_named(clean, mode):
    """Leaving the ``with`` block gives the graphs and their pool back although the stack
    lives on (its name, ``model.stack``); ``.grad``, which may be a pool buffer, keeps its
    gradients."""
    b = clean
    model = small(b)
    with graphed(model, b, mode) as stack:
        model(*model.batch(0, b.device)).backward()
        graphs = [weakref.ref(g) for r in stack._runners for g in (r.fwd, r.bwd) if g is not None]
        want = [p.grad.clone() for p in model.blocks.parameters()]
    gc.collect()
    assert graphs and all(g() is None for g in graphs)
    assert stack.pool_bytes is None and model.stack is stack
    churn = [torch.randn_like(w) for w in want for _ in range(2)]  # memory handed out again
    b.synchronize()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.blocks.parameters(), want))
    del churn


def _held_at_replay(graph) -> tuple[threading.Event, threading.Event, Any]:
    """Make ``graph``'s replays wait, once begun (``entered``), for ``release``; returns
    those events and the real replay."""
    entered, release = threading.Event(), threading.Event()
    real = graph.replay

    def held() -> None:
        entered.set()
        release.wait(10)
        real()

    graph.replay = held
    return entered, release, real


def test_close_waits_for_a_backward_under_way_in_another_thread(clean):
    b = clean
    model = small(b)
    stack = graphed(model, b, "resident")
    loss = model(*model.batch(0, b.device))
    entered, release, _ = _held_at_replay(stack._runners[1].bwd)
    errors: list[BaseException] = []

    def run_backward() -> None:
        try:
            loss.backward()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=run_backward)
    t.start()
    assert entered.wait(10)
    with pytest.raises(StateError, match="another thread"):
        stack.close(timeout=0.2)  # refuses while the replay is under way
    closer = threading.Thread(target=stack.close)
    closer.start()
    release.set()
    t.join(20)
    closer.join(20)
    assert not errors and not closer.is_alive()
    assert stack._closed


@pytest.mark.parametrize("mode", ["off", "resident"])
def test_a_second_thread_is_refused_while_the_first_replays(clean, mode):
    """The graphs share their buffers: a forward from another thread while one runs would
    mix the two (silently, before); it is refused by name, and the first is eager's."""
    b = clean
    model = small(b)
    eager = copy.deepcopy(model)
    stack = graphed(model, b, mode)
    entered, release, real = _held_at_replay(stack._runners[1].fwd)
    got: list = []
    batch = model.batch(0, b.device)
    t = threading.Thread(target=lambda: got.append(model(*batch)))
    t.start()
    assert entered.wait(10)
    with pytest.raises(StateError, match="called from a second thread while another thread runs"):
        model(*model.batch(1, b.device))
    release.set()
    t.join(20)
    stack._runners[1].fwd.replay = real  # type: ignore[method-assign]
    got[0].backward()
    eager(*batch).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
    t0 = time.perf_counter()
    stack.close(timeout=10)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("change", ["forward hook added", "backward hook added", "hook removed"])
def test_a_module_hook_changed_after_the_build_is_refused_before_anything_runs(clean, change):
    """The graphs run the hooks they captured: one added or removed since would be
    silently skipped or still applied."""
    from graphslot.errors import CaptureMismatchError

    b = clean
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8).to(b.device) for _ in range(3)]
    before = layers[1].register_forward_hook(lambda m, i, o: o * 2) if change == "hook removed" else None
    with pytest.warns(UserWarning) if before is not None else contextlib.nullcontext():
        stack = GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True),
                              mode="resident", backend=b)
    with stack:
        stack(torch.randn(4, 8, device=b.device)).sum().backward()
        handle = (before if change == "hook removed" else
                  layers[1].register_forward_hook(lambda m, i, o: o * 2) if change == "forward hook added" else
                  layers[2].register_full_backward_hook(lambda m, gi, go: gi))
        try:
            if change == "hook removed":
                handle.remove()
            with pytest.raises(CaptureMismatchError, match="module hook was added to or removed"):
                stack(torch.randn(4, 8, device=b.device))
            with torch.no_grad():  # (another shape without a backward runs eagerly, hooks and all)
                stack(torch.randn(3, 8, device=b.device))
        finally:
            handle.remove()
        if change != "hook removed":  # (as built again: the graphs' hooks are the layers' again)
            stack(torch.randn(4, 8, device=b.device)).sum().backward()


def test_hooks_a_build_drops_itself_or_global_ones_a_profiler_adds_are_not_refused(clean):
    """A lazy module removes its own initialising hook in its first forward, which the
    build runs; a global module hook (a FLOP counter's, a tracker's) is the profiler's."""
    b = clean
    layers = [nn.Sequential(nn.LazyLinear(8), nn.Tanh()).to(b.device) for _ in range(2)]
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True),
                       mode="off", backend=b) as stack:
        stack(torch.randn(4, 8, device=b.device)).sum().backward()
        seen: list = []
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(m))
        try:
            stack(torch.randn(4, 8, device=b.device)).sum().backward()
        finally:
            handle.remove()


@pytest.mark.parametrize("transform", ["grad", "grad of the input", "vmap"])
def test_torch_func_transforms_are_refused_by_name_and_training_goes_on(clean, transform):
    b = clean
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8).to(b.device) for _ in range(2)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with GraphedLayers(layers, torch.zeros(4, 8, device=b.device, requires_grad=True),
                       mode="resident", backend=b) as stack:
        x = torch.randn(4, 8, device=b.device)
        params = dict(stack.named_parameters())
        run = {"grad": lambda: torch.func.grad(lambda p: torch.func.functional_call(stack, p, (x,)).sum())(params),
               "grad of the input": lambda: torch.func.grad(lambda x: stack(x).sum())(x),
               "vmap": lambda: torch.func.vmap(stack)(x.expand(3, 4, 8))}[transform]
        with pytest.raises(UsageError, match="cannot run under torch.func transforms"):
            run()
        xe = x.clone().requires_grad_()
        xg = x.clone().requires_grad_()
        # (.square(): a plain .sum() hands back an expanded gradient, which eager's matrix
        # product reads as such and a graph reads from its own buffer: the last bit may differ)
        stack(xg).square().sum().backward()
        eager(xe).square().sum().backward()
        assert torch.equal(xg.grad, xe.grad)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(stack.parameters(), eager.parameters()))


def test_an_interrupt_as_a_replay_ends_leaves_close_free(clean, monkeypatch):
    """Ctrl-C landing as a forward or a backward replay ends (where a Python call begins,
    before the call can act) leaves no replay counted as under way: close() is prompt."""
    b = clean
    model = small(b)
    stack = graphed(model, b, "resident")

    def interrupted(self: GraphedLayers) -> None:
        raise KeyboardInterrupt

    loss = model(*model.batch(0, b.device))
    with monkeypatch.context() as m:
        m.setattr(GraphedLayers, "_left", interrupted)
        with pytest.raises(KeyboardInterrupt):
            model(*model.batch(1, b.device))
        with pytest.raises(KeyboardInterrupt):
            loss.backward()
    assert not stack._inside
    t0 = time.perf_counter()
    stack.close(timeout=10)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("mode", MODES)
def test_stacks_dropped_without_close_release_everything(clean, mode):
    b = clean
    model = small(b, 2)
    before, rss0 = resources(b), _rss()
    for _ in range(60 if mode == "resident" else 10):
        stack = graphed(model, b, mode)
        model(*model.batch(0, b.device)).backward()
        model.stack = nn.Sequential(*model.blocks)
        del stack
    after = resources(b)
    assert after[:3] == before[:3], (before, after)
    assert after[3] <= before[3] + 2, (before, after)
    assert _rss() - rss0 < 128 << 20, (rss0, _rss())


@pytest.mark.parametrize("mode", MODES)
def test_stacks_built_one_after_another_leave_no_device_memory_behind(clean, mode):
    """Libraries keep state per stream for the process's life (cuBLAS a workspace of
    tens of MiB per stream and thread): stacks warm up on the backend's one side stream,
    so building and closing another stack leaves the allocator holding no more."""
    b = clean
    if b.allocator_stats()["reserved_bytes"] is None:
        pytest.skip(f"the {b.name} backend's allocator keeps no figure to compare")
    model = small(b, 2)

    def build_train_close() -> int:
        with graphed(model, b, mode):
            model(*model.batch(0, b.device)).backward()
        model.stack = nn.Sequential(*model.blocks)
        model.zero_grad(set_to_none=True)
        memory.release_unused(b)
        return b.allocator_stats()["reserved_bytes"]

    build_train_close()  # what the first capture of the process sets up once
    held = build_train_close()
    assert [build_train_close() for _ in range(2)] == [held, held]


class _SavesItsOutput(nn.Module):
    """exp saves its own result for backward, as SDPA does: a saved-tensor hook that
    returned that tensor would tie the node to itself through C++, beyond gc's reach."""

    WIDE = 37  # a width no other tensor of the test has

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, self.WIDE)
        self.down = nn.Linear(self.WIDE, width)

    def forward(self, x):
        return self.down(torch.exp(self.up(x) * 0.01))


def _orphaned_autograd_tensors() -> int:
    """Tensors of some capture's autograd graph that nothing but that graph keeps alive.

    A backend graph may hold the tensors it recorded (the cpu backend's graphs do), so a
    tensor referenced from a live graph object's own lists is not counted.
    """
    gc.collect()
    n = 0
    for o in gc.get_objects():
        if not (isinstance(o, torch.Tensor) and o.grad_fn is not None and o.dim()
                and o.shape[-1] == _SavesItsOutput.WIDE):
            continue
        holders = [r for r in gc.get_referrers(o) if isinstance(r, (list, dict, tuple))]
        if not any(isinstance(g, graphslot.DeviceGraph) or
                   any(isinstance(h, graphslot.DeviceGraph) for h in gc.get_referrers(g))
                   for r in holders for g in [r, *gc.get_referrers(r)]):
            n += 1
    return n


@pytest.mark.parametrize("mode", MODES)
def test_a_built_stack_keeps_no_tensor_its_captures_saved(clean, mode):
    b = clean
    torch.manual_seed(3)
    layers = [_SavesItsOutput(16).to(b.device) for _ in range(2)]
    x = torch.randn(4, 16, device=b.device, requires_grad=True)
    stack = GraphedLayers(layers, x, mode=mode, backend=b)
    # Only the graphs' own memory holds activations now: no tensor of discovery's or the
    # captures' autograd graphs outlives them, so their pools are free for what follows.
    assert _orphaned_autograd_tensors() == 0
    stack(x).sum().backward()
    stack.close()
    del stack
    assert _orphaned_autograd_tensors() == 0


class _ReturnsTuple(nn.Module):
    def forward(self, x):
        return x, x


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_construction_releases_what_it_made(clean, mode):
    b = clean
    model = small(b, 2)
    before = resources(b)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach().requires_grad_()
    for _ in range(30 if mode == "resident" else 8):
        with pytest.raises(UsageError, match="one tensor"):
            GraphedLayers([*model.blocks, _ReturnsTuple()], sample, mode=mode, backend=b)
    after = resources(b)
    assert after[:3] == before[:3], (before, after)


@pytest.mark.parametrize("layers", [[0.5], [True], ["1"], [7], torch.tensor([True, False])])
def test_offload_layers_must_be_layer_indices(clean, layers):
    b = clean
    model = small(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    with pytest.raises(UsageError, match="not layer indices"):
        GraphedLayers(list(model.blocks), sample, mode="resident", backend=b, offload_layers=layers)


@pytest.mark.parametrize("layers", [1, "01", torch.tensor(1), pytest.param("np0d", id="numpy-0d")])
def test_offload_layers_must_be_a_collection(clean, layers):
    b = clean
    model = small(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    if layers == "np0d":
        layers = pytest.importorskip("numpy").array(1)
    with pytest.raises(UsageError, match="offload_layers must be a collection of layer indices"):
        GraphedLayers(list(model.blocks), sample, mode="resident", backend=b, offload_layers=layers)


def test_layer_indices_of_numpy_and_torch_integers_are_layer_indices(clean):
    np = pytest.importorskip("numpy")
    b = clean
    model = small(b, 3)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    for layers in (np.array([0, 2]), torch.tensor([0, 2]), [np.int64(0), 2]):
        with GraphedLayers(list(model.blocks), sample, mode="resident", backend=b,
                           offload_layers=layers, recompute_layers=np.array([1]),
                           min_offload_bytes=np.int64(0), section_bytes=np.int32(1 << 20)) as stack:
            assert stack.offload_layers == {0, 2} and stack.recompute_layers == {1}
            assert stack.engine.section_bytes == 1 << 20 and type(stack.engine.section_bytes) is int


@pytest.mark.parametrize("kw", [dict(min_offload_bytes="1MiB"), dict(min_offload_bytes=-1),
                                dict(section_bytes=0), dict(section_bytes=2.5)])
def test_byte_counts_must_be_integers(clean, kw):
    b = clean
    model = small(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    with pytest.raises(UsageError, match=f"{next(iter(kw))} must be an integer of bytes"):
        GraphedLayers(list(model.blocks), sample, mode="resident", backend=b, **kw)


@pytest.mark.parametrize("warmups", [-1, 1.5, "2", True])
def test_warmup_iterations_must_be_a_count(clean, warmups):
    b = clean
    model = small(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    with pytest.raises(UsageError, match=f"warmup_iters must be an integer, at least 0, got {warmups!r}"):
        GraphedLayers(list(model.blocks), sample, backend=b, warmup_iters=warmups)
    with GraphedLayers(list(model.blocks), sample, backend=b, warmup_iters=torch.tensor(0)) as stack:
        assert stack.warmup_iters == 1


def test_mode_off_refuses_layers_to_offload(clean):
    b = clean
    model = small(b, 2)
    sample = model.hidden_in(model.batch(0, b.device)[0]).detach()
    with pytest.raises(UsageError, match="mode='off' offloads nothing.*\\[0, 1\\]"):
        GraphedLayers(list(model.blocks), sample, mode="off", backend=b, offload_layers=[0, 1])
    with GraphedLayers(list(model.blocks), sample, mode="off", backend=b, offload_layers=[]) as stack:
        assert not stack.engine.offloads


def train(model: TinyGPT, b: graphslot.Backend, steps: int, interrupt_at: int | None = None) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        if step == interrupt_at:
            # An abandoned step: a forward, then an error before its backward.
            try:
                model(*model.batch(999, b.device))
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                pass
            opt.zero_grad(set_to_none=True)
        loss = model(*model.batch(step, b.device))
        loss.backward()
        out.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["resident", "remap", "off"])
def test_an_abandoned_step_leaves_the_stack_usable(clean, mode):
    b = clean
    base = small(b)
    want = train(copy.deepcopy(base), b, 4)
    model = copy.deepcopy(base)
    with graphed(model, b, mode) as stack:
        got = train(model, b, 4, interrupt_at=2)
        assert stack.engine.in_flight() == []
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), i


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_only_a_forward_left_without_backward_is_given_back_at_the_next_forward(clean, mode, monkeypatch):
    """The next forward reaps microbatches whose autograd graph died; one whose backward
    ran on every layer holds nothing and costs no unit call, one dropped after its forward
    is abandoned on every layer and its slots are free again."""
    b = clean
    model = small(b, 3)
    with graphed(model, b, mode) as stack:
        calls: list[int] = []
        orig = OffloadUnit.abandon

        def abandon(unit: OffloadUnit, mb: int) -> None:
            calls.append(mb)
            orig(unit, mb)

        monkeypatch.setattr(OffloadUnit, "abandon", abandon)
        x, y = model.batch(0, b.device)
        for _ in range(2):  # whole steps: the second forward finds the first's graph dead
            model(x, y).backward()
            gc.collect()
        assert calls == []
        model(x, y)  # dropped without a backward
        gc.collect()
        model(x, y).backward()
        dropped = stack._microbatch - 1
        assert calls == [dropped] * len(stack._runners)
        assert stack.engine.in_flight() == []


def test_backward_twice_says_so(clean):
    b = clean
    model = small(b, 2)
    with graphed(model, b, "resident"):
        loss = model(*model.batch(0, b.device))
        loss.backward(retain_graph=True)
        with pytest.raises(StateError, match="ran backward already"):
            loss.backward()


def test_a_parameter_the_forward_changes_in_place_during_the_build_is_named(clean):
    """nn.Embedding(max_norm=...) renormalises the rows it reads: the build's forwards on
    its sample change the weight, which eager training would not have done. Buffers are
    put back; a weight is named, with the way out."""
    b = clean

    class Renormed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 8, max_norm=1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.emb((x.abs() * 10).long().clamp(0, 31)).mean(1)

    torch.manual_seed(0)
    layers = [Renormed().to(b.device), nn.Linear(8, 8).to(b.device)]
    with pytest.warns(UserWarning, match=r"changed parameter 0\.emb\.weight in place .*load_state_dict"):
        GraphedLayers(layers, torch.randn(4, 8, device=b.device, requires_grad=True), backend=b).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing changed: nothing said)
        GraphedLayers([nn.Linear(8, 8).to(b.device) for _ in range(2)],
                      torch.randn(4, 8, device=b.device, requires_grad=True), backend=b).close()
