"""The musa driver layer (ctypes over libmusa) against a test-double libmusa.

``tests/musa_stub/libmusa_stub.c`` is compiled with gcc at test time: it exports the
driver entry points over host memory (mmap, memfd, mprotect), so bytes written
through a mapped address are real, and ``stub_fail_next`` makes any chosen call
fail, so every ctypes call path and error mapping is driven here. Nothing in this
file needs torch_musa or a MUSA GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib.util
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import graphslot.backends.musa as musa_pkg
from graphslot import selection
from graphslot.backends.musa import abi, dlpack, driver
from graphslot.backends.musa.driver import MusaDriver, MusaLibrary, MusaUnavailable, probe_driver
from graphslot.errors import DriverError


import musa_stubbuild as sb  # noqa: E402  (registered by conftest.py)
G = 64 * 1024  # the stub's granularity


@pytest.fixture
def drv(stub: Any) -> Iterator[MusaDriver]:
    d = MusaDriver(0)
    yield d
    d.close()


def peek(va: int, n: int) -> bytes:
    return ctypes.string_at(va, n)


def poke(va: int, data: bytes) -> None:
    ctypes.memmove(va, data, len(data))


# --------------------------------------------------------------------------- round trip


def test_vmm_round_trip_with_real_bytes(drv: MusaDriver, stub: Any) -> None:
    assert drv.granularity() == G
    assert drv.granularity(abi.MU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == 2 * G
    va = drv.reserve(2 * G)
    assert va % G == 0
    h = drv.create(2 * G)
    drv.map(va, 2 * G, h)
    drv.set_access(va, 2 * G)
    poke(va, b"graphslot")
    poke(va + 2 * G - 4, b"tail")
    assert peek(va, 9) == b"graphslot" and peek(va + 2 * G - 4, 4) == b"tail"
    assert stub.live() == {"reservations": 1, "handles": 1, "mappings": 1}
    drv.unmap(va, 2 * G)
    drv.release(h)
    drv.free(va, 2 * G)
    assert stub.live() == {"reservations": 0, "handles": 0, "mappings": 0}


def test_same_backing_at_two_addresses(drv: MusaDriver) -> None:
    """One allocation mapped twice is one memory: the property graphslot shares pools with."""
    a, b = drv.reserve(G), drv.reserve(G)
    h = drv.create(G)
    for va in (a, b):
        drv.map(va, G, h)
        drv.set_access(va, G)
    poke(a, b"shared")
    assert peek(b, 6) == b"shared"
    for va in (a, b):
        drv.unmap(va, G)
        drv.free(va, G)
    drv.release(h)


def test_swap_backing_behind_a_fixed_address(drv: MusaDriver) -> None:
    """Unmap keeps the VA reserved; new backing mapped there is what the address now reads."""
    va = drv.reserve(G)
    h1, h2 = drv.create(G), drv.create(G)
    drv.map(va, G, h1)
    drv.set_access(va, G)
    poke(va, b"first")
    drv.unmap(va, G)
    drv.map(va, G, h2)
    drv.set_access(va, G)
    assert peek(va, 5) == bytes(5)  # fresh memory, not the old bytes
    poke(va, b"second")
    drv.unmap(va, G)
    drv.map(va, G, h1)  # the first backing kept its contents while unmapped
    drv.set_access(va, G)
    assert peek(va, 5) == b"first"
    drv.unmap(va, G)
    drv.release(h1)
    drv.release(h2)
    drv.free(va, G)


def test_release_while_mapped_keeps_pages_until_unmap(drv: MusaDriver, stub: Any) -> None:
    va = drv.reserve(G)
    h = drv.create(G)
    drv.map(va, G, h)
    drv.set_access(va, G)
    drv.release(h)  # allowed by the driver model: freed once unmapped
    poke(va, b"still here")
    assert peek(va, 10) == b"still here"
    drv.unmap(va, G)
    drv.free(va, G)
    assert stub.live() == {"reservations": 0, "handles": 0, "mappings": 0}


def test_read_only_access(drv: MusaDriver) -> None:
    va = drv.reserve(G)
    h = drv.create(G)
    drv.map(va, G, h)
    drv.set_access(va, G, abi.MU_MEM_ACCESS_FLAGS_PROT_READ)
    assert peek(va, 4) == bytes(4)
    drv.unmap(va, G)
    drv.release(h)
    drv.free(va, G)


def test_mem_info_version_attributes(drv: MusaDriver, stub: Any) -> None:
    free0, total = drv.mem_info()
    assert total == 256 << 20 and free0 == total
    h = drv.create(4 * G)
    assert drv.mem_info() == (total - 4 * G, total)
    drv.release(h)
    assert drv.driver_version() == 4030
    assert drv.vmm_supported() is True
    assert drv.attribute(abi.MU_DEVICE_ATTRIBUTE_CLOCK_RATE) == 1_500_000
    assert drv.lib.symbols["muMemGetInfo"] == "muMemGetInfo_v2"
    assert drv.lib.symbols["muDevicePrimaryCtxRelease"] == "muDevicePrimaryCtxRelease_v2"
    assert drv.lib.path == str(stub.path)
    assert "MusaDriver device 0" in repr(drv)


# --------------------------------------------------------------------------- error paths


def _mapped(drv: MusaDriver, size: int = G) -> tuple[int, int]:
    va = drv.reserve(size)
    h = drv.create(size)
    drv.map(va, size, h)
    drv.set_access(va, size)
    return va, h


def _released(drv: MusaDriver) -> int:
    h = drv.create(G)
    drv.release(h)
    return h


ERROR_CASES: list[tuple[str, Callable[[MusaDriver], Any], str, str, int]] = [
    ("reserve zero bytes", lambda d: d.reserve(0), "muMemAddressReserve", "MUSA_ERROR_INVALID_VALUE", 1),
    ("reserve a non-granular size", lambda d: d.reserve(G + 1), "muMemAddressReserve",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("reserve with alignment 3", lambda d: d.reserve(G, 3), "muMemAddressReserve",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("create a non-granular size", lambda d: d.create(100), "muMemCreate", "MUSA_ERROR_INVALID_VALUE", 1),
    ("create more than the device has", lambda d: d.create(512 << 20), "muMemCreate",
     "MUSA_ERROR_OUT_OF_MEMORY", 2),
    ("release twice", lambda d: d.release(_released(d)), "muMemRelease", "MUSA_ERROR_INVALID_VALUE", 1),
    ("release a bogus handle", lambda d: d.release(7), "muMemRelease", "MUSA_ERROR_INVALID_VALUE", 1),
    ("map a bogus handle", lambda d: d.map(d.reserve(G), G, 7), "muMemMap", "MUSA_ERROR_INVALID_HANDLE", 400),
    ("map a released handle", lambda d: d.map(d.reserve(G), G, _released(d)), "muMemMap",
     "MUSA_ERROR_INVALID_HANDLE", 400),
    ("map outside any reservation", lambda d: d.map(G * 16, G, d.create(G)), "muMemMap",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("map past the end of a reservation", lambda d: d.map(d.reserve(G), 2 * G, d.create(2 * G)),
     "muMemMap", "MUSA_ERROR_INVALID_VALUE", 1),
    ("map over a mapping", lambda d: d.map(_mapped(d)[0], G, d.create(G)), "muMemMap",
     "MUSA_ERROR_ALREADY_MAPPED", 208),
    ("map at a non-zero handle offset", lambda d: d.map(d.reserve(G), G, d.create(2 * G), offset=G),
     "muMemMap", "MUSA_ERROR_INVALID_VALUE", 1),
    ("unmap an unmapped range", lambda d: d.unmap(d.reserve(G), G), "muMemUnmap",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("unmap part of a mapping", lambda d: d.unmap(_mapped(d, 2 * G)[0], G), "muMemUnmap",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("set access on an unmapped range", lambda d: d.set_access(d.reserve(G), G), "muMemSetAccess",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("set unknown access flags", lambda d: d.set_access(_mapped(d)[0], G, 7), "muMemSetAccess",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("free with the wrong size", lambda d: d.free(d.reserve(2 * G), G), "muMemAddressFree",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("free a range that is still mapped", lambda d: d.free(_mapped(d)[0], G), "muMemAddressFree",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("free an address never reserved", lambda d: d.free(G * 16, G), "muMemAddressFree",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("ask an unknown attribute", lambda d: d.attribute(99999), "muDeviceGetAttribute",
     "MUSA_ERROR_INVALID_VALUE", 1),
    ("granularity for an unknown option", lambda d: d.granularity(5), "muMemGetAllocationGranularity",
     "MUSA_ERROR_INVALID_VALUE", 1),
]


@pytest.mark.parametrize("what,action,call,name,code", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_driver_errors(drv: MusaDriver, what: str, action: Callable[[MusaDriver], Any], call: str,
                       name: str, code: int) -> None:
    with pytest.raises(DriverError) as ei:
        action(drv)
    e = ei.value
    assert (e.op, e.call, e.name, e.code) == ("", call, name, code), what
    assert f"{call} failed with {name} ({code})" in str(e)


def test_error_detail_comes_from_mu_get_error_string(drv: MusaDriver) -> None:
    with pytest.raises(DriverError) as ei:
        drv.create(512 << 20)
    assert ei.value.detail == "out of memory (libmusa stub)"


def test_device_out_of_range(stub: Any) -> None:
    with pytest.raises(DriverError) as ei:
        MusaDriver(3)
    assert (ei.value.call, ei.value.name, ei.value.code) == ("muDeviceGet", "MUSA_ERROR_INVALID_DEVICE", 101)


def test_no_device(stub: Any) -> None:
    stub.set_device_count(0)
    with pytest.raises(DriverError) as ei:
        MusaDriver(0)
    assert (ei.value.call, ei.value.name, ei.value.code) == ("muInit", "MUSA_ERROR_NO_DEVICE", 100)


def test_bad_allocation_prop_is_refused(drv: MusaDriver) -> None:
    """The stub checks the struct's fields, so a layout slip would show up as this error."""
    drv._prop.location.id = 5
    with pytest.raises(DriverError) as ei:
        drv.create(G)
    assert (ei.value.call, ei.value.name) == ("muMemCreate", "MUSA_ERROR_INVALID_DEVICE")
    drv._prop.location.id = 0
    drv._prop.allocFlags.reserved[2] = 1
    with pytest.raises(DriverError) as ei:
        drv.create(G)
    assert ei.value.name == "MUSA_ERROR_INVALID_VALUE"


