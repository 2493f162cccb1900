"""How the GPU tests get TransformerEngine and Megatron-Core: the skip messages say it.

Neither installs from the usual index on the project's GPU machine (no network there), so
each test that needs one skips with these instructions when it is missing.
"""

from __future__ import annotations

import importlib.util

#: How to put TransformerEngine 2.20.2 (CUDA 13, torch 2.11, Python 3.12) on a GPU machine.
TE_HOWTO = (
    "TransformerEngine is two wheels there: the core wheel transformer-engine-cu13==2.20.2 "
    "(264 MiB, sent in five parts) and its PyTorch extension transformer_engine_torch-2.20.2 "
    "(prebuilt for torch 2.11.0+cu130, sm_90, in ../shared/te/), plus a few small wheels. "
    "Here: ../shared/te/prepare.sh (fills .te/: parts .te/p0 .. .te/p4 and .te/base). On the GPU "
    "machine: send each .te/pK with 'mkdir -p /tmp/te && cp .te/pK/part* /tmp/te/' (K = 0..4), "
    "then send .te/base with the project and begin the test command with "
    "'source .te/base/install.sh || exit 1;' (it installs under /tmp/tesite and puts it on "
    "PYTHONPATH). See ../shared/te/README.md"
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
