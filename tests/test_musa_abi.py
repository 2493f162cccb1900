"""ABI layout of the musa backend's ctypes mirror of musa.h (and of its DLPack structs).

These run anywhere: they pin sizes, offsets and enum values, so a change to the
mirror is deliberate. Expected layouts are CUDA's on 64-bit Linux (x86-64 and
aarch64 agree), which MUSA's driver API is assumed to copy; see
graphslot/backends/musa/abi.py for which values are confirmed and which assumed.
"""

from __future__ import annotations

import ctypes
import struct

import pytest

from graphslot.backends.musa import abi, dlpack

pytestmark = pytest.mark.skipif(struct.calcsize("P") != 8, reason="layouts below are for 64-bit hosts")


def off(cls: type[ctypes.Structure], field: str) -> int:
    return getattr(cls, field).offset


def test_scalar_types() -> None:
    assert ctypes.sizeof(abi.MUresult) == 4
    assert ctypes.sizeof(abi.MUdevice) == 4
    assert ctypes.sizeof(abi.MUcontext) == 8
    assert ctypes.sizeof(abi.MUdeviceptr) == 8
    assert ctypes.sizeof(abi.MUmemGenericAllocationHandle) == 8


def test_mem_location() -> None:
    assert ctypes.sizeof(abi.MUmemLocation) == 8
    assert ctypes.alignment(abi.MUmemLocation) == 4
    assert off(abi.MUmemLocation, "type") == 0
    assert off(abi.MUmemLocation, "id") == 4


def test_alloc_flags() -> None:
    f = abi.MUmemAllocFlags
    assert ctypes.sizeof(f) == 8
    assert (off(f, "compressionType"), off(f, "gpuDirectRDMACapable"), off(f, "usage"),
            off(f, "reserved")) == (0, 1, 2, 4)
    assert abi.MUmemAllocFlags.reserved.size == 4


def test_allocation_prop() -> None:
    p = abi.MUmemAllocationProp
    assert ctypes.sizeof(p) == 32
    assert ctypes.alignment(p) == 8
    assert off(p, "type") == 0
    assert off(p, "requestedHandleTypes") == 4
    assert off(p, "location") == 8
    assert off(p, "win32HandleMetaData") == 16
    assert off(p, "allocFlags") == 24
    # Nested members at their absolute offsets, as the driver reads them.
    assert off(p, "location") + off(abi.MUmemLocation, "id") == 12
    assert off(p, "allocFlags") + off(abi.MUmemAllocFlags, "usage") == 26
    assert off(p, "allocFlags") + off(abi.MUmemAllocFlags, "reserved") == 28


def test_allocation_prop_bytes() -> None:
    """Filled in as the driver layer fills it, the struct has CUDA's exact bytes."""
    p = abi.MUmemAllocationProp()
    p.type = abi.MU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = abi.MU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 3
    raw = bytes(p)
    assert raw == struct.pack("=iiii", 1, 0, 1, 3) + bytes(16)


def test_access_desc() -> None:
    d = abi.MUmemAccessDesc
    assert ctypes.sizeof(d) == 12
    assert ctypes.alignment(d) == 4
    assert off(d, "location") == 0
    assert off(d, "flags") == 8


def test_enum_values() -> None:
    assert abi.MUSA_SUCCESS == 0
    assert abi.MU_MEM_ALLOCATION_TYPE_INVALID == 0
    assert abi.MU_MEM_ALLOCATION_TYPE_PINNED == 1
    assert abi.MU_MEM_LOCATION_TYPE_INVALID == 0
    assert abi.MU_MEM_LOCATION_TYPE_DEVICE == 1
    assert abi.MU_MEM_HANDLE_TYPE_NONE == 0
    assert abi.MU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 1
    assert abi.MU_MEM_ACCESS_FLAGS_PROT_NONE == 0
    assert abi.MU_MEM_ACCESS_FLAGS_PROT_READ == 1
    assert abi.MU_MEM_ACCESS_FLAGS_PROT_READWRITE == 3
    assert abi.MU_MEM_ALLOC_GRANULARITY_MINIMUM == 0
    assert abi.MU_MEM_ALLOC_GRANULARITY_RECOMMENDED == 1
    assert abi.MU_DEVICE_ATTRIBUTE_CLOCK_RATE == 13
    assert abi.MU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING == 41
    assert abi.MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED == 102


@pytest.mark.parametrize("code,name", [
    (0, "MUSA_SUCCESS"),
    (1, "MUSA_ERROR_INVALID_VALUE"),
    (2, "MUSA_ERROR_OUT_OF_MEMORY"),
    (3, "MUSA_ERROR_NOT_INITIALIZED"),
    (4, "MUSA_ERROR_DEINITIALIZED"),
    (100, "MUSA_ERROR_NO_DEVICE"),
    (101, "MUSA_ERROR_INVALID_DEVICE"),
    (201, "MUSA_ERROR_INVALID_CONTEXT"),
    (205, "MUSA_ERROR_MAP_FAILED"),
    (206, "MUSA_ERROR_UNMAP_FAILED"),
    (208, "MUSA_ERROR_ALREADY_MAPPED"),
    (211, "MUSA_ERROR_NOT_MAPPED"),
    (400, "MUSA_ERROR_INVALID_HANDLE"),
    (401, "MUSA_ERROR_ILLEGAL_STATE"),
    (500, "MUSA_ERROR_NOT_FOUND"),
    (600, "MUSA_ERROR_NOT_READY"),
    (700, "MUSA_ERROR_ILLEGAL_ADDRESS"),
    (719, "MUSA_ERROR_LAUNCH_FAILED"),
    (800, "MUSA_ERROR_NOT_PERMITTED"),
    (801, "MUSA_ERROR_NOT_SUPPORTED"),
    (803, "MUSA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    (900, "MUSA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
    (901, "MUSA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    (999, "MUSA_ERROR_UNKNOWN"),
])
def test_error_table(code: int, name: str) -> None:
    assert abi.ERROR_NAMES[code] == name
    assert abi.error_name_from_table(code) == name


def test_error_table_is_consistent() -> None:
    names = list(abi.ERROR_NAMES.values())
    assert len(names) == len(set(names)), "two codes share a name"
    assert all(n == "MUSA_SUCCESS" or n.startswith("MUSA_ERROR_") for n in names)
    assert abi.error_name_from_table(12345) == "MUSA_ERROR_UNRECOGNIZED_12345"


def test_dlpack_layout() -> None:
    assert ctypes.sizeof(dlpack.DLDevice) == 8
    assert ctypes.sizeof(dlpack.DLDataType) == 4
    assert (off(dlpack.DLDataType, "code"), off(dlpack.DLDataType, "bits"),
            off(dlpack.DLDataType, "lanes")) == (0, 1, 2)
    t = dlpack.DLTensor
    assert ctypes.sizeof(t) == 48
    assert [off(t, f) for f in ("data", "device", "ndim", "dtype", "shape", "strides",
                                "byte_offset")] == [0, 8, 16, 20, 24, 32, 40]
    m = dlpack.DLManagedTensor
    assert ctypes.sizeof(m) == 64
    assert (off(m, "dl_tensor"), off(m, "manager_ctx"), off(m, "deleter")) == (0, 48, 56)
    assert (dlpack.kDLCPU, dlpack.kDLExtDev, dlpack.kDLUInt) == (1, 12, 1)
