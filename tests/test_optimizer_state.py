"""An optimizer's state under a memory budget: what torch's optimizers will make at their
first step is counted when the stack is built, and state the plan did not count is named
at the step that made it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

from graphslot import budget as gb
from graphslot.adapters import torch as gt
from graphslot.errors import BudgetError
from graphslot.optimizer_state import (StateWatch, optimizers_holding, pending_state_bytes,
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
    assert state_bytes(opt, params) >= _big_state(opt, params)


def test_state_is_told_for_the_parameters_asked_about_alone():
    mine, theirs = _params(), _params()
    opt = torch.optim.Adam(mine + theirs)
    mine_bytes = sum(p.numel() * p.element_size() for p in mine if p.requires_grad)
    assert pending_state_bytes(opt, mine) == 2 * mine_bytes


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


def test_the_optimizers_holding_parameters_are_found():
    mine, theirs = _params(), _params()
    a, b = torch.optim.Adam(mine[:1]), torch.optim.SGD(theirs, lr=0.1)
    found = optimizers_holding(mine)
    assert a in found and b not in found


def _step(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    for p in params:
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()


def test_the_watch_warns_once_per_optimizer_past_what_was_counted_and_stops_at_close():
    import weakref

    params = _params()
    counted_one, uncounted = torch.optim.Adam(params), torch.optim.Adam(params)
    want = pending_state_bytes(counted_one, params)
    counted = weakref.WeakKeyDictionary({counted_one: want})
    hooks = len(_global_optimizer_post_hooks)
    watch = StateWatch(params, counted, lambda o, extra: f"{type(o).__name__} {extra}",
                       slack=64)  # (the step counters, a few bytes each, are not counted)
    assert len(_global_optimizer_post_hooks) == hooks + 1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _step(counted_one, params)
        _step(uncounted, params)
        _step(uncounted, params)  # (once)
    assert [str(m.message) for m in w] == [f"Adam {state_bytes(uncounted, params)}"]
    watch.close()
    watch.close()
    assert len(_global_optimizer_post_hooks) == hooks


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
        with gt.GraphedLayers(layers, _sample(b), memory_budget="auto", backend=b) as stack:
            assert stack.plan.profile.optimizer_state_bytes == moments
        with pytest.raises(BudgetError) as e:
            gt.GraphedLayers(layers, _sample(b), memory_budget=1, backend=b)
        least[name] = e.value.least_bytes  # (with room, in whole granules)
        del opt
    assert moments > 0 and abs(least["Adam"] - least["SGD"] - moments) <= b.granularity


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
    hooks = len(_global_optimizer_post_hooks)
    with gt.GraphedLayers(layers, _sample(b), memory_budget=budget, backend=b) as stack:
        assert len(_global_optimizer_post_hooks) == hooks + 1
        opt = opt or torch.optim.Adam(params)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                stack(_sample(b)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        said = [str(m.message) for m in w if "GraphedLayers: Adam" in str(m.message)]
        if made == "before":
            assert said == []
        else:
            moments = state_bytes(opt, params, b.device.type)
            assert len(said) == 1 and "did not count" in said[0] and "Build the stack after" in said[0]
            from graphslot.sizes import format_bytes
            assert format_bytes(moments) in said[0]
    assert len(_global_optimizer_post_hooks) == hooks  # (closed with the stack)
