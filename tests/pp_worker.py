"""One rank of a two-rank pipeline-parallel run, for tests/test_pipeline.py.

    python tests/pp_worker.py RANK WORLD PORT MODE OUT.json [gpipe|interleaved]

``gpipe``: stage 0 holds the embedding and the first half of the blocks, stage 1 the
second half, the final norm and the head. ``interleaved``: two virtual stages per rank,
placed round-robin as in interleaved pipeline schedules (rank 0 holds model chunks 0 and
2, rank 1 chunks 1 and 3), so every microbatch crosses the ranks three times each way.
Each step runs every microbatch's forward, then every backward, over torch.distributed
send/recv; graphslot only wraps each rank's blocks (one ``GraphedLayers`` per chunk).
The same steps run eagerly and graphed with offload from the same weights, and the rank
writes losses, parameter checksums and its memory report to OUT.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import graphslot
from graphslot.adapters.torch import GraphedLayers
from graphslot.memory import report
from graphslot.cli.toy import GPTConfig, TinyGPT

STEPS, MICRO = 3, 3


def chunks(model: TinyGPT, rank: int, schedule: str) -> list[list[torch.nn.Module]]:
    """This rank's model chunks, in forward order."""
    n = len(model.blocks)
    if schedule == "gpipe":
        return [list(model.blocks[:n // 2] if rank == 0 else model.blocks[n // 2:])]
    per = n // 4  # global chunk 2v + rank is this rank's virtual stage v
    return [list(model.blocks[(2 * v + rank) * per:(2 * v + rank + 1) * per]) for v in range(2)]


def run(model: TinyGPT, stacks: list[torch.nn.Module], rank: int, b: graphslot.Backend) -> list[float]:
    if len(stacks) == 2:
        return run_interleaved(model, stacks, rank, b)
    stack = stacks[0]
    c = model.config
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shape = (c.batch, c.seq, c.hidden)
    losses: list[float] = []
    for step in range(STEPS):
        keep = []
        for mb in range(MICRO):  # all forwards: MICRO microbatches in flight
            tokens, targets = model.batch(step * MICRO + mb, b.device)
            if rank == 0:
                h = stack(model.hidden_in(tokens))
                dist.send(h.detach().cpu(), 1)
                keep.append(h)
            else:
                buf = torch.empty(shape)
                dist.recv(buf, 0)
                h_in = buf.to(b.device).requires_grad_()
                logits = model.head(model.ln_f(stack(h_in)))
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                keep.append((h_in, loss))
        for mb in range(MICRO):  # then every backward, oldest first
            if rank == 1:
                h_in, loss = keep[mb]
                (loss / MICRO).backward()
                dist.send(h_in.grad.detach().cpu(), 0)
                losses.append(float(loss.detach()))
            else:
                g = torch.empty(shape)
                dist.recv(g, 1)
                keep[mb].backward(g.to(b.device))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def run_interleaved(model: TinyGPT, stacks: list[torch.nn.Module], rank: int,
                    b: graphslot.Backend) -> list[float]:
    """Chunks 0..3 alternate between the ranks; all forwards, then all backwards."""
    c = model.config
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shape = (c.batch, c.seq, c.hidden)
    peer = 1 - rank
    losses: list[float] = []

    def recv() -> torch.Tensor:
        buf = torch.empty(shape)
        dist.recv(buf, peer)
        return buf.to(b.device)

    for step in range(STEPS):
        keep: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for mb in range(MICRO):
            tokens, targets = model.batch(step * MICRO + mb, b.device)
            for v in range(2):  # this rank's virtual stages, in forward order
                first = rank == 0 and v == 0
                x = model.hidden_in(tokens) if first else recv().requires_grad_()
                h = stacks[v](x)
                if rank == 1 and v == 1:  # the last chunk: the loss
                    logits = model.head(model.ln_f(h))
                    h = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                else:
                    dist.send(h.detach().cpu(), peer)
                keep[(mb, v)] = (x, h)
        for mb in range(MICRO):  # every backward, oldest microbatch first
            for v in (1, 0):
                x, h = keep.pop((mb, v))
                if rank == 1 and v == 1:
                    (h / MICRO).backward()
                    losses.append(float(h.detach()))
                else:
                    h.backward(recv())
                if not (rank == 0 and v == 0):
                    dist.send(x.grad.detach().cpu(), peer)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def main() -> None:
    rank, world, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    schedule = sys.argv[6] if len(sys.argv) > 6 else "gpipe"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if os.environ.get("GRAPHSLOT_BACKEND") == "cuda":  # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
    b = graphslot.get_backend()
    c = GPTConfig(hidden=32, heads=2, ffn=64, seq=16, batch=2, layers=4 if schedule == "gpipe" else 8, vocab=64)
    torch.manual_seed(0)
    base = TinyGPT(c).to(b.device)

    def timed(model: TinyGPT, stacks: list[torch.nn.Module]) -> tuple[list[float], dict]:
        b.synchronize()
        b.allocator_stats(reset_peak=True)
        t0 = time.perf_counter()
        losses = run(model, stacks, rank, b)
        b.synchronize()
        return losses, {"step_ms": (time.perf_counter() - t0) * 1e3 / STEPS,
                        "peak_reserved_bytes": b.allocator_stats()["peak_reserved_bytes"]}

    eager = copy.deepcopy(base)
    eager_losses, eager_perf = timed(eager, [torch.nn.Sequential(*ch) for ch in chunks(eager, rank, schedule)])

    model = copy.deepcopy(base)
    sample = torch.zeros(c.batch, c.seq, c.hidden, device=b.device, requires_grad=True)
    stacks = [GraphedLayers(ch, sample, mode=mode, backend=b, debug_checksums=True,
                             layers_per_graph=1)
              for ch in chunks(model, rank, schedule)]
    losses, perf = timed(model, stacks)
    for st in stacks:
        st.engine.wait_idle()
    mem = report(b).as_dict()
    banks = {(f"chunk{v}." if len(stacks) > 1 else "") + g.name: g.bank.index if g.bank is not None else None
             for v, st in enumerate(stacks) for g in st.engine.groups}
    ledger = b.ledger.snapshot()
    reports: list = [None] * world
    dist.all_gather_object(reports, {"rank": rank, "ledger": ledger, "memory": mem, "banks": banks,
                                     "eager": eager_perf, "offload": perf})
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    with open(out, "w") as f:
        json.dump({"rank": rank, "losses": losses, "eager_losses": eager_losses, "params_equal": same,
                   "reports": reports, "schedule": schedule,
                   "offloaded": sum(st.engine.stats["offloaded_bytes"] for st in stacks)}, f)
    if rank == 0:  # per-rank memory reports side by side
        keys = ("mapped_bytes", "allocated_bytes", "reserved_va_bytes", "driver_used_bytes")
        print("rank " + "".join(f"{k:>20}" for k in keys) + "   eager ms/step  offload ms/step")
        for r in reports:
            row = {**r["memory"], **{k: r["ledger"].get(k, r["memory"].get(k)) for k in keys}}
            print(f"{r['rank']:>4} " + "".join(f"{row[k]:>20}" for k in keys)
                  + f"{r['eager']['step_ms']:16.1f}{r['offload']['step_ms']:17.1f}")
    for st in stacks:
        st.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
