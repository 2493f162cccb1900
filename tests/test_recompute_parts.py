"""Layers recomputed part by part inside the graphs (``recompute_ops="parts"``): each
child of a layer runs under a checkpoint of its own, the forward saves what each part is
given, the backward holds one part's activations at a time, and training is bit for bit
eager's; the planner offers it where a layer's profile has its figures."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random

import pytest
import torch
from torch import nn

from graphslot import budget as gb
from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import UsageError
from graphslot.memory import run_counting_saved, saved_bytes_by_part
from graphslot.profile import profile_units
from graphslot.recompute import checkpointing_parts, noting_draws, recompute_parts
from stacks import graphed, small_gpt
from test_budget import llama_like, random_profile, search_ratios
from test_budget_stack import fake_profile
from test_graphed_grads import assert_bitwise, run

GiB, MiB = 1 << 30, 1 << 20


class Decoder(nn.Module):
    """A pre-norm block of four parts: norm, mixer, norm, MLP."""

    def __init__(self, n: int = 16, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(n), nn.LayerNorm(n)
        self.mix = nn.Sequential(nn.Linear(n, n), nn.Tanh())
        self.mlp = nn.Sequential(nn.Linear(n, 4 * n), nn.GELU(), nn.Linear(4 * n, n))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.n1(x))
        x = x + self.mlp(self.n2(x))
        return x if self.extra is None else self.extra(x)


def judge(m: nn.Module, *args: torch.Tensor) -> list[str]:
    """The eager check that judges which of ``m``'s parts are cheap (in the modes they
    are in); returns what it names as changed in place."""
    changed: list[str] = []
    with checkpointing_parts(recompute_parts(m), changed):
        m(*args)
    return changed


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_layers_parts_are_the_children_of_its_first_module_with_several():
    d = Decoder()
    assert recompute_parts(d) == [d.n1, d.n2, d.mix, d.mlp]
    assert recompute_parts(Wrapper(Wrapper(d))) == [d.n1, d.n2, d.mix, d.mlp]  # (wrappers gone through)
    assert recompute_parts(nn.Linear(2, 2)) == []
    assert recompute_parts(Wrapper(nn.Linear(2, 2))) == []
    # a list of modules is never called: the modules in it are the parts
    held = nn.Module()
    held.norm, held.blocks = nn.LayerNorm(2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert recompute_parts(held) == [held.norm, *held.blocks]
    only = nn.Module()
    only.blocks = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Tanh()})
    assert recompute_parts(Wrapper(only)) == list(only.blocks.values())


def test_parts_run_under_checkpoints_only_within_and_save_their_inputs():
    torch.manual_seed(0)
    d = Decoder()
    own = d.mlp.forward = d.mlp.forward  # (an instance attribute of its own stays)
    x = torch.randn(4, 16, requires_grad=True)
    whole = run_counting_saved(lambda: d(x), "cpu", [d])[1]
    # (until an eager check judged the parts, each saves what it is given: the norms'
    # inputs and outputs)
    with checkpointing_parts(recompute_parts(d)):
        unjudged = run_counting_saved(lambda: d(x), "cpu", [d])[1]
    assert unjudged == 4 * x.numel() * x.element_size()
    assert judge(d, x) == []
    with checkpointing_parts(recompute_parts(d)):
        parts = run_counting_saved(lambda: d(x), "cpu", [d])[1]
        y = d(x)
    # (each norm's input, once: the mixer and the MLP make the norms' outputs again)
    assert parts == 2 * x.numel() * x.element_size() < whole
    assert "forward" not in d.n1.__dict__ and d.mlp.__dict__["forward"] is own
    y.square().sum().backward()
    got = [p.grad.clone() for p in d.parameters()]
    d.zero_grad()
    d(x).square().sum().backward()
    assert_bitwise(got, [p.grad for p in d.parameters()])
    # what each part saves while it runs (its own activations, the input among them)
    by_part = saved_bytes_by_part(lambda: d(x), "cpu", [d], recompute_parts(d))
    assert by_part[3] == max(by_part) and sum(by_part) <= whole


class Parallel(nn.Module):
    """One norm read by two parts and by the block itself, a cheap part after a cheap
    part (norm, then an activation), and a norm output changed in place before a part
    reads it."""

    def __init__(self, n: int = 16, scale_in_place: bool = False) -> None:
        super().__init__()
        self.n1, self.act, self.n2 = nn.LayerNorm(n), nn.Tanh(), nn.LayerNorm(n)
        self.attn, self.mlp, self.out = nn.Linear(n, n), nn.Linear(n, n), nn.Linear(n, n)
        self.scale_in_place = scale_in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        x = x + self.attn(h) + self.mlp(h) + h  # (h: two parts and the block read it)
        g = self.n2(x)
        if self.scale_in_place:
            g.mul_(0.5)  # (then g is no longer what n2 made: out gets it as it is)
        return x + self.out(self.act(g))


@pytest.mark.parametrize("scale_in_place", [False, True], ids=["as-made", "changed-in-place"])
def test_a_cheap_parts_output_is_made_again_and_gradients_sum_as_eager(scale_in_place):
    """A later part keeps a cheap part's inputs, not its output, and its recompute makes
    the output again; gradients still flow through the output the forward made, so a
    norm read by two parts and by the block sums them as eager does, bit for bit. An
    output changed in place before a part reads it is kept as it is."""
    torch.manual_seed(0)
    d = Parallel(scale_in_place=scale_in_place)
    x = torch.randn(8, 16, requires_grad=True)
    act = x.numel() * x.element_size()
    judge(d, x)
    with checkpointing_parts(recompute_parts(d)):
        saved = run_counting_saved(lambda: d(x), "cpu", [d])[1]
        d(x).square().sum().backward()
    got = [t.grad.clone() for t in (x, *d.parameters())]
    x.grad = None
    d.zero_grad()
    d(x).square().sum().backward()
    assert_bitwise(got, [t.grad for t in (x, *d.parameters())])
    # as made: the norms' inputs (x, and the block's sum); the activation's output is made
    # from n2's, made from the sum. Changed in place: act keeps g as it is (out makes
    # act's output again from it).
    assert saved == (3 if scale_in_place else 2) * act, saved / act


def _grads_with_parts(m: nn.Module, x: torch.Tensor, parts: bool, ctx=None) -> list:
    """Every gradient (the input's first) of one forward and backward of ``m``, its parts
    checkpointed or not, under ``ctx`` (autocast, say)."""
    x.grad = None
    m.zero_grad(set_to_none=True)
    with (ctx if ctx is not None else contextlib.nullcontext()):
        if parts:
            judge(m, x)
            with checkpointing_parts(recompute_parts(m)):
                y = m(x)
        else:
            y = m(x)
    y.float().square().sum().backward()
    return [t.grad.clone() for t in (x, *m.parameters()) if t.grad is not None]


class _PReLUThenLinear(nn.Module):
    """A cheap part run under the caller's autocast, the next part with autocast off
    (bfloat16 input and linear; the activation's weight in float32)."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.act, self.lin = nn.PReLU(), nn.Linear(n, n).bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(x)
        with torch.autocast("cpu", enabled=False):
            return x + self.lin(h)


@pytest.mark.parametrize("case", ["same-tensor-thrice", "autocast-changed"])
def test_a_made_again_output_is_what_the_part_read(case):
    """A part given one norm output three times (attention's query, key and value: it
    takes another path for one object than for three) gets one object again in its
    recompute; an output made under another autocast than the part reading it runs
    under is not made again. Either way the gradients are eager's, bit for bit."""
    torch.manual_seed(0)
    if case == "same-tensor-thrice":
        m = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, norm_first=True, batch_first=True)
        x, ctx = torch.randn(2, 5, 16, requires_grad=True), None
    else:
        m = _PReLUThenLinear()
        x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    assert_bitwise(_grads_with_parts(m, x, True, ctx), _grads_with_parts(m, x, False, ctx))


def test_parts_that_change_a_made_again_input_in_place_are_named_and_inference_runs():
    """A part that changes in place the norm output it was given is named (its recompute
    would change the output made again); a forward under inference_mode keeps nothing to
    make again and runs."""
    m = nn.Sequential(nn.LayerNorm(16), nn.ReLU(inplace=True), nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    assert judge(m, x) == ["ReLU"]
    # (the ReLU keeps the norm output it changes as given: torch's own check names it)
    with checkpointing_parts(recompute_parts(m)):
        y = m(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with torch.inference_mode(), checkpointing_parts(recompute_parts(m)):
        y = m(x)
    torch.testing.assert_close(y, m(x), rtol=0, atol=0)


class _Noise(nn.Module):
    """Cheap in eval (no draws), drawing in training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x) * 0.1 if self.training else x * 1.0


class _Shift(nn.Module):
    """A cheap part whose own backward saves nothing."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(n))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2.0 + self.b


class _ChunkWrite(nn.Module):
    """Changes the cheap part's input after it ran, through a chunk that shares no
    version counter with it (a GRU cell's gates)."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.shift, self.lin = _Shift(n), nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        h = self.shift(x)
        x.unsafe_chunk(2, 0)[0].sigmoid_()
        return self.lin(h) + x


class _Center(nn.Module):
    """A cheap part with a reduction, whose own backward saves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x - x.mean(-1, keepdim=True)


class _Strided(nn.Module):
    """The cheap part given a transposed input: its mean adds in the layout's order."""

    def __init__(self) -> None:
        super().__init__()
        self.shift, self.lin = _Center(), nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.shift(x.transpose(0, 1)))


def _grads(m: nn.Module, x: torch.Tensor, parts: bool, ctx=None, seed: int = 1) -> list[torch.Tensor]:
    x.grad = None
    m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with (ctx if ctx is not None else contextlib.nullcontext()), \
            (checkpointing_parts(recompute_parts(m)) if parts else contextlib.nullcontext()):
        y = m(x)
    y.square().sum().backward()
    return [t.grad.clone() for t in (x, *m.parameters()) if t.grad is not None]


def test_a_verdict_holds_for_the_modes_it_was_judged_in():
    """A part judged cheap in eval (it draws nothing there) is not made again in
    training, where it draws: its output is kept until a check in training judges it."""
    torch.manual_seed(0)
    m = nn.Sequential(_Noise(), nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    m.eval()
    judge(m, x)
    m.train()
    assert_bitwise(_grads(m, x, True), _grads(m, x, False))
    judge(m, x)  # (in training: it draws, so it is not cheap)
    assert_bitwise(_grads(m, x, True), _grads(m, x, False))
    m.eval()  # (the eval verdict was replaced: nothing to make again, still eager's bits)
    assert_bitwise(_grads(m, x, True), _grads(m, x, False))


def test_a_part_whose_input_changes_unseen_by_its_version_is_not_made_again():
    """The eager check reads the cheap part's input back at its end: changed through a
    view that shares no version counter, the part's output is kept, not made again."""
    torch.manual_seed(0)
    m = _ChunkWrite()
    x = torch.randn(8, 16, requires_grad=True)
    judge(m, x)
    m.shift.calls = 0
    assert_bitwise(_grads(m, x, True), _grads(m, x, False))
    assert m.shift.calls == 2  # (the two forwards: never again in a backward)


class _UnseenChange(nn.Module):
    """A cheap part whose output (``out``), or whose input with its values moved around
    (``flip``: every value kept, its sum too), changes through a view that shares no
    version counter after it ran."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what, self.norm, self.lin = what, _Center(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        h = self.norm(x)
        if self.what == "out":
            h.unsafe_chunk(2, 0)[0].sigmoid_()
        else:
            c = x.unsafe_chunk(2, 0)[0]
            c.copy_(c.flip(-1))
        return self.lin(h) + x


@pytest.mark.parametrize("what", ["out", "flip"])
def test_a_cheap_parts_output_or_input_changed_unseen_is_kept(what):
    torch.manual_seed(0)
    m = _UnseenChange(what)
    x = torch.randn(8, 16, requires_grad=True)
    assert judge(m, x) == []
    assert_bitwise(_grads(m, x, True), _grads(m, x, False))


def test_a_part_two_layers_share_is_made_again_only_where_both_allow():
    """The norm is shared by a layer that changes its input unseen and one that does not:
    judged in either order, the first layer keeps the norm's output."""
    torch.manual_seed(0)
    norm, lin = _Center(), nn.Linear(16, 16)
    plain = nn.Sequential(norm, lin)
    changing = _UnseenChange("flip")
    changing.norm, changing.lin = norm, lin
    x = torch.randn(8, 16, requires_grad=True)
    judge(changing, x)
    judge(plain, x)
    assert_bitwise(_grads(changing, x, True), _grads(changing, x, False))


def test_a_verdict_takes_the_modes_a_part_ran_in():
    """Modes switched before the judging context ends: the verdict is the eval one."""
    torch.manual_seed(0)
    m = nn.Sequential(_Noise(), nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    m.eval()
    with checkpointing_parts(recompute_parts(m), []):
        m(x)
        m.train()
    assert_bitwise(_grads(m, x, True), _grads(m, x, False))


def test_a_made_again_output_is_made_from_its_inputs_laid_out_as_given():
    """Under a saved-tensor hook that gives a transposed input back contiguous
    (``save_on_cpu``), the cheap part is made again from it laid out as the forward had
    it, so a reduction over its output adds in the forward's order: eager's bits."""
    torch.manual_seed(0)
    m = _Strided()
    x = torch.randn(512, 256, requires_grad=True)
    hook = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=True)
    with hook():
        judge(m, x)
    m.shift.calls = 0
    got = _grads(m, x, True, hook())
    assert m.shift.calls == 2  # (the forward, and once made again in the backward)
    assert_bitwise(got, _grads(m, x, False, hook()))
    # a few rows at the end of a large input: laid out again in as many elements
    m, big = nn.Sequential(_Center(), nn.Linear(16, 16)), torch.randn(100_000, 16, requires_grad=True)

    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.m(t[-4:])

    tail = Tail()
    made: list[int] = []
    real = torch.Tensor.new_empty

    def counting(self, *size, **kw):  # (what _laid_out allocates, in elements)
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        made.append(torch.Size(shape).numel())
        return real(self, *size, **kw)

    with hook():
        assert judge(tail, big) == []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "new_empty", counting)
        got = _grads(tail, big, True, hook())
    assert max(made, default=0) <= 64, made  # (none here: the rows keep their alignment)
    assert_bitwise(got, _grads(tail, big, False, hook()))


@pytest.mark.parametrize("share", [False, True], ids=["pool", "shared-pages"])
@pytest.mark.parametrize("mode", ["off", "resident", "remap"])
def test_an_activation_between_two_products_is_made_again_alike_in_discovery_and_capture(
        clean, mode, share):
    """Linear, GELU, Linear, LayerNorm by parts: the second product keeps the GELU's input,
    an intermediate that an offload hook lets go once saved (a capture into shared pages
    let it go, the discovery kept it); the capture saves what the discovery saved, and
    the stack trains as eager, bit for bit."""
    b = clean
    if share and not b.capabilities.region_graphs:
        pytest.skip(f"the {b.name} backend's graphs do not draw their pool from a region")
    torch.manual_seed(3)
    base = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32),
                          nn.LayerNorm(32)).to(b.device) for _ in range(3)]
    xs = [torch.randn(8, 32, device=b.device) for _ in range(2)]
    eager, mine = copy.deepcopy(base), copy.deepcopy(base)
    kw = {} if mode == "off" else {"offload_layers": [0, 1]}
    with GraphedLayers(mine, xs[0].clone().requires_grad_(), backend=b, mode=mode,
                       recompute_layers=[0, 1, 2], recompute_ops="parts",
                       share_pool_pages=share, **kw) as stack:
        assert stack.parts_layers == {0, 1, 2}
        for f in (nn.Sequential(*eager), stack):
            for x in xs:
                f(x.clone().requires_grad_()).square().sum().backward()
        assert_bitwise([p.grad for m in mine for p in m.parameters()],
                       [p.grad for m in eager for p in m.parameters()])


