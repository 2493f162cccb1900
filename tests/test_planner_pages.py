"""share_pages: pages of one address range backed by shared physical pages, only where
they are never live at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphslot.planner import PageSharing, PlanError, share_pages

P = 4096  # a page, small to keep the examples readable


def _live_at(blocks, page, t):
    """Whether ``page`` is live over the step [t, t+1), from the blocks alone."""
    return any(off // P <= page <= (off + n - 1) // P and start <= t and (end is None or t < end)
               for off, n, start, end in blocks)


def _check_safe(blocks, got: PageSharing):
    horizon = max([s for _, _, s, _ in blocks] + [e for *_, e in blocks if e is not None] + [0]) + 1
    for phys, pages in got.sharing().items():
        for t in range(-1, horizon + 1):
            live = [p for p in pages if _live_at(blocks, p, t)]
            assert len(live) <= 1, f"physical page {phys} backs pages {live} live at step {t}"
    touched = {p for off, n, *_ in blocks for p in range(off // P, (off + n - 1) // P + 1)}
    assert {p for p, ph in enumerate(got.physical) if ph >= 0} == touched
    assert got.least_pages <= got.physical_pages <= len(touched)
    assert got.physical_pages == len(got.sharing())


def test_pages_live_at_different_times_share_and_the_rest_do_not():
    blocks = [(0, 2 * P, 0, 2),          # pages 0, 1 over [0, 2)
              (2 * P + 100, P, 1, 3),    # pages 2, 3 (it straddles them) over [1, 3)
              (6 * P, 2 * P, 2, 4),      # pages 6, 7 over [2, 4): may take 0 and 1's
              (9 * P, 10, 0, None)]      # page 9 for good: shares with nothing
    got = share_pages(blocks, 10 * P, P)
    _check_safe(blocks, got)
    assert got.physical[4] == got.physical[5] == got.physical[8] == -1
    assert {got.physical[6], got.physical[7]} == {got.physical[0], got.physical[1]}
    assert got.physical_pages == got.least_pages == 5
    assert got.physical_bytes == 5 * P


def test_a_page_is_live_while_any_block_on_it_is():
    # two blocks on one page, one after the other: the page is live over both, so the
    # page of a block live with the second cannot share it
    blocks = [(0, 100, 0, 1), (P, P, 2, 3), (200, 100, 2, 3)]
    got = share_pages(blocks, 2 * P, P)
    _check_safe(blocks, got)
    assert got.physical[0] != got.physical[1] and got.physical_pages == 2
    # without the second block the pages share
    assert share_pages(blocks[:2], 2 * P, P).physical_pages == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 20), st.integers(1, 6)),
                min_size=1, max_size=30))
def test_one_interval_a_page_takes_the_fewest_pages(spans):
    """Page-aligned blocks of one page each, a page used once: an interval graph, which
    the first-use order colours exactly."""
    blocks = [(i * P, P, s, s + d) for i, (_, s, d) in enumerate(spans)]
    got = share_pages(blocks, len(blocks) * P, P)
    _check_safe(blocks, got)
    assert got.physical_pages == got.least_pages


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40 * P - 1), st.integers(1, 5 * P),
                          st.integers(0, 30), st.one_of(st.none(), st.integers(1, 10))),
                min_size=1, max_size=40))
def test_any_blocks_get_a_safe_sharing(raw):
    blocks = [(off, min(n, 45 * P - off), s, None if d is None else s + d) for off, n, s, d in raw]
    got = share_pages(blocks, 45 * P, P)
    _check_safe(blocks, got)


@pytest.mark.parametrize("blocks, size, page, says", [
    ([(0, 10, 0, 1)], 10, 0, "page_bytes"),
    ([(0, 10, 0, 1)], -1, P, "size"),
    ([(5, 10, 0, 1)], 10, P, "block #0: offset 5 and nbytes 10"),
    ([(0, 0, 0, 1)], 10, P, "nbytes 0"),
    ([(0, 10, 1, 1)], 10, P, "block #0: live over [1, 1)"),
    ([(0, 10, 0, 1), (0, 10, 2.0, 3)], 10, P, "block #1"),
    ([(0, 10, 0)], 10, P, "expected (offset, nbytes, start, end)"),
])
def test_bad_blocks_are_refused_naming_them(blocks, size, page, says):
    with pytest.raises(PlanError, match=says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        share_pages(blocks, size, page)


def test_nothing_live_maps_nothing():
    got = share_pages([], 3 * P, P)
    assert got.physical == (-1, -1, -1) and got.physical_pages == got.least_pages == 0
