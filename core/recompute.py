"""Recomputing only a layer's cheap ops: what :class:`~graphslot.adapters.torch.GraphedLayers`
captures for a layer whose plan says ``recompute`` with ``recompute_ops="cheap"``.

A recomputed layer normally saves only its input and runs its whole forward again in
its backward. Most of that forward's time is in a few ops (matrix products, attention,
convolutions) whose outputs are a minority of what the layer saves; the rest (norms,
activation functions, rotary embeddings, dtype casts, elementwise products) costs
little to run again and saves the most bytes. Recomputing cheaply keeps the outputs of
the expensive ops (:func:`is_expensive`) and runs only the cheap ops again, through
``torch.utils.checkpoint``'s selective policy, so the layer holds a fraction of its
activations for a fraction of a full recompute's time.

Device neutral: the ops are aten's, whatever the device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["EXPENSIVE_OPS", "is_expensive", "cheap_recompute_contexts", "noting_expensive_outputs"]


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


class _NoteOutputs(TorchDispatchMode):
    """Calls ``note`` with every tensor an expensive op returns."""

    def __init__(self, note: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_expensive(func):
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.note(t)
        return out


@contextlib.contextmanager
def noting_expensive_outputs(note: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within: ``note(t)`` for each tensor an expensive op (:func:`is_expensive`) returns."""
    with _NoteOutputs(note):
        yield


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_expensive(op) else CheckpointPolicy.PREFER_RECOMPUTE


def cheap_recompute_contexts(note: Callable[[torch.Tensor], None] | None = None
                             ) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that keeps the expensive ops' outputs and recomputes the rest in the backward.

    Args:
        note: called with each output kept (what the layer holds until its backward),
            as the forward makes it.
    """
    def contexts() -> tuple[Any, Any]:
        forward, recompute = create_selective_checkpoint_contexts(_policy)
        if note is None:
            return forward, recompute
        return _both(forward, note), recompute

    return contexts


@contextlib.contextmanager
def _both(forward: Any, note: Callable[[torch.Tensor], None]) -> Iterator[None]:
    with forward, noting_expensive_outputs(note):
        yield
