"""Megatron-Core: local CUDA graphs and activation offload together, through graphslot slots.

    from graphslot.adapters import megatron as gs_megatron

    model = GPTModel(config, ...)          # config.cuda_graph_impl = "local"
    offload = gs_megatron.enable(model, mode="resident")   # before the first training step
    ...                                    # Megatron's own schedules and optimizer, unchanged
    offload.disable()                      # or gs_megatron.disable()

Megatron's local CUDA graphs capture every ``TransformerLayer`` forward and backward, and
the saved activations of each layer stay in the graphs' memory pool from forward to
backward. Megatron's own fine-grained offload cannot help there: it reloads into a new
address, so its configuration check refuses offload with whole-layer graphs. With
:func:`enable`, the graphed layers you choose save their activations into graphslot slots
at fixed virtual addresses instead; after each forward replay the slot goes to pinned host
memory, and before the backward replay it comes back to the same address. The graphs
never see a new pointer, and the pool no longer holds those activations.

What it touches, all restored by :meth:`MegatronOffload.disable`:

* a forward pre-hook and hook on each chosen layer, only until Megatron creates its
  graphs: they record what the layer saves for backward while Megatron records its
  first, eager step (``is_graph_capturing`` and ``is_graph_warmup`` keep them quiet in
  Megatron's own warm-up);
* ``_CudagraphGlobalRecord.create_cudagraphs``, wrapped: before Megatron captures, each
  graph runner of a chosen layer gets a slot, with ping-pong banks assigned in the order
  of Megatron's own backward record; its forward is captured with a pack hook that
  copies each saved tensor into the slot;
* per runner, after capture: ``replay_graph_capture`` (offload after the forward
  replay, or give the slot back when no backward follows) and ``bwd_graph`` (restore,
  look-ahead restore of the runner whose backward came next the step before, replay).

* with ``release_graph_pool`` (the default in remap): ``CudaGraphManager.global_mempool``
  becomes a :class:`~graphslot.paged.PagedPool`, a graph pool in a graphslot VA region, so
  the pool's free pages (the graphs' working memory, buffers Megatron let go of) are
  unmapped once a backward leaves no graph waiting for its backward, and mapped again
  before the next forward replay; the runner class's ``create_fwd_graph``,
  ``create_bwd_graph`` and ``replay_graph_capture`` and the module's
  ``alloc_tensor_from_graph_mempool`` are wrapped to map the pool before anything runs on
  it. Device memory between steps then approaches eager's.

``disable()`` after the graphs exist calls Megatron's ``delete_cuda_graphs()`` first
(those graphs read graphslot's slots), so the next step records and captures them again
without graphslot.

Layers from Megatron's local spec and from its TransformerEngine spec are served, in
fp32/bf16/fp16 and with fp8 compute; :func:`check_config` names what is refused and why
(fp8/fp4 parameters, fp8 attention, unverified recipes, fp4, ``delay_wgrad_compute``, ...).
With TransformerEngine importable, Megatron itself releases graph input and output buffers
across graphs through TE's weak references, which graphslot leaves alone. Megatron 0.19.2
also releases, right after a layer's forward capture, a graph input that its
``save_for_backward`` observer did not see saved. Torch's own norms save their input in C++,
unseen, so a layer graphslot does not offload may read an overwritten input in its backward
graph. A layer graphslot offloads is not affected: its slot holds a copy of every saved
tensor.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from graphslot.backend import Backend, align_up
from graphslot.errors import IncompatibleError, StateError, UsageError
from graphslot.offload import (Mode, OffloadEngine, OffloadUnit, SavedLayout, leaves_on_device,
                               ping_pong_banks)
from graphslot.paged import PagedPool
from graphslot.selection import get_backend

from .megatron_checks import (FP8_RECIPES_SERVED, MIN_VERSION, RUNNER_NEEDS, MegatronInfo,  # noqa: F401
                              check_config, check_megatron)

__all__ = ["MIN_VERSION", "FP8_RECIPES_SERVED", "MegatronOffload", "check_megatron", "check_config", "enable", "disable", "active"]


# --------------------------------------------------------------------------- per layer


class _Layer:
    """One chosen TransformerLayer: what it saves for backward, and its discovery hooks."""

    def __init__(self, module: torch.nn.Module, device_type: str) -> None:
        self.module = module
        self.number = int(getattr(module, "layer_number", 0))
        self.device_type = device_type
        self.layout = SavedLayout(f"layer {self.number}")
        self._ctx: Any = None
        self._is_state = leaves_on_device([], device_type)
        self._kept: dict[str, int] = {}
        self._recording = False
        #: saved tensor subclasses kept on the device in the last recorded forward, by type
        self.kept: dict[str, int] = {}
        self.handles: list[Any] = []

    def is_state(self, t: torch.Tensor) -> bool:
        # Parameters and buffers (and views of them) are never offloaded; neither are
        # host-side or empty tensors, which cost the device nothing.
        return self._is_state(t)

    def keeps(self, t: torch.Tensor) -> bool:
        """True when the saved tensor ``t`` stays where it is; False when it goes into the slot.

        State stays (see :meth:`is_state`), and so does a tensor subclass: a TransformerEngine
        quantized tensor (``Float8Tensor``: the cached fp8 weight that ``LayerNormLinear`` saves
        by reference, say) keeps its bytes in inner tensors that a slot copy would not reach,
        and stays referenced as autograd keeps any saved tensor. Only plain tensors are
        offloaded.
        """
        if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
            return self.is_state(t)
        if self._recording:
            name = f"{type(t).__module__}.{type(t).__qualname__}"
            self._kept[name] = self._kept.get(name, 0) + 1
        return True

    def begin(self) -> None:
        """From the layer's forward pre-hook in Megatron's recording step."""
        self._is_state = leaves_on_device([self.module], self.device_type)
        self._kept = {}
        self._recording = True
        self._ctx = self.layout.recording(self.keeps)
        self._ctx.__enter__()

    def end(self) -> None:
        """From the layer's forward hook (also after forwards that were not recorded)."""
        if self._ctx is None:
            return
        ctx, self._ctx = self._ctx, None
        self._recording = False
        self.kept = dict(self._kept)
        ctx.__exit__(None, None, None)


