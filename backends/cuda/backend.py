"""The cuda backend: driver VMM through cuda-python (:mod:`.driver`), streams, events,
copies and graphs through torch.cuda."""

from __future__ import annotations

from typing import Any, ContextManager, Iterator

import contextlib
import dataclasses
import warnings

import torch
from cuda.bindings import driver as cu

from graphslot.backend import Backend, Capabilities, DeviceGraph, RngStream, no_gc
from graphslot.errors import BackendUnavailableError, DriverError, UsageError
from graphslot.regions import RegionGraph

from .driver import CudaDriver, _check


class _CudaArray:
    """Exposes a raw device range through ``__cuda_array_interface__`` (zero copy)."""

    def __init__(self, va: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (va, False), "version": 2,
        }


def _external_events() -> bool:
    """Whether this torch has external events (``torch.cuda.Event(external=True)``)."""
    try:
        torch.cuda.Event(external=True)
    except TypeError:
        return False
    return True


class CudaBackend(Backend):
    """graphslot on an NVIDIA GPU."""

    name = "cuda"

    driver: CudaDriver

    # Graph events besides, where this torch has external events (known in __init__);
    # this process's own footprint cannot be told apart from the driver's figure.
    capabilities = Capabilities(graphed_callables=True, rng_streams=True, pool_return=True,
                                pool_segments=True, allocator_stats=True,
                                spin=hasattr(torch.cuda, "_sleep"), region_graphs=True)

    def __init__(self, device: int | None = None) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise BackendUnavailableError("torch.cuda.is_available() is False")
        torch.cuda.init()
        self._index = torch.cuda.current_device() if device is None else int(device)
        self._torch_device = torch.device("cuda", self._index)
        # torch's primary context first (the runtime creates it for a tensor), so the
        # driver retains that very context and both share memory.
        with torch.cuda.device(self._index):
            torch.empty(1, device=self._torch_device)
        self.driver = CudaDriver(self._index)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._spin_cycles_per_ms: float | None = None
        self.capabilities = dataclasses.replace(self.capabilities, graph_events=_external_events())

    def vendor_empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def vendor_warm_stream(self, stream: Any) -> None:
        from .pool import warm_up

        warm_up(self, stream)  # (cuBLAS and cuBLASLt: a 32 MiB workspace each on Hopper)

    def vendor_allocator_stats(self, reset_peak: bool) -> dict[str, int | None]:
        stats = torch.cuda.memory_stats(self._torch_device)
        pool_reserved = pool_allocated = 0
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", self._index) != self._index:
                continue
            if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):  # a private (graph) pool
                pool_reserved += int(seg["total_size"])
                pool_allocated += int(seg["allocated_size"])
        out: dict[str, int | None] = {
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            "peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "graph_pool_reserved_bytes": pool_reserved,
            "graph_pool_allocated_bytes": pool_allocated,
        }
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(self._torch_device)
        return out

    def vendor_graphed_callables(self, callables: tuple[Any, ...], sample_args: tuple[Any, ...]) -> Any:
        return torch.cuda.make_graphed_callables(callables, sample_args)

    def vendor_return_to_pool(self, t: torch.Tensor) -> torch.Tensor | None:
        if self.vendor_is_capturing():
            raise UsageError("return_to_pool runs between captures, not inside one")
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        view = self.alias_bytes(storage.data_ptr(), storage.nbytes()).view(t.dtype)
        view = view.as_strided(t.shape, t.stride(), t.storage_offset())
        storage.resize_(0)  # the caching allocator frees the block into the private pool it came from
        return view

    def vendor_graph_pool_segments(self) -> list[tuple[int, int]]:
        return [(int(seg["address"]), int(seg["total_size"])) for seg in torch.cuda.memory_snapshot()
                if seg.get("device", self._index) == self._index
                and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]

    def vendor_is_capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    # -- streams and events -----------------------------------------------------

    def current_stream(self) -> torch.cuda.Stream:
        # torch.cuda.current_stream builds a new Stream object each call (3.5 us of host
        # time on the H200, against 0.2 us to read the stream's id), and the offload engine
        # asks several times per layer and pass: keep one object per stream id (streams with
        # one id are the same stream, and compare equal).
        sid, index, kind = torch._C._cuda_getCurrentStream(self._index)  # type: ignore[attr-defined]
        s = self._streams.get(sid)
        if s is None:
            if len(self._streams) > 256:  # external streams each have an id of their own
                self._streams.clear()
            s = self._streams[sid] = torch.cuda.Stream(stream_id=sid, device_index=index,
                                                       device_type=kind)
        return s

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self._torch_device)

    def stream(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def vendor_new_event(self, timing: bool) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    # Graph events are torch's external events: recorded and waited on under capture they
    # become the graph's own record and wait nodes (benchmarks/graph_events.py checked the
    # semantics on an H200). torch makes the device event at its first record, and a wait
    # on an event never recorded is no wait at all (no node under capture), so each is
    # recorded once at birth. (Whether this torch has them is known in __init__.)

    def vendor_new_graph_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(external=True)
        ev.record(self.current_stream())
        return ev

    def vendor_graph_record(self, event: Any) -> None:
        event.record(self.current_stream())

    def vendor_graph_wait(self, event: Any) -> None:
        self.current_stream().wait_event(event)

    def vendor_spin(self, ms: float, stream: Any) -> None:
        # torch.cuda._sleep spins for a count of clock cycles: what one ms is, measured once.
        if self._spin_cycles_per_ms is None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1 << 20)  # (the first launch loads the kernel)
                a.record()
                torch.cuda._sleep(1 << 24)
                b.record()
            b.synchronize()
            self._spin_cycles_per_ms = (1 << 24) / max(a.elapsed_time(b), 1e-3)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(1, int(ms * self._spin_cycles_per_ms)))

    def vendor_synchronize(self) -> None:
        torch.cuda.synchronize(self._torch_device)

    # -- tensors and copies -----------------------------------------------------

    def vendor_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        if dst.is_contiguous() and src.is_contiguous():
            # Byte for byte: one cuMemcpyAsync on the stream's handle. torch's copy_ would
            # first make the stream current and then restore it, which costs about five
            # times the copy's own launch; the engine orders reuse of both buffers with
            # events of its own, so the host allocator need not track them.
            _check("cuMemcpyAsync", cu.cuMemcpyAsync(dst.data_ptr(), src.data_ptr(),
                                                     dst.numel() * dst.element_size(),
                                                     stream.cuda_stream))
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def vendor_pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def vendor_tensor_at(self, va: int, nbytes: int) -> torch.Tensor:
        t = torch.as_tensor(_CudaArray(va, nbytes), device=self._torch_device)
        if t.data_ptr() != va:  # as_tensor must not copy; a copy would defeat the slot
            raise DriverError("", "torch.as_tensor", "COPIED", 0,
                              f"got a tensor at 0x{t.data_ptr():x}, not 0x{va:x}")
        return t

    # -- graphs -----------------------------------------------------------------

    def vendor_new_rng_stream(self) -> RngStream:
        from .rng import CudaRngStream

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        seed = torch.cuda.default_generators[index].initial_seed()
        return CudaRngStream(index, self.rng_stream_seed(seed))

    def new_graph(self, share_pool_with: DeviceGraph | None = None,
                  pool_region: tuple[int, int] | None = None) -> DeviceGraph:
        if pool_region is not None or isinstance(share_pool_with, RegionGraph):
            from .pool import RegionCudaGraph  # a MemPool over the region (pluggable allocator)

            return RegionCudaGraph.make(self, pool_region, share_pool_with)
        pool = share_pool_with.pool if isinstance(share_pool_with, CudaGraph) else None
        return CudaGraph(self, pool if pool is not None else torch.cuda.graph_pool_handle())

    def vendor_region_capture_kwargs(self) -> dict[str, Any]:
        """Region graphs capture on graphslot's warmed capture stream
        (:func:`graphslot.backends.cuda.pool.capture_stream`): so does an ordinary graph
        captured with these arguments, so per-stream library workspaces count alike."""
        from .pool import capture_stream, warm_up

        s = capture_stream(self)
        warm_up(self, s)
        return {"stream": s}

    # -- info -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._torch_device

    def describe(self) -> dict[str, Any]:
        import cuda.bindings

        return {
            "device": f"{torch.cuda.get_device_name(self._index)} (cuda:{self._index})",
            "vmm_supported": True,  # the driver refused the device otherwise
            "versions": {
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
                "driver": self.driver.version(),
                "cuda_bindings": getattr(cuda.bindings, "__version__", "unknown"),
            },
        }


