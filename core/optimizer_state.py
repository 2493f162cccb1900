"""The state optimizers make for parameters at their first step, which a memory budget has
to count though it does not exist yet when a stack is built.

torch's optimizers make their per-parameter state (Adam's two moments, SGD's momentum
buffer) lazily, at the first ``step()`` that sees a gradient. A stack built under a memory
budget before that step would plan without it, and the first step would then add, for
Adam, twice the parameters' bytes on top of the plan. :func:`optimizers_holding` finds the
optimizers that hold given parameters, :func:`pending_state_bytes` says what they will
still make for them, and :func:`state_bytes` what they hold now.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["optimizers_holding", "pending_state_bytes", "state_bytes", "StateWatch"]

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


def optimizers_holding(params: Iterable[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """The live optimizers (``torch.optim.Optimizer`` instances) any of whose parameter
    groups hold one of ``params``."""
    ids = {id(p) for p in params}
    opt = torch.optim.Optimizer
    # (type(), not isinstance: some objects answer isinstance through a __class__ that
    # warns or raises)
    return [o for o in gc.get_objects() if issubclass(type(o), opt)
            and any(id(p) in ids for g in o.param_groups for p in g["params"])]


def _held(opt: torch.optim.Optimizer, ids: frozenset[int]) -> list[tuple[Group, torch.Tensor]]:
    return [(g, p) for g in opt.param_groups for p in g["params"] if id(p) in ids]


def pending_state_bytes(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> int | None:
    """Bytes of state ``opt`` will make at its next steps for those of ``params`` it holds
    that want a gradient and have no state yet; None where ``opt``'s kind is not known
    (not one of torch's optimizers, or LBFGS, whose history grows as it goes)."""
    rule = _rule(opt)
    if rule is None:
        return None
    return sum(rule(g, p) for g, p in _held(opt, frozenset(map(id, params)))
               if p.requires_grad and not opt.state.get(p))


def state_bytes(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                device_type: str | None = None) -> int:
    """Bytes of the state tensors ``opt`` holds now for those of ``params`` it holds (those
    on ``device_type`` only, where given)."""
    return _state_bytes_by_id(opt, frozenset(map(id, params)), device_type)


def _state_bytes_by_id(opt: torch.optim.Optimizer, ids: frozenset[int],
                       device_type: str | None) -> int:
    n = 0
    for _, p in _held(opt, ids):
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and (device_type is None or v.device.type == device_type):
                n += v.numel() * v.element_size()
    return n



class StateWatch:
    """Warns, once per optimizer, when after a step an optimizer holds more state for
    ``params`` than was counted for it (an optimizer made after a budget was planned, or
    one whose state :func:`pending_state_bytes` cannot tell). Watches every optimizer's
    steps through torch's global step hook until :meth:`close`.

    Args:
        params: the parameters watched (held by their ids: the watch keeps none alive).
        counted: per optimizer, the bytes of its state for ``params`` that were counted.
        say: the warning's text for an optimizer and the bytes beyond what was counted
            ("": no warning, the bytes mattering not).
        device_type: count state tensors on this device type only.
        slack: bytes beyond the counted figure that go unremarked.
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 counted: weakref.WeakKeyDictionary[torch.optim.Optimizer, int],
                 say: Callable[[torch.optim.Optimizer, int], str], *,
                 device_type: str | None = None, slack: int = 1 << 20) -> None:
        self._ids = frozenset(id(p) for p in params)
        self._counted = counted
        self._say = say
        self._device_type = device_type
        self._slack = slack
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handle: Any = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt in self._checked:
            return
        now = _state_bytes_by_id(opt, self._ids, self._device_type)
        if not now:
            return  # (not holding, or no state for these parameters yet)
        self._checked.add(opt)
        extra = now - self._counted.get(opt, 0)
        if extra > self._slack:
            said = self._say(opt, extra)
            if said:
                warnings.warn(said, stacklevel=3)

    def close(self) -> None:
        """Stop watching (safe to call again)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