# --------------------------------------------------------------------------- planted failures

# (driver method to call, the symbol it reaches). Each is made to fail once.
def _setup_for(symbol: str, d: MusaDriver) -> Callable[[], Any]:
    if symbol == "muMemAddressFree":
        va = d.reserve(G)
        return lambda: d.free(va, G)
    if symbol == "muMemRelease":
        h = d.create(G)
        return lambda: d.release(h)
    if symbol == "muMemMap":
        va, h = d.reserve(G), d.create(G)
        return lambda: d.map(va, G, h)
    if symbol in ("muMemUnmap", "muMemSetAccess"):
        va, h = d.reserve(G), d.create(G)
        d.map(va, G, h)
        return (lambda: d.unmap(va, G)) if symbol == "muMemUnmap" else (lambda: d.set_access(va, G))
    return {
        "muMemAddressReserve": lambda: d.reserve(G),
        "muMemCreate": lambda: d.create(G),
        "muMemGetAllocationGranularity": d.granularity,
        "muMemGetInfo_v2": d.mem_info,
        "muDriverGetVersion": d.driver_version,
        "muDeviceGetAttribute": d.vmm_supported,
        "muDevicePrimaryCtxRelease_v2": d.close,
    }[symbol]


PLANTED = ["muMemAddressReserve", "muMemAddressFree", "muMemCreate", "muMemRelease", "muMemMap",
           "muMemUnmap", "muMemSetAccess", "muMemGetAllocationGranularity", "muMemGetInfo_v2",
           "muDriverGetVersion", "muDeviceGetAttribute", "muDevicePrimaryCtxRelease_v2"]


