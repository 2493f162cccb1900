"""A replayable graph on the cpu backend, bound to the addresses it captured.

Capture records every ATen operation issued inside it (through a dispatch mode) with
the raw address, shape, stride and dtype of each tensor it read or wrote. Replay
re-runs the operations on views made at exactly those addresses and writes each result
back to the address the capture saw, so replay reads whatever lives at those addresses
now, just as a device graph does. A pointer bug therefore shows here exactly as on a
GPU: reloading activations into a new allocation leaves the graph reading the old bytes.

Tensors created during capture form the graph's private pool: the graph keeps them
alive so their addresses are never handed to anyone else. A graph made with a *pool
region* (``new_graph(pool_region=(va, size))``) draws that pool from the region instead:
each fresh output (one that does not alias an input) is copied to the next free bytes of
the region and the op returns the region view, so later ops and the replay use region
addresses. The region is a bump allocator (the graph replays every op, so every address
it recorded stays in use); graphs made with ``share_pool_with`` share one region.

Before each replay, every address the graph touches inside a graphslot reservation is
checked against the ledger; replaying over an unmapped slot raises
:class:`~graphslot.errors.StateError` naming the address instead of faulting.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphslot.backend import DeviceGraph
from graphslot.errors import PoolFullError, StateError, UsageError
from graphslot.regions import Block, RegionGraph
from graphslot.sizes import view_extent

from .backend import bytes_at

if TYPE_CHECKING:
    from .backend import CpuBackend

# Operations a graph cannot hold: they sync with the host or have data-dependent shapes.
_REFUSED = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
            "aten::unique", "aten::_unique2", "aten::equal"}
# Operations that only allocate: on a device they are no work of the graph (the pool hands
# out the bytes at capture), so a replay must not run them again (nor write their
# uninitialised result over what lives at that address now).
_ALLOCATE_ONLY = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::empty_permuted",
                  "aten::new_empty", "aten::new_empty_strided"}


@dataclass(frozen=True)
class _Ref:
    """Where a tensor lived at capture: enough to rebuild a view there."""

    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # bytes spanned from ptr
    conj: bool = False  # the lazy conjugate and negative bits, which ops read as values
    neg: bool = False

    @staticmethod
    def of(t: torch.Tensor) -> _Ref:
        nbytes = view_extent(t.shape, t.stride(), t.element_size())
        return _Ref(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, nbytes,
                    t.is_conj(), t.is_neg())

    def view(self) -> torch.Tensor:
        if self.nbytes == 0:
            v = torch.empty(self.shape, dtype=self.dtype)
        else:
            v = bytes_at(self.ptr, self.nbytes).view(self.dtype).as_strided(self.shape, self.stride)
        if self.conj:
            v = v.conj()
        if self.neg:
            v = torch._neg_view(v)
        return v


class _Op:
    __slots__ = ("func", "state", "args_spec", "in_refs", "out_refs", "out_spec", "in_views",
                 "out_views")

    def __init__(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        self.func = func
        self.state = _global_state()
        flat, self.args_spec = pytree.tree_flatten((args, kwargs))
        self.in_refs = [(_Ref.of(x) if isinstance(x, torch.Tensor) else x) for x in flat]
        out_flat, self.out_spec = pytree.tree_flatten(out)
        self.out_refs = [(_Ref.of(x) if isinstance(x, torch.Tensor) else None) for x in out_flat]
        self.in_views: list[Any] | None = None
        self.out_views: list[torch.Tensor | None] | None = None

    def bind(self) -> None:
        """Build the address views once; they stay valid because the addresses do."""
        self.in_views = [(r.view() if isinstance(r, _Ref) else r) for r in self.in_refs]
        self.out_views = [(r.view() if r is not None else None) for r in self.out_refs]

    def run(self) -> None:
        assert self.in_views is not None and self.out_views is not None
        args, kwargs = pytree.tree_unflatten(self.in_views, self.args_spec)
        out = self.func(*args, **kwargs)
        for got, want in zip(pytree.tree_leaves(out), self.out_views):
            if want is None or not isinstance(got, torch.Tensor):
                continue
            if got.data_ptr() == want.data_ptr() and got.stride() == want.stride():
                continue  # in place, a view, or written through out=: already at the address
            want.copy_(got)


def _global_state() -> tuple[bool, torch.dtype, bool]:
    """What kernels read besides their arguments, which a replay may find otherwise than
    the capture did: grad mode (oneDNN's LSTM keeps the workspace its backward reads only
    with it on, and a stack's forward replays inside an autograd Function, grad off), the
    default dtype (a factory op recorded with dtype None) and whether oneDNN runs
    (convolutions differ in the last bits without it)."""
    return torch.is_grad_enabled(), torch.get_default_dtype(), torch._C._get_mkldnn_enabled()


def _set_global_state(state: tuple[bool, torch.dtype, bool]) -> None:
    # (the views a replay passes never require grad: grad mode builds no autograd graph)
    grad, dtype, mkldnn = state
    torch._C._set_grad_enabled(grad)
    torch.set_default_dtype(dtype)
    torch._C._set_mkldnn_enabled(mkldnn)


class _HostStep:
    """Host work a graph runs at its place in every replay (a record or a wait)."""

    __slots__ = ("fn",)
    in_refs: list[Any] = []
    out_refs: list[Any] = []

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def bind(self) -> None:
        pass

    def run(self) -> None:
        self.fn()


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: CpuGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _REFUSED:
            raise StateError(f"{name} cannot be captured in a graph: it synchronises with the "
                             "host or has a data-dependent shape")
        out = func(*args, **kwargs)
        region = self.graph._region
        if region is not None:
            out = region.relocate(out, (args, kwargs))
        # An op that changes only a tensor's shape and strides in place (t_, transpose_,
        # unsqueeze_; nn.GRU(batch_first=True) calls one) is no work of the graph either:
        # the ops after it recorded the views it made, and replaying it would change the
        # bound view it ran on again at every replay.
        if name not in _ALLOCATE_ONLY and torch.Tag.inplace_view not in func.tags:
            self.graph._ops.append(_Op(func, args, kwargs, out))
        for x in pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and not (region is not None and region.holds(x)):
                self.graph._pool.append(x)  # keep capture-time memory: the graph's private pool
        return out


class RegionPool:
    """A graph's private pool drawn from ``[va, va + size)`` of a graphslot reservation.

    Bump allocation, never reused: replay rewrites every recorded address. ``used`` is
    the high-water mark in bytes, the physical memory the graphs of this pool need.
    """

    def __init__(self, backend: CpuBackend, region: Any, align: int = 256) -> None:
        va, size, res = backend.pool_region(region)
        self._backend, self._res = backend, res
        self.va, self.size, self.align = va, size, align
        self.used = 0
        # The buffers behind relocated storages: alive while any tensor uses region bytes.
        self._bufs: list[weakref.ref[Any]] = []
        # While recording (see recording()): the blocks ended so far, the blocks handed
        # out by offset as (nbytes, start), and the next position in the sequence.
        self._ended: list[Block] | None = None
        self._open: dict[int, tuple[int, int]] = {}
        self._position = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Block]]:
        """See :meth:`graphslot.regions.RegionGraph.recording`. A block is handed out from
        its relocation until the storage behind it goes (a recorded op keeps its address
        only, never the tensor)."""
        if self._ended is not None:
            raise UsageError("this graph pool is recording already")
        out: list[Block] = []
        ended: list[Block] = []
        self._open = {off: (n, 0) for off, n in self.live_ranges()}
        self._position, self._ended = 1, ended
        try:
            yield out
        finally:
            self._ended = None
            out.extend(ended)
            out.extend((off, n, start, None) for off, (n, start) in sorted(self._open.items()))
            self._open = {}

    def _tick(self) -> int:
        self._position += 1
        return self._position - 1

    def _gone(self, offset: int, _ref: Any) -> None:
        # (a weakref callback: runs on whichever thread let the storage go)
        if self._ended is not None and offset in self._open:
            n, start = self._open.pop(offset)
            self._ended.append((offset, n, start, self._tick()))

    @property
    def live_bytes(self) -> int:
        """Region bytes still referenced by live tensors (0: the region may be unmapped)."""
        return sum(n for _, n in self.live_ranges())

    def live_ranges(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every relocated storage still alive."""
        self._bufs = [r for r in self._bufs if r() is not None]
        return [(ctypes.addressof(b) - self.va, ctypes.sizeof(b))
                for b in (r() for r in self._bufs) if b is not None]

    def holds(self, t: torch.Tensor) -> bool:
        p = t.untyped_storage().data_ptr()
        return self.va <= p < self.va + self.size

    def _alloc(self, nbytes: int) -> int:
        off = -(-self.used // self.align) * self.align
        if off + nbytes > self.size:
            raise PoolFullError(
                f"graph pool region [0x{self.va:x}, 0x{self.va + self.size:x}) is full: "
                f"{off} of {self.size} bytes used, the capture needs {nbytes} more; "
                "give the pool a larger region")
        start = self.va + off - self._res.va
        # Writing to an unmapped page would kill the process: refuse with a message instead.
        if self._res.freed or not self._res.is_accessible(start, nbytes):
            raise StateError(f"graph pool region at 0x{self.va + off:x} ({nbytes} bytes) has "
                             "nothing accessible mapped; map the region before capturing into it")
        self.used = off + nbytes
        return self.va + off

    def relocate(self, out: Any, inputs: Any) -> Any:
        """``out`` with every fresh (non-input-aliasing) storage moved into the region."""
        seen = {x.untyped_storage().data_ptr() for x in pytree.tree_leaves(inputs)
                if isinstance(x, torch.Tensor) and x.layout == torch.strided}
        moved: dict[int, Any] = {}

        def move(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.device.type != "cpu":
                return x
            storage = x.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in seen or self.va <= ptr < self.va + self.size:
                return x  # an alias of an input (view, in place, out=): it already has its address
            if ptr not in moved:
                addr = self._alloc(nbytes)
                buf = (ctypes.c_uint8 * nbytes).from_address(addr)
                offset = addr - self.va
                self._bufs.append(weakref.ref(buf, functools.partial(self._gone, offset)))
                if self._ended is not None:
                    self._open[offset] = (nbytes, self._tick())
                dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
                dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
                moved[ptr] = dst.untyped_storage()
            # set_ rather than a view op: the result must not look like a view to autograd.
            return torch.empty(0, dtype=x.dtype).set_(moved[ptr], x.storage_offset(),
                                                      x.shape, x.stride())

        return pytree.tree_map(move, out)


class CpuGraph(DeviceGraph):
    """See the module docstring."""

    #: capture runs every op eagerly, so a pool region must be mapped while capturing.
    executes_during_capture = True

    def __init__(self, backend: CpuBackend, region: RegionPool | None = None) -> None:
        self._backend = backend
        self._region = region
        self._ops: list[_Op | _HostStep] = []
        self._pool: list[torch.Tensor] = []
        self._checks: list[tuple[Any, int, int]] = []  # (reservation, offset, size) to verify
        self._state = "empty"

    @contextlib.contextmanager
    def capture(self, stream: Any = None) -> Iterator[None]:
        if self._state != "empty":
            raise StateError(f"this graph is already {self._state}; make a new graph to capture again")
        if self._backend.is_capturing():
            raise StateError("a graph is already being captured on this thread")
        self._state = "capturing"
        self._backend._set_capturing(True, self)
        try:
            with _Recorder(self):
                yield
        except BaseException:
            self._state = "failed"
            raise
        finally:
            self._backend._set_capturing(False)
        self._finish()

    def host_step(self, fn: Any) -> None:
        """Under capture: run ``fn`` now and at this place in every replay (capture runs
        every op as it records it)."""
        fn()
        self._ops.append(_HostStep(fn))

    def _finish(self) -> None:
        ledger = self._backend.ledger
        seen: dict[tuple[int, int], tuple[Any, int, int]] = {}
        for op in self._ops:
            for r in [*op.in_refs, *op.out_refs]:
                if isinstance(r, _Ref) and r.nbytes:
                    res = ledger.find(r.ptr, r.nbytes)
                    if res is not None:
                        seen[(r.ptr, r.nbytes)] = (res, r.ptr - res.va, r.nbytes)
            op.bind()
        self._checks = list(seen.values())
        self._state = "captured"

    def replay(self) -> None:
        if self._state != "captured":
            raise StateError(f"cannot replay a graph that is {self._state}")
        with self._backend.driver_lock:
            for res, off, size in self._checks:
                if res.freed or not res.is_accessible(off, size):
                    raise StateError(
                        f"graph replay would touch 0x{res.va + off:x} ({size} bytes), where nothing "
                        "accessible is mapped; map the slot before replaying")
        # Each op runs as the kernel the capture recorded, as a device graph's would: not
        # through autocast again (the caller's, on at replay, would recast what the capture
        # ran in full precision inside a composite op, such as attention's math path).
        caller = state = _global_state()
        try:
            with torch.autocast("cpu", enabled=False):
                for op in self._ops:
                    want = getattr(op, "state", state)  # (a host step: the op's before it)
                    if want != state:
                        _set_global_state(want)
                        state = want
                    op.run()
        finally:
            if state != caller:
                _set_global_state(caller)

    @property
    def num_ops(self) -> int:
        return len(self._ops)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the graph's private pool that the framework allocator holds (distinct
        storages it keeps alive; a pool region is graphslot's memory, not counted here)."""
        seen: dict[int, int] = {}
        for t in self._pool:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def release_pool(self) -> int:
        """Drop the recorded work and the private pool; replay is refused afterwards.

        Returns the bytes of the pool region that live tensors still reference (0 when
        the region may be unmapped; always 0 without a region). Safe to call again.
        """
        self._ops, self._pool, self._checks = [], [], []
        self._state = "released"
        if self._region is None:
            return 0
        import gc

        gc.collect()  # capture-time autograd graphs hold region tensors in reference cycles
        return self._region.live_bytes

    @property
    def pool_region(self) -> tuple[int, int] | None:
        """``(va, size)`` of the pool region, or ``None`` for an ordinary private pool."""
        return None if self._region is None else (self._region.va, self._region.size)

    @property
    def pool_used_bytes(self) -> int:
        """Bytes of the pool in use: the region's high-water mark, else :attr:`pool_bytes`."""
        return self.pool_bytes if self._region is None else self._region.used


class RegionCpuGraph(CpuGraph, RegionGraph):
    """A :class:`CpuGraph` whose private pool is a :class:`RegionPool`: the
    :class:`~graphslot.regions.RegionGraph` of the cpu backend. Its pool handle is the graph
    itself (``backend.new_graph(share_pool_with=...)``), and captures into it draw from the
    region with no routing, so :meth:`lend` is the interface's no-op."""

    def __init__(self, backend: CpuBackend, region: RegionPool) -> None:
        super().__init__(backend, region)

    @property
    def pool_region(self) -> tuple[int, int]:
        assert self._region is not None
        return (self._region.va, self._region.size)

    def live_ranges(self) -> list[tuple[int, int]]:
        assert self._region is not None
        return self._region.live_ranges()

    def recording(self) -> ContextManager[list[Block]]:
        assert self._region is not None
        return self._region.recording()
