"""Which layers each device graph covers (:func:`plan_graphs`), and the checks of
:class:`~graphslot.adapters.torch.GraphedLayers`' arguments. Imports nothing of the package."""

from __future__ import annotations

from typing import AbstractSet, Any, Iterable, Sequence

import torch
from torch.utils.hooks import RemovableHandle
from torch import nn

from graphslot.backend import Backend
from graphslot.errors import UsageError
from graphslot.sizes import as_integer

#: ``layers_per_graph=None`` joins consecutive layers while what their forwards save
#: stays within this together. A graph replay and an offload copy cost the host about as
#: much for a small layer as for a large one; past a few tens of MiB the copies, not the
#: calls, set an offloading step's time, and a larger graph only coarsens them.
JOIN_BYTES = 32 << 20


def plan_graphs(n: int, offloaded: AbstractSet[int], layers_per_graph: int | None,
                saved_bytes: Sequence[int] | None, join_bytes: int | None = None,
                recomputed: AbstractSet[int] = frozenset(),
                cheap: AbstractSet[int] = frozenset(),
                tied: Sequence[AbstractSet[int]] = (),
                parts: AbstractSet[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
    """Which of ``n`` layers each device graph covers: consecutive runs, never mixing
    layers in and outside ``offloaded`` (or ``recomputed``, or ``cheap``: recomputed
    cheaply, or ``parts``: recomputed part by part); ``layers_per_graph`` at a
    time, or, when it is None, as many as keep ``saved_bytes`` (per layer) within
    ``join_bytes`` together (default :data:`JOIN_BYTES`). ``tied``: for each parameter
    several layers use, those layers; where the graphs would add its parts in another
    order than eager does, the layers concerned get a graph each (:func:`_tied_apart`)."""
    if layers_per_graph is None and (saved_bytes is None or len(saved_bytes) != n):
        raise UsageError("plan_graphs: joining by size needs every layer's saved bytes")
    join_bytes = JOIN_BYTES if join_bytes is None else join_bytes
    alone: set[int] = set()

    def kind(i: int) -> tuple[bool, bool, bool, bool]:
        return (i in offloaded, i in recomputed, i in cheap, i in parts)

    while True:
        plan: list[tuple[int, ...]] = []
        run: list[int] = []
        total = 0
        for i in range(n):
            size = 0 if saved_bytes is None else saved_bytes[i]
            if run and (kind(run[0]) != kind(i) or i in alone or run[0] in alone
                        or (layers_per_graph is not None and len(run) >= layers_per_graph)
                        or (layers_per_graph is None and total + size > join_bytes)):
                plan.append(tuple(run))
                run, total = [], 0
            run.append(i)
            total += size
        plan.append(tuple(run))
        more = _tied_apart(plan, tied) - alone
        if not more:
            return tuple(plan)
        alone |= more


def _tied_apart(plan: Sequence[tuple[int, ...]], tied: Sequence[AbstractSet[int]]) -> set[int]:
    """The layers to give a graph each so that a shared parameter's gradient is eager's
    bit for bit. Eager adds the layers' parts into it one at a time, the topmost layer's
    first; a graph adds the parts of the layers it covers first, then autograd adds that
    sum: the same order only where every graph but the one holding the topmost user
    holds one user at most. (A use outside the stack, a tied head above it, is not seen:
    its part comes between the stack's, and may differ in the last bits.)"""
    graph_of = {i: k for k, g in enumerate(plan) for i in g}
    out: set[int] = set()
    for users in tied:
        top = graph_of[max(users)]
        per_graph: dict[int, list[int]] = {}
        for i in users:
            per_graph.setdefault(graph_of[i], []).append(i)
        for k, held in per_graph.items():
            if k != top and len(held) > 1:
                out.update(held)
    return out


def unit_label(layers: Sequence[int]) -> str:
    """What messages call the layers one graph covers: ``"layer 3"``, ``"layers 0-2"``."""
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"


def layer_set(name: str, layers: Iterable[int], n: int) -> set[int]:
    """``layers`` as a set of layer indices (any integers: numpy's and one-element integer
    tensors too); a UsageError naming what is not one."""
    try:
        if isinstance(layers, (str, bytes)) or (isinstance(layers, torch.Tensor) and layers.dim() == 0):
            raise TypeError
        items = list(layers)  # (a 0-d numpy array raises here too)
    except TypeError:
        raise UsageError(f"{name} must be a collection of layer indices (e.g. [0, 2]), got "
                         f"{type(layers).__name__} {layers!r}") from None
    chosen: list[int] = []
    bad: list[Any] = []
    for i in items:
        k = as_integer(i)  # (a bool, or a mask's element, is no index)
        if k is None:
            bad.append(i)
        else:
            (chosen if 0 <= k < n else bad).append(k)
    if bad:
        raise UsageError(f"{name} {bad} are not layer indices (integers 0..{n - 1})")
    return set(chosen)


def check_layers(layers: Any) -> None:
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


def hooked_modules(layers: Sequence[nn.Module]) -> list[str]:
    """The layers' modules with forward or backward hooks (``layers[i].name``), and
    ``"every module"`` where global module hooks are registered."""
    found = [f"layers[{i}]{'.' + n if n else ''}" for i, layer in enumerate(layers)
             for n, m in layer.named_modules() if any(getattr(m, k, None) for k in _HOOK_KINDS)]
    glob = torch.nn.modules.module
    if any(getattr(glob, f"_global{k}", None) for k in _HOOK_KINDS):
        found.insert(0, "every module (global module hooks)")
    return found


_HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class HookWatch:
    """Whether a module hook was added to or removed from the layers' modules since it
    was made (global module hooks, which profilers and FLOP counters register while they
    run, are not watched). Cheap per call: the hook dictionaries' lengths, and their last
    keys only after a hook handle was made anywhere."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        self._dicts = [d for layer in layers for m in layer.modules() for k in _HOOK_KINDS
                       if isinstance(d := getattr(m, k, None), dict)]
        self._lens = list(map(len, self._dicts))
        self._last = self._last_keys()
        self._next_id = RemovableHandle.next_id

    def _last_keys(self) -> list[Any]:
        return [next(reversed(d), None) for d in self._dicts]

    def changed(self) -> bool:
        if list(map(len, self._dicts)) != self._lens:
            return True
        if RemovableHandle.next_id == self._next_id:
            return False  # (no hook registered anywhere since: a removal alone shows in lengths)
        if self._last_keys() != self._last:
            return True
        self._next_id = RemovableHandle.next_id
        return False


def param_name(layers: Iterable[nn.Module], p: torch.Tensor) -> str:
    """``layers[i].name`` of parameter ``p`` (its first place), for messages."""
    for i, m in enumerate(layers):
        for n, q in m.named_parameters():
            if q is p:
                return f"layers[{i}].{n}"
    return "a parameter"


def check_main_grads(layers: Iterable[nn.Module]) -> None:
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


def check_sample(sample: Any, backend: Backend) -> None:
    """A sample input is one tensor on the backend's device type."""
    if not isinstance(sample, torch.Tensor):
        raise UsageError(f"sample_input must be a torch.Tensor of the shape, dtype and device "
                         f"the stack will see, got {type(sample).__name__}")
    if sample.device.type != backend.device.type:
        raise UsageError(f"sample_input is on {sample.device}, but the {backend.name} "
                         f"backend runs on {backend.device}")