@pytest.mark.parametrize("symbol", PLANTED)
@pytest.mark.parametrize("code,name", [(2, "MUSA_ERROR_OUT_OF_MEMORY"), (801, "MUSA_ERROR_NOT_SUPPORTED"),
                                       (700, "MUSA_ERROR_ILLEGAL_ADDRESS")])
def test_planted_failure_of_every_call(drv: MusaDriver, stub: Any, symbol: str, code: int,
                                       name: str) -> None:
    drv.make_current()
    call = _setup_for(symbol, drv)
    stub.fail_next(symbol, code)
    with pytest.raises(DriverError) as ei:
        call()
    assert (ei.value.op, ei.value.call, ei.value.name, ei.value.code) == ("", symbol, name, code)
    if symbol != "muDevicePrimaryCtxRelease_v2":
        call()  # one-shot: the same call now goes through
    assert stub.calls(symbol) >= 1


@pytest.mark.parametrize("symbol", ["muInit", "muDeviceGet"])
def test_planted_failure_while_opening(stub: Any, symbol: str) -> None:
    stub.fail_next(symbol, 999)
    with pytest.raises(DriverError) as ei:
        MusaDriver(0)
    assert (ei.value.call, ei.value.name, ei.value.code) == (symbol, "MUSA_ERROR_UNKNOWN", 999)
    MusaDriver(0).close()


