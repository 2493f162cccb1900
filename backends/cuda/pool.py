"""CUDA graph private pools drawn from a graphslot VA region.

``backend.new_graph(pool_region=(va, size))`` returns a :class:`RegionCudaGraph`: a
``torch.cuda.CUDAGraph`` captured into a ``torch.cuda.MemPool`` whose allocator is
graphslot's (``torch.cuda.memory.CUDAPluggableAllocator`` loading ``arena_alloc.c``), so
every segment of the graph's private pool is a byte range of ``[va, va + size)``. Only
public torch interfaces are used: the pluggable allocator, ``MemPool`` and
``torch.cuda.graph(pool=...)``; no allocator checkpointing.

The region is graphslot's: the caller reserves it and maps physical memory behind it
(:mod:`graphslot.arena` maps one allocation behind the regions of several mutually
exclusive variants). Capture launches nothing, so the region need not be mapped while
capturing, only before the first replay; :meth:`RegionCudaGraph.replay` checks that it
is, so a missing mapping is a :class:`~graphslot.errors.StateError`, not a lost context.

Region graphs capture on one graphslot capture stream per device (:func:`capture_stream`),
warmed up before every capture (a linear layer forward and backward in three dtypes, on
the capturing thread, so autograd's device thread is covered too). Per-stream library
caches such as the cuBLAS/cuBLASLt workspaces then already exist, in torch's ordinary
pool, when capture starts. Created during a capture instead, such a cache would land in
that variant's region and be reused by the next variant's graph, whose own data shares
those physical pages. Library caches keyed otherwise are not covered: capture on the
threads and streams that were warmed up.

Requirements: torch's native caching allocator (not ``cudaMallocAsync``) without
``expandable_segments`` (a ``MemPool`` with a custom allocator works with neither), and a
C compiler (``$CC`` or ``gcc``) to build the shim once into ``$GRAPHSLOT_CACHE_DIR``
(default ``~/.cache/graphslot``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator

from graphslot.errors import BackendUnavailableError, PoolFullError, StateError, UsageError
from graphslot.regions import Block, RegionGraph

# RegionCudaGraph is importable too; it is built on first access (see __getattr__ below).
__all__ = ["Shim", "shim", "shim_path", "capture_stream", "warm_up"]

_SRC = Path(__file__).with_name("arena_alloc.c")
_ALIGN = 512  # segment alignment inside a region (torch's segments are 2 MiB multiples anyway)
_build_lock = threading.Lock()
#: the most allocator events :meth:`_Region.recording` keeps (torch's history is a ring:
#: past this, the start of what it recorded is lost, and it says so)
_MAX_EVENTS = 4_000_000
#: held while a region's recording has torch's allocator history on (one per process)
_recording = threading.Lock()


def _cache_dir() -> Path:
    env = os.environ.get("GRAPHSLOT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "graphslot"


def shim_path() -> str:
    """Path of the compiled allocator shim, building it on first use.

    The file name carries a hash of the source and the compiler command, so an edited
    source or another compiler builds a new file; the build writes a temporary file and
    renames it, so concurrent processes never load a half-written library.
    """
    with _build_lock:
        cc = os.environ.get("CC", "gcc")
        compiler = shutil.which(cc)
        src = _SRC.read_bytes()
        flags = ["-O2", "-shared", "-fPIC", "-std=c11", "-Wall", "-pthread"]
        tag = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
        out = _cache_dir() / f"graphslot_arena_alloc-{tag}.so"
        if out.exists():
            return str(out)
        if compiler is None:
            raise BackendUnavailableError(
                f"graph pool regions on cuda need a C compiler to build {_SRC.name} once "
                f"(looked for {cc!r}: set $CC or install gcc)")
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *flags, "-o", tmp, str(_SRC)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise BackendUnavailableError(
                    f"building {_SRC.name} with {compiler} failed ({proc.returncode}):\n"
                    f"{proc.stderr.strip()}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return str(out)


class Shim:
    """ctypes view of the allocator shim; the same library instance torch loads."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        sz = ctypes.c_size_t
        lib.gs_region_add.argtypes = [ctypes.c_size_t, sz, sz]
        lib.gs_region_add.restype = ctypes.c_int
        for name in ("gs_region_remove", "gs_region_retire", "gs_region_activate"):
            getattr(lib, name).argtypes = [ctypes.c_int]
            getattr(lib, name).restype = ctypes.c_int
        lib.gs_active.argtypes = []
        lib.gs_active.restype = ctypes.c_int
        lib.gs_region_stats.argtypes = [ctypes.c_int, ctypes.POINTER(sz)]
        lib.gs_region_stats.restype = ctypes.c_int
        lib.gs_global_stats.argtypes = [ctypes.POINTER(sz)]
        lib.gs_global_stats.restype = None
        lib.gs_malloc.argtypes = [sz, ctypes.c_int, ctypes.c_void_p]
        lib.gs_malloc.restype = ctypes.c_void_p
        lib.gs_free.argtypes = [ctypes.c_void_p, sz, ctypes.c_int, ctypes.c_void_p]
        lib.gs_free.restype = None
        self.lib = lib

    def add(self, va: int, size: int, align: int = _ALIGN) -> int:
        rid = self.lib.gs_region_add(va, size, align)
        if rid == -2:
            raise UsageError(f"pool_region [0x{va:x}, 0x{va + size:x}) overlaps a region "
                             "another graph pool already draws from")
        if rid < 0:
            raise UsageError(f"pool_region (0x{va:x}, {size}) was refused by the allocator "
                             f"shim ({rid}): address and size must be positive and the "
                             f"address {align}-byte aligned")
        return rid

    def remove(self, rid: int) -> bool:
        """Forget region ``rid``; False while torch still holds blocks in it."""
        return self.lib.gs_region_remove(rid) == 0

    def retire(self, rid: int) -> None:
        """Stop allocating from ``rid``; the shim forgets it once torch frees its last block."""
        self.lib.gs_region_retire(rid)

    def activate(self, rid: int) -> None:
        rc = self.lib.gs_region_activate(rid)
        if rc == -2:
            raise StateError("another graph is being captured into a pool region; "
                             "capture one graph at a time")
        if rc != 0:
            raise StateError(f"pool region {rid} is not registered (released?)")

    def deactivate(self) -> None:
        self.lib.gs_region_activate(-1)

    @property
    def active(self) -> int:
        return int(self.lib.gs_active())

    def stats(self, rid: int) -> dict[str, int]:
        """``live``, ``high`` (high-water mark), ``blocks``, ``failed`` (last request that
        did not fit, 0 if none), ``allocs``, ``frees`` of region ``rid``."""
        out = (ctypes.c_size_t * 6)()
        if self.lib.gs_region_stats(rid, out) != 0:
            raise StateError(f"pool region {rid} is not registered (released?)")
        return dict(zip(("live", "high", "blocks", "failed", "allocs", "frees"), map(int, out)))

    def global_stats(self) -> dict[str, int]:
        out = (ctypes.c_size_t * 2)()
        self.lib.gs_global_stats(out)
        return {"unrouted_allocs": int(out[0]), "foreign_frees": int(out[1])}