def _segment_bound(nbytes: int) -> int:
    """The most torch's caching allocator asks a pool for to serve ``nbytes``: small
    requests take a 2 MiB segment, up to 10 MiB a 20 MiB one, larger ones their size in
    2 MiB steps."""
    mib = 1 << 20
    return 2 * mib if nbytes <= mib else 20 * mib if nbytes < 10 * mib else align_up(nbytes, 2 * mib)


@dataclass(eq=False)
class _RunnerUnit:
    """One Megatron graph runner (one layer, one microbatch in flight) and its slot."""

    runner: Any
    layer: _Layer
    unit: OffloadUnit
    bank: int
    count: int = 0  #: its forwards so far: each one's microbatch key
    in_flight: int | None = None  #: the key of its forward awaiting its backward


@dataclass(eq=False)
class _Patch:
    obj: Any
    name: str
    had_own: bool
    old: Any = None

    @staticmethod
    def set(obj: Any, name: str, value: Any) -> _Patch:
        own = name in vars(obj)
        p = _Patch(obj, name, own, vars(obj)[name] if own else None)
        setattr(obj, name, value)
        return p

    def undo(self) -> None:
        if self.had_own:
            setattr(self.obj, self.name, self.old)
        else:
            with contextlib.suppress(AttributeError):
                delattr(self.obj, self.name)


class _BackwardGraph:
    """Stands in for a runner's ``bwd_graph``: restore, look-ahead, replay, consumed."""

    def __init__(self, owner: MegatronOffload, r: _RunnerUnit, graph: Any) -> None:
        self._owner, self._r, self.graph = owner, r, graph

    def replay(self) -> None:
        self._owner._backward(self._r, self.graph)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)


_ACTIVE: MegatronOffload | None = None
_KEPT_POOLS: list[PagedPool] = []  # pools whose bytes tensors still held at disable()


