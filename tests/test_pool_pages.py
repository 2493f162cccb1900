"""GraphedLayers(share_pool_pages=True): the graphs' pool on graphslot's pages, shared by
when they are live (same tests per backend; skipped where graphs draw no pool from a
region). On cpu a captured graph's pool never reuses bytes, so sharing saves most of it;
on cuda the allocator reuses freed blocks already, and sharing saves what its order of
allocations left unusable."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import BudgetError, UsageError


def _layers(b: graphslot.Backend, n: int = 4, width: int = 64) -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                          nn.LayerNorm(width)).to(b.device) for _ in range(n)]


def _input(b: graphslot.Backend, width: int = 64, seed: int = 5, rows: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(b.device)


def _train(b: graphslot.Backend, layers: list[nn.Module], steps: int, micro: int = 1,
           in_flight: bool = False, rows: int = 16, **kw) -> tuple[list[torch.Tensor], GraphedLayers]:
    """The parameters after ``steps`` SGD steps of ``micro`` microbatches (all forwards,
    then all backwards where ``in_flight``) of ``rows`` rows, through a stack built with
    ``kw``."""
    x0 = _input(b, rows=rows).requires_grad_()
    stack = GraphedLayers(layers, x0, backend=b, layers_per_graph=1, **kw)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.05)
    for s in range(steps):
        xs = [_input(b, seed=10 * s + k, rows=rows).requires_grad_() for k in range(micro)]
        if in_flight:
            losses = [stack(x).square().sum() for x in xs]
            for loss in reversed(losses):
                loss.backward()
            del losses
        else:
            for x in xs:
                stack(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for m in layers for p in m.parameters()], stack


def _unshared(seen: list[warnings.WarningMessage]) -> list[str]:
    """The warnings among ``seen`` that say the pages were given their memory back."""
    return [str(w.message) for w in seen if "share_pool_pages" in str(w.message)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


PLANS = {
    "kept": dict(mode="off"),
    "recomputed": dict(mode="off", recompute_layers=[0, 2]),
    "offloaded and recomputed": dict(mode="remap", offload_layers=[1, 3], recompute_layers=[0, 2]),
    "offloaded resident": dict(mode="resident"),
}


@pytest.mark.parametrize("plan", PLANS)
def test_shared_pages_train_as_the_plain_pool_does_on_no_more_memory(regions, plan):
    """Three steps of two microbatches each, every one's backward before the next forward:
    bit for bit what the plain pool trains; the pool's pages, shared, are no more than
    before and are what the ledger counts; no warning (the order held)."""
    b = regions
    layers = _layers(b)
    plain, stack = _train(b, copy.deepcopy(layers), 3, micro=2, **PLANS[plan])
    stack.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shared, stack = _train(b, layers, 3, micro=2, share_pool_pages=True, **PLANS[plan])
    assert not _unshared(seen)
    pages = stack._pages
    assert pages is not None and pages.shared and pages.pages_bytes is not None
    before, after = pages.pages_bytes
    assert after <= before and stack.pool_bytes == after == pages.pool.mapped_bytes
    assert _same(plain, shared)
    stack.close()


def test_sharing_saves_where_the_pool_never_reuses(regions):
    """Where captures never reuse a freed block's bytes (cpu), the shared pool of a stack
    whose activations outweigh its gradients holds a fraction of what the captures made:
    keeping every layer, what the backward graphs free; recomputing every layer, most."""
    b = regions
    if b.name != "cpu":
        pytest.skip("the cpu backend's graph pools never reuse bytes; elsewhere the "
                    "allocator does, and what sharing saves depends on its order")
    for kw, share in ((dict(mode="off"), 0.75), (dict(mode="off", recompute_layers=range(4)), 0.25)):
        _, stack = _train(b, _layers(b), 1, rows=1024, share_pool_pages=True, **kw)
        before, after = stack._pages.pages_bytes
        stack.close()
        assert after < share * before, kw
    stack.close()


def test_microbatches_in_flight_give_every_page_its_memory_and_still_train_right(regions):
    """Two forwards before their backwards leave the captured order: the pages get their
    own memory back first (a warning says so), with what they held, and training matches
    the plain pool bit for bit."""
    b = regions
    layers = _layers(b)
    plain, stack = _train(b, copy.deepcopy(layers), 2, micro=2, in_flight=True, mode="off")
    stack.close()
    with pytest.warns(UserWarning, match="share_pool_pages"):
        shared, stack = _train(b, layers, 2, micro=2, in_flight=True, mode="off",
                               share_pool_pages=True)
    pages = stack._pages
    assert not pages.shared
    # (its own memory again up to what the pool used, not the room a capture had)
    assert pages.pool.mapped_bytes <= pages.pages_bytes[0]
    assert _same(plain, shared)
    stack.close()


def test_a_stack_dropped_or_closed_with_a_gradient_held_gives_its_pages_back(regions):
    """A stack dropped without close() gives its pool back at the next such stack's build
    at the latest; one closed while its input's and parameters' .grad (lent from the pool)
    are still held gives it back at once, the gradients keeping their values."""
    import gc

    b = regions
    mapped = b.ledger.mapped_bytes
    _, stack = _train(b, _layers(b), 1, share_pool_pages=True, mode="remap")
    del stack
    gc.collect()
    layers = _layers(b)
    x = _input(b).requires_grad_()
    stack = GraphedLayers(layers, x, backend=b, layers_per_graph=1, mode="off", share_pool_pages=True)
    stack(x).square().sum().backward()
    held = [x.grad.clone()] + [p.grad.clone() for m in layers for p in m.parameters()]
    stack.close()
    assert b.ledger.mapped_bytes == mapped
    assert _same(held, [x.grad] + [p.grad for m in layers for p in m.parameters()])


def test_forwards_without_gradients_keep_the_pages_shared(regions):
    """A forward under torch.no_grad() between steps replays the forward graphs in order
    and owes no backward: the pages stay shared, and training matches the plain pool."""
    b = regions
    layers = _layers(b)

    def run(**kw):
        ls = copy.deepcopy(layers)
        x = _input(b).requires_grad_()
        stack = GraphedLayers(ls, x, backend=b, layers_per_graph=1, mode="off", **kw)
        opt = torch.optim.SGD([p for m in ls for p in m.parameters()], lr=0.05)
        seen = []
        for s in range(3):
            stack(_input(b, seed=s).requires_grad_()).square().sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                seen.append(stack(_input(b, seed=100 + s)).clone())
        return [p.detach().clone() for m in ls for p in m.parameters()], seen, stack

    plain, plain_seen, stack = run()
    stack.close()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        shared, shared_seen, stack = run(share_pool_pages=True)
    assert not _unshared(said)
    assert stack._pages.shared
    assert _same(plain, shared) and _same(plain_seen, shared_seen)
    stack.close()


def test_close_gives_the_pages_back(regions):
    """Closed (and its output let go), the stack holds no page of graphslot's."""
    b = regions
    mapped = b.ledger.mapped_bytes
    _, stack = _train(b, _layers(b), 1, share_pool_pages=True, mode="remap")
    assert b.ledger.mapped_bytes > mapped
    stack.close()
    assert b.ledger.mapped_bytes == mapped