_shim: Shim | None = None
_allocator: Any = None  # kept for the process: a MemPool does not own its allocator


def shim() -> Shim:
    """The process-wide :class:`Shim` (built and loaded on first use)."""
    global _shim
    if _shim is None:
        _shim = Shim(shim_path())
    return _shim


def _pluggable_allocator() -> Any:
    import torch

    global _allocator
    if _allocator is None:
        conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
        if re.search(r"expandable_segments\s*:\s*true", conf, re.I):
            raise BackendUnavailableError(
                "graph pool regions need torch.cuda.MemPool with a custom allocator, which "
                "torch refuses with expandable_segments:True; unset it in PYTORCH_CUDA_ALLOC_CONF")
        backend = torch.cuda.get_allocator_backend()
        if backend != "native":
            raise BackendUnavailableError(
                f"graph pool regions need torch's native caching allocator, not {backend!r}")
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(shim().path, "gs_malloc", "gs_free")
    return _allocator


_streams: dict[int, Any] = {}


def capture_stream(backend: Any) -> Any:
    """graphslot's capture stream on ``backend``'s device (one per device, made on first use)."""
    import torch

    index = backend.device.index
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(backend.device)
    return _streams[index]


def warm_up(backend: Any, stream: Any) -> None:
    """Create ``stream``'s cuBLAS/cuBLASLt workspaces for this thread and autograd's device
    thread outside any graph pool; a no-op once they exist. See the module docstring."""
    import torch

    # (grad on and saved tensors kept as they are: the caller's no_grad or offload hooks
    # have nothing to do with this)
    with torch.cuda.stream(stream), torch.inference_mode(False), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones(32, 32, device=backend.device, dtype=dtype, requires_grad=True)
            torch.nn.functional.linear(a, a, a[0]).float().sum().backward()
    stream.synchronize()


