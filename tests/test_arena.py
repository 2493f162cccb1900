"""Shared variant pools and planned partial-graph I/O (graphslot.arena), on every backend.

Memory is measured at the lowest level each backend offers: on cpu the process's
proportional set size of anonymous memory (Pss_Anon: not the libraries' pages, whose
share moves as other processes come and go) plus the kernel's count of the pages behind
graphslot's memfds (a page mapped at three addresses counts once); on cuda the driver's
used memory.
"""

from __future__ import annotations

import math
import os
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

import graphslot
from graphslot import align_up
from graphslot.arena import (IOArena, IOTensor, PoolFullError, SharedArena, Step, VariantGraphs,
                             io_specs, warm_first_capture)
from graphslot.errors import InjectedFault, StateError, UsageError
from graphslot.memory import measure, used_bytes
from graphslot.planner import PlanError

MiB = 1 << 20

# Hidden size and the three variants' lengths (mlp, normed, mixing), per backend: pools of
# similar size (the quadratic mixing path gets the shortest length), each well above noise.
SHAPES = {"cuda": (2048, (3072, 2048, 1024)), "cpu": (256, (3072, 2048, 1024))}


def shape(b: graphslot.Backend) -> tuple[int, tuple[int, int, int]]:
    return SHAPES.get(b.name, SHAPES["cpu"])


