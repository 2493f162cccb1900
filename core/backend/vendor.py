"""What a vendor implements: :class:`DeviceVendor`, and the optional features it declares
in :class:`Capabilities`.

A vendor's backend subclasses :class:`~graphslot.backend.Backend`, which is a
:class:`DeviceVendor` with the checked API on top, and implements what this module
declares, nothing more:

* ``name``, ``driver`` (a :class:`~graphslot.backend.VmmDriver`) and ``capabilities``;
* six members users call as they are, there being nothing to check: ``device``,
  ``describe``, ``current_stream``, ``new_stream``, ``stream`` and ``new_graph``;
* the ``vendor_*`` hooks, which only :class:`~graphslot.backend.Backend` calls, behind its
  checks (users call the checked method of the same purpose: ``copy_async``, not
  ``vendor_copy``);
* the hooks of each optional feature it declares in :class:`Capabilities`.

A leading underscore in :mod:`graphslot.backend` means private to graphslot: no vendor
overrides or calls one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager

from .driver import VmmDriver
from .graphs import DeviceGraph, RngStream

if TYPE_CHECKING:
    import torch

__all__ = ["ALLOCATOR_STATS_KEYS", "Capabilities", "DeviceVendor", "FEATURE_HOOKS"]

#: The keys of :meth:`Backend.allocator_stats <graphslot.backend.Backend.allocator_stats>`.
ALLOCATOR_STATS_KEYS = ("allocated_bytes", "reserved_bytes", "peak_reserved_bytes",
                        "peak_allocated_bytes", "graph_pool_reserved_bytes",
                        "graph_pool_allocated_bytes")


@dataclass(frozen=True)
class Capabilities:
    """The optional features of one backend, each off unless its vendor declares it.

    A vendor declares what it has (``capabilities = Capabilities(graph_events=True)`` on
    its class, or on the instance in ``__init__`` where only the device can tell) and
    implements those features' hooks (:data:`FEATURE_HOOKS`). The checked
    :class:`~graphslot.backend.Backend` calls a hook only where its feature is declared;
    elsewhere it answers with the default named below.
    """

    #: Graphs under capture record and wait on events as nodes of their own, as the offload
    #: engine's sections need: a wait node waits for the record its event had when the graph
    #: was launched (not for one queued later), and a wait queued on another stream after a
    #: launch waits for the graph's record node in that launch (measured so:
    #: benchmarks/graph_events.py). Without: ``new_graph_event`` raises ``UsageError``.
    graph_events: bool = False
    #: The framework's own graphed callables (on cuda ``torch.cuda.make_graphed_callables``),
    #: the peer graphslot is measured against. Without: ``make_graphed_callables`` raises
    #: ``UsageError``.
    graphed_callables: bool = False
    #: Random streams of graphs' own (:class:`~graphslot.backend.RngStream`). Without:
    #: ``new_rng_stream`` returns None (a recomputed layer's random ops then draw other
    #: numbers than its forward did).
    rng_streams: bool = False
    #: A tensor allocated during a capture can give its bytes back to its graph pool.
    #: Without: ``return_to_pool`` returns None and changes nothing (graphs keep what they
    #: captured for their whole life).
    pool_return: bool = False
    #: The framework allocator's graph-pool segments can be listed. Without:
    #: ``graph_pool_segments`` returns None.
    pool_segments: bool = False
    #: The memory this process holds on the device can be told apart from everyone else's.
    #: Without: ``footprint_bytes`` returns None (read the driver).
    footprint: bool = False
    #: The framework allocator keeps figures. Without: every figure of ``allocator_stats``
    #: is None.
    allocator_stats: bool = False
    #: A stream can be kept busy for a given time (a kernel that spins), so that the host
    #: queues the work after it before the device starts on it, and events then time the
    #: device alone, without the host's launch gaps (``timed(ahead_ms=...)``): what a graph
    #: replay of that work takes. Without: ``timed`` counts those gaps.
    spin: bool = False
    #: Graphs draw their private pool from a range of a graphslot reservation:
    #: ``new_graph(pool_region=(va, size))`` (and ``share_pool_with`` such a graph) returns a
    #: :class:`~graphslot.regions.RegionGraph`, so mutually exclusive graphs can share
    #: physical memory (:mod:`graphslot.arena`). Without: ``new_graph(pool_region=...)``
    #: raises ``UsageError``, and ``ordinary_capture_kwargs`` is empty.
    region_graphs: bool = False


#: The hooks a vendor implements for each feature it declares in :class:`Capabilities`.
FEATURE_HOOKS: dict[str, tuple[str, ...]] = {
    "graph_events": ("vendor_new_graph_event", "vendor_graph_record", "vendor_graph_wait"),
    "graphed_callables": ("vendor_graphed_callables",),
    "rng_streams": ("vendor_new_rng_stream",),
    "pool_return": ("vendor_return_to_pool",),
    "pool_segments": ("vendor_graph_pool_segments",),
    "footprint": ("vendor_footprint_bytes",),
    "allocator_stats": ("vendor_allocator_stats",),
    "spin": ("vendor_spin",),
    "region_graphs": ("vendor_region_capture_kwargs",),
}


class DeviceVendor(abc.ABC):
    """What one vendor implements for its backend; see the module docstring.

    Arguments the checked layer passes to a ``vendor_*`` hook are already valid.
    """

    #: short name used by ``GRAPHSLOT_BACKEND`` ("cpu", "cuda", "musa").
    name: str = "abstract"

    #: the raw VMM calls; only the checked methods of :class:`~graphslot.backend.Backend`
    #: call them. A backend that must set the device up first assigns it in ``__init__``.
    driver: VmmDriver

    #: the optional features this backend has (none by default)
    capabilities: Capabilities = Capabilities()

    # ------------------------------------------------------------------ users call these as they are

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device tensors of this backend live on."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Device name, VMM support and versions: ``{"device", "vmm_supported", "versions"}``."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream work is issued on now, in this thread."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A new stream (for copies: runs concurrently with the current stream)."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> ContextManager[Any]:
        """Context manager that makes ``stream`` current in this thread."""

    @abc.abstractmethod
    def new_graph(self, share_pool_with: DeviceGraph | None = None,
                  pool_region: tuple[int, int] | None = None) -> DeviceGraph:
        """An empty device graph; see :class:`~graphslot.backend.DeviceGraph`.

        Graphs made with ``share_pool_with=g`` draw their private memory from ``g``'s pool,
        as the forward and backward graphs of one layer should.

        ``pool_region=(va, size)`` makes the graph's private pool come from that range
        of a graphslot reservation, which the caller maps (see :mod:`graphslot.arena`):
        graphs of mutually exclusive variants can then share physical memory. Such a
        graph has ``pool_region``, ``pool_used_bytes`` (the high-water mark) and
        ``executes_during_capture`` (whether the region must be mapped while capturing);
        only a backend that declares ``Capabilities.region_graphs`` takes it (elsewhere a
        :class:`~graphslot.errors.UsageError`). A capture that needs more than ``size``
        bytes fails with a :class:`~graphslot.errors.UsageError`. Pass one of the two
        arguments, not both.
        """

    # ------------------------------------------------------------------ hooks behind the checked API

    @abc.abstractmethod
    def vendor_is_capturing(self) -> bool:
        """Whether the current stream is capturing a graph (``is_capturing``)."""

    @abc.abstractmethod
    def vendor_new_event(self, timing: bool) -> Any:
        """A new framework event, with timing if asked (``new_event`` lends these)."""

    @abc.abstractmethod
    def vendor_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``; shapes and dtypes match (``copy_async``)."""

    @abc.abstractmethod
    def vendor_pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host uint8 tensor of ``nbytes`` bytes (``pinned_empty``)."""

    @abc.abstractmethod
    def vendor_tensor_at(self, va: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``[va, va + nbytes)``, not a copy (``tensor_at``, ``alias_bytes``)."""

    @abc.abstractmethod
    def vendor_synchronize(self) -> None:
        """Block the host until all work on the device finished (``synchronize``)."""

    @abc.abstractmethod
    def vendor_empty_cache(self) -> None:
        """Give the framework allocator's cached, unused blocks back to the driver (``empty_cache``)."""

    def vendor_warm_stream(self, stream: Any) -> None:
        """Make the state libraries keep per stream (matmul workspaces) for ``stream`` now,
        on a stream with nothing cached yet (``side_stream``). Such state lives as long as
        the process: made later, amid cached blocks, it lands inside a larger block and
        keeps that block's whole segment held. Default: nothing to make."""

    # ------------------------------------------------------------------ hooks of declared features

    def vendor_new_graph_event(self) -> Any:
        """[graph_events] A complete event a capture may record and wait on (``new_graph_event``)."""
        raise self._undeclared("graph_events")

    def vendor_graph_record(self, event: Any) -> None:
        """[graph_events] Add a node recording ``event`` to the graph under capture (``graph_record``)."""
        raise self._undeclared("graph_events")

    def vendor_graph_wait(self, event: Any) -> None:
        """[graph_events] Add a node waiting on ``event`` to the graph under capture (``graph_wait``)."""
        raise self._undeclared("graph_events")

    def vendor_graphed_callables(self, callables: tuple[Any, ...], sample_args: tuple[Any, ...]) -> Any:
        """[graphed_callables] The framework's own graphed callables (``make_graphed_callables``)."""
        raise self._undeclared("graphed_callables")

    def vendor_new_rng_stream(self) -> RngStream:
        """[rng_streams] A new random stream, seeded by :meth:`rng_stream_seed` (``new_rng_stream``)."""
        raise self._undeclared("rng_streams")

    def vendor_return_to_pool(self, t: torch.Tensor) -> torch.Tensor | None:
        """[pool_return] Free ``t``'s bytes into its graph pool; a view of them (``return_to_pool``)."""
        raise self._undeclared("pool_return")

    def vendor_graph_pool_segments(self) -> list[tuple[int, int]]:
        """[pool_segments] ``(address, bytes)`` of each graph-pool segment (``graph_pool_segments``)."""
        raise self._undeclared("pool_segments")

    def vendor_footprint_bytes(self) -> int:
        """[footprint] Bytes this process really holds on the device (``footprint_bytes``)."""
        raise self._undeclared("footprint")

    def vendor_allocator_stats(self, reset_peak: bool) -> dict[str, int | None]:
        """[allocator_stats] The figures of :data:`ALLOCATOR_STATS_KEYS` (``allocator_stats``)."""
        raise self._undeclared("allocator_stats")

    def vendor_spin(self, ms: float, stream: Any) -> None:
        """[spin] Queue on ``stream`` work that keeps the device busy about ``ms`` (``timed``)."""
        raise self._undeclared("spin")

    def vendor_region_capture_kwargs(self) -> dict[str, Any]:
        """[region_graphs] ``capture()`` arguments under which an ordinary graph captures
        as region graphs do (``ordinary_capture_kwargs``)."""
        raise self._undeclared("region_graphs")

    def _undeclared(self, feature: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} declares Capabilities.{feature} but does not implement "
            f"{', '.join(FEATURE_HOOKS[feature])}")

    # ------------------------------------------------------------------ helpers for vendors

    _rng_streams_made = 0  #: (per backend object once it makes one: see rng_stream_seed)

    def rng_stream_seed(self, initial_seed: int) -> int:
        """The seed of this backend's next :class:`~graphslot.backend.RngStream`.

        Args:
            initial_seed: the framework's seed now (``torch.initial_seed()`` or the
                device generator's).

        Returns:
            ``initial_seed`` moved on by a count of the streams made, so no two streams
            draw alike, and a run seeded alike makes the same ones.
        """
        self._rng_streams_made += 1
        return (initial_seed + 0x9E3779B97F4A7C15 * self._rng_streams_made) % (1 << 63)
