"""The MUSA driver (libmusa.so) through ctypes: only the calls graphslot needs.

This module needs neither torch nor torch_musa, so it can be tested against any
library that exports the same symbols (``tests/musa_stub/`` builds such a test
double from C).

* :class:`MusaLibrary` opens libmusa and resolves every symbol up front, so a driver
  too old for virtual memory management is reported at load time, naming what is
  missing, instead of failing at the first ``muMemMap``.
* :class:`MusaDriver` binds the library to one device. Its methods return plain ints
  and raise :class:`~graphslot.errors.DriverError` with ``op=""`` (the backend's
  checked layer fills in what it was doing), the symbol that failed, the MUSA error
  name and the numeric code.

The library is found, in order: ``$GRAPHSLOT_LIBMUSA`` (that path only, nothing else
is tried), ``ctypes.util.find_library("musa")``, ``libmusa.so`` on the loader's search
path, ``$MUSA_HOME/lib/libmusa.so`` (``MUSA_HOME`` defaults to ``/usr/local/musa``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong
from typing import Any, Callable

from graphslot.errors import BackendUnavailableError, DriverError

from . import abi
from .abi import MUcontext, MUdevice, MUdeviceptr, MUmemGenericAllocationHandle, MUresult

__all__ = ["ENV_LIBMUSA", "MusaUnavailable", "MusaLibrary", "MusaDriver", "library_candidates",
           "CORE_SYMBOLS", "VMM_SYMBOLS", "OPTIONAL_SYMBOLS", "probe_driver"]

#: Environment variable naming the libmusa to load (a path, or a name for dlopen).
ENV_LIBMUSA = "GRAPHSLOT_LIBMUSA"


class MusaUnavailable(BackendUnavailableError):
    """libmusa cannot be used here; the message says exactly why."""


# Each entry: logical name -> (exported names to try in order, argtypes). Every function
# returns MUresult. Where CUDA's header redirects a name to a "_v2" export, libmusa is
# assumed to follow suit, so the "_v2" spelling is tried first (third-party loaders of
# libmusa resolve muMemGetInfo_v2); the plain name is the fallback.
_Sig = tuple[tuple[str, ...], list[Any]]

CORE_SYMBOLS: dict[str, _Sig] = {
    "muInit": (("muInit",), [c_uint]),
    "muDriverGetVersion": (("muDriverGetVersion",), [POINTER(c_int)]),
    "muDeviceGet": (("muDeviceGet",), [POINTER(MUdevice), c_int]),
    "muDeviceGetAttribute": (("muDeviceGetAttribute",), [POINTER(c_int), c_int, MUdevice]),
    "muDevicePrimaryCtxRetain": (("muDevicePrimaryCtxRetain",), [POINTER(MUcontext), MUdevice]),
    "muCtxSetCurrent": (("muCtxSetCurrent",), [MUcontext]),
    "muMemGetInfo": (("muMemGetInfo_v2", "muMemGetInfo"), [POINTER(c_size_t), POINTER(c_size_t)]),
}

VMM_SYMBOLS: dict[str, _Sig] = {
    "muMemAddressReserve": (("muMemAddressReserve",),
                            [POINTER(MUdeviceptr), c_size_t, c_size_t, MUdeviceptr, c_ulonglong]),
    "muMemAddressFree": (("muMemAddressFree",), [MUdeviceptr, c_size_t]),
    "muMemCreate": (("muMemCreate",), [POINTER(MUmemGenericAllocationHandle), c_size_t,
                                       POINTER(abi.MUmemAllocationProp), c_ulonglong]),
    "muMemRelease": (("muMemRelease",), [MUmemGenericAllocationHandle]),
    "muMemMap": (("muMemMap",), [MUdeviceptr, c_size_t, c_size_t, MUmemGenericAllocationHandle,
                                 c_ulonglong]),
    "muMemUnmap": (("muMemUnmap",), [MUdeviceptr, c_size_t]),
    "muMemSetAccess": (("muMemSetAccess",), [MUdeviceptr, c_size_t, POINTER(abi.MUmemAccessDesc),
                                             c_size_t]),
    "muMemGetAllocationGranularity": (("muMemGetAllocationGranularity",),
                                      [POINTER(c_size_t), POINTER(abi.MUmemAllocationProp), c_int]),
}

#: Used when present: better error names, and giving the primary context back.
OPTIONAL_SYMBOLS: dict[str, _Sig] = {
    "muGetErrorName": (("muGetErrorName",), [MUresult, POINTER(c_char_p)]),
    "muGetErrorString": (("muGetErrorString",), [MUresult, POINTER(c_char_p)]),
    "muDevicePrimaryCtxRelease": (("muDevicePrimaryCtxRelease_v2", "muDevicePrimaryCtxRelease"),
                                  [MUdevice]),
}


def library_candidates() -> list[str]:
    """Where libmusa is looked for when ``$GRAPHSLOT_LIBMUSA`` is not set, in order."""
    out = []
    found = ctypes.util.find_library("musa")
    if found:
        out.append(found)
    out.append("libmusa.so")
    out.append(os.path.join(os.environ.get("MUSA_HOME", "/usr/local/musa"), "lib", "libmusa.so"))
    return list(dict.fromkeys(out))


def _open(path: str | None) -> tuple[ctypes.CDLL, str]:
    path = path or os.environ.get(ENV_LIBMUSA) or None
    if path:
        # An explicit choice is never second-guessed: loading something else instead
        # would hide a typo in the path.
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            raise MusaUnavailable(f"{ENV_LIBMUSA}={path} could not be loaded: {e}") from None
    tried = library_candidates()
    for cand in tried:
        try:
            return ctypes.CDLL(cand), cand
        except OSError:
            continue
    raise MusaUnavailable(f"libmusa.so not found (set {ENV_LIBMUSA}; tried {', '.join(tried)})")


class MusaLibrary:
    """libmusa, opened, with every symbol graphslot calls resolved and typed.

    ``fn[name]`` is the callable for a logical name (``"muMemGetInfo"``), ``symbols[name]``
    the export it resolved to (``"muMemGetInfo_v2"``). Optional symbols that are missing
    are simply absent from both.
    """

    def __init__(self, path: str | None = None) -> None:
        self.cdll, self.path = _open(path)
        self.fn: dict[str, Callable[..., int]] = {}
        self.symbols: dict[str, str] = {}
        missing_core = self._resolve(CORE_SYMBOLS)
        missing_vmm = self._resolve(VMM_SYMBOLS)
        self._resolve(OPTIONAL_SYMBOLS)
        if missing_core:
            raise MusaUnavailable(f"{self.path} lacks {', '.join(missing_core)}: it is not a "
                                  f"MUSA driver library (check {ENV_LIBMUSA})")
        if missing_vmm:
            raise MusaUnavailable(
                f"libmusa ({self.path}) lacks {', '.join(missing_vmm)}: driver too old for VMM "
                "(virtual memory management needs a MUSA 4.0 or newer driver)")

    def _resolve(self, table: dict[str, _Sig]) -> list[str]:
        missing = []
        for name, (exports, argtypes) in table.items():
            for export in exports:
                try:
                    f = getattr(self.cdll, export)
                except AttributeError:
                    continue
                f.restype = MUresult
                f.argtypes = argtypes
                self.fn[name] = f
                self.symbols[name] = export
                break
            else:
                missing.append(name)
        return missing


class MusaDriver:
    """libmusa bound to device ordinal ``device``; see the module docstring.

    The device's primary context (the one torch_musa's runtime uses, so both see the
    same memory) is retained on first use and made current once on every thread that
    calls the driver: the offload engine's worker thread is such a thread, and
    driver VMM calls fail with ``MUSA_ERROR_INVALID_CONTEXT`` on a thread that has none.
    """

    def __init__(self, device: int = 0, path: str | None = None,
                 library: MusaLibrary | None = None) -> None:
        self.lib = library or MusaLibrary(path)
        self.index = int(device)
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._ctx: MUcontext | None = None
        self._call("muInit", 0)
        dev = MUdevice()
        self._call("muDeviceGet", byref(dev), self.index)
        self.device = dev.value
        self._prop = abi.MUmemAllocationProp()  # zeroed: members graphslot leaves alone stay 0
        self._prop.type = abi.MU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = abi.MU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.index

    # ------------------------------------------------------------------ errors

    def error_name(self, code: int) -> str:
        """The driver's name for ``code`` (``muGetErrorName``), else graphslot's table."""
        f = self.lib.fn.get("muGetErrorName")
        if f is not None:
            s = c_char_p()
            if f(code, byref(s)) == abi.MUSA_SUCCESS and s.value:
                return s.value.decode(errors="replace")
        return abi.error_name_from_table(code)

    def error_string(self, code: int) -> str:
        """The driver's description of ``code`` (``muGetErrorString``), or ``""``."""
        f = self.lib.fn.get("muGetErrorString")
        if f is not None:
            s = c_char_p()
            if f(code, byref(s)) == abi.MUSA_SUCCESS and s.value:
                return s.value.decode(errors="replace")
        return ""

    def _call(self, name: str, *args: Any) -> None:
        rc = self.lib.fn[name](*args)
        if rc != abi.MUSA_SUCCESS:
            raise DriverError("", self.lib.symbols[name], self.error_name(rc), int(rc),
                              self.error_string(rc))

    # ------------------------------------------------------------------ context

    def _context(self) -> MUcontext:
        with self._lock:
            if self._ctx is None:
                ctx = MUcontext()
                self._call("muDevicePrimaryCtxRetain", byref(ctx), self.device)
                self._ctx = ctx
            return self._ctx

    def make_current(self) -> None:
        """Make the primary context current on this thread (once per thread)."""
        if not getattr(self._tls, "ready", False):
            self._call("muCtxSetCurrent", self._context())
            self._tls.ready = True

    def close(self) -> None:
        """Give the retained primary context back, if any (libmusa permitting)."""
        with self._lock:
            if self._ctx is None:
                return
            f = self.lib.fn.get("muDevicePrimaryCtxRelease")
            self._ctx = None
            # Threads that made it current must set it again if the driver is reused.
            self._tls = threading.local()
            if f is not None:
                self._call("muDevicePrimaryCtxRelease", self.device)

    # ------------------------------------------------------------------ device

    def driver_version(self) -> int:
        """``muDriverGetVersion``: an int, assumed to be encoded like CUDA's (1000*major + 10*minor)."""
        v = c_int()
        self._call("muDriverGetVersion", byref(v))
        return v.value

    def attribute(self, attr: int) -> int:
        """``muDeviceGetAttribute`` of this device."""
        v = c_int()
        self._call("muDeviceGetAttribute", byref(v), int(attr), self.device)
        return v.value

    def vmm_supported(self) -> bool:
        """Whether the device reports virtual memory management support."""
        return bool(self.attribute(abi.MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED))

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory."""
        self.make_current()
        free, total = c_size_t(), c_size_t()
        self._call("muMemGetInfo", byref(free), byref(total))
        return free.value, total.value

    # ------------------------------------------------------------------ VMM

    def granularity(self, option: int = abi.MU_MEM_ALLOC_GRANULARITY_MINIMUM) -> int:
        """Allocation granularity in bytes for pinned device memory on this device."""
        self.make_current()
        g = c_size_t()
        self._call("muMemGetAllocationGranularity", byref(g), byref(self._prop), int(option))
        return g.value

    def reserve(self, size: int, alignment: int = 0, addr: int = 0) -> int:
        """``muMemAddressReserve``: a new VA range of ``size`` bytes."""
        self.make_current()
        va = MUdeviceptr()
        self._call("muMemAddressReserve", byref(va), size, alignment, addr, 0)
        return va.value

    def free(self, va: int, size: int) -> None:
        """``muMemAddressFree`` of a whole reservation."""
        self.make_current()
        self._call("muMemAddressFree", va, size)

    def create(self, size: int) -> int:
        """``muMemCreate``: ``size`` bytes of pinned device memory; returns the handle."""
        self.make_current()
        h = MUmemGenericAllocationHandle()
        self._call("muMemCreate", byref(h), size, byref(self._prop), 0)
        return h.value

    def release(self, handle: int) -> None:
        """``muMemRelease`` of a handle from :meth:`create`."""
        self.make_current()
        self._call("muMemRelease", handle)

    def map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        """``muMemMap``: back ``[va, va + size)`` with ``handle`` from ``offset``."""
        self.make_current()
        self._call("muMemMap", va, size, offset, handle, 0)

    def unmap(self, va: int, size: int) -> None:
        """``muMemUnmap`` of ``[va, va + size)``; the range stays reserved."""
        self.make_current()
        self._call("muMemUnmap", va, size)

    def set_access(self, va: int, size: int,
                   flags: int = abi.MU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> None:
        """``muMemSetAccess``: grant this device ``flags`` on a mapped range."""
        self.make_current()
        desc = abi.MUmemAccessDesc()
        desc.location.type = abi.MU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.index
        desc.flags = int(flags)
        self._call("muMemSetAccess", va, size, byref(desc), 1)

    def __repr__(self) -> str:
        return f"<MusaDriver device {self.index} via {self.lib.path}>"


def probe_driver(device: int = 0, path: str | None = None) -> str | None:
    """``None`` when libmusa, MUSA device ``device`` and its VMM support are all there,
    else one sentence saying what is not. Retains no context and maps nothing."""
    try:
        drv = MusaDriver(device, path)
    except MusaUnavailable as e:
        return str(e)
    except DriverError as e:
        what = "no usable MUSA device" if e.call == "muInit" else f"MUSA device {device} is not usable"
        return f"{what}: {e.call} failed with {e.name} ({e.code})"
    try:
        if not drv.vmm_supported():
            return (f"MUSA device {device} does not support virtual memory management "
                    "(MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)")
    except DriverError as e:
        return (f"cannot ask MUSA device {device} whether it supports virtual memory "
                f"management: {e.call} failed with {e.name} ({e.code})")
    return None
