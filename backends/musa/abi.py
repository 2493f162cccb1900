"""ctypes mirror of the parts of ``musa.h`` (the MUSA driver API) that graphslot calls.

No MUSA header is used at build or run time, so every layout and value below is
written out by hand. MUSA's driver API is a renamed copy of CUDA's (``cuMemMap`` ->
``muMemMap``, ``CUDA_ERROR_x`` -> ``MUSA_ERROR_x``); where a value could not be
checked against Moore Threads' own header it is taken from CUDA and marked
``ASSUMED`` (see also the MUSA section of the README). ``tests/test_musa_abi.py``
pins every size, offset and value here, so a change is always deliberate.

Sources used to confirm names and values:

* ``MooreThreads/torch_musa`` (``csrc/core/driver_api.h``, ``MUSACachingAllocator.cpp``)
  uses ``muMemAddressReserve``, ``muMemCreate``, ``muMemMap``, ``muMemSetAccess``,
  ``muMemUnmap``, ``muMemRelease``, ``muMemAddressFree``,
  ``muMemGetAllocationGranularity``, ``MUmemAllocationProp``, ``MUmemAccessDesc``,
  ``MU_MEM_ALLOCATION_TYPE_PINNED``, ``MU_MEM_LOCATION_TYPE_DEVICE`` and
  ``MU_MEM_ACCESS_FLAGS_PROT_READWRITE``, and only enables them for MUSA >= 4.0.
* ``MooreThreads/tensorflow_musa_extension`` (``musa_ext/mu/device/driver_api.h``)
  redeclares the two structures with CUDA's field order and states the values
  PINNED = 1, LOCATION_TYPE_DEVICE = 1, PROT_READWRITE = 3, GRANULARITY_MINIMUM = 0
  and MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102.
* CUDA's values were read from cuda-bindings (``cuda.bindings.driver``), and CUDA's
  ``CUmemAllocationProp`` byte layout from a filled-in cuda-bindings struct.
"""

from __future__ import annotations

import ctypes

__all__ = [
    "MUresult", "MUdevice", "MUcontext", "MUdeviceptr", "MUmemGenericAllocationHandle",
    "MUmemLocation", "MUmemAllocFlags", "MUmemAllocationProp", "MUmemAccessDesc",
    "MUSA_SUCCESS", "ERROR_NAMES", "error_name_from_table",
    "MU_MEM_ALLOCATION_TYPE_INVALID", "MU_MEM_ALLOCATION_TYPE_PINNED",
    "MU_MEM_LOCATION_TYPE_INVALID", "MU_MEM_LOCATION_TYPE_DEVICE",
    "MU_MEM_HANDLE_TYPE_NONE", "MU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "MU_MEM_ACCESS_FLAGS_PROT_NONE", "MU_MEM_ACCESS_FLAGS_PROT_READ",
    "MU_MEM_ACCESS_FLAGS_PROT_READWRITE",
    "MU_MEM_ALLOC_GRANULARITY_MINIMUM", "MU_MEM_ALLOC_GRANULARITY_RECOMMENDED",
    "MU_DEVICE_ATTRIBUTE_CLOCK_RATE", "MU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING",
    "MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
]

# --------------------------------------------------------------------------- scalar types

#: ``MUresult`` is a C enum: int-sized on every ABI graphslot supports.
MUresult = ctypes.c_int
#: ``MUdevice`` is an ordinal handle (``typedef int``), as ``CUdevice`` is.
MUdevice = ctypes.c_int
#: ``MUcontext`` is an opaque pointer (``struct MUctx_st*``).
MUcontext = ctypes.c_void_p
#: ``MUdeviceptr`` is 64 bits on 64-bit hosts (``unsigned long long``), as ``CUdeviceptr`` is.
MUdeviceptr = ctypes.c_uint64
#: ``MUmemGenericAllocationHandle`` is ``unsigned long long``, as CUDA's is.
MUmemGenericAllocationHandle = ctypes.c_ulonglong

# --------------------------------------------------------------------------- structures


class MUmemLocation(ctypes.Structure):
    """``MUmemLocation``: where memory lives (``type`` = DEVICE, ``id`` = ordinal)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MUmemAllocFlags(ctypes.Structure):
    """The anonymous ``allocFlags`` struct inside ``MUmemAllocationProp`` (8 bytes)."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MUmemAllocationProp(ctypes.Structure):
    """``MUmemAllocationProp``: what ``muMemCreate`` should create.

    The pointer member makes the struct 8-byte aligned, so on x86-64 it is 32 bytes
    with ``location`` at 8, ``win32HandleMetaData`` at 16 and ``allocFlags`` at 24.
    Leave every member graphslot does not set at zero: the driver reads them all.
    """

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", MUmemAllocFlags),
    ]