class CudaGraph(DeviceGraph):
    """torch.cuda.CUDAGraph behind the device-neutral interface."""

    # Stream capture records and runs nothing, so a region graph's pool (a subclass)
    # need only be mapped before replay.
    executes_during_capture = False

    def __init__(self, backend: CudaBackend, pool: Any = None) -> None:
        self._backend = backend
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @contextlib.contextmanager
    def capture(self, stream: Any = None) -> Iterator[None]:
        # Collect garbage first and not during capture: a reference cycle holding device
        # tensors (a saved-tensor hook that returns its argument makes one) freed
        # mid-capture touches the legacy stream and invalidates the capture.
        with no_gc():
            capture = torch.cuda.graph(self.graph, pool=self.pool, stream=stream)
            capture.__enter__()
            try:
                yield
                capture.__exit__(None, None, None)  # (ending an invalidated capture raises)
            except BaseException:
                self._abandon(capture)
                raise

    def _abandon(self, capture: Any) -> None:
        """Leave torch as it was before a capture that failed.

        torch's own context manager does not: where the capture was invalidated (work that
        cannot be captured, such as ``.item()``), ending it raises before the caller's
        stream is restored, before the allocator stops routing into the graph's pool and
        before the default generator leaves capture mode, so every later random op fails
        ("Offset increment outside graph capture") and later allocations can land in a
        pool that is released under them.
        """
        if torch.cuda.is_current_stream_capturing():
            with contextlib.suppress(Exception):
                self.graph.capture_end()  # ends the stream's capture, also an invalidated one
        device = self._backend._index
        with contextlib.suppress(Exception):  # a no-op where capture_end got that far
            torch._C._cuda_endAllocateToPool(device, self.pool)
        capture.stream_ctx.__exit__(None, None, None)
        try:
            self.graph.pool()  # answers only after a capture that ended: reset() releases it
        except Exception:
            # capture_begin took a reference on the pool that reset() does not give back
            with contextlib.suppress(Exception):
                torch._C._cuda_releasePool(device, self.pool)
        self.graph.reset()
        # A capture that begins and ends takes the default generator out of capture mode.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass

    def replay(self) -> None:
        self.graph.replay()

    @property
    def pool_bytes(self) -> int:
        pool = tuple(self.pool) if self.pool is not None else None
        return sum(int(seg["total_size"]) for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", (0, 0))) == pool)
