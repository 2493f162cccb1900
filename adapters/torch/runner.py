"""One device graph's consecutive layers (:class:`GraphRunner`): warm-up, discovery, the
capture of its forward and backward graphs, and their replays, with its saved activations
in an :class:`~graphslot.offload.OffloadUnit`; and the autograd function each replay runs
under (:class:`LayerFunction`). Imports :mod:`.grads` and :mod:`.plan`."""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from graphslot.backend import DeviceGraph, RngStream
from graphslot.errors import CaptureMismatchError, DriverError, StateError, UsageError
from graphslot.layer_calls import ctx_tensors, foreign_gradient_inputs, naming_refusals, next_node_number
from graphslot.offload import (KEEP, OFFLOAD, RECOMPUTE, OffloadUnit, leaves_on_device,
                               watching_saved_values)
from graphslot.precision import without_autocast
from graphslot.recompute import (CallKey, checkpointing_parts, cheap_recompute_contexts,
                                 noting_changed_buffers, noting_draws, noting_expensive_outputs,
                                 recompute_parts)

from .grads import (GradHome, ParamGrad, backward_into, give_holders_own_bytes, shares_storage, storage_id,
                    use_count)
from .plan import param_name, unit_label

if TYPE_CHECKING:
    from .stack import GraphedLayers


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


@contextlib.contextmanager
def restoring_contents(tensors: Sequence[torch.Tensor], inner: ContextManager[Any] | None = None,
                       wait_first: Callable[[], None] | None = None) -> Iterator[None]:
    """``inner`` (if any), with ``tensors`` holding again on the way out what they held on
    the way in, copied back in place: graphs read them where they are (copies made inside
    a capture are part of its graph). ``wait_first`` waits first for work that may still
    write them. Where the block fails, its error is the one raised."""
    kept = [t.detach().clone() for t in tensors]
    failed = False
    try:
        with inner or contextlib.nullcontext():
            yield
    except BaseException:
        failed = True
        raise
    finally:
        try:
            if wait_first is not None:
                wait_first()
            with torch.no_grad():
                for t, k in zip(tensors, kept):
                    t.copy_(k)
        except Exception:
            if not failed:
                raise


def own_generators(module: nn.Module) -> list[tuple[str, torch.Generator, torch.Tensor]]:
    """The random generators ``module`` and its submodules hold as attributes, other
    than torch's default ones (which the build forks), each with its qualified name and
    its state now."""
    defaults = {id(torch.default_generator)} | {
        id(g) for kind in ("cuda", "musa") for g in getattr(getattr(torch, kind, None), "default_generators", ())}
    return [(f"{prefix}.{attr}" if prefix else attr, g, g.get_state())
            for prefix, m in module.named_modules() for attr, g in vars(m).items()
            if isinstance(g, torch.Generator) and id(g) not in defaults]


class StackHost(Protocol):
    """What a runner needs of the stack that owns it beyond its public face; the stack
    hands each runner an object with these (its bookkeeping stays private to it)."""

    @property
    def warmup_stream(self) -> Any:
        """The side stream the warm-ups and captures run on (None once closed)."""

    @property
    def grad_homes(self) -> bool:
        """Whether this build gives gradients homes outside the graphs' pool."""

    @property
    def lent(self) -> dict[int, list[ParamGrad]]:
        """By layer: the gradient buffers of the pool lent out as ``.grad`` since the last step."""

    @property
    def in_backward(self) -> set[int]:
        """The microbatches whose backward has begun."""

    @property
    def runners(self) -> list[GraphRunner]:
        """The stack's runners, in forward order."""

    @property
    def abandoned(self) -> collections.deque[int]:
        """Microbatches whose autograd graph was dropped before their backward ran."""

    @property
    def ctx_overwritten(self) -> dict[int, str]:
        """Microbatches whose ctx-kept tensors a later forward overwrote: the refusal of
        their backward."""

    @property
    def tracing(self) -> bool:
        """Whether a timeline or probe watches the replays."""

    @property
    def closed(self) -> bool:
        """Whether the stack was closed."""

    def at_end_of_pass(self, mb: int) -> None:
        """At the end of the autograd pass now running, microbatch ``mb``'s backward is over."""

    def new_graph(self) -> DeviceGraph:
        """A graph over the stack's pool."""

    def capture_room(self) -> ContextManager[None]:
        """Around a capture into the stack's pool (room mapped ahead where it is on pages)."""

    def replaying(self, kind: str, index: int) -> None:
        """Before graph ``index``'s ``kind`` (``"fwd"``, ``"bwd"``) replay."""

    def give_back(self, layer: int | None) -> None:
        """Give the holders of lent buffers (of ``layer`` and below; all for None) their own."""

    def next_forward(self, index: int) -> GraphRunner | None:
        """The next runner in forward order whose activations are offloaded (prefetch)."""

    def next_backward(self, index: int) -> GraphRunner | None:
        """The next runner in backward order whose activations are offloaded (look-ahead)."""

    def span(self, name: str) -> ContextManager[Any]:
        """A timeline span around a replay."""

    def enter(self, token: object) -> None:
        """A backward replay begins, under ``token`` (refused after close(), and while
        another thread replays: close() waits for it)."""

    @property
    def inside(self) -> dict[object, int]:
        """The replays under way; a replay's ``finally`` pops its token from it with one
        C call (an interrupt cannot land between that call and its effect, as it can at
        the start of a Python function), then calls :meth:`left`."""

    def left(self) -> None:
        """A replay is over: wake close()."""

    def reap(self) -> None:
        """Give back what the microbatches in :attr:`abandoned` hold."""

    def lend_input_grad(self, buf: torch.Tensor, input_ref: weakref.ref[torch.Tensor] | None
                        ) -> torch.Tensor:
        """The first layer's input gradient, as eager hands it out."""

    def saw_kept_grad(self) -> None:
        """A gradient buffer lent as ``.grad`` was kept through a replay that overwrites
        it (the loop accumulates into ``.grad``, or zeroes it in place): it got bytes of
        its own."""


