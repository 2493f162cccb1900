"""graphslot's checked Backend layer over the musa driver layer and the libmusa test double.

``StubMusaBackend`` is the cpu backend with the musa backend's VMM driver,
:class:`MusaDriver`, in place of its own (so every reserve/create/map/... goes through
ctypes into the stub libmusa); streams, events, copies and tensor views stay the cpu
backend's, which works because the stub's "device" memory is host memory. This runs the real checked methods,
transactions and rollback against musa-shaped driver errors without torch_musa.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import sys
import types
from typing import Any, Iterator

import pytest
import torch

from graphslot.backend import Backend
from graphslot.backends.cpu.backend import CpuBackend
from graphslot.backends.musa.driver import MusaDriver
from graphslot.errors import DriverError, InjectedFault, UsageError


G = 64 * 1024


class StubMusaBackend(CpuBackend):
    """Test-only: musa driver VMM (into the stub) + host-side torch parts from cpu."""

    name = "musa-stub"

    def __init__(self) -> None:
        CpuBackend.__init__(self)
        self.driver = MusaDriver(0)  # type: ignore[assignment]


@pytest.fixture
def be(stub: Any) -> Iterator[StubMusaBackend]:
    b = StubMusaBackend()
    yield b
    b.driver.close()


def clean(be: Backend, stub: Any) -> bool:
    snap = be.ledger.snapshot()
    return (all(v == 0 for v in snap.values())
            and stub.live() == {"reservations": 0, "handles": 0, "mappings": 0})


def test_granularity_and_mem_info_come_from_the_driver(be: StubMusaBackend, stub: Any) -> None:
    assert be.granularity == G
    assert be.mem_info() == (256 << 20, 256 << 20)
    info = be.info()
    assert info["granularity"] == G and info["total_bytes"] == 256 << 20


def test_checked_round_trip(be: StubMusaBackend, stub: Any) -> None:
    res, alloc = be.reserve_mapped(2 * G)
    t = be.tensor_at(res.va, (2 * G // 4,), torch.float32)
    assert t.data_ptr() == res.va
    t.fill_(1.5)
    assert ctypes.c_float.from_address(res.va + 4 * 100).value == 1.5
    assert be.counters["map"] == 1 and stub.calls("muMemMap") == 1
    be.unmap_release(res, 0)
    be.free(res)
    assert clean(be, stub)
    assert be.driver_calls() == 7  # reserve, create, map, set_access, unmap, release, free


def test_swap_backing_keeps_the_view(be: StubMusaBackend, stub: Any) -> None:
    res = be.reserve(G)
    a = be.map_new(res, 0, G)
    view = be.tensor_at(res.va, (G,), torch.uint8)
    view[:4] = 7
    be.unmap(res, 0, G)
    b = be.map_new(res, 0, G)
    assert view.data_ptr() == res.va and int(view[0]) == 0  # new backing, same address
    be.unmap(res, 0, G)
    be.map(res, 0, a)
    be.set_access(res, 0, G)
    assert int(view[0]) == 7
    del view
    be.unmap_release(res, 0)
    be.release(b)
    be.free(res)
    assert clean(be, stub)


def test_misuse_is_caught_before_the_driver(be: StubMusaBackend, stub: Any) -> None:
    res = be.reserve(2 * G)
    alloc = be.create(G)
    with pytest.raises(UsageError):
        be.map(res, 100, alloc)  # offset not granular
    with pytest.raises(UsageError):
        be.map(res, 2 * G, alloc)  # past the end
    with pytest.raises(UsageError):
        be.unmap(res, 0, G)  # nothing mapped
    assert stub.calls("muMemMap") == 0 and stub.calls("muMemUnmap") == 0
    be.release(alloc)
    with pytest.raises(UsageError):
        be.release(alloc)  # double release stops in the ledger, not the driver
    assert stub.calls("muMemRelease") == 1
    be.free(res)
    assert clean(be, stub)


@pytest.mark.parametrize("symbol,op,undone", [
    ("muMemAddressReserve", "reserve", {}),
    ("muMemCreate", "create", {"muMemAddressFree": 1}),
    ("muMemMap", "map", {"muMemRelease": 1, "muMemAddressFree": 1}),
    ("muMemSetAccess", "set read/write access", {"muMemUnmap": 1, "muMemRelease": 1,
                                                 "muMemAddressFree": 1}),
])
def test_driver_failure_rolls_back(be: StubMusaBackend, stub: Any, symbol: str, op: str,
                                   undone: dict[str, int]) -> None:
    stub.fail_next(symbol, 2)
    with pytest.raises(DriverError) as ei:
        be.reserve_mapped(G)
    e = ei.value
    assert (e.call, e.name, e.code) == (symbol, "MUSA_ERROR_OUT_OF_MEMORY", 2)
    assert e.op.startswith(op)  # the checked layer says what it was doing
    assert f"{symbol} failed with MUSA_ERROR_OUT_OF_MEMORY (2)" in str(e)
    for call, n in undone.items():
        assert stub.calls(call) == n, call
    assert clean(be, stub)


def test_rollback_keeps_earlier_committed_work(be: StubMusaBackend, stub: Any) -> None:
    res = be.reserve(2 * G)
    be.map_new(res, 0, G)
    stub.fail_next("muMemMap", 801)
    with pytest.raises(DriverError) as ei:
        be.map_new(res, G, G)
    assert ei.value.name == "MUSA_ERROR_NOT_SUPPORTED"
    assert set(res.mappings) == {0} and stub.live()["mappings"] == 1
    be.unmap_release(res, 0)
    be.free(res)
    assert clean(be, stub)


def test_injected_fault_never_reaches_the_driver(be: StubMusaBackend, stub: Any) -> None:
    be.faults.fail("create")
    with pytest.raises(InjectedFault):
        be.reserve_mapped(G)
    assert stub.calls("muMemCreate") == 0
    assert clean(be, stub)


def test_rollback_failure_is_noted(be: StubMusaBackend, stub: Any) -> None:
    stub.fail_next("muMemSetAccess", 2)
    stub.fail_next("muMemUnmap", 999)  # and undoing the map fails too
    with pytest.raises(DriverError) as ei:
        be.reserve_mapped(G)
    assert ei.value.call == "muMemSetAccess"
    assert any("rollback also failed" in n and "MUSA_ERROR_UNKNOWN" in n
               for n in getattr(ei.value, "__notes__", []))


def test_musa_backend_class_is_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    """MusaBackend implements every abstract primitive (imported with a stand-in torch_musa)."""
    if importlib.util.find_spec("torch_musa") is None:
        monkeypatch.setitem(sys.modules, "torch_musa", types.ModuleType("torch_musa"))
        monkeypatch.setattr(torch, "musa", types.SimpleNamespace(), raising=False)
    name = "graphslot.backends.musa.backend"
    had = name in sys.modules
    mod = importlib.import_module(name)
    try:
        assert mod.MusaBackend.__abstractmethods__ == frozenset()
        assert mod.MusaBackend.name == "musa"
        assert issubclass(mod.MusaBackend, Backend)
        assert mod.MusaBackend.__annotations__.get("driver") in ("MusaDriver", MusaDriver)
    finally:
        if not had:
            sys.modules.pop(name, None)
            pkg = sys.modules["graphslot.backends.musa"]
            if hasattr(pkg, "backend"):
                delattr(pkg, "backend")
