"""PagedPool: a graph pool whose free pages go back between steps (same tests per backend).

On cpu a recorded graph keeps every buffer it wrote, so its pool's free bytes are those
of a graph that is gone; on cuda the allocator frees a capture's temporaries at once.
Either way the tests drop a graph, keep one of its outputs, and keep a second graph to
replay: what a framework's pool holds between steps.
"""

from __future__ import annotations

import pytest
import torch

import graphslot
from graphslot.errors import StateError, UsageError
from graphslot.offload import DriverWorker
from graphslot.paged import PagedPool, PoolState
from graphslot.planner import PlanError

from devices import spin

MiB = 1 << 20


@pytest.fixture
def pooled(clean):
    b = clean
    if not b.capabilities.region_graphs:
        pytest.skip(f"the {b.name} backend's graphs do not draw their pool from a region")
    worker = DriverWorker(b)
    made: list[PagedPool] = []

    def make(capacity: int = 256 * MiB) -> PagedPool:
        p = PagedPool(b, capacity, worker=worker)
        made.append(p)
        return p

    yield b, make
    for p in made:
        if p.state is not PoolState.CLOSED:
            p.acquire()
            assert p.close() == 0, "a test left tensors in its pool"
    worker.close()


def _capture(b: graphslot.Backend, pool: PagedPool, x: torch.Tensor):
    """A graph in the pool: big temporaries, a small output."""
    g = b.new_graph(share_pool_with=pool.graph)
    pool.grow(extra=64 * MiB)  # the cpu backend's capture runs the work in the region
    with pool.lend(), g.capture():
        t = x * 2.0
        u = t + 1.0
        out = (u * t).sum(dim=1)
    pool.grow()
    return g, out


def _kept_output(b: graphslot.Backend, pool: PagedPool, x: torch.Tensor) -> torch.Tensor:
    """An output left in the pool by a graph that is gone (its other bytes are free)."""
    gone, kept = _capture(b, pool, x)
    gone.release_pool()
    return kept


def _replays_right(g, out: torch.Tensor, x: torch.Tensor) -> None:
    """Replay ``g`` (the pool mapped), check its output, and let the graph go."""
    g.replay()
    torch.testing.assert_close(out, _expected(x), rtol=1e-5, atol=1e-3)
    g.release_pool()


def _expected(x: torch.Tensor) -> torch.Tensor:
    t = x * 2.0
    return ((t + 1.0) * t).sum(dim=1)


def _input(b: graphslot.Backend, rows: int = 1024, cols: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, cols, generator=g).to(b.device)


def test_free_pages_go_back_and_live_bytes_stay(pooled):
    b, make = pooled
    pool = make()
    x = _input(b)
    # a graph that is gone left one of its outputs in the pool, with data of its own
    kept = _kept_output(b, pool, x)
    want = _expected(x)
    kept.copy_(want)
    g, out = _capture(b, pool, x)
    pool.split_free()
    assert pool.live_bytes > 0 and pool.free_bytes > 0
    mapped = pool.mapped_bytes
    ledger_mapped = b.ledger.mapped_bytes

    ev = b.record_event(b.new_event())
    pool.release(after=[ev])
    assert pool._pending is not None
    pool._pending.result()
    assert pool.state is PoolState.RELEASED
    assert pool.mapped_bytes == pool.live_bytes < mapped
    assert b.ledger.mapped_bytes == ledger_mapped - (mapped - pool.live_bytes)
    assert pool.report()["released_bytes_last"] == mapped - pool.live_bytes
    # the live output is readable while the pool is released, its bytes intact
    assert torch.equal(kept, want)

    pool.acquire()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped
    x2 = _input(b, cols=2048) * 0.5
    x.copy_(x2)
    g.replay()
    torch.testing.assert_close(out, _expected(x2), rtol=1e-5, atol=1e-3)
    assert torch.equal(kept, want)
    del kept
    g.release_pool()
    del g, out