class GraphRunner:
    """One graph's consecutive layers (one, or several small ones): its graphs, static
    tensors and its offload unit (kept on the device when its layers do not offload)."""

    def __init__(self, stack: GraphedLayers, host: StackHost, index: int, layers: tuple[int, ...]) -> None:
        self.stack = stack  # (its public face: layers, backend, engine, the lists it was given)
        self.host = host  # (what else a runner needs of the stack)
        self.index = index  # position among the stack's graphs
        self.layers = layers
        mods = [stack.layers[i] for i in layers]
        # Not a submodule of the stack: its state_dict and parameters stay the layers' own.
        self.module: nn.Module = mods[0] if len(mods) == 1 else nn.Sequential(*mods)
        a, z = layers[0], layers[-1]
        self.name = f"layer{a}" if a == z else f"layers{a}-{z}"
        self.label = unit_label(layers)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        #: with ``main_grad=True``: each parameter's main_grad, which the backward graph adds into
        self.main_grads: list[torch.Tensor] | None = (
            [getattr(p, "main_grad") for p in self.params] if stack.main_grad else None)
        #: where no layer keeps activations in the pool: (position among ``params``, its
        #: gradient home the backward graph adds into) for each parameter that has one
        self.homes: list[tuple[int, GradHome]] = []
        # Warm-up and capture differentiate with respect to aliases of the parameters (same
        # memory, so the graphs read the very same addresses): the parameters' own tensor
        # hooks must run at each real backward, not once baked into a graph, and their
        # gradient accumulators must come from the training stream, not the capture's.
        self.unit: OffloadUnit
        self.pending: set[int] = set()  # microbatches whose backward has not run
        #: what custom autograd Functions' ctx keep that the next forward overwrites
        #: (``ctx_tensors``): one copy for all microbatches (see ``ctx_overwritten``)
        self.ctx_made: list[str] = []
        self.static_in: torch.Tensor
        self.wants_grad_in = False
        self.static_out: torch.Tensor
        self.static_grad_out: torch.Tensor
        self.grad_in: torch.Tensor | None = None
        self.grads: list[ParamGrad | None] = []
        self.fwd: DeviceGraph
        self.bwd: DeviceGraph | None = None
        # The stack's first layer copies its input in and hands its input gradient out as a
        # copy; the others read and write their neighbours' buffers themselves.
        self.first = index == 0
        #: recomputed part by part (``recompute_ops="parts"``): its forward runs each of these
        #: modules under a checkpoint of its own and saves what each is given, and its
        #: backward graph runs each again right before that part's backward
        self.parts: list[nn.Module] = ([p for i in layers for p in recompute_parts(stack.layers[i])]
                                       if layers[0] in stack.parts_layers else [])
        #: its forward saves only its input, and its backward graph runs the forward again
        self.recompute = layers[0] in stack.recompute_layers and not self.parts
        #: recomputed cheaply: its forward also keeps its expensive ops' outputs, and its
        #: backward graph runs only the cheap ops again (:mod:`graphslot.recompute`)
        self.cheap = layers[0] in stack.cheap_layers
        #: the expensive calls a cheap recompute runs again all the same (its forward
        #: changes their outputs in place), found before the warm-up
        self.recompute_calls: frozenset[CallKey] = frozenset()
        #: the buffers the forward changes (batch norm's running statistics): the
        #: recompute runs from them as the forward found them and puts them back as the
        #: forward left them, so they move once a step
        self.changed_buffers: list[torch.Tensor] = []
        # A recomputed layer's forward graph draws from the default generator, as every
        # layer's does and as in eager; its backward graph's recompute draws from a random
        # stream of its own, pointed where that microbatch's forward drew.
        self.rng: RngStream | None = None
        self._rng_at: dict[int, Any] = {}  # microbatch -> the default generator before its forward
        self._slot_at_capture: list[torch.Tensor | None] = []  # (see OffloadUnit.slot_snapshot)

    def forget_draws(self, mb: int | None = None) -> None:
        """Drop where microbatch ``mb``'s forward drew (all of them for None): no backward
        will draw it again."""
        if mb is None:
            self._rng_at.clear()
        else:
            self._rng_at.pop(mb, None)

    # -- build ---------------------------------------------------------------------------

    def build_forward(self, static_in: torch.Tensor) -> torch.Tensor:
        """Warm up, discover what the capture saves, allocate the slot, capture the forward."""
        stack, b, eng = self.stack, self.stack.backend, self.stack.engine
        is_state = leaves_on_device([self.module], b.device.type)
        self.static_in = static_in
        self.wants_grad_in = static_in.requires_grad
        aliases = [p.detach().requires_grad_() for p in self.params]
        inputs = ([static_in] if static_in.requires_grad else []) + aliases
        alias_of = {id(p): a for p, a in zip(self.params, aliases)}

        def run(x: torch.Tensor, *found: torch.Tensor) -> Any:
            with _parameters_as(self.module, alias_of), checkpointing_parts(self.parts):
                if found:  # (the changed buffers as this microbatch's forward found them)
                    with torch.no_grad():
                        for t, v in zip(self.changed_buffers, found):
                            t.copy_(v)
                return self.module(x)

        def call(note: Callable[[torch.Tensor], None] | None = None) -> Any:
            if self.recompute:
                # The recompute runs inside the backward graph's capture, so ``run`` swaps
                # the aliases in again there. Its random numbers come from the runner's
                # own stream (``self.rng``), not from state calls that would run in capture.
                # Recomputed cheaply, the expensive ops' outputs are kept (``note``d as
                # the unit's memory in the graphs' pool) and only the rest runs again.
                # The buffers the forward changes go in as inputs, saved (to the slot) as
                # the forward found them: a forward that reads what it changes (spectral
                # norm's power iteration, a step counter) runs again on what it read.
                found = [t.detach().clone() for t in self.changed_buffers]
                return torch.utils.checkpoint.checkpoint(
                    run, static_in, *found, use_reentrant=False, preserve_rng_state=False,
                    context_fn=functools.partial(self._recompute_contexts, note))
            return run(static_in)

        offload = self.layers[0] in stack.offload_layers
        policy = RECOMPUTE if self.recompute else OFFLOAD if offload else KEEP
        unit = self.unit = OffloadUnit(eng, self.name, policy,
                                       offload_input=self.recompute and offload)

        # Warm-up: eager iterations on a side stream (libraries initialise, autotuners
        # settle); autograd is untouched. Not on the current stream: if that is the legacy
        # default stream, an accumulator node the warm-up leaves alive would tie it to the
        # capture, which CUDA refuses. Every capture runs on that same stream: per-stream
        # library state (cuBLAS's workspace for each stream and thread) then exists from
        # the warm-up, in the ordinary pool, and no capture allocates another in a pool.
        side = self.host.warmup_stream
        b.wait_event(side, b.record_event(b.new_event()))
        own = [(i, *o) for i in self.layers for o in own_generators(stack.layers[i])]
        with b.stream(side), naming_refusals(self.label):
            if self.parts:
                self._check_parts(static_in)
            if self.recompute:
                # What the forward changes in place: a cheap recompute makes those expensive
                # outputs again instead of keeping them (torch's selective policy refuses
                # them), and every recompute leaves those buffers as the forward left them.
                noting: ContextManager[set[CallKey]] = (
                    noting_expensive_outputs() if self.cheap else contextlib.nullcontext(set()))
                with noting_changed_buffers(self.module) as buffers, noting as changed, \
                        watching_saved_values(lambda t: not is_state(t)) as late:
                    out = run(static_in)
                del out
                # (torch.utils.checkpoint's own backward reads such a tensor unfilled)
                self._refuse_filled_after_saving(late, "a recompute's backward then reads it as "
                                                 "saved, unfilled (torch.utils.checkpoint's too): "
                                                 "leave this layer out of recompute_layers")
                self.recompute_calls = frozenset(changed)
                self.changed_buffers = buffers
            warm_ctx: list[tuple[str, torch.Tensor]] | None = None
            for _ in range(stack.warmup_iters):
                since = next_node_number()
                # (the first: does the forward change a tensor after saving it? A slot
                # copies it when saved)
                watching: ContextManager[list[int]] = (
                    watching_saved_values(lambda t: not is_state(t))
                    if warm_ctx is None and unit.wants_offload else contextlib.nullcontext([]))
                with watching as late:
                    out = call()
                self._refuse_filled_after_saving(late, "its slot copies each saved tensor when it "
                                                 "is saved, so its backward would read what the "
                                                 "tensor held then. Keep this layer's activations "
                                                 "on the device: leave it out of offload_layers "
                                                 "(or give mode='off')")
                if not isinstance(out, torch.Tensor):
                    raise UsageError(f"{self.label} returned {type(out).__name__}; "
                                     "graphed layers must return one tensor")
                if warm_ctx is None:  # (held until the capture: see ctx_made)
                    warm_ctx = ctx_tensors(out)
                    foreign = foreign_gradient_inputs(out, {id(t) for t in inputs}, since)
                    if foreign:
                        raise UsageError(
                            f"GraphedLayers ({self.label}): the forward reads {foreign[0]}"
                            f"{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}, "
                            "which requires grad and is neither the layer's input nor one of "
                            "its parameters: the graphs would read the tensor the build saw at "
                            "every replay and give it no gradient. Register it as a parameter "
                            "of the layer that reads it (several layers may share one) or make "
                            "it inside the layer's forward; another module's output reaches a "
                            "graphed layer only as its input")
                if inputs and out.requires_grad:
                    with without_autocast(b.device.type):
                        warm = torch.autograd.grad(out, inputs, torch.ones_like(out),
                                                   allow_unused=True)
                    n_in = len(inputs) - len(aliases)
                    sparse = [(p, g.layout) for p, g in zip(self.params, warm[n_in:])
                              if g is not None and g.layout != torch.strided]
                    if sparse:
                        p, layout = sparse[0]
                        raise UsageError(
                            f"{self.label}: parameter {param_name(stack.layers, p)} "
                            f"gets a {layout} gradient (an embedding with sparse=True), "
                            "which a device graph cannot capture: give it dense gradients "
                            "(sparse=False) or keep the layer outside GraphedLayers")
                    del warm
                del out
        b.wait_event(b.current_stream(), b.record_event(b.new_event(), side))
        b.synchronize()
        drew = [(i, name) for i, name, g, state in own if not torch.equal(g.get_state(), state)]
        if drew:  # (before any capture: one would fail, or replay without moving it on)
            raise UsageError(
                f"layer {drew[0][0]} draws random numbers from a torch.Generator of its own "
                f"({drew[0][1]}), which its graphs cannot draw from as eager does: draw from the "
                "default generator (nn.Dropout, torch.rand without generator=), or keep the "
                "layer outside GraphedLayers")

        if unit.wants_offload:
            # Discovery under capture: kernels may save other tensors when captured than
            # when run eagerly (SDPA's memory-efficient kernel saves its RNG seed and
            # offset as device tensors only under capture), so the slot is laid out from
            # a capture, which is then thrown away.
            probe_graph = b.new_graph()  # a pool of its own, gone with it
            with self._naming_capture_errors("forward"), probe_graph.capture(side):
                with unit.discovering(is_state):
                    out = call()
            del out, probe_graph
            b.synchronize()
            b.empty_cache()
            unit.allocate(bank=stack.bank_index(self.layers[0]))
        else:
            unit.allocate()  # kept on the device: nothing to lay out

        fwd = self.host.new_graph()
        if self.recompute:
            self.rng = b.new_rng_stream()
            if self.rng is None:
                warnings.warn(f"GraphedLayers: the {b.name} backend's graphs have no random stream "
                              "of their own: random ops (dropout) in a recomputed layer draw "
                              "other numbers in its backward than in its forward", stacklevel=2)
        with self._naming_capture_errors("forward"), self.host.capture_room(), fwd.capture(side), \
                unit.capture_forward(is_state):
            out = call(unit.keep_also if self.cheap else None)
        self.fwd = fwd
        if fwd.executes_during_capture:  # (see OffloadUnit.slot_snapshot)
            with b.stream(side):
                self._slot_at_capture = unit.slot_snapshot()
        # A ctx tensor the next forward overwrites is one copy for every microbatch: one the
        # capture made anew, or the input (or a view of it), the buffer the layer below
        # writes. One the warm-up's ctx held too (a parameter, a module's state) stays.
        # Only plain tensors are judged: a library's wrapper subclass keeps its data
        # elsewhere (and may report a new empty storage at each call).
        def plain(found: list[tuple[str, torch.Tensor]] | None) -> list[tuple[str, torch.Tensor]]:
            return [(n, t) for n, t in found or () if type(t) in (torch.Tensor, nn.Parameter)]

        was = {storage_id(t) for _, t in plain(warm_ctx)} - {storage_id(static_in)}
        self.ctx_made = sorted({name for name, t in plain(ctx_tensors(out)) if storage_id(t) not in was})
        del warm_ctx, was
        self._out = out  # the captured autograd graph, until the backward graphs exist
        self._inputs = inputs
        self.static_out = out.detach()
        return self.static_out

    def _check_parts(self, static_in: torch.Tensor) -> None:
        """Refuse a layer recomputed part by part whose forward draws random numbers,
        changes its buffers or changes a part's input in place: a part's recompute would
        draw other numbers or change them a second time (recomputing the whole layer
        restores both), or find its saved input changed."""
        inplace: list[str] = []
        with noting_changed_buffers(self.module) as changed, noting_draws() as drawn, \
                checkpointing_parts(self.parts, inplace):
            out = self.module(static_in)
        del out
        why = (f"draws random numbers ({drawn[0]}), which a part run again would draw anew"
               if drawn else
               f"changes its buffers ({len(changed)}: batch norm's running statistics, say), "
               "which a part run again would change a second time" if changed else
               f"changes what its part {inplace[0]} is given in place (an in-place activation "
               "as a part, say), after that part's checkpoint saved it" if inplace else None)
        if why:
            raise UsageError(f"{self.label}, recomputed part by part (recompute_ops='parts'): "
                             f"its forward {why}. Recompute it whole (recompute_ops='all'), "
                             "which runs the forward again as it ran, or keep its activations")

    def _refuse_filled_after_saving(self, late: list[int], why: str) -> None:
        """Refuse the build where :func:`watching_saved_values` found saved tensors
        (``late``, their indices) changed after they were saved; ``why`` that matters."""
        if late:
            raise UsageError(f"{self.label}: its forward changes a tensor in place after saving it "
                             f"for backward (saved tensor #{late[0]}; RReLU's kernel fills the "
                             f"noise it saved, for one), and {why}")

    def build_backward(self, static_grad_out: torch.Tensor | None, shared: set[int]) -> None:
        """Capture the backward graph (after every forward, in reverse layer order)."""
        b, out, inputs = self.stack.backend, self._out, self._inputs
        wants_grad_in = self.wants_grad_in
        slot_at_capture, self._slot_at_capture = self._slot_at_capture, []
        differentiable = bool(inputs) and out.requires_grad
        # (the layer above's input gradient may be an expanded view, one element standing
        # for many: another microbatch's gradient could not be copied into it)
        own = (static_grad_out is None or static_grad_out.shape != out.shape
               or torch._debug_has_internal_overlap(static_grad_out) != 0)
        if own and not differentiable:
            static_grad_out = torch.zeros_like(out)
        targets: list[torch.Tensor | None] | None = list(self.main_grads or []) or None
        if targets is None and self.host.grad_homes and differentiable:
            # Shared parameters (eager adds their parts first, then into .grad) and hooked
            # ones (the hook sees each gradient) keep a pool buffer.
            self.homes = [(k, GradHome(p)) for k, p in enumerate(self.params)
                          if id(p) not in shared and not p._backward_hooks]
            if self.homes:
                by_param = dict(self.homes)
                targets = [by_param[k].home if k in by_param else None
                           for k in range(len(self.params))]
        try:
            if differentiable:
                bwd = self.host.new_graph()
                if slot_at_capture:  # (see OffloadUnit.slot_snapshot)
                    with b.stream(self.host.warmup_stream):
                        self.unit.restore_slot(slot_at_capture)
                del slot_at_capture
                # A backend whose capture runs the work (cpu) would add the capture's gradient
                # (from whatever the static buffers hold) into the targets: put them back after.
                before = ([None if t is None else t.clone() for t in targets] if targets is not None
                          and bwd.executes_during_capture else None)
                drawing = self._attach_rng(bwd)
                with self.host.capture_room(), bwd.capture(self.host.warmup_stream), drawing(), \
                        without_autocast(b.device.type):
                    if own:
                        # The stack's last gradient buffer, from the graphs' pool: the caller's
                        # gradient is copied in right before each replay and only this graph
                        # reads it, so once captured the stack gives its bytes back.
                        static_grad_out = torch.empty_like(out)
                    grads: tuple[torch.Tensor | None, ...]
                    if targets is None:
                        grads = torch.autograd.grad(out, inputs, static_grad_out, allow_unused=True)
                    else:
                        grads, reached = backward_into(targets, out, inputs, static_grad_out)
                        # A parameter the layers leave unused keeps .grad None, as in eager
                        # (a home would hand it zeros, which an optimizer then steps on).
                        self.homes = [(k, h) for k, h in self.homes if k in reached]
                    # A parameter's gradient that is its layer's output gradient (x + p with
                    # p of x's shape) or its input gradient (tanh(x + p)) would be lent as a
                    # buffer another graph writes, or gives back to the pool: it gets bytes
                    # of its own. So does one in another parameter's storage (tanh(x + p +
                    # q), or a fused kernel's gradients split by parameter): a lent buffer
                    # is one .grad's alone (clipping would scale one buffer twice).
                    k = int(wants_grad_in)
                    shared_with = [t for t in (static_grad_out, grads[0] if k else None)
                                   if t is not None]
                    param_grads: list[torch.Tensor | None] = []
                    for g in grads[k:]:
                        if g is not None:
                            if any(shares_storage(g, t) for t in shared_with):
                                g = g.clone()
                            shared_with.append(g)
                        param_grads.append(g)
                    grads = (*grads[:k], *param_grads)
                if before is not None:
                    with torch.no_grad():
                        for target, was in zip(targets or [], before):
                            if target is not None and was is not None:
                                target.copy_(was)
                    del before
                del targets
                self.bwd = bwd
                grad_list = list(grads)
                self.grad_in = grad_list.pop(0) if wants_grad_in else None
                # (None where the graph adds into main_grad or a gradient home itself)
                self.grads = [None if gbuf is None else ParamGrad(p, gbuf, id(p) in shared or bool(p._backward_hooks))
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
        self.unit.finish_capture()  # (a unit that keeps its activations learns where they are)
        # Drop the captured autograd graph: its accumulator nodes were made on the capture
        # stream, and training must make its own on the training stream.
        del self._out, self._inputs

    @contextlib.contextmanager
    def _naming_capture_errors(self, what: str) -> Iterator[None]:
        """A capture that fails says which layer and why that usually is."""
        try:
            yield
        except (DriverError, UsageError):
            raise  # (memory, or a wrong argument: not the layer's work)
        except Exception as e:
            raise StateError(
                f"{self.label}: capturing the {what} graph failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Work whose shape or path "
                "depends on the data (nonzero, .item(), a branch on a tensor's value, "
                "routing tokens by index) cannot be captured: keep such a layer outside "
                "GraphedLayers.") from e

    def _recompute_contexts(self, note: Callable[[torch.Tensor], None] | None
                            ) -> tuple[ContextManager[Any], ContextManager[Any]]:
        """The checkpoint's ``context_fn``: the cheap policy's contexts where the layer is
        recomputed cheaply, and around the recompute, its changed buffers put back."""
        forward, recompute = (cheap_recompute_contexts(note, self.recompute_calls)() if self.cheap
                              else (contextlib.nullcontext(), contextlib.nullcontext()))
        return forward, restoring_contents(self.changed_buffers, recompute)

    def _attach_rng(self, graph: DeviceGraph) -> Callable[[], ContextManager[None]]:
        """Before ``graph``'s capture: what to enter inside it so that its random ops draw
        from the runner's stream (nothing without one)."""
        if self.rng is None:
            return contextlib.nullcontext
        self.rng.attach(graph)
        return self.rng.drawing

    def count_own_refs(self) -> None:
        """After the build: count the references graphslot itself holds to each buffer."""
        for pg in self.grads:
            if pg is not None:
                pg.count_own_refs()
        for _, h in self.homes:
            h.count_own_refs()

    # -- run -------------------------------------------------------------------------------

    def fits(self, x: Any) -> bool:
        """``x`` is one tensor of the shape, dtype and device the capture fixed."""
        si = self.static_in
        return (isinstance(x, torch.Tensor) and x.shape == si.shape and x.dtype == si.dtype
                and x.device == si.device)

    def check_input(self, x: Any) -> None:
        """``x`` is what the capture fixed: one tensor of its shape, dtype and device, and
        no input that wants a gradient where the graphs were captured computing none."""
        si = self.static_in
        if not isinstance(x, torch.Tensor):
            raise CaptureMismatchError(f"the graph of {self.label} was captured for one tensor "
                                       f"input, got {type(x).__name__}")
        if not self.fits(x):
            raise CaptureMismatchError(
                f"the graph of {self.label} was captured for input {list(si.shape)} {si.dtype} "
                f"on {si.device}, got {list(x.shape)} {x.dtype} on {x.device}: a training "
                "forward replays graphs, which fix their input's shape, dtype and device. Feed "
                "that shape (a DataLoader with drop_last=True, or the last batch padded), or "
                "build a stack for each shape; forwards without gradients (torch.no_grad(), "
                "model.eval()) run the layers eagerly, on any input")
        if x.requires_grad and not self.wants_grad_in and torch.is_grad_enabled():
            # (its backward graph computes no input gradient: x.grad would stay None)
            raise CaptureMismatchError(
                f"{self.label} was captured for an input without requires_grad (the "
                "sample_input's), got one that requires grad; build the stack with a sample "
                "input that requires grad (sample.requires_grad_()) to get its gradient")

    def trains(self) -> bool:
        """Whether a parameter of its layers wants a gradient now (one frozen since the
        build no longer does)."""
        return any(p.requires_grad for p in self.params)

    def forward(self, x: torch.Tensor, mb: int, training: bool) -> torch.Tensor:
        # (GraphedLayers.forward checked the stack's input)
        if mb in self.pending:
            raise StateError(f"{self.label}: microbatch {mb} ran forward again before its backward")
        self.host.replaying("fwd", self.index)
        if self.host.lent:
            self.host.give_back(None)
        unit = self.unit
        # An offloaded unit makes the next offloaded one's slot writable ahead.
        nxt = self.host.next_forward(self.index) if unit.offloads else None
        # (moves out what another microbatch keeps in the graphs' memory, if one does)
        with unit.forward(mb, training=training, prefetch=None if nxt is None else nxt.unit):
            if x.data_ptr() != self.static_in.data_ptr():
                with torch.no_grad():
                    self.static_in.copy_(x)
            if self.rng is not None and training:
                self._rng_at[mb] = self.rng.framework_position()
            self._replay(self.fwd, f"fwd {self.name}", f"F{self.layers[-1]}")
        if training:
            self.pending.add(mb)
        return self.static_out

    def backward(self, grad: torch.Tensor | None, mb: int,
                 input_ref: weakref.ref[torch.Tensor] | None = None) -> tuple[torch.Tensor | None, ...]:
        """Replay microbatch ``mb``'s backward; ``input_ref``: the stack's input (the first
        layer's), whose gradient the returned input gradient becomes. ``grad`` None: no
        gradient reached this layer (a layer above stops it): as in eager, its parameters
        and its input get none, and what its forward kept for the microbatch is given back."""
        if self.host.closed:
            raise StateError(f"{self.label}: backward of microbatch {mb} after close(); "
                             "close() abandoned the forward it belonged to")
        token, inside = object(), self.host.inside
        try:
            self.host.enter(token)
            if self.host.abandoned:
                # (one whose pass stopped above the stack's first layer may hold a bank this
                # backward needs: its look-ahead restore)
                self.host.reap()
            return self._backward(grad, mb, input_ref)
        finally:
            inside.pop(token, None)
            self.host.left()

    def _no_backward(self, mb: int) -> tuple[None, ...]:
        self._check_pending(mb)
        self.pending.discard(mb)
        self._rng_at.pop(mb, None)
        self.unit.abandon(mb)
        return (None,) * (1 + len(self.params))

    def _check_pending(self, mb: int) -> None:
        if mb not in self.pending:
            raise StateError(
                f"{self.label}: microbatch {mb} has no forward waiting for this backward: "
                "it ran backward already (a second backward through graphed layers, e.g. "
                "retain_graph=True, is not supported), an earlier pass ended without reaching "
                "this layer (backward(inputs=...) stopping above it), or close() abandoned it")

    def _backward(self, grad: torch.Tensor | None, mb: int, input_ref: weakref.ref[torch.Tensor] | None
                  ) -> tuple[torch.Tensor | None, ...]:
        # A backward pass is one unit for close(): from its first layer to the stack's
        # first, or to the end of autograd's pass where it stops above (a frozen layer
        # below, backward(inputs=...)).
        if mb not in self.host.in_backward:
            why = self.host.ctx_overwritten.pop(mb, None)
            if why is not None:  # (before any layer of the stack replays for it)
                raise UsageError(why)
            self.host.in_backward.add(mb)
            self.host.at_end_of_pass(mb)
        try:
            out = (self._no_backward(mb) if grad is None else
                   self._replay_backward(grad, mb, input_ref))
        except BaseException:
            self.host.in_backward.discard(mb)
            raise
        if self.index == 0:
            self.host.in_backward.discard(mb)
        return out

    def _replay(self, graph: DeviceGraph, span: str, probe: str) -> None:
        """Replay ``graph`` on the current stream: under a timeline's ``span`` and then the
        stack's probe (``probe`` its label) where they watch; else an offloading layer's
        replay between two timing events recorded there, as a timeline's span records them.

        Measured on the H200 (eight Llama-3-8B layers, resident, per microbatch): with
        them, 368.7 ms at four microbatches a step and 371.7 at one; without, 396-398
        and 382-384. Events without timing (lent ones) changed nothing, nor did timing
        events around the copies. Why the device then runs these graphs and their copy
        streams' waits better is not known. A new timing event costs the host about 3 us.
        """
        if self.host.tracing:
            with self.host.span(span):
                graph.replay()
            if self.stack.probe is not None:
                self.stack.probe(probe)
        elif self.unit.offloads:
            b = self.stack.backend
            b.record_event(b.new_event(timing=True))
            graph.replay()
            b.record_event(b.new_event(timing=True))
        else:
            graph.replay()

    def _replay_backward(self, grad: torch.Tensor, mb: int, input_ref: weakref.ref[torch.Tensor] | None
                         ) -> tuple[torch.Tensor | None, ...]:
        self._check_pending(mb)
        self.host.replaying("bwd", self.index)
        if self.main_grads is not None:
            self._main_grads_in_place()
        if self.host.lent:  # before anything below writes pool memory a lent buffer may share
            self.host.give_back(self.index)
        # Look-ahead: the next offloaded layer's reload runs under this backward graph
        # (and under every graph up to it, when offloaded layers are spread out); if its
        # slot still holds another restore, that layer's backward waits for it.
        prev = self.host.next_backward(self.index)
        # (brings back this microbatch's activations if another's graphs ran since)
        with self.unit.backward(mb, ahead=None if prev is None else prev.unit):
            out: list[torch.Tensor | None] = [None] * len(self.params)
            at = self._rng_at.pop(mb, None)  # (a runner without a backward graph draws nothing back)
            if self.bwd is not None:
                if grad.data_ptr() != self.static_grad_out.data_ptr():
                    with torch.no_grad():
                        self.static_grad_out.copy_(grad)
                graph = self.bwd
                if self.rng is not None and at is not None:
                    self.rng.seek(at)  # the recompute draws what this microbatch's forward drew
                homes = self.homes
                with torch.no_grad():
                    for _, h in homes:
                        h.prepare(h.fills_grad())
                try:
                    self._replay(graph, f"bwd {self.name}", f"B{self.layers[0]}")
                except BaseException:
                    with torch.no_grad():
                        for _, h in homes:
                            h.abandon()
                    raise
                out = self._grads_out()
                if homes:
                    with torch.no_grad():
                        for k, h in homes:
                            out[k] = h.finish()
                lent = [pg for pg in self.grads if pg is not None and not pg.copy]
                if lent:
                    self.host.lent[self.index] = lent
            self.pending.discard(mb)
        gin = self.grad_in
        if gin is not None:
            if self.first:
                gin = self.host.lend_input_grad(gin, input_ref)
            elif len(self.host.runners[self.index - 1].pending) > 1:
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
                    f"{self.label}: parameter {param_name(self.stack.layers, p)}'s main_grad is no "
                    f"longer the tensor its backward graph adds into (at 0x{mg.data_ptr():x}); zero "
                    "main_grad in place instead of replacing it, or build the stack again")
            if p._backward_hooks:
                raise StateError(
                    f"{self.label}: parameter {param_name(self.stack.layers, p)} got a tensor hook "
                    "after the build; with main_grad=True the backward graph adds its gradient "
                    "into main_grad itself, so the hook would never run")

    def give_back(self, pg: ParamGrad) -> None:
        """``pg``'s buffer is about to be overwritten: whoever holds it as a gradient (its
        ``.grad`` under accumulation, or a kept reference) gets bytes of its own first."""
        if use_count is not None and use_count(pg.storage) <= pg.base_refs:
            return  # nobody kept it: the usual case after zero_grad(set_to_none=True)
        kept = False
        g = pg.grad()
        if g is not None and g.data_ptr() == pg.ptr:
            # The same tensor object keeps its identity (references to it stay good) and
            # gets its own bytes; autograd then adds the next gradient into it, as eagerly.
            g.data = g.clone()
            kept = True
        if pg.others_hold():
            self._move_out(pg)
            kept = True
        if kept and pg.param is not None:  # (the stack's input gradient is no parameter's)
            self.host.saw_kept_grad()

    def _move_out(self, pg: ParamGrad) -> None:
        """Somebody kept an earlier ``.grad`` that is this buffer: give it a copy of its own
        bytes before the graph overwrites them, and hand this parameter copies from now on."""
        give_holders_own_bytes(pg.buf, pg.ptr, pg.ptr + 1, (pg.buf,))
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


class LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: GraphRunner, mb: int, lowest: bool, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        # (a layer above that stops the gradient, x.detach(), sends none: not zeros)
        ctx.set_materialize_grads(False)
        ctx.runner, ctx.mb = runner, mb
        out = runner.forward(x, mb, True)
        if lowest:
            # The lowest layer's node outlives the others: when it dies without a backward
            # (the output was dropped), the stack gives back what the microbatch holds.
            weakref.finalize(ctx, runner.host.abandoned.append, mb).atexit = False
            ctx.input = weakref.ref(x) if x.requires_grad else None
        # The last layer's output goes to the caller, who may keep it across the next
        # forward; inside the stack the next layer reads the buffer itself.
        return out.clone() if runner.host.runners[-1] is runner else out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:
        if grad is not None and torch.is_grad_enabled():
            # (the gradients a replay returns have no autograd history: a second backward
            # through them would get none of these layers' part, silently)
            raise StateError(
                f"GraphedLayers: a backward with create_graph=True (a double backward, such as "
                f"a gradient penalty) reached {ctx.runner.label}, whose backward is a captured "
                "graph computing first-order gradients only: its gradients cannot be "
                "differentiated again. Keep the layers that a double backward goes through "
                "outside GraphedLayers")
        grads = ctx.runner.backward(grad, ctx.mb, getattr(ctx, "input", None))
        return (None, None, None, *grads)