def test_drawing_ops_are_noted():
    with noting_draws() as drawn:
        nn.Dropout(0.5)(torch.ones(4))
        torch.ones(4) * 2
    assert drawn == ["aten.bernoulli_"]
    with noting_draws() as drawn:
        nn.Dropout(0.5).eval()(torch.ones(4))
    assert drawn == []


@pytest.mark.parametrize("mode", ["off", "resident", "remap"])
def test_parts_recompute_trains_as_eager_bitwise(clean, mode):
    """Layers 1 and 2 recomputed by parts (layer 2's parts' inputs to the host where the
    mode offloads), beside an offloaded, a kept and a wholly recomputed layer."""
    b = clean
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 3, 2, False)
    model = copy.deepcopy(base)
    offload = [0, 2] if mode != "off" else []
    with graphed(model, b, mode, offload_layers=offload, recompute_layers=[1, 2],
                 recompute_ops="parts") as stack:
        assert stack.parts_layers == {1, 2} and stack.recompute_layers == {1, 2}
        assert [r.recompute for r in stack._runners] == [False] * 4  # (no whole checkpoint)
        assert [bool(r.parts) for r in stack._runners] == [False, True, True, False]
        assert [r.unit.offloads for r in stack._runners] == [mode != "off", False, mode != "off", False]
        assert_bitwise(run(model, b, 3, 2, False), want)