class _Region:
    """One pool region: the shim's id for it and the MemPool over it."""

    def __init__(self, backend: Any, pool_region: Any) -> None:
        import torch

        va, size, res = backend.pool_region(pool_region)
        allocator = _pluggable_allocator()
        self.backend, self.reservation, self.va, self.size = backend, res, va, size
        self.shim = shim()
        self.id = self.shim.add(va, size)
        self.graphs = 0
        # Graphs dropped without release_pool(): retire the region when this object goes,
        # so a later region over the same (freed and reserved again) addresses is allowed.
        self._finalizer = weakref.finalize(self, self.shim.retire, self.id)
        with torch.cuda.device(backend.device):
            self.mempool: Any = torch.cuda.MemPool(allocator.allocator())

    @property
    def used(self) -> int:
        return self.shim.stats(self.id)["high"]

    def release(self) -> int:
        """Once no graph uses the pool: drop the MemPool and let torch free the region's
        segments. Returns the bytes torch still holds in the region (live tensors)."""
        import gc

        import torch

        if self.graphs > 0:
            return self.size  # still in use by a graph
        if self.id < 0:
            return 0
        self.mempool = None
        gc.collect()
        torch.cuda.synchronize(self.backend.device)
        torch.cuda.empty_cache()
        live = self.shim.stats(self.id)["live"]
        if live == 0 and self.shim.remove(self.id):
            self._finalizer.detach()  # the id may be reused by another region from now on
            self.id = -1
        return live

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Block]]:
        """See :meth:`graphslot.regions.RegionGraph.recording`: from torch's history of the
        caching allocator's events, on for the block (positions are event indices; a
        block ends at its ``free_completed``, after every stream that used it)."""
        import torch

        if not _recording.acquire(blocking=False):
            raise UsageError("a graph pool's blocks are being recorded already (torch's "
                             "allocator history is one per process): one recording at a time")
        try:
            mem = torch.cuda.memory
            dev = self.backend.device
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            first = mem._snapshot(dev)
            traces = first.get("device_traces") or []
            # (history on with "state" only, or on with no event yet, is not seen here)
            if index < len(traces) and traces[index]:
                raise UsageError("recording a graph pool's blocks turns torch's allocator "
                                 "history (torch.cuda.memory._record_memory_history) on and "
                                 "off, and it is recording already: stop it before the build")
            opened = {self.va + off: (n, 0)
                      for off, n in self._live_in(first.get("segments") or [])}
            out: list[Block] = []
            with torch.cuda.device(dev):
                mem._record_memory_history("all", context=None, stacks="python",
                                           max_entries=_MAX_EVENTS)
            try:
                yield out
                snap = mem._snapshot(dev)
            finally:
                with torch.cuda.device(dev):
                    mem._record_memory_history(None)
        finally:
            _recording.release()
        traces = snap.get("device_traces") or []
        events = traces[index] if index < len(traces) else []
        if len(events) >= _MAX_EVENTS:
            raise StateError(f"recording a graph pool's blocks: the allocator made more than "
                             f"{_MAX_EVENTS} events, and the first of them are lost")
        lo, hi = self.va, self.va + self.size
        for i, ev in enumerate(events):
            addr = int(ev.get("addr", 0))
            if not lo <= addr < hi:
                continue
            if ev["action"] == "alloc":
                opened[addr] = (int(ev["size"]), i + 1)
            elif ev["action"] == "free_completed" and addr in opened:
                n, start = opened.pop(addr)
                out.append((addr - lo, n, start, i + 1))
        # (a block still handed out counts at the size the allocator gave it, which
        # live_ranges() reads too; an event has the size asked for, rounded up there)
        given = {lo + off: n for off, n in self._live_in(snap.get("segments") or [])}
        out.extend((addr - lo, max(n, given.get(addr, 0)), start, None)
                   for addr, (n, start) in sorted(opened.items()))

    def live_ranges(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every block of the region's segments that torch has not
        freed (allocated, or freed but still waiting for a stream), from its snapshot."""
        import torch

        return self._live_in(torch.cuda.memory_snapshot())

    def _live_in(self, segments: list[dict[str, Any]]) -> list[tuple[int, int]]:
        """:meth:`live_ranges` as ``segments`` (a memory snapshot's) say."""
        out = []
        for seg in segments:
            addr = int(seg["address"])
            if not self.va <= addr < self.va + self.size:
                continue
            pos = addr
            for blk in seg["blocks"]:
                start = int(blk.get("address", pos))
                if blk["state"] != "inactive":
                    out.append((start - self.va, int(blk["size"])))
                pos = start + int(blk["size"])
        return out

    def check_mapped(self) -> None:
        used = self.used
        res = self.reservation
        off = self.va - res.va
        if res.freed or (used and not res.is_accessible(off, used)):
            raise StateError(f"replay would touch the graph pool region at 0x{self.va:x} "
                             f"({used} bytes used), where nothing accessible is mapped; map "
                             "the region before replaying")


def _define() -> type:
    from .backend import CudaGraph

    class _RegionCudaGraph(CudaGraph, RegionGraph):
        """A :class:`CudaGraph` whose private pool is a MemPool over a graphslot region:
        the :class:`~graphslot.regions.RegionGraph` of the cuda backend."""

        @classmethod
        def make(cls, backend: Any, pool_region: Any, share_pool_with: Any) -> _RegionCudaGraph:
            if pool_region is not None and share_pool_with is not None:
                raise UsageError("new_graph: pass share_pool_with or pool_region, not both")
            region = share_pool_with._region if pool_region is None else _Region(backend, pool_region)
            return cls(backend, region)

        def __init__(self, backend: Any, region: _Region) -> None:
            super().__init__(backend, region.mempool.id)
            self._region = region
            self._state = "empty"
            region.graphs += 1

        @contextlib.contextmanager
        def routing(self, stream: Any = None) -> Iterator[None]:
            """Route this pool's allocations into the region for the block.

            :meth:`capture` does it around its own capture; code that captures its own
            graphs into ``self.pool`` (TransformerEngine's ``make_graphed_callables``)
            runs under it. ``stream``, when given, is warmed up first, outside the region.
            """
            r = self._region
            if r.id < 0 or r.mempool is None:
                raise StateError("this graph's pool region was released")
            if stream is not None:
                warm_up(self._backend, stream)  # before activating: nothing of it may land in the region
            r.shim.activate(r.id)
            try:
                yield
            except BaseException as e:
                counts = r.shim.stats(r.id)
                # torch reports the NULL from gs_malloc as an out-of-memory error (or, if
                # its error path trips over the capture, as another one): the shim knows.
                if counts["failed"] and not isinstance(e, PoolFullError):
                    raise PoolFullError(
                        f"graph pool region [0x{r.va:x}, 0x{r.va + r.size:x}) is full: the "
                        f"capture asked for a {counts['failed']}-byte segment with {counts['live']} "
                        f"of {r.size} bytes in use; give the pool a larger region") from e
                raise
            finally:
                r.shim.deactivate()

        @property
        def pool_handle(self) -> Any:
            """The ``MemPool`` id, for ``torch.cuda.graph(pool=...)``."""
            return self.pool

        @contextlib.contextmanager
        def lend(self) -> Iterator[None]:
            """Route this pool's allocations into the region while other code captures
            into :attr:`pool_handle` on torch's default capture stream, which is made (if
            new) and warmed up first, outside the region."""
            import torch

            torch.cuda.graph(torch.cuda.CUDAGraph())  # creates torch's default capture stream, if new
            with self.routing(torch.cuda.graph.default_capture_stream):
                yield

        @contextlib.contextmanager
        def capture(self, stream: Any = None) -> Iterator[None]:
            if self._state != "empty":
                raise StateError(f"this graph is already {self._state}; make a new graph to capture again")
            stream = capture_stream(self._backend) if stream is None else stream
            with self.routing(stream):
                self._state = "capturing"
                try:
                    with super().capture(stream):  # torch.cuda.graph(pool=...), garbage collector paused
                        yield
                except BaseException:
                    self._state = "failed"
                    raise
            self._state = "captured"

        def replay(self) -> None:
            if self._state != "captured":
                raise StateError(f"cannot replay a graph that is {self._state}")
            self._region.check_mapped()
            self.graph.replay()

        @property
        def pool_region(self) -> tuple[int, int]:
            return (self._region.va, self._region.size)

        def live_ranges(self) -> list[tuple[int, int]]:
            return self._region.live_ranges() if self._region.id >= 0 else []

        def recording(self) -> Any:
            if self._region.id < 0:
                raise StateError("this graph's pool region was released")
            return self._region.recording()

        @property
        def pool_used_bytes(self) -> int:
            """High-water mark of the region: the physical bytes the pool needs."""
            return self._region.used if self._region.id >= 0 else 0

        def release_pool(self) -> int:
            """Drop the graph; when it was the pool's last, let torch free the pool's
            segments. Returns the region bytes torch still holds (0: safe to unmap)."""
            if self._state != "released":
                self.graph.reset()
                self._state = "released"
                self._region.graphs -= 1
            return self._region.release()

    _RegionCudaGraph.__name__ = _RegionCudaGraph.__qualname__ = "RegionCudaGraph"
    return _RegionCudaGraph


def __getattr__(name: str) -> Any:
    # RegionCudaGraph subclasses CudaGraph, which imports torch.cuda and cuda-python; build
    # it on first access so the shim half of this module imports anywhere.
    if name == "RegionCudaGraph":
        cls = _define()
        globals()["RegionCudaGraph"] = cls
        return cls
    raise AttributeError(name)
