"""How the GPU tests get TransformerEngine and Megatron-Core: the skip messages say it.

Neither installs from the usual index on the project's GPU machine (no network there), so
each test that needs one skips with these instructions when it is missing.
"""

from __future__ import annotations

import importlib.util

#: How to put TransformerEngine 2.20.2 (CUDA 13, torch 2.11, Python 3.12) on a GPU machine.
TE_HOWTO = (
    "TransformerEngine installs from wheels brought to the GPU machine: the core wheel "
    "transformer-engine-cu13==2.20.2 (TE's CUDA libraries) and the PyTorch extension "
    "transformer_engine_torch 2.20.2 built for the machine's torch (2.11.0+cu130, sm_90 on "
    "the project's H200), plus a few small wheels, each with 'python3 -m pip install "
    "--no-deps'; for benchmarks/gpu_check.sh, in .te/base/install.sh. See docs/gpu.md"
)

#: How to put megatron-core on a GPU machine.
MEGATRON_HOWTO = (
    "megatron-core travels as a wheel: here 'pip download megatron-core==0.19.2 --no-deps "
    "--python-version 3.12 --only-binary=:all: -d .wheels', send .wheels with the project, and on "
    "the GPU machine 'python3 -m pip install --no-deps .wheels/*.whl' before the tests "
    "(tox -e megatron installs 0.16.x for the cpu wiring tests)"
)


def have(module: str) -> bool:
    """``module`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
