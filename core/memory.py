"""Memory accounting that sees graph pools and VMM pages.

One :class:`MemoryReport` separates three views of device memory, each exact about
what it can see and blind to the rest:

(a) **graphslot's ledger** (``mapped_bytes``, ``allocated_bytes``, ``reserved_va_bytes``):
    exact, from graphslot's own books. Sees every page graphslot created and mapped,
    and nothing else. A physical allocation mapped at two addresses (pages a
    :class:`~graphslot.paged.PagedPool` shares) counts once in both.
(b) **the framework allocator** (``allocator_allocated_bytes``,
    ``allocator_reserved_bytes``, ``graph_pool_reserved_bytes``,
    ``graph_pool_allocated_bytes``): from the allocator's statistics and memory
    snapshot, graph private pools included. Exact for what the allocator manages; blind
    to graphslot's VMM pages, to other libraries' direct driver allocations, and to
    driver/graph metadata. The ``allocator_*`` fields are ``None`` where the backend's
    allocator keeps no figures (host memory on the cpu backend, whose ``graph_pool_*``
    fields count the graphs' own memory).
(c) **the driver** (``driver_free_bytes``, ``driver_total_bytes``, ``driver_used_bytes``):
    sees everything on the device, this process's and others', including graph
    executables and library workspaces, so it is the ground truth for "did memory come
    back", but it moves with unrelated activity. :func:`report` takes the median of
    several reads.
(d) **graphslot's pinned host buffers** (``host_pinned_bytes``): exact, the live buffers
    made by ``Backend.pinned_empty`` (the offload engine's host side). Host memory, not
    device memory; so a leak of offloaded activations shows here.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import asdict, dataclass, fields
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from .backend import Backend
from .errors import UsageError
from .layer_calls import check_passes_gradient, naming_refusals
from .offload import SavedTensorSpec, never_offloaded, recording_saved_tensors, state_storages

__all__ = ["MemoryReport", "report", "measure", "release_unused", "used_bytes", "saved_activation_bytes",
           "run_counting_saved", "saved_bytes_by_part", "saved_bytes_per_layer"]


@dataclass(frozen=True)
class MemoryReport:
    mapped_bytes: int
    allocated_bytes: int
    reserved_va_bytes: int
    allocator_allocated_bytes: int | None
    allocator_reserved_bytes: int | None
    graph_pool_reserved_bytes: int | None
    graph_pool_allocated_bytes: int | None
    driver_free_bytes: int
    driver_total_bytes: int
    host_pinned_bytes: int = 0

    @property
    def driver_used_bytes(self) -> int:
        return self.driver_total_bytes - self.driver_free_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["driver_used_bytes"] = self.driver_used_bytes
        return d

    def __sub__(self, other: MemoryReport) -> MemoryReport:
        vals: dict[str, Any] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            vals[f.name] = None if a is None or b is None else a - b
        return MemoryReport(**vals)


def report(backend: Backend, samples: int = 3) -> MemoryReport:
    """Read all three views now (after synchronising the device).

    Args:
        backend: the backend to read.
        samples: driver reads; the driver figure is their median (at least one).

    Returns:
        A :class:`MemoryReport` of graphslot's ledger, the allocator and the driver.
    """
    backend.synchronize()
    frees = []
    total = 0
    for _ in range(max(1, samples)):
        free, total = backend.mem_info()
        frees.append(free)
    a = backend.allocator_stats()
    led = backend.ledger
    return MemoryReport(
        mapped_bytes=led.mapped_bytes,
        allocated_bytes=led.allocated_bytes,
        reserved_va_bytes=led.reserved_bytes,
        allocator_allocated_bytes=a["allocated_bytes"],
        allocator_reserved_bytes=a["reserved_bytes"],
        graph_pool_reserved_bytes=a["graph_pool_reserved_bytes"],
        graph_pool_allocated_bytes=a["graph_pool_allocated_bytes"],
        driver_free_bytes=int(statistics.median(frees)),
        driver_total_bytes=total,
        host_pinned_bytes=backend.pinned_bytes,
    )


def release_unused(backend: Backend) -> None:
    """Free what is garbage and hand cached memory back, so usage figures show live memory.

    Args:
        backend: whose allocator cache is emptied (after a garbage collection and a
            device synchronisation).
    """
    import gc

    gc.collect()
    backend.synchronize()
    backend.empty_cache()


def used_bytes(backend: Backend) -> int:
    """Memory really in use after :func:`release_unused`.

    Args:
        backend: the backend to measure.

    Returns:
        This process's footprint in bytes where the backend can tell it (cpu), else the
        driver's used figure (median of three reads).
    """
    release_unused(backend)
    own = backend.footprint_bytes()
    return own if own is not None else report(backend).driver_used_bytes


class Measurement:
    """What :func:`measure` yields: ``before``, ``after`` and ``delta`` once the block ends."""

    before: MemoryReport
    after: MemoryReport
    delta: MemoryReport


@contextmanager
def measure(backend: Backend, samples: int = 3) -> Iterator[Measurement]:
    """Context manager: the change of all three views around the block.

    Args:
        backend: the backend to read.
        samples: driver reads per report (their median is used).

    Returns:
        A :class:`Measurement`; ``before`` is filled at entry, ``after`` and ``delta``
        when the block ends. ``driver_total_bytes`` of ``delta`` is 0 and
        ``driver_free_bytes`` is negative when the block took memory; read
        ``delta.driver_used_bytes`` for "bytes the device lost".
    """
    m = Measurement()
    m.before = report(backend, samples)
    yield m
    m.after = report(backend, samples)
    m.delta = m.after - m.before


def _recording_spans(device_type: str, state: set[int], spans: dict[int, tuple[int, int]]
                     ) -> Callable[[torch.Tensor], None]:
    """A saved-tensor recorder that widens ``spans`` (storage -> bytes [first, past last)
    of its saved views) with each saved activation; parameters and buffers are skipped."""

    def record(t: torch.Tensor) -> None:
        if not never_offloaded(t, device_type, state):
            ptr = t.untyped_storage().data_ptr()
            sp = SavedTensorSpec.of(t)  # the slot layout's own byte extent of a view
            lo, hi = sp.storage_offset, sp.storage_offset + sp.extent
            a, b = spans.get(ptr, (lo, hi))
            spans[ptr] = (min(a, lo), max(b, hi))

    return record


def run_counting_saved(fn: Callable[[], Any], device_type: str,
                       modules: Sequence[torch.nn.Module]) -> tuple[Any, int]:
    """Run ``fn`` and count what autograd saves for backward meanwhile.

    Args:
        fn: the work (a forward).
        device_type: count tensors on this device type.
        modules: their parameters and buffers are not counted.

    Returns:
        ``fn``'s result and the bytes saved (views of one storage count once).
    """
    spans: dict[int, tuple[int, int]] = {}
    with recording_saved_tensors(_recording_spans(device_type, state_storages(modules), spans)):
        out = fn()
    # A tensor saved twice, or several views of one buffer, cost their storage once.
    return out, sum(b - a for a, b in spans.values())


def saved_bytes_by_part(fn: Callable[[], Any], device_type: str, modules: Sequence[torch.nn.Module],
                        parts: Sequence[torch.nn.Module]) -> list[int]:
    """Run ``fn`` (a forward of ``modules``) and count what autograd saves while each of
    ``parts`` (modules it calls, none inside another) runs: per part, in bytes, counted
    as :func:`run_counting_saved` counts."""
    spans: list[dict[int, tuple[int, int]]] = [{} for _ in parts]
    state = state_storages(modules)
    records = [_recording_spans(device_type, state, s) for s in spans]
    running: list[int | None] = [None]

    def record(t: torch.Tensor) -> None:
        if running[0] is not None:
            records[running[0]](t)

    def enter(i: int) -> Callable[..., None]:
        return lambda *_: running.__setitem__(0, i)

    handles = []
    for i, m in enumerate(parts):
        handles.append(m.register_forward_pre_hook(enter(i)))
        handles.append(m.register_forward_hook(lambda *_: running.__setitem__(0, None)))
    try:
        with recording_saved_tensors(record):
            fn()
    finally:
        for h in handles:
            h.remove()
    return [sum(b - a for a, b in s.values()) for s in spans]


def saved_activation_bytes(layers: Sequence[torch.nn.Module], x: torch.Tensor) -> int:
    """What stays on the device between forward and backward without offload.

    Args:
        layers: modules applied in order, each one tensor to one tensor.
        x: an input of the shape, dtype and device the layers will see.

    Returns:
        Bytes of activations autograd saves on ``x``'s device for one forward through
        ``layers`` (parameters and buffers excluded; views of one storage count once).
    """
    def forward() -> None:
        h = x
        for m in layers:
            h = m(h)

    return run_counting_saved(forward, x.device.type, layers)[1]


def saved_bytes_per_layer(layers: Sequence[torch.nn.Module], x: torch.Tensor,
                          around: Callable[[int], ContextManager[Any]] | None = None) -> list[int]:
    """What each of ``layers`` (applied in order to ``x``) saves for backward, in bytes, as
    :func:`saved_activation_bytes` counts it for one layer. One layer's saved tensors are
    held at a time, so this costs one layer's activations, not the stack's. ``around(i)``,
    where given, is entered around layer ``i``'s forward (parts checkpointed, say).

    Raises:
        UsageError: a layer does not return one tensor (naming it).
    """
    out: list[int] = []
    h = x
    for i, m in enumerate(layers):
        with naming_refusals(f"layer {i}"), (contextlib.nullcontext() if around is None else around(i)):
            y, saved = run_counting_saved(lambda: m(h), x.device.type, [m])
        if not isinstance(y, torch.Tensor):
            raise UsageError(f"layer {i} returned {type(y).__name__}; graphed layers must "
                             "return one tensor")
        if i + 1 < len(layers):
            check_passes_gradient(y, f"layer {i}", h.requires_grad or any(
                p.requires_grad for p in m.parameters()))
        out.append(saved)
        h = y.detach().requires_grad_(h.requires_grad or y.requires_grad)
        del y
    return out
