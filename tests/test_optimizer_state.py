"""An optimizer's state under a memory budget: what torch's optimizers will make at their
first step is counted when the stack is built, and state the plan did not count is named
at the step that made it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
import graphslot
from graphslot import budget as gb
from graphslot import optimizer_state
from graphslot.adapters import torch as gt
from graphslot.errors import BudgetError
from graphslot.optimizer_state import (StateCount, StateWatch, live_optimizers, pending_state_bytes,
                                      state_bytes)
from test_budget_stack import fake_profile

MiB = 1 << 20

OPTIMIZERS = [
    ("Adam", {}), ("Adam", {"amsgrad": True}), ("AdamW", {}), ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}), ("RMSprop", {}),
    ("RMSprop", {"momentum": 0.9, "centered": True}), ("Adagrad", {}), ("Adadelta", {}),
    ("Adamax", {}), ("NAdam", {}), ("RAdam", {}), ("Rprop", {}), ("ASGD", {}),
    ("Adafactor", {}), ("Muon", {}),
]


def _params(muon: bool = False) -> list[nn.Parameter]:
    shapes = [(6, 5)] if muon else [(6, 5), (5,), (3, 4, 5)]  # (Muon takes matrices only)
    ps = [nn.Parameter(torch.randn(s, dtype=torch.bfloat16 if k == 0 else torch.float32))
          for k, s in enumerate(shapes)]
    frozen = nn.Parameter(torch.randn((4, 4) if muon else (4,)), requires_grad=False)
    return ps + [frozen]  # (frozen: no state)


def _big_state(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> int:
    """The bytes of the state tensors beyond the scalar counters."""
    return sum(v.numel() * v.element_size() for p in params for v in opt.state.get(p, {}).values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=[f"{n}{kw}" for n, kw in OPTIMIZERS])
def test_the_state_told_before_the_first_step_is_what_the_step_makes(name, kw):
    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"this torch has no torch.optim.{name}")
    params = _params(muon=name == "Muon")
    opt = cls(params, **kw)
    made_before = _big_state(opt, params)  # (Adagrad's constructor makes its state)
    told = pending_state_bytes(opt, params)
    for p in params:
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    assert told == _big_state(opt, params) - made_before
    assert pending_state_bytes(opt, params) == 0  # (made now)


def test_state_is_told_for_the_parameters_asked_about_alone():
    mine, theirs = _params(), _params()
    opt = torch.optim.Adam(mine + theirs)
    mine_bytes = sum(p.numel() * p.element_size() for p in mine if p.requires_grad)
    assert pending_state_bytes(opt, mine) == 2 * mine_bytes


def test_a_device_named_with_or_without_its_index_counts_alike():
    """"cuda" names every cuda device and "cuda:0" the first; a tensor's device always has
    its index on cuda and never on the host, so both spellings must count the same
    tensors (the cuda suite found "cuda" counting nothing of state on cuda:0)."""
    params = _params()
    opt = torch.optim.Adam(params)
    for p in params:
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    told = {d: pending_state_bytes(opt, params, d) for d in ("cpu", "cpu:0")}
    opt.step()
    held = {d: state_bytes(opt, params, d) for d in ("cpu", "cpu:0")}
    assert told["cpu"] == told["cpu:0"] > 0 and held["cpu"] == held["cpu:0"] == state_bytes(opt, params) > 0
    assert state_bytes(opt, params, "meta") == 0  # (another kind holds none of it)


def test_an_optimizer_of_a_kind_it_cannot_tell_says_so():
    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    self.state[p]["m"] = torch.zeros_like(p)

    params = _params()
    assert pending_state_bytes(Mine(params), params) is None
    assert pending_state_bytes(torch.optim.LBFGS(params[:1]), params) is None


def test_live_optimizers_are_found_and_half_built_ones_are_passed_over():
    mine = _params()
    a = torch.optim.Adam(mine[:1])
    kept = None
    try:
        torch.optim.Adam(_params(), lr=-1.0)  # (raises before it has param_groups)
    except ValueError as e:
        kept = e  # (its traceback keeps the half-built optimizer alive)
    assert kept is not None
    b = torch.optim.SGD(mine, lr=0.1)
    found = live_optimizers()
    assert any(o is a for o in found) and any(o is b for o in found)
    assert all(isinstance(o.param_groups, list) for o in found)
    del kept


def test_state_made_late_is_named_when_it_comes():
    """A layer frozen when the optimizer first steps and unfrozen later makes its state
    late; the watch names it then (the build counted none for it)."""
    import weakref

    params = _params()
    frozen = nn.Parameter(torch.randn(512, 512), requires_grad=False)
    opt = torch.optim.Adam(params + [frozen])
    watch = StateWatch(StateCount(0, pending_state_bytes(opt), (weakref.ref(opt),)),
                       lambda o, extra: f"late {extra}", slack=1024)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            _step(opt, params + [frozen])  # (the frozen one has no gradient: no state)
            frozen.requires_grad_(True)
            for _ in range(2):
                _step(opt, params + [frozen])
        said = [str(m.message) for m in w]
        assert len(said) == 1 and said[0].startswith("late ")
        assert int(said[0].split()[1]) >= 2 * frozen.numel() * frozen.element_size()
    finally:
        watch.close()


def _step(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()


def test_the_watch_warns_past_what_was_counted_once_per_growth_and_stops_at_close():
    import weakref

    params = _params()
    counted_one, uncounted = torch.optim.Adam(params), torch.optim.Adam(params)
    want = pending_state_bytes(counted_one)
    watch = StateWatch(StateCount(want, want, (weakref.ref(counted_one),)),
                       lambda o, extra: f"{type(o).__name__} {extra}",
                       slack=64)  # (the step counters, a few bytes each, are not counted)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _step(counted_one, params)
        _step(uncounted, params)
        _step(uncounted, params)  # (once: it has not grown since)
    extra = state_bytes(counted_one) + state_bytes(uncounted) - want
    assert [str(m.message) for m in w] == [f"Adam {extra}"]
    watch.close()
    watch.close()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _step(torch.optim.Adam(params), params)
    assert w == []


def test_a_watch_closed_inside_a_step_leaves_the_step_alone():
    """A stack dropped without close() is collected when a collection comes, which may be
    inside an optimizer's step: its watch closing then must not disturb torch's hooks."""
    import weakref

    params = _params()
    watches = [StateWatch(StateCount(0, 0, ()), lambda o, extra: "") for _ in range(3)]
    from torch.optim.optimizer import register_optimizer_step_post_hook

    closing = register_optimizer_step_post_hook(lambda o, a, k: [w.close() for w in watches])
    try:
        _step(torch.optim.Adam(params), params)  # (raised "mutated during iteration" before)
    finally:
        closing.remove()
    assert not any(w in optimizer_state._WATCHES for w in watches)


def _room_say(room: int):
    """A budget's ``say``: silent while the excess fits ``room``."""
    return lambda o, extra: "" if extra <= room else f"over {extra}"


