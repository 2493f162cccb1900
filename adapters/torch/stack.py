"""Plain PyTorch: a stack of layers as graphed callables with activation offload.

    from graphslot.adapters.torch import GraphedLayers

    stack = GraphedLayers(blocks, sample_input, mode="resident")   # or "remap", "off"
    for batch in data:
        loss = head(stack(embed(batch))).mean()
        loss.backward()
        opt.step(); opt.zero_grad()

Each layer, or each run of consecutive small layers (``layers_per_graph``), gets a
forward and a backward device graph, in the spirit of ``torch.cuda.make_graphed_callables``
(which graphs each callable alone). Saved activations go through graphslot slots:
the backward graph reads them at a fixed address, and between forward and backward
they wait on the host (``resident``: two banks per size class, mapped for good, no driver
calls; ``remap``: one bank where slots stream in sections, its pages released whenever
nothing is in flight). ``off`` graphs without offload.

What the graphs hold, and why it is no more than torch's own graphed callables:

* Layer boundaries are chained: layer ``i + 1`` is captured reading layer ``i``'s static
  output, and layer ``i``'s backward reading layer ``i + 1``'s static input gradient, so
  no activation or gradient is copied or cloned between layers. Only the stack's own
  input, output and their gradients are copied, once per step.
* Parameter gradients are the backward graphs' static buffers: after a backward with
  ``.grad`` unset, ``.grad`` *is* that buffer (no second copy). A backward that finds
  ``.grad`` still being that buffer (gradient accumulation, ``zero_grad(set_to_none=False)``)
  first gives ``.grad`` bytes of its own (the same tensor object) and lets autograd add
  into it, as eagerly; the result is bitwise eager's. A parameter shared by several
  layers, or one with tensor hooks, gets its gradient as a copy, so autograd sums and
  hooks run as in eager. A ``.grad`` someone still holds after
  ``zero_grad(set_to_none=True)`` is moved out of the buffer before the next backward
  overwrites it, and that parameter is copied from then on.
* ``main_grad=True`` (Megatron and TransformerEngine style): the backward graph adds each
  parameter's gradient into its ``main_grad``, in the graph, as each arrives, and frees it
  at once; ``.grad`` is left as it is. ``main_grad`` is then the only gradient storage, and
  a kept or accumulated gradient costs no copy (``p.grad = p.main_grad`` makes ``.grad``
  that storage). Without it, a ``.grad`` kept across a forward costs one copy of the
  gradients: the buffers' pool memory is what the next forward writes.
* Capture-time autograd graphs are dropped once the backward graphs exist, so training
  builds its own gradient accumulators on the training stream.

Parameters and buffers are never offloaded. Several microbatches may be in flight before
their backward on every layer: offloaded layers keep each microbatch in the engine's
host buffers; layers whose activations stay on the device keep the newest microbatch in
the graph's own memory and move older ones to device buffers of their own only when
another microbatch's graphs are about to run (the engine's ``KeptOnDevice`` residency:
every layer has an offload group, kept on the device or offloaded). Gradient
accumulation, ``loss.backward()``
and any optimizer work as usual. A forward under ``torch.no_grad()`` offloads nothing.

Limits, as for device graphs in general: each layer takes one tensor and returns one
tensor of fixed shape, dtype and device; no host synchronisation or data-dependent
shapes inside a layer. Random ops (dropout) draw fresh numbers at every replay, from the
default generator as in eager; a recomputed layer draws, in its backward, the very
numbers its forward drew for that microbatch (a random stream of its own, pointed where
the forward drew, where the backend has one: :meth:`~graphslot.backend.Backend.new_rng_stream`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
import time
import warnings
import weakref
from dataclasses import replace
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence

import torch
from torch import nn

from graphslot.backend import Backend, DeviceGraph, align_up
from graphslot.budget import (OFFLOAD, RECOMPUTE, RECOMPUTE_CHEAP, RECOMPUTE_PARTS, BudgetPlan,
                              StackProfile, banks_bytes, fit_budget, gradient_homes,
                              has_gradient_homes, parse_budget, refusal_message)
from graphslot.errors import BudgetError, CaptureMismatchError, StateError, UsageError
from graphslot.layer_calls import check_passes_gradient
from graphslot.memory import release_unused, saved_bytes_per_layer
from graphslot.offload import SECTION_BYTES, Mode, OffloadEngine, ping_pong_banks
from graphslot.optimizer_state import StateWatch, state_to_come
from graphslot.precision import autocast_dtype
from graphslot.profile import copy_bandwidth, held_bytes, profile_units
from graphslot.recompute import checkpointing_parts, recompute_parts
from graphslot.selection import get_backend
from graphslot.sizes import format_bytes, whole_count

from .grads import ParamGrad, storage_id
from .pages import PoolPages
from .plan import (check_layers, check_main_grads, check_sample, HookWatch, hooked_modules, layer_set,
                   param_name, plan_graphs, unit_label)
from .runner import GraphRunner, LayerFunction, own_generators, restoring_contents

__all__ = ["GraphedLayers"]


class _Host:
    """A stack's side of its runners (:class:`~.runner.StackHost`): its bookkeeping under
    the names a runner uses, so the runner reads nothing private of the stack."""

    __slots__ = ("_stack",)

    def __init__(self, stack: GraphedLayers) -> None:
        self._stack = stack

    @property
    def warmup_stream(self) -> Any:
        return self._stack._warmup_stream

    @property
    def grad_homes(self) -> bool:
        return self._stack._grad_homes

    @property
    def lent(self) -> dict[int, list[ParamGrad]]:
        return self._stack._lent

    @property
    def in_backward(self) -> set[int]:
        return self._stack._in_backward

    @property
    def runners(self) -> list[GraphRunner]:
        return self._stack._runners

    @property
    def abandoned(self) -> collections.deque[int]:
        return self._stack._abandoned

    @property
    def ctx_overwritten(self) -> dict[int, str]:
        return self._stack._ctx_overwritten

    @property
    def tracing(self) -> bool:
        return self._stack.engine.timeline is not None or self._stack.probe is not None

    @property
    def closed(self) -> bool:
        return self._stack._closed

    def at_end_of_pass(self, mb: int) -> None:
        self._stack._at_end_of_pass(mb)

    def new_graph(self) -> DeviceGraph:
        return self._stack._new_graph()

    def capture_room(self) -> ContextManager[None]:
        return self._stack._capture_room()

    def replaying(self, kind: str, index: int) -> None:
        self._stack._replaying(kind, index)

    def give_back(self, layer: int | None) -> None:
        self._stack._give_back(layer)

    def next_forward(self, index: int) -> GraphRunner | None:
        return self._stack._ahead[index]

    def next_backward(self, index: int) -> GraphRunner | None:
        return self._stack._behind[index]

    def span(self, name: str) -> Any:
        tl = self._stack.engine.timeline
        return contextlib.nullcontext() if tl is None else tl.span("compute", name)

    def enter(self, token: object) -> None:
        self._stack._enter(token)

    @property
    def inside(self) -> dict[object, int]:
        return self._stack._inside

    def left(self) -> None:
        self._stack._left()

    def reap(self) -> None:
        self._stack._reap()

    def saw_kept_grad(self) -> None:
        self._stack._saw_kept_grad()

    def lend_input_grad(self, buf: torch.Tensor, input_ref: weakref.ref[torch.Tensor] | None
                        ) -> torch.Tensor:
        return self._stack._lend_input_grad(buf, input_ref)


class GraphedLayers(nn.Module):
    """Run ``layers`` in sequence as graphed callables with slot-based activation offload.

    Args:
        layers: the modules, applied in order; each maps one tensor to one tensor.
        sample_input: an input of the exact shape, dtype and device the stack will see
            (``requires_grad`` as at run time).
        mode: ``"resident"`` (the default without a budget: two banks per size class of
            slots, mapped for good, zero driver calls per step), ``"remap"`` (least memory:
            one bank per size class where slots stream in sections, mapped only while a
            pass is in flight) or ``"off"``. With ``memory_budget``, the planner picks it
            unless it is given (``"off"``: keep or recompute, never offload); a plan that
            offloads nothing runs, and says it runs, as ``"off"`` whatever mode was given.
        min_offload_bytes: saved tensors smaller than this stay on the device.
        section_bytes: slots move to and from the host in sections of at most this many
            bytes (:data:`graphslot.offload.SECTION_BYTES`), each fenced on its own inside
            the graphs where the backend allows.
        offload_layers: indices of the layers whose activations are offloaded
            (default: every layer not in ``recompute_layers``); the others keep theirs on
            the device. Not with ``mode="off"``, which offloads nothing.
        recompute_layers: indices of the layers recomputed in the backward: the forward
            graph saves only the layer's input, and the backward graph runs the forward
            again (``torch.utils.checkpoint`` captured inside the graphs). A layer also in
            ``offload_layers`` sends that input to the host.
        recompute_ops: what ``recompute_layers`` run again: ``"all"`` (the default: the
            whole forward, keeping only the input), ``"cheap"`` (only the cheap ops:
            norms, activation functions, casts and other elementwise work; the outputs of
            matrix products, attention and convolutions are kept on the device, in the
            graphs' pool; see :mod:`graphslot.recompute`) or ``"parts"`` (the whole
            forward, one part at a time: each child of the layer, its attention, MLP and
            norms say (:func:`graphslot.recompute.recompute_parts`), is checkpointed on its
            own, so the forward saves what each part is given and the backward holds one
            part's activations at a time; not for a layer that draws random numbers or
            changes its buffers). A layer recomputed cheaply keeps its input on the device
            (not in ``offload_layers``); one recomputed by parts in ``offload_layers``
            sends its parts' inputs to the host. With ``memory_budget`` the planner
            chooses per layer (``plan.recompute_ops``).
        memory_budget: bytes the training step may hold at its peak (the framework
            allocator's reserved bytes plus graphslot's pages, counting what the device
            holds when the stack is built; where the allocator keeps no figures, as on
            cpu, the process's footprint), a size string (``"12GiB"``), or ``"auto"``
            (save memory only where the planner predicts it costs no time, and then
            only a saving of at least a hundredth of the peak). The stack
            measures its layers (:mod:`graphslot.profile`) and plans each graph's layers
            kept, offloaded or recomputed, then checks what its build holds against the
            budget and plans again where the graphs hold more or less than predicted
            (:func:`graphslot.budget.fit_budget`); a budget the model calls too small has
            its least plan built before it is refused. ``plan`` says what was chosen. What the
            step makes outside the stack after the build (the loss, the output's
            gradient) comes on top. Not with ``offload_layers`` or ``recompute_layers``.
        layers_per_graph: how many consecutive layers each device graph covers. ``None``
            (the default) joins consecutive layers while what their forwards save for
            backward stays within :data:`JOIN_BYTES` together, so a stack of small layers
            replays a few graphs, each with one offload copy each way, instead of one
            graph and copy per layer; a layer that saves more gets a graph of its own. An
            integer takes that many at a time. Layers of different choices (kept,
            offloaded, recomputed) never share a graph. ``graph_layers`` says what was
            chosen.
        warmup_iters: eager iterations before capture (at least one runs: 0 means one).
        backend: the graphslot backend (default: :func:`graphslot.get_backend`).
        debug_checksums: verify a checksum of every restored activation (slow).
        main_grad: accumulate each parameter's gradient into its ``main_grad`` attribute,
            inside the backward graph (``main_grad.add_(grad)``, as Megatron-Core and
            TransformerEngine do, e.g. bf16 gradients into fp32 ``main_grad``); ``.grad``
            stays as it is (None, as Megatron keeps it), so ``main_grad`` is the only
            gradient storage and the graphs' pool keeps no gradient buffers. Every
            trainable parameter must carry a ``main_grad`` of its shape on its device,
            kept in place for the stack's life (zero it in place), and belong to one
            graph; post-accumulate-grad hooks still run once per backward, tensor hooks
            (``register_hook``) cannot. The parameters' gradients do not reach autograd
            (``torch.autograd.grad`` gets none), and a parameter also used outside the
            stack gets only the stack's part in ``main_grad``.
        keep_grads: the training loop keeps ``.grad`` through the next forward: it
            accumulates microbatches into it, or zeroes it in place
            (``zero_grad(set_to_none=False)``). The gradients then get homes of their own,
            which the backward graphs add into, so a kept ``.grad`` is their only copy
            (without, where the layers keep activations in the graphs' pool, the gradient
            buffers share that memory and a kept one is copied out of it at the next
            forward), and a memory budget's plan counts them as held for the whole step.
            With a budget and without ``keep_grads``, a ``.grad`` kept through a forward
            that takes the step over the budget is named in a warning.
        share_pool_pages: put the graphs' pool on graphslot's pages and, once the build is
            done, back pages that are never live at the same time with one physical page
            each (:mod:`graphslot.adapters.torch.pages`): the pool then holds about what its
            blocks need at their highest, not every segment its captures made. Safe while
            the graphs replay in the order they were captured (each microbatch's backward
            before the next forward); a step that leaves that order gives every page its
            own memory back first, with a warning. Needs a backend whose graphs draw their
            pool from a region (cpu, cuda); on cuda it records torch's allocator history
            during the build (it refuses to start where that history is being recorded).
            A stack dropped without ``close()`` keeps its pool until the next stack on
            shared pages is built or closed.

    Raises:
        BudgetError: a budget below the least any plan reaches (the message names that
            least peak and a budget that fits it, with room for what the process holds
            moving between builds; ``least_bytes`` holds that budget).
        UsageError: no layers, a sample that is not a tensor on the backend's device, a
            bad layer index or mode, a budget beside explicit layer lists, or
            with ``main_grad=True`` a parameter without a fitting ``main_grad``, with
            tensor hooks, or in several graphs.

    ``close()`` releases its slots, banks and host buffers; as a context manager
    (``with GraphedLayers(...) as stack:``) it closes on exit. ``stack[i]``, ``len(stack)``
    and iterating give its layers, as an ``nn.Sequential`` of them would.
    """

    def __init__(self, layers: Sequence[nn.Module], sample_input: torch.Tensor, *,
                 mode: Mode | str | None = None, min_offload_bytes: int = 0,
                 section_bytes: int = SECTION_BYTES,
                 offload_layers: Iterable[int] | None = None,
                 recompute_layers: Iterable[int] | None = None,
                 recompute_ops: str = "all",
                 memory_budget: int | str | None = None,
                 layers_per_graph: int | None = None, warmup_iters: int = 2,
                 backend: Backend | None = None, debug_checksums: bool = False,
                 main_grad: bool = False, keep_grads: bool = False,
                 share_pool_pages: bool = False) -> None:
        super().__init__()
        check_layers(layers)
        hooked = hooked_modules(list(layers))
        if hooked:
            warnings.warn(
                f"GraphedLayers: {', '.join(hooked[:3])}{' and others' if len(hooked) > 3 else ''} "
                "have module hooks. They run while the graphs are built, not at each replay: "
                "their tensor work is captured into the graphs, their Python side effects "
                "(logging, counting, changing state) happen only at build", stacklevel=2)
        # The layers are this module's children by index, as in nn.Sequential, and not
        # under a child of their own: the stack put where a Sequential or ModuleList of
        # them was leaves the model's state_dict keys as they were, so checkpoints load
        # from eager training into graphed training and back.
        for i, m in enumerate(layers):
            self.add_module(str(i), m)
        #: the layers, in order (the same modules; not registered a second time)
        self.layers: nn.ModuleList
        object.__setattr__(self, "layers", nn.ModuleList(layers))
        self.backend = backend or get_backend()
        check_sample(sample_input, self.backend)
        #: the backward graphs add into the parameters' ``main_grad`` (see ``main_grad``)
        self.main_grad = bool(main_grad)
        self._grad_homes = False  # (decided per build, in _make)
        if self.main_grad:
            check_main_grads(self.layers)
        if not isinstance(keep_grads, bool):
            raise UsageError(f"keep_grads must be True or False, got {keep_grads!r}")
        #: the training loop keeps ``.grad`` through the next forward (see ``keep_grads``)
        self.keep_grads = keep_grads
        if not isinstance(share_pool_pages, bool):
            raise UsageError(f"share_pool_pages must be True or False, got {share_pool_pages!r}")
        if share_pool_pages and not self.backend.capabilities.region_graphs:
            raise UsageError(f"share_pool_pages=True needs graphs whose pool is a graphslot region; "
                             f"the {self.backend.name} backend's are not")
        #: the graphs' pool is on graphslot's pages, shared by when they are live (see
        #: ``share_pool_pages``)
        self.share_pool_pages = share_pool_pages
        self._pages: PoolPages | None = None
        n = len(self.layers)
        if memory_budget is not None and (offload_layers is not None or recompute_layers is not None):
            raise UsageError("memory_budget plans which layers to offload and recompute: give "
                             "it, or offload_layers / recompute_layers, not both")
        recompute = layer_set("recompute_layers", [] if recompute_layers is None else recompute_layers, n)
        offload = layer_set("offload_layers", (set(range(n)) - recompute) if offload_layers is None
                            else offload_layers, n)
        if recompute_ops not in ("all", "cheap", "parts"):
            raise UsageError(f"recompute_ops must be 'all', 'cheap' or 'parts', got {recompute_ops!r}")
        if recompute_ops != "all" and memory_budget is not None:
            raise UsageError("recompute_ops is for recompute_layers; with memory_budget the "
                             "planner chooses what each recomputed layer runs again")
        if recompute_ops != "all" and not recompute:
            raise UsageError(f"recompute_ops={recompute_ops!r} says what recompute_layers run "
                             "again, and recompute_layers names none: name the layers to recompute")
        cheap = set(recompute) if recompute_ops == "cheap" else set()
        parts = set(recompute) if recompute_ops == "parts" else set()
        no_parts = [i for i in sorted(parts) if not recompute_parts(self.layers[i])]
        if no_parts:
            raise UsageError(f"recompute_ops='parts': layer {no_parts[0]} "
                             f"({type(self.layers[no_parts[0]]).__name__}) has no parts to "
                             "recompute one at a time (no module in it has two children or "
                             "more): recompute it whole (recompute_ops='all')")
        if cheap & offload:
            raise UsageError(f"layers {sorted(cheap & offload)} are recomputed cheaply, which "
                             "keeps their input on the device, and in offload_layers too")
        min_offload_bytes = whole_count(min_offload_bytes, "min_offload_bytes", of=" of bytes")
        section_bytes = whole_count(section_bytes, "section_bytes", least=1, of=" of bytes")
        warmups = whole_count(warmup_iters, "warmup_iters")
        if layers_per_graph is not None:
            try:
                layers_per_graph = whole_count(layers_per_graph, "layers_per_graph", least=1)
            except UsageError:
                raise UsageError(f"layers_per_graph must be a positive integer or None (join "
                                 f"small layers), got {layers_per_graph!r}") from None
        if mode is not None and mode not in tuple(m.value for m in Mode):
            raise UsageError(f"mode must be one of {', '.join(repr(m.value) for m in Mode)} "
                             f"or None, got {mode!r}")
        if mode == Mode.OFF.value and offload_layers is not None and offload:
            raise UsageError(f"mode='off' offloads nothing, and offload_layers names layers "
                             f"{sorted(offload)}: give mode 'resident' or 'remap' to offload "
                             "them, or leave offload_layers out")
        modes = tuple(m.value for m in Mode) if mode is None else (Mode(mode).value,)
        self._engine_args: dict[str, Any] = dict(
            min_bytes=min_offload_bytes, section_bytes=section_bytes, debug_checksums=debug_checksums)
        self.warmup_iters = max(1, warmups)  # (the build's checks read one eager iteration)
        self._microbatch = 0
        #: the layers each device graph covers, in order (see ``layers_per_graph``)
        self.graph_layers: tuple[tuple[int, ...], ...] = ()
        #: what ``memory_budget`` chose (:class:`graphslot.budget.BudgetPlan`, choices per
        #: layer); None without a budget
        self.plan: BudgetPlan | None = None
        self._warned_kept_grads = False
        self._runners: list[GraphRunner] = []
        #: called with a label after each layer's forward and backward replay (for probes)
        self.probe: Callable[[str], None] | None = None
        # One private pool for every graph, captured in replay order (all forwards, then
        # the backwards in reverse), as torch.cuda.make_graphed_callables does: memory a
        # graph frees at capture is reused only by graphs that replay after it.
        self._pool_owner: DeviceGraph | None = None
        # The backend's one side stream for every warm-up of every stack: libraries keep
        # per-stream state for the process's life (cuBLAS a workspace of tens of MiB for
        # each stream and thread), so a stream of the stack's own would leave that behind
        # with each stack built.
        self._warmup_stream = self.backend.side_stream()
        #: gradient buffers handed out as .grad since the last replay that could overwrite them
        self._lent: dict[int, list[ParamGrad]] = {}  # by layer
        #: the first layer's input gradient buffer, lent as the stack's input gradient
        self._input_grad: ParamGrad | None = None
        self._lock = threading.Condition()
        #: forwards and backwards under way, each under a token of its own, to the thread
        #: running it (close() waits for them; another thread is refused meanwhile)
        self._inside: dict[object, int] = {}
        self._in_backward: set[int] = set()  # microbatches whose backward pass has begun
        #: microbatches whose ctx-kept tensors (``GraphRunner.ctx_made``) a later forward
        #: overwrote, with what their backward is refused with
        self._ctx_overwritten: dict[int, str] = {}
        self._closed = False
        #: with a memory budget: warns where an optimizer's state outgrows what the plan counted
        self._state_watch: StateWatch | None = None
        #: microbatches whose autograd graph died without a backward (appended by finalizers)
        self._abandoned: collections.deque[int] = collections.deque()
        #: the autocast dtype the graphs were captured under on the stack's device type
        #: (None: without autocast); every forward must run under the same
        self.autocast_dtype = autocast_dtype(self.backend.device.type)
        # Warm-ups, the profile and captures run the layers' forwards: the buffers they
        # change (batch norm's running statistics) are put back after the build, and the
        # random numbers they draw come from a fork of the generators, so the stack starts
        # from the state the layers and the caller's seed came with, as eager would.
        own = own_generators(self.layers)
        versions = [(name, p, p._version) for name, p in self.layers.named_parameters()]
        with restoring_contents(list(self.layers.buffers()), wait_first=self.backend.synchronize), \
                _building(self.backend.device, self.autocast_dtype, own):
            try:
                saved = None if layers_per_graph is not None else saved_bytes_per_layer(
                    list(self.layers),
                    sample_input.detach().requires_grad_(sample_input.requires_grad))
                if memory_budget is None:
                    self._make(Mode(modes[0]) if mode is not None else Mode.RESIDENT, offload,
                               recompute, layers_per_graph, saved, sample_input, cheap, parts)
                else:
                    self._make_planned(memory_budget, modes, layers_per_graph, saved,
                                       sample_input, section_bytes)
            except BaseException:
                self._unmake()  # what the failed build made goes before the error does
                self._warmup_stream = None
                raise
        # Parameters are not copied back as buffers are (a copy of every weight would cost
        # what the model does): one the layers' forwards change in place is named instead.
        changed = [name for name, p, version in versions if p._version != version]
        if changed:
            warnings.warn(
                f"GraphedLayers: the layers' forwards changed parameter{'s' if len(changed) > 1 else ''} "
                f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} in place while the "
                "stack was built (nn.Embedding(max_norm=...) renormalises the rows it reads, for "
                "one): the build ran those forwards on its sample input, which eager training "
                "would not have, so the parameters differ from before the build. Load the "
                "weights to train from after the build (load_state_dict copies them in place, "
                "where the graphs read them)", stacklevel=2)
        #: the module hooks as captured (after the build: a lazy module drops its own in
        #: its first forward): one added or removed since is refused at a graphed forward
        self._hook_watch = HookWatch(self.layers)
        #: each layer module's ``training`` flag as captured: a forward with any other
        #: (``model.eval()`` for validation) runs the layers eagerly, as the graphs hold
        #: the captured mode's dropout and batch statistics
        self._captured_modes = [(m, m.training) for m in self.layers.modules()]
        #: where each parameter and buffer lay when the graphs were captured: they read
        #: that memory, so a tensor put elsewhere since is refused at the next forward
        #: (and each parameter is the object the graphs' backward hands its gradient to)
        self._captured_at = [(tensors, name, t, t.data_ptr(), f"{prefix}.{name}")
                             for prefix, m in self.layers.named_modules()
                             for tensors in (m._parameters, m._buffers)
                             for name, t in tensors.items() if t is not None]
        # Frozen at the build: the backward graphs compute no gradient for these
        frozen = {id(p): (p, f"{prefix}.{name}") for prefix, m in self.layers.named_modules()
                  for name, p in m._parameters.items() if p is not None and not p.requires_grad}
        self._frozen_at_build = list(frozen.values())
        self._warned_mode = False
        # Dropped without close(): the pages, host buffers and threads go with the stack.
        self._finalizer = (weakref.finalize(self, OffloadEngine.close, self.engine)
                           if self._pages is None else
                           weakref.finalize(self, _close_paged, self._pages, self.engine))
        self._finalizer.atexit = False
        # Each layer's look-ahead targets, once: a pass asks for them at every layer.
        offloaded = [r for r in self._runners if r.unit.offloads]
        n = len(self._runners)
        self._ahead: list[GraphRunner | None] = [
            next((r for r in offloaded if r.index > i), None) for i in range(n)]
        self._behind: list[GraphRunner | None] = [
            next((r for r in reversed(offloaded) if r.index < i), None) for i in range(n)]

    def _make(self, mode: Mode, offload: set[int], recompute: set[int],
              layers_per_graph: int | None, saved: list[int] | None, sample: torch.Tensor,
              cheap: frozenset[int] | set[int] = frozenset(),
              parts: frozenset[int] | set[int] = frozenset(), homes: bool | None = None) -> None:
        """Build the engine, the graphs' plan and every graph (``homes``: whether the
        gradients get homes of their own, as a plan's model said; measured where None)."""
        self.offload_layers, self.recompute_layers = set(offload), set(recompute)
        #: the recomputed layers that run only their cheap ops again (``recompute_ops``)
        self.cheap_layers = set(cheap)
        #: the recomputed layers that run their forward again part by part (``recompute_ops``)
        self.parts_layers = set(parts)
        self._grad_homes = not self.main_grad and (
            self._homes_pay(mode, saved, sample) if homes is None else homes)
        self.engine = OffloadEngine(self.backend, mode, **self._engine_args)
        self.graph_layers = plan_graphs(len(self.layers), self.offload_layers, layers_per_graph,
                                        saved, recomputed=self.recompute_layers,
                                        cheap=self.cheap_layers, parts=self.parts_layers,
                                        tied=self._tied())
        host = _Host(self)
        self._runners = [GraphRunner(self, host, k, ls) for k, ls in enumerate(self.graph_layers)]
        if self.share_pool_pages:
            # (a layer's backward capture takes about twice what its forward saves)
            self._pages = PoolPages(self.backend, room_bytes=2 * max(saved or [0]))
            with self._pages.building():
                self._build(sample)
        else:
            self._build(sample)

    def _homes_pay(self, mode: Mode, saved: list[int] | None, sample: torch.Tensor) -> bool:
        """Does this build give gradients homes outside the pool (:class:`GradHome`)?
        :func:`graphslot.budget.gradient_homes` says, from what the layers keep in the
        graphs' pool (``saved``, measured) against the gradients' bytes."""
        # (a layer recomputed cheaply, or by parts with their inputs on the device, keeps
        # part of what it saves: counted as kept, a cheap one in full, as an unplanned
        # build does not measure what its expensive ops keep)
        gone = ((self.recompute_layers - self.cheap_layers - self.parts_layers)
                | (self.offload_layers if mode is not Mode.OFF else set()))
        kept = [i for i in range(len(self.layers)) if i not in gone]
        if not kept or self.keep_grads:
            return True
        parts = self.parts_layers & set(kept)
        if saved is None or parts:
            # (layers_per_graph given: not measured for joining layers; a layer recomputed
            # by parts keeps what its parts are given: counted so)
            def around(i: int) -> ContextManager[Any]:
                return checkpointing_parts(recompute_parts(self.layers[i]) if i in parts else [])

            saved = saved_bytes_per_layer(list(self.layers),
                                          sample.detach().requires_grad_(sample.requires_grad),
                                          around)
        params = {id(p): p for m in self.layers for p in m.parameters() if p.requires_grad}
        grads = sum(p.numel() * p.element_size() for p in params.values())
        return gradient_homes(sum(saved[i] for i in kept), grads)

    def _unmake(self) -> None:
        """Give back what :meth:`_make` built (the graphs, their pool, slots and banks)."""
        engine = getattr(self, "engine", None)
        pages, self._pages = self._pages, None
        self._runners = []
        self._ahead, self._behind = [], []
        self._pool_owner = None
        self._lent.clear()
        self._input_grad = None
        try:
            if pages is not None:
                gc.collect()  # (the runners' buffers are the pool's: gone before it closes)
                pages.close()
        finally:
            if engine is not None:
                engine.close()
        release_unused(self.backend)

    def _make_planned(self, budget: int | str, modes: tuple[str, ...], layers_per_graph: int | None,
                      saved: list[int] | None, sample: torch.Tensor, section_bytes: int) -> None:
        """Profile the stack, plan the budget and build, checking what each build holds
        (:func:`~graphslot.budget.fit_budget`: where the graphs hold more or less than the
        model said, the difference is counted and the plan made again)."""
        b, n = self.backend, len(self.layers)
        if not (isinstance(budget, str) and budget.strip().lower() == "auto"):
            parse_budget(budget)  # (a bad one fails before any work)
        units = plan_graphs(n, set(), layers_per_graph, saved, tied=self._tied())
        # torch's optimizers make their state at their first step: what the process's
        # optimizers will still make on this device (for the layers' parameters and any
        # other, the budget being the process's) is counted as held from the start
        count = state_to_come(b.device)
        pending = count.pending
        profile = self._profile(units, sample, section_bytes, pending)
        builds = 0

        def build(plan: BudgetPlan) -> int | None:
            nonlocal builds
            if builds:
                self._unmake()
            builds += 1
            self.plan = _per_layer(plan, units)
            recomputed = set(self.plan.layers(RECOMPUTE))
            cheap = set(self.plan.layers(RECOMPUTE_CHEAP))
            parts = set(self.plan.layers(RECOMPUTE_PARTS))
            # (in a mode that offloads, a recomputed layer's input goes to the host too,
            # unless it is recomputed cheaply; by parts, what its parts are given)
            offloaded = set(self.plan.layers(OFFLOAD)) | (recomputed - cheap if plan.mode != "off"
                                                          else set())
            # (gradient homes as the model counted them: it knows what a cheaply recomputed
            # layer keeps, which the build would have to measure again)
            self._make(Mode(plan.mode), offloaded, recomputed, layers_per_graph, saved, sample,
                       cheap, parts, has_gradient_homes(profile, plan.detailed, plan.mode))
            release_unused(b)
            held = _build_holds(b)
            if held is None:
                return None  # the backend cannot tell: the model's figure stands
            # What the step adds to what the build holds: the banks it has not mapped now
            # (remap maps them only while a pass runs), and the copy of the output the
            # caller gets, as far as the allocator needs memory for it.
            banks = banks_bytes(profile, plan.detailed, plan.mode)
            unmapped = max(0, banks - self.engine.mapped_bytes)
            return held + unmapped + self._output_copy_bytes(held) + pending

        try:
            plan = fit_budget(profile, budget, build, measured=_build_holds(b) is not None,
                              modes=modes)
        except BudgetError as e:
            # What a process holds moves a little between builds (a granule of the
            # allocator, tens of KiB of the host's heap): the figure given back is one that
            # builds again, the least peak with that much room, in whole granules.
            # (a process's footprint, where the allocator keeps no figures, moves by MiBs:
            # the host's heap keeps what it freed as it likes)
            g = b.granularity
            moves = (1 << 20) if held_bytes(b) is not None else (4 << 20)
            room = align_up(e.least_bytes + max(2 * g, moves), g)
            # (the least plan named per layer, as stack.plan names a plan)
            least = _per_layer(e.least_plan, units) if isinstance(e.least_plan, BudgetPlan) else None
            said = str(e) if least is None else refusal_message(e.budget_bytes, least)
            pages = ("; share_pool_pages=True may fit less: the graphs' pool then holds what "
                     "its blocks need at once" if not self.share_pool_pages
                     and b.capabilities.region_graphs else "")
            raise BudgetError(f"{said}; a budget of {format_bytes(room)} ({room} bytes) fits "
                              "it, with room for what the process holds moving between builds "
                              "(built at that budget, the stack takes the fastest plan that "
                              f"fits){pages}",
                              budget_bytes=e.budget_bytes, least_bytes=room,
                              least_plan=least) from None
        self.plan = _per_layer(plan, units)
        if plan.budget_bytes is not None:
            self._state_watch = StateWatch(count, _state_warning(plan), device=b.device)
            weakref.finalize(self, self._state_watch.close).atexit = False

    def _output_copy_bytes(self, held: int) -> int:
        """What the caller's copy of the stack's output adds to ``held`` (what the process
        holds after the build): allocated once here and measured, since it often fits in
        memory the allocator holds already. The output's gradient and the loss are the
        caller's, made as the caller makes them (a preallocated gradient is in ``held``)."""
        probe = torch.zeros_like(self._runners[-1].static_out)  # (touched: cpu counts pages)
        grown = _build_holds(self.backend)
        del probe
        return 0 if grown is None else max(0, grown - held)

    def _profile(self, units: tuple[tuple[int, ...], ...], sample: torch.Tensor,
                 section_bytes: int, optimizer_state: int) -> StackProfile:
        """What each graph's layers cost, measured eagerly (:mod:`graphslot.profile`)."""
        b = self.backend
        mods = [self.layers[u[0]] if len(u) == 1 else nn.Sequential(*(self.layers[i] for i in u))
                for u in units]
        # On the warm-ups' stream: a library's per-stream state (a matmul workspace of
        # tens of MiB) made on the caller's stream would stay for good, held by a plan
        # that keeps everything as by none.
        b.synchronize()
        with b.stream(self._warmup_stream):
            costs = profile_units(b, mods, sample, labels=[unit_label(u) for u in units],
                                  parts=[[p for i in u for p in recompute_parts(self.layers[i])]
                                         for u in units])
        if self.main_grad:
            # (the backward graphs add into main_grad, made before the build and so in the
            # fixed memory: the pool holds no gradient buffers and the stack no homes)
            costs = [replace(c, grad_bytes=0) for c in costs]
        probe = min(max(c.saved_bytes for c in costs), 256 << 20) or (1 << 20)
        bw = copy_bandwidth(b, probe, reps=3)
        release_unused(b)
        # What the step holds whatever the plan: what the process holds now, and the
        # step's tensors outside the graphs (the output the caller gets and the stack's
        # input gradient; the output's gradient is the caller's, as its loss is); the
        # gradients, boundary buffers and the graphs' pool depend on the plan.
        # (and what the optimizers will make at their first step, ``optimizer_state``)
        fixed = (_build_holds(b) or 0) + 2 * costs[-1].input_bytes + optimizer_state
        return StackProfile(tuple(costs), bw["d2h_gbps"], bw["h2d_gbps"], fixed_bytes=fixed,
                            granularity=b.granularity, section_bytes=section_bytes,
                            d2d_gbps=bw.get("d2d_gbps"), optimizer_state_bytes=optimizer_state,
                            keep_grads=self.keep_grads)

    def _new_graph(self) -> DeviceGraph:
        g = (self._pages.new_graph() if self._pages is not None
             else self.backend.new_graph(share_pool_with=self._pool_owner))
        self._pool_owner = self._pool_owner or g
        return g

    def _build(self, sample: torch.Tensor) -> None:
        runners = self._runners
        # The first layer reads the stack's input from a buffer of its own. When that layer
        # offloads what it saves (a saved input goes to its slot), the buffer is read by
        # its forward graph alone: it comes from the graphs' pool and goes back to it once
        # that graph is captured, the caller's input copied in right before each replay.
        pooled = self.engine.offloads and runners[0].layers[0] in self.offload_layers
        x = (self._pool_buffer(sample) if pooled else sample.detach().clone()
             ).requires_grad_(sample.requires_grad)
        shared = self._shared_params()
        if self.main_grad:
            self._check_main_grads_graphs()
        for i, r in enumerate(runners):
            out = r.build_forward(x)
            wants_grad = x.requires_grad or bool(r.params)
            if i + 1 < len(runners):
                check_passes_gradient(out, r.label, wants_grad)
            # The next layer is captured reading this layer's output buffer itself.
            x = out.detach().requires_grad_(wants_grad)
            if i == 0 and pooled:
                self._return_to_pool((r, "static_in"))
            if i >= 1:
                self._free_boundary(runners[i - 1], r)
        last = runners[-1]
        # (an output that views the layer's input stays: the input is another's buffer)
        if last.unit.wants_offload:
            # The stack's output buffer is copied for the caller right after its replay;
            # nothing else reads it (a saved output is in the slot): the backward graphs,
            # captured next, may use its bytes.
            self._return_to_pool((last, "static_out"))
        grad_out: torch.Tensor | None = None
        for i in reversed(range(len(runners))):
            r = runners[i]
            r.build_backward(grad_out, shared)
            if r.bwd is not None and r.static_grad_out is not grad_out:
                # Its own output-gradient buffer (the stack's last layer): read by its graph
                # alone, once the caller's gradient is copied in.
                self._return_to_pool((r, "static_grad_out"))
            if i + 1 < len(runners) and runners[i + 1].grad_in is r.static_grad_out:
                # Layer i+1's input gradient is read by layer i's backward graph alone.
                self._return_to_pool((r, "static_grad_out"), (runners[i + 1], "grad_in"))
            grad_out = r.grad_in
        first = runners[0]
        if first.grad_in is not None:
            # Handed out as the stack's input gradient (see _lend_input_grad).
            self._input_grad = ParamGrad(None, first.grad_in, False)
        _check_nothing_given_back_in_use(self.layers, runners, self._input_grad)
        self.backend.synchronize()
        gc.collect()
        for r in self._runners:
            r.count_own_refs()
        if self._input_grad is not None:
            self._input_grad.count_own_refs()

    def _pool_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A copy of ``like`` in memory of the graphs' shared pool (an allocation captured
        into an otherwise empty graph; the first such graph stays the pool's owner)."""
        g = self._new_graph()
        with self._capture_room():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the captured graph is empty
                with g.capture(self._warmup_stream):
                    buf = torch.empty_like(like)
            with torch.no_grad():
                buf.copy_(like.detach())
        return buf

    def _capture_room(self) -> ContextManager[None]:
        """Around a capture into the graphs' pool: room mapped ahead where the pool is on
        graphslot's pages (see :meth:`PoolPages.room`)."""
        return contextlib.nullcontext() if self._pages is None else self._pages.room()

    def _replaying(self, kind: str, index: int) -> None:
        """Before graph ``index``'s ``kind`` (``"fwd"``, ``"bwd"``) replay: on shared
        pages, out of the order they were shared for, every page gets its memory back."""
        pages = self._pages
        if pages is not None and pages.shared:
            owed = kind == "fwd" and index == 0 and any(r.pending for r in self._runners)
            pages.replaying(kind, index, len(self._runners) - 1, owed)

    def _lend_input_grad(self, buf: torch.Tensor, input_ref: weakref.ref[torch.Tensor] | None
                         ) -> torch.Tensor:
        """The stack's input gradient: the first layer's gradient buffer itself, lent as
        parameter gradients are (no copy). Before any replay that could overwrite the
        buffer, whoever still holds it gets bytes of its own (see :meth:`_give_back`): a
        leaf input keeps it as ``.grad`` (``pg.holder``); an input with hooks, which may
        keep it where nobody finds it again, gets a copy."""
        pg = self._input_grad
        x = input_ref() if input_ref is not None else None
        if pg is None or pg.copy or (x is not None and x._backward_hooks):
            return buf.clone()
        # (given back before every replay, so it is lent to one input at a time)
        pg.holder = input_ref if x is not None and x.is_leaf else None
        lent = self._lent.setdefault(0, [])
        if pg not in lent:
            lent.append(pg)
        return buf.detach()

    def _free_boundary(self, a: GraphRunner, b: GraphRunner) -> None:
        """Layer ``a``'s output buffer is layer ``b``'s input, read by ``b``'s forward graph
        and by nothing after it when both layers offload every saved tensor (a saved input
        is copied into ``b``'s slot): give its bytes back to the pool, so later captures
        reuse them instead of each boundary holding an activation's worth for good."""
        if not (a.unit.wants_offload and b.unit.wants_offload) or a is self._runners[-1]:
            return
        self._return_to_pool((a, "static_out"), (b, "static_in"))

    def _return_to_pool(self, *holders: tuple[GraphRunner, str]) -> None:
        """Give the buffer that ``holders`` (runner, attribute) name back to the graphs'
        pool, each of them then naming a view of its bytes: unless another buffer of the
        stack shares its bytes (a layer handing on its input, or its output gradient, as
        is: ``x.view(...)``, ``x + pos``), which goes on being read or lent."""
        buf = getattr(*holders[0])
        if self._held_elsewhere(buf, holders):
            return
        view = self.backend.return_to_pool(buf)
        if view is not None:
            for r, name in holders:
                setattr(r, name, view)

    def _held_elsewhere(self, buf: torch.Tensor, holders: Sequence[tuple[GraphRunner, str]]) -> bool:
        # (by storage, not address: a view of bytes given back earlier may start where a
        # later capture put a buffer of its own, and does not hold that buffer)
        st = storage_id(buf)
        for r in self._runners:
            for name in _BUFFERS:
                t = getattr(r, name, None)
                if t is not None and (r, name) not in holders and storage_id(t) == st:
                    return True
            if any(pg is not None and storage_id(pg.buf) == st for pg in r.grads):
                return True
        return False

    def _check_main_grads_graphs(self) -> None:
        """With ``main_grad=True``, a parameter in several graphs would get each graph's part
        added into ``main_grad`` in turn, where eager adds their sum: refuse it."""
        seen: set[int] = set()
        for r in self._runners:
            for p in r.params:
                if id(p) in seen:
                    raise UsageError(
                        f"main_grad=True, but parameter {param_name(self.layers, p)} is in "
                        f"several graphs ({self.graph_layers}); give the layers that share it one "
                        "graph (layers_per_graph) or build without main_grad")
            seen.update(id(p) for p in r.params)

    def _shared_users(self) -> dict[int, set[int]]:
        """By ``id``, each trainable parameter several layers use: those layers."""
        users: dict[int, set[int]] = {}
        for i, m in enumerate(self.layers):
            for p in m.parameters():
                if p.requires_grad:
                    users.setdefault(id(p), set()).add(i)
        return {k: ls for k, ls in users.items() if len(ls) > 1}

    def _tied(self) -> list[set[int]]:
        """For each trainable parameter several layers use, those layers (none with
        ``main_grad=True``: there such layers share one graph, which adds into main_grad
        their parts' sum)."""
        return [] if self.main_grad else list(self._shared_users().values())

    def _shared_params(self) -> set[int]:
        return set(self._shared_users())

    @property
    def mode(self) -> Mode:
        return self.engine.mode

    def bank_index(self, layer: int) -> int:
        """Ping-pong bank of ``layer``'s graph (:func:`graphslot.offload.ping_pong_banks`)."""
        k = next(k for k, ls in enumerate(self.graph_layers) if layer in ls)
        backward = self.graph_layers[::-1]
        banks = ping_pong_banks(ls[0] in self.offload_layers for ls in backward)
        return banks[len(backward) - 1 - k]

    @property
    def timeline(self) -> Any:
        """A :class:`graphslot.trace.Timeline` recording compute and copy spans, or None."""
        return self.engine.timeline

    @timeline.setter
    def timeline(self, tl: Any) -> None:
        self.engine.timeline = tl

    @property
    def gradient_buffers(self) -> list[torch.Tensor]:
        """The backward graphs' parameter-gradient buffers in their pool (what ``.grad`` may
        alias; not the gradient homes outside it)."""
        return [pg.buf for r in self._runners for pg in r.grads if pg is not None]

    @property
    def pool_bytes(self) -> int | None:
        """Bytes of the graphs' shared private pool, where the backend can tell (on
        graphslot's pages, ``share_pool_pages``: the physical bytes behind it)."""
        if self._pages is not None:
            return self._pages.pool.mapped_bytes
        return None if self._pool_owner is None else self._pool_owner.pool_bytes

    def _saw_kept_grad(self) -> None:
        """A ``.grad`` lent from the pool was kept through a forward: where a budget's plan
        counted the gradients as sharing the pool (no ``keep_grads``), say once if their
        copies take the step over the budget."""
        plan = self.plan
        if self._warned_kept_grads or plan is None or plan.budget_bytes is None:
            return
        self._warned_kept_grads = True
        grads = sum(pg.buf.numel() * pg.buf.element_size()
                    for r in self._runners for pg in r.grads if pg is not None)
        if plan.predicted_peak_bytes + grads <= plan.budget_bytes:
            return
        warnings.warn(
            f"GraphedLayers: .grad was kept through a forward (gradients accumulated over "
            f"microbatches, or zeroed in place), so the gradients ({format_bytes(grads)}) were "
            "copied out of the graphs' pool, where the memory budget's plan counted them as "
            "sharing memory with the layers' activations: the step holds about "
            f"{format_bytes(plan.predicted_peak_bytes + grads)} against a budget of "
            f"{format_bytes(plan.budget_bytes)}. Build with keep_grads=True: the gradients "
            "then have homes of their own, which the plan counts", stacklevel=4)

    def _give_back(self, layer: int | None) -> None:
        """Before a replay: gradient buffers it may overwrite stop being anyone's gradient.

        A backward graph's gradient buffers share pool memory with what forward graphs
        write (as in torch's graphed callables, which is why they cost no extra memory),
        and with what backward graphs of later layers wrote before them. So before any
        forward replay every lent buffer is given back, and before layer ``j``'s backward
        replay those of layer ``j`` and below; in an ordinary backward pass nothing is lent
        below, and after ``zero_grad(set_to_none=True)`` nothing is held, so no copy is made.
        """
        # By layer, so a backward pass, which lends from layers above the one it replays
        # next, looks at a few keys rather than at every buffer lent so far.
        for i in [i for i in self._lent if layer is None or i <= layer]:
            runner = self._runners[i]
            for pg in self._lent.pop(i):
                runner.give_back(pg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _compiling():
            # Inside torch.compile: the stack runs outside the compiled graph (a graph
            # break), as it is, its graphs replaying; dynamo would trace its bookkeeping.
            return _uncompiled_forward(self, x)
        return self._forward(x)

    def __copy__(self) -> GraphedLayers:
        raise UsageError(
            "GraphedLayers cannot be copied: its graphs read fixed device memory that a copy "
            "would share. Copy the layers (or the model's state_dict) before building the "
            "stack, or build another stack over the copy")

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedLayers:
        return self.__copy__()

    def _replicate_for_data_parallel(self) -> Any:
        raise UsageError(
            "GraphedLayers cannot be replicated (nn.DataParallel): its graphs are this "
            "device's. Run one process per device, each building its own stack")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UsageError(
            "GraphedLayers cannot be pickled (torch.save of a model holding it): its graphs and "
            "device memory are this process's. Save the model's state_dict(): its keys are "
            "the layers' own, and it loads into the model with or without the stack")

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise StateError("GraphedLayers: forward after close(); its slots and graphs are "
                             "released, build a new stack")
        if any(m.training is not was for m, was in self._captured_modes):
            return self._eager(x)  # (any input: a validation batch may have its own size)
        if _functorch_active():
            raise UsageError(
                "GraphedLayers cannot run under torch.func transforms (grad, vmap, jacrev, "
                "functional_call inside them): its graphs replay captured kernels on their own "
                "buffers, which a transform cannot see into. Call the stack outside the "
                "transform, or run its layers (stack.layers) eagerly inside it")
        # (before anything runs: a mismatch loses nothing; moved parameters first, since
        # .double() or .half() on the model changes the input's dtype too)
        self._check_in_place()
        if self._frozen_at_build and torch.is_grad_enabled():
            self._check_still_frozen()
        # (which layers' parameters want a gradient now: some may be frozen since the build)
        trains = [r.trains() for r in self._runners] if torch.is_grad_enabled() else []
        if self.main_grad and trains and isinstance(x, torch.Tensor):
            self._check_frozen_main_grads(x.requires_grad, trains)
        if not isinstance(x, torch.Tensor):
            self._runners[0].check_input(x)  # (names what it got)
        cast = autocast_dtype(x.device.type)
        if not torch.is_grad_enabled() and (not self._runners[0].fits(x) or
                                            cast != self.autocast_dtype):
            return self._eager(x)  # no backward can follow: any input, as in eval mode
        if self._hook_watch.changed():
            raise CaptureMismatchError(
                "GraphedLayers: a module hook was added to or removed from the layers since "
                "the build. The graphs run the hooks as they were captured, whatever is "
                "registered now: build the stack again after changing hooks (or register "
                "them before building)")
        self._runners[0].check_input(x)
        if cast != self.autocast_dtype:
            def under(dtype: torch.dtype | None) -> str:
                return "without autocast" if dtype is None else f"under autocast to {dtype}"
            raise CaptureMismatchError(
                f"GraphedLayers was captured {under(self.autocast_dtype)}, and this forward "
                f"runs {under(cast)}: build the stack under the autocast its forwards run under")
        runners = self._runners
        token = object()
        try:
            self._enter(token)
            if self._abandoned:
                self._reap()
            for r in runners:
                if r.ctx_made and r.pending:
                    # This forward overwrites what those microbatches' ctx keep: their
                    # backward is refused before it replays anything (one that never comes,
                    # a skipped step's loss, costs nothing).
                    for m in r.pending:
                        self._ctx_overwritten.setdefault(m, (
                            f"GraphedLayers ({r.label}): an autograd.Function keeps "
                            f"{', '.join(r.ctx_made)} on its ctx, not through "
                            "ctx.save_for_backward, and the graphs hold one copy of it, which a "
                            f"forward of another microbatch overwrote before this one's ({m}) "
                            "backward. Save it with ctx.save_for_backward, or run each "
                            "microbatch's backward before the next forward. Nothing of this "
                            "backward ran in the stack"))
            self._microbatch += 1
            mb = self._microbatch
            try:
                if torch.is_grad_enabled() and (x.requires_grad or any(trains)):
                    lowest = True
                    for r, r_trains in zip(runners, trains):
                        if not (x.requires_grad or r_trains):
                            # (frozen layers, at the build or since, below any that train,
                            # the input wanting no gradient: no backward reaches them,
                            # nothing is kept for one)
                            x = r.forward(x, mb, False)
                            continue
                        x = LayerFunction.apply(r, mb, lowest, x, *r.params)
                        lowest = False
                    return x
                # No backward can follow: nothing is offloaded or kept for one.
                for r in runners:
                    x = r.forward(x, mb, False)
                return x.clone()
            except BaseException:
                self._abandon(mb)  # nobody holds this forward's output: no backward can come
                raise
        finally:
            self._inside.pop(token, None)  # (one C call: see StackHost.inside)
            self._left()

    def _check_in_place(self) -> None:
        """Every parameter and buffer is where the capture found it, and every parameter
        the object it was."""
        for tensors, name, was, ptr, where in self._captured_at:  # (a module's own dicts)
            t = tensors.get(name)
            if t is None or t.data_ptr() != ptr:
                what = "is gone" if t is None else "lies elsewhere"
                raise CaptureMismatchError(
                    f"GraphedLayers: layer {where} {what} since the graphs were "
                    "captured, and they read the memory it had (load_state_dict(assign=True), "
                    ".to() or .half() after the build, or a wrapper that reallocates "
                    "parameters, put it elsewhere): copy new values in place "
                    "(load_state_dict without assign=True) or build the stack again")
            if t is not was and isinstance(was, nn.Parameter):  # (t is not None here)
                raise CaptureMismatchError(
                    f"GraphedLayers: layer {where} is another parameter object than the one "
                    "the graphs were captured with, which their backward hands its gradient "
                    "to: the new one would get none. Copy new values into the parameter in "
                    "place (load_state_dict without assign=True, or param.data.copy_) or "
                    "build the stack again")

    def _check_still_frozen(self) -> None:
        """A parameter frozen at the build and unfrozen since would get no gradient from
        the graphs (eager gives it one): refuse, before anything runs."""
        woken = [where for p, where in self._frozen_at_build if p.requires_grad]
        if woken:
            raise CaptureMismatchError(
                f"GraphedLayers: parameter {woken[0]}"
                f"{f' (and {len(woken) - 1} more)' if len(woken) > 1 else ''} "
                "wants a gradient now but was frozen (requires_grad=False) when the graphs were "
                "captured, and they compute no gradient for it: build the stack again after "
                "unfreezing, or build it with every layer that will train unfrozen and freeze "
                "them with requires_grad_(False) afterwards (the stack honours that)")

    def _check_frozen_main_grads(self, wants: bool, trains: Sequence[bool]) -> None:
        """With ``main_grad=True`` the backward graphs add into main_grad themselves: a
        parameter frozen since the build, in a layer a backward reaches (any layer above
        one that trains, or whose input wants a gradient), would still get its part added
        (eager adds none). Refuse, before anything runs."""
        for r, r_trains in zip(self._runners, trains):
            wants = wants or r_trains
            frozen = [p for p in r.params if not p.requires_grad] if wants else []
            if frozen:
                raise CaptureMismatchError(
                    f"GraphedLayers: parameter {param_name(self.layers, frozen[0])} was frozen "
                    "after the build, and a backward reaches its layer, whose graph adds its "
                    "gradient into main_grad whatever requires_grad says (main_grad=True): build "
                    "the stack again after freezing, or freeze only layers below every one that "
                    "trains")

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        """The layers run as plain modules (the graphs were captured in another mode)."""
        if torch.is_grad_enabled() and not self._warned_mode:
            self._warned_mode = True
            warnings.warn("GraphedLayers: layers are not in the training mode their graphs "
                          "were captured in (model.train() / model.eval()); they run eagerly, "
                          "without graphs or offload, until they are again", stacklevel=3)
        for m in self.layers:
            x = m(x)
        return x

    def _at_end_of_pass(self, mb: int) -> None:
        """Called in autograd's pass: once it ends, microbatch ``mb``'s backward is over
        for close(), also where it stopped above the stack's first layer (a frozen layer
        below, ``backward(inputs=...)``). Neither such a pass nor one that failed part way
        (a hook raising; autograd freed what its nodes that ran saved) can go on, so what
        the layers it did not reach keep is given back at the next forward, backward or
        close()."""
        stack = weakref.ref(self)

        def over(failed: bool) -> None:
            s = stack()
            if s is not None:
                with s._lock:
                    s._in_backward.discard(mb)
                    # A pass that stopped above a layer never reaches it later (a second
                    # pass through the layers above is refused): what that layer keeps for
                    # the microbatch (a restore into a bank, ahead of its backward) is given
                    # back at the next forward or backward, while the caller may still hold
                    # the loss.
                    if failed or any(mb in r.pending for r in s._runners):
                        s._abandoned.append(mb)
                    s._lock.notify_all()

        end = _PassEnd(over)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(end)  # type: ignore[attr-defined]
        except RuntimeError:
            end.dropped.detach()  # (not inside autograd's engine: the stack's first layer ends it)

    def _enter(self, token: object) -> None:
        me = threading.get_ident()
        with self._lock:
            if self._closed:
                raise StateError("GraphedLayers: used after close()")
            if any(t != me for t in self._inside.values()):
                raise StateError(
                    "GraphedLayers: called from a second thread while another thread runs "
                    "its graphs: they share their buffers, so one stack serves one thread at "
                    "a time. Build a stack per thread, or take turns (a lock around the "
                    "forward and the backward)")
            self._inside[token] = me

    def _left(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _abandon(self, mb: int) -> None:
        """Microbatch ``mb``'s backward will never run: give back what it holds."""
        self._ctx_overwritten.pop(mb, None)
        for r in self._runners:
            r.pending.discard(mb)
            r.forget_draws(mb)
            r.unit.abandon(mb)  # (nothing once the engine is closed)
        self._in_backward.discard(mb)

    def _reap(self) -> None:
        """Abandon the microbatches whose autograd graphs died without a backward."""
        runners = self._runners
        while self._abandoned:
            mb = self._abandoned.popleft()
            # (one whose backward ran on every layer holds nothing: most of them)
            if mb in self._in_backward or any(mb in r.pending for r in runners):
                self._abandon(mb)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int | slice) -> Any:
        """The layer at ``i`` (a list of them for a slice), as ``stack.layers[i]``."""
        return list(self.layers)[i] if isinstance(i, slice) else self.layers[i]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    def close(self, timeout: float = 30.0) -> None:
        """Release the graphs, their pool, the slots, banks and buffers.

        Safe to call again and from another thread: it waits up to ``timeout`` seconds for
        a forward or backward under way to finish, then refuses with a StateError (a
        backward that failed part way, a hook raising, is over: it is not waited for). A
        microbatch whose backward has not run is abandoned; its backward then raises.
        """
        with self._lock:
            if self._closed:
                return
            def idle() -> bool:  # no replay, and no backward pass begun that can still go on
                return not self._inside and not any(
                    m in r.pending for m in self._in_backward for r in self._runners)

            # (in short waits: a replay interrupted right after leaving wakes nobody)
            deadline = time.monotonic() + timeout
            while not idle() and time.monotonic() < deadline:
                self._lock.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            if not idle():
                raise StateError(f"GraphedLayers.close(): another thread is still replaying "
                                 f"after {timeout:g} s; close() once it is done")
            self._closed = True
        self._finalizer.detach()
        if self._pages is not None:
            # (a .grad lent from the pool gets bytes of its own: the pool can then close)
            self._give_back(None)
        if self._state_watch is not None:
            self._state_watch.close()
        self._forget_draws()
        # The graphs go too, not only when the stack is collected: a stack still named
        # after its ``with`` block would otherwise hold their pool (tensors a caller still
        # holds, such as ``.grad`` that is a pool buffer, keep their own bytes).
        self._unmake()
        self._warmup_stream = None

    def _forget_draws(self) -> None:
        # (a method of its own: a loop in close() would leave its last runner named there,
        # holding that runner's buffers while the graphs' pool closes)
        for r in self._runners:
            r.forget_draws()

    def __enter__(self) -> GraphedLayers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)
_functorch_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active",
                                                lambda: False)
