"""Plain PyTorch: a stack of layers as graphed callables with activation offload.

    from graphslot.adapters.torch import GraphedLayers

    stack = GraphedLayers(blocks, sample_input, mode="resident")   # or "remap", "off"

Modules, each importing only those below it (contract ``adapters-torch-layers``):
:mod:`.stack` (:class:`GraphedLayers`), :mod:`.runner` (one graph's layers: capture and
replay, through :class:`graphslot.offload.OffloadUnit`), :mod:`.grads` (gradient buffers
and homes), :mod:`.plan` (which layers each graph covers, argument checks) and
:mod:`.pages` (the graphs' pool on shared pages). They import
graphslot's library and interface modules, never another adapter. The names they share
with each other carry no underscore; what users import is ``__all__`` below.
"""

from graphslot.errors import CaptureMismatchError, StateError, UsageError  # noqa: F401 (importable here, as before)

from .plan import JOIN_BYTES, plan_graphs
from .stack import GraphedLayers

__all__ = ["JOIN_BYTES", "GraphedLayers", "plan_graphs"]