@pytest.mark.parametrize("per_graph", [1, None], ids=["graph-per-layer", "joined"])
def test_parts_recompute_trains_as_eager_with_microbatches_in_flight(clean, per_graph):
    b = clean
    base = small_gpt(b, 4)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    with graphed(model, b, "remap", offload_layers=[0, 1], recompute_layers=[0, 1, 3],
                 recompute_ops="parts", layers_per_graph=per_graph) as stack:
        if per_graph is None:  # (parts layers share a graph only with parts layers)
            assert stack.graph_layers[-2:] == ((2,), (3,))
        for m in (eager, model):
            losses = [m(*m.batch(k, b.device)) for k in range(3)]
            for loss in reversed(losses):
                loss.backward()
        assert_bitwise([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()])


def test_parts_keep_less_than_keeping_and_more_than_a_whole_recompute(clean):
    """What the backward graph reads of the forward's memory: the parts' inputs (and what
    the ops between the parts save: attention's, here) for parts; the input alone whole."""
    b = clean
    kept = {}
    for name, kw in (("keep", {}), ("all", {"recompute_layers": [0, 1, 2]}),
                     ("parts", {"recompute_layers": [0, 1, 2], "recompute_ops": "parts"})):
        model = small_gpt(b, 3)
        with graphed(model, b, "off", **kw) as stack:
            kept[name] = [g.kept_bytes for g in stack.engine.groups]
            model(*model.batch(0, b.device)).backward()
    for k in range(3):
        assert kept["all"][k] < kept["parts"][k] < kept["keep"][k], kept