def test_a_chunk_with_live_and_free_bytes_is_split_keeping_the_live_bytes(pooled):
    b, make = pooled
    pool = make()
    x = _input(b)
    kept = _kept_output(b, pool, x)
    pattern = torch.arange(kept.numel(), dtype=kept.dtype).to(b.device)
    kept.copy_(pattern)
    chunks = pool.report()["chunks"]
    pool.split_free()
    assert pool.counters["split_chunks"] >= 1 and pool.report()["chunks"] > chunks
    assert torch.equal(kept, pattern)
    # every chunk is now wholly live or wholly free: the live one holds the output
    va = kept.untyped_storage().data_ptr() - pool.reservation.va
    assert any(c.live and c.offset <= va < c.end for c in pool._chunks)
    assert all(not c.live or any(c.offset <= o < c.end or o <= c.offset < o + n
                                 for o, n in pool.graph.live_ranges()) for c in pool._chunks)
    del kept


def test_an_acquire_calls_off_a_release_that_still_waits(pooled):
    b, make = pooled
    pool = make()
    x = _input(b)
    g, out = _capture(b, pool, x)
    pool.split_free()
    mapped, maps_before = pool.mapped_bytes, b.ledger.snapshot()
    s = b.new_stream()
    spin(b, 0.3, s)  # the release's event completes only after this
    ev = b.record_event(b.new_event(), s)
    pool.release(after=[ev])
    assert pool.state is PoolState.RELEASING
    pool.acquire()
    assert pool.state is PoolState.MAPPED and pool.counters["called_off"] == 1
    pool._pending.result()  # the worker saw the call-off after its wait
    assert pool.mapped_bytes == mapped and pool.counters["releases"] == 0
    assert b.ledger.snapshot() == maps_before
    # a release after the call-off is a release of its own
    pool.release(after=[b.record_event(b.new_event())])
    pool._pending.result()
    assert pool.state is PoolState.RELEASED and pool.counters["releases"] == 1
    pool.acquire()
    _replays_right(g, out, x)
    del g, out


def test_misuse_is_named_and_nothing_is_lost(pooled):
    b, make = pooled
    for bad in (0, -1, True, 1.5):
        with pytest.raises(UsageError, match="capacity"):
            PagedPool(b, bad, worker=None)  # type: ignore[arg-type]
    pool = make()
    x = _input(b)
    g, out = _capture(b, pool, x)
    pool.split_free()
    pool.release()
    pool._pending.result()
    for call in (pool.grow, pool.split_free):
        with pytest.raises(StateError, match="acquire"):
            call()
    with pytest.raises(StateError, match="acquire"):
        with pool.lend():
            pass
    pool.release()  # already released: nothing to do
    assert pool.state is PoolState.RELEASED
    pool.acquire()
    pool.acquire()  # mapped: nothing to do
    assert pool.counters["acquires"] == 1
    # a graph that still lives keeps the pool: close() says how many bytes, and keeps them
    assert pool.close() > 0 and pool.state is PoolState.MAPPED
    _replays_right(g, out, x)
    del g, out
    assert pool.close() == 0 and pool.state is PoolState.CLOSED
    with pytest.raises(StateError, match="after close"):
        pool.acquire()


def test_a_release_that_fails_leaves_the_pool_mapped_and_says_so(pooled):
    b, make = pooled
    pool = make()
    x = _input(b)
    kept = _kept_output(b, pool, x)
    kept.zero_()
    pool.split_free()
    mapped = pool.mapped_bytes
    b.faults.fail("unmap")
    pool.release()
    assert pool._pending is not None and pool._pending.exception(timeout=30) is not None
    with pytest.raises(StateError, match="release failed part way"):
        pool.acquire()
    b.faults.clear()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped
    assert torch.count_nonzero(kept) == 0
    del kept


