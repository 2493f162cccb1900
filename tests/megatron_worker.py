"""Train a small Megatron-Core GPT with local CUDA graphs, with or without graphslot offload.

    python tests/megatron_worker.py --mode resident --steps 20 --out run.json

``--mode``: ``eager`` (no graphs), ``graphs`` (Megatron's local CUDA graphs, no offload),
``resident`` or ``remap`` (local graphs plus graphslot offload through
:mod:`graphslot.adapters.megatron`). One process, one GPU, Megatron's own
``get_forward_backward_func()`` schedule; writes per-step losses, step times, driver-level
memory and graphslot's report as JSON. Used by tests/test_adapter_megatron.py and by the
benchmark figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from functools import partial


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["eager", "graphs", "resident", "remap"], required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--offload-layers", type=str, default="", help="comma list of layer numbers")
    ap.add_argument("--checksums", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    graphs = a.mode != "eager"
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=graphs)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        cuda_graph_impl="local" if graphs else "none", use_cpu_initialization=True,
    )
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=a.vocab, max_sequence_length=a.seq).cuda()
    # Megatron's DDP owns the main_grad buffers its local graphs accumulate into.
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
    config.no_sync_func = model.no_sync
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4)

    offload = None
    if a.mode in ("resident", "remap"):
        from graphslot.adapters import megatron as gs_megatron

        layers = [int(x) for x in a.offload_layers.split(",") if x] or None
        offload = gs_megatron.enable(model, mode=a.mode, layers=layers, debug_checksums=a.checksums)

    dev = torch.device("cuda")
    position_ids = torch.arange(a.seq, device=dev).unsqueeze(0).expand(a.batch, -1)
    mask = torch.triu(torch.ones(a.seq, a.seq, device=dev, dtype=torch.bool), 1)[None, None]

    def batches(step: int):
        for mb in range(a.microbatches):
            g = torch.Generator().manual_seed(step * 1000 + mb)
            tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        out = model(tokens, position_ids, mask, labels=labels)
        return out, partial(loss_func)

    fwd_bwd = get_forward_backward_func()
    losses: list[float] = []
    times: list[float] = []
    used_peak = 0
    for step in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=batches(step), model=[model],
                      num_microbatches=a.microbatches, seq_length=a.seq, micro_batch_size=a.batch,
                      forward_only=False)
        model.finish_grad_sync()
        for p in params:
            p.grad = p.main_grad
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(sum(float(d["lm loss"]) for d in out) / len(out)))
        free, total = torch.cuda.mem_get_info()
        used_peak = max(used_peak, total - free) if step >= 2 else used_peak

    # Steady state: the graph pools (and graphslot's banks) stay; cached blocks go.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    res = {
        "mode": a.mode, "steps": a.steps, "losses": losses, "step_s": times,
        "median_step_ms_after_capture": 1000 * sorted(times[3:])[len(times[3:]) // 2] if len(times) > 3 else None,
        "driver_used_bytes": total - free, "driver_used_peak_bytes": used_peak,
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "shape": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "seq", "batch", "microbatches", "vocab")},
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
    }
    import megatron.core

    res["megatron_core"] = megatron.core.__version__
    if offload is not None:
        res["graphslot"] = offload.report()
        offload.disable()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
