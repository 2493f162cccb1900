"""The backend conformance suite: runs unchanged against whichever backend is selected."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import graphslot
from graphslot import align_up
from graphslot.backend import FEATURE_HOOKS, Backend, Capabilities, DeviceVendor, VmmDriver
from graphslot.errors import DriverError, InjectedFault, UsageError

from devices import spin

MiB = 1 << 20


def footprint(b: graphslot.Backend) -> dict[str, int]:
    """What the backend really holds outside graphslot's ledger, to catch leaks."""
    if b.name == "cpu":
        fds = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds += "memfd:graphslot" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        shm = 0
        with open("/proc/self/maps") as f:
            for line in f:
                if "memfd:graphslot" in line:
                    a, c = line.split()[0].split("-")
                    shm += int(c, 16) - int(a, 16)
        return {"memfd_fds": fds, "memfd_mapped_bytes": shm}
    free, _ = b.mem_info()
    # Round to 64 MiB: the driver's figure moves a little with unrelated activity.
    return {"free_64mib": round(free / (64 * MiB))}


def resident_bytes(b: graphslot.Backend) -> int:
    """Memory actually backing this process's (cpu) or device's (gpu) pages."""
    if b.name == "cpu":
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    free, total = b.mem_info()
    return total - free


def checksum(t: torch.Tensor) -> int:
    return int(t.detach().reshape(-1).view(torch.uint8).to(torch.int64).mul(
        torch.arange(1, t.numel() * t.element_size() + 1, device=t.device) % 251 + 1).sum())


