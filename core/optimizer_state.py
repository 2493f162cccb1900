"""The state optimizers make for parameters at their first step, which a memory budget has
to count though it does not exist yet when a stack is built.

torch's optimizers make their per-parameter state (Adam's two moments, SGD's momentum
buffer) lazily, at the first ``step()`` that sees a gradient. A stack built under a memory
budget before that step would plan without it, and the first step would then add, for
Adam, twice the parameters' bytes on top of the plan. :func:`live_optimizers` finds the
process's optimizers, :func:`pending_state_bytes` says what one will still make,
:func:`state_bytes` what it holds now, and :class:`StateWatch` names state that outgrew
what was counted.
"""

from __future__ import annotations

import gc
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


__all__ = ["live_optimizers", "pending_state_bytes", "state_bytes", "state_to_come", "StateCount",
           "StateWatch"]

Group = dict


def _adam(group: Group, p: torch.Tensor) -> int:
    return (3 if group.get("amsgrad") else 2) * _nbytes(p)


def _sgd(group: Group, p: torch.Tensor) -> int:
    return _nbytes(p) if group.get("momentum", 0) else 0


def _rmsprop(group: Group, p: torch.Tensor) -> int:
    return (1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))) * _nbytes(p)


def _adafactor(group: Group, p: torch.Tensor) -> int:
    if p.dim() < 2:
        return _nbytes(p)
    # (factored: a variance per row and one per column)
    s = p.shape
    return (math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1]) * p.element_size()


def _copies(n: int) -> Callable[[Group, torch.Tensor], int]:
    return lambda group, p: n * _nbytes(p)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


#: per torch optimizer class: the bytes of state it makes for one parameter (the scalar
#: step counters, a few bytes each, left out); the first class ``isinstance`` matches wins
_STATE: list[tuple[type, Callable[[Group, torch.Tensor], int]]] = [
    (torch.optim.Adam, _adam),  # (and AdamW)
    (torch.optim.SGD, _sgd),
    (torch.optim.RMSprop, _rmsprop),
    (torch.optim.Adagrad, _copies(1)),  # (made by its constructor)
    (torch.optim.Adadelta, _copies(2)),
    (torch.optim.Adamax, _copies(2)),
    (torch.optim.NAdam, _copies(2)),
    (torch.optim.RAdam, _copies(2)),
    (torch.optim.Rprop, _copies(2)),
    (torch.optim.ASGD, _copies(1)),
    (torch.optim.SparseAdam, _copies(2)),
]
for _name, _bytes in (("AdamW", _adam), ("Adafactor", _adafactor), ("Muon", _copies(1))):
    _cls = getattr(torch.optim, _name, None)  # (not in every torch the project supports)
    if _cls is not None:
        _STATE.insert(0, (_cls, _bytes))


def _rule(opt: torch.optim.Optimizer) -> Callable[[Group, torch.Tensor], int] | None:
    return next((rule for cls, rule in _STATE if isinstance(opt, cls)), None)


def live_optimizers() -> list[torch.optim.Optimizer]:
    """The process's optimizers (``torch.optim.Optimizer`` instances) that the garbage
    collector sees, after a collection (an optimizer dead in a cycle holds nothing to
    come). Those set aside by ``gc.freeze()`` are not seen (looking would mean freezing
    everything made since, the stack being built included, for good); what they make is
    named by :class:`StateWatch` at their first step."""
    gc.collect()
    opt = torch.optim.Optimizer
    # (type(), not isinstance: some objects answer isinstance through a __class__ that
    # warns or raises; and one whose constructor raised has no param_groups)
    return [o for o in gc.get_objects() if issubclass(type(o), opt)
            and isinstance(getattr(o, "param_groups", None), list)]


def _on(t: torch.Tensor, device: torch.device | None) -> bool:
    # "cuda" names every cuda device; "cpu:0" and "cpu" name the one host
    return device is None or (t.device.type == device.type and (
        device.index is None or t.device.index is None or t.device.index == device.index))


def _held(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None,
          device: torch.device | None) -> list[tuple[Group, torch.Tensor]]:
    """``opt``'s parameters, with their groups: those of ``params`` (all where None), on
    ``device`` (any where None)."""
    ids = None if params is None else {id(p) for p in params}
    return [(g, p) for g in opt.param_groups if isinstance(g, dict)
            for p in g.get("params", ()) if isinstance(p, torch.Tensor)
            and (ids is None or id(p) in ids) and _on(p, device)]


def pending_state_bytes(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None = None,
                        device: torch.device | str | None = None) -> int | None:
    """Bytes of state ``opt`` will make at its next steps for its parameters (those of
    ``params``, on ``device`` ("cuda" names every cuda device), where given) that want a
    gradient and have no state yet; None where ``opt``'s kind is not known (not one of
    torch's optimizers, or LBFGS, whose history grows as it goes)."""
    rule = _rule(opt)
    if rule is None:
        return None
    return sum(rule(g, p) for g, p in _held(opt, params, _device(device))
               if p.requires_grad and not opt.state.get(p))


def state_bytes(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None = None,
                device: torch.device | str | None = None) -> int:
    """Bytes of the state tensors ``opt`` holds now for its parameters (those of
    ``params`` where given), the tensors on ``device`` alone where given ("cuda" names
    every cuda device). Tensors in lists, tuples and dicts count too (LBFGS keeps its
    history so), each storage once."""
    dev = _device(device)
    seen: set[tuple[int, int]] = set()
    n = 0
    for _, p in _held(opt, params, None):
        for t in _tensors(opt.state.get(p, {}).values()):
            if not _on(t, dev):
                continue
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                n += key[1]
    return n


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s bytes are and how many: its storage's, or for a tensor that has none
    of its own (a wrapper subclass), its local part's (DTensor's shard on this rank), else
    its own size by identity."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


