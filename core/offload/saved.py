"""What a forward saves: :class:`SavedTensorSpec`, :class:`SavedLayout` (the specs of
one module's forward, recorded while a framework runs it), the rules for what is never
offloaded, and the section and alignment sizes slots are cut in. Imports nothing of the
package."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ..backend import align_up
from ..errors import StateError
from ..sizes import view_extent

SLOT_ALIGN = 256  #: byte alignment of each saved tensor inside a slot
#: a bank's bytes move to and from the host in sections of about this many bytes, each
#: with events of its own (see the package docstring). A copy's cost is its bytes past a
#: few MiB; below that the calls and events per section start to count.
SECTION_BYTES = 32 << 20


def sections_of(size: int, section_bytes: int = SECTION_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges cutting ``size`` bytes into about equal sections of
    about ``section_bytes`` (as many as ``section_bytes`` asks for, each start 256-byte
    aligned, so a section may be up to 255 bytes longer; the last may be shorter)."""
    n = max(1, -(-size // max(section_bytes, SLOT_ALIGN)))
    step = align_up(-(-size // n), SLOT_ALIGN)
    return [(a, min(a + step, size)) for a in range(0, size, step)]

@dataclass(frozen=True)
class SavedTensorSpec:
    """What discovery saw of one saved tensor, and where it lives in the slot.

    Saved tensors that view one storage (a tensor saved twice, the q/k/v slices of one
    projection) share one region of the slot laid out like that storage, so their bytes
    are held and moved once, as the graph's own pool would hold them.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    device: str
    nbytes: int
    offset: int = 0  #: slot byte offset of the first element (set by layout)
    offload: bool = True  #: False: kept on the device (below the size threshold)
    storage: int = -1  #: which saved storage it views, in order of first sight; -1: its own region
    storage_offset: int = 0  #: byte offset of the first element inside that storage
    extent: int = 0  #: bytes from the first element to just past the last

    @staticmethod
    def of(t: torch.Tensor, storages: dict[int, int] | None = None) -> SavedTensorSpec:
        """Describe ``t``; with ``storages`` (data pointer -> index, filled in as seen)
        it is placed with the other saved views of its storage."""
        es = t.element_size()
        shape, stride = tuple(t.shape), tuple(t.stride())
        extent = view_extent(shape, stride, es)
        sid = -1
        overlaps = any(step == 0 and n > 1 for n, step in zip(shape, stride))  # expanded: copy densely
        # A lazily conjugated or negated view reads other values than its storage holds:
        # a region of its own, its values copied (sharing its storage's region, it read
        # the plain bytes, or wrote its values over them).
        lazy = t.is_conj() or t.is_neg()
        if storages is not None and not overlaps and not lazy and t.numel():
            sid = storages.setdefault(t.untyped_storage().data_ptr(), len(storages))
        return SavedTensorSpec(shape, stride, t.dtype, str(t.device), t.numel() * es,
                               storage=sid, storage_offset=int(t.storage_offset()) * es, extent=extent)

    def describe(self) -> str:
        return f"{list(self.shape)} stride {list(self.stride)} {self.dtype} on {self.device}"


def _same(a: SavedTensorSpec, b: SavedTensorSpec) -> bool:
    """Two passes saved the same tensor: same view of the same saved storage."""
    return (a.shape, a.stride, a.dtype, a.device, a.storage, a.storage_offset) == \
        (b.shape, b.stride, b.dtype, b.device, b.storage, b.storage_offset)


class SavedLayout:
    """What one graphed module's forward saves, recorded during forwards that autograd
    keeps (a framework's own recording step, before it captures), for the units of its
    graphs to lay their slots out from (:meth:`OffloadUnit.adopt`). Every recorded pass
    must save the same tensors.

    Args:
        name: the module's name in messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._specs: list[SavedTensorSpec] | None = None

    @property
    def recorded(self) -> bool:
        """Whether a forward has been recorded."""
        return self._specs is not None

    @property
    def specs(self) -> list[SavedTensorSpec]:
        """The saved tensors of the last recorded forward, in the order they were saved
        (a copy; empty before any)."""
        return list(self._specs or ())

    @contextlib.contextmanager
    def recording(self, leave: Callable[[torch.Tensor], bool]) -> Iterator[None]:
        """Around one forward whose backward will run: note each tensor it saves, except
        what ``leave`` says stays put. Autograd keeps every saved tensor as it is (the
        backward that follows frees them; a forward no backward follows is recorded with
        :func:`recording_saved_tensors` instead).

        Raises:
            StateError: on leaving, when this forward saved other tensors than the one
                recorded before it.
        """
        seen: list[SavedTensorSpec] = []
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not leave(t):
                seen.append(SavedTensorSpec.of(t, storages))
            return t.detach()  # (the same memory without its grad_fn: see below)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        before = self._specs
        if before is not None and (len(seen) != len(before) or not all(map(_same, seen, before))):
            raise StateError(f"{self.name} saved different tensors in two forward passes "
                             f"({len(before)} then {len(seen)}); graphed layers must save the same "
                             "tensors every time")
        self._specs = seen


def state_storages(modules: Iterable[Any]) -> set[int]:
    """Data pointers of the storages of ``modules``' parameters and buffers (a wrapper
    tensor subclass with no storage of its own to ask is skipped)."""
    out = set()
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            with contextlib.suppress(Exception):
                out.add(t.untyped_storage().data_ptr())
    return out


def never_offloaded(t: torch.Tensor, device_type: str, state: set[int]) -> bool:
    """The one rule for what activation offload leaves where it is: parameters and buffers
    (and views of them: their storage is in ``state``, see :func:`state_storages`), and
    tensors that cost the device nothing (empty, or not on a ``device_type`` device, such
    as the host-side RNG seeds some kernels save)."""
    return t.device.type != device_type or t.numel() == 0 or t.untyped_storage().data_ptr() in state


def values_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A fingerprint of ``t``'s values that stays on its device (their sum, in float64 or
    int64): what tells a change made through a way the version counter does not see."""
    with torch.no_grad():
        t = t.detach()
        if t.is_complex():  # (summed as complex, the imaginary parts would be dropped)
            t = torch.view_as_real(t.resolve_conj())
        return t.sum(dtype=torch.float64 if t.is_floating_point() else torch.int64)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two :func:`values_fingerprint` of one tensor tell no change (NaN as NaN)."""
    return bool(torch.equal(a, b) or (a.is_floating_point() and bool(a.isnan()) and bool(b.isnan())))


@contextlib.contextmanager
def watching_saved_values(watch: Callable[[torch.Tensor], bool]) -> Iterator[list[int]]:
    """Around an eager forward: yields a list that, on exit, holds the indices (in saving
    order, among the saved tensors ``watch`` accepts) of those whose values changed after
    they were saved. Some kernels fill an input they save, and without a new version:
    RReLU's noise is saved before its kernel draws it. A copy made when such a tensor is
    saved (a slot's) holds what it held then, not what eager's backward reads."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (autograd holds them anyway)
    changed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if watch(t):
            seen.append((t, values_fingerprint(t)))
        # The same memory without its grad_fn: a node saving its own output, handed back
        # the output itself, would hold itself through C++ where no garbage collection
        # sees it, and the forward's activations would stay for the life of the process.
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield changed
        changed.extend(i for i, (t, was) in enumerate(seen) if not same_values(values_fingerprint(t), was))
    finally:
        seen.clear()


@contextlib.contextmanager
def recording_saved_tensors(record: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Run a forward that no backward follows, handing each tensor autograd saves to
    ``record``.

    The tensors are held here until the block ends, so no storage is freed and its address
    reused meanwhile (saved views are told apart by address), and autograd keeps none of
    them: a hook that returned a node's own output (SDPA saves its result) would tie the
    node to itself through C++, where no garbage collection sees it, and the memory would
    stay allocated for the life of the process.
    """
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> None:
        record(t)
        held.append(t)

    def unpack(_packed: None) -> torch.Tensor:
        raise AssertionError("graphslot: a recording forward is never differentiated")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
    held.clear()
