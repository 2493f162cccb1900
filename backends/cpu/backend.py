"""The cpu backend: graphslot on host memory, the embedded default and what CI runs.

VMM is real (:mod:`.driver`: ``mmap``, ``memfd``, ``MAP_FIXED``, ``mprotect``), streams
are worker threads with real fences (:mod:`.streams`), graphs record and replay host
work (:mod:`.graph`). Touching an address with nothing mapped raises SIGSEGV, so a stale
pointer fails as loudly here as on a device.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import weakref
from typing import Any, ContextManager, Iterator

import torch

from graphslot.backend import Backend, Capabilities, DeviceGraph, RngStream
from graphslot.errors import UsageError

from . import streams as _s
from .driver import GRANULARITY_ENV, MAX_GRANULARITY, PAGE, CpuDriver, Quarantine, parse_granularity

__all__ = ["CpuBackend", "CpuDriver", "Quarantine", "bytes_at", "iter_maps", "parse_granularity",
           "PAGE", "GRANULARITY_ENV", "MAX_GRANULARITY"]

_libc = ctypes.CDLL(None, use_errno=True)


def bytes_at(va: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``[va, va + nbytes)`` of this process, without copying."""
    buf = (ctypes.c_uint8 * nbytes).from_address(va)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)




class CpuBackend(Backend):
    """graphslot on host memory; see the module docstring for the mapping to Linux."""

    name = "cpu"

    driver: CpuDriver

    # Graphs hold events as host steps (below); the footprint is read from /proc; of the
    # allocator's figures only graph pools are known (graphslot's own), torch's host
    # allocator keeping no statistics.
    capabilities = Capabilities(graph_events=True, rng_streams=True, footprint=True,
                                allocator_stats=True, region_graphs=True)

    def __init__(self, granularity: int | None = None) -> None:
        super().__init__(CpuDriver(granularity))
        self._streams: weakref.WeakSet[_s.CpuStream] = weakref.WeakSet()
        self._capture = threading.local()
        self._graphs: weakref.WeakSet[DeviceGraph] = weakref.WeakSet()

    # -- memory ---------------------------------------------------------------

    @property
    def quarantine(self) -> Quarantine:
        """Freed address ranges not yet given back to the kernel (see :class:`Quarantine`)."""
        return self.driver.quarantine

    def release_quarantine(self) -> None:
        """``munmap`` every quarantined range now (see :class:`Quarantine`)."""
        with self.driver_lock:
            self.quarantine.release()

    def headroom_bytes(self) -> int:
        """Bytes ``create`` may still commit (see :meth:`CpuDriver.headroom_bytes`)."""
        return self.driver.headroom_bytes()

    # -- capture state ----------------------------------------------------------

    def vendor_is_capturing(self) -> bool:
        return bool(getattr(self._capture, "active", False))

    def _set_capturing(self, on: bool, graph: Any = None) -> None:
        self._capture.active = on
        self._capture.graph = graph

    # -- streams and events -----------------------------------------------------

    def current_stream(self) -> _s.CpuStream:
        return _s.current()

    def new_stream(self) -> _s.CpuStream:
        s = _s.CpuStream()
        self._streams.add(s)
        return s

    def stream(self, stream: Any) -> ContextManager[Any]:
        return _StreamContext(stream)

    def vendor_new_event(self, timing: bool) -> _s.CpuEvent:
        return _s.CpuEvent(timing)

    # A graph under capture keeps a record or a wait as a host step of its own, run at
    # its place at every replay on the replaying thread itself (a replay runs its ops
    # there, in program order, whatever stream is current: a record marks everything
    # before it as done, and a wait blocks the replay until the copy thread gets there):
    # the device graph's record and wait nodes.

    def vendor_new_graph_event(self) -> _s.CpuEvent:
        return _s.CpuEvent()

    def _capturing_graph(self) -> Any:
        return self._capture.graph

    def vendor_graph_record(self, event: Any) -> None:
        self._capturing_graph().host_step(lambda: event.record(_s.INLINE))

    def vendor_graph_wait(self, event: Any) -> None:
        self._capturing_graph().host_step(lambda: event.wait(_s.INLINE))

    def vendor_synchronize(self) -> None:
        for s in list(self._streams):
            s.drain()

    # -- tensors and copies -----------------------------------------------------

    def vendor_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        stream.submit(lambda: dst.copy_(src))

    def vendor_pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def vendor_tensor_at(self, va: int, nbytes: int) -> torch.Tensor:
        return bytes_at(va, nbytes)

    # -- graphs -----------------------------------------------------------------

    def vendor_new_rng_stream(self) -> RngStream:
        from .rng import CpuRngStream

        return CpuRngStream(self, self.rng_stream_seed(torch.initial_seed()))

    def new_graph(self, share_pool_with: DeviceGraph | None = None,
                  pool_region: tuple[int, int] | None = None) -> DeviceGraph:
        from .graph import CpuGraph, RegionCpuGraph, RegionPool

        if pool_region is not None and share_pool_with is not None:
            raise UsageError("new_graph: pass share_pool_with or pool_region, not both")
        region = RegionPool(self, pool_region) if pool_region is not None else (
            share_pool_with._region if isinstance(share_pool_with, CpuGraph) else None)
        g = CpuGraph(self) if region is None else RegionCpuGraph(self, region)
        self._graphs.add(g)
        return g

    def vendor_region_capture_kwargs(self) -> dict[str, Any]:
        return {}  # (a region graph captures on any stream, as an ordinary one does)

    def vendor_empty_cache(self) -> None:
        if hasattr(_libc, "malloc_trim"):
            _libc.malloc_trim(0)  # glibc keeps freed heap pages resident otherwise

    def vendor_footprint_bytes(self) -> int:
        # The process's anonymous memory (proportional), with graphslot's memfd pages
        # counted from the kernel: shared pages count once however often they are mapped,
        # but Pss sees them only once a mapping touched them (create commits all of them at
        # once). File-backed pages (the libraries) are left out: their proportional share
        # moves whenever another process maps or unmaps the same files.
        fields = {}
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if rest.strip().endswith("kB"):
                    fields[key] = int(rest.split()[0]) * 1024
        with self.driver_lock:  # (the driver worker releases allocations, closing their fds)
            memfd = sum(os.fstat(a.handle.fd).st_blocks * 512 for a in self.ledger.allocations)
        own = fields.get("Pss_Anon")
        if own is None:  # kernels before 5.9: all but shmem
            own = fields["Pss"] - fields["Pss_Shmem"]
        return own + memfd

    def vendor_allocator_stats(self, reset_peak: bool) -> dict[str, int | None]:
        pools = sum(getattr(g, "pool_bytes", 0) for g in list(self._graphs))
        return {"allocated_bytes": None, "reserved_bytes": None, "peak_reserved_bytes": None,
                "peak_allocated_bytes": None, "graph_pool_reserved_bytes": pools,
                "graph_pool_allocated_bytes": pools}

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