def test_concurrent_releases_and_acquires_keep_the_pool_consistent(pooled):
    """The training thread's acquires race the worker's releases (some still waiting for
    their event, some done): after each acquire the pool is mapped, every chunk of it."""
    b, make = pooled
    pool = make()
    x = _input(b)
    g, out = _capture(b, pool, x)
    pool.split_free()
    mapped = pool.mapped_bytes
    for k in range(40):
        if k % 3 == 0:
            spin(b, 0.002)
        pool.release(after=[b.record_event(b.new_event())])
        if k % 2:
            pool._pending.result()
        pool.acquire()
        assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped
    b.synchronize()
    _replays_right(g, out, x)
    del g, out


def test_a_capture_under_headroom_keeps_only_what_it_used(pooled):
    """Room is mapped ahead of a capture (cuda's copy nodes check their addresses), and
    once the capture ends the pool maps exactly up to its high-water mark."""
    b, make = pooled
    pool = make()
    x = _input(b)
    g = b.new_graph(share_pool_with=pool.graph)
    before = pool.mapped_bytes
    with pool.headroom(96 * MiB):
        assert pool.mapped_bytes >= before + 96 * MiB
        with pool.lend(), g.capture():
            t = x * 2.0
            y = t.clone()  # a copy in the graph
            out = ((y + 1.0) * t).sum(dim=1)
    used = pool.used_bytes
    assert 0 < used <= 96 * MiB
    assert pool.mapped_bytes == -(-used // b.granularity) * b.granularity
    assert b.ledger.mapped_bytes >= pool.mapped_bytes
    g.replay()
    torch.testing.assert_close(out, _expected(x), rtol=1e-5, atol=1e-3)
    with pytest.raises(StateError, match="acquire"):
        pool.release()
        pool._pending.result()
        with pool.headroom(MiB):
            pass
    pool.acquire()
    g.release_pool()
    del g, out, t, y


def _filled_pool(b, make, pages: int) -> PagedPool:
    """A pool of twice ``pages`` pages with ``pages`` mapped, page k filled with k + 1."""
    g = b.granularity
    pool = make(2 * pages * g)
    with pool.allocating(extra=pages * g):
        pass
    for k in range(pages):
        b.alias_bytes(pool.reservation.va + k * g, g).fill_(k + 1)
    b.synchronize()
    return pool


def _page(b, pool: PagedPool, k: int) -> torch.Tensor:
    g = b.granularity
    return b.alias_bytes(pool.reservation.va + k * g, g)


def test_pages_never_live_at_once_share_memory_and_lasting_bytes_stay(pooled):
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 8)
    mapped_before, ledger_before = pool.mapped_bytes, b.ledger.mapped_bytes
    blocks = [(0, 2 * g, 0, 1),              # pages 0-1 in the first step
              (2 * g + 64, 2 * g - 64, 1, 2),  # pages 2-3 in the second: may take 0-1's
              (4 * g, 100, 0, None),          # page 4 for good: its bytes stay
              (5 * g, g, 0, 2)]               # page 5 over both; pages 6-7 untouched
    sharing = pool.share(blocks)
    assert pool.state is PoolState.SHARED and pool.report()["state"] == "shared"
    # (pages 6-7, past every block and the high-water mark, are no part of the sharing)
    assert sharing.physical_pages == 4 and len(sharing.physical) == 6
    assert {sharing.physical[2], sharing.physical[3]} == {sharing.physical[0], sharing.physical[1]}
    assert pool.mapped_bytes == 4 * g == mapped_before - 4 * g
    assert b.ledger.mapped_bytes == ledger_before - 4 * g  # (a page behind two addresses once)
    assert torch.all(_page(b, pool, 4) == 5)
    # pages that share are one memory
    other = sharing.physical.index(sharing.physical[0], 1)
    _page(b, pool, 0).fill_(77)
    b.synchronize()
    assert torch.all(_page(b, pool, other) == 77)
    # nothing allocates into a shared pool; releasing and acquiring do nothing
    for call in (pool.grow, pool.split_free, lambda: pool.share(blocks)):
        with pytest.raises(StateError, match="unshare"):
            call()
    with pytest.raises(StateError, match="unshare"):
        with pool.allocating():
            pass
    pool.release()
    pool.acquire()
    assert pool.state is PoolState.SHARED and pool.mapped_bytes == 4 * g
    # unshared, every page of the sharing has its own memory again (pages 6-7 are gone);
    # the lasting bytes stay
    pool.unshare()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped_before - 2 * g
    assert b.ledger.mapped_bytes == ledger_before - 2 * g
    assert torch.all(_page(b, pool, 4) == 5)
    _page(b, pool, 0).fill_(1)
    _page(b, pool, other).fill_(2)
    b.synchronize()
    assert torch.all(_page(b, pool, 0) == 1)
    pool.unshare()  # not shared: nothing to do
    assert pool.close() == 0 and b.ledger.mapped_bytes == ledger_before - mapped_before


