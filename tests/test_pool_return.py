"""What a build gives back to the graphs' pool, under cuda's rules on the cpu backend: a
buffer goes back only when no graph captured after it, and nothing handed to the caller,
uses it. The cpu backend's graphs keep what they captured, so the pool's return is given
cuda's behaviour here (a stand-in for the view, the storage given back counted as empty,
which the build's own check looks for). Builds only: no replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphslot.adapters import torch as gt
from graphslot.errors import StateError
from stacks import small_gpt
from test_pool_grad_buffers import (_InnerAddFull, _PosAdd, _Reshaped, _returning_like_cuda,
                                        _still_used, _TanhAddFull, _Widen)


class _Scale(nn.Module):
    """``x * w``, its output a new tensor and its input gradient another."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _View(nn.Module):
    """Hands on a view of its input: its output and input share bytes, and so do their
    gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape)


def _zoo(kind: str, b) -> tuple[list[nn.Module], torch.Tensor]:
    torch.manual_seed(11)
    if kind == "gpt":
        model = small_gpt(b, 4)
        return list(model.blocks), model.hidden_in(model.batch(0, b.device)[0]).detach()
    x = torch.randn(2, 4, 8, device=b.device)
    if kind == "widths":
        widths = [8, 16, 16, 8, 8]
        return [_Widen(i, o) for i, o in zip(widths, widths[1:])], x
    pass_through = {"pos": lambda: _PosAdd(4, 8), "reshape": lambda: _Reshaped(8), "view": _View,
                    "inner": lambda: _InnerAddFull((2, 4, 8)),
                    "tanh": lambda: _TanhAddFull((2, 4, 8))}[kind]
    # (first, beside layers of another kind and of its own, and last)
    return [pass_through(), _Scale(8), _Widen(8, 8), pass_through(), pass_through(), _Widen(8, 8),
            _Scale(8), pass_through()], x


PLANS = {  # mode, offload_layers, recompute_layers (over the first four layers)
    "kept": ("off", [], []),
    "recomputed": ("off", [], [0, 1, 2, 3]),
    "resident": ("resident", [0, 1, 2, 3], []),
    "remap-mixed": ("remap", [0, 2, 3], [1]),
    "remap-recomputed": ("remap", [0, 1, 2, 3], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", ["gpt", "widths", "pos", "reshape", "view", "inner", "tanh"])
def test_nothing_the_stack_uses_goes_back_to_the_pool(clean, monkeypatch, kind, plan):
    b = clean
    layers, x = _zoo(kind, b)
    layers = [m.to(b.device) for m in layers]
    mode, offload, recompute = PLANS[plan]
    returned = _returning_like_cuda(b, monkeypatch)
    with gt.GraphedLayers(layers, x.requires_grad_(), mode=mode, offload_layers=offload,
                          recompute_layers=recompute, layers_per_graph=1, backend=b) as stack:
        assert _still_used(stack, returned) == []
    assert returned  # (buffers did go back: the check was not vacuous)


def test_a_buffer_given_back_while_in_use_fails_the_build_by_name(clean, monkeypatch):
    """The build's own check: were a buffer the stack still uses given back, the build
    says which, instead of training on bytes later graphs overwrite."""
    from graphslot.adapters.torch import stack as stack_module

    b = clean
    returned = _returning_like_cuda(b, monkeypatch)
    # (as the build was before layers handing their gradient on were known: every
    # buffer between two layers goes back)
    monkeypatch.setattr(stack_module.GraphedLayers, "_held_elsewhere", lambda self, buf, holders: False)
    layers = [nn.Linear(8, 8), _PosAdd(4, 8), nn.Linear(8, 8)]
    with pytest.raises(StateError, match=r"layer 0: its output gradient buffer was given back to the graphs. pool while the stack still uses it"):
        gt.GraphedLayers([m.to(b.device) for m in layers],
                         torch.randn(2, 4, 8, device=b.device, requires_grad=True),
                         mode="off", layers_per_graph=1, backend=b)
    assert returned