def random_bytes(n: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


# --------------------------------------------------------------------------- address stability


def test_va_identical_across_many_remap_cycles(clean):
    b = clean
    size = 4 * b.granularity
    res = b.reserve(size)
    view = b.tensor_at(res.va, (size // 4,), torch.int32)
    try:
        for i in range(40):
            b.map_new(res, 0, size)
            view.fill_(i)
            assert view.data_ptr() == res.va
            assert int(view[0]) == i and int(view[-1]) == i
            b.unmap_release(res, 0)
        assert b.tensor_at(res.va, (8,), torch.int32).data_ptr() == res.va
    finally:
        b.free(res)


def test_one_allocation_at_two_addresses_is_one_memory_and_counts_once(clean):
    """A page mapped at two addresses of a reservation: a write through one reads through
    the other, and the ledger counts its bytes once while any mapping remains."""
    b = clean
    g = b.granularity
    res = b.reserve(2 * g)
    alloc = b.create(g)
    mapped = b.ledger.mapped_bytes
    try:
        b.map(res, 0, alloc)
        b.map(res, g, alloc)
        b.set_access(res, 0, 2 * g)
        assert b.ledger.mapped_bytes == mapped + g
        b.tensor_at(res.va, (g // 4,), torch.int32).fill_(7)
        b.synchronize()
        assert int(b.tensor_at(res.va + g, (g // 4,), torch.int32)[-1]) == 7
        b.unmap(res, 0, g)
        assert b.ledger.mapped_bytes == mapped + g
        b.unmap(res, g, g)
        assert b.ledger.mapped_bytes == mapped
    finally:
        for off in list(res.mappings):
            b.unmap(res, off, g)
        b.release(alloc)
        b.free(res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_tensor_at_is_zero_copy_for_dtypes_and_strides(clean, dtype):
    b = clean
    res, alloc = b.reserve_mapped(b.granularity)
    try:
        t = b.tensor_at(res.va, (4, 6), dtype)
        assert t.data_ptr() == res.va and t.device.type == b.device.type
        assert t.shape == (4, 6) and t.dtype == dtype and t.is_contiguous()
        tt = b.tensor_at(res.va, (6, 4), dtype, stride=(1, 6))
        t.copy_(torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype))
        assert torch.equal(tt.cpu(), t.cpu().t())
    finally:
        b.unmap_release(res, 0)
        b.free(res)


# --------------------------------------------------------------------------- data round trips


@pytest.mark.parametrize("granules,extra", [(1, 0), (3, 0), (1, -1000), (5, -4096 + 8), (2, -1)])
def test_device_host_device_roundtrip_keeps_bytes(clean, granules, extra):
    """D2H to pinned host, release, map new backing at the same VA, H2D: same bytes."""
    b = clean
    nbytes = granules * b.granularity + extra
    size = align_up(nbytes, b.granularity)
    res, alloc = b.reserve_mapped(size)
    copy = b.new_stream()
    try:
        slot = b.tensor_at(res.va, (nbytes,), torch.uint8)
        src = random_bytes(nbytes, b.device, seed=nbytes)
        slot.copy_(src)
        want = checksum(src)
        host = b.pinned_empty(nbytes)
        ready = b.record_event(b.new_event())
        b.wait_event(copy, ready)
        b.copy_async(host, slot, copy)
        done = b.record_event(b.new_event(), copy)
        b.synchronize_event(done)
        b.unmap_release(res, 0)
        b.map_new(res, 0, size)
        b.copy_async(slot, host, copy)
        b.synchronize_event(b.record_event(b.new_event(), copy))
        assert slot.data_ptr() == res.va
        assert checksum(slot) == want
        assert torch.equal(slot.cpu(), src.cpu())
    finally:
        b.unmap_release(res, 0)
        b.free(res)


def test_device_to_device_copy_on_stream(clean):
    b = clean
    res, _ = b.reserve_mapped(2 * b.granularity)
    try:
        a = b.tensor_at(res.va, (b.granularity // 4,), torch.float32)
        c = b.tensor_at(res.va + b.granularity, (b.granularity // 4,), torch.float32)
        a.copy_(torch.linspace(0, 1, a.numel()))
        s = b.new_stream()
        b.wait_event(s, b.record_event(b.new_event()))
        b.copy_async(c, a, s)
        b.synchronize_event(b.record_event(b.new_event(), s))
        assert torch.equal(a.cpu(), c.cpu())
    finally:
        b.unmap_release(res, 0)
        b.free(res)


# --------------------------------------------------------------------------- events and streams


def test_event_ordering_holds_while_one_copy_is_slowed(clean):
    b = clean
    n = 1 << 16
    src = random_bytes(n, b.device, 7)
    mid = torch.zeros(n, dtype=torch.uint8, device=b.device)
    dst = torch.zeros(n, dtype=torch.uint8, device=b.device)
    slow, fast = b.new_stream(), b.new_stream()
    b.wait_event(slow, b.record_event(b.new_event()))
    spin(b, 0.3, slow)  # artificially slow the first copy
    b.copy_async(mid, src, slow)
    first = b.record_event(b.new_event(), slow)
    assert not b.query_event(first), "the slowed stream finished too early to test ordering"
    b.wait_event(fast, first)
    b.copy_async(dst, mid, fast)
    second = b.record_event(b.new_event(), fast)
    b.synchronize_event(second)
    assert b.query_event(first)
    assert torch.equal(dst.cpu(), src.cpu())


def _needs_graph_events(b: graphslot.Backend) -> None:
    if not b.graph_events:
        pytest.skip(f"the {b.name} backend's graphs cannot record or wait on events")


def _captured(b: graphslot.Backend, body) -> graphslot.DeviceGraph:
    g = b.new_graph()
    with g.capture(b.side_stream()):
        body()
    return g


def test_a_graph_waits_inside_for_the_record_queued_before_each_replay(clean):
    b = clean
    _needs_graph_events(b)
    n = 1 << 16
    ev = b.new_graph_event()
    src = torch.zeros(n, dtype=torch.uint8, device=b.device)
    out = torch.zeros_like(src)

    def body():
        b.graph_wait(ev)
        out.copy_(src)

    g = _captured(b, body)
    b.synchronize()
    copy = b.new_stream()
    for seed in (1, 2):  # each replay waits for the record queued before it
        want = random_bytes(n, b.device, seed)
        spin(b, 0.2, copy)  # the copy that fills src starts late
        b.copy_async(src, want, copy)
        b.record_event(ev, copy)
        g.replay()
        b.synchronize()
        assert torch.equal(out.cpu(), want.cpu())


def test_a_wait_outside_waits_for_the_record_inside_the_replay(clean):
    b = clean
    _needs_graph_events(b)
    n = 1 << 16
    ev = b.new_graph_event()
    flag = torch.zeros(n, dtype=torch.uint8, device=b.device)
    ones = torch.ones_like(flag)
    seen = torch.zeros_like(flag)

    def body():
        spin(b, 0.2)  # (on a device: a kernel of the graph; on cpu: at capture only)
        flag.copy_(ones)
        b.graph_record(ev)
        spin(b, 0.2)
        flag.zero_()  # well after the record: the wait outside must not need it

    g = _captured(b, body)
    b.synchronize()
    flag.fill_(7)
    copy = b.new_stream()
    g.replay()
    b.wait_event(copy, ev)
    b.copy_async(seen, flag, copy)
    b.synchronize()
    # Never before the record (7). On a device, between the record and the zeroing; on cpu
    # the replay ran to its end on the host before the wait was queued.
    assert torch.equal(seen.cpu(), (ones if b.name != "cpu" else torch.zeros_like(ones)).cpu())


def test_a_graph_waits_for_the_record_at_its_launch_not_for_a_later_one(clean):
    """The later record waits for the graph's own record node: waiting for it from inside
    the graph would never end."""
    b = clean
    _needs_graph_events(b)
    a, r = b.new_graph_event(), b.new_graph_event()
    x = torch.ones(1 << 10, device=b.device)
    y = torch.zeros_like(x)

    def body():
        b.graph_wait(a)
        y.copy_(x)
        b.graph_record(r)

    g = _captured(b, body)
    copy = b.new_stream()
    b.record_event(a, copy)
    b.synchronize()
    spin(b, 0.2)  # the graph starts after the host queued what follows
    g.replay()
    b.wait_event(copy, r)
    b.copy_async(x, torch.full_like(x, 2.0), copy)
    b.record_event(a, copy)
    done = b.record_event(b.new_event())
    deadline = time.monotonic() + 20
    while not b.query_event(done):
        assert time.monotonic() < deadline, "the graph waited for a record queued after its launch"
        time.sleep(0.01)
    b.synchronize()
    assert torch.all(y.cpu() == 1.0)


def test_graph_events_are_refused_where_they_cannot_be(clean, monkeypatch):
    b = clean
    if b.graph_events:
        with pytest.raises(UsageError, match="no capture is under way"):
            b.graph_record(b.new_graph_event())
        with pytest.raises(UsageError, match="no capture is under way"):
            b.graph_wait(b.new_graph_event())
        g = b.new_graph()
        with pytest.raises(UsageError, match="before the capture that uses them"):
            with g.capture(b.side_stream()):
                b.new_graph_event()
    monkeypatch.setattr(b, "capabilities", dataclasses.replace(b.capabilities, graph_events=False))
    with pytest.raises(UsageError, match="graphs cannot record or wait on events"):
        b.new_graph_event()


@pytest.mark.parametrize("shared", [False, True], ids=["own-pool", "shared-pool"])
def test_a_capture_that_fails_leaves_the_backend_as_it_was(clean, shared):
    """A capture whose body raises passes the error on and leaves the backend working: the
    caller's stream is current again, random numbers draw eagerly as before the capture,
    and a graph captured next (into the same pool, where pools are shared) replays right."""
    b = clean
    x = torch.ones(1 << 12, device=b.device)
    first = _captured(b, lambda: x.mul_(1)) if shared else None
    before = b.current_stream()
    g = b.new_graph(share_pool_with=first)
    with pytest.raises(RuntimeError, match="the body stopped"):
        with g.capture(b.side_stream()):
            torch.rand(16, device=b.device)  # the capture takes over the generator
            held = x * 3  # and its pool holds a block
            raise RuntimeError("the body stopped")
    del held
    assert b.current_stream() == before
    torch.manual_seed(1)
    drawn = torch.rand(64, device=b.device)
    torch.manual_seed(1)
    assert torch.equal(drawn, torch.rand(64, device=b.device))
    y = torch.zeros_like(x)
    g2 = b.new_graph(share_pool_with=first)
    with g2.capture(b.side_stream()):
        y.copy_(x * 5 + torch.rand_like(x))
    for _ in range(2):
        y.zero_()
        g2.replay()
    b.synchronize()
    assert torch.all((y.cpu() >= 5) & (y.cpu() < 6))


def test_a_random_stream_sought_where_the_default_generator_was_draws_what_a_graph_drew(clean):
    """What a recomputed layer relies on: a graph drawing from the default generator draws
    what eager draws from there; a graph on a random stream, sought to
    ``framework_position()`` taken before that replay, draws the same again; the next
    replay draws fresh numbers."""
    b = clean
    rng = b.new_rng_stream()
    if rng is None:
        pytest.skip(f"the {b.name} backend's graphs have no random stream of their own")
    x = torch.ones(1 << 14, device=b.device)
    drew: list[torch.Tensor] = []
    plain = _captured(b, lambda: drew.append(torch.nn.functional.dropout(x, 0.5)))
    again = b.new_graph()
    rng.attach(again)
    with again.capture(b.side_stream()), rng.drawing():
        redrawn = torch.nn.functional.dropout(x, 0.5)
    masks = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        eager = torch.nn.functional.dropout(x, 0.5)
        torch.manual_seed(seed)
        at = rng.framework_position()
        plain.replay()
        redrawn.zero_()
        rng.seek(at)
        again.replay()
        b.synchronize()
        assert torch.equal(drew[0], eager) and torch.equal(redrawn, eager), seed
        masks.append(eager == 0)
        plain.replay()  # the default generator moved on: fresh numbers
        b.synchronize()
        assert not torch.equal(drew[0], eager)
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


def test_ordinary_capture_arguments_follow_the_region_graphs_capability(clean, monkeypatch):
    """Where the backend declares region graphs, an ordinary graph captures with the
    arguments the vendor gives (and captures); elsewhere there are none, and the vendor's
    hook is never asked."""
    b = clean
    if b.capabilities.region_graphs:
        kw = b.ordinary_capture_kwargs()
        assert isinstance(kw, dict)
        x = torch.zeros(4, device=b.device)
        g = b.new_graph()
        with g.capture(**kw):
            x.add_(1)
        g.replay()
        b.synchronize()
        assert torch.all(x.cpu() >= 1)
    monkeypatch.setattr(b, "capabilities", dataclasses.replace(b.capabilities, region_graphs=False))
    monkeypatch.setattr(b, "vendor_region_capture_kwargs", lambda: pytest.fail("asked"), raising=False)
    assert b.ordinary_capture_kwargs() == {}


def test_a_warmed_stream_keeps_its_library_state_in_memory_of_its_own(clean):
    """vendor_warm_stream (run on the side stream when it is made): the matmul workspaces
    a stream keeps for good take segments of their own, so a large block cached for the
    stream before its first matmul goes back to the driver afterwards."""
    b = clean
    if b.name != "cuda":
        pytest.skip("only the cuda backend has per-stream library state to make")
    s = b.new_stream()
    b.vendor_warm_stream(s)
    with torch.cuda.stream(s):
        big = torch.empty(512 << 20, dtype=torch.uint8, device=b.device)
        del big  # (cached for the stream)
        a = torch.ones(256, 256, device=b.device, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(a, a).float().sum().backward()
        del a
    s.synchronize()
    torch.cuda.empty_cache()
    mine = [seg for seg in torch.cuda.memory_snapshot() if seg["stream"] == s.cuda_stream]
    assert mine, "the warm-up made no state for the stream"
    held = sum(seg["total_size"] for seg in mine)
    live = sum(blk["size"] for seg in mine for blk in seg["blocks"] if blk["state"] != "inactive")
    assert held == live, f"{held - live} free bytes held for the stream"


def test_timing_events_measure_queued_work(clean):
    b = clean
    s = b.new_stream()
    a, e = b.new_event(timing=True), b.new_event(timing=True)
    b.record_event(a, s)
    spin(b, 0.05, s)
    b.record_event(e, s)
    b.synchronize_event(e)
    assert 30 <= b.elapsed_ms(a, e) < 2000


def test_unrecorded_event_counts_as_complete(clean):
    b = clean
    ev = b.new_event()
    assert b.query_event(ev)
    b.synchronize_event(ev)
    b.wait_event(b.new_stream(), ev)


def test_an_event_recorded_again_after_its_handle_is_dropped_keeps_earlier_waits(clean):
    """Events without timing are reused once their handle is gone: a new handle reads as
    unrecorded although its event's last record is still pending, and a wait queued on
    the old record still orders what follows it after that record's work."""
    b = clean
    n = 1 << 16
    src = random_bytes(n, b.device, 11)
    mid = torch.zeros(n, dtype=torch.uint8, device=b.device)
    dst = torch.zeros(n, dtype=torch.uint8, device=b.device)
    slow, fast, idle = b.new_stream(), b.new_stream(), b.new_stream()
    b.wait_event(slow, b.record_event(b.new_event()))
    spin(b, 0.3, slow)
    b.copy_async(mid, src, slow)
    first = b.record_event(b.new_event(), slow)
    inner = first.event
    b.wait_event(fast, first)  # queued on the pending record
    del first  # nothing refers to the handle: its event goes back to the free list
    again = b.new_event()
    assert again.event is inner, "a dropped handle's event was not reused"
    assert b.query_event(again), "a new handle must read as unrecorded, not as its event's old record"
    b.wait_event(b.new_stream(), again)  # nothing to wait for: returns at once
    b.record_event(again, idle)  # re-recorded on an idle stream: done at once
    b.synchronize_event(again)
    b.copy_async(dst, mid, fast)  # still after the slowed copy, through the earlier wait
    b.synchronize_event(b.record_event(b.new_event(), fast))
    assert torch.equal(dst.cpu(), src.cpu())


def test_a_record_that_fails_leaves_a_lent_event_unrecorded(clean):
    """A reused event whose record was refused must not read as its old, pending record."""
    b = clean
    slow = b.new_stream()
    spin(b, 0.3, slow)
    first = b.record_event(b.new_event(), slow)
    inner = first.event
    del first
    h = b.new_event()
    assert h.event is inner
    with pytest.raises(Exception):
        b.record_event(h, object())  # not a stream
    assert not h.recorded and b.query_event(h), "the failed record left the old one showing"
    b.synchronize()


def test_timing_events_are_never_lent(clean):
    b = clean
    a = b.new_event(timing=True)
    assert not isinstance(a, graphslot.backend.LentEvent)
    kept = b.new_event()
    assert isinstance(kept, graphslot.backend.LentEvent) and not kept.recorded


def test_current_stream_and_stream_context(clean):
    b = clean
    s = b.new_stream()
    before = b.current_stream()
    with b.stream(s):
        assert b.current_stream() == s
        s2 = b.new_stream()
        with b.stream(s2):
            assert b.current_stream() == s2 and b.current_stream() != s
        assert b.current_stream() == s
    assert b.current_stream() == before
    # The current stream is each thread's own: another thread's context does not leak.
    seen: list = []
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with b.stream(s):
            seen.append(b.current_stream())
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(10)
    try:
        assert seen == [s] and b.current_stream() == before
    finally:
        leave.set()
        t.join()


def test_the_side_stream_is_one_stream_of_its_own_for_the_backend(clean):
    """Eager side work (warm-ups) shares one stream per backend, even from several
    threads, and it is not the stream work is issued on by default."""
    b = clean
    got: list = []
    ts = [threading.Thread(target=lambda: got.append(b.side_stream())) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s = b.side_stream()
    assert all(x is s for x in got) and s != b.current_stream()
    with b.stream(s):  # work queued on it runs and can be waited for
        x = torch.ones(1024, device=b.device) * 3
    b.synchronize_event(b.record_event(b.new_event(), s))
    assert float(x.sum()) == 3 * 1024


def test_the_side_stream_is_warmed_once_before_any_thread_gets_it(clean, monkeypatch):
    """side_stream() makes the stream's library state (vendor_warm_stream) once, before
    it hands the stream to any thread; made under a capture, it waits for a call outside."""
    b = clean
    warmed: list = []

    def warm(s) -> None:
        time.sleep(0.05)  # (the other threads ask meanwhile)
        warmed.append(s)

    monkeypatch.setattr(b, "vendor_warm_stream", warm)
    monkeypatch.setattr(b, "_side", None)
    monkeypatch.setattr(b, "_side_warm", False)
    got: list = []
    ts = [threading.Thread(target=lambda: got.append((b.side_stream(), len(warmed))))
          for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s = b.side_stream()
    assert warmed == [s] and got == [(s, 1)] * 4
    monkeypatch.setattr(b, "_side", None)
    monkeypatch.setattr(b, "_side_warm", False)
    monkeypatch.setattr(b, "vendor_is_capturing", lambda: True)
    s = b.side_stream()
    assert len(warmed) == 1, "warmed under a capture"
    monkeypatch.setattr(b, "vendor_is_capturing", lambda: False)
    assert b.side_stream() is s and warmed[1:] == [s]


# --------------------------------------------------------------------------- memory returns


def test_released_memory_really_returns(clean):
    b = clean
    size = align_up((64 if b.name == "cpu" else 512) * MiB, b.granularity)
    before = resident_bytes(b)
    res, alloc = b.reserve_mapped(size)
    b.tensor_at(res.va, (size,), torch.uint8).fill_(1)  # touch every page
    b.synchronize()
    held = resident_bytes(b)
    b.unmap(res, 0, size)
    b.release(alloc)
    b.synchronize()
    after = resident_bytes(b)
    b.free(res)
    assert held - before >= 0.9 * size, f"mapping {size} bytes raised usage by only {held - before}"
    assert held - after >= 0.9 * size, f"release returned only {held - after} of {size} bytes"


def test_unmap_keeps_reservation_and_memory_until_release(clean):
    b = clean
    size = b.granularity
    res, alloc = b.reserve_mapped(size)
    b.tensor_at(res.va, (size,), torch.uint8).fill_(42)
    b.synchronize()  # the fill is queued work: unmapping under it is the caller's fault (see unmap)
    b.unmap(res, 0, size)
    assert b.ledger.reservations[res.va] is res
    b.map(res, 0, alloc)  # same backing again: contents survive an unmap
    b.set_access(res, 0, size)
    assert int(b.tensor_at(res.va, (size,), torch.uint8).min()) == 42
    b.unmap_release(res, 0)
    b.free(res)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("size", [0, -4096, 1000, 4096 + 1, 2.0, "1"])
def test_bad_sizes_are_rejected_clearly(clean, size):
    b = clean
    if size == 4096 + 1 and b.granularity != 4096:
        size = b.granularity + 1
    for call in (lambda: b.reserve(size), lambda: b.create(size)):
        with pytest.raises(UsageError, match="size"):
            call()


def test_misaligned_offset_and_out_of_range(clean):
    b = clean
    g = b.granularity
    res = b.reserve(2 * g)
    alloc = b.create(g)
    try:
        with pytest.raises(UsageError, match="not a multiple of the granularity"):
            b.map(res, 512, alloc)
        with pytest.raises(UsageError, match="runs past the end"):
            b.map(res, 2 * g, alloc)
        with pytest.raises(UsageError, match="power of two"):
            b.reserve(g, alignment=3 * g)
    finally:
        b.release(alloc)
        b.free(res)


def test_mapping_over_a_mapped_range_is_refused(clean):
    b = clean
    g = b.granularity
    res, alloc = b.reserve_mapped(2 * g)
    other = b.create(g)
    try:
        with pytest.raises(UsageError, match="overlaps the mapping at offset 0"):
            b.map(res, g, other)
    finally:
        b.release(other)
        b.unmap_release(res, 0)
        b.free(res)


def test_many_page_mappings_answer_overlap_and_access_after_every_change(clean):
    """A reservation of page-sized mappings (as a pool with shared pages has): a map over
    any one of them is refused, and whether a range is accessible follows every unmap,
    map and access change, also when asked twice in a row."""
    b = clean
    g = b.granularity
    n = 6
    res = b.reserve(n * g)
    allocs = [b.create(g) for _ in range(n)]
    other = b.create(2 * g)
    try:
        for k in (3, 0, 5, 1, 4, 2):  # (out of order: the index keeps them sorted)
            b.map(res, k * g, allocs[k])
        assert not res.is_accessible(0, n * g)
        b.set_access(res, 0, n * g)
        assert res.is_accessible(0, n * g) and res.is_accessible(g + 10, g)
        for at in (0, g, 4 * g):
            with pytest.raises(UsageError, match=f"overlaps the mapping at offset {at}"):
                b.map(res, at, other)
        b.unmap(res, 2 * g, g)
        assert not res.is_accessible(0, n * g) and not res.is_accessible(2 * g + 1, 1)
        assert res.is_accessible(0, 2 * g) and res.is_accessible(3 * g, 3 * g)
        with pytest.raises(UsageError, match=f"overlaps the mapping at offset {3 * g}"):
            b.map(res, 2 * g, other)  # (the gap is one page; this needs two)
        b.map(res, 2 * g, allocs[2])
        assert not res.is_accessible(0, n * g), "mapped, but access not granted yet"
        b.set_access(res, 2 * g, g)
        assert res.is_accessible(0, n * g) and res.is_accessible(0, n * g)
    finally:
        for off in list(res.mappings):
            b.unmap(res, off, g)
        for a in allocs + [other]:
            b.release(a)
        b.free(res)


def test_unmapping_an_unmapped_range_is_refused(clean):
    b = clean
    g = b.granularity
    res = b.reserve(2 * g)
    try:
        with pytest.raises(UsageError, match="nothing is mapped at offset 0"):
            b.unmap(res, 0, g)
        b.map_new(res, 0, g)
        with pytest.raises(UsageError, match=f"nothing is mapped at offset {g}"):
            b.unmap(res, 0, 2 * g)
        with pytest.raises(UsageError, match="nothing is mapped"):
            b.set_access(res, g, g)
        b.unmap_release(res, 0)
    finally:
        b.free(res)


def test_double_release_and_release_while_mapped(clean):
    b = clean
    g = b.granularity
    res, alloc = b.reserve_mapped(g)
    with pytest.raises(UsageError, match="still mapped"):
        b.release(alloc)
    b.unmap(res, 0, g)
    b.release(alloc)
    with pytest.raises(UsageError, match="double release"):
        b.release(alloc)
    with pytest.raises(UsageError, match="not a live allocation"):
        b.map(res, 0, alloc)
    b.free(res)


def test_use_of_a_freed_va_is_refused(clean):
    b = clean
    g = b.granularity
    res = b.reserve(g)
    with pytest.raises(UsageError, match="still has mappings"):
        b.map_new(res, 0, g)
        b.free(res)
    b.unmap_release(res, 0)
    b.free(res)
    alloc = b.create(g)
    try:
        with pytest.raises(UsageError, match="was freed"):
            b.map(res, 0, alloc)
        with pytest.raises(UsageError, match="was freed"):
            b.free(res)
        with pytest.raises(UsageError, match="not inside a live reservation"):
            b.tensor_at(res.va, (16,), torch.uint8)
    finally:
        b.release(alloc)


def test_driver_errors_carry_the_backend_error_name_and_code(clean):
    b = clean
    with pytest.raises(DriverError) as info:
        b.reserve(align_up(1 << 62, b.granularity))
    e = info.value
    assert e.call and e.name and isinstance(e.code, int) and e.code != 0
    assert "reserve" in str(e) and e.name in str(e) and str(e.code) in str(e)
    assert b.ledger.reservations == {} or all(r.size < (1 << 62) for r in b.ledger.reservations.values())


_FAULT_CHILD = r"""
import os, sys, torch, graphslot
b = graphslot.get_backend()
res, alloc = b.reserve_mapped(b.granularity)
t = b.tensor_at(res.va, (16,), torch.float32)
t.fill_(1.0)
b.synchronize()
b.unmap(res, 0, b.granularity)
print("unmapped; reading", flush=True)
print(float(t.sum()), flush=True)
b.synchronize()
print("READ_SUCCEEDED", flush=True)
"""


def test_access_to_an_unmapped_range_fails_loudly(backend):
    """Touching an address with nothing mapped kills the reader; it never reads garbage."""
    env = dict(os.environ, GRAPHSLOT_BACKEND=backend.name)
    proc = subprocess.run([sys.executable, "-c", _FAULT_CHILD], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "unmapped; reading" in proc.stdout, proc.stderr
    assert "READ_SUCCEEDED" not in proc.stdout
    assert proc.returncode != 0


# --------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("step", ["reserve", "create", "map", "set_access"])
def test_multi_step_sequence_rolls_back_at_every_step(clean, step):
    b = clean
    size = 2 * b.granularity
    ledger0, real0 = b.ledger.snapshot(), footprint(b)
    calls0 = b.driver_calls()
    b.faults.fail(step)
    with pytest.raises(InjectedFault, match=step):
        b.reserve_mapped(size)
    assert b.ledger.snapshot() == ledger0
    assert footprint(b) == real0
    assert b.driver_calls() > calls0 or step == "reserve"
    res, alloc = b.reserve_mapped(size)  # and the same sequence then works
    b.unmap_release(res, 0)
    b.free(res)


@pytest.mark.parametrize("step", ["create", "map", "set_access"])
def test_map_new_rolls_back_and_keeps_the_reservation(clean, step):
    b = clean
    res = b.reserve(b.granularity)
    try:
        b.faults.fail(step)
        with pytest.raises(InjectedFault):
            b.map_new(res, 0, b.granularity)
        assert res.mappings == {} and b.ledger.allocated_bytes == 0
        b.map_new(res, 0, b.granularity)
        b.unmap_release(res, 0)
    finally:
        b.free(res)


def test_faults_can_be_delayed(clean):
    b = clean
    b.faults.fail("create", after=1)
    res, _ = b.reserve_mapped(b.granularity)
    with pytest.raises(InjectedFault):
        b.create(b.granularity)
    b.unmap_release(res, 0)
    b.free(res)
    with pytest.raises(UsageError, match="cannot inject"):
        b.faults.fail("launch")


# --------------------------------------------------------------------------- info and counters


def test_the_driver_speaks_the_vmm_protocol_and_streams_and_events_torchs_names(backend):
    """One checked layer over every vendor: the backend's driver has each raw VMM call,
    and its streams and events answer to torch's method names (no per-vendor wrapper)."""
    calls = sorted(n for n in VmmDriver.__dict__ if not n.startswith("_"))
    assert calls == ["create", "free", "granularity", "map", "mem_info", "release", "reserve",
                     "set_access", "unmap"]
    missing = [n for n in calls if not callable(getattr(backend.driver, n, None))]
    assert not missing, f"{type(backend.driver).__name__} lacks {missing}"
    assert backend.driver.granularity() == backend.granularity
    s, e, f = backend.new_stream(), backend.new_event(timing=True), backend.new_event(timing=True)
    e.record(s)
    s.wait_event(e)
    f.record(s)
    f.synchronize()
    assert e.query() and f.query() and e.elapsed_time(f) >= 0
    assert backend.elapsed_ms(e, f) == e.elapsed_time(f)


def test_the_vendor_implements_what_it_declares_and_overrides_no_checked_method(backend):
    """The vendor's side is DeviceVendor: each feature declared in the backend's
    Capabilities has its hooks implemented, and the vendor's classes leave every checked
    method of Backend as it is."""
    assert set(FEATURE_HOOKS) == {f.name for f in dataclasses.fields(Capabilities)}
    caps = backend.capabilities
    for feature, hooks in FEATURE_HOOKS.items():
        if getattr(caps, feature):
            lacking = [h for h in hooks if getattr(type(backend), h) is getattr(DeviceVendor, h)]
            assert not lacking, f"{backend.name} declares {feature} but lacks {lacking}"
    checked = {n for n in Backend.__dict__ if not n.startswith("__") and n != "_abc_impl"}
    vendor_classes = type(backend).__mro__[:type(backend).__mro__.index(Backend)]
    overridden = {n for cls in vendor_classes for n in cls.__dict__} & checked
    assert not overridden, f"{backend.name} overrides checked members {sorted(overridden)}"


def test_info_reports_required_keys(backend):
    info = backend.info()
    for key in ("backend", "device", "granularity", "vmm_supported", "free_bytes", "total_bytes",
                "versions"):
        assert key in info
    assert info["backend"] == backend.name and info["vmm_supported"] is True
    assert info["granularity"] == backend.granularity > 0
    assert 0 < info["free_bytes"] <= info["total_bytes"]
    assert "torch" in info["versions"]


def test_counters_count_driver_calls_and_host_syncs(clean):
    b = clean
    c0, s0 = b.driver_calls(), b.counters["host_sync"]
    res, _ = b.reserve_mapped(b.granularity)  # reserve, create, map, set_access
    b.unmap_release(res, 0)  # unmap, release
    b.free(res)
    b.synchronize()
    assert b.driver_calls() - c0 == 7
    assert b.counters["host_sync"] - s0 == 1


def test_driver_calls_are_serialised_across_threads(clean):
    import threading

    b = clean
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                res, _ = b.reserve_mapped(b.granularity)
                b.tensor_at(res.va, (16,), torch.uint8).fill_(3)
                # Wait for the fill: on a device it is queued, and a range unmapped under
                # queued work faults later, in whatever runs next in the process.
                b.synchronize()
                b.unmap_release(res, 0)
                b.free(res)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --------------------------------------------------------------------------- impossible sizes


def test_create_of_an_impossible_size_fails_cleanly(clean):
    """Like a device, a backend refuses physical memory it cannot hold, at create time,
    with a DriverError, and leaves nothing behind (ledger, memfds, mappings)."""
    b = clean
    size = align_up(1 << 62, b.granularity)
    ledger0, real0 = b.ledger.snapshot(), footprint(b)
    t0 = time.perf_counter()
    with pytest.raises(DriverError) as ei:
        b.create(size)
    assert time.perf_counter() - t0 < 5.0
    if b.name == "cpu":
        assert "out of memory" in str(ei.value) and ei.value.name == "ENOMEM"
    assert b.ledger.snapshot() == ledger0
    assert footprint(b) == real0


def test_pinned_host_bytes_are_counted_while_any_tensor_keeps_them(clean):
    """A view of a pinned buffer, or a tensor set to its storage, keeps its bytes after the
    tensor pinned_empty returned is gone: the report counts them until the last goes."""
    import gc

    from graphslot import memory

    b = clean
    base = memory.report(b).host_pinned_bytes
    h = b.pinned_empty(1 << 20)
    view = h.view(torch.float32)
    other = torch.empty(0, dtype=torch.uint8).set_(h.untyped_storage())
    del h
    gc.collect()
    assert memory.report(b).host_pinned_bytes == base + (1 << 20)
    del view
    gc.collect()
    assert memory.report(b).host_pinned_bytes == base + (1 << 20)
    del other
    gc.collect()
    assert memory.report(b).host_pinned_bytes == base