def test_a_page_no_block_touches_keeps_memory_of_its_own(pooled):
    """A page under what the pool used that no block of the list covers (a segment's
    tail the allocator never handed out) shares with nothing and stays mapped: a graph's
    replay may be checked against, or touch, every byte its pool used."""
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 4)
    blocks = [(0, g, 0, 1), (2 * g, g, 1, 2), (3 * g, 64, 0, None)]  # page 1: no block
    sharing = pool.share(blocks)
    assert sharing.physical[0] == sharing.physical[2]
    assert sharing.physical[1] not in (-1, sharing.physical[0], sharing.physical[3])
    assert sharing.physical_pages == 3 and pool.mapped_bytes == 3 * g
    assert pool.reservation.is_accessible(0, 4 * g)
    _page(b, pool, 1).fill_(9)
    _page(b, pool, 0).fill_(8)
    b.synchronize()
    assert torch.all(_page(b, pool, 1) == 9) and torch.all(_page(b, pool, 3) == 4)
    pool.unshare()
    assert pool.close() == 0


def _two_captures(b: graphslot.Backend, pool: PagedPool, xs: list[torch.Tensor], keep: bool):
    """A graph in the pool per input (:func:`_expected`'s work), and per graph its
    temporaries and output: the temporaries held past its capture where ``keep``, else
    let go inside it (the output alone then)."""
    graphs, held = [], []
    for x in xs:
        gr = b.new_graph(share_pool_with=pool.graph)
        pool.grow(extra=64 * MiB)
        with pool.lend(), gr.capture():
            t = x * 2.0
            u = t + 1.0
            v = u * t
            out = v.sum(dim=1)
            temps = (t, u, v) if keep else ()
            del t, u, v
        pool.grow()
        graphs.append((gr, out))
        held.append((*temps, out))
    return graphs, held


def test_graphs_replay_right_on_shared_pages(pooled):
    """Two graphs whose temporaries are never live at once: shared, they replay as before
    on less memory."""
    b, make = pooled
    pool = make()
    xs = [_input(b, 1024, 2048), _input(b, 1024, 2048) + 1.0]
    graphs, held = _two_captures(b, pool, xs, keep=True)
    va, g = pool.reservation.va, b.granularity
    blocks = []
    for step, ts in enumerate(held):
        for k, t in enumerate(ts):
            off = t.data_ptr() - va
            assert 0 <= off < pool.capacity, "the capture allocated outside the pool"
            n = t.untyped_storage().nbytes()
            blocks.append((off, n, step, None if k == 3 else step + 1))  # outputs for good
    before = pool.mapped_bytes
    sharing = pool.share(blocks)
    assert pool.mapped_bytes < before and sharing.physical_pages >= sharing.least_pages
    for _ in range(2):
        for x, (gr, out) in zip(xs, graphs):
            gr.replay()
        for x, (gr, out) in zip(xs, graphs):
            torch.testing.assert_close(out, _expected(x), rtol=1e-5, atol=1e-3)
    pool.unshare()
    del held, t, out
    for gr, _ in graphs:
        gr.release_pool()
    del graphs


