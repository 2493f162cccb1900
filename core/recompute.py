"""Recomputing only a layer's cheap ops: what :class:`~graphslot.adapters.torch.GraphedLayers`
captures for a layer whose plan says ``recompute`` with ``recompute_ops="cheap"``.

A recomputed layer normally saves only its input and runs its whole forward again in
its backward. Most of that forward's time is in a few ops (matrix products, attention,
convolutions) whose outputs are a minority of what the layer saves; the rest (norms,
activation functions, rotary embeddings, dtype casts, elementwise products) costs
little to run again and saves the most bytes. Recomputing cheaply keeps the outputs of
the expensive ops (:func:`is_expensive`) and runs only the cheap ops again, through
``torch.utils.checkpoint``'s selective policy, so the layer holds a fraction of its
activations for a fraction of a full recompute's time. An expensive call that draws
random numbers (attention with dropout) runs again too: kept, it would draw nothing in
the recompute, and every random op after it would draw other numbers than the forward.

Device neutral: the ops are aten's, whatever the device.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .offload import same_values, values_fingerprint

__all__ = ["EXPENSIVE_OPS", "CallKey", "is_expensive", "cheap_recompute_contexts",
           "recompute_parts", "checkpointing_parts", "noting_draws",
           "noting_expensive_outputs", "noting_changed_buffers"]


def _packets(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    # (some exist only in newer torch, or only in builds with that kernel)
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


#: The aten ops whose outputs a cheap recompute keeps: matrix products, attention and
#: convolution, where a layer's forward spends its time (their outputs are few bytes for
#: the work behind them).
EXPENSIVE_OPS = _packets(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward")


def is_expensive(op: Any) -> bool:
    """Whether ``op`` (an aten overload or packet) is one whose outputs a cheap recompute
    keeps rather than runs again."""
    return getattr(op, "overloadpacket", op) in EXPENSIVE_OPS


def _draws(op: Any, args: Any, kwargs: Any) -> bool:
    """Whether this call of a seeded op draws random numbers (attention with dropout).
    Its outputs are not kept: the recompute runs it again, so that it and every random
    op after it draw where the forward's did."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    schema = getattr(op, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name in ("dropout_p", "p"):
            p = kwargs.get(a.name, args[i] if i < len(args) else a.default_value)
            return not isinstance(p, (int, float)) or p > 0
    return True


def _kept(op: Any, args: Any, kwargs: Any) -> bool:
    """Whether a cheap recompute keeps this call's outputs: an expensive op's, unless the
    call draws random numbers."""
    return is_expensive(op) and not _draws(op, args, kwargs or {})


#: One call of an expensive op in a forward: its op packet and how many calls of that op
#: came before it. A layer's forward makes the same calls in the same order each time
#: (torch's selective checkpointing relies on it too), so a key names one call.
CallKey = tuple[Any, int]