class MUmemAccessDesc(ctypes.Structure):
    """``MUmemAccessDesc``: the access ``flags`` granted to one location (12 bytes)."""

    _fields_ = [("location", MUmemLocation), ("flags", ctypes.c_int)]


# --------------------------------------------------------------------------- enum values

# MUmemAllocationType
MU_MEM_ALLOCATION_TYPE_INVALID = 0
MU_MEM_ALLOCATION_TYPE_PINNED = 1
# MUmemLocationType
MU_MEM_LOCATION_TYPE_INVALID = 0
MU_MEM_LOCATION_TYPE_DEVICE = 1
# MUmemAllocationHandleType (ASSUMED: mirrors CUDA; torch_musa uses the POSIX fd name)
MU_MEM_HANDLE_TYPE_NONE = 0
MU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
# MUmemAccess_flags (NONE and READ ASSUMED: mirror CUDA)
MU_MEM_ACCESS_FLAGS_PROT_NONE = 0
MU_MEM_ACCESS_FLAGS_PROT_READ = 1
MU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
# MUmemAllocationGranularity_flags (RECOMMENDED ASSUMED: mirrors CUDA)
MU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
MU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
# MUdevice_attribute. ASSUMED to mirror CUDA's numbering: 102 is
# CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; a third-party MUSA loader
# states the same value, but it was not checked against Moore Threads' musa.h.
MU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
MU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
MU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102

# --------------------------------------------------------------------------- errors

MUSA_SUCCESS = 0

#: Common ``MUresult`` codes. ASSUMED to share CUDA's numbers (the names are MUSA's:
#: ``CUDA_ERROR_X`` becomes ``MUSA_ERROR_X``). Used only when the driver's own
#: ``muGetErrorName`` is missing or does not know the code.
ERROR_NAMES: dict[int, str] = {
    0: "MUSA_SUCCESS",
    1: "MUSA_ERROR_INVALID_VALUE",
    2: "MUSA_ERROR_OUT_OF_MEMORY",
    3: "MUSA_ERROR_NOT_INITIALIZED",
    4: "MUSA_ERROR_DEINITIALIZED",
    100: "MUSA_ERROR_NO_DEVICE",
    101: "MUSA_ERROR_INVALID_DEVICE",
    201: "MUSA_ERROR_INVALID_CONTEXT",
    205: "MUSA_ERROR_MAP_FAILED",
    206: "MUSA_ERROR_UNMAP_FAILED",
    208: "MUSA_ERROR_ALREADY_MAPPED",
    210: "MUSA_ERROR_ALREADY_ACQUIRED",
    211: "MUSA_ERROR_NOT_MAPPED",
    214: "MUSA_ERROR_ECC_UNCORRECTABLE",
    304: "MUSA_ERROR_OPERATING_SYSTEM",
    400: "MUSA_ERROR_INVALID_HANDLE",
    401: "MUSA_ERROR_ILLEGAL_STATE",
    500: "MUSA_ERROR_NOT_FOUND",
    600: "MUSA_ERROR_NOT_READY",
    700: "MUSA_ERROR_ILLEGAL_ADDRESS",
    701: "MUSA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    709: "MUSA_ERROR_CONTEXT_IS_DESTROYED",
    719: "MUSA_ERROR_LAUNCH_FAILED",
    800: "MUSA_ERROR_NOT_PERMITTED",
    801: "MUSA_ERROR_NOT_SUPPORTED",
    802: "MUSA_ERROR_SYSTEM_NOT_READY",
    803: "MUSA_ERROR_SYSTEM_DRIVER_MISMATCH",
    900: "MUSA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    901: "MUSA_ERROR_STREAM_CAPTURE_INVALIDATED",
    908: "MUSA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
    909: "MUSA_ERROR_TIMEOUT",
    999: "MUSA_ERROR_UNKNOWN",
}


def error_name_from_table(code: int) -> str:
    """The name of ``code`` from :data:`ERROR_NAMES`; unknown codes get a name that says so."""
    return ERROR_NAMES.get(code, f"MUSA_ERROR_UNRECOGNIZED_{code}")
