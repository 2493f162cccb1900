"""benchmarks/build_memory.py's figures for a graphs' pool, on synthetic allocator events:
the lifetime layout and the pages that could share physical memory."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MiB = 1 << 20
S1, S2 = 0x10000000, 0x20000000


def _load():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("build_memory", REPO / "benchmarks" / "build_memory.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod


bm = _load()


def shared(events, segs):
    """build_memory's page-sharing figure, from the history as it reads it."""
    return bm.shared_pages(*bm.pool_blocks(events, segs))


def laid_out(events, segs):
    """build_memory's lifetime-layout figure, from the history as it reads it."""
    return bm.lifetime_layout(bm.pool_blocks(events, segs)[0], len(events) + 1)


class Events(list):
    def segment(self, addr):
        self.append(dict(action="segment_alloc", addr=addr))
        return len(self) - 1

    def alloc(self, addr, size):
        self.append(dict(action="alloc", addr=addr, size=size))

    def free(self, addr, completed=True):
        self.append(dict(action="free_requested", addr=addr))
        if completed:
            self.append(dict(action="free_completed", addr=addr))

    def completed(self, addr):
        self.append(dict(action="free_completed", addr=addr))


def test_segments_used_at_different_times_share_their_pages():
    ev = Events()
    m1, m2 = ev.segment(S1), ev.segment(S2)
    ev.alloc(S1, 8 * MiB), ev.free(S1), ev.alloc(S2 + 2 * MiB, 6 * MiB), ev.free(S2 + 2 * MiB)
    segs = [(S1, S1 + 8 * MiB, m1), (S2, S2 + 8 * MiB, m2)]
    assert shared(ev, segs) == (8 * MiB, 8 * MiB)


def test_pages_live_at_once_or_never_freed_do_not_share():
    ev = Events()
    m1, m2 = ev.segment(S1), ev.segment(S2)
    ev.alloc(S1, 8 * MiB), ev.alloc(S2, 3 * MiB), ev.free(S1)  # S2's block is never freed
    ev.alloc(S1, 2 * MiB), ev.free(S1)
    segs = [(S1, S1 + 8 * MiB, m1), (S2, S2 + 8 * MiB, m2)]
    # the 3 MiB block touches two pages; they overlap the first block and the last one
    assert shared(ev, segs) == (12 * MiB, 12 * MiB)
    arena, peak = laid_out(ev, segs)
    assert (arena, peak) == (11 * MiB, 11 * MiB)


def test_blocks_outside_the_pool_or_before_its_segment_do_not_count():
    ev = Events()
    ev.alloc(S1, 8 * MiB), ev.free(S1)  # an eager block at an address a segment takes later
    m1 = ev.segment(S1)
    ev.alloc(S2, 64 * MiB), ev.free(S2)  # outside every pool segment
    ev.alloc(S1, 4 * MiB), ev.free(S1)
    assert shared(ev, [(S1, S1 + 8 * MiB, m1)]) == (4 * MiB, 4 * MiB)


def test_the_sharing_of_a_real_looking_history_is_safe_and_within_its_bounds():
    import random

    from graphslot.planner import share_pages

    rng = random.Random(3)
    ev = Events()
    made = ev.segment(S1)
    live = {}
    for _ in range(600):
        if live and rng.random() < 0.5:
            a = rng.choice(sorted(live))
            ev.free(a, completed=rng.random() < 0.9)  # (some frees never complete)
            del live[a]
            continue
        a, size = S1 + rng.randrange(32) * 2 * MiB, rng.randint(1, 6) * MiB
        if a + size <= S1 + 64 * MiB and all(a + size <= b or b + s <= a for b, s in live.items()):
            live[a] = size
            ev.alloc(a, size)
    blocks, size = bm.pool_blocks(ev, [(S1, S1 + 64 * MiB, made)])
    assert size == 64 * MiB and any(end is None for *_, end in blocks)
    got = share_pages(blocks, size, 2 * MiB)
    for pages in got.sharing().values():  # no two pages of one physical page live at once
        for t in range(len(ev) + 2):
            on = [p for p in pages for off, n, s, e in blocks
                  if off // (2 * MiB) <= p <= (off + n - 1) // (2 * MiB) and s <= t and (e is None or t < e)]
            assert len(set(on)) <= 1, (pages, t)
    assert shared(ev, [(S1, S1 + 64 * MiB, made)]) == (got.physical_bytes, got.least_bytes)
    assert got.least_bytes <= got.physical_bytes <= size


def test_a_deferred_free_keeps_its_pages_live_until_it_completes():
    ev = Events()
    m1, m2 = ev.segment(S1), ev.segment(S2)
    ev.alloc(S1, 8 * MiB), ev.free(S1, completed=False)
    ev.alloc(S2, 8 * MiB), ev.free(S2)
    ev.completed(S1)  # (the captures deferred it past S2's whole life)
    segs = [(S1, S1 + 8 * MiB, m1), (S2, S2 + 8 * MiB, m2)]
    assert shared(ev, segs) == (16 * MiB, 16 * MiB)
    assert laid_out(ev, segs) == (16 * MiB, 16 * MiB)
