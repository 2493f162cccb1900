"""Recomputed layers whose forward reads buffers it also changes (spectral norm's power
iteration, a step counter, a running mean the output subtracts): the recompute runs from
the buffers as that microbatch's forward found them, so gradients are eager's bit for bit
(``torch.utils.checkpoint`` runs them from the changed buffers and differs), and the
buffers move once a forward, as in eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphslot.adapters.torch import GraphedLayers
from test_graphed_grads import assert_bitwise

H = 16


class _Counted(nn.Module):
    """Scales by a step count it then advances."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * (1 + 0.1 * self.step)
        self.step.add_(1)
        return torch.tanh(y)


class _Centred(nn.Module):
    """Subtracts a running mean it updates first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.register_buffer("mean", torch.zeros(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return torch.tanh(h - self.mean)


class _Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


KINDS = [_Counted, _Centred, _Spectral]
PLANS = [dict(mode="off", recompute_layers=[0, 1, 2]),  # (one graph: layer 1's input is made again)
         dict(mode="off", recompute_layers=[1], layers_per_graph=1),
         dict(mode="resident", recompute_layers=[0, 2], layers_per_graph=1),
         dict(mode="remap", recompute_layers=[0, 1, 2], layers_per_graph=1),
         dict(mode="resident", recompute_layers=[0, 1], recompute_ops="cheap", layers_per_graph=1)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__.strip("_"))
@pytest.mark.parametrize("plan", PLANS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_a_recompute_reads_the_buffers_its_forward_read(clean, kind, plan):
    b = clean
    torch.manual_seed(0)
    layers = [kind().to(b.device) for _ in range(3)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    with GraphedLayers(layers, torch.zeros(4, H, device=b.device, requires_grad=True),
                       backend=b, **plan) as stack:
        opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1, momentum=0.9)
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            xs = [torch.randn(4, H, device=b.device, requires_grad=True) for _ in range(2)]
            # two microbatches' forwards before their backwards: each recompute reads what
            # its own forward read, not what the later forward left
            outs = [stack(x) for x in xs]
            outs_e = [eager(x.detach().clone()) for x in xs]
            for y, ye in zip(reversed(outs), reversed(outs_e)):
                y.square().sum().backward()
                ye.square().sum().backward()
            assert_bitwise([p.grad for m in layers for p in m.parameters()],
                           [p.grad for p in eager.parameters()])
            opt.step()
            opt_e.step()
            opt.zero_grad()
            opt_e.zero_grad()
        assert_bitwise([t for m in layers for t in (*m.parameters(), *m.buffers())],
                       [t for m in eager for t in (*m.parameters(), *m.buffers())])


def test_the_profile_counts_the_changed_buffers_a_recompute_saves(clean):
    """A recompute saves, with its input, the buffers its forward changes: the budget's
    profile counts them as what the layer saves when recomputed."""
    from graphslot.profile import profile_units

    b = clean
    x = torch.randn(4, H, device=b.device, requires_grad=True)
    plain, centred = nn.Linear(H, H).to(b.device), _Centred().to(b.device)
    [p], [c] = profile_units(b, [plain], x), profile_units(b, [centred], x)
    assert p.input_bytes == x.numel() * x.element_size()
    assert c.input_bytes == p.input_bytes + centred.mean.numel() * centred.mean.element_size()
