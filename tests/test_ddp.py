"""torch's DistributedDataParallel over a model holding a GraphedLayers stack: two ranks
on gloo (the cpu backend), each with its own stack, train bit for bit as the same model
does eagerly under DDP, with gradient homes and with the pool's gradient buffers."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

H = 32


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, H)
        self.stack = nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.GELU()) for _ in range(3)])
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.pre(x)))


def _rank(rank: int, port: int, mode: str, out: "mp.Queue[tuple[int, bool, bool]]") -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphslot.adapters.torch import GraphedLayers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        eager = _Model()
        graphed = copy.deepcopy(eager)
        graphed.stack = GraphedLayers(list(graphed.stack), torch.randn(8, H, requires_grad=True),
                                      mode=mode, layers_per_graph=1)
        nets = [(DDP(eager), torch.optim.SGD(eager.parameters(), lr=0.1)),
                (DDP(graphed), torch.optim.SGD(graphed.parameters(), lr=0.1))]
        same = True
        for k in range(3):
            g = torch.Generator().manual_seed(100 * k + rank)  # (each rank its own data)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            for net, opt in nets:
                nn.functional.mse_loss(net(x), y).backward()
            same &= all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(),
                                                                     graphed.parameters()))
            for _, opt in nets:
                opt.step()
                opt.zero_grad()
        same &= all(torch.equal(a, b) for a, b in zip(eager.parameters(), graphed.parameters()))
        out.put((rank, graphed.stack._grad_homes, same))
        graphed.stack.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode,homes", [("remap", True), ("off", False)])
def test_ddp_over_a_graphed_stack_trains_as_eager_ddp(backend, mode, homes):
    if backend.name != "cpu" or not dist.is_gloo_available():
        pytest.skip("two ranks on gloo, on the cpu backend")
    with socket.socket() as s:  # (a free port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port, mode, out)) for r in range(2)]
    for p in ranks:
        p.start()
    got = sorted(out.get(timeout=300) for _ in ranks)
    for p in ranks:
        p.join(60)
    assert got == [(0, homes, True), (1, homes, True)]