@pytest.mark.parametrize("layer,match", [
    (lambda: Decoder(extra=nn.Dropout(0.2)), "draws random numbers"),
    (lambda: Decoder(extra=nn.BatchNorm1d(16)), "changes its buffers"),
    (lambda: nn.Linear(16, 16), "has no parts"),
])
def test_a_layer_parts_cannot_recompute_is_refused_by_name(clean, layer, match):
    b = clean
    layers = [layer().to(b.device) for _ in range(2)]
    with pytest.raises(UsageError, match=match):
        GraphedLayers(layers, torch.randn(4, 16, device=b.device, requires_grad=True), backend=b,
                      mode="off", recompute_layers=[1], recompute_ops="parts")


def test_the_profile_offers_parts_where_a_layer_has_them_and_may_run_them_again(clean):
    b = clean
    torch.manual_seed(0)
    layers = [Decoder(64), nn.Linear(64, 64), Decoder(64, extra=nn.Dropout(0.1)),
              Decoder(64, extra=nn.BatchNorm1d(64))]
    costs = profile_units(b, [m.to(b.device) for m in layers],
                          torch.randn(32, 64, device=b.device, requires_grad=True))
    d = costs[0]
    assert d.parts and d.parts_saved_bytes < d.saved_bytes
    assert d.parts_saved_bytes == 2 * 32 * 64 * 4  # (each norm's input; their outputs made again)
    assert d.parts_work_bytes > 0 and d.parts_recompute_ms >= 0
    assert [c.parts for c in costs] == [True, False, False, False]


