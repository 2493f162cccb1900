"""Real virtual-memory management on host memory.

The driver model maps one to one onto Linux:

=================  ==========================================================
reserve            ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
create             ``memfd_create`` + ``ftruncate`` (pages appear when touched)
map                ``mmap(MAP_SHARED|MAP_FIXED)`` of the memfd at the address,
                   still ``PROT_NONE`` until access is granted
set_access         ``mprotect(PROT_READ|PROT_WRITE)``
unmap              ``mmap(PROT_NONE, MAP_FIXED|MAP_ANONYMOUS)`` over the range:
                   the reservation stays, the pages are no longer reachable
release            ``close`` of the memfd: once unmapped, the kernel frees the pages
free               ``munmap`` of the reservation
=================  ==========================================================

Touching an address with nothing mapped raises SIGSEGV, so a stale pointer fails as
loudly here as on a device.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
import time
import weakref
from typing import Any, ContextManager, Iterator

import torch

from graphslot.backend import Backend, DeviceGraph
from graphslot.errors import DriverError, UsageError

from . import streams as _s

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = os.sysconf("SC_PAGE_SIZE")


def _os_error(call: str, err: int | None = None, detail: str = "") -> DriverError:
    err = ctypes.get_errno() if err is None else err
    return DriverError("", call, errno.errorcode.get(err, "EUNKNOWN"), err,
                       detail or os.strerror(err))


def bytes_at(va: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``[va, va + nbytes)`` of this process, without copying."""
    buf = (ctypes.c_uint8 * nbytes).from_address(va)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


