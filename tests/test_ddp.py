"""torch's DistributedDataParallel over a model holding a GraphedLayers stack: two ranks
on gloo (the cpu backend), each with its own stack, train bit for bit as the same model
does eagerly under DDP, with gradient homes and with the pool's gradient buffers."""

from __future__ import annotations

import copy
import datetime
import queue
import time

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


def _rank(rank: int, store: str, mode: str, out: "mp.Queue[tuple[int, bool, bool]]") -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphslot.adapters.torch import GraphedLayers

    # (a file store: no port to race for; a short timeout: a rank that dies ends the other)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
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
def test_ddp_over_a_graphed_stack_trains_as_eager_ddp(backend, tmp_path, mode, homes):
    if backend.name != "cpu" or not dist.is_gloo_available():
        pytest.skip("two ranks on gloo, on the cpu backend")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), mode, out), daemon=True)
             for r in range(2)]
    got = []
    try:
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 300
        while len(got) < len(ranks):
            try:
                got.append(out.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
                assert not dead, f"a rank failed (exit codes {dead})"
                assert time.monotonic() < deadline, "the ranks did not report in 300 s"
        for p in ranks:
            p.join(60)
        assert [p.exitcode for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert sorted(got) == [(0, homes, True), (1, homes, True)]