# torch's lazily importing form of torch.compiler.disable: dynamo is imported by the
# first call, which comes only under torch.compile, where it is imported already.
_uncompiled_forward: Callable[..., Any] = torch._disable_dynamo(GraphedLayers._forward)


def _state_warning(plan: BudgetPlan) -> Callable[[torch.optim.Optimizer, int], str]:
    """The warning for optimizers' state beyond what ``plan`` counted, where the step then
    holds more than the budget."""
    budget, peak = plan.budget_bytes or 0, plan.predicted_peak_bytes

    def say(opt: torch.optim.Optimizer, extra: int) -> str:
        if peak + extra <= budget:
            return ""  # (the budget holds all the same)
        return (f"GraphedLayers: the optimizers hold {format_bytes(extra)} more state on the "
                f"device than the stack's memory budget's plan counted (seen after "
                f"{type(opt).__name__}'s step): the step holds about {format_bytes(peak + extra)} "
                f"where the plan said {format_bytes(peak)}, against a budget of "
                f"{format_bytes(budget)}. Build the stack after the optimizers are made and "
                "their parameter groups added (torch's optimizers' state is then counted "
                "before their first step) or after their first step (any optimizer's), or "
                f"give a budget {format_bytes(extra)} lower")
    return say


class _PassEnd:
    """Queued at the end of autograd's pass: ``fn(False)`` when the pass ends. A pass
    that fails runs no callback, but its engine drops them: ``fn(True)`` then."""

    __slots__ = ("_fn", "dropped", "__weakref__")

    def __init__(self, fn: Callable[[bool], None]) -> None:
        self._fn = fn
        self.dropped = weakref.finalize(self, fn, True)

    def __call__(self) -> None:
        if self.dropped.detach() is not None:
            self._fn(False)