class Layer:
    """One layer with three code paths; each variant runs one path at its own length."""

    def __init__(self, hidden: int, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.h = hidden
        self.w1 = (torch.randn(hidden, 4 * hidden, generator=g) / hidden ** 0.5).to(device)
        self.w2 = (torch.randn(4 * hidden, hidden, generator=g) / (2 * hidden)).to(device)

    def mlp(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.matmul(F.gelu(x @ self.w1), self.w2, out=out)

    def normed(self, x: torch.Tensor) -> torch.Tensor:  # residual and layer norm on top
        return F.layer_norm(x + self.mlp(x), (self.h,))

    def mixing(self, x: torch.Tensor) -> torch.Tensor:  # token mixing first: another path
        a = torch.softmax(x @ x.T / math.sqrt(self.h), dim=-1)
        return self.mlp(a @ x)


PATHS = ("mlp", "normed", "mixing")


def variants(b: graphslot.Backend, seed: int = 0) -> tuple[Layer, dict[str, torch.Tensor]]:
    hidden, seqs = shape(b)
    layer = Layer(hidden, b.device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    xs = {p: torch.randn(s, hidden, generator=g).to(b.device) for p, s in zip(PATHS, seqs)}
    for p in PATHS:  # eager warm-up: lazy library init stays out of every capture
        getattr(layer, p)(xs[p])
    warm_first_capture(b)
    return layer, xs



def check(y: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")




# --------------------------------------------------------------------------- allocator shim


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="no C compiler")
def test_cuda_allocator_shim_places_frees_and_reports():
    """The C allocator behind the cuda MemPool, driven directly (it never touches memory)."""
    from graphslot.backends.cuda.pool import shim

    s = shim()
    base, size = 1 << 44, 64 * MiB
    rid = s.add(base, size)
    with pytest.raises(UsageError, match="overlaps"):
        s.add(base + MiB, MiB)
    try:
        s.activate(rid)
        a = s.lib.gs_malloc(20 * MiB, 0, None)
        c = s.lib.gs_malloc(2 * MiB, 0, None)
        d = s.lib.gs_malloc(30 * MiB, 0, None)
        assert (a, c, d) == (base, base + 20 * MiB, base + 22 * MiB)
        assert s.lib.gs_malloc(20 * MiB, 0, None) is None  # 12 MiB left
        st = s.stats(rid)
        assert (st["live"], st["high"], st["failed"], st["blocks"]) == (52 * MiB, 52 * MiB, 20 * MiB, 3)
        s.lib.gs_free(a, 0, 0, None)
        assert s.lib.gs_malloc(8 * MiB, 0, None) == base  # first fit reuses the hole
        assert not s.remove(rid)  # blocks still live
        before = s.global_stats()
        s.lib.gs_free(base - 4096, 0, 0, None)
        s.deactivate()
        assert s.lib.gs_malloc(MiB, 0, None) is None  # nothing active: torch sees OOM
        after = s.global_stats()
        assert after["foreign_frees"] == before["foreign_frees"] + 1
        assert after["unrouted_allocs"] == before["unrouted_allocs"] + 1
        for p in (base, c, d):
            s.lib.gs_free(p, 0, 0, None)
        assert s.stats(rid)["live"] == 0 and s.stats(rid)["high"] == 52 * MiB
    finally:  # after a failed assertion, free what is left so the region can go
        s.deactivate()
        if s.stats(rid)["live"]:
            for q in (base, base + 20 * MiB, base + 22 * MiB):
                s.lib.gs_free(q, 0, 0, None)
        assert s.remove(rid)
    with pytest.raises(StateError):
        s.activate(rid)
    # A retired region with a live block: no new allocations, no longer in the way of a
    # new region over the same addresses, forgotten with its last block.
    old = s.add(base, size)
    s.activate(old)
    p = s.lib.gs_malloc(MiB, 0, None)
    s.deactivate()
    s.retire(old)
    with pytest.raises(StateError):
        s.activate(old)
    new = s.add(base, size)
    s.activate(new)
    q = s.lib.gs_malloc(MiB, 0, None)
    s.deactivate()
    assert p == q == base
    s.lib.gs_free(p, 0, 0, None)  # one of the two blocks at `base` goes
    s.lib.gs_free(q, 0, 0, None)  # and the other
    assert s.remove(new)
    with pytest.raises(StateError):
        s.stats(old)  # forgotten with its last block


# --------------------------------------------------------------------------- shared arena


def test_regions_have_distinct_addresses_and_share_pages(clean):
    b = clean
    g = b.granularity
    arena = SharedArena(b, capacity=8 * g, size=2 * g)
    try:
        regs = [arena.add_region(n) for n in "abc"]
        assert len({r.va for r in regs}) == 3
        assert b.ledger.allocated_bytes == 2 * g and b.ledger.mapped_bytes == 2 * g  # (once)
        views = [b.tensor_at(r.va, (2 * g,), torch.uint8) for r in regs]
        views[0].copy_(torch.arange(2 * g, dtype=torch.int64).remainder(251).to(torch.uint8).to(b.device))
        b.synchronize()
        assert torch.equal(views[2].cpu(), views[0].cpu())
        want = views[0].cpu().clone()
        arena.resize(3 * g)  # contents survive a resize
        views = [b.tensor_at(r.va, (2 * g,), torch.uint8) for r in regs]
        assert all(torch.equal(v.cpu(), want) for v in views)
        assert b.ledger.allocated_bytes == 3 * g and b.ledger.mapped_bytes == 3 * g
        with pytest.raises(UsageError, match="capacity"):
            arena.resize(9 * g)
        arena.remove_region("b")
        assert b.ledger.mapped_bytes == 3 * g and len(arena.regions) == 2
    finally:
        del views
        arena.close()
    with pytest.raises(StateError, match="closed"):
        arena.add_region("d")


def test_resize_rolls_back_when_a_map_fails(clean):
    b = clean
    g = b.granularity
    arena = SharedArena(b, capacity=8 * g, size=g)
    try:
        regs = [arena.add_region(n) for n in range(3)]
        b.tensor_at(regs[0].va, (g,), torch.uint8).fill_(7)
        b.faults.fail("map", after=2)  # the copy's temporary map and region 0 pass, region 1 fails
        with pytest.raises(InjectedFault):
            arena.resize(4 * g)
        assert b.ledger.allocated_bytes == g and b.ledger.mapped_bytes == g
        for r in regs:
            v = b.tensor_at(r.va, (g,), torch.uint8)
            assert int(v.min()) == 7 and int(v.max()) == 7
        arena.resize(4 * g)
        assert b.ledger.allocated_bytes == 4 * g
    finally:
        arena.close()


# --------------------------------------------------------------------------- variants


def test_variants_replay_correctly_in_random_interleavings(regions):
    b = regions
    layer, xs = variants(b)
    with VariantGraphs(b, capacity=512 * MiB) as vg:
        outs = {p: vg.capture(p, getattr(layer, p), xs[p]) for p in PATHS}
        regions = vg.arena.regions
        for p in PATHS:  # each variant's outputs live in its own region
            r = regions[p]
            assert r.va <= outs[p].data_ptr() < r.va + vg.arena.capacity
        pools = vg.pool_bytes()
        assert vg.arena.mapped_bytes == align_up(max(pools.values()), b.granularity)
        rng = random.Random(0)
        gen = torch.Generator().manual_seed(1)
        order = [rng.choice(PATHS) for _ in range(36)] + list(PATHS)
        for i, p in enumerate(order):
            xs[p].copy_(torch.randn(xs[p].shape, generator=gen).to(b.device))
            y = vg.replay(p)
            assert y is outs[p] and vg.current == p
            check(y, getattr(layer, p)(xs[p]), f"replay {i} ({p})")
        del y, outs


def test_shared_variants_cost_the_largest_not_the_sum(regions):
    """Driver-level memory of three variants in one arena against three separate captures."""
    b = regions
    layer, xs = variants(b, seed=3)
    kw = b.ordinary_capture_kwargs()
    slack = 48 * MiB if b.name == "cuda" else 8 * MiB
    before = used_bytes(b)
    vg = VariantGraphs(b, capacity=512 * MiB)
    for p in PATHS:
        vg.capture(p, getattr(layer, p), xs[p])
        vg.replay(p)
    shared = used_bytes(b) - before
    st = vg.stats()
    pools = list(vg.pool_bytes().values())
    largest, total = max(pools), sum(pools)
    assert b.ledger.allocated_bytes == st["shared_bytes"] == align_up(largest, b.granularity)
    assert b.ledger.mapped_bytes == st["shared_bytes"]  # (three regions, one memory)
    vg.close()
    del vg

    before = used_bytes(b)
    graphs, keep = [], []
    for p in PATHS:
        g = b.new_graph()
        with g.capture(**kw):
            keep.append(getattr(layer, p)(xs[p]))
        g.replay()
        graphs.append(g)
    separate = used_bytes(b) - before
    separate_pools = [g.pool_bytes for g in graphs]
    del graphs, keep

    msg = (f"shared {shared / MiB:.1f} MiB, separate {separate / MiB:.1f} MiB, pools "
           f"{[round(p / MiB, 1) for p in pools]} MiB, separate pools "
           f"{[round(p / MiB, 1) for p in separate_pools]} MiB")
    print(msg)
    assert total - largest > 2 * slack, msg  # the case must be able to tell them apart
    assert shared <= align_up(largest, b.granularity) + slack, msg
    assert separate >= 0.85 * sum(separate_pools) - slack, msg
    assert separate - shared >= (total - largest) - 2 * slack, msg


def test_forward_and_backward_parts_share_the_variant_pool(regions):
    b = regions
    hidden, seqs = shape(b)
    layer = Layer(hidden, b.device, seed=5)
    w1 = layer.w1.clone().requires_grad_()
    xs = {p: torch.randn(s // 4, hidden, device=b.device) for p, s in zip(("mlp", "normed"), seqs)}
    gos = {p: torch.randn_like(x) for p, x in xs.items()}

    def forward(p: str) -> torch.Tensor:
        h = F.gelu(xs[p] @ w1) @ layer.w2
        return F.layer_norm(h + xs[p], (hidden,)) if p == "normed" else h

    for p in xs:  # eager warm-up, backward included
        torch.autograd.grad(forward(p), w1, gos[p])
    b.synchronize()
    with VariantGraphs(b, capacity=512 * MiB) as vg:
        outs = {}
        for p in xs:
            outs[p] = vg.capture(p, forward, p)
            vg.capture(p, torch.autograd.grad, outs[p], w1, gos[p], part="bwd")
        gen = torch.Generator().manual_seed(2)
        for p in ("normed", "mlp", "mlp", "normed"):
            xs[p].copy_(torch.randn(xs[p].shape, generator=gen).to(b.device))
            y = vg.replay(p)
            gw, = vg.replay(p, part="bwd")
            want = forward(p)
            check(y, want.detach(), f"{p} forward")
            check(gw, torch.autograd.grad(want, w1, gos[p])[0], f"{p} backward")
        del outs, y, gw


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-size", "capacity"])
def test_a_variant_that_does_not_fit_is_refused_and_the_rest_keep_working(regions, fixed):
    b = regions
    layer, xs = variants(b, seed=7)
    with VariantGraphs(b, capacity=512 * MiB) as probe:
        for p in PATHS:
            probe.capture(p, getattr(layer, p), xs[p])
        pools = probe.pool_bytes()
    small, big = min(pools, key=pools.get), max(pools, key=pools.get)
    room = align_up(pools[small], b.granularity)
    assert pools[big] > room
    vg = VariantGraphs(b, size=room) if fixed else VariantGraphs(b, capacity=room)
    try:
        vg.capture(small, getattr(layer, small), xs[small])
        before = b.ledger.snapshot()
        with pytest.raises(PoolFullError, match=f"variant '{big}'") as e:
            vg.capture(big, getattr(layer, big), xs[big])
        assert ("fixed" in str(e.value)) == fixed
        del e  # its traceback holds the half-captured tensors
        assert vg.names == [small]
        assert b.ledger.allocated_bytes == before["allocated_bytes"] == room
        xs[small].normal_()
        check(vg.replay(small), getattr(layer, small)(xs[small]), "after the refused capture")
    finally:
        vg.close()


def test_bad_use_is_refused_clearly(regions):
    b = regions
    layer, xs = variants(b, seed=9)
    vg = VariantGraphs(b, capacity=512 * MiB)
    out = vg.capture("mlp", layer.mlp, xs["mlp"])
    with pytest.raises(UsageError, match="already has a graph 'main'"):
        vg.capture("mlp", layer.mlp, xs["mlp"])
    with pytest.raises(UsageError, match="no variant 'long'.*'mlp'"):
        vg.replay("long")
    with pytest.raises(UsageError, match="no graph 'bwd'"):
        vg.replay("mlp", part="bwd")
    with pytest.raises(UsageError, match="not both"):
        b.new_graph(share_pool_with=b.new_graph(), pool_region=(vg.arena.regions["mlp"].va, MiB))
    with pytest.raises(UsageError, match="not inside a live reservation"):
        b.new_graph(pool_region=(1 << 46, MiB))
    # Unmapped memory behind a region: replay is refused instead of faulting.
    res = vg.arena.regions["mlp"]
    alloc = res.mappings[0].allocation
    b.unmap(res, 0, alloc.size)
    with pytest.raises(StateError, match="nothing accessible is mapped"):
        vg.replay("mlp")
    b.map(res, 0, alloc)
    b.set_access(res, 0, alloc.size)
    vg.replay("mlp")
    # Outputs still held: close keeps the memory behind them and says why; the graphs are
    # released, and a replay says so truthfully.
    with pytest.raises(StateError, match="still alive"):
        vg.close()
    with pytest.raises(StateError, match="close\\(\\) was called and refused.*memory is held"):
        vg.replay("mlp")
    assert out.sum().isfinite()  # (its bytes still mapped)
    del out
    vg.close()
    vg.close()  # idempotent
    with pytest.raises(StateError, match="closed"):
        vg.replay("mlp")
    with pytest.raises(StateError, match="closed"):
        vg.capture("mlp2", layer.mlp, xs["mlp"])


# --------------------------------------------------------------------------- partial-graph I/O


def chain(hidden: int, seq: int, dtype: torch.dtype = torch.float32) -> tuple[list[IOTensor], list[Step]]:
    """Three partial graphs with an eager (routing) segment between the first two."""
    t = [IOTensor(n, (seq, hidden), dtype) for n in ("x", "h0", "h1", "h2", "y")]
    steps = [Step("g0", reads=("x",), writes=("h0",)),
             Step("route", reads=("h0",), writes=("h1",)),
             Step("g1", reads=("h1",), writes=("h2",)),
             Step("g2", reads=("h2",), writes=("y",))]
    return t, steps


def test_io_lifetimes_come_from_the_steps():
    t, steps = chain(8, 4)
    spans = {s.name: (s.start, s.end) for s in io_specs(t, steps)}
    assert spans == {"x": (0, 1), "h0": (0, 2), "h1": (1, 3), "h2": (2, 4), "y": (3, 4)}
    kept = [IOTensor("h0", (4, 8), torch.float32, keep=True), *t[2:], t[0]]
    assert {s.name: (s.start, s.end) for s in io_specs(kept, steps)}["h0"] == (0, 4)
    with pytest.raises(PlanError, match="unknown tensor 'z'"):
        io_specs(t, [*steps, Step("g3", reads=("z",))])
    with pytest.raises(PlanError, match="used by no step"):
        io_specs([*t, IOTensor("spare", (1,), torch.float32)], steps)
    with pytest.raises(PlanError, match="not a string"):
        io_specs(t, [Step("g0", reads="x")])


def test_partial_graph_io_shares_bytes_and_replays_correctly(clean):
    b = clean
    hidden, seqs = shape(b)
    seq = seqs[1]
    layers = [Layer(hidden, b.device, seed=20 + i) for i in range(3)]

    def route(h: torch.Tensor) -> torch.Tensor:  # the eager segment between graphs
        return h * torch.sigmoid(h.mean(dim=-1, keepdim=True))

    def reference(x: torch.Tensor) -> torch.Tensor:
        return layers[2].mlp(layers[1].mlp(route(layers[0].mlp(x))))

    tensors, steps = chain(hidden, seq)
    buf = seq * hidden * 4
    reference(torch.randn(seq, hidden, device=b.device))  # eager warm-up
    kw = b.ordinary_capture_kwargs()

    warm_first_capture(b)

    # Planned: every static tensor at its planned offset; buffers with disjoint lifetimes
    # share bytes. Each graph writes its result straight into its output tensor.
    before = used_bytes(b)
    with measure(b) as m:
        io = IOArena(b, tensors, steps)
    rep = io.report()
    assert rep["naive_bytes"] == 5 * buf and rep["lower_bound_bytes"] == 2 * buf
    assert rep["arena_bytes"] == 2 * buf and io.mapped_bytes == align_up(2 * buf, b.granularity)
    assert m.delta.allocated_bytes == io.mapped_bytes  # the ledger sees exactly the arena
    g0 = b.new_graph()
    with g0.capture(**kw):
        layers[0].mlp(io["x"], out=io["h0"])
    g1 = b.new_graph(share_pool_with=g0)
    with g1.capture(**kw):
        layers[1].mlp(io["h1"], out=io["h2"])
    g2 = b.new_graph(share_pool_with=g0)
    with g2.capture(**kw):
        layers[2].mlp(io["h2"], out=io["y"])
    planned_used = used_bytes(b) - before

    # Naive: static inputs of their own and outputs kept by their graphs, as graphed
    # callables do, with the caller copying each output into the next graph's input.
    before = used_bytes(b)
    with measure(b) as naive:
        static_in = [torch.zeros(seq, hidden, device=b.device) for _ in range(3)]
    outs, ng = [], []
    for i, layer in enumerate(layers):
        g = b.new_graph(share_pool_with=ng[0] if ng else None)
        with g.capture(**kw):
            outs.append(layer.mlp(static_in[i]))
        ng.append(g)
    naive_used = used_bytes(b) - before
    naive_io = sum(t.nbytes for t in static_in) + sum(t.nbytes for t in outs)
    assert naive_io == 6 * buf
    if naive.delta.allocator_allocated_bytes is not None:  # cuda: the allocator saw them
        assert naive.delta.allocator_allocated_bytes >= 3 * buf
    saved = naive_io - io.mapped_bytes
    assert naive_used - planned_used >= saved // 2, (
        f"planned setup {planned_used / MiB:.1f} MiB, naive {naive_used / MiB:.1f} MiB, "
        f"static I/O saved on paper {saved / MiB:.1f} MiB")

    gen = torch.Generator().manual_seed(4)
    for trial in range(4):
        x = torch.randn(seq, hidden, generator=gen).to(b.device)
        io["x"].copy_(x)
        g0.replay()
        io["h1"].copy_(route(io["h0"]))
        g1.replay()
        g2.replay()
        want = reference(x)
        check(io["y"], want, f"planned run {trial}")
        static_in[0].copy_(x)
        ng[0].replay()
        static_in[1].copy_(route(outs[0]))
        ng[1].replay()
        static_in[2].copy_(outs[1])
        ng[2].replay()
        check(outs[2], want, f"naive run {trial}")
    assert io["x"].data_ptr() == io["h1"].data_ptr() or io["h0"].data_ptr() == io["h2"].data_ptr()
    del g0, g1, g2, ng, outs, static_in
    io.close()
    with pytest.raises(StateError, match="closed"):
        io["x"]


def test_io_of_exclusive_variants_shares_bytes_across_branches(clean):
    b = clean
    t = [IOTensor(f"in_{k}", (64 * k, 128), torch.float32, branch=k) for k in (1, 2, 3)]
    t += [IOTensor(f"out_{k}", (64 * k, 128), torch.float32, branch=k) for k in (1, 2, 3)]
    steps = [Step(f"v{k}", reads=(f"in_{k}",), writes=(f"out_{k}",)) for k in (1, 2, 3)]
    with IOArena(b, t, steps) as io:
        rep = io.report()
        assert rep["arena_bytes"] == 2 * 64 * 3 * 128 * 4  # the largest variant's in + out
        assert rep["naive_bytes"] == 2 * 64 * 6 * 128 * 4
        assert io["in_1"].data_ptr() == io.reservation.va or io["out_1"].data_ptr() == io.reservation.va


def test_io_tensors_of_several_dtypes_under_a_small_align_land_on_their_elements(clean):
    b = clean
    t = [IOTensor("a", (3,), torch.float32), IOTensor("b", (2,), torch.float64),
         IOTensor("c", (5,), torch.int8)]
    steps = [Step("s", reads=("a", "c"), writes=("b",))]
    with IOArena(b, t, steps, align=1) as io:
        for name in "abc":
            assert io[name].data_ptr() % io[name].element_size() == 0


def test_removing_a_region_the_arena_lacks_is_refused_by_name(regions):
    b = regions
    arena = SharedArena(b, capacity=4 * b.granularity, size=b.granularity)
    arena.add_region("a")
    with pytest.raises(UsageError, match="no region 'nope' \\(known: 'a'\\)"):
        arena.remove_region("nope")
    arena.remove_region("a")
    arena.close()
    with pytest.raises(StateError, match="remove_region: this arena was closed"):
        arena.remove_region("a")


def test_an_io_arena_that_fails_to_build_gives_its_range_back(clean, monkeypatch):
    b = clean
    before = (len(b.ledger.reservations), b.ledger.mapped_bytes)
    with pytest.raises(PlanError, match="'x': shape \\(-4, 8\\) must be non-negative"):
        IOArena(b, [IOTensor("x", (-4, 8), torch.float32)], [Step("s", writes=("x",))])

    def fails(*args, **kwargs):
        raise UsageError("tensor_at refused")

    monkeypatch.setattr(b, "tensor_at", fails)
    with pytest.raises(UsageError, match="tensor_at refused"):
        IOArena(b, [IOTensor("x", (4, 8), torch.float32)], [Step("s", writes=("x",))])
    assert (len(b.ledger.reservations), b.ledger.mapped_bytes) == before


def test_region_graphs_implement_the_declared_interface(regions):
    """Region graphs are :class:`graphslot.regions.RegionGraph` (what the arena and the TE
    adapter use), ordinary graphs are not, and the backend declares the capability."""
    from graphslot.regions import RegionGraph

    b = regions
    assert b.capabilities.region_graphs
    assert not isinstance(b.new_graph(), RegionGraph)
    with VariantGraphs(b, capacity=64 * MiB) as vg:
        with vg.lend_pool("v") as g:
            assert isinstance(g, RegionGraph)
            assert g.pool_region[0] == vg.arena.regions["v"].va
            assert isinstance(g.pool_used_bytes, int)
            with g.lend():
                pass
            shared = b.new_graph(share_pool_with=g)
            assert isinstance(shared, RegionGraph) and shared.pool_region == g.pool_region
            assert isinstance(shared.release_pool(), int)  # g still holds the pool
    assert isinstance(b.ordinary_capture_kwargs(), dict)