def _tensors(values: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif depth < 4 and isinstance(v, (list, tuple)):
            yield from _tensors(v, depth + 1)
        elif depth < 4 and isinstance(v, dict):
            yield from _tensors(v.values(), depth + 1)


@dataclass(frozen=True)
class StateCount:
    """What was counted of the process's optimizers' state on one device, when a plan was
    made (:func:`state_to_come`)."""

    #: bytes they will still make at their next steps (a kind it cannot tell counts none)
    pending: int
    #: bytes they hold then, plus ``pending``: what the plan counted in all
    counted: int
    #: the optimizers counted
    optimizers: tuple[weakref.ref[torch.optim.Optimizer], ...]


def state_to_come(device: torch.device | str) -> StateCount:
    """What the process's optimizers will still make on ``device`` at their next steps,
    and what that leaves them holding there (what a :class:`StateWatch` compares
    against)."""
    pending = held = 0
    refs = []
    for opt in live_optimizers():
        pending += pending_state_bytes(opt, device=device) or 0
        held += state_bytes(opt, device=device)
        refs.append(weakref.ref(opt))
    return StateCount(pending, held + pending, tuple(refs))


def _device(device: torch.device | str | None) -> torch.device | None:
    return None if device is None else torch.device(device)


#: a watch looks after each of an optimizer's first steps, then after every this many,
#: and again whenever its parameters change (``add_param_group``)
_EARLY_STEPS, _LATER_EVERY = 10, 100


@dataclass
class _Seen:
    ref: weakref.ref[torch.optim.Optimizer]
    steps: int = 0
    params: int = -1  # how many parameters it had when last looked at
    done: bool = False  # every parameter has its state: nothing more can come


class StateWatch:
    """Warns when, after an optimizer's step, the process's optimizers hold more state on
    ``device`` than was counted (one made after a budget was planned, one whose state
    :func:`pending_state_bytes` cannot tell, state for a layer unfrozen or a parameter
    group added since), and again each time that grows by more than ``slack``. Watches
    every optimizer's steps until :meth:`close`.

    Args:
        count: what was counted, and of which optimizers (:func:`state_to_come`).
        say: the warning's text for the optimizer that just stepped and the bytes beyond
            what was counted ("": no warning, the bytes mattering not).
        device: count state tensors on this device only.
        slack: bytes beyond the counted figure that go unremarked.
    """

    def __init__(self, count: StateCount, say: Callable[[torch.optim.Optimizer, int], str], *,
                 device: torch.device | str | None = None, slack: int = 1 << 20) -> None:
        # (by id, not by the optimizer: an optimizer class may define __eq__ without
        # __hash__; each entry's weak reference says whether it is still that optimizer)
        self._seen: dict[int, _Seen] = {id(o): _Seen(r) for r in count.optimizers
                                        if (o := r()) is not None}
        self._counted = count.counted
        self._say = say
        self._device = _device(device)
        self._slack = slack
        self._warned = 0  # the excess last warned about
        self._lock = threading.Lock()
        _watching(self)

    def _entry(self, opt: torch.optim.Optimizer) -> _Seen:
        e = self._seen.get(id(opt))
        if e is None or e.ref() is not opt:
            e = self._seen[id(opt)] = _Seen(weakref.ref(opt))
        return e

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        with self._lock:
            e = self._entry(opt)
            e.steps += 1
            params = sum(len(g.get("params", ())) for g in opt.param_groups if isinstance(g, dict))
            # (every step at first, then every _LATER_EVERY steps, also for an optimizer
            # that made all its state: a changed setting, momentum say, can make more)
            if params == e.params and (e.done or e.steps > _EARLY_STEPS) and e.steps % _LATER_EVERY:
                return
            e.params = params
            held = _held(opt, None, self._device)
            rule = _rule(opt)
            e.done = not held or rule is not None and all(opt.state.get(p) or rule(g, p) == 0
                                                          for g, p in held)
            extra = self._held_now() - self._counted
            if extra <= self._warned + self._slack:
                return
            said = self._say(opt, extra)
            if said:
                self._warned = extra
        if said:
            warnings.warn(said, stacklevel=4)

    def _held_now(self) -> int:
        total = 0
        for k, e in list(self._seen.items()):
            o = e.ref()
            if o is None:
                del self._seen[k]
            else:
                total += state_bytes(o, device=self._device)
        return total

    def close(self) -> None:
        """Stop watching (safe to call again, from any thread, at any time)."""
        _WATCHES.discard(self)


# One step hook for every watch, registered once: a watch's close() (a finalizer may run
# it inside a step, as a collection comes) then never changes torch's hook table while
# torch walks it.
_WATCHES: weakref.WeakSet[StateWatch] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hooked = False


def _watching(watch: StateWatch) -> None:
    global _hooked
    with _hook_lock:
        _WATCHES.add(watch)
        if not _hooked:
            register_optimizer_step_post_hook(_after_any_step)
            _hooked = True


def _after_any_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # (a copy of the weak references taken in one step, which another thread's add or
    # discard cannot change under it; iterating the WeakSet itself could)
    for ref in list(_WATCHES.data):  # type: ignore[attr-defined]
        watch = ref()
        if watch is None:
            continue
        try:
            watch.after_step(opt)
        except Exception as e:  # (a check must never break the user's step)
            watch.close()
            warnings.warn(f"graphslot: stopped watching the optimizers' state after "
                          f"{type(opt).__name__}'s step: {type(e).__name__}: {e}", stacklevel=3)
