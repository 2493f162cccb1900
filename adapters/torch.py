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
shapes inside a layer. Random ops (dropout) draw fresh numbers at every replay; a
recomputed layer draws, in its backward, the very numbers its forward drew for that
microbatch (a random stream of its own, where the backend has one:
:meth:`~graphslot.backend.Backend.new_rng_stream`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import threading
import warnings
import weakref
from dataclasses import replace
from typing import AbstractSet, Any, Callable, ContextManager, Iterable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from graphslot.backend import Backend, DeviceGraph, RngStream
from graphslot.budget import (OFFLOAD, RECOMPUTE, BudgetPlan, StackProfile, banks_bytes,
                              fit_budget, gradient_homes, parse_budget)
from graphslot.errors import CaptureMismatchError, StateError, UsageError
from graphslot.memory import saved_bytes_per_layer, settle
from graphslot.offload import (SECTION_BYTES, Mode, OffloadEngine, OffloadGroup, never_offloaded,
                               recording_saved_tensors, state_storages)
from graphslot.profile import copy_bandwidth, held_bytes, profile_units
from graphslot.selection import get_backend

__all__ = ["JOIN_BYTES", "GraphedLayers", "plan_graphs"]

#: ``layers_per_graph=None`` joins consecutive layers while what their forwards save
#: stays within this together. A graph replay and an offload copy cost the host about as
#: much for a small layer as for a large one; past a few tens of MiB the copies, not the
#: calls, set an offloading step's time, and a larger graph only coarsens them.
JOIN_BYTES = 32 << 20


def plan_graphs(n: int, offloaded: AbstractSet[int], layers_per_graph: int | None,
                saved_bytes: Sequence[int] | None, join_bytes: int | None = None,
                recomputed: AbstractSet[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
    """Which of ``n`` layers each device graph covers: consecutive runs, never mixing
    layers in and outside ``offloaded`` (or ``recomputed``); ``layers_per_graph`` at a
    time, or, when it is None, as many as keep ``saved_bytes`` (per layer) within
    ``join_bytes`` together (default :data:`JOIN_BYTES`)."""
    if layers_per_graph is None and (saved_bytes is None or len(saved_bytes) != n):
        raise UsageError("plan_graphs: joining by size needs every layer's saved bytes")
    join_bytes = JOIN_BYTES if join_bytes is None else join_bytes

    def kind(i: int) -> tuple[bool, bool]:
        return (i in offloaded, i in recomputed)

    plan: list[tuple[int, ...]] = []
    run: list[int] = []
    total = 0
    for i in range(n):
        size = 0 if saved_bytes is None else saved_bytes[i]
        if run and (kind(run[0]) != kind(i)
                    or (layers_per_graph is not None and len(run) >= layers_per_graph)
                    or (layers_per_graph is None and total + size > join_bytes)):
            plan.append(tuple(run))
            run, total = [], 0
        run.append(i)
        total += size
    plan.append(tuple(run))
    return tuple(plan)

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _tracked_objects() -> list[Any]:
    """Every object the garbage collector tracks, frozen ones included: gc.get_objects()
    skips what gc.freeze() set aside, and training loops freeze after their first steps,
    with whatever they keep (a ``.grad`` an optimizer holds) among the frozen."""
    if not gc.get_freeze_count():
        return gc.get_objects()
    gc.unfreeze()
    try:
        return gc.get_objects()
    finally:
        # Frozen again, with what was young now too: those are only spared cycle
        # collection (this runs once per parameter whose old gradient someone kept).
        gc.freeze()


def _give_holders_own_bytes(t: torch.Tensor, lo: int, hi: int, spare: Sequence[torch.Tensor]) -> None:
    """Every tensor the program holds over ``t``'s storage, starting in ``[lo, hi)``, except
    ``spare``, gets a copy of its bytes of its own (the same object: references stay good),
    before graphslot writes that memory again."""
    storage = t.untyped_storage()._cdata
    with warnings.catch_warnings():  # isinstance() wakes deprecated module attributes
        warnings.simplefilter("ignore")
        held = [o for o in _tracked_objects() if isinstance(o, torch.Tensor)
                and all(o is not x for x in spare) and o.device == t.device
                and lo <= o.data_ptr() < hi and o.untyped_storage()._cdata == storage]
    for o in held:
        o.data = o.clone()


@contextlib.contextmanager
def _parameters_as(module: nn.Module, alias_of: dict[int, torch.Tensor]) -> Iterator[None]:
    """Run ``module`` with each parameter ``p`` replaced by ``alias_of[id(p)]`` wherever it
    is registered (a tied parameter in all its places), and put the very same parameter
    objects back after. (``torch.func.functional_call`` puts new objects in place of
    tied parameters, so optimizers and the model would no longer share them.)"""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for m in module.modules():
            params: dict[str, Any] = m._parameters  # (plain tensors go in for a while)
            for name, p in params.items():
                if p is not None and id(p) in alias_of:
                    swapped.append((params, name, p))
                    params[name] = alias_of[id(p)]
        yield
    finally:
        for params, name, p in reversed(swapped):
            params[name] = p


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _ParamGrad:
    """One parameter's gradient buffer in a layer's backward graphs (``param`` None: the
    stack's input gradient, the first layer's buffer)."""

    __slots__ = ("param", "buf", "ptr", "storage", "base_refs", "copy", "holder")

    def __init__(self, param: nn.Parameter | None, buf: torch.Tensor, copy: bool) -> None:
        self.param = param
        self.buf = buf  # written by the backward graph at every replay
        self.ptr = buf.data_ptr()
        self.storage = _storage_id(buf)
        self.base_refs = 0  # references to buf's storage that graphslot itself holds
        #: hand out a copy, never the buffer: shared parameters, hooked ones, and those
        #: whose earlier gradient somebody kept
        self.copy = copy
        #: the stack's input the buffer was last lent to as its ``.grad`` (input gradient only)
        self.holder: weakref.ref[torch.Tensor] | None = None

    def settle(self) -> None:
        """After the build: count the references graphslot itself holds to the buffer."""
        if _use_count is not None:
            self.base_refs = _use_count(self.storage)

    def grad(self) -> torch.Tensor | None:
        """The ``.grad`` the buffer was handed to: its parameter's, or the stack input's."""
        if self.param is not None:
            return self.param.grad
        x = self.holder() if self.holder is not None else None
        return None if x is None else x.grad

    def aliased(self) -> bool:
        g = self.grad()
        return g is not None and g.data_ptr() == self.ptr

    def others_hold(self) -> bool:
        """Does anyone but graphslot (and an aliasing ``.grad``) hold the buffer?"""
        if _use_count is None:
            return False
        extra = 1 if self.aliased() else 0
        return _use_count(self.storage) > self.base_refs + extra


class _GradHome:
    """A parameter's gradient storage outside the graphs' pool, at one address for good:
    the backward graph adds the parameter's gradient into it (``home.add_(grad)``), and
    ``.grad`` is the home itself, so a kept or accumulated ``.grad`` is the only copy.

    Used where no layer keeps activations in the pool (every layer offloads or
    recomputes): there pool gradient buffers would overlap nothing, so the home costs no
    memory with ``zero_grad()`` and saves a whole copy of the gradients without.

    Before each backward replay :meth:`prepare` makes the home hold what the graph must
    add to: ``.grad`` itself when it is the home; else, once whoever kept the earlier
    ``.grad`` (the home) got bytes of its own, ``-0.0`` (``-0.0 + g`` is ``g`` bit for
    bit, negative zeros included) when ``.grad`` is None, or a copy of a ``.grad`` the
    user assigned (which receives the sum after). Where this backward does not
    accumulate into ``.grad`` (``torch.autograd.grad``, ``backward(inputs=...)`` without
    the parameter), a tensor hook must see the gradient, or the parameter turned out to
    get gradients from outside the stack too (eager adds those to the stack's before
    adding into ``.grad``), the home is set aside for the replay and the gradient goes
    back to autograd as a tensor of its own."""

    __slots__ = ("param", "home", "node", "base_pyrefs", "base_refs", "outside", "_user",
                 "_saved", "_gave_none", "__weakref__")

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param
        self.home: torch.Tensor = torch.empty_like(param)
        # The parameter's gradient accumulator, held so that it stays the one autograd
        # uses: whether a backward runs it tells whether that backward fills .grad.
        node = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        assert node is not None
        self.node: torch.autograd.graph.Node = node
        self.base_pyrefs = 0
        self.base_refs = 0
        #: the parameter gets gradients from outside the stack as well (a tied weight)
        self.outside = False
        self._user: torch.Tensor | None = None
        self._saved: torch.Tensor | None = None
        self._gave_none = False
        _accumulator_runs_hooks_on_none()  # (asked here, not inside a backward)
        me = weakref.ref(self)

        def arrived(grads: tuple[torch.Tensor | None, ...]) -> None:
            home = me()
            if home is not None and home._gave_none and grads and grads[0] is not None:
                home.outside = True  # from the next backward on: the gradient goes to autograd
            if home is not None:
                home._gave_none = False

        node.register_prehook(arrived)

    def settle(self) -> None:
        """Count the references graphslot itself holds to the home (no local names)."""
        self.base_pyrefs = sys.getrefcount(self.home)
        if _use_count is not None:
            self.base_refs = _use_count(_storage_id(self.home))

    def fills_grad(self) -> bool:
        """Will the running backward accumulate into ``.grad``, with no tensor hook between
        and nothing from outside the stack to add first?"""
        if self.outside or self.param._backward_hooks:
            return False
        try:
            return bool(torch._C._will_engine_execute_node(self.node))
        except RuntimeError:  # torch.autograd.grad: it never fills .grad
            return False

    def prepare(self, fills: bool) -> None:
        """Before the replay: make the home hold what the graph must add to."""
        if not fills:
            self._saved = self.home.clone()
            self.home.fill_(-0.0)
            return
        g, h = self.param.grad, self.home
        if g is not None and (g is h or g.data_ptr() == h.data_ptr() and g.dtype == h.dtype
                              and g.shape == h.shape and g.stride() == h.stride()):
            return  # .grad is the home (or a view of it as it is): the graph adds into it
        del h  # (no local name on the home while its holders are counted)
        self._release_to_holders()  # the earlier .grad, the home, may still be held
        if g is None:
            self.home.fill_(-0.0)
        else:
            self.home.copy_(g)
            self._user = g

    def finish(self) -> torch.Tensor | None:
        """After the replay: the gradient for autograd (None when ``.grad`` has it)."""
        if self._saved is not None:
            grad = self.home.clone()
            self.home.copy_(self._saved)
            self._saved = None
            return grad
        p = self.param
        if self._user is not None:
            self._user.copy_(self.home)
            self._user = None
        elif p.grad is None:
            p.grad = self.home
        self._gave_none = True
        if not _accumulator_runs_hooks_on_none():
            # (older torch skips them when the accumulator gets no gradient)
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(p)
        return None

    def abandon(self) -> None:
        """The replay raised: put back what :meth:`prepare` set aside."""
        if self._saved is not None:
            self.home.copy_(self._saved)
        self._saved = self._user = None

    def _release_to_holders(self) -> None:
        """Somebody may still hold the earlier ``.grad`` (the home, or a view of it): give
        them their bytes before the graph writes the home, as eager leaves an old ``.grad``
        alone."""
        held_obj = sys.getrefcount(self.home) > self.base_pyrefs
        held_views = _use_count is not None and _use_count(_storage_id(self.home)) > self.base_refs
        if not (held_obj or held_views):
            return
        old = self.home
        self.home = old.detach()  # graphslot's own handle on the address from now on
        if held_views:
            lo = old.data_ptr()
            _give_holders_own_bytes(old, lo, lo + old.untyped_storage().nbytes(), (old, self.home))
        if held_obj:
            old.data = old.clone()
        del old
        self.settle()


_hooks_on_none: bool | None = None


def _accumulator_runs_hooks_on_none() -> bool:
    """Does autograd run a parameter's post-accumulate-grad hooks when its accumulator gets
    no gradient (a Function returned None for it)? Newer torch does; asked once."""
    global _hooks_on_none
    if _hooks_on_none is None:
        p = torch.zeros(1, requires_grad=True)
        ran: list[int] = []
        p.register_post_accumulate_grad_hook(lambda _: ran.append(1))

        class _NoneForP(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
                return x * 2

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
                return g * 2, None

        x = torch.zeros(1, requires_grad=True)
        with torch.enable_grad():
            _NoneForP.apply(x, p).sum().backward()
        _hooks_on_none = bool(ran)
    return _hooks_on_none


def _backward_into(targets: Sequence[torch.Tensor | None], out: torch.Tensor,
                   inputs: Sequence[torch.Tensor], grad_out: torch.Tensor | None
                   ) -> tuple[torch.Tensor | None, ...]:
    """Under capture: the backward of ``out`` with each parameter alias's gradient added into
    its target as it arrives (Megatron's ``main_grad.add_(grad)``) and dropped at once, so
    the graphs' pool holds one such gradient at a time, none after the replay. ``inputs``
    are the stack input (when it wants a gradient) and then the aliases, one per
    ``targets`` entry (None: that gradient is returned, a buffer of the graphs' pool).
    Returns what ``torch.autograd.grad`` would, added ones as None."""
    n_in = len(inputs) - len(targets)
    kept = list(inputs[:n_in]) + [a for a, t in zip(inputs[n_in:], targets) if t is None]

    def into(target: torch.Tensor, alias: torch.Tensor) -> None:
        target.add_(alias.grad)  # type: ignore[arg-type]  # (the hook runs once it is set)
        alias.grad = None

    handles = [a.register_post_accumulate_grad_hook(lambda a, t=t: into(t, a))
               for a, t in zip(inputs[n_in:], targets) if t is not None]
    try:
        torch.autograd.backward(out, grad_out, inputs=list(inputs))
    finally:
        for h in handles:
            h.remove()
    got = {id(x): x.grad for x in kept}
    for x in kept:
        x.grad = None
    return tuple(got.get(id(x)) for x in inputs[:n_in]) + tuple(
        None if t is not None else got[id(a)] for a, t in zip(inputs[n_in:], targets))


class _Runner:
    """One graph's consecutive layers (one, or several small ones): its graphs, static
    tensors and its offload group (kept on the device when its layers do not offload)."""

    def __init__(self, stack: GraphedLayers, index: int, layers: tuple[int, ...]) -> None:
        self.stack = stack
        self.index = index  # position among the stack's graphs
        self.layers = layers
        mods = [stack.layers[i] for i in layers]
        # Not a submodule of the stack: its state_dict and parameters stay the layers' own.
        self.module: nn.Module = mods[0] if len(mods) == 1 else nn.Sequential(*mods)
        a, z = layers[0], layers[-1]
        self.name = f"layer{a}" if a == z else f"layers{a}-{z}"
        self.label = f"layer {a}" if a == z else f"layers {a}-{z}"
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        #: with ``main_grad=True``: each parameter's main_grad, which the backward graph adds into
        self.main_grads: list[torch.Tensor] | None = (
            [getattr(p, "main_grad") for p in self.params] if stack.main_grad else None)
        #: where no layer keeps activations in the pool: (position among ``params``, its
        #: gradient home the backward graph adds into) for each parameter that has one
        self.homes: list[tuple[int, _GradHome]] = []
        # Warm-up and capture differentiate with respect to aliases of the parameters (same
        # memory, so the graphs read the very same addresses): the parameters' own tensor
        # hooks must run at each real backward, not once baked into a graph, and their
        # gradient accumulators must come from the training stream, not the capture's.
        self.group: OffloadGroup
        self.pending: set[int] = set()  # microbatches whose backward has not run
        self.static_in: torch.Tensor
        self.wants_grad_in = False
        self.static_out: torch.Tensor
        self.static_grad_out: torch.Tensor
        self.grad_in: torch.Tensor | None = None
        self.grads: list[_ParamGrad | None] = []
        self.fwd: DeviceGraph
        self.bwd: DeviceGraph | None = None
        # The stack's first layer copies its input in and hands its input gradient out as a
        # copy; the others read and write their neighbours' buffers themselves.
        self.first = index == 0
        #: its forward saves only its input, and its backward graph runs the forward again
        self.recompute = layers[0] in stack.recompute_layers
        # A recomputed layer's graphs draw from a random stream of their own, rewound to
        # where each microbatch's forward drew before its backward graph draws it again.
        self.rng: RngStream | None = None
        self._rng_at: dict[int, Any] = {}  # microbatch -> the stream before its forward

    # -- build ---------------------------------------------------------------------------

    def build_forward(self, static_in: torch.Tensor) -> torch.Tensor:
        """Warm up, discover what the capture saves, allocate the slot, capture the forward."""
        st, b, eng = self.stack, self.stack.backend, self.stack.engine
        state = state_storages([self.module])
        self.static_in = static_in
        self.wants_grad_in = static_in.requires_grad
        aliases = [p.detach().requires_grad_() for p in self.params]
        inputs = ([static_in] if static_in.requires_grad else []) + aliases
        dev = b.device
        alias_of = {id(p): a for p, a in zip(self.params, aliases)}

        def run(x: torch.Tensor) -> Any:
            with _parameters_as(self.module, alias_of):
                return self.module(x)

        def call() -> Any:
            if self.recompute:
                # The recompute runs inside the backward graph's capture, so ``run`` swaps
                # the aliases in again there. Its random numbers come from the runner's
                # own stream (``self.rng``), not from state calls that would run in capture.
                return torch.utils.checkpoint.checkpoint(run, static_in, use_reentrant=False,
                                                         preserve_rng_state=False)
            return run(static_in)

        def is_state(t: torch.Tensor) -> bool:
            return never_offloaded(t, dev.type, state)

        g = self.group = eng.group(self.name, offload=self.layers[0] in st.offload_layers)

        # Warm-up: eager iterations on a side stream (libraries initialise, autotuners
        # settle); autograd is untouched. Not on the current stream: if that is the legacy
        # default stream, an accumulator node the warm-up leaves alive would tie it to the
        # capture, which CUDA refuses. Every capture runs on that same stream: per-stream
        # library state (cuBLAS's workspace for each stream and thread) then exists from
        # the warm-up, in the ordinary pool, and no capture allocates another in a pool.
        side = st._warmup_stream
        b.wait_event(side, b.record_event(b.new_event()))
        with b.stream(side):
            for _ in range(st.warmup_iters):
                out = call()
                if not isinstance(out, torch.Tensor):
                    raise UsageError(f"{self.label} returned {type(out).__name__}; "
                                     "graphed layers must return one tensor")
                if inputs and out.requires_grad:
                    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
                del out
        b.wait_event(b.current_stream(), b.record_event(b.new_event(), side))
        b.synchronize()

        if g.wants_offload:
            # Discovery under capture: kernels may save other tensors when captured than
            # when run eagerly (SDPA's memory-efficient kernel saves its RNG seed and
            # offset as device tensors only under capture), so the slot is laid out from
            # a capture, which is then thrown away.
            g.restart_discovery()

            def discover(t: torch.Tensor) -> None:
                if not is_state(t):
                    g.discover(t)

            probe_graph = b.new_graph()  # a pool of its own, gone with it
            with probe_graph.capture(side):
                with recording_saved_tensors(discover):  # autograd keeps none of them
                    out = call()
            del out, probe_graph
            b.synchronize()
            b.empty_cache()
            g.allocate(bank_index=st.bank_index(self.layers[0]))
        else:
            g.allocate()  # kept on the device: nothing to lay out

        fwd = st._new_graph()
        if self.recompute:
            self.rng = b.new_rng_stream()
            if self.rng is None:
                warnings.warn(f"GraphedLayers: the {b.name} backend's graphs have no random stream "
                              "of their own: random ops (dropout) in a recomputed layer draw "
                              "other numbers in its backward than in its forward", stacklevel=2)
        drawing = self._attach_rng(fwd)
        g.begin_capture()
        if g.wants_offload:
            def pack(t: torch.Tensor) -> torch.Tensor:
                return t if is_state(t) else g.save_tensor(t)

            with fwd.capture(side), drawing():
                # (the unpack hook teaches the backward graph the slot's sections)
                with torch.autograd.graph.saved_tensors_hooks(pack, g.load_tensor):
                    out = call()
                g.forward_captured()
        else:
            kept: dict[int, tuple[int, int]] = {}  # storage pointer -> (pointer, bytes)

            def note(t: torch.Tensor) -> torch.Tensor:
                # What the backward graph will read from the graph's own memory.
                if not is_state(t):
                    s = t.untyped_storage()
                    kept.setdefault(s.data_ptr(), (s.data_ptr(), s.nbytes()))
                return t.detach()  # the same memory, no grad_fn: no cycle (see recording_saved_tensors)

            with fwd.capture(side), drawing():
                with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
                    out = call()
            self._kept = kept
        self.fwd = fwd
        self._out = out  # the captured autograd graph, until the backward graphs exist
        self._inputs = inputs
        self.static_out = out.detach()
        return self.static_out

    def build_backward(self, static_grad_out: torch.Tensor | None, shared: set[int]) -> None:
        """Capture the backward graph (after every forward, in reverse layer order)."""
        b, out, inputs = self.stack.backend, self._out, self._inputs
        wants_grad_in = self.wants_grad_in
        differentiable = bool(inputs) and out.requires_grad
        own = static_grad_out is None or static_grad_out.shape != out.shape
        if own and not differentiable:
            static_grad_out = torch.zeros_like(out)
        targets: list[torch.Tensor | None] | None = list(self.main_grads or []) or None
        if targets is None and self.stack._grad_homes and differentiable:
            # Shared parameters (eager adds their parts first, then into .grad) and hooked
            # ones (the hook sees each gradient) keep a pool buffer.
            self.homes = [(k, _GradHome(p)) for k, p in enumerate(self.params)
                          if id(p) not in shared and not p._backward_hooks]
            if self.homes:
                by_param = dict(self.homes)
                targets = [by_param[k].home if k in by_param else None
                           for k in range(len(self.params))]
        try:
            if differentiable:
                bwd = self.stack._new_graph()
                # A backend whose capture runs the work (cpu) would add the capture's gradient
                # (from whatever the static buffers hold) into the targets: put them back after.
                before = ([None if t is None else t.clone() for t in targets] if targets is not None
                          and getattr(bwd, "executes_during_capture", False) else None)
                drawing = self._attach_rng(bwd)
                with bwd.capture(self.stack._warmup_stream), drawing():
                    if own:
                        # The stack's last gradient buffer, from the graphs' pool: the caller's
                        # gradient is copied in right before each replay and only this graph
                        # reads it, so once captured its bytes go back to the pool (below).
                        static_grad_out = torch.empty_like(out)
                    grads: tuple[torch.Tensor | None, ...]
                    if targets is None:
                        grads = torch.autograd.grad(out, inputs, static_grad_out, allow_unused=True)
                    else:
                        grads = _backward_into(targets, out, inputs, static_grad_out)
                if before is not None:
                    with torch.no_grad():
                        for target, was in zip(targets or [], before):
                            if target is not None and was is not None:
                                target.copy_(was)
                    del before
                del targets
                if own:
                    assert static_grad_out is not None  # (allocated in the capture)
                    view = b.return_to_pool(static_grad_out)
                    if view is not None:
                        static_grad_out = view
                self.bwd = bwd
                grad_list = list(grads)
                self.grad_in = grad_list.pop(0) if wants_grad_in else None
                # (None where the graph adds into main_grad or a gradient home itself)
                self.grads = [None if gbuf is None else _ParamGrad(p, gbuf, id(p) in shared or bool(p._backward_hooks))
                              for p, gbuf in zip(self.params, grad_list)]
                del grads, grad_list
        except Exception as e:
            raise StateError(
                f"{self.label}: capturing the backward graph failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}). A common cause is an autograd graph from earlier "
                "eager work that is still alive (a kept loss, or a saved-tensor hook that "
                "returned its argument without a backward): its parameter accumulators "
                "then belong to the default stream. Build GraphedLayers before such work "
                "or drop those references.") from e
        assert static_grad_out is not None
        self.static_grad_out = static_grad_out
        self.group.finish_capture()
        # Drop the captured autograd graph: its accumulator nodes were made on the capture
        # stream, and training must make its own on the training stream.
        del self._out, self._inputs
        kept = self.__dict__.pop("_kept", None)
        if kept is not None:
            self.group.keep(b.alias_bytes(ptr, n) for ptr, n in kept.values())

    def _attach_rng(self, graph: DeviceGraph) -> Callable[[], ContextManager[None]]:
        """Before ``graph``'s capture: what to enter inside it so that its random ops draw
        from the runner's stream (nothing without one)."""
        if self.rng is None:
            return contextlib.nullcontext
        self.rng.attach(graph)
        return self.rng.drawing

    def settle_refs(self) -> None:
        """After the build: count the references graphslot itself holds to each buffer."""
        for pg in self.grads:
            if pg is not None:
                pg.settle()
        for _, h in self.homes:
            h.settle()

    # -- run -------------------------------------------------------------------------------

    def check_input(self, x: Any) -> None:
        """``x`` is what the capture fixed: one tensor of its shape, dtype and device, and
        no input that wants a gradient where the graphs were captured computing none."""
        si = self.static_in
        if not isinstance(x, torch.Tensor):
            raise CaptureMismatchError(f"{self.label} was captured for one tensor input, got "
                                       f"{type(x).__name__}")
        if x.shape != si.shape or x.dtype != si.dtype or x.device != si.device:
            raise CaptureMismatchError(
                f"{self.label} was captured for input {list(si.shape)} {si.dtype} on "
                f"{si.device}, got {list(x.shape)} {x.dtype} on {x.device}")
        if x.requires_grad and not self.wants_grad_in and torch.is_grad_enabled():
            # (its backward graph computes no input gradient: x.grad would stay None)
            raise CaptureMismatchError(
                f"{self.label} was captured for an input without requires_grad (the "
                "sample_input's), got one that requires grad; build the stack with a sample "
                "input that requires grad (sample.requires_grad_()) to get its gradient")

    def forward(self, x: torch.Tensor, mb: int, training: bool) -> torch.Tensor:
        stack = self.stack  # (GraphedLayers.forward checked the stack's input)
        if mb in self.pending:
            raise StateError(f"{self.label}: microbatch {mb} ran forward again before its backward")
        if stack._lent:
            stack._give_back(None)
        eng = stack.engine
        # (moves out what another microbatch keeps in the graphs' memory, if one does)
        ticket = eng.before_forward(self.group, mb)
        if self.group.offloads:
            nxt = stack._next_forward(self.index)
            if nxt is not None:
                eng.prefetch_forward(nxt.group)
        if x.data_ptr() != self.static_in.data_ptr():
            with torch.no_grad():
                self.static_in.copy_(x)
        if self.rng is not None and training:
            self._rng_at[mb] = self.rng.position()
        if stack._tracing:
            with stack._span(f"fwd {self.name}"):
                self.fwd.replay()
            if stack.probe is not None:
                stack.probe(f"F{self.layers[-1]}")
        else:
            self.fwd.replay()
        if training:
            eng.after_forward(ticket)
        else:
            eng.forget(ticket)
        if training:
            self.pending.add(mb)
        return self.static_out

    def backward(self, grad: torch.Tensor, mb: int, input_ref: weakref.ref[torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor | None, ...]:
        """Replay microbatch ``mb``'s backward; ``input_ref``: the stack's input (the first
        layer's), whose gradient the returned input gradient becomes."""
        stack = self.stack
        if stack._closed:
            raise StateError(f"{self.label}: backward of microbatch {mb} after close(); "
                             "close() abandoned the forward it belonged to")
        stack._enter()
        try:
            return self._backward(grad, mb, input_ref)
        finally:
            stack._leave()

    def _backward(self, grad: torch.Tensor, mb: int, input_ref: weakref.ref[torch.Tensor] | None
                  ) -> tuple[torch.Tensor | None, ...]:
        stack = self.stack
        # A backward pass is one unit for close(): from its first layer to the stack's first.
        stack._in_backward.add(mb)
        try:
            out = self._replay_backward(grad, mb, input_ref)
        except BaseException:
            stack._in_backward.discard(mb)
            raise
        if self.index == 0:
            stack._in_backward.discard(mb)
        return out

    def _replay_backward(self, grad: torch.Tensor, mb: int, input_ref: weakref.ref[torch.Tensor] | None
                         ) -> tuple[torch.Tensor | None, ...]:
        stack, eng = self.stack, self.stack.engine
        if mb not in self.pending:
            raise StateError(
                f"{self.label}: microbatch {mb} has no forward waiting for this backward: "
                "it ran backward already (a second backward through graphed layers, e.g. "
                "retain_graph=True, is not supported) or close() abandoned it")
        if self.main_grads is not None:
            self._main_grads_in_place()
        if stack._lent:  # before anything below writes pool memory a lent buffer may share
            stack._give_back(self.index)
        # (brings back this microbatch's activations if another's graphs ran since)
        t = eng.ticket(self.group, mb)
        eng.wait_restored(t)
        out: list[torch.Tensor | None] = [None] * len(self.params)
        at = self._rng_at.pop(mb, None)  # (a runner without a backward graph draws nothing back)
        if self.bwd is not None:
            if grad.data_ptr() != self.static_grad_out.data_ptr():
                with torch.no_grad():
                    self.static_grad_out.copy_(grad)
            graph = self.bwd
            rng = self.rng if at is not None else None
            if rng is not None:  # the recompute draws what this microbatch's forward drew,
                newest = rng.position()  # and the next forward goes on from the newest one
                rng.seek(at)
            homes = self.homes
            with torch.no_grad():
                for _, h in homes:
                    h.prepare(h.fills_grad())
            try:
                if stack._tracing:
                    with stack._span(f"bwd {self.name}"):
                        graph.replay()
                    if stack.probe is not None:
                        stack.probe(f"B{self.layers[0]}")
                else:
                    graph.replay()
            except BaseException:
                with torch.no_grad():
                    for _, h in homes:
                        h.abandon()
                raise
            finally:
                if rng is not None:
                    rng.seek(newest)
            out = self._grads_out()
            if homes:
                with torch.no_grad():
                    for k, h in homes:
                        out[k] = h.finish()
            lent = [pg for pg in self.grads if pg is not None and not pg.copy]
            if lent:
                stack._lent[self.index] = lent
        self.pending.discard(mb)
        eng.consumed(t)
        # Look-ahead: the next offloaded layer's reload runs under this backward graph
        # (and under every graph up to it, when offloaded layers are spread out). Queued
        # after the replay: its copies wait for what this graph records as it goes (the
        # sections it is done with), so the replay must be launched first.
        prev = stack._next_backward(self.index)
        if prev is not None and mb in prev.pending:
            # (if its slot still holds another restore, that layer's backward waits for it)
            eng.restore_ahead(eng.ticket(prev.group, mb))
        gin = self.grad_in
        if gin is not None:
            if self.first:
                gin = stack._lend_input_grad(gin, input_ref)
            elif len(stack._runners[self.index - 1].pending) > 1:
                gin = gin.clone()  # another microbatch of the layer below may run in between
            else:
                gin = gin.detach()  # the layer below reads this buffer straight away
        return (gin, *out)

    def _main_grads_in_place(self) -> None:
        """The graph adds into the ``main_grad`` tensors it was captured with: refuse to
        replay once one was replaced (the sum would go to the old memory) or got a tensor
        hook (it would not run)."""
        assert self.main_grads is not None
        for p, mg in zip(self.params, self.main_grads):
            now = getattr(p, "main_grad", None)
            if now is not mg and not (isinstance(now, torch.Tensor) and now.data_ptr() == mg.data_ptr()
                                      and now.dtype == mg.dtype and now.shape == mg.shape
                                      and now.stride() == mg.stride()):
                raise StateError(
                    f"{self.label}: parameter {_param_name(self.stack.layers, p)}'s main_grad is no "
                    f"longer the tensor its backward graph adds into (at 0x{mg.data_ptr():x}); zero "
                    "main_grad in place instead of replacing it, or build the stack again")
            if p._backward_hooks:
                raise StateError(
                    f"{self.label}: parameter {_param_name(self.stack.layers, p)} got a tensor hook "
                    "after the build; with main_grad=True the backward graph adds its gradient "
                    "into main_grad itself, so the hook would never run")

    def give_back(self, pg: _ParamGrad) -> None:
        """``pg``'s buffer is about to be overwritten: whoever holds it as a gradient (its
        ``.grad`` under accumulation, or a kept reference) gets bytes of its own first."""
        if _use_count is not None and _use_count(pg.storage) <= pg.base_refs:
            return  # nobody kept it: the usual case after zero_grad(set_to_none=True)
        g = pg.grad()
        if g is not None and g.data_ptr() == pg.ptr:
            # The same tensor object keeps its identity (references to it stay good) and
            # gets its own bytes; autograd then adds the next gradient into it, as eagerly.
            g.data = g.clone()
        if pg.others_hold():
            self._move_out(pg)

    def _move_out(self, pg: _ParamGrad) -> None:
        """Somebody kept an earlier ``.grad`` that is this buffer: give it a copy of its own
        bytes before the graph overwrites them, and hand this parameter copies from now on."""
        _give_holders_own_bytes(pg.buf, pg.ptr, pg.ptr + 1, (pg.buf,))
        pg.copy = True

    def _grads_out(self) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for pg in self.grads:
            if pg is None:
                out.append(None)
            elif pg.copy:
                out.append(pg.buf.clone())
            else:
                # With .grad unset, autograd takes this tensor as .grad without a copy;
                # with .grad set, it adds this into it.
                out.append(pg.buf.detach())
        return out


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: _Runner, mb: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.runner, ctx.mb = runner, mb
        out = runner.forward(x, mb, True)
        if runner.index == 0:
            # The first layer's node outlives the others: when it dies without a backward
            # (the output was dropped), the stack gives back what the microbatch holds.
            weakref.finalize(ctx, runner.stack._abandoned.append, mb).atexit = False
            ctx.input = weakref.ref(x) if x.requires_grad else None
        # The last layer's output goes to the caller, who may keep it across the next
        # forward; inside the stack the next layer reads the buffer itself.
        return out.clone() if runner.stack._runners[-1] is runner else out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grads = ctx.runner.backward(grad, ctx.mb, getattr(ctx, "input", None))
        return (None, None, *grads)


def _layer_set(name: str, layers: Iterable[int], n: int) -> set[int]:
    """``layers`` as a set of layer indices; a UsageError naming what is not one."""
    chosen = list(layers)
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise UsageError(f"{name} {bad} are not layer indices (integers 0..{n - 1})")
    return set(chosen)


def _check_layers(layers: Any) -> None:
    """``layers`` is a non-empty sequence of modules."""
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise UsageError(f"layers must be a sequence of torch.nn.Module (a list, nn.Sequential "
                         f"or nn.ModuleList), got one {type(layers).__name__}: wrap it in a list")
    try:
        items = list(layers)
    except TypeError:
        raise UsageError(f"layers must be a sequence of torch.nn.Module, got "
                         f"{type(layers).__name__}") from None
    if not items:
        raise UsageError("GraphedLayers needs at least one layer")
    bad = [f"layers[{i}] is {type(m).__name__}" for i, m in enumerate(items)
           if not isinstance(m, nn.Module)]
    if bad:
        raise UsageError(f"layers must be torch.nn.Module instances: {', '.join(bad[:3])}")


def _param_name(layers: Iterable[nn.Module], p: torch.Tensor) -> str:
    """``layers[i].name`` of parameter ``p`` (its first place), for messages."""
    for i, m in enumerate(layers):
        for n, q in m.named_parameters():
            if q is p:
                return f"layers[{i}].{n}"
    return "a parameter"


def _check_main_grads(layers: Iterable[nn.Module]) -> None:
    """With ``main_grad=True``: every trainable parameter has a ``main_grad`` the backward
    graph can add its gradient into, and no tensor hook the graph would skip."""
    for i, m in enumerate(layers):
        for n, p in m.named_parameters():
            if not p.requires_grad:
                continue
            name = f"layers[{i}].{n}"
            mg = getattr(p, "main_grad", None)
            if not isinstance(mg, torch.Tensor):
                raise UsageError(
                    f"main_grad=True, but parameter {name} has "
                    + ("no main_grad attribute" if mg is None else f"main_grad of type {type(mg).__name__}")
                    + f"; give every trainable parameter a main_grad (e.g. torch.zeros_like(p, "
                    "dtype=torch.float32)) or build the stack without main_grad")
            if mg.shape != p.shape or mg.device != p.device or not mg.is_floating_point():
                raise UsageError(
                    f"main_grad=True, but parameter {name}'s main_grad is {list(mg.shape)} "
                    f"{mg.dtype} on {mg.device}; it must be a floating-point tensor of the "
                    f"parameter's shape {list(p.shape)} on {p.device}")
            if p._backward_hooks:
                raise UsageError(
                    f"main_grad=True, but parameter {name} has tensor hooks (register_hook): "
                    "the backward graph adds its gradient into main_grad itself, so they "
                    "would never run; use a post-accumulate-grad hook or build without main_grad")


def _check_sample(sample: Any, backend: Backend) -> None:
    """A sample input is one tensor on the backend's device type."""
    if not isinstance(sample, torch.Tensor):
        raise UsageError(f"sample_input must be a torch.Tensor of the shape, dtype and device "
                         f"the stack will see, got {type(sample).__name__}")
    if sample.device.type != backend.device.type:
        raise UsageError(f"sample_input is on {sample.device}, but the {backend.name} "
                         f"backend runs on {backend.device}")


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
            unless it is given (``"off"``: keep or recompute, never offload).
        min_offload_bytes: saved tensors smaller than this stay on the device.
        section_bytes: slots move to and from the host in sections of at most this many
            bytes (:data:`graphslot.offload.SECTION_BYTES`), each fenced on its own inside
            the graphs where the backend allows.
        offload_layers: indices of the layers whose activations are offloaded
            (default: every layer not in ``recompute_layers``); the others keep theirs on
            the device.
        recompute_layers: indices of the layers recomputed in the backward: the forward
            graph saves only the layer's input, and the backward graph runs the forward
            again (``torch.utils.checkpoint`` captured inside the graphs). A layer also in
            ``offload_layers`` sends that input to the host.
        memory_budget: bytes the training step may hold at its peak (the framework
            allocator's reserved bytes plus graphslot's pages, counting what the device
            holds when the stack is built), a size string (``"12GiB"``), or ``"auto"``
            (save memory only where the planner predicts it costs no time). The stack
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
        warmup_iters: eager iterations before capture.
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

    Raises:
        UsageError: no layers, a sample that is not a tensor on the backend's device, a
            bad layer index or mode, a budget below the least any plan reaches (the
            message names that least budget), a budget beside explicit layer lists, or
            with ``main_grad=True`` a parameter without a fitting ``main_grad``, with
            tensor hooks, or in several graphs.

    ``close()`` releases its slots, banks and host buffers; as a context manager
    (``with GraphedLayers(...) as stack:``) it closes on exit.
    """

    def __init__(self, layers: Sequence[nn.Module], sample_input: torch.Tensor, *,
                 mode: Mode | str | None = None, min_offload_bytes: int = 0,
                 section_bytes: int = SECTION_BYTES,
                 offload_layers: Iterable[int] | None = None,
                 recompute_layers: Iterable[int] | None = None,
                 memory_budget: int | str | None = None,
                 layers_per_graph: int | None = None, warmup_iters: int = 2,
                 backend: Backend | None = None, debug_checksums: bool = False,
                 main_grad: bool = False) -> None:
        super().__init__()
        _check_layers(layers)
        self.layers = nn.ModuleList(layers)
        self.backend = backend or get_backend()
        _check_sample(sample_input, self.backend)
        #: the backward graphs add into the parameters' ``main_grad`` (see ``main_grad``)
        self.main_grad = bool(main_grad)
        self._grad_homes = False  # (decided per build, in _make)
        if self.main_grad:
            _check_main_grads(self.layers)
        n = len(self.layers)
        if memory_budget is not None and (offload_layers is not None or recompute_layers is not None):
            raise UsageError("memory_budget plans which layers to offload and recompute: give "
                             "it, or offload_layers / recompute_layers, not both")
        recompute = _layer_set("recompute_layers", [] if recompute_layers is None else recompute_layers, n)
        offload = _layer_set("offload_layers", (set(range(n)) - recompute) if offload_layers is None
                             else offload_layers, n)
        if layers_per_graph is not None and (isinstance(layers_per_graph, bool)
                                             or not isinstance(layers_per_graph, int)
                                             or layers_per_graph < 1):
            raise UsageError(f"layers_per_graph must be a positive integer or None (join small "
                             f"layers), got {layers_per_graph!r}")
        modes = tuple(m.value for m in Mode) if mode is None else (Mode(mode).value,)
        self._engine_args: dict[str, Any] = dict(
            min_bytes=min_offload_bytes, section_bytes=section_bytes, debug_checksums=debug_checksums)
        self.warmup_iters = max(1, int(warmup_iters))
        self._microbatch = 0
        #: the layers each device graph covers, in order (see ``layers_per_graph``)
        self.graph_layers: tuple[tuple[int, ...], ...] = ()
        #: what ``memory_budget`` chose (:class:`graphslot.budget.BudgetPlan`, choices per
        #: layer); None without a budget
        self.plan: BudgetPlan | None = None
        self._runners: list[_Runner] = []
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
        self._lent: dict[int, list[_ParamGrad]] = {}  # by layer
        #: the first layer's input gradient buffer, lent as the stack's input gradient
        self._input_grad: _ParamGrad | None = None
        self._lock = threading.Condition()
        self._users = 0  # forwards and backwards under way (close() waits for them)
        self._in_backward: set[int] = set()  # microbatches whose backward pass has begun
        self._closed = False
        #: microbatches whose autograd graph died without a backward (appended by finalizers)
        self._abandoned: collections.deque[int] = collections.deque()
        try:
            saved = None if layers_per_graph is not None else saved_bytes_per_layer(
                list(self.layers), sample_input.detach().requires_grad_(sample_input.requires_grad))
            if memory_budget is None:
                self._make(Mode(modes[0]) if mode is not None else Mode.RESIDENT, offload,
                           recompute, layers_per_graph, saved, sample_input)
            else:
                self._make_planned(memory_budget, modes, layers_per_graph, saved, sample_input,
                                   section_bytes)
        except BaseException:
            self._unmake()  # what the failed build made goes before the error does
            self._warmup_stream = None
            raise
        # Dropped without close(): the pages, host buffers and threads go with the stack.
        self._finalizer = weakref.finalize(self, OffloadEngine.close, self.engine)
        self._finalizer.atexit = False
        # Each layer's look-ahead targets, once: a pass asks for them at every layer.
        offloaded = [r for r in self._runners if r.group.offloads]
        n = len(self._runners)
        self._ahead: list[_Runner | None] = [
            next((r for r in offloaded if r.index > i), None) for i in range(n)]
        self._behind: list[_Runner | None] = [
            next((r for r in reversed(offloaded) if r.index < i), None) for i in range(n)]

    def _make(self, mode: Mode, offload: set[int], recompute: set[int],
              layers_per_graph: int | None, saved: list[int] | None, sample: torch.Tensor) -> None:
        """Build the engine, the graphs' plan and every graph."""
        self.offload_layers, self.recompute_layers = set(offload), set(recompute)
        self._grad_homes = not self.main_grad and self._homes_pay(mode, saved, sample)
        self.engine = OffloadEngine(self.backend, mode, **self._engine_args)
        self.graph_layers = plan_graphs(len(self.layers), self.offload_layers, layers_per_graph,
                                        saved, recomputed=self.recompute_layers)
        self._runners = [_Runner(self, k, ls) for k, ls in enumerate(self.graph_layers)]
        self._build(sample)

    def _homes_pay(self, mode: Mode, saved: list[int] | None, sample: torch.Tensor) -> bool:
        """Does this build give gradients homes outside the pool (:class:`_GradHome`)?
        :func:`graphslot.budget.gradient_homes` says, from what the layers keep in the
        graphs' pool (``saved``, measured) against the gradients' bytes."""
        gone = self.recompute_layers | (self.offload_layers if mode is not Mode.OFF else set())
        kept = [i for i in range(len(self.layers)) if i not in gone]
        if not kept:
            return True
        if saved is None:  # (layers_per_graph given: not measured for joining layers)
            saved = saved_bytes_per_layer(list(self.layers),
                                          sample.detach().requires_grad_(sample.requires_grad))
        params = {id(p): p for m in self.layers for p in m.parameters() if p.requires_grad}
        grads = sum(p.numel() * p.element_size() for p in params.values())
        return gradient_homes(sum(saved[i] for i in kept), grads)

    def _unmake(self) -> None:
        """Give back what :meth:`_make` built (the graphs, their pool, slots and banks)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        self._runners = []
        self._pool_owner = None
        self._lent.clear()
        self._input_grad = None
        settle(self.backend)

    def _make_planned(self, budget: int | str, modes: tuple[str, ...], layers_per_graph: int | None,
                      saved: list[int] | None, sample: torch.Tensor, section_bytes: int) -> None:
        """Profile the stack, plan the budget and build, checking what each build holds
        (:func:`~graphslot.budget.fit_budget`: where the graphs hold more or less than the
        model said, the difference is counted and the plan made again)."""
        b, n = self.backend, len(self.layers)
        if not (isinstance(budget, str) and budget.strip().lower() == "auto"):
            parse_budget(budget)  # (a bad one fails before any work)
        units = plan_graphs(n, set(), layers_per_graph, saved)
        profile = self._profile(units, sample, section_bytes)
        mapped_before = b.ledger.mapped_bytes  # (other stacks' pages, say)
        builds = 0

        def build(plan: BudgetPlan) -> int | None:
            nonlocal builds
            if builds:
                self._unmake()
            builds += 1
            per_layer = tuple(plan.choices[k] for k, ls in enumerate(units) for _ in ls)
            self.plan = replace(plan, choices=per_layer)
            recomputed = set(self.plan.layers(RECOMPUTE))
            # (in a mode that offloads, a recomputed layer's input goes to the host too)
            offloaded = set(self.plan.layers(OFFLOAD)) | (recomputed if plan.mode != "off" else set())
            self._make(Mode(plan.mode), offloaded, recomputed, layers_per_graph, saved, sample)
            settle(b)
            held = held_bytes(b)
            if held is None:
                return None  # the allocator cannot tell: the model's figure stands
            # What the step adds to what the build holds: the banks it has not mapped now
            # (remap maps them only while a pass runs), and the copy of the output the
            # caller gets, as far as the allocator needs memory for it.
            banks = banks_bytes(profile, plan.choices, plan.mode)
            unmapped = max(0, banks - (b.ledger.mapped_bytes - mapped_before))
            return held + unmapped + self._output_copy_bytes(held)

        plan = fit_budget(profile, budget, build, modes=modes)
        self.plan = replace(plan, choices=tuple(plan.choices[k] for k, ls in enumerate(units)
                                                for _ in ls))

    def _output_copy_bytes(self, held: int) -> int:
        """What the caller's copy of the stack's output adds to ``held`` (what the process
        holds after the build): allocated once here and measured, since it often fits in
        memory the allocator holds already. The output's gradient and the loss are the
        caller's, made as the caller makes them (a preallocated gradient is in ``held``)."""
        probe = torch.empty_like(self._runners[-1].static_out)
        grown = held_bytes(self.backend)
        del probe
        return 0 if grown is None else max(0, grown - held)

    def _profile(self, units: tuple[tuple[int, ...], ...], sample: torch.Tensor,
                 section_bytes: int) -> StackProfile:
        """What each graph's layers cost, measured eagerly (:mod:`graphslot.profile`)."""
        b = self.backend
        mods = [self.layers[u[0]] if len(u) == 1 else nn.Sequential(*(self.layers[i] for i in u))
                for u in units]
        costs = profile_units(b, mods, sample)
        probe = min(max(c.saved_bytes for c in costs), 256 << 20) or (1 << 20)
        bw = copy_bandwidth(b, probe, reps=3)
        settle(b)
        # What the step holds whatever the plan: what the process holds now, and the
        # step's tensors outside the graphs (the output the caller gets and the stack's
        # input gradient; the output's gradient is the caller's, as its loss is); the
        # gradients, boundary buffers and the graphs' pool depend on the plan.
        held = held_bytes(b)
        if held is None:  # no allocator figures: what the process holds, where it can tell
            held = b.footprint_bytes() or 0
        fixed = held + 2 * costs[-1].input_bytes
        return StackProfile(tuple(costs), bw["d2h_gbps"], bw["h2d_gbps"], fixed_bytes=fixed,
                            granularity=b.granularity, section_bytes=section_bytes,
                            d2d_gbps=bw.get("d2d_gbps"))

    def _new_graph(self) -> DeviceGraph:
        g = self.backend.new_graph(share_pool_with=self._pool_owner)
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
            # The next layer is captured reading this layer's output buffer itself.
            x = out.detach().requires_grad_(x.requires_grad or bool(r.params))
            if i == 0 and pooled and not _shares_storage(r.static_out, r.static_in):
                view = self.backend.return_to_pool(r.static_in)
                if view is not None:
                    r.static_in = view
            if i >= 1:
                self._free_boundary(runners[i - 1], r)
        last = runners[-1]
        # (an output that views the layer's input stays: the input is another's buffer)
        if last.group.wants_offload and not _shares_storage(last.static_out, last.static_in):
            # The stack's output buffer is copied for the caller right after its replay;
            # nothing else reads it (a saved output is in the slot): the backward graphs,
            # captured next, may use its bytes.
            view = self.backend.return_to_pool(last.static_out)
            if view is not None:
                last.static_out = view
        grad_out: torch.Tensor | None = None
        for i in reversed(range(len(runners))):
            r = runners[i]
            r.build_backward(grad_out, shared)
            if i + 1 < len(runners) and runners[i + 1].grad_in is r.static_grad_out:
                # Layer i+1's input gradient is read by layer i's backward graph alone.
                view = self.backend.return_to_pool(r.static_grad_out)
                if view is not None:
                    r.static_grad_out = runners[i + 1].grad_in = view
            grad_out = r.grad_in
        first = runners[0]
        if first.grad_in is not None:
            # Handed out as the stack's input gradient (see _lend_input_grad).
            self._input_grad = _ParamGrad(None, first.grad_in, False)
        self.backend.synchronize()
        gc.collect()
        for r in self._runners:
            r.settle_refs()
        if self._input_grad is not None:
            self._input_grad.settle()

    def _pool_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A copy of ``like`` in memory of the graphs' shared pool (an allocation captured
        into an otherwise empty graph, which stays the pool's first owner)."""
        g = self._new_graph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the captured graph is empty
            with g.capture(self._warmup_stream):
                buf = torch.empty_like(like)
        with torch.no_grad():
            buf.copy_(like.detach())
        return buf

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

    def _free_boundary(self, a: _Runner, b: _Runner) -> None:
        """Layer ``a``'s output buffer is layer ``b``'s input, read by ``b``'s forward graph
        and by nothing after it when both layers offload every saved tensor (a saved input
        is copied into ``b``'s slot): give its bytes back to the pool, so later captures
        reuse them instead of each boundary holding an activation's worth for good."""
        if not (a.group.wants_offload and b.group.wants_offload) or a is self._runners[-1]:
            return
        if _shares_storage(b.static_out, b.static_in):  # b hands on a view of its input
            return
        view = self.backend.return_to_pool(a.static_out)
        if view is not None:
            a.static_out = b.static_in = view

    def _check_main_grads_graphs(self) -> None:
        """With ``main_grad=True``, a parameter in several graphs would get each graph's part
        added into ``main_grad`` in turn, where eager adds their sum: refuse it."""
        seen: set[int] = set()
        for r in self._runners:
            for p in r.params:
                if id(p) in seen:
                    raise UsageError(
                        f"main_grad=True, but parameter {_param_name(self.layers, p)} is in "
                        f"several graphs ({self.graph_layers}); give the layers that share it one "
                        "graph (layers_per_graph) or build without main_grad")
            seen.update(id(p) for p in r.params)

    def _shared_params(self) -> set[int]:
        seen: dict[int, int] = {}
        for m in self.layers:
            for p in {id(p): p for p in m.parameters()}.values():
                seen[id(p)] = seen.get(id(p), 0) + 1
        return {k for k, v in seen.items() if v > 1}

    @property
    def mode(self) -> Mode:
        return self.engine.mode

    def bank_index(self, layer: int) -> int:
        """Ping-pong bank of ``layer``'s graph: the graphs that offload alternate, in
        backward order."""
        k = next(k for k, ls in enumerate(self.graph_layers) if layer in ls)
        return sum(1 for ls in self.graph_layers[k + 1:] if ls[0] in self.offload_layers) % 2

    @property
    def timeline(self) -> Any:
        """A :class:`graphslot.trace.Timeline` recording compute and copy spans, or None."""
        return self.engine.timeline

    @timeline.setter
    def timeline(self, tl: Any) -> None:
        self.engine.timeline = tl

    @property
    def _tracing(self) -> bool:
        return self.engine.timeline is not None or self.probe is not None

    @property
    def gradient_buffers(self) -> list[torch.Tensor]:
        """The backward graphs' parameter-gradient buffers in their pool (what ``.grad`` may
        alias; not the gradient homes outside it)."""
        return [pg.buf for r in self._runners for pg in r.grads if pg is not None]

    @property
    def pool_bytes(self) -> int | None:
        """Bytes of the graphs' shared private pool, where the backend can tell."""
        return None if self._pool_owner is None else self._pool_owner.pool_bytes

    def _span(self, name: str) -> Any:
        tl = self.engine.timeline
        return contextlib.nullcontext() if tl is None else tl.span("compute", name)

    def _next_forward(self, i: int) -> _Runner | None:
        """The next layer in forward order whose activations are offloaded."""
        return self._ahead[i]

    def _next_backward(self, i: int) -> _Runner | None:
        """The next layer in backward order whose activations are offloaded (look-ahead)."""
        return self._behind[i]

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
        if self._closed:
            raise StateError("GraphedLayers: forward after close(); its slots and graphs are "
                             "released, build a new stack")
        self._runners[0].check_input(x)  # (before anything runs: a mismatch loses nothing)
        if self._abandoned:
            self._reap()
        self._microbatch += 1
        mb = self._microbatch
        runners = self._runners
        self._enter()
        try:
            try:
                if torch.is_grad_enabled() and (x.requires_grad or any(r.params for r in runners)):
                    for r in runners:
                        x = _LayerFunction.apply(r, mb, x, *r.params)
                    return x
                # No backward can follow: nothing is offloaded or kept for one.
                for r in runners:
                    x = r.forward(x, mb, False)
                return x.clone()
            except BaseException:
                self._abandon(mb)  # nobody holds this forward's output: no backward can come
                raise
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise StateError("GraphedLayers: used after close()")
            self._users += 1

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            self._lock.notify_all()

    def _abandon(self, mb: int) -> None:
        """Microbatch ``mb``'s backward will never run: give back what it holds."""
        eng = self.engine
        for r in self._runners:
            r.pending.discard(mb)
            r._rng_at.pop(mb, None)
            if not eng.closed:
                t = eng.find(r.group, mb)
                if t is not None:
                    eng.abandon(t)
        self._in_backward.discard(mb)

    def _reap(self) -> None:
        """Abandon the microbatches whose autograd graphs died without a backward."""
        while self._abandoned:  # one whose backward ran meanwhile holds nothing: a no-op
            self._abandon(self._abandoned.popleft())

    def close(self, timeout: float = 30.0) -> None:
        """Release the slots, banks and buffers (the graphs cannot replay afterwards).

        Safe to call again and from another thread: it waits up to ``timeout`` seconds for
        a forward or backward under way to finish, then refuses with a StateError. A
        microbatch whose backward has not run is abandoned; its backward then raises.
        """
        with self._lock:
            if self._closed:
                return
            def idle() -> bool:  # no replay, and no backward pass begun that can still go on
                return self._users == 0 and not any(
                    m in r.pending for m in self._in_backward for r in self._runners)

            if not self._lock.wait_for(idle, timeout):
                raise StateError(f"GraphedLayers.close(): another thread is still replaying "
                                 f"after {timeout:g} s; close() once it is done")
            self._closed = True
        self._finalizer.detach()
        self.engine.close()
        self._warmup_stream = None
        for r in self._runners:
            r._rng_at.clear()

    def __enter__(self) -> GraphedLayers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
