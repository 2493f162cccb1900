"""Parameter gradients of graphed layers: the backward graphs' gradient buffers lent as
``.grad`` (:class:`ParamGrad`), gradient homes outside the graphs' pool
(:class:`GradHome`), and a backward that adds each gradient into a target as it arrives
(:func:`backward_into`). Imports nothing of the package."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


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


def give_holders_own_bytes(t: torch.Tensor, lo: int, hi: int, spare: Sequence[torch.Tensor]) -> None:
    """Every tensor the program holds over ``t``'s storage, starting in ``[lo, hi)``, except
    ``spare``, gets a copy of its bytes of its own (the same object: references stay good),
    before graphslot writes that memory again."""
    storage = t.untyped_storage()._cdata

    def over(o: torch.Tensor) -> bool:
        try:
            return lo <= o.data_ptr() < hi and o.untyped_storage()._cdata == storage
        except RuntimeError:  # (a tensor without memory: torch.compile's fake ones, kept
            return False      # in its caches, and functional or meta tensors)

    with warnings.catch_warnings():  # isinstance() wakes deprecated module attributes
        warnings.simplefilter("ignore")
        held = [o for o in _tracked_objects() if isinstance(o, torch.Tensor)
                and all(o is not x for x in spare) and o.device == t.device and over(o)]
    for o in held:
        o.data = o.clone()


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class ParamGrad:
    """One parameter's gradient buffer in a layer's backward graphs (``param`` None: the
    stack's input gradient, the first layer's buffer)."""

    __slots__ = ("param", "buf", "ptr", "storage", "base_refs", "copy", "holder")

    def __init__(self, param: nn.Parameter | None, buf: torch.Tensor, copy: bool) -> None:
        self.param = param
        self.buf = buf  # written by the backward graph at every replay
        self.ptr = buf.data_ptr()
        self.storage = storage_id(buf)
        self.base_refs = 0  # references to buf's storage that graphslot itself holds
        #: hand out a copy, never the buffer: shared parameters, hooked ones, and those
        #: whose earlier gradient somebody kept
        self.copy = copy
        #: the stack's input the buffer was last lent to as its ``.grad`` (input gradient only)
        self.holder: weakref.ref[torch.Tensor] | None = None

    def count_own_refs(self) -> None:
        """After the build: count the references graphslot itself holds to the buffer."""
        if use_count is not None:
            self.base_refs = use_count(self.storage)

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
        if use_count is None:
            return False
        extra = 1 if self.aliased() else 0
        return use_count(self.storage) > self.base_refs + extra


class GradHome:
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

    def count_own_refs(self) -> None:
        """Count the references graphslot itself holds to the home (no local names)."""
        self.base_pyrefs = sys.getrefcount(self.home)
        if use_count is not None:
            self.base_refs = use_count(storage_id(self.home))

    def fills_grad(self) -> bool:
        """Will the running backward accumulate into ``.grad``, with no tensor hook between
        and nothing from outside the stack to add first?"""
        # (a parameter frozen since its forward: autograd's accumulator drops what it gets)
        if self.outside or self.param._backward_hooks or not self.param.requires_grad:
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
        held_views = use_count is not None and use_count(storage_id(self.home)) > self.base_refs
        if not (held_obj or held_views):
            return
        old = self.home
        self.home = old.detach()  # graphslot's own handle on the address from now on
        if held_views:
            lo = old.data_ptr()
            give_holders_own_bytes(old, lo, lo + old.untyped_storage().nbytes(), (old, self.home))
        if held_obj:
            old.data = old.clone()
        del old
        self.count_own_refs()


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


def backward_into(targets: Sequence[torch.Tensor | None], out: torch.Tensor,
                  inputs: Sequence[torch.Tensor], grad_out: torch.Tensor | None
                  ) -> tuple[tuple[torch.Tensor | None, ...], set[int]]:
    """Under capture: the backward of ``out`` with each parameter alias's gradient added into
    its target as it arrives (Megatron's ``main_grad.add_(grad)``) and dropped at once, so
    the graphs' pool holds one such gradient at a time, none after the replay. ``inputs``
    are the stack input (when it wants a gradient) and then the aliases, one per
    ``targets`` entry (None: that gradient is returned, a buffer of the graphs' pool).
    Returns what ``torch.autograd.grad`` would, added ones as None, and the indices of the
    targets a gradient was added into (a parameter the layers leave unused gets none)."""
    n_in = len(inputs) - len(targets)
    kept = list(inputs[:n_in]) + [a for a, t in zip(inputs[n_in:], targets) if t is None]
    reached: set[int] = set()

    def into(k: int, target: torch.Tensor, alias: torch.Tensor) -> None:
        target.add_(alias.grad)  # type: ignore[arg-type]  # (the hook runs once it is set)
        alias.grad = None
        reached.add(k)

    handles = [a.register_post_accumulate_grad_hook(lambda a, k=k, t=t: into(k, t, a))
               for k, (a, t) in enumerate(zip(inputs[n_in:], targets)) if t is not None]
    try:
        torch.autograd.backward(out, grad_out, inputs=list(inputs))
    finally:
        for h in handles:
            h.remove()
    got = {id(x): x.grad for x in kept}
    for x in kept:
        x.grad = None
    return tuple(got.get(id(x)) for x in inputs[:n_in]) + tuple(
        None if t is not None else got[id(a)] for a, t in zip(inputs[n_in:], targets)), reached