def parts_profile(rng: random.Random, n: int) -> gb.StackProfile:
    base = random_profile(rng, n)
    return dataclasses.replace(base, layers=tuple(
        dataclasses.replace(c, parts_saved_bytes=rng.randint(0, c.saved_bytes // 2),
                            parts_work_bytes=rng.randint(0, c.saved_bytes + c.work_bytes),
                            parts_recompute_ms=c.forward_ms * rng.uniform(0.9, 1.2))
        if rng.random() < 0.7 else c for c in base.layers))


def test_the_model_counts_one_parts_activations_and_sends_the_parts_inputs_out():
    layer = dataclasses.replace(llama_like(1).layers[0], parts_saved_bytes=256 * MiB,
                                parts_work_bytes=1200 * MiB, parts_recompute_ms=6.5)
    p = gb.StackProfile((layer,) * 2, 55.0, 55.0, fixed_bytes=7 * GiB)
    P, R, K = gb.RECOMPUTE_PARTS, gb.RECOMPUTE, gb.KEEP
    # off: the parts' inputs stay in the pool; a mode that offloads puts them in slots
    assert gb.slot_bytes(p, (P, K), "off") == [0, 0]
    assert gb.slot_bytes(p, (P, R), "remap") == [256 * MiB, 64 * MiB]
    # the pool at the bottom layer's backward: both layers' parts' inputs and one part's
    # activations again, against every activation again beside the working memory
    assert (gb.predict_peak_bytes(p, (P, P), "off") - gb.predict_peak_bytes(p, (R, R), "off")
            == (2 * 256 + 1200) * MiB - (layer.saved_bytes + layer.work_bytes))
    assert gb.predict_step_ms(p, (P, K), "off") == pytest.approx(
        gb.predict_step_ms(p, (K, K), "off") + 6.5)
    with pytest.raises(UsageError, match="without parts_saved_bytes"):
        gb.predict_peak_bytes(llama_like(2), (P, K), "off")
    with pytest.raises(UsageError, match="go together"):
        gb.LayerCost(1.0, 2.0, GiB, parts_saved_bytes=MiB)


def test_the_search_offers_parts_and_matches_the_exhaustive_one():
    rng = random.Random(11)
    ratios = []
    for _ in range(8):
        p = parts_profile(rng, rng.randint(2, 4))
        ratios += search_ratios(p, brute_force_parts)
    assert max(ratios) <= 1.06


def brute_force_parts(p: gb.StackProfile, limit: int) -> tuple[float, int]:
    import itertools
    best = (float("inf"), 0)
    opts = [gb.CHOICES + ((gb.RECOMPUTE_PARTS,) if c.parts else ()) for c in p.layers]
    for ch in itertools.product(*opts):
        for mode in (("resident", "remap") if gb.OFFLOAD in ch else ("off", "resident", "remap")):
            peak = gb.predict_peak_bytes(p, ch, mode)
            if peak <= limit:
                best = min(best, (gb.predict_step_ms(p, ch, mode), peak))
    return best


def test_a_plan_reports_parts_as_recompute_with_its_ops():
    choices, ops = gb.costs.reported((gb.KEEP, gb.RECOMPUTE_PARTS, gb.RECOMPUTE))
    assert choices == ("keep", "recompute", "recompute") and ops == (None, "parts", "all")
    plan = gb.BudgetPlan(choices, "off", None, 0, 0.0, 0.0, 0, 0.0, "", recompute_ops=ops)
    assert plan.detailed == (gb.KEEP, gb.RECOMPUTE_PARTS, gb.RECOMPUTE)
    assert plan.layers("recompute") == [1, 2] and plan.layers(gb.RECOMPUTE_PARTS) == [1]
    assert gb.costs.short(plan.detailed) == "KPR"


def test_the_least_plan_recomputes_by_parts_where_that_holds_least(clean, monkeypatch):
    """A profile where a part's activations are a fraction of the layer's: the least
    budget recomputes by parts, and the stack built from it trains as eager."""
    b = clean
    layer = gb.LayerCost(4.0, 8.0, 64 * MiB, recompute_ms=4.0, work_bytes=8 * MiB,
                         input_bytes=MiB, parts_saved_bytes=4 * MiB, parts_work_bytes=24 * MiB,
                         parts_recompute_ms=4.2)
    fake_profile(monkeypatch, [layer] * 4, gbps=5.0)
    base = small_gpt(b, 4)
    want = run(copy.deepcopy(base), b, 2, 1, True)
    model = copy.deepcopy(base)
    with graphed(copy.deepcopy(base), b, None, memory_budget="auto") as probe:
        least = gb.smallest_peak(probe.plan.profile)
    with graphed(model, b, None, memory_budget=least) as stack:
        assert stack.plan.recompute_ops and "parts" in stack.plan.recompute_ops
        assert stack.parts_layers == set(stack.plan.layers(gb.RECOMPUTE_PARTS))
        assert_bitwise(run(model, b, 2, 1, True), want)


def test_the_bench_runs_every_layer_recomputed_by_parts_beside_whole(backend):
    from graphslot.cli.bench import run_bench
    from graphslot.cli.bench_models import BenchShape

    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("graph_recompute", "graph_recompute_parts"), layers_per_graph=1)
    whole, parts = r["configs"]["graph_recompute"], r["configs"]["graph_recompute_parts"]
    assert "reason" not in parts, parts.get("reason")
    # what goes to the host is what each part is given: more than the layers' inputs
    assert parts["offloaded_bytes"] > 0 and whole["offloaded_bytes"] == 0


