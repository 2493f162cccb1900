"""Plain PyTorch: a stack of layers as graphed callables with activation offload.

    from graphslot.adapters.torch import GraphedLayers

    stack = GraphedLayers(blocks, sample_input, mode="resident")   # or "remap", "off"
    for batch in data:
        loss = head(stack(embed(batch))).mean()
        loss.backward()
        opt.step(); opt.zero_grad()

Each layer gets a forward and a backward device graph, in the spirit of
``torch.cuda.make_graphed_callables``. Saved activations go through graphslot slots:
the backward graph reads them at a fixed address, and between forward and backward
they wait on the host (``resident``: two mapped banks per slot class, no driver calls;
``remap``: the device pages are released). ``off`` graphs without offload.

Parameters and buffers are never offloaded. Several microbatches may be in flight
before their backward (with ``resident`` or ``remap``); gradient accumulation,
``loss.backward()`` and any optimizer work as usual.

Limits, as for device graphs in general: each layer takes one tensor and returns one
tensor of fixed shape, dtype and device; no host synchronisation or data-dependent
shapes inside a layer; random ops (dropout) are not supported inside graphed layers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from graphslot.backend import Backend
from graphslot.errors import CaptureMismatchError, StateError, UsageError
from graphslot.offload import Mode, OffloadEngine, OffloadGroup
from graphslot.selection import get_backend

__all__ = ["GraphedLayers"]


class _Runner:
    """One layer: its graphs, static tensors and offload group."""

    def __init__(self, stack: GraphedLayers, index: int, module: nn.Module) -> None:
        self.stack = stack
        self.index = index
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.group: OffloadGroup | None = None
        self.in_flight: set[int] = set()
        self.static_in: torch.Tensor
        self.static_out: torch.Tensor
        self.static_grad_out: torch.Tensor
        self.static_grads: tuple[torch.Tensor | None, ...]

    # -- build ---------------------------------------------------------------------------

    def _state_storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in [*self.module.parameters(), *self.module.buffers()]}

    def build_forward(self, sample: torch.Tensor) -> torch.Tensor:
        """Warm up (discovery), allocate the slot, capture the forward graph."""
        st, b, eng = self.stack, self.stack.backend, self.stack.engine
        state = self._state_storages()
        self.static_in = sample.detach().clone().requires_grad_(sample.requires_grad)
        inputs = ([self.static_in] if sample.requires_grad else []) + self.params

        dev = b.device

        def is_state(t: torch.Tensor) -> bool:
            # Parameters and buffers are never offloaded; neither are host-side or empty
            # tensors some kernels save (e.g. RNG seeds), which cost the device nothing.
            return t.device != dev or t.numel() == 0 or t.untyped_storage().data_ptr() in state

        if eng.mode is not Mode.OFF and self.index in st.offload_layers:
            self.group = eng.group(f"layer{self.index}")

        def discover(t: torch.Tensor) -> torch.Tensor:
            if not is_state(t):
                self.group.discover(t)  # type: ignore[union-attr]
            return t

        # Discovery: eager warm-up on a side stream; autograd is untouched. Not on the
        # current stream: if that is the legacy default stream, any accumulator node the
        # warm-up leaves alive would tie it to the capture, which CUDA refuses.
        side = b.new_stream()
        b.wait_event(side, b.record_event(b.new_event()))
        with b.stream(side):
            for _ in range(st.warmup_iters):
                if self.group is not None:
                    self.group.restart_discovery()
                    with torch.autograd.graph.saved_tensors_hooks(discover, lambda t: t):
                        out = self.module(self.static_in)
                else:
                    out = self.module(self.static_in)
                if not isinstance(out, torch.Tensor):
                    raise UsageError(f"layer {self.index} returned {type(out).__name__}; "
                                     "graphed layers must return one tensor")
                if inputs and out.requires_grad:
                    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
                del out
        b.wait_event(b.current_stream(), b.record_event(b.new_event(), side))
        b.synchronize()

        if self.group is not None:
            self.group.allocate(bank_index=st.bank_index(self.index))

        fwd = b.new_graph(share_pool_with=st._pool_owner)
        st._pool_owner = st._pool_owner or fwd
        if self.group is not None:
            g = self.group
            g.begin_capture()

            def pack(t: torch.Tensor) -> torch.Tensor:
                return t if is_state(t) else g.save_tensor(t)

            with fwd.capture():
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = self.module(self.static_in)
                g.forward_captured()
        else:
            with fwd.capture():
                out = self.module(self.static_in)
        self.static_out = out
        self.static_grad_out = torch.zeros_like(out)
        self.fwd = fwd
        self._inputs = inputs
        self._wants_grad_in = sample.requires_grad
        return out.detach()

    def build_backward(self) -> None:
        """Capture the backward graph (after every forward: see GraphedLayers)."""
        b, out, inputs = self.stack.backend, self.static_out, self._inputs
        bwd = b.new_graph(share_pool_with=self.stack._pool_owner)
        if inputs and out.requires_grad:
            try:
                with bwd.capture():
                    grads = torch.autograd.grad(out, inputs, self.static_grad_out, allow_unused=True)
            except Exception as e:
                raise StateError(
                    f"layer {self.index}: capturing the backward graph failed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0]}). A common cause is an autograd graph from earlier "
                    "eager work that is still alive (a kept loss, or a saved-tensor hook that "
                    "returned its argument without a backward): its parameter accumulators "
                    "then belong to the default stream. Build GraphedLayers before such work "
                    "or drop those references.") from e
        else:
            grads = tuple(None for _ in inputs)  # type: ignore[misc]  # nothing to differentiate
        if self.group is not None:
            self.group.finish_capture()
        self.bwd = bwd
        self.has_bwd = bool(inputs) and out.requires_grad
        grad_list = list(grads)
        self.grad_in = grad_list.pop(0) if self._wants_grad_in else None
        self.static_grads = tuple(grad_list)
        del self._inputs

    # -- run -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        si = self.static_in
        if x.shape != si.shape or x.dtype != si.dtype or x.device != si.device:
            raise CaptureMismatchError(
                f"layer {self.index} was captured for input {list(si.shape)} {si.dtype} on "
                f"{si.device}, got {list(x.shape)} {x.dtype} on {x.device}")
        eng = self.stack.engine
        if self.group is None:
            if self.in_flight:
                raise StateError(f"layer {self.index} keeps its activations in its graph's own "
                                 "memory (mode 'off', or not in offload_layers), one microbatch "
                                 "at a time; run backward first, or offload this layer to keep "
                                 "several microbatches in flight")
            self.in_flight.add(mb)
            ticket = None
        else:
            ticket = eng.before_forward(self.group, mb)
            nxt = self.stack._next_forward(self.index)
            if nxt is not None and nxt.group is not None:
                eng.prefetch_forward(nxt.group)
        with torch.no_grad():
            si.copy_(x)
        with self.stack._span(f"fwd layer{self.index}"):
            self.fwd.replay()
        if self.stack.probe is not None:
            self.stack.probe(f"F{self.index}")
        if ticket is not None:
            eng.after_forward(ticket)
        return self.static_out.detach().clone()

    def backward(self, grad: torch.Tensor, mb: int) -> tuple[torch.Tensor | None, ...]:
        eng = self.stack.engine
        if self.group is None:
            if mb not in self.in_flight:
                raise StateError(f"layer {self.index}: backward for microbatch {mb} before its forward")
            self.in_flight.discard(mb)
            t = None
        else:
            t = eng.ticket(self.group, mb)
            eng.wait_restored(t)
        # Look-ahead: the next offloaded layer's reload runs under this backward graph
        # (and under every graph up to it, when offloaded layers are spread out).
        prev = self.stack._next_backward(self.index)
        if prev is not None:
            eng.restore(eng.ticket(prev.group, mb))
        if self.has_bwd:
            with torch.no_grad():
                self.static_grad_out.copy_(grad)
            with self.stack._span(f"bwd layer{self.index}"):
                self.bwd.replay()
            if self.stack.probe is not None:
                self.stack.probe(f"B{self.index}")
        if t is not None:
            eng.consumed(t)
        # Clones: autograd may keep a returned gradient as .grad (it steals sole
        # references), and the next replay would overwrite it in place.
        gin = self.grad_in.detach().clone() if self.grad_in is not None else None
        return (gin, *(g.detach().clone() if g is not None else None for g in self.static_grads))


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: _Runner, mb: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.runner, ctx.mb = runner, mb
        return runner.forward(x, mb)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grads = ctx.runner.backward(grad, ctx.mb)
        gin, pgrads = grads[0], grads[1:]
        return (None, None, gin, *pgrads)


class GraphedLayers(nn.Module):
    """Run ``layers`` in sequence as graphed callables with slot-based activation offload.

    Args:
        layers: the modules, applied in order; each maps one tensor to one tensor.
        sample_input: an input of the exact shape, dtype and device the stack will see
            (``requires_grad`` as at run time).
        mode: ``"resident"`` (ping-pong banks, zero driver calls per step), ``"remap"``
            (least memory: pages released between forward and backward) or ``"off"``.
        min_offload_bytes: saved tensors smaller than this stay on the device.
        offload_layers: indices of the layers whose activations are offloaded
            (default: all); the others keep theirs on the device.
        warmup_iters: eager iterations before capture (discovery runs in them).
        backend: the graphslot backend (default: :func:`graphslot.get_backend`).
        debug_checksums: verify a checksum of every restored activation (slow).

    ``close()`` releases its slots, banks and host buffers; as a context manager
    (``with GraphedLayers(...) as stack:``) it closes on exit.
    """

    def __init__(self, layers: Sequence[nn.Module], sample_input: torch.Tensor, *,
                 mode: Mode | str = Mode.RESIDENT, min_offload_bytes: int = 0,
                 offload_layers: Iterable[int] | None = None, warmup_iters: int = 2,
                 backend: Backend | None = None, debug_checksums: bool = False) -> None:
        super().__init__()
        if not layers:
            raise UsageError("GraphedLayers needs at least one layer")
        self.layers = nn.ModuleList(layers)
        self.backend = backend or get_backend()
        if sample_input.device.type != self.backend.device.type:
            raise UsageError(f"sample_input is on {sample_input.device}, but the {self.backend.name} "
                             f"backend runs on {self.backend.device}")
        self.engine = OffloadEngine(self.backend, mode, min_bytes=min_offload_bytes,
                                    debug_checksums=debug_checksums)
        n = len(self.layers)
        self.offload_layers = set(range(n)) if offload_layers is None else set(offload_layers)
        bad = sorted(i for i in self.offload_layers if not 0 <= i < n)
        if bad:
            raise UsageError(f"offload_layers {bad} out of range for {n} layers")
        self.warmup_iters = max(1, int(warmup_iters))
        self._microbatch = 0
        self._runners = [_Runner(self, i, m) for i, m in enumerate(self.layers)]
        #: called with a label after each layer's forward and backward replay (for probes)
        self.probe: Callable[[str], None] | None = None
        # One private pool for every graph, captured in replay order (all forwards, then
        # the backwards in reverse), as torch.cuda.make_graphed_callables does: memory a
        # graph frees at capture is reused only by graphs that replay after it.
        self._pool_owner: Any = None
        x = sample_input
        for r in self._runners:
            x = r.build_forward(x).requires_grad_(x.requires_grad or bool(r.params))
        for r in reversed(self._runners):
            r.build_backward()
        self.backend.synchronize()
        self._offloaded = [r for r in self._runners if r.group is not None and not r.group.empty]

    @property
    def mode(self) -> Mode:
        return self.engine.mode

    def bank_index(self, layer: int) -> int:
        """Ping-pong bank of ``layer``: alternate among offloaded layers in backward order."""
        return sum(1 for i in self.offload_layers if i > layer) % 2

    @property
    def timeline(self) -> Any:
        """A :class:`graphslot.trace.Timeline` recording compute and copy spans, or None."""
        return self.engine.timeline

    @timeline.setter
    def timeline(self, tl: Any) -> None:
        self.engine.timeline = tl

    def _span(self, name: str) -> Any:
        tl = self.engine.timeline
        return contextlib.nullcontext() if tl is None else tl.span("compute", name)

    def _next_forward(self, i: int) -> _Runner | None:
        """The next layer in forward order whose activations are offloaded."""
        return next((r for r in self._offloaded if r.index > i), None)

    def _next_backward(self, i: int) -> _Runner | None:
        """The next layer in backward order whose activations are offloaded (look-ahead)."""
        return next((r for r in reversed(self._offloaded) if r.index < i), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._microbatch += 1
        mb = self._microbatch
        for r in self._runners:
            x = _LayerFunction.apply(r, mb, x, *r.params)
        return x

    def close(self) -> None:
        """Release the slots, banks and buffers (the graphs cannot replay afterwards)."""
        self.engine.close()

    def __enter__(self) -> GraphedLayers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