def test_a_budget_builds_on_shared_pages(regions):
    """With a memory budget the planner's builds each get a pool of pages of their own
    (each build's is closed before the next) and the plan it keeps trains as the plain
    pool does with that plan."""
    b = regions
    layers = _layers(b)
    shared, stack = _train(b, copy.deepcopy(layers), 2, memory_budget="auto",
                           share_pool_pages=True)
    plan = stack.plan
    assert plan is not None and stack._pages is not None and stack._pages.shared
    kw = {"mode": plan.mode,
          "recompute_layers": [i for i, c in enumerate(plan.choices) if c == "recompute"],
          "offload_layers": [i for i, c in enumerate(plan.choices) if c == "offload"]}
    stack.close()
    if plan.mode == "off":
        kw.pop("offload_layers")
    if any(op for op in plan.recompute_ops):
        pytest.skip("the plan recomputes by kinds the explicit arguments name otherwise")
    plain, stack = _train(b, layers, 2, **kw)
    stack.close()
    assert _same(plain, shared)


def test_a_refused_budget_points_to_shared_pages_where_they_are_off(regions):
    """A budget no plan reaches is refused naming the least that builds; where the
    graphs' pool could be on shared pages and is not, the refusal says so."""
    b = regions
    for share in (False, True):
        with pytest.raises(BudgetError, match="fits it") as e:
            GraphedLayers(_layers(b), _input(b).requires_grad_(), backend=b,
                          memory_budget=1, share_pool_pages=share)
        assert ("share_pool_pages=True may fit less" in str(e.value)) is not share, str(e.value)


def test_share_pool_pages_must_be_a_bool(clean):
    b = clean
    with pytest.raises(UsageError, match="share_pool_pages"):
        GraphedLayers(_layers(b, 1), _input(b), backend=b, share_pool_pages="yes")