def _warned(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(m.message) for m in w]


def _mats(n: int, side: int = 64) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(side, side)) for _ in range(n)]


def _nbytes(ps: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def test_state_within_the_room_at_first_is_named_once_it_outgrows_it():
    """Three ways state comes after a first step whose state fit the room: a layer
    unfrozen, a second optimizer, a parameter group added. The first step is not named;
    the step that takes the process's state past the room is."""
    import weakref

    for case in ("unfrozen", "second optimizer", "group added"):
        ps = _mats(2)
        room = 3 * _nbytes(ps[:1])  # (Adam makes two matrices per matrix: one fits, two do not)
        if case == "unfrozen":
            ps[1].requires_grad_(False)
        opt = torch.optim.Adam(ps if case == "unfrozen" else ps[:1])
        watch = StateWatch(StateCount(0, 0, (weakref.ref(opt),)), _room_say(room), slack=1024)
        try:
            assert _warned(lambda: _step(opt, ps[:1])) == [], case
            if case == "unfrozen":
                ps[1].requires_grad_(True)
                said = _warned(lambda: _step(opt, ps))
            elif case == "second optimizer":
                said = _warned(lambda: _step(torch.optim.Adam(ps[1:]), ps[1:]))
            else:
                opt.add_param_group({"params": [ps[1]]})
                said = _warned(lambda: _step(opt, ps))
            assert len(said) == 1 and said[0].startswith("over "), (case, said)
            assert int(said[0].split()[1]) >= 4 * _nbytes(ps[:1])
        finally:
            watch.close()


def test_an_optimizer_made_again_over_the_same_parameters_is_no_excess():
    import weakref

    ps = _mats(2)
    first = torch.optim.Adam(ps)
    count = StateCount(pending_state_bytes(first), pending_state_bytes(first), (weakref.ref(first),))
    watch = StateWatch(count, lambda o, extra: f"over {extra}", slack=1024)
    try:
        del first  # (replaced before its first step: its counted state never comes)
        again = torch.optim.Adam(ps)
        assert _warned(lambda: [_step(again, ps) for _ in range(2)]) == []
    finally:
        watch.close()


def test_lbfgs_history_is_counted():
    ps = _mats(1)
    opt = torch.optim.LBFGS(ps, history_size=5, max_iter=4)

    def closure():
        opt.zero_grad()
        loss = ps[0].square().sum()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    st = opt.state[ps[0]]
    history = sum(t.numel() * t.element_size() for t in st["old_dirs"] + st["old_stps"])
    assert history > 0 and state_bytes(opt) >= history + _nbytes(ps)


def test_an_unhashable_optimizer_neither_breaks_the_count_nor_its_step():
    class Compared(torch.optim.SGD):
        def __eq__(self, other):  # (and so no __hash__)
            return self is other

    ps = _mats(2)
    opt = Compared(ps, lr=0.1, momentum=0.9)
    count = optimizer_state.state_to_come("cpu")
    assert count.pending >= _nbytes(ps)
    watch = StateWatch(count, lambda o, extra: f"over {extra}", slack=1024)
    try:
        assert _warned(lambda: _step(opt, ps)) == []
    finally:
        watch.close()


def test_a_watch_that_fails_stops_and_leaves_the_step_alone():
    ps = _mats(1)
    opt = torch.optim.Adam(ps)

    def say(o, extra):
        raise RuntimeError("broken")

    watch = StateWatch(StateCount(0, 0, ()), say, slack=0)
    said = _warned(lambda: _step(opt, ps))
    assert len(said) == 1 and "stopped watching" in said[0] and "broken" in said[0]
    assert watch not in optimizer_state._WATCHES
    assert _warned(lambda: _step(opt, ps)) == []


def _blocks(h: int = 256, n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
            for _ in range(n)]


def _sample(b, h: int = 256) -> torch.Tensor:
    return torch.randn(8, h, device=b.device, requires_grad=True)


def _fake(monkeypatch, n: int = 3) -> None:
    fake_profile(monkeypatch, [gb.LayerCost(1.0, 2.0, 4 * MiB, recompute_ms=1.0)] * n)


def test_the_state_an_optimizer_made_before_the_build_will_make_is_in_the_plan(clean, monkeypatch):
    """Planned from the same costs, a stack whose layers an Adam holds counts Adam's two
    moments as held: its least plan holds that much more, and a refusal names it."""
    b = clean
    _fake(monkeypatch)
    least = {}
    for name in ("SGD", "Adam"):
        layers = [m.to(b.device) for m in _blocks()]
        params = [p for m in layers for p in m.parameters()]
        opt = torch.optim.SGD(params, lr=0.1) if name == "SGD" else torch.optim.Adam(params)
        moments = 0 if name == "SGD" else 2 * sum(p.numel() * p.element_size() for p in params)
        others = _others_pending(b, opt)
        with gt.GraphedLayers(layers, _sample(b), memory_budget="auto", backend=b) as stack:
            assert stack.plan.profile.optimizer_state_bytes == moments + others
        with pytest.raises(BudgetError) as e:
            gt.GraphedLayers(layers, _sample(b), memory_budget=1, backend=b)
        least[name] = e.value.least_bytes  # (with room, in whole granules)
        del opt
    assert moments > 0 and abs(least["Adam"] - least["SGD"] - moments) <= b.granularity


def _others_pending(b, *mine: torch.optim.Optimizer) -> int:
    """What the process's other live optimizers will make on ``b``'s device (the test
    session's own)."""
    return sum(pending_state_bytes(o, device=b.device) or 0 for o in live_optimizers()
               if all(o is not m for m in mine))


def test_the_state_for_parameters_outside_the_stack_is_counted_too(clean, monkeypatch):
    """The budget is the process's peak: an optimizer's state for the model's other
    parameters (an embedding, a head) comes at the same first step."""
    b = clean
    _fake(monkeypatch)
    layers = [m.to(b.device) for m in _blocks()]
    embed = nn.Embedding(1000, 256).to(b.device)
    opt = torch.optim.AdamW(list(embed.parameters()) + [p for m in layers for p in m.parameters()])
    everything = 2 * sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
    others = _others_pending(b, opt)
    with gt.GraphedLayers(layers, _sample(b), memory_budget="auto", backend=b) as stack:
        assert stack.plan.profile.optimizer_state_bytes == everything + others
    del opt


@pytest.mark.parametrize("made", ["before", "after"])
def test_state_an_optimizer_made_after_the_build_is_named_at_its_first_step(clean, monkeypatch, made):
    b = clean
    _fake(monkeypatch)
    layers = [m.to(b.device) for m in _blocks()]
    params = [p for m in layers for p in m.parameters()]
    opt = torch.optim.Adam(params) if made == "before" else None
    # (a budget the plan without Adam's moments fits, with a MiB to spare)
    with gt.GraphedLayers(layers, _sample(b), memory_budget="auto", backend=b) as probe:
        budget = probe.plan.predicted_peak_bytes + MiB
    watching = len(optimizer_state._WATCHES)
    with gt.GraphedLayers(layers, _sample(b), memory_budget=budget, backend=b) as stack:
        assert len(optimizer_state._WATCHES) == watching + 1
        opt = opt or torch.optim.Adam(params)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                stack(_sample(b)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        said = [str(m.message) for m in w if "GraphedLayers: the optimizers" in str(m.message)]
        if made == "before":
            assert said == []
        else:
            moments = state_bytes(opt, params, b.device.type)
            assert len(said) == 1 and "than the stack's memory budget's plan counted" in said[0]
            assert "after Adam's step" in said[0] and "Build the stack after" in said[0]
            from graphslot.sizes import format_bytes
            assert format_bytes(moments) in said[0]
    assert len(optimizer_state._WATCHES) == watching  # (closed with the stack)


def test_state_made_by_a_changed_setting_after_all_state_is_made_is_named(monkeypatch):
    """An optimizer that made all its state is looked at again now and then: a setting
    changed later (SGD's momentum switched on) makes more, which is named."""
    import weakref

    monkeypatch.setattr(optimizer_state, "_LATER_EVERY", 5)
    p = nn.Parameter(torch.randn(1024))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.0)
    count = StateCount(0, 0, (weakref.ref(opt),))
    watch = StateWatch(count, lambda o, extra: f"{type(o).__name__} {extra}", slack=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _step(opt, [p])
        assert state_bytes(opt) == 0
        opt.param_groups[0]["momentum"] = 0.9
        for _ in range(5):
            _step(opt, [p])
    watch.close()
    assert [str(m.message) for m in w] == [f"SGD {p.numel() * p.element_size()}"]


def test_state_of_tensors_without_storage_of_their_own_is_counted(tmp_path):
    """A DTensor (FSDP2's optimizer state) has no storage of its own: its shard on this
    rank is counted, and a budgeted build beside such an optimizer still builds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        w = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        opt = torch.optim.AdamW([w])
        w.grad = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        opt.step()
        moments = [t for t in opt.state[w].values() if type(t).__name__ == "DTensor"]
        assert len(moments) == 2
        # (the two moments' shards, 64 bytes each, and the step counter)
        assert state_bytes(opt, device="cpu") == 2 * 64 + opt.state[w]["step"].untyped_storage().nbytes()
        dev = graphslot.get_backend().device  # (the stack beside it on the backend's device)
        with gt.GraphedLayers([nn.Linear(8, 8).to(dev), nn.Linear(8, 8).to(dev)],
                              torch.randn(4, 8, device=dev, requires_grad=True),
                              memory_budget="64GiB") as stack:
            assert stack.plan.choices == ("keep", "keep")
    finally:
        dist.destroy_process_group()