def test_a_pool_records_when_its_blocks_are_live_and_shares_by_that(pooled):
    """The blocks a pool records over two captures (their temporaries let go inside each,
    their outputs kept) are what share() takes: the outputs live for good, the temporaries
    ended, every block inside what the pool used; shared by them, both graphs replay right
    on no more memory."""
    b, make = pooled
    pool = make()
    xs = [_input(b, 1024, 2048), _input(b, 1024, 2048) + 1.0]
    with pool.graph.recording() as blocks:
        graphs, _ = _two_captures(b, pool, xs, keep=False)
        assert not blocks, "blocks are listed when recording ends"
    assert blocks
    va, used = pool.reservation.va, pool.used_bytes
    assert all(0 <= off and off + n <= used and (end is None or end > start)
               for off, n, start, end in blocks)
    ends = {off: end for off, _, _, end in blocks}
    for _, out in graphs:
        assert ends[out.untyped_storage().data_ptr() - va] is None, "a kept output ended"
    # (each capture's temporaries: three of 8 MiB, let go inside it)
    ended = [n for _, n, _, end in blocks if end is not None]
    assert len(ended) >= 6 and min(sorted(ended)[-6:]) >= 8 * MiB
    before = pool.mapped_bytes
    sharing = pool.share(blocks)
    assert pool.mapped_bytes == sharing.physical_bytes <= before
    for _ in range(2):
        for gr, _ in graphs:
            gr.replay()
        for x, (_, out) in zip(xs, graphs):
            torch.testing.assert_close(out, _expected(x), rtol=1e-5, atol=1e-3)
    pool.unshare()
    for gr, _ in graphs:
        gr.release_pool()
    del graphs, out


def test_unsharing_that_keeps_all_keeps_what_every_page_holds(pooled):
    """unshare(keep_all=True) copies every page as it reads: an output whose block was not
    live for good keeps the bytes its last replay wrote."""
    b, make = pooled
    pool = make()
    x = _input(b)
    with pool.graph.recording() as blocks:
        g, out = _capture(b, pool, x)
    # (every block, the kept output too, live over the round's first step only)
    pool.share([(off, n, 0, 1) for off, n, _, _ in blocks])
    g.replay()
    want = out.clone()
    pool.unshare(keep_all=True)
    assert pool.state is PoolState.MAPPED
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(out, _expected(x), rtol=1e-5, atol=1e-3)
    g.release_pool()
    del out


def test_what_the_process_holds_counts_a_region_pool_once(pooled):
    """held_bytes (what a budget counts): a region pool's segments are the allocator's
    reserved bytes and, as pages, graphslot's mapped bytes; counted once."""
    from graphslot.profile import held_bytes

    b, make = pooled
    if held_bytes(b) is None:
        pytest.skip(f"the {b.name} backend's allocator keeps no figures")
    pool = make()
    before = held_bytes(b)
    g, out = _capture(b, pool, _input(b, 4096, 2048))
    grown = held_bytes(b) - before
    assert pool.used_bytes >= 64 * MiB
    assert pool.mapped_bytes <= grown < pool.mapped_bytes + pool.used_bytes // 2
    g.release_pool()
    del out


def test_one_recording_at_a_time(pooled):
    b, make = pooled
    pool = make()
    with pool.graph.recording():
        with pytest.raises(UsageError, match="recording"):
            with pool.graph.recording():
                pass


def test_blocks_that_are_no_blocks_leave_the_pool_as_it_was(pooled):
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 2)
    mapped = pool.mapped_bytes
    for bad in ([(0, 3 * g, 0, 1)], [(0, g, 2, 1)], [(0, 0, 0, 1)]):
        with pytest.raises(PlanError, match="block #0"):
            pool.share(bad)
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped
    assert torch.all(_page(b, pool, 1) == 2)