#: a runner's buffers that may share bytes with one given back to the pool, and their names
_BUFFERS = {"static_in": "input", "static_out": "output", "static_grad_out": "output gradient",
            "grad_in": "input gradient"}


def _given_back(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes went back to the graphs' pool (``Backend.return_to_pool``
    leaves the storage it took them from with none)."""
    return t.untyped_storage().nbytes() == 0


def _check_nothing_given_back_in_use(layers: Iterable[nn.Module], runners: Sequence[GraphRunner],
                                     input_grad: ParamGrad | None) -> None:
    """After a build: no buffer the stack goes on using was given back to the graphs' pool
    (a tensor whose storage the pool took back has no bytes; later graphs may have put
    their own data where it was). Where one was, the build fails here, at once, instead of
    training on bytes that other graphs overwrite."""
    for i, r in enumerate(runners):
        kept = [*((what, getattr(r, name)) for name, what in _BUFFERS.items()),
                *((f"gradient of {param_name(layers, pg.param)}", pg.buf)
                  for pg in r.grads if pg is not None and pg.param is not None)]
        if i == 0 and input_grad is not None:
            kept.append(("the stack's input gradient", input_grad.buf))
        for what, t in kept:
            if t is not None and t.numel() and _given_back(t):
                raise StateError(
                    f"{r.label}: its {what} buffer was given back to the graphs' pool while "
                    "the stack still uses it; later graphs may write there. This is a fault "
                    "of graphslot's, not of your layers: please report it with the layer's "
                    "code")


def _close_paged(pages: PoolPages, engine: OffloadEngine) -> None:
    """A stack on shared pages dropped without close(): its pool and its engine go (a
    pool whose bytes tensors still hold stays until a later stack's build or close finds
    them gone)."""
    try:
        pages.close()
    finally:
        engine.close()


def _build_holds(b: Backend) -> int | None:
    """What the process holds now, as the budget counts it (before the profile, after each
    build): the allocator's reserved bytes plus graphslot's pages, or where the allocator
    keeps no figures (cpu), the process's footprint; None where neither can be told."""
    held = held_bytes(b)
    return b.footprint_bytes() if held is None else held


