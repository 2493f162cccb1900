"""GraphedLayers in the training loops users write, over model families: random draws of
a family (encoder layers, MLPs with in-place activations, batch-norm convolutions,
layers that change the hidden size), a build (a memory budget or explicit offload and
recompute lists, joined or per-layer graphs, each mode, ``keep_grads`` or not) and a loop (microbatches,
``.grad`` kept or set to None, SGD or AdamW, frozen parameters, an input with or without
a gradient, a validation pass in eval mode, autocast, one seed set before the build).
Losses, parameters, buffers and gradients must equal eager's bit for bit.

One difference is by design and drawn around: under autocast a weight tied across layers
is cast at each use (README), so no family here ties weights. Recomputed layers draw
eager's dropout masks, so families with dropout are recomputed too.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from graphslot.adapters.torch import GraphedLayers
from graphslot.errors import BudgetError
from test_graphed_grads import assert_bitwise

_EXAMPLES = int(os.environ.get("GRAPHSLOT_LOOP_EXAMPLES", "10"))


class _Mlp(nn.Module):
    def __init__(self, h: int, drop: float, inplace: bool) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.act, self.drop = nn.ReLU(inplace=inplace), nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.act(self.up(self.norm(x)))))


class _ConvNorm(nn.Module):
    def __init__(self, h: int, drop: float, inplace: bool) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv1d(h, h, 3, padding=1), nn.BatchNorm1d(h)
        self.act = nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.transpose(1, 2)
        return (t + self.act(self.norm(self.conv(t)))).transpose(1, 2)


class _Encoder(nn.TransformerEncoderLayer):
    def __init__(self, h: int, drop: float, inplace: bool) -> None:
        super().__init__(h, 4, 2 * h, dropout=drop, batch_first=True, norm_first=inplace)


class _Resize(nn.Module):
    def __init__(self, h: int, drop: float, inplace: bool) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.lin(x))))


_FAMILIES = {"mlp": _Mlp, "convnorm": _ConvNorm, "encoder": _Encoder, "resize": _Resize}


class _Model(nn.Module):
    def __init__(self, layers: list[nn.Module], h: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(layers)
        self.stack: nn.Module = nn.Sequential(*layers)
        self.head = nn.Linear(h, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.stack(x)).squeeze(-1).sum(-1), y)


def _train(m: _Model, data, loop: dict) -> list[torch.Tensor]:
    opt = (torch.optim.AdamW if loop["adam"] else torch.optim.SGD)(
        [p for p in m.parameters() if p.requires_grad], lr=1e-3)
    dev = data[0][0].device.type
    seen = []
    for step in range(2):
        m.train()
        for k in range(loop["micro"]):
            x, y = data[(step * loop["micro"] + k) % len(data)]
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=loop["amp"]):
                loss = m(x.clone().requires_grad_(loop["input_grad"]), y)
            loss.backward()
            seen.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=not loop["keep_grad"])
        if loop["validate"]:
            m.eval()
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=loop["amp"]):
                seen.append(m(*data[-1]).clone())
    return seen + [t.detach().clone() for t in (*m.parameters(), *m.buffers())] + [
        p.grad.clone() for p in m.parameters() if p.grad is not None]


@st.composite
def _cases(draw):
    n = draw(st.integers(2, 4))
    build = draw(st.sampled_from(["budget", "explicit"]))
    explicit = {}
    if build == "explicit":
        explicit = dict(
            mode=draw(st.sampled_from(["off", "resident", "remap"])),
            offload_layers=draw(st.lists(st.integers(0, n - 1), unique=True)),
            recompute_layers=draw(st.lists(st.integers(0, n - 1), unique=True)),
            layers_per_graph=draw(st.sampled_from([None, 1, 2])))
        if explicit["mode"] == "off":
            explicit["offload_layers"] = []
    return dict(
        family=draw(st.sampled_from(sorted(_FAMILIES))), n=n,
        drop=draw(st.sampled_from([0.0, 0.2])),
        inplace=draw(st.booleans()), budget=draw(st.sampled_from(["auto", "least"])),
        explicit=explicit, keep_grads=draw(st.booleans()),
        loop=dict(micro=draw(st.integers(1, 2)), keep_grad=draw(st.booleans()),
                  adam=draw(st.booleans()), amp=draw(st.booleans()),
                  validate=draw(st.booleans()), input_grad=draw(st.booleans()),
                  frozen=draw(st.booleans())))


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_cases())
def test_a_training_loop_runs_as_eager_bitwise(clean, case, monkeypatch):
    b = clean
    # (cuDNN may pick a convolution backward that adds in any order: not bit for bit)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    h, loop = 16, case["loop"]
    torch.manual_seed(0)
    family = _FAMILIES[case["family"]]
    base = _Model([family(h, case["drop"], case["inplace"]) for _ in range(case["n"])], h).to(b.device)
    if loop["frozen"]:
        for k, p in enumerate(base.blocks.parameters()):
            p.requires_grad_(k % 3 != 1)
    data = [(torch.randn(2, 8, h, device=b.device), torch.randn(2, device=b.device))
            for _ in range(3)]
    torch.manual_seed(1)
    want = _train(copy.deepcopy(base), data, loop)

    model = copy.deepcopy(base)
    sample = torch.randn(2, 8, h, device=b.device, requires_grad=loop["input_grad"])
    kw: dict = dict(backend=b, keep_grads=case["keep_grads"], **case["explicit"])
    if not case["explicit"]:
        kw["memory_budget"] = "auto"
        if case["budget"] == "least":
            with pytest.raises(BudgetError, match=r"smallest peak any plan reaches|below what "
                                                  r"the plans built for it hold") as refused:
                with torch.autocast(b.device.type, dtype=torch.bfloat16, enabled=loop["amp"]):
                    GraphedLayers(list(model.blocks), sample, **{**kw, "memory_budget": 1})
            kw["memory_budget"] = refused.value.least_bytes  # (it has room for what moves)
    torch.manual_seed(1)
    with torch.autocast(b.device.type, dtype=torch.bfloat16, enabled=loop["amp"]):
        stack = GraphedLayers(list(model.blocks), sample, **kw)
    with stack:
        model.stack = stack
        got = _train(model, data, loop)
    assert_bitwise(got, want)
