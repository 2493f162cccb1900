"""transformers' own layers through GraphedLayers, trained beside eager, bitwise: Llama's
decoder layer (rotary embeddings, grouped keys and values), GPT-2's block and BERT's
encoder layer, with dropout, recomputed layers and a memory budget. Skipped where
transformers is not installed (the ``models`` extra)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from graphslot.adapters.torch import GraphedLayers

transformers = pytest.importorskip("transformers")

HIDDEN, SEQ, BATCH = 64, 16, 2


class OneTensor(nn.Module):
    """A transformers layer as GraphedLayers takes one: one tensor in, one out (the first
    of a tuple), the rotary embedding's cos and sin fixed where the layer takes them."""

    def __init__(self, layer: nn.Module, rotary: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.layer, self.rotary = layer, rotary is not None
        if rotary is not None:  # (buffers: they move with the model)
            self.register_buffer("cos", rotary[0], persistent=False)
            self.register_buffer("sin", rotary[1], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (self.layer(x, position_embeddings=(self.cos, self.sin)) if self.rotary
               else self.layer(x))
        return out[0] if isinstance(out, tuple) else out


def _llama(n: int, p: float) -> list[nn.Module]:
    from transformers.models.llama import modeling_llama as m

    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=2 * HIDDEN, num_hidden_layers=n,
                                   max_position_embeddings=SEQ, attention_dropout=p)
    cfg._attn_implementation = "sdpa"
    cos, sin = m.LlamaRotaryEmbedding(config=cfg)(torch.empty(0), torch.arange(SEQ).expand(BATCH, -1))
    return [OneTensor(m.LlamaDecoderLayer(cfg, i), (cos, sin)) for i in range(n)]


def _gpt2(n: int, p: float) -> list[nn.Module]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=n, n_head=4, n_positions=SEQ,
                                  attn_pdrop=p, resid_pdrop=p, embd_pdrop=p)
    cfg._attn_implementation = "sdpa"
    return [OneTensor(GPT2Block(cfg, layer_idx=i)) for i in range(n)]


def _bert(n: int, p: float) -> list[nn.Module]:
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = transformers.BertConfig(hidden_size=HIDDEN, num_attention_heads=4,
                                  intermediate_size=2 * HIDDEN, num_hidden_layers=n,
                                  hidden_dropout_prob=p, attention_probs_dropout_prob=p)
    cfg._attn_implementation = "sdpa"
    return [OneTensor(BertLayer(cfg)) for _ in range(n)]


FAMILIES = {"llama": _llama, "gpt2": _gpt2, "bert": _bert}


class Model(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.pre, self.head = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList(blocks)
        self.stack: nn.Module = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.pre(x)))


def _train(model: Model, device: torch.device, graphed: dict | None, set_to_none: bool):
    """Three AdamW steps of two microbatches each, seeded once before the stack is built
    (so dropout draws as in eager); the losses, then every parameter and gradient."""
    g = torch.Generator().manual_seed(5)
    data = [[(torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(device),
              torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(device)) for _ in range(2)]
            for _ in range(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    stack = None
    if graphed is not None:
        sample = data[0][0][0].clone().requires_grad_()  # (drawing nothing: the seed holds)
        stack = model.stack = GraphedLayers(list(model.blocks), sample, **graphed)
    losses = []
    for step in data:
        for x, y in step:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    grads = [p.grad for p in model.parameters()]
    if stack is not None:
        stack.close()
    return losses, [p.detach() for p in model.parameters()], grads


def _same(a: list, b: list) -> bool:
    return all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
               for u, v in zip(a, b))


CONFIGS = {
    "off": (0.0, dict(mode="off")),
    "remap": (0.0, dict(mode="remap")),
    "dropout-resident": (0.1, dict(mode="resident")),
    "dropout-recompute": (0.1, dict(mode="resident", recompute_layers=[0], offload_layers=[1])),
    "dropout-cheap": (0.1, dict(mode="off", recompute_layers=[1], recompute_ops="cheap")),
    "dropout-budget": (0.1, dict(memory_budget="auto")),
    "parts": (0.0, dict(mode="remap", recompute_layers=[0, 1], recompute_ops="parts",
                        offload_layers=[1])),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_layers_train_as_eager_bitwise(clean, family, config):
    b = clean
    p, kw = CONFIGS[config]
    torch.manual_seed(0)
    base = Model(FAMILIES[family](3, p)).to(b.device)
    set_to_none = config != "remap"  # (one case keeps .grad, zeroed in place)
    want = _train(copy.deepcopy(base), b.device, None, set_to_none)
    got = _train(copy.deepcopy(base), b.device, dict(kw, layers_per_graph=1, backend=b), set_to_none)
    for what, w, g in zip(("losses", "parameters", "gradients"), want, got):
        assert _same(g, w), f"{family} {config}: {what} differ from eager's"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layers_recomputed_by_parts_train_as_eager_with_microbatches_in_flight(clean, family):
    """A decoder layer's attention gets its rotary embeddings by keyword, in a tuple: with
    two microbatches in flight each backward must recompute from its own."""
    b = clean
    torch.manual_seed(0)
    base = Model(FAMILIES[family](3, 0.0)).to(b.device)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(b.device) for _ in range(2)]
    eager, mine = copy.deepcopy(base), copy.deepcopy(base)
    mine.stack = GraphedLayers(list(mine.blocks), xs[0].clone().requires_grad_(), backend=b,
                               mode="off", recompute_layers=[0, 1, 2], recompute_ops="parts",
                               layers_per_graph=1)
    with mine.stack:
        for m in (eager, mine):
            outs = [m(x).square().sum() for x in xs]
            for o in reversed(outs):
                o.backward()
        assert _same([p.grad for p in mine.parameters()], [p.grad for p in eager.parameters()])