@contextlib.contextmanager
def _building(dev: torch.device, autocast_dtype: torch.dtype | None,
              own: Sequence[tuple[str, torch.Generator, torch.Tensor]] = ()) -> Iterator[None]:
    """Around a build: the random generators forked (what the build draws is not the
    caller's; the layers' ``own`` generators too), and autocast as the caller has it but
    without its cast cache, whose copies would outlive the capture that made them while
    the graphs go on reading them."""
    with contextlib.ExitStack() as build:
        build.enter_context(torch.random.fork_rng(
            devices=[] if dev.type == "cpu" else [dev.index if dev.index is not None else 0],
            device_type=dev.type))
        build.callback(lambda: [g.set_state(state) for _, g, state in own])
        if autocast_dtype is not None:
            build.enter_context(torch.autocast(dev.type, dtype=autocast_dtype, cache_enabled=False))
        yield


def _per_layer(plan: BudgetPlan, units: tuple[tuple[int, ...], ...]) -> BudgetPlan:
    """``plan`` (one choice per graph of ``units``) with one choice per layer."""
    ops = plan.recompute_ops
    return replace(plan, choices=tuple(plan.choices[k] for k, ls in enumerate(units) for _ in ls),
                   recompute_ops=tuple(ops[k] for k, ls in enumerate(units) for _ in ls) if ops else ())