class MegatronOffload:
    """graphslot offload for the graphed layers of a Megatron-Core model; see the module docs.

    Args:
        model: the model, or a list of model chunks (virtual pipeline stages); wrappers
            such as DDP are fine: every ``TransformerLayer`` inside is found.
        mode: ``"resident"`` (two mapped banks per slot size, no driver calls per step)
            or ``"remap"`` (least memory: each slot's pages exist only around its use).
        layers: Megatron layer numbers (``layer.layer_number``, 1-based) to offload;
            default: every graphed layer of this rank.
        min_offload_bytes: saved tensors smaller than this stay on the device.
        backend: the graphslot backend (default :func:`graphslot.get_backend`); it must
            run on the model's device type.
        debug_checksums: check every restored activation against what was offloaded.
        release_graph_pool: give the free pages of Megatron's graph pool back between
            steps (see the module docs); default: in remap mode. Needs a backend whose
            graphs draw pools from regions.

    Raises:
        IncompatibleError: a Megatron-Core or a configuration the adapter cannot serve,
            naming what to change.
        UsageError: no ``TransformerLayer`` in the model, an unknown or ``"off"`` mode,
            or layer numbers the model does not have.

    Create it (or call :func:`enable`) after building the model and before the first
    training step; Megatron records its graphs in that step.
    """

    def __init__(self, model: Any, *, mode: Mode | str = Mode.RESIDENT, layers: Iterable[int] | None = None,
                 min_offload_bytes: int = 0, backend: Backend | None = None,
                 debug_checksums: bool = False, release_graph_pool: bool | None = None) -> None:
        global _ACTIVE
        info = check_megatron()
        self.megatron_version = info.version
        self._cg = info.cuda_graphs
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        layer_type: Any = info.transformer_layer
        found: list[torch.nn.Module] = [m for c in chunks for m in c.modules() if isinstance(m, layer_type)]
        if not found:
            raise UsageError("no megatron.core TransformerLayer found in the model")
        check_config(getattr(found[0], "config", None))
        try:
            m = Mode(mode)
        except ValueError:
            raise UsageError(f"unknown offload mode {mode!r}; choose resident or remap") from None
        if m is Mode.OFF:
            raise UsageError("mode 'off' offloads nothing; do not call enable() for that")
        numbers = sorted(int(getattr(x, "layer_number", 0)) for x in found)
        chosen = set(numbers) if layers is None else {int(n) for n in layers}
        unknown = sorted(chosen - set(numbers))
        if unknown:
            raise UsageError(f"layers {unknown} are not on this rank; its graphed layers are {numbers}")
        rec = self._cg._CudagraphGlobalRecord
        if rec.cudagraph_created or rec.cudagraph_record:
            raise StateError("enable() must run before the first training step: Megatron has already "
                             "recorded or created its CUDA graphs (call its delete_cuda_graphs() first)")
        if _ACTIVE is not None:
            raise StateError("graphslot's Megatron adapter is already enabled; disable() it first")
        selected = [x for x in found if int(getattr(x, "layer_number", 0)) in chosen]
        for x in selected:
            if getattr(x, "cudagraph_manager", None) is None:
                raise IncompatibleError(f"layer {x.layer_number} has no CUDA graph manager: build the "
                                        "model after setting cuda_graph_impl='local'")
        self.backend = backend or get_backend()
        dev = next((p.device for x in selected for p in x.parameters()), self.backend.device)
        if dev.type != self.backend.device.type:
            raise UsageError(f"the model is on {dev}, but the {self.backend.name} backend runs on "
                             f"{self.backend.device}; set GRAPHSLOT_BACKEND={dev.type}")
        self.engine = OffloadEngine(self.backend, m, min_bytes=min_offload_bytes,
                                    debug_checksums=debug_checksums)
        self.layers = {id(x): _Layer(x, dev.type) for x in selected}
        self.runners: list[_RunnerUnit] = []  # in Megatron's backward order
        self._patches: list[_Patch] = []
        self._created = False
        self._closed = False
        self._last_fwd: _RunnerUnit | None = None
        self._last_bwd: _RunnerUnit | None = None
        self._next_fwd: dict[int, _RunnerUnit | None] = {}
        self._next_bwd: dict[int, _RunnerUnit | None] = {}
        self.pool: PagedPool | None = None
        self._reserved_at_enable = 0
        self._recording_bytes = 0  # allocator bytes Megatron's recording step needed (0: unknown)
        self._graph_runners: dict[int, Any] = {}  # every Megatron runner whose graphs use the pool
        self._release_task: Any = None  # the backward pass a pool release is queued for
        release = (m is Mode.REMAP) if release_graph_pool is None else bool(release_graph_pool)
        try:
            if release:
                self._page_pool()
            for L in self.layers.values():
                L.handles = [L.module.register_forward_pre_hook(self._pre_hook(L)),
                             L.module.register_forward_hook(self._post_hook(L), always_call=True)]
            original = rec.__dict__["create_cudagraphs"]
            owner = self

            def create_cudagraphs(cls: Any) -> Any:
                return owner._create(cls, original)

            self._patches.append(_Patch.set(rec, "create_cudagraphs", classmethod(create_cudagraphs)))
        except BaseException:
            self._undo()
            if self.pool is not None:
                self.pool.close()
            self.engine.close()
            raise
        _ACTIVE = self

    # -- the graph pool -----------------------------------------------------------------

    def _page_pool(self) -> None:
        """Make Megatron's global graph pool a :class:`PagedPool` (see the module docs)."""
        cg, b = self._cg, self.backend
        if not b.capabilities.region_graphs:
            raise IncompatibleError(f"release_graph_pool needs a backend whose graphs draw their pool "
                                    f"from a region; the {b.name} backend's do not (pass "
                                    "release_graph_pool=False)")
        # (Megatron's GTP, which allocates into the pool on its own, is refused by check_config.)
        manager: Any = getattr(cg, "CudaGraphManager", None)
        runner_cls: Any = getattr(cg, "_CudaGraphRunner", None)
        missing = [n for n, ok in (("CudaGraphManager.global_mempool", hasattr(manager, "global_mempool")),
                                   ("_CudaGraphRunner", runner_cls is not None),
                                   ("_GraphStatus", hasattr(cg, "_GraphStatus"))) if not ok]
        if missing:
            raise IncompatibleError(f"Megatron-Core {self.megatron_version}: release_graph_pool needs "
                                    f"{missing} (pass release_graph_pool=False)")
        # VA for the whole device: the pool can never outgrow it, and pages follow use.
        capacity = align_up(b.mem_info()[1], b.granularity)
        pool = PagedPool(b, capacity, worker=getattr(self.engine, "worker", None))
        self.pool = pool
        # What the recording step needs beyond what the model holds now sizes the room
        # mapped ahead of each capture (see _capture_headroom).
        b.empty_cache()
        self._reserved_at_enable = b.allocator_stats(reset_peak=True)["reserved_bytes"] or 0
        patch = self._patches.append
        patch(_Patch.set(manager, "global_mempool", pool.pool_handle))
        # Megatron 0.17+ allocates graph buffers into the pool outside capture and fills them.
        alloc: Any = getattr(cg, "alloc_tensor_from_graph_mempool", None)

        def alloc_tensor_from_graph_mempool(meta: Any) -> Any:
            # Megatron fills the buffer at once: map where torch may put its segment first.
            with pool.allocating(extra=_segment_bound(torch.Size(meta.shape).numel() * meta.dtype.itemsize)):
                return alloc(meta)

        if alloc is not None:
            patch(_Patch.set(cg, "alloc_tensor_from_graph_mempool", alloc_tensor_from_graph_mempool))
        for name in ("create_fwd_graph", "create_bwd_graph"):
            patch(_Patch.set(runner_cls, name, self._creating(pool, getattr(runner_cls, name))))
        patch(_Patch.set(runner_cls, "replay_graph_capture", self._replaying(pool, runner_cls.replay_graph_capture)))

    def _creating(self, pool: PagedPool, create: Callable[..., Any]) -> Callable[..., Any]:
        runners = self._graph_runners
        graph_cls: Any = getattr(getattr(torch, self.backend.device.type, None), "graph", None)
        grows: Any = None
        if isinstance(graph_cls, type):
            owner = self

            class _MappedCapture(graph_cls):  # type: ignore[misc, valid-type]
                """The framework's capture context, with room mapped in the pool for what
                the capture allocates (its copy nodes check their addresses); once the
                capture ends the pool keeps what it used, mapped before Megatron runs
                anything on it (restoring fp8 state, say)."""

                def __enter__(self) -> Any:
                    self._room = pool.headroom(owner._capture_headroom())
                    self._room.__enter__()
                    try:
                        return super().__enter__()
                    except BaseException as e:
                        self._room.__exit__(type(e), e, e.__traceback__)
                        raise

                def __exit__(self, *exc: Any) -> Any:
                    try:
                        out = super().__exit__(*exc)
                    except BaseException as e:
                        if not self._room.__exit__(type(e), e, e.__traceback__):
                            raise
                        return None
                    self._room.__exit__(*exc)
                    return out
            grows = _MappedCapture

        def run(runner: Any, *args: Any, **kwargs: Any) -> Any:
            # Warm-up reads what earlier captures left in the pool; the capture only records.
            runners[id(runner)] = runner
            with pool.allocating(), contextlib.ExitStack() as stack:
                if grows is not None:
                    module = getattr(torch, self.backend.device.type)
                    stack.callback(setattr, module, "graph", module.graph)
                    module.graph = grows
                out = create(runner, *args, **kwargs)
            if not self._cg._CudagraphGlobalRecord.cudagraph_record:
                pool.split_free()  # a graph created outside create_cudagraphs
            return out
        return run

    def _capture_headroom(self) -> int:
        """Pool bytes to map ahead of one capture: what Megatron's recording step needed
        beyond what the model held before it (a capture of one layer allocates no more),
        with a margin; within the device's free memory."""
        free = self.backend.mem_info()[0]
        step = self._recording_bytes
        want = int(1.5 * step) + (512 << 20) if step else free // 2
        return max(0, min(want, free - (1 << 30)))

    def _replaying(self, pool: PagedPool, replay: Callable[..., Any]) -> Callable[..., Any]:
        def run(runner: Any, *args: Any, **kwargs: Any) -> Any:
            pool.acquire()  # before Megatron copies the inputs into the graph's buffers
            return replay(runner, *args, **kwargs)
        return run

    def _queue_pool_release(self, stream: Any) -> None:
        """From a backward replay: once this backward pass is over, give the pool's free
        pages back if no graph then waits for its backward."""
        pool = self.pool
        if pool is None:
            return
        task = getattr(torch._C, "_current_graph_task_id", lambda: None)()
        if task is not None and task == self._release_task:
            return
        self._release_task = task
        ready = self._cg._GraphStatus.FWD_READY
        b = self.backend

        def at_end() -> None:
            self._release_task = None
            if any(r.status is not ready for r in self._graph_runners.values()):
                return  # a forward's backward is still to come: its buffers are in the pool
            events = [b.record_event(b.new_event(), stream), b.record_event(b.new_event())]
            pool.release(after=events)

        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    # -- discovery (Megatron's recording step) ------------------------------------------

    def _discovering(self, module: torch.nn.Module) -> bool:
        cg = self._cg
        return (not cg._CudagraphGlobalRecord.cudagraph_created and not cg.is_graph_capturing()
                and not cg.is_graph_warmup() and torch.is_grad_enabled() and module.training)

    def _pre_hook(self, L: _Layer) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self._discovering(module):
                L.begin()
        return hook

    def _post_hook(self, L: _Layer) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            L.end()
        return hook

    def _remove_hooks(self) -> None:
        for L in self.layers.values():
            for h in L.handles:
                h.remove()
            L.handles = []

    # -- capture -------------------------------------------------------------------------

    def _create(self, rec: Any, original: classmethod) -> Any:
        create = original.__func__  # type: ignore[attr-defined]
        if rec.cudagraph_created or not rec.cudagraph_record:
            return create(rec)
        self._remove_hooks()  # Megatron refuses user forward pre-hooks on replayed layers
        self._prepare(rec.cudagraph_record)
        # From here Megatron's graphs may read the slots: disable() must delete them first,
        # even if this creation fails half way.
        self._created = True
        if self.pool is not None:
            peak = self.backend.allocator_stats()["peak_reserved_bytes"] or 0
            self._recording_bytes = max(0, peak - self._reserved_at_enable)
        result = create(rec)
        self._after_capture()
        if self.pool is not None:
            self.pool.split_free()
        return result

    def _prepare(self, record: list[tuple[Any, ...]]) -> None:
        """Before Megatron captures: a slot per runner, placed in forward order, banks
        alternating in Megatron's backward order."""
        per_layer: dict[int, int] = {}
        # (runner, layer, graph number), in Megatron's backward order
        chosen: list[tuple[Any, _Layer, int]] = []
        first_fwd: dict[int, int] = {}  # id(runner) -> position of its first forward in the record
        for pos, entry in enumerate(record):
            runner, kind = entry[0], entry[1]
            if kind == "fwd":
                first_fwd.setdefault(id(runner), pos)
            L = self.layers.get(id(getattr(runner, "base_module", None)))
            if kind != "bwd" or L is None:
                continue
            missing = [n for n in RUNNER_NEEDS if not hasattr(runner, n)]
            if missing:
                raise IncompatibleError(f"Megatron-Core {self.megatron_version}: graph runner lacks {missing}")
            if not L.layout.recorded:
                raise StateError(f"layer {L.number} ran no training forward while Megatron recorded "
                                 "its graphs, so there is nothing to lay out")
            k = per_layer.get(L.number, 0)
            per_layer[L.number] = k + 1
            chosen.append((runner, L, k))
        # A runner with no recorded forward goes last, in reverse backward order.
        order = sorted(range(len(chosen)), key=lambda i: (first_fwd.get(id(chosen[i][0]), len(record)), -i))
        placed: dict[int, _RunnerUnit] = {}
        banks = ping_pong_banks([True] * len(chosen))  # (chosen is in backward order)
        for i in order:
            runner, L, k = chosen[i]
            unit = OffloadUnit(self.engine, f"layer{L.number}.graph{k}")
            unit.adopt(L.layout)
            bank = banks[i]
            unit.allocate(bank)
            placed[i] = _RunnerUnit(runner, L, unit, bank)
        for i in range(len(chosen)):
            r, runner = placed[i], chosen[i][0]
            self.runners.append(r)
            self._patches.append(_Patch.set(runner, "func", self._capturing(r, runner.func)))
            self._patches.append(_Patch.set(runner, "create_bwd_graph", self._finishing(r, runner.create_bwd_graph)))

    def _capturing(self, r: _RunnerUnit, func: Callable[..., Any]) -> Callable[..., Any]:
        unit, L, b = r.unit, r.layer, self.backend

        def run(*args: Any, **kwargs: Any) -> Any:
            if not b.is_capturing():  # Megatron's warm-up before the capture
                return func(*args, **kwargs)
            with unit.capture_forward(L.keeps):
                return func(*args, **kwargs)
        return run

    @staticmethod
    def _finishing(r: _RunnerUnit, create_bwd: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = create_bwd()
            r.unit.finish_capture()
            return out
        return run

    def _after_capture(self) -> None:
        # Capture is over: the capture wrappers go; replay goes through graphslot.
        keep = []
        for p in self._patches:
            if p.name in ("func", "create_bwd_graph") and not isinstance(p.obj, type):
                p.undo()
            else:
                keep.append(p)
        self._patches = keep
        for r in self.runners:
            if not r.unit.ready:
                raise StateError(f"{r.unit.name}: Megatron captured no backward graph for it")
            self._patches.append(_Patch.set(r.runner, "replay_graph_capture",
                                            self._forward(r, r.runner.replay_graph_capture)))
            self._patches.append(_Patch.set(r.runner, "bwd_graph", _BackwardGraph(self, r, r.runner.bwd_graph)))

    # -- replay ----------------------------------------------------------------------------

    def _forward(self, r: _RunnerUnit, replay: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if r.in_flight is not None:
                raise StateError(f"{r.unit.name}: forward replayed again before its backward")
            grad = torch.is_grad_enabled()
            r.count += 1
            # (a replay that fails gives the slot back: no backward follows it)
            with r.unit.forward(r.count, training=grad, release_on_error=True,
                                prefetch=(lambda: self._saw_forward(r)) if grad else None):
                out = replay(*args, **kwargs)
            if grad:
                r.in_flight = r.count
            return out
        return run

    def _saw_forward(self, r: _RunnerUnit) -> OffloadUnit | None:
        """Learn the schedule from the step before: which offloaded runner ran next; its
        unit, to make its slot writable ahead (remap: map it)."""
        if self._last_bwd is not None:
            self._next_bwd[id(self._last_bwd)] = None  # a forward came between: no look-ahead
            self._last_bwd = None
        if self._last_fwd is not None:
            self._next_fwd[id(self._last_fwd)] = r
        self._last_fwd = r
        nxt = self._next_fwd.get(id(r))
        return None if nxt is None else nxt.unit

    def _backward(self, r: _RunnerUnit, graph: Any) -> None:
        if r.in_flight is None:
            raise StateError(f"{r.unit.name}: backward graph replayed with no forward pending")
        # Look-ahead: the runner whose backward came next the step before restores under
        # this replay (each runner counts its own forwards: its key, not this one's).
        nxt = self._next_bwd.get(id(r))
        ahead = nxt if nxt is not None and nxt is not r and nxt.in_flight is not None else None
        with r.unit.backward(r.in_flight, ahead=None if ahead is None else ahead.unit,
                             ahead_microbatch=None if ahead is None else ahead.in_flight):
            graph.replay()  # (the pool is mapped: no release while a runner awaits its backward)
        self._queue_pool_release(self.backend.current_stream())
        r.in_flight = None
        if self._last_fwd is not None:
            self._next_fwd[id(self._last_fwd)] = None
            self._last_fwd = None
        if self._last_bwd is not None:
            self._next_bwd[id(self._last_bwd)] = r
        self._last_bwd = r

    # -- inspection and teardown -------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self.engine.mode

    def report(self) -> dict[str, Any]:
        """Slots, banks and byte counts, as plain data (JSON-ready)."""
        te = sys.modules.get("transformer_engine")
        return {
            "megatron_core": self.megatron_version,
            "transformer_engine": getattr(te, "__version__", None) if te is not None else None,
            "backend": self.backend.name,
            "mode": self.mode.value,
            "layers": sorted(L.number for L in self.layers.values()),
            "graphs_created": self._created,
            "runners": [{"group": r.unit.name, "layer": r.layer.number, "bank": r.bank,
                         "saved_tensors": r.unit.saved_tensors, "slot_bytes": r.unit.slot_bytes,
                         "offloaded_bytes": r.unit.offloaded_bytes,
                         "kept_subclass_tensors": dict(r.layer.kept)} for r in self.runners],
            "mapped_bytes": self.backend.ledger.mapped_bytes,
            "peak_mapped_bytes": self.backend.ledger.peak_mapped_bytes,
            "peak_allocated_bytes": self.backend.ledger.peak_allocated_bytes,
            "stats": dict(self.engine.stats),
            "graph_pool": self.pool.report() if self.pool is not None else None,
        }

    def drain(self) -> None:
        """Wait until the driver work queued so far ran: after a step, the graph pool's
        release (which otherwise finishes on its own, shortly after the step's last
        backward pass) is then done, e.g. before reading device memory."""
        w = getattr(self.engine, "worker", None)
        if w is not None:
            w.drain()
        if self.pool is not None:
            self.pool.drain()

    def _undo(self) -> None:
        self._remove_hooks()
        for p in reversed(self._patches):
            p.undo()
        self._patches = []

    def disable(self) -> None:
        """Restore everything :func:`enable` touched and release the slots (idempotent).

        After Megatron created its graphs this deletes them (they read graphslot's slots)
        with Megatron's ``delete_cuda_graphs()``; the next step captures them again.
        """
        global _ACTIVE
        if self._closed:
            return
        busy = [r.unit.name for r in self.runners if r.in_flight is not None]
        if busy:
            raise StateError(f"cannot disable with microbatches in flight (forward without backward: {busy})")
        self._undo()
        if self.pool is not None:
            self.pool.acquire()
        if self._created:
            self._cg.delete_cuda_graphs()
        if self.pool is not None:
            still = self.pool.close()
            if still:
                # Megatron's runners still hold graph buffers in the pool. Nothing replays
                # from it or allocates in it any more: keep the chunks those buffers live in
                # mapped, give the free ones back for good.
                self.pool.release()
                self.pool.drain()
                _KEPT_POOLS.append(self.pool)
                warnings.warn(f"graphslot: tensors still hold bytes of Megatron's graph pool after "
                              f"disable(); {self.pool.mapped_bytes} bytes of it stay mapped",
                              stacklevel=2)
        self.engine.close()
        self._closed = True
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> MegatronOffload:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()


def enable(model: Any, **kwargs: Any) -> MegatronOffload:
    """Offload the activations of ``model``'s graphed layers through graphslot slots.

    Args:
        model: the Megatron-Core model (or its list of chunks) with local CUDA graphs.
        **kwargs: the arguments of :class:`MegatronOffload`.

    Returns:
        The active :class:`MegatronOffload` (one may be active at a time).

    Raises:
        IncompatibleError, UsageError: as :class:`MegatronOffload` raises them.
    """
    return MegatronOffload(model, **kwargs)


def disable() -> None:
    """Disable the active :class:`MegatronOffload`, if any."""
    if _ACTIVE is not None:
        _ACTIVE.disable()


def active() -> MegatronOffload | None:
    """The enabled :class:`MegatronOffload`, or None."""
    return _ACTIVE
