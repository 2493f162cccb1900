"""What a layer may not do under graphs, said in the library's words where torch's message
would name neither the layer nor the way out.

A graphed layer's forward is run (warm-ups, the profile, the capture) on an input that is
a leaf of its own, the buffer the layer below writes, and its backward is captured with
``torch.autograd.grad`` over that input and the parameters. A few things eager allows
cannot work so: changing the input in place, a reentrant checkpoint inside the layer, and
an integer tensor between two layers when gradients flow below it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from .errors import UsageError

__all__ = ["naming_refusals", "check_passes_gradient", "ctx_tensors", "next_node_number",
           "foreign_gradient_inputs"]

# (torch's message, the first words of ours after the layer's label)
_REFUSALS = (
    ("a leaf Variable that requires grad is being used in an in-place operation",
     "changes in place a leaf tensor that requires grad, most likely its input "
     "(nn.ReLU(inplace=True) or x.mul_(2) as a layer of its own): under graphs each layer "
     "reads its input as a leaf, which autograd does not let an op change. Use the "
     "out-of-place form, or make the in-place op part of the layer that makes its operand "
     "(nn.Sequential(nn.Linear(...), nn.ReLU(inplace=True)) as one layer)"),
    ("When use_reentrant=True, torch.utils.checkpoint is incompatible with",
     "calls torch.utils.checkpoint with use_reentrant=True, whose backward runs a backward "
     "of its own that a captured graph cannot hold: pass use_reentrant=False, or leave the "
     "checkpoint out and name the layer in recompute_layers (or give a memory_budget), "
     "which recompute it under the graphs"),
)


@contextlib.contextmanager
def naming_refusals(label: str) -> Iterator[None]:
    """Around a call of the layer named ``label``: the torch errors of :data:`_REFUSALS`
    become a :class:`~graphslot.errors.UsageError` that names the layer and the way out."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        for needle, why in _REFUSALS:
            if needle in text:
                raise UsageError(f"{label} {why}") from e
        raise


def check_passes_gradient(y: torch.Tensor, label: str, wants_grad: bool) -> None:
    """``y``, what the layer ``label`` returns to the layer above, can carry the gradient
    the layers below it want (``wants_grad``).

    Raises:
        UsageError: ``y`` is an integer or boolean tensor and a gradient is wanted below.
    """
    if wants_grad and not (y.is_floating_point() or y.is_complex()):
        raise UsageError(
            f"{label} returns a {y.dtype} tensor to the layer above, through which no "
            "gradient flows, while the layers below it (or the stack's input) want one: the "
            "graphs' backward runs through every layer. Only the stack's first layer may "
            "take such a tensor: begin a stack of its own with the layer above")


def ctx_tensors(out: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors that custom autograd Functions in ``out``'s autograd graph keep as
    attributes of their ``ctx`` (``ctx.h = ...``; also inside a list, tuple or dict there),
    each with its name (``"Function.attribute"``). Saved-tensor hooks never see them, so
    graphs keep one copy of such a tensor for all microbatches when the forward makes it."""
    found: list[tuple[str, torch.Tensor]] = []
    for node in _nodes(out, lambda node: True):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            cls = getattr(node, "_forward_cls", type(node))
            for name, v in vars(node).items():
                items = (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple))
                         else (v,))
                found += [(f"{cls.__name__}.{name}", t) for t in items if isinstance(t, torch.Tensor)]
    return found


def next_node_number() -> int:
    """The sequence number the next autograd node this thread makes will have about (one
    made now): nodes made from here on have larger ones."""
    with torch.enable_grad():
        return int((torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr())  # type: ignore[union-attr]


def foreign_gradient_inputs(out: torch.Tensor, own: set[int], since: int) -> list[str]:
    """What ``out``'s autograd graph reaches that wants a gradient but is neither one of the
    leaves ``own`` (ids: the layer's input and parameters) nor made by nodes numbered
    ``since`` and up (this thread's forward): a tensor the layer reads from outside that
    requires grad (a parameter it does not register, an attribute set to another module's
    output). A graph would read the one the build saw at every replay and give it no
    gradient. Each is described for a message."""
    found: list[str] = []

    def inside(node: Any) -> bool:  # (a leaf's AccumulateGrad has a variable)
        return not isinstance(getattr(node, "variable", None), torch.Tensor) and \
            node._sequence_nr() >= since

    for node in _nodes(out, inside):
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) not in own:
                found.append(f"a leaf tensor of shape {tuple(var.shape)} ({var.dtype})"
                             + (" that is an nn.Parameter" if isinstance(var, torch.nn.Parameter) else ""))
        elif node._sequence_nr() < since:
            found.append(f"a tensor made before the layer's forward (by {type(node).__name__})")
    return found


def _nodes(out: torch.Tensor, descend: Callable[[Any], bool]) -> Iterator[Any]:
    """The nodes of ``out``'s autograd graph, each once, going on past those ``descend``
    accepts."""
    # A node's Python object lives only while referenced, and a new one may take a freed
    # one's id: keeping each object seen keeps the ids apart (on a GPU, a joined stack's
    # walk skipped a foreign leaf through a reused id).
    seen: dict[int, Any] = {}
    todo = [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        if descend(node):
            todo += [n for n, _ in node.next_functions]
