"""The cpu backend keeps device semantics where the host would be kinder: committed pages,
a quarantine for freed address ranges, and a named error for a bad granularity."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

from graphslot.backends import cpu as cpu_pkg
from graphslot.errors import DriverError, UsageError

if cpu_pkg.probe() is not None:  # pragma: no cover - only off Linux
    pytest.skip(f"cpu backend unavailable: {cpu_pkg.probe()}", allow_module_level=True)

from graphslot.backends.cpu import backend as cpu  # noqa: E402
from graphslot.backends.cpu.backend import CpuBackend, Quarantine, iter_maps  # noqa: E402


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def b(monkeypatch):
    monkeypatch.delenv("GRAPHSLOT_CPU_GRANULARITY", raising=False)
    be = CpuBackend()
    yield be
    assert be.ledger.snapshot() == {"reservations": 0, "reserved_bytes": 0, "allocations": 0,
                                    "allocated_bytes": 0, "mapped_bytes": 0}
    be.release_quarantine()


def reserved_here(va: int) -> bool:
    return any(a <= va < e for a, e, _ in iter_maps())


# --------------------------------------------------------------------------- create commits


@pytest.mark.parametrize("size", [1 << 62, 1 << 63, (1 << 64) + 4096, 1 << 70])
def test_create_of_an_impossible_size_fails_fast_naming_out_of_memory(b, size):
    fds, calls = open_fds(), b.counters["create"]
    t0 = time.perf_counter()
    with pytest.raises(DriverError, match="out of memory") as ei:
        b.create(size)
    assert time.perf_counter() - t0 < 1.0
    assert ei.value.name == "ENOMEM" and ei.value.code == errno.ENOMEM
    assert str(ei.value).startswith("create ")  # says what graphslot was doing
    assert open_fds() == fds, "a failed create left a file descriptor open"
    assert b.ledger.allocations == set()
    assert b.counters["create"] == calls + 1  # the attempt counts as a driver call


def test_create_beyond_the_headroom_is_refused(b):
    size = cpu.MAX_GRANULARITY * (b.headroom_bytes() // cpu.MAX_GRANULARITY + 1)
    fds = open_fds()
    with pytest.raises(DriverError, match="out of memory"):
        b.create(size)
    assert open_fds() == fds


def test_create_commits_its_pages_before_they_are_touched(b):
    size = 8 << 20
    alloc = b.create(size)
    try:
        assert os.fstat(alloc.handle.fd).st_blocks * 512 >= size
    finally:
        b.release(alloc)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.ENOMEM])
def test_a_failed_fallocate_is_out_of_memory_and_closes_the_memfd(b, monkeypatch, err):
    def refuse(fd, offset, length):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(cpu.os, "posix_fallocate", refuse)
    fds = open_fds()
    with pytest.raises(DriverError, match="out of memory") as ei:
        b.create(b.granularity)
    assert ei.value.name == "ENOMEM" and ei.value.call == "posix_fallocate"
    assert open_fds() == fds
    assert b.ledger.allocations == set()


def test_an_interrupt_inside_fallocate_closes_the_memfd(b, monkeypatch):
    def interrupted(fd, offset, length):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu.os, "posix_fallocate", interrupted)
    fds = open_fds()
    with pytest.raises(KeyboardInterrupt):
        b.create(b.granularity)
    assert open_fds() == fds
    assert b.ledger.allocations == set()


def test_a_kernel_without_shmem_fallocate_still_creates(b, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(cpu.os, "posix_fallocate", unsupported)
    res, alloc = b.reserve_mapped(b.granularity)
    b.tensor_at(res.va, (b.granularity,), torch.uint8).fill_(7)
    b.unmap_release(res, 0)
    b.free(res)


def test_a_reservation_beyond_the_address_space_is_refused_not_wrapped(b):
    for size in ((1 << 64) + 4096, 1 << 63):
        with pytest.raises(DriverError, match="ENOMEM|EINVAL"):
            b.reserve(size)
    assert b.ledger.reservations == {}


# --------------------------------------------------------------------------- quarantine


def test_a_freed_range_is_not_returned_by_the_next_reserve(b):
    size = 4 * b.granularity
    freed: list[int] = []
    for _ in range(20):
        res = b.reserve(size)
        assert res.va not in freed, "a recently freed range was handed out again"
        freed.append(res.va)
        b.free(res)
        assert res.va in b.quarantine and reserved_here(res.va)  # still reserved, PROT_NONE
    assert len(b.quarantine) == 20 and b.quarantine.bytes == 20 * size
    assert b.ledger.reserved_bytes == 0  # graphslot's account: all of it was freed
    assert b.counters["free"] == 20


def test_a_freed_range_stays_inaccessible(b):
    res, _ = b.reserve_mapped(b.granularity)
    va = res.va
    b.unmap_release(res, 0)
    b.free(res)
    perms = [p for a, e, p in iter_maps() if a <= va < e]
    assert perms and perms[0].startswith("---"), perms
    with pytest.raises(UsageError, match="not inside a live reservation"):
        b.tensor_at(va, (4,), torch.float32)


def test_the_quarantine_is_a_bounded_fifo():
    q = Quarantine(max_ranges=3, max_bytes=1 << 40)
    g = cpu.PAGE
    vas = [CpuBackend().driver.reserve(g, 0) for _ in range(5)]
    for va in vas:
        q.add(va, g)
    assert len(q) == 3 and q.bytes == 3 * g
    assert [va in q for va in vas] == [False, False, True, True, True]
    assert not reserved_here(vas[0]) and not reserved_here(vas[1])  # given back, oldest first
    assert all(reserved_here(va) for va in vas[2:])
    q.release()
    assert len(q) == 0 and q.bytes == 0 and not any(reserved_here(va) for va in vas)


def test_the_quarantine_bounds_bytes_but_always_keeps_the_newest():
    g = cpu.PAGE
    q = Quarantine(max_ranges=100, max_bytes=4 * g)
    be = CpuBackend()
    small = [be.driver.reserve(g, 0) for _ in range(3)]
    for va in small:
        q.add(va, g)
    big = be.driver.reserve(8 * g, 0)
    q.add(big, 8 * g)  # over the byte bound alone: the older ranges go, the newest stays
    assert len(q) == 1 and big in q and reserved_here(big)
    assert not any(reserved_here(va) for va in small)
    q.release()
    assert not reserved_here(big)


def test_the_backend_quarantine_plateaus(b):
    size = b.granularity
    for _ in range(b.quarantine.max_ranges + 50):
        b.free(b.reserve(size))
    assert len(b.quarantine) == b.quarantine.max_ranges
    b.release_quarantine()
    assert len(b.quarantine) == 0


_STALE_CHILD = r"""
import torch
from graphslot.backends.cpu.backend import CpuBackend
b = CpuBackend()
g = b.granularity
res, alloc = b.reserve_mapped(g)
stale = b.tensor_at(res.va, (g // 4,), torch.int32)
stale.fill_(1)
b.unmap_release(res, 0)
b.free(res)
others = [b.reserve_mapped(g) for _ in range(8)]
for r, _ in others:
    b.tensor_at(r.va, (g // 4,), torch.int32).fill_(42)
print("freed; reading the stale view", flush=True)
print("READ", int(stale[0]), flush=True)
"""


def test_a_stale_view_of_a_freed_range_faults_instead_of_reading_another_owner():
    proc = subprocess.run([sys.executable, "-c", _STALE_CHILD], capture_output=True, text=True,
                          timeout=120)
    assert "freed; reading the stale view" in proc.stdout, proc.stderr
    assert "READ" not in proc.stdout.replace("reading", ""), proc.stdout
    assert proc.returncode != 0


# --------------------------------------------------------------------------- granularity


@pytest.mark.parametrize("value, why", [
    ("foo", "is not an integer"),
    ("1.5", "is not an integer"),
    ("0", "is not positive"),
    ("-4096", "is not positive"),
    ("4097", "is not a power of two"),
    (str(3 * cpu.PAGE), "is not a power of two"),
    (str(cpu.PAGE // 2), "is smaller than the page size"),
    (str(1 << 31), "is larger than 1 GiB"),
])
def test_a_bad_granularity_variable_is_a_named_usage_error(monkeypatch, value, why):
    monkeypatch.setenv("GRAPHSLOT_CPU_GRANULARITY", value)
    with pytest.raises(UsageError) as ei:
        CpuBackend()
    msg = str(ei.value)
    assert f"GRAPHSLOT_CPU_GRANULARITY={value!r}" in msg and why in msg
    assert "\n" not in msg


@pytest.mark.parametrize("value, expect", [
    (str(2 * cpu.PAGE), 2 * cpu.PAGE), ("0x200000", 2 << 20), (" 65536 ", 65536), ("", cpu.PAGE),
])
def test_a_good_granularity_variable_is_used(monkeypatch, value, expect):
    monkeypatch.setenv("GRAPHSLOT_CPU_GRANULARITY", value)
    assert CpuBackend().granularity == expect


@pytest.mark.parametrize("value", [0, -1, 3 * cpu.PAGE, 1.5, True, "x"])
def test_a_bad_granularity_argument_is_a_usage_error(value):
    with pytest.raises(UsageError, match="cpu granularity"):
        CpuBackend(granularity=value)


# --------------------------------------------------------------------------- graphs


def test_an_allocation_under_capture_is_no_work_of_the_graph(b):
    """As on a device, where the pool hands out the bytes at capture: a replay does not
    allocate again, nor write an uninitialised result over what lives there now."""
    g = b.new_graph()
    with g.capture(b.side_stream()):
        buf = torch.empty(64)
        out = buf * 2.0
    buf.fill_(3.0)
    g.replay()
    assert torch.all(buf == 3.0) and torch.all(out == 6.0)


def test_the_footprint_read_while_another_thread_releases_allocations_counts_live_ones(b):
    # The offload engine's driver worker releases allocations (closing their memfds) while
    # the training thread may read the footprint (a budgeted build measures it): the read
    # must not stat a file descriptor that is being closed, or one reused since.
    import threading

    allocs = [b.create(b.granularity) for _ in range(200)]
    done = threading.Event()

    def release_all() -> None:
        for a in allocs:
            b.release(a)
            time.sleep(0)
        done.set()

    t = threading.Thread(target=release_all)
    t.start()
    try:
        while not done.is_set():
            assert b.footprint_bytes() >= 0
    finally:
        t.join()
