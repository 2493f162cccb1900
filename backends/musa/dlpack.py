"""A zero-copy torch tensor over a raw address, made through a hand-built DLPack capsule.

torch_musa offers no ``__cuda_array_interface__`` equivalent, but torch's DLPack
importer (``at::fromDLPack``) wraps foreign memory without copying, and it maps
DLPack's ``kDLExtDev`` to torch's ``PrivateUse1`` device type, which is the one
torch_musa registers and renames to ``"musa"``. DLPack has no MUSA-specific device
type (its enum ends at ``kDLTrn = 18`` in the header torch ships), so ``kDLExtDev``
is the type torch itself uses for MUSA tensors in ``torch.to_dlpack``.

The same code builds ``kDLCPU`` views, which is how the tests exercise it without a
GPU. The view owns no device memory: graphslot's reservation does, and the deleter
only frees the small descriptor block.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["kDLCPU", "kDLExtDev", "kDLUInt", "DLDevice", "DLDataType", "DLTensor",
           "DLManagedTensor", "byte_tensor_at", "storage_tensor_at"]

# DLDeviceType / DLDataTypeCode values (dlpack.h; stable since DLPack 0.6).
kDLCPU = 1
kDLExtDev = 12
kDLUInt = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """The unversioned (pre-1.0) managed tensor: the capsule name is ``"dltensor"``.

    ``deleter`` is ``void (*)(DLManagedTensor*)``, held as a plain address.
    """

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


# The managed tensor and its one-element shape live in one malloc'd block whose
# deleter is libc's free(). A Python callback would also work in the normal case, but
# torch may call the deleter while unwinding a failed import with a Python error
# already set, where no Python code can run safely; free() needs no interpreter.
_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = [ctypes.c_size_t]
_FREE = ctypes.cast(_libc.free, ctypes.c_void_p).value
_BLOCK = ctypes.sizeof(DLManagedTensor) + ctypes.sizeof(ctypes.c_int64)
_CAPSULE_NAME = b"dltensor"  # torch keeps the name pointer; a module constant never moves

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def byte_tensor_at(va: int, nbytes: int, device_type: int, device_id: int = 0,
                   deleter: int | None = None) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` at address ``va``, without copying.

    ``device_type`` is ``kDLExtDev`` for a MUSA address (torch's PrivateUse1) or
    ``kDLCPU`` for host memory. The caller checks ``data_ptr() == va``. ``deleter``
    (an address; default libc ``free``) receives the descriptor block when torch is done.
    """
    import torch

    block = _malloc(_BLOCK)
    if not block:
        raise MemoryError("malloc of a DLPack descriptor failed")
    mt = DLManagedTensor.from_address(block)
    shape = ctypes.c_int64.from_address(block + ctypes.sizeof(DLManagedTensor))
    shape.value = nbytes
    mt.dl_tensor.data = va
    mt.dl_tensor.device = DLDevice(device_type, device_id)
    mt.dl_tensor.ndim = 1
    mt.dl_tensor.dtype = DLDataType(kDLUInt, 8, 1)
    mt.dl_tensor.shape = ctypes.pointer(shape)
    mt.dl_tensor.strides = None  # compact
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = deleter if deleter is not None else _FREE
    # Owned by torch from here: on success it calls the deleter when the last view
    # dies; on failure it may or may not have called it, so the block is never freed
    # here (a failed import leaks one small block rather than risking a double free).
    return torch.utils.dlpack.from_dlpack(_PyCapsule_New(block, _CAPSULE_NAME, None))


def storage_tensor_at(va: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The same view built from a non-owning storage, for when DLPack import is refused.

    ``torch._C._construct_storage_from_data_pointer`` is private, but it is what
    torch_musa's own graph trees (``musagraph_trees.py``) use to rebuild tensors at
    raw MUSA addresses, so it works wherever torch_musa does.
    """
    import torch

    storage = torch._C._construct_storage_from_data_pointer(va, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
