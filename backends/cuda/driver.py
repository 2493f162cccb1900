"""The cuda backend's VMM driver: the nine raw calls through cuda-python's driver API.

Calls run in torch's primary context for the device, made current on each thread the
first time that thread calls the driver (the offload engine's worker is such a thread).
"""

from __future__ import annotations

import threading
from typing import Any

from cuda.bindings import driver as cu

from graphslot.errors import BackendUnavailableError, DriverError

__all__ = ["CudaDriver"]


def _err_name(err: Any) -> str:
    try:
        res = cu.cuGetErrorName(err)
        if res[0] == cu.CUresult.CUDA_SUCCESS and res[1]:
            return res[1].decode()
    except Exception:
        pass
    return getattr(err, "name", str(err))


def _check(call: str, result: Any) -> Any:
    """Unpack a cuda-python ``(CUresult, value...)`` tuple, raising DriverError on failure."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise DriverError("", call, _err_name(err), int(err))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class CudaDriver:
    """Driver VMM on CUDA device ``index`` (:class:`graphslot.backend.VmmDriver`).

    torch's runtime must have created the device's primary context already (any tensor
    on the device does): the driver retains that same context, so both share one
    address space.

    Raises:
        BackendUnavailableError: the device does not support virtual memory management.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        _check("cuInit", cu.cuInit(0))
        self._dev = _check("cuDeviceGet", cu.cuDeviceGet(index))
        self._ctx = _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._dev))
        self._tls = threading.local()
        vmm = bool(_check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self._dev)))
        if not vmm:
            raise BackendUnavailableError(
                f"CUDA device {index} does not support virtual memory management "
                "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]

    def _ctx_current(self) -> None:
        if not getattr(self._tls, "ready", False):
            _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
            self._tls.ready = True

    def clock_hz(self) -> int:
        """The device's clock rate in Hz (turns seconds into cycles for busy kernels)."""
        khz = _check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, self._dev))
        return max(int(khz), 1) * 1000

    def version(self) -> str:
        """The driver's CUDA version, ``"major.minor"``."""
        v = int(_check("cuDriverGetVersion", cu.cuDriverGetVersion()))
        return f"{v // 1000}.{(v % 1000) // 10}"

    def granularity(self) -> int:
        self._ctx_current()
        return int(_check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def reserve(self, size: int, alignment: int) -> int:
        self._ctx_current()
        return int(_check("cuMemAddressReserve", cu.cuMemAddressReserve(size, alignment, 0, 0)))

    def free(self, va: int, size: int) -> None:
        self._ctx_current()
        _check("cuMemAddressFree", cu.cuMemAddressFree(va, size))

    def create(self, size: int) -> Any:
        self._ctx_current()
        return _check("cuMemCreate", cu.cuMemCreate(size, self._prop, 0))

    def release(self, handle: Any) -> None:
        self._ctx_current()
        _check("cuMemRelease", cu.cuMemRelease(handle))

    def map(self, va: int, size: int, handle: Any) -> None:
        self._ctx_current()
        _check("cuMemMap", cu.cuMemMap(va, size, 0, handle, 0))

    def unmap(self, va: int, size: int) -> None:
        self._ctx_current()
        _check("cuMemUnmap", cu.cuMemUnmap(va, size))

    def set_access(self, va: int, size: int) -> None:
        self._ctx_current()
        _check("cuMemSetAccess", cu.cuMemSetAccess(va, size, self._access, 1))

    def mem_info(self) -> tuple[int, int]:
        self._ctx_current()
        free, total = _check("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free), int(total)