class Gated(nn.Module):
    """A block whose parts get tensors by keyword and inside a tuple (as a decoder layer's
    attention gets its rotary ``position_embeddings``)."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n)
        self.mix = Mixer(n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.mix(h, gate=torch.sigmoid(x), pair=(x * 2, h))[0]


class Mixer(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, h: torch.Tensor, gate: torch.Tensor, pair: tuple) -> tuple:
        return self.lin(h) * gate + pair[0] * pair[1], None


@pytest.mark.parametrize("mode", ["off", "remap"])
def test_tensors_a_part_gets_by_keyword_or_in_a_tuple_are_saved_with_each_microbatch(clean, mode):
    """With microbatches in flight the next forward writes the graphs' memory again: every
    tensor a part is given must be saved (parked, or sent to the host) with its own."""
    b = clean
    torch.manual_seed(0)
    base = [Gated().to(b.device) for _ in range(3)]
    xs = [torch.randn(4, 16, device=b.device) for _ in range(3)]
    eager, mine = copy.deepcopy(base), copy.deepcopy(base)
    stack = GraphedLayers(mine, xs[0].clone().requires_grad_(), backend=b, mode=mode,
                          recompute_layers=[0, 1, 2], recompute_ops="parts", layers_per_graph=1,
                          offload_layers=[0, 1] if mode != "off" else None)
    with stack:
        for f in (nn.Sequential(*eager), stack):
            outs = [f(x.clone().requires_grad_()) for x in xs]
            for o in reversed(outs):
                o.square().sum().backward()
        assert_bitwise([p.grad for m in mine for p in m.parameters()],
                       [p.grad for m in eager for p in m.parameters()])


def test_a_part_that_changes_its_input_in_place_is_refused_and_not_offered(clean):
    b = clean
    layers = [Decoder(16, extra=nn.ReLU(inplace=True)).to(b.device) for _ in range(2)]
    x = torch.randn(4, 16, device=b.device, requires_grad=True)
    with pytest.raises(UsageError, match=r"layer 1, recomputed part by part .* changes what its part "
                                         r"ReLU is given in place"):
        GraphedLayers(layers, x, backend=b, mode="off", recompute_layers=[1], recompute_ops="parts")
    assert not profile_units(b, layers[:1], x)[0].parts
    with GraphedLayers(layers, x, backend=b, memory_budget="auto") as stack:  # (still plans)
        assert stack.plan is not None


def test_the_build_counts_what_parts_layers_keep_when_it_gives_gradients_homes(clean):
    """Where layers recomputed by parts keep their parts' inputs in the graphs' pool, the
    build judges gradient homes by those bytes, as the planner's model does."""
    b = clean
    torch.manual_seed(0)
    layers = [Decoder(256).to(b.device) for _ in range(3)]
    x = torch.randn(20, 256, device=b.device, requires_grad=True)
    with GraphedLayers(layers, x, backend=b, mode="off", recompute_layers=[0, 1, 2],
                       recompute_ops="parts", layers_per_graph=1) as stack:
        kept = sum(g.kept_bytes for g in stack.engine.groups)
        grads = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
        assert stack._grad_homes == gb.gradient_homes(kept, grads)
