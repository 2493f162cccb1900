"""The musa backend: driver VMM through libmusa (ctypes), the rest through torch_musa.

Importing this module imports torch_musa, which registers the ``"musa"`` device
(torch's PrivateUse1 type) and ``torch.musa``. Driver calls run in the device's
primary context, the one torch_musa's runtime uses, made current on each thread the
first time that thread calls the driver (see :class:`~.driver.MusaDriver`).

Nothing here has run on MUSA hardware yet: the README's MUSA section lists what was
verified where, and how to check it on a Moore Threads GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch
import torch_musa  # noqa: F401  (registers the "musa" device and torch.musa)

from graphslot.backend import Backend, Capabilities, DeviceGraph, no_gc
from graphslot.errors import BackendUnavailableError, DriverError, UsageError

from .dlpack import byte_tensor_at, kDLExtDev, storage_tensor_at
from .driver import MusaDriver

__all__ = ["MusaBackend", "MusaGraph"]

#: ``torch.musa``, which torch_musa attaches at import; typed loosely because torch's
#: own stubs do not know it.
tmusa: Any = getattr(torch, "musa")


class MusaBackend(Backend):
    """graphslot on a Moore Threads GPU."""

    name = "musa"
    driver: MusaDriver

    # No optional feature declared: every one answers with its default.
    capabilities = Capabilities()

    def __init__(self, device: int | None = None, driver: MusaDriver | None = None) -> None:
        Backend.__init__(self)
        if not tmusa.is_available():
            raise BackendUnavailableError("torch.musa.is_available() is False")
        self._index = int(tmusa.current_device() if device is None else device)
        self._torch_device = torch.device("musa", self._index)
        # Let torch_musa's runtime create the primary context first, so the driver
        # retains that same context and both sides see the same address space.
        with tmusa.device(self._index):
            torch.empty(1, device=self._torch_device)
        try:
            self.driver = driver if driver is not None else MusaDriver(self._index)
            vmm = self.driver.vmm_supported()
            if vmm:
                self.driver.make_current()  # retain the context now: fail here, not mid-offload
        except DriverError as e:
            raise DriverError(f"open MUSA device {self._index}", e.call, e.name, e.code,
                              e.detail) from None
        if not vmm:
            raise BackendUnavailableError(
                f"MUSA device {self._index} does not support virtual memory management "
                "(MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)")
        self._dlpack_error: str | None = None  # set once DLPack import was refused

    # -- capture state ------------------------------------------------------------

    def vendor_is_capturing(self) -> bool:
        capturing = getattr(tmusa, "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    # -- streams and events -------------------------------------------------------

    def current_stream(self) -> Any:
        return tmusa.current_stream(self._torch_device)

    def new_stream(self) -> Any:
        return tmusa.Stream(self._torch_device)

    def stream(self, stream: Any) -> ContextManager[Any]:
        return tmusa.stream(stream)

    def vendor_new_event(self, timing: bool) -> Any:
        return tmusa.Event(enable_timing=timing)

    def vendor_synchronize(self) -> None:
        tmusa.synchronize(self._torch_device)

    # -- tensors and copies -------------------------------------------------------

    def vendor_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with tmusa.stream(stream):
            dst.copy_(src, non_blocking=True)

    def vendor_pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def vendor_tensor_at(self, va: int, nbytes: int) -> torch.Tensor:
        t, route = None, "torch.from_dlpack"
        if self._dlpack_error is None:
            try:
                t = byte_tensor_at(va, nbytes, kDLExtDev, self._index)
            except Exception as e:  # remember, and use the storage route from now on
                self._dlpack_error = f"{type(e).__name__}: {e}"
        if t is None:
            t, route = (storage_tensor_at(va, nbytes, self._torch_device),
                        "torch._C._construct_storage_from_data_pointer")
        if t.device != self._torch_device or t.data_ptr() != va:
            # A copy, or a tensor on another device, would defeat the fixed address.
            raise DriverError("", route, "NOT_ZERO_COPY", 0,
                              f"got a {t.device} tensor at 0x{t.data_ptr():x}, wanted "
                              f"{self._torch_device} at 0x{va:x}")
        return t

    # -- graphs -------------------------------------------------------------------

    def vendor_empty_cache(self) -> None:
        tmusa.empty_cache()

    def new_graph(self, share_pool_with: DeviceGraph | None = None,
                  pool_region: tuple[int, int] | None = None) -> DeviceGraph:
        if pool_region is not None:
            raise UsageError("new_graph: the musa backend cannot draw a graph pool from a "
                             "region yet (pool_region needs a pluggable MUSA allocator)")
        pool = share_pool_with.pool if isinstance(share_pool_with, MusaGraph) else None
        if pool is None and hasattr(tmusa, "graph_pool_handle"):
            pool = tmusa.graph_pool_handle()
        return MusaGraph(self, pool)

    # -- info ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._torch_device

    def describe(self) -> dict[str, Any]:
        drv = self.driver.driver_version()
        return {
            "device": f"{tmusa.get_device_name(self._index)} (musa:{self._index})",
            "vmm_supported": True,  # the constructor refuses a device without it
            "versions": {
                "torch": torch.__version__,
                "torch_musa": getattr(torch_musa, "__version__", "unknown"),
                "musa_runtime": str(getattr(torch.version, "musa", "unknown")),
                # Decoded like CUDA's (1000*major + 10*minor); the raw value is kept.
                "driver": f"{drv // 1000}.{(drv % 1000) // 10} ({drv})",
                "libmusa": self.driver.lib.path,
                # How tensor_at builds views: DLPack unless torch refused it once.
                "tensor_at": f"storage ({self._dlpack_error})" if self._dlpack_error else "dlpack",
            },
        }


class MusaGraph(DeviceGraph):
    """``torch.musa.MUSAGraph`` behind the device-neutral interface."""

    executes_during_capture = False  # (stream capture records; nothing runs)

    def __init__(self, backend: MusaBackend, pool: Any = None) -> None:
        self._backend = backend
        self.graph = tmusa.MUSAGraph()
        self.pool = pool

    @contextlib.contextmanager
    def capture(self, stream: Any = None) -> Iterator[None]:
        with no_gc():
            with tmusa.graph(self.graph, pool=self.pool, stream=stream):
                yield

    def replay(self) -> None:
        self.graph.replay()