@pytest.mark.parametrize("op, after", [("create", 1), ("map", 1), ("set_access", 0)])
def test_a_share_that_fails_part_way_maps_every_page_again_and_says_so(pooled, op, after):
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 4)
    mapped, allocations = pool.mapped_bytes, len(b.ledger.allocations)
    blocks = [(0, g, 0, 1), (g, g, 1, 2), (2 * g, 2 * g, 0, None)]
    b.faults.fail(op, after=after)  # (the pages are one run: one set_access)
    with pytest.raises(StateError, match="failed part way"):
        pool.share(blocks)
    b.faults.clear()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped
    assert len(b.ledger.allocations) == allocations  # (one chunk for the old ones: no leak)
    assert torch.all(_page(b, pool, 2) == 3) and torch.all(_page(b, pool, 3) == 4)
    assert pool.share(blocks).physical_pages == 3
    pool.unshare()


def test_bytes_still_handed_out_must_be_in_a_block(pooled):
    """A tensor the pool still hands out, left out of the blocks: refused, nothing moved."""
    b, make = pooled
    pool = make()
    kept = _kept_output(b, pool, _input(b))
    want = kept.clone()
    mapped = pool.mapped_bytes
    with pytest.raises(PlanError, match="still handed out"):
        pool.share([])
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == mapped
    off = kept.data_ptr() - pool.reservation.va
    pool.share([(off, kept.untyped_storage().nbytes(), 0, None)])  # listed: kept for good
    assert torch.equal(kept, want)
    pool.unshare()
    assert torch.equal(kept, want)
    del kept


def test_an_empty_pool_shares_and_unshares(pooled):
    b, make = pooled
    pool = make()
    assert pool.share([]).physical_pages == 0 and pool.mapped_bytes == 0
    pool.unshare()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == 0


@pytest.mark.parametrize("op", ["unmap", "release", "create"])
def test_an_unshare_that_fails_part_way_maps_every_page_again_and_says_so(pooled, op):
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 4)
    pool.share([(0, g, 0, 1), (g, g, 1, 2), (2 * g, 2 * g, 0, None)])
    b.faults.fail(op)
    with pytest.raises(StateError, match="unsharing failed part way"):
        pool.unshare()
    b.faults.clear()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == 4 * g
    assert torch.all(_page(b, pool, 2) == 3) and torch.all(_page(b, pool, 3) == 4)


def test_a_close_that_fails_while_shared_can_be_tried_again(pooled):
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 4)
    pool.share([(0, g, 0, 1), (g, g, 1, 2), (2 * g, 2 * g, 0, None)])
    b.faults.fail("unmap", after=1)
    with pytest.raises(Exception):
        pool.close()
    b.faults.clear()
    assert pool.state is PoolState.SHARED
    assert pool.close() == 0 and pool.state is PoolState.CLOSED  # (the fixture checks the ledger)


def test_a_copy_back_that_fails_leaves_the_books_right(pooled, monkeypatch):
    b, make = pooled
    g = b.granularity
    pool = _filled_pool(b, make, 4)

    def fails(saved):
        raise RuntimeError("copy back failed")

    monkeypatch.setattr(pool, "_restore_pages", fails)
    with pytest.raises(RuntimeError, match="copy back"):
        pool.share([(0, g, 0, 1), (g, g, 1, 2), (2 * g, 2 * g, 0, None)])
    assert pool.state is PoolState.SHARED and pool.mapped_bytes == 3 * g
    with pytest.raises(RuntimeError, match="copy back"):
        pool.unshare()
    assert pool.state is PoolState.MAPPED and pool.mapped_bytes == 4 * g
    monkeypatch.undo()
    assert pool.close() == 0
