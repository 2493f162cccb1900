"""The cuda backend: VMM through cuda-python's driver bindings, the rest through torch.cuda.

It imports torch, cuda-python and the interface only (see :mod:`graphslot.backends`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["probe", "create"]


def probe() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no CUDA device or driver)"
    if importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-python is not installed (pip install 'graphslot[cuda]' for cuda.bindings)"
    from cuda.bindings import driver as cu

    err, = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuInit failed with {err.name}"
    err, dev = cu.cuDeviceGet(torch.cuda.current_device())
    err, vmm = cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
    if err != cu.CUresult.CUDA_SUCCESS or not vmm:
        return "the CUDA device does not support virtual memory management"
    return None


def create() -> Any:
    from .backend import CudaBackend

    return CudaBackend()