class _Calls:
    """Numbers each expensive op's calls in one forward (see :data:`CallKey`)."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}

    def key(self, op: Any) -> CallKey:
        packet = getattr(op, "overloadpacket", op)
        k = self.counts.get(packet, 0)
        self.counts[packet] = k + 1
        return packet, k


class _NoteOutputs(TorchDispatchMode):
    """Calls ``note`` with every tensor an expensive op returns, except those of the calls
    in ``skip``; keeps each such output and its version when ``watch`` is set."""

    def __init__(self, note: Callable[[torch.Tensor], None] | None,
                 skip: frozenset[CallKey] = frozenset(), watch: bool = False) -> None:
        super().__init__()
        self.note, self.skip, self.watch = note, skip, watch
        self.calls = _Calls()
        self.outputs: list[tuple[CallKey, torch.Tensor, int, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _kept(func, args, kwargs):
            key = self.calls.key(func)
            if key not in self.skip:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        if self.note is not None:
                            self.note(t)
                        if self.watch:
                            self.outputs.append((key, t, t._version, values_fingerprint(t)))
        return out


@contextlib.contextmanager
def noting_expensive_outputs(note: Callable[[torch.Tensor], None] | None = None
                             ) -> Iterator[set[CallKey]]:
    """Within: ``note(t)`` for each tensor an expensive op (:func:`is_expensive`) returns.

    Yields a set that, on exit, holds the calls whose outputs the code within changed in
    place (an in-place activation on a matrix product's output, say): a cheap recompute
    cannot keep those outputs as they were made, and runs those calls again instead
    (``cheap_recompute_contexts(recompute_calls=...)``). The outputs are kept alive until
    the exit, to read their versions there.
    """
    mode = _NoteOutputs(note, watch=True)
    changed: set[CallKey] = set()
    try:
        with mode:
            yield changed
        # The version tells most changes; a view that shares no version counter
        # (unsafe_chunk's: a GRU cell's gates go through sigmoid_ so on cpu) only the values do.
        changed.update(key for key, t, version, total in mode.outputs
                       if t._version != version or not same_values(values_fingerprint(t), total))
    finally:
        mode.outputs.clear()


@contextlib.contextmanager
def noting_changed_buffers(module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Around a forward of ``module``: yields a list that, on exit, holds the buffers the
    code within changed (what a recompute runs again from, as the forward found them).
    Batch norm's kernel changes its running statistics without a new version: the values
    tell as well."""
    before = [(t, t._version, t.detach().clone()) for t in module.buffers()]
    changed: list[torch.Tensor] = []
    yield changed
    changed.extend(t for t, version, was in before if t._version != version or not torch.equal(t, was))


def cheap_recompute_contexts(note: Callable[[torch.Tensor], None] | None = None,
                             recompute_calls: frozenset[CallKey] = frozenset()
                             ) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that keeps the expensive ops' outputs and recomputes the rest in the backward.

    Args:
        note: called with each output kept (what the layer holds until its backward),
            as the forward makes it.
        recompute_calls: expensive calls run again all the same: those whose outputs the
            forward changes in place (:func:`noting_expensive_outputs` finds them), which
            torch's selective checkpointing refuses to keep.
    """
    def contexts() -> tuple[Any, Any]:
        calls = {False: _Calls(), True: _Calls()}  # the forward's and the recompute's

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if not _kept(op, args, kwargs) or calls[ctx.is_recompute].key(op) in recompute_calls:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE

        forward, recompute = create_selective_checkpoint_contexts(policy)
        if note is None:
            return forward, recompute
        return _both(forward, _NoteOutputs(note, skip=recompute_calls)), recompute

    return contexts


@contextlib.contextmanager
def _both(forward: Any, noting: _NoteOutputs) -> Iterator[None]:
    with forward, noting:
        yield


def recompute_parts(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The parts a layer is recomputed by, one at a time (``recompute_ops="parts"``): the
    children of the first module with two or more, going down from ``module`` through
    modules with one child (a wrapper around a decoder layer, say: its attention, MLP and
    norms). A list or dict of modules, which is never called itself, stands for the
    modules in it. Empty where no module has two children (nothing to take apart)."""
    def children(m: torch.nn.Module) -> list[torch.nn.Module]:
        out: list[torch.nn.Module] = []
        for c in m.children():
            out += children(c) if isinstance(c, (torch.nn.ModuleList, torch.nn.ModuleDict)) else [c]
        return out

    m = module
    while True:
        found = children(m)
        if len(found) >= 2:
            return found
        if not found:
            return []
        m = found[0]


#: Ops whose results may differ in their last bits from run to run on a device (atomic
#: accumulation): a part running one is not made again for a later part's input.
#: (torch's ``nondeterministic_bitwise`` tag is checked too, where an op carries it.)
_UNSTABLE_OPS = _packets(
    "index_add", "index_add_", "index_reduce", "index_reduce_", "index_put", "index_put_",
    "_index_put_impl_", "put", "put_", "scatter_add", "scatter_add_", "scatter_reduce",
    "scatter_reduce_", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only",
    "histc", "bincount", "_unsafe_index_put")


class _NoteCost(TorchDispatchMode):
    """Notes whether a forward ran an op that keeps it from being made again for a later
    part's input: an expensive one (:func:`is_expensive`), one that draws random numbers,
    or one whose results may differ in their last bits from run to run."""

    def __init__(self) -> None:
        super().__init__()
        self.costly = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tags = getattr(func, "tags", ())
        if (is_expensive(func) or getattr(func, "overloadpacket", func) in _UNSTABLE_OPS
                or torch.Tag.nondeterministic_seeded in tags
                or torch.Tag.nondeterministic_bitwise in tags):
            self.costly = True
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class _Verdict:
    """What an eager call of a part (:func:`checkpointing_parts` with ``changed``) found,
    for the train/eval modes its modules had then."""

    modes: tuple[bool, ...]  #: ``training`` of the part's modules, in ``modules()`` order
    cheap: bool  #: its output may be made again from its inputs for a later part
    changes_given: bool  #: it changes in place a cheap part's output it is given


#: per part module: what its last eager check found (a remake needs a verdict for the
#: modes the part and the part reading its output are in: dropout draws only in training)
_verdicts: weakref.WeakKeyDictionary[torch.nn.Module, _Verdict] = weakref.WeakKeyDictionary()


@dataclass
class _Judged:
    """What a judging call saw of a part so far (:func:`checkpointing_parts`)."""

    modes: tuple[bool, ...]
    cheap: bool = True
    changes_given: bool = False
    #: its inputs and output, each with a copy as it was when the part ran: a cheap
    #: part's are read back at the end (a view that shares no version counter changes
    #: them unseen)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _modes(m: torch.nn.Module) -> tuple[bool, ...]:
    return tuple(x.training for x in m.modules())


def _verdict(m: torch.nn.Module) -> _Verdict | None:
    """``m``'s verdict where it was judged in the modes it is in now."""
    v = _verdicts.get(m)
    return v if v is not None and v.modes == _modes(m) else None


def _autocast_state(device_type: str) -> tuple[Any, ...]:
    """Autocast as it stands for ``device_type`` and the cpu: a remake runs under the
    state of the part that reads the output, which must be the one it was made under."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in dict.fromkeys(("cpu", device_type))
                 if torch.amp.is_autocast_available(d))


#: a tensor's layout: size, stride, and its address modulo :data:`_ALIGN`
_Layout = tuple[tuple[int, ...], tuple[int, ...], int]

#: bytes of address alignment a layout keeps (a device's vectorized reduction may take
#: another path over data aligned otherwise, and add in another order)
_ALIGN = 64


def _layout(t: torch.Tensor) -> _Layout:
    return tuple(t.shape), t.stride(), t.data_ptr() % _ALIGN


def _laid_out(t: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``t``'s values in ``layout`` (``t`` itself where it has it): a saved-tensor hook may
    give an input back packed otherwise (``save_on_cpu`` makes it contiguous), and a
    reduction over it would then add in another order than the forward's did."""
    size, stride, align = layout
    if t.stride() == stride and t.data_ptr() % _ALIGN == align:
        return t
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    pad = align // t.element_size()  # (a new block's address is aligned to _ALIGN at least)
    return t.new_empty(pad + span).as_strided(size, stride, pad).copy_(t)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as integers of its width: equal bits, NaNs and signed zeros alike."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.dtype != torch.bool else t


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class _Made:
    """A cheap part's output as it left the part, and how to make it again: ``call``
    over ``inputs`` (the tensors the part's checkpoint got), as they were then.

    The inputs are held while the output lives (the entry goes with it): whether a later
    part makes the output again must not hang on when an offload hook let an input go,
    or a capture would save other tensors than its discovery did."""

    out: weakref.ref[torch.Tensor]
    version: int
    call: Callable[..., Any]
    inputs: list[torch.Tensor]
    versions: list[int]
    layouts: list[_Layout]
    autocast: tuple[Any, ...]

    def inputs_for(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """The inputs to make ``t`` again from: where ``t`` is this output and neither it
        nor they changed since, under the same autocast."""
        if (self.out() is not t or t._version != self.version
                or _autocast_state(t.device.type) != self.autocast
                or any(x._version != v for x, v in zip(self.inputs, self.versions))):
            return None
        return list(self.inputs)


#: how a part's recompute gets a tensor it was given back: ``(None, 1, False, [])`` as
#: saved; ``(call, n, requires_grad, layouts)`` made again by ``call`` from the next
#: ``n`` tensors saved, laid out as they were
_Source = tuple[Callable[..., Any] | None, int, bool, list[_Layout]]


def _sources(given: list[torch.Tensor], made: dict[int, _Made]
             ) -> tuple[list[torch.Tensor], list[_Source]]:
    """The tensors a part's checkpoint gets for the distinct tensors it was ``given``
    (for a cheap part's output: that part's inputs), and per given tensor its
    :data:`_Source`."""
    tensors: list[torch.Tensor] = []
    sources: list[_Source] = []
    for t in given:
        how = made.get(id(t))
        ins = how.inputs_for(t) if how is not None else None
        if how is not None and ins is not None:
            sources.append((how.call, len(ins), t.requires_grad, how.layouts))
            tensors += ins
        else:
            sources.append((None, 1, False, []))
            tensors.append(t)
    return tensors, sources


def _nbytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@contextlib.contextmanager
def checkpointing_parts(parts: list[torch.nn.Module],
                        changed: list[str] | None = None) -> Iterator[None]:
    """Within: each of ``parts`` runs its forward under a non-reentrant
    ``torch.utils.checkpoint``, so a forward of the layer saves only what each part is
    given (and what the code between the parts saves), and its backward runs each part
    again just before that part's own backward: one part's activations are live at a
    time, against all of them with the whole layer recomputed at once. The part runs
    again from what its forward was given, with the parameters it reads then (a capture
    that swaps them for aliases of the same memory is read alike). Random numbers are not
    restored (``preserve_rng_state=False``: a part that draws them is not recomputed this
    way), nor module state its forward changes (a caller refuses those).

    A part given the output of a cheap part (no matrix product, attention, random numbers
    or run-to-run differences, no buffers: a norm), unchanged and needing a gradient,
    saves that part's inputs instead where they are no larger (the cheap part's own
    checkpoint keeps them anyway), and its recompute makes the output again from them: a
    pre-norm block keeps its residual inputs, not also the norms' outputs. The forward
    reads the output as made, so gradients flow and sum as without this. Which parts are
    cheap, an eager call with ``changed`` given judges, for the train/eval modes the
    parts are in then; until one has, every part saves what it is given.

    Every tensor a part is given, keyword arguments and tensors inside tuples included,
    goes to the checkpoint as an input of its own (one given twice, once), so what saves
    it (an offload slot, a microbatch's parked copy) sees it; torch's checkpoint would
    keep the others by reference only.

    Args:
        parts: the modules (:func:`recompute_parts`).
        changed: where given, the call is a check run eagerly (not under a capture: it
            reads values back at its exit). It judges which parts are cheap (and makes
            nothing again itself: each part saves what it is given), and gets on exit
            the name of each part whose input was changed in place after the part was
            given it (``nn.ReLU(inplace=True)`` as a part, say): its checkpoint saved
            that input, so its backward would fail.
    """
    had = [(m, m.__dict__.get("forward")) for m in parts]
    given: list[tuple[str, list[tuple[torch.Tensor, int]]]] = []
    made: dict[int, _Made] = {}  # id of a cheap part's output -> how to make it again
    judging = changed is not None
    # (judging: per part, the modes it ran in, whether it is cheap and whether it changes
    # a cheap part's output it is given, so far, and its inputs and output with copies
    # of them as they were when it ran)
    judged: dict[torch.nn.Module, _Judged] = {}

    def forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
        if key in made and made[key].out is ref:
            del made[key]

    try:
        for m in parts:
            forward = m.forward

            def run(*args: Any, _forward: Any = forward, _m: torch.nn.Module = m,
                    **kwargs: Any) -> Any:
                flat, spec = tree_flatten((args, kwargs))
                at = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
                rest = [None if isinstance(v, torch.Tensor) else v for v in flat]  # (no reference kept)
                # Each distinct tensor once: one given twice (attention's query, key and
                # value alike) is one object again in the recompute.
                index: dict[int, int] = {}
                distinct: list[torch.Tensor] = []
                for i in at:
                    if index.setdefault(id(flat[i]), len(distinct)) == len(distinct):
                        distinct.append(flat[i])
                where = [index[id(flat[i])] for i in at]
                # (the closures keep counts, not tensors: what saves the checkpoint's
                # inputs decides where they live; without grad nothing is recomputed)
                grad = torch.is_grad_enabled()
                mine = None if judging or not grad else _verdict(_m)
                tensors, sources = (
                    _sources(distinct, made) if mine is not None and not mine.changes_given
                    else (list(distinct), [(None, 1, False, [])] * len(distinct)))
                # (judging: the tensors given that a later call would make again)
                again = ([(t, t._version) for t in distinct
                          if id(t) in made and made[id(t)].inputs_for(t) is not None]
                         if judging and grad else [])
                if changed is not None:
                    given.append((type(_m).__name__, [(t, t._version) for t in tensors]))
                # the forward reads the tensors as given (their gradients flow as they
                # would); only the recompute makes a cheap part's output again
                first: list[list[torch.Tensor] | None] = [distinct]

                def given_back(ts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
                    held, first[0] = first[0], None
                    if held is not None:
                        return held
                    out: list[torch.Tensor] = []
                    k = 0
                    for make, n, needs_grad, layouts in sources:
                        if make is None:
                            out.append(ts[k])
                        else:
                            with torch.no_grad():
                                t = make(*(_laid_out(x, lay) for x, lay in zip(ts[k:k + n], layouts)))
                            # (as given: an op saves what it saves by what needs a gradient)
                            out.append(t.requires_grad_() if needs_grad else t)
                        k += n
                    return out

                def call(*ts: torch.Tensor) -> Any:
                    back = given_back(ts)
                    leaves = list(rest)
                    for i, k in zip(at, where):
                        leaves[i] = back[k]
                    a, kw = tree_unflatten(leaves, spec)
                    return _forward(*a, **kw)

                noting: Any = _NoteCost() if judging and grad else contextlib.nullcontext()
                try:
                    with noting:
                        out = torch.utils.checkpoint.checkpoint(
                            call, *tensors, use_reentrant=False, preserve_rng_state=False)
                finally:
                    first[0] = None
                if judging and grad:
                    j = judged.setdefault(_m, _Judged(_modes(_m)))
                    j.cheap &= (not noting.costly and next(_m.buffers(), None) is None
                                and j.modes == _modes(_m))
                    j.changes_given |= any(t._version != v for t, v in again)
                    if j.cheap:
                        seen = [*tensors, *([out] if isinstance(out, torch.Tensor) else [])]
                        j.copies += [(t, t.detach().clone()) for t in seen]
                    cheap_now = j.cheap
                else:
                    v = _verdict(_m) if grad else None
                    cheap_now = v is not None and v.cheap
                if (cheap_now and isinstance(out, torch.Tensor) and out.requires_grad
                        and _nbytes(tensors) <= _nbytes([out])
                        and all(torch._debug_has_internal_overlap(t) == 0 for t in tensors)):
                    key = id(out)
                    made[key] = _Made(weakref.ref(out, functools.partial(forget, key)),
                                      out._version, call, list(tensors),
                                      [t._version for t in tensors], [_layout(t) for t in tensors],
                                      _autocast_state(out.device.type))
                return out

            m.forward = run  # (an instance attribute: hooks still run around it)
        yield
        if changed is not None:
            # A cheap part's input or output changed where its version did not move (a
            # view that shares no version counter, unsafe_chunk's) would be made again
            # otherwise; a verdict in the same modes stands with this one (a part two
            # layers share is made again only where both allow it).
            for m, j in judged.items():
                cheap = j.cheap and all(torch.equal(_bits(t), _bits(was)) for t, was in j.copies)
                last = _verdicts.get(m)
                if last is not None and last.modes == j.modes:  # (a part shared by layers: all alike)
                    cheap, j.changes_given = cheap and last.cheap, j.changes_given or last.changes_given
                _verdicts[m] = _Verdict(j.modes, cheap, j.changes_given)
            changed.extend(dict.fromkeys(name for name, ts in given
                                         if any(t._version != v for t, v in ts)))
    finally:
        given.clear()
        made.clear()
        judged.clear()
        for m, own in reversed(had):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own


class _NoteDraws(TorchDispatchMode):
    """Appends the name of each op called within that draws random numbers."""

    def __init__(self, drawn: list[str]) -> None:
        super().__init__()
        self.drawn = drawn

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _draws(func, args, kwargs or {}):
            self.drawn.append(str(getattr(func, "overloadpacket", func)))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def noting_draws() -> Iterator[list[str]]:
    """Within: yields a list that gets the name of each op called that draws random
    numbers (dropout, ``torch.rand``; attention with a dropout probability above 0)."""
    drawn: list[str] = []
    with _NoteDraws(drawn):
        yield drawn