class _Memfd:
    """Physical backing: an anonymous memory file."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size


class CpuBackend(Backend):
    """graphslot on host memory; see the module docstring for the mapping to Linux."""

    name = "cpu"

    def __init__(self, granularity: int | None = None) -> None:
        super().__init__()
        if granularity is None:
            granularity = int(os.environ.get("GRAPHSLOT_CPU_GRANULARITY", PAGE))
        if granularity <= 0 or granularity % PAGE:
            raise UsageError(f"cpu granularity must be a positive multiple of the page size "
                             f"{PAGE}, got {granularity}")
        self._gran = granularity
        self._streams: weakref.WeakSet[_s.CpuStream] = weakref.WeakSet()
        self._capture = threading.local()
        self._graphs: weakref.WeakSet[DeviceGraph] = weakref.WeakSet()

    # -- memory ---------------------------------------------------------------

    def _granularity_bytes(self) -> int:
        return self._gran

    def _reserve(self, size: int, alignment: int) -> int:
        align = max(alignment, self._gran)
        span = size + (align - PAGE if align > PAGE else 0)
        addr = _libc.mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if addr == MAP_FAILED or addr is None:
            raise _os_error("mmap")
        start = -(-addr // align) * align
        # Trim the slack so exactly [start, start + size) stays reserved.
        if start > addr:
            _libc.munmap(addr, start - addr)
        tail = addr + span - (start + size)
        if tail > 0:
            _libc.munmap(start + size, tail)
        return start

    def _free(self, va: int, size: int) -> None:
        if _libc.munmap(va, size) != 0:
            raise _os_error("munmap")

    def _create(self, size: int) -> Any:
        try:
            fd = os.memfd_create("graphslot", os.MFD_CLOEXEC)
        except OSError as e:
            raise _os_error("memfd_create", e.errno) from None
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            raise _os_error("ftruncate", e.errno) from None
        return _Memfd(fd, size)

    def _release(self, handle: Any) -> None:
        try:
            os.close(handle.fd)
        except OSError as e:
            raise _os_error("close", e.errno) from None

    def _map(self, va: int, size: int, handle: Any) -> None:
        addr = _libc.mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle.fd, 0)
        if addr == MAP_FAILED or addr != va:
            raise _os_error("mmap")

    def _unmap(self, va: int, size: int) -> None:
        addr = _libc.mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                          -1, 0)
        if addr == MAP_FAILED or addr != va:
            raise _os_error("mmap")

    def _set_access(self, va: int, size: int) -> None:
        if _libc.mprotect(va, size, PROT_READ | PROT_WRITE) != 0:
            raise _os_error("mprotect")

    def _mem_info(self) -> tuple[int, int]:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]

    # -- capture state ----------------------------------------------------------

    def _is_capturing(self) -> bool:
        return bool(getattr(self._capture, "active", False))

    def _set_capturing(self, on: bool) -> None:
        self._capture.active = on

    # -- streams and events -----------------------------------------------------

    def current_stream(self) -> _s.CpuStream:
        return _s.current()

    def new_stream(self) -> _s.CpuStream:
        s = _s.CpuStream()
        self._streams.add(s)
        return s

    def stream(self, stream: Any) -> ContextManager[Any]:
        return _StreamContext(stream)

    def new_event(self, timing: bool = False) -> _s.CpuEvent:
        return _s.CpuEvent(timing)

    def _record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def _wait(self, stream: Any, event: Any) -> None:
        event.wait_on(stream)

    def query_event(self, event: Any) -> bool:
        return bool(event.query())

    def _event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_ms(end))

    def _synchronize(self) -> None:
        for s in list(self._streams):
            s.drain()

    def spin(self, seconds: float, stream: Any = None) -> None:
        (stream or self.current_stream()).submit(lambda: time.sleep(seconds))

    # -- tensors and copies -----------------------------------------------------

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        stream.submit(lambda: dst.copy_(src))

    def _pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _tensor_at(self, va: int, nbytes: int) -> torch.Tensor:
        return bytes_at(va, nbytes)

    # -- graphs -----------------------------------------------------------------

    def new_graph(self, share_pool_with: DeviceGraph | None = None,
                  pool_region: tuple[int, int] | None = None) -> DeviceGraph:
        from .graph import CpuGraph, RegionPool

        if pool_region is not None and share_pool_with is not None:
            raise UsageError("new_graph: pass share_pool_with or pool_region, not both")
        region = RegionPool(self, pool_region) if pool_region is not None else (
            share_pool_with._region if isinstance(share_pool_with, CpuGraph) else None)
        g = CpuGraph(self, region)
        self._graphs.add(g)
        return g

    def empty_cache(self) -> None:
        if hasattr(_libc, "malloc_trim"):
            _libc.malloc_trim(0)  # glibc keeps freed heap pages resident otherwise

    def footprint_bytes(self) -> int | None:
        # Proportional set size, with graphslot's memfd pages counted from the kernel:
        # shared pages count once however often they are mapped, but Pss sees them only
        # once a mapping touched them.
        fields = {}
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if rest.strip().endswith("kB"):
                    fields[key] = int(rest.split()[0]) * 1024
        memfd = sum(os.fstat(a.handle.fd).st_blocks * 512 for a in self.ledger.allocations)
        return fields["Pss"] - fields["Pss_Shmem"] + memfd

    def allocator_stats(self, reset_peak: bool = False) -> dict[str, int | None]:
        # torch's host allocator keeps no statistics; graph pools are ours and exact.
        pools = sum(getattr(g, "pool_bytes", 0) for g in list(self._graphs))
        return {"allocated_bytes": None, "reserved_bytes": None, "peak_reserved_bytes": None,
                "graph_pool_reserved_bytes": pools, "graph_pool_allocated_bytes": pools}

    # -- info -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def describe(self) -> dict[str, Any]:
        return {
            "device": f"host memory via memfd ({platform.machine()}, {os.cpu_count()} cores)",
            "vmm_supported": True,
            "versions": {
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "kernel": platform.release(),
            },
        }


class _StreamContext:
    def __init__(self, stream: _s.CpuStream) -> None:
        self._stream = stream
        self._prev: _s.CpuStream | None = None

    def __enter__(self) -> _s.CpuStream:
        self._prev = getattr(_s._tls, "stream", None)
        _s.set_current(self._stream)
        return self._stream

    def __exit__(self, *exc: Any) -> None:
        _s.set_current(self._prev)


def iter_maps() -> Iterator[tuple[int, int, str]]:
    """``(start, end, perms)`` of each mapping of this process (for leak checks)."""
    with open("/proc/self/maps") as f:
        for line in f:
            rng, perms = line.split()[:2]
            a, b = rng.split("-")
            yield int(a, 16), int(b, 16), perms