@pytest.mark.parametrize("symbol", ["muDevicePrimaryCtxRetain", "muCtxSetCurrent"])
def test_planted_failure_making_the_context_current(drv: MusaDriver, stub: Any, symbol: str) -> None:
    stub.fail_next(symbol, 201)
    with pytest.raises(DriverError) as ei:
        drv.reserve(G)
    assert (ei.value.call, ei.value.name, ei.value.code) == (symbol, "MUSA_ERROR_INVALID_CONTEXT", 201)
    assert ei.value.detail == "no current context on this thread (libmusa stub)"
    assert stub.live()["reservations"] == 0
    drv.free(drv.reserve(G), G)  # the next call retries and works
    assert stub.ctx_refs() == 1


# --------------------------------------------------------------------------- error names


def test_error_names_prefer_the_driver_then_the_table(drv: MusaDriver) -> None:
    assert drv.error_name(2) == "MUSA_ERROR_OUT_OF_MEMORY"  # muGetErrorName knows it
    assert drv.error_name(700) == "MUSA_ERROR_ILLEGAL_ADDRESS"  # the stub does not: table
    assert drv.error_name(4242) == "MUSA_ERROR_UNRECOGNIZED_4242"
    assert drv.error_string(4242) == ""


def test_error_names_without_mu_get_error_name(stub_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = sb.build(stub_dir, "OMIT_ERROR_NAME")
    monkeypatch.setenv(driver.ENV_LIBMUSA, str(path))
    s = sb.Stub(path)
    s.reset()
    d = MusaDriver(0)
    assert "muGetErrorName" not in d.lib.fn and "muGetErrorString" not in d.lib.fn
    with pytest.raises(DriverError) as ei:
        d.reserve(G + 1)
    assert (ei.value.name, ei.value.code, ei.value.detail) == ("MUSA_ERROR_INVALID_VALUE", 1, "")
    s.fail_next("muMemCreate", 801)
    with pytest.raises(DriverError) as ei:
        d.create(G)
    assert ei.value.name == "MUSA_ERROR_NOT_SUPPORTED"
    d.close()
    s.reset()


# --------------------------------------------------------------------------- loading


def test_driver_too_old_for_vmm(stub_dir: Path) -> None:
    path = sb.build(stub_dir, "OMIT_VMM")
    with pytest.raises(MusaUnavailable) as ei:
        MusaLibrary(str(path))
    msg = str(ei.value)
    assert "driver too old for VMM" in msg
    for sym in driver.VMM_SYMBOLS:
        assert sym in msg
    assert probe_driver(0, str(path)) == msg


def test_one_vmm_symbol_missing_is_named(stub_dir: Path) -> None:
    path = sb.build(stub_dir, "OMIT_muMemCreate")
    with pytest.raises(MusaUnavailable) as ei:
        MusaLibrary(str(path))
    assert str(ei.value) == (f"libmusa ({path}) lacks muMemCreate: driver too old for VMM "
                             "(virtual memory management needs a MUSA 4.0 or newer driver)")


def test_not_a_musa_library() -> None:
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no libc to load as a stand-in for a non-MUSA library")
    with pytest.raises(MusaUnavailable) as ei:
        MusaLibrary(libc)
    msg = str(ei.value)
    assert msg.startswith(f"{libc} lacks muInit, muDriverGetVersion")
    assert "not a MUSA driver library" in msg


def test_library_path_that_does_not_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "libmusa.so"
    monkeypatch.setenv(driver.ENV_LIBMUSA, str(missing))
    with pytest.raises(MusaUnavailable) as ei:
        MusaLibrary()
    assert str(ei.value).startswith(f"GRAPHSLOT_LIBMUSA={missing} could not be loaded: ")


def test_library_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(driver.ENV_LIBMUSA, raising=False)
    monkeypatch.setattr(driver, "library_candidates", lambda: ["libgraphslot-absent-musa.so"])
    with pytest.raises(MusaUnavailable) as ei:
        MusaLibrary()
    assert str(ei.value) == ("libmusa.so not found (set GRAPHSLOT_LIBMUSA; tried "
                             "libgraphslot-absent-musa.so)")


def test_library_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MUSA_HOME", "/opt/musa")
    cands = driver.library_candidates()
    assert "libmusa.so" in cands
    assert cands[-1] == "/opt/musa/lib/libmusa.so"


# --------------------------------------------------------------------------- contexts and threads


def test_context_is_retained_once_and_set_once_per_thread(drv: MusaDriver, stub: Any) -> None:
    assert stub.ctx_refs() == 0  # opening retains nothing
    assert not stub.thread_has_context()
    drv.free(drv.reserve(G), G)
    drv.mem_info()
    assert stub.calls("muDevicePrimaryCtxRetain") == 1
    assert stub.calls("muCtxSetCurrent") == 1
    assert stub.thread_has_context()

    seen: list[bool] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            seen.append(stub.thread_has_context())  # a new thread has no context yet
            for _ in range(3):
                drv.release(drv.create(G))
            seen.append(stub.thread_has_context())
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen.count(False) == 3 and seen.count(True) == 3
    assert stub.calls("muCtxSetCurrent") == 4  # main thread + one per worker
    assert stub.calls("muDevicePrimaryCtxRetain") == 1
    assert stub.ctx_refs() == 1


def test_a_thread_without_the_context_is_refused(drv: MusaDriver, stub: Any) -> None:
    """What the thread-local step prevents: the raw call on a fresh thread fails."""
    drv.make_current()
    out: list[int] = []

    def raw() -> None:
        h = abi.MUmemGenericAllocationHandle()
        out.append(drv.lib.fn["muMemCreate"](ctypes.byref(h), G, ctypes.byref(drv._prop), 0))

    t = threading.Thread(target=raw)
    t.start()
    t.join()
    assert out == [201]
    assert drv.error_name(out[0]) == "MUSA_ERROR_INVALID_CONTEXT"


def test_close_releases_the_primary_context(stub: Any) -> None:
    d = MusaDriver(0)
    d.close()  # nothing retained yet: no driver call
    assert stub.calls("muDevicePrimaryCtxRelease_v2") == 0
    d.make_current()
    assert stub.ctx_refs() == 1
    d.close()
    assert stub.ctx_refs() == 0
    d.free(d.reserve(G), G)  # reuse retains again and sets the context again
    assert stub.ctx_refs() == 1 and stub.calls("muCtxSetCurrent") == 2
    d.close()


# --------------------------------------------------------------------------- probes


def test_probe_driver(stub: Any) -> None:
    assert probe_driver(0) is None
    assert stub.ctx_refs() == 0  # probing retains no context
    assert probe_driver(2) == ("MUSA device 2 is not usable: muDeviceGet failed with "
                               "MUSA_ERROR_INVALID_DEVICE (101)")
    stub.set_vmm_supported(False)
    assert probe_driver(0) == ("MUSA device 0 does not support virtual memory management "
                               "(MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)")
    stub.set_vmm_supported(True)
    stub.fail_next("muDeviceGetAttribute", 999)
    assert probe_driver(0) == ("cannot ask MUSA device 0 whether it supports virtual memory "
                               "management: muDeviceGetAttribute failed with MUSA_ERROR_UNKNOWN (999)")
    stub.set_device_count(0)
    assert probe_driver(0) == "no usable MUSA device: muInit failed with MUSA_ERROR_NO_DEVICE (100)"


needs_no_torch_musa = pytest.mark.skipif(importlib.util.find_spec("torch_musa") is not None,
                                         reason="torch_musa is installed here")
TORCH_MUSA_MISSING = ("torch_musa is not installed (install Moore Threads' torch_musa wheel that "
                      "matches your torch and MUSA SDK)")


@needs_no_torch_musa
def test_probe_reports_torch_musa_missing(stub: Any) -> None:
    # The driver side is fine (the stub), so torch_musa is the one thing reported.
    assert musa_pkg.probe() == TORCH_MUSA_MISSING
    assert selection.probe("musa") == TORCH_MUSA_MISSING


@needs_no_torch_musa
def test_probe_reports_every_missing_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(driver.ENV_LIBMUSA, raising=False)
    monkeypatch.setattr(driver, "library_candidates", lambda: ["libgraphslot-absent-musa.so"])
    assert musa_pkg.probe() == (f"{TORCH_MUSA_MISSING}; libmusa.so not found (set "
                                "GRAPHSLOT_LIBMUSA; tried libgraphslot-absent-musa.so)")


@needs_no_torch_musa
def test_probe_reports_an_old_driver(stub_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = sb.build(stub_dir, "OMIT_muMemCreate")
    monkeypatch.setenv(driver.ENV_LIBMUSA, str(path))
    assert musa_pkg.probe() == (f"{TORCH_MUSA_MISSING}; libmusa ({path}) lacks muMemCreate: "
                                "driver too old for VMM (virtual memory management needs a "
                                "MUSA 4.0 or newer driver)")


# --------------------------------------------------------------------------- layouts and views


def test_ctypes_layout_matches_the_c_compiler(stub: Any) -> None:
    """ctypes and gcc agree on the structures as the stub declares them (CUDA's layout)."""
    P, L, A = abi.MUmemAllocationProp, abi.MUmemLocation, abi.MUmemAccessDesc
    F = abi.MUmemAllocFlags
    fo = P.allocFlags.offset
    expected = [
        ctypes.sizeof(L), L.type.offset, L.id.offset,
        ctypes.sizeof(P), P.type.offset, P.requestedHandleTypes.offset, P.location.offset,
        P.win32HandleMetaData.offset, fo, fo + F.compressionType.offset,
        fo + F.gpuDirectRDMACapable.offset, fo + F.usage.offset, fo + F.reserved.offset,
        ctypes.sizeof(A), A.location.offset, A.flags.offset,
        ctypes.sizeof(abi.MUdeviceptr), ctypes.sizeof(abi.MUmemGenericAllocationHandle),
    ]
    assert stub.layout() == expected


def test_dlpack_view_of_mapped_memory(drv: MusaDriver, stub: Any) -> None:
    """The capsule route MusaBackend uses (with kDLCPU here): zero copy, deleter called once."""
    va, h = _mapped(drv)
    t = dlpack.byte_tensor_at(va, G, dlpack.kDLCPU, deleter=stub.dlpack_deleter)
    assert t.data_ptr() == va and t.shape == (G,) and t.dtype == torch.uint8
    t[:5] = torch.tensor(list(b"hello"), dtype=torch.uint8)
    assert peek(va, 5) == b"hello"
    poke(va + 10, b"\x07")
    assert int(t[10]) == 7
    view = t.view(torch.int32)[:2]  # typed views share the memory too
    assert view.data_ptr() == va
    del t, view
    gc.collect()
    assert stub.dlpack_deletes() == 1
    t = dlpack.byte_tensor_at(va, G, dlpack.kDLCPU)  # default deleter: libc free
    del t
    drv.unmap(va, G)
    drv.release(h)
    drv.free(va, G)


def test_storage_view_of_mapped_memory(drv: MusaDriver) -> None:
    va, h = _mapped(drv)
    t = dlpack.storage_tensor_at(va, G, torch.device("cpu"))
    assert t.data_ptr() == va and t.shape == (G,)
    t[3] = 42
    assert peek(va + 3, 1) == b"\x2a"
    del t
    drv.unmap(va, G)
    drv.release(h)
    drv.free(va, G)


def test_dlpack_rejects_unknown_device_types() -> None:
    buf = (ctypes.c_uint8 * 16)()
    with pytest.raises(Exception, match="Unsupported device_type"):
        dlpack.byte_tensor_at(ctypes.addressof(buf), 16, 99)
