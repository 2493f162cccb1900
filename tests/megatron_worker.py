"""Train a small Megatron-Core GPT with local CUDA graphs, with or without graphslot offload.

    python tests/megatron_worker.py --mode resident --steps 20 --out run.json

``--mode``: ``eager`` (no graphs), ``graphs`` (Megatron's local CUDA graphs, no offload),
``resident`` or ``remap`` (local graphs plus graphslot offload through
:mod:`graphslot.adapters.megatron`). ``--spec te`` builds the layers from Megatron's
TransformerEngine spec (``get_gpt_layer_with_transformer_engine_spec``, TE's RNG tracker,
no attention mask: causal attention in TE's fused kernels), ``--bf16`` trains in bf16
(``Float16Module``, fp32 master weights in the optimizer), ``--fp8 RECIPE`` adds fp8
compute with that Megatron ``fp8_recipe``, and ``--deterministic`` sets Megatron's
``deterministic_mode`` and ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (deterministic attention
backward, so separate runs can be compared bit for bit). One process, one GPU, Megatron's
own ``get_forward_backward_func()`` schedule; writes per-step losses, step times, a SHA-256
of the final parameters, driver-level memory and graphslot's report as JSON. Used by
tests/test_adapter_megatron.py and by the benchmark figures in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time
from functools import partial


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _census(segs: list) -> dict:
    """Live bytes of the pool's segments by the innermost Megatron or graphslot frame that
    allocated them (the rest by their innermost Python frame), largest first."""
    import collections

    def where(frames: list) -> str:
        py = [f for f in frames or [] if f.get("filename", "").endswith(".py")]
        mine = [f for f in py if "megatron" in f["filename"] or "graphslot" in f["filename"]
                or "/adapters/" in f["filename"] or "/core/" in f["filename"]]
        f = (mine or py or [{"filename": "?", "line": 0, "name": "(no python frame)"}])[0]
        return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}"

    by: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for seg in segs:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                k = where(blk.get("frames"))
                by[k] += blk["size"]
                count[k] += 1
            else:
                by["(free in the pool)"] += blk["size"]
    return {k: {"bytes": v, "blocks": count[k]} for k, v in by.most_common(25)}


def _watch_weakrefs():
    """Watch Megatron's ``make_weakref`` around each forward graph capture: the buffers a
    captured forward saved for backward that it gives back to the pool at the end of that
    forward capture, before the backward capture, while graphs captured in between (and so
    replayed in between) may take those bytes. Returns the function that reports them."""
    import torch
    from megatron.core.transformer import cuda_graphs

    if not hasattr(cuda_graphs, "make_weakref"):  # Megatron-Core before 0.17
        return lambda: {"make_weakref": False}
    saved: dict[int, int] = {}  # storage pointer -> bytes, saved by the forward being captured
    early: dict[int, int] = {}  # of those, given back before their backward capture
    released: list[int] = [0]  # every buffer make_weakref gave back
    seen: list[int] = [0]  # saved tensors the hook saw (0: another hook hid them)
    make_weakref = cuda_graphs.make_weakref
    create_fwd_graph = cuda_graphs._CudaGraphRunner.create_fwd_graph

    def watching_make_weakref(ten, inplace=True):
        if torch.is_tensor(ten) and getattr(ten, "is_from_global_mempool", False) \
                and getattr(cuda_graphs, "HAVE_TE_GRAPHS", False):
            released[0] += 1
            p = ten.untyped_storage().data_ptr()
            if p in saved:
                early[p] = saved[p]
        return make_weakref(ten, inplace)

    def pack(t):
        seen[0] += 1
        st = t.untyped_storage()
        if t.is_cuda and st.nbytes():
            saved[st.data_ptr()] = st.nbytes()
        return t.detach()  # the same bytes; no reference back to the node (no cycle)

    def watching_create_fwd_graph(self, *args, **kwargs):
        # This forward's saves only: the weak references at its end are checked against them.
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return create_fwd_graph(self, *args, **kwargs)
        finally:
            saved.clear()

    cuda_graphs.make_weakref = watching_make_weakref
    cuda_graphs._CudaGraphRunner.create_fwd_graph = watching_create_fwd_graph

    def report() -> dict:
        return {"make_weakref": True, "te_graphs": bool(getattr(cuda_graphs, "HAVE_TE_GRAPHS", False)),
                "released": released[0], "saved_tensors_seen": seen[0], "saved_and_released_before_backward_capture": len(early),
                "saved_and_released_before_backward_capture_bytes": sum(early.values())}

    return report


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
    ap.add_argument("--spec", choices=["local", "te"], default="local",
                    help="Megatron's local (torch) layer spec or its TransformerEngine spec")
    ap.add_argument("--bf16", action="store_true", help="bf16 model, fp32 master weights")
    ap.add_argument("--fp8", default="", help="fp8 compute with this Megatron fp8_recipe (needs --spec te)")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic_mode and NVTE_ALLOW_NONDETERMINISTIC_ALGO=0")
    ap.add_argument("--keep-graph-buffers", action="store_true",
                    help="make Megatron's make_weakref the identity: its graphs then own every "
                         "buffer they captured (with TE importable it weak-references them)")
    ap.add_argument("--report-weakrefs", action="store_true",
                    help="report the graph buffers Megatron releases with make_weakref that a captured "
                         "forward saved for its backward (the tensors its save_for_backward observer "
                         "cannot see, such as what torch's own norms save in C++)")
    ap.add_argument("--census", action="store_true",
                    help="record allocations and report what Megatron's graph pool holds, by allocating frame")
    ap.add_argument("--keep-graph-pool", action="store_true",
                    help="graphslot keeps Megatron's graph pool as it is (release_graph_pool=False)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.fp8 and a.spec != "te":
        ap.error("--fp8 needs --spec te")
    if a.deterministic:  # read by TransformerEngine when its attention modules are built
        os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if a.keep_graph_buffers:
        from megatron.core.transformer import cuda_graphs

        cuda_graphs.make_weakref = lambda ten, inplace=True: ten
    weakrefs = _watch_weakrefs() if a.report_weakrefs else None
    parallel_state.initialize_model_parallel(1, 1)
    graphs = a.mode != "eager"
    te_spec = a.spec == "te"
    # TE's attention asserts TE's own (graph-safe) RNG tracker under capture.
    model_parallel_cuda_manual_seed(1234, te_rng_tracker=te_spec, use_cudagraphable_rng=graphs and not te_spec)
    torch.manual_seed(1234)
    extra = {}
    if a.bf16 or a.fp8:
        extra.update(bf16=True, params_dtype=torch.bfloat16)
    if a.fp8:
        extra.update(fp8="hybrid", fp8_recipe=a.fp8)
    if a.deterministic:
        extra.update(deterministic_mode=True)
    config = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        ffn_hidden_size=4 * a.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        cuda_graph_impl="local" if graphs else "none", use_cpu_initialization=True, **extra,
    )
    spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec() if te_spec
            else gpt_layer_specs.get_gpt_layer_local_spec())
    gpt = GPTModel(config=config, transformer_layer_spec=spec,
                   vocab_size=a.vocab, max_sequence_length=a.seq).cuda()
    inner = Float16Module(config, gpt) if config.bf16 else gpt
    # Megatron's DDP owns the main_grad buffers its local graphs accumulate into.
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), inner)
    config.no_sync_func = model.no_sync
    params = [p for p in model.parameters() if p.requires_grad]
    # bf16: Adam steps fp32 master copies (bf16 weights would round small updates away, and
    # then wrong gradients could leave the losses unchanged); fp32: the parameters themselves.
    masters = [p.detach().float().clone() for p in params] if config.bf16 else params
    opt = torch.optim.Adam(masters, lr=1e-4)

    offload = None
    if a.mode in ("resident", "remap"):
        from graphslot.adapters import megatron as gs_megatron

        layers = [int(x) for x in a.offload_layers.split(",") if x] or None
        offload = gs_megatron.enable(model, mode=a.mode, layers=layers, debug_checksums=a.checksums,
                                     **({"release_graph_pool": False} if a.keep_graph_pool else {}))

    dev = torch.device("cuda")
    position_ids = torch.arange(a.seq, device=dev).unsqueeze(0).expand(a.batch, -1)
    # The local spec takes an explicit causal mask; TE's attention is causal by its mask type.
    mask = None if te_spec else torch.triu(torch.ones(a.seq, a.seq, device=dev, dtype=torch.bool), 1)[None, None]

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

    if a.census:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
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
        for m, p in zip(masters, params):
            m.grad = p.main_grad if m is p else p.main_grad.float()
        opt.step()
        if masters is not params:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(sum(float(d["lm loss"]) for d in out) / len(out)))
        free, total = torch.cuda.mem_get_info()
        used_peak = max(used_peak, total - free) if step >= 2 else used_peak

    # Steady state: the graph pools (and graphslot's banks) stay; cached blocks go.
    torch.cuda.synchronize()
    if offload is not None:
        offload.drain()  # the graph pool's release runs on graphslot's driver thread
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    graph_pool = None
    if graphs:  # what Megatron's graph pool holds after the steps (issue 15, item 3)
        from megatron.core.transformer.cuda_graphs import CudaGraphManager

        pool = CudaGraphManager.global_mempool
        segs = [x for x in torch.cuda.memory_snapshot()
                if pool is not None and tuple(x.get("segment_pool_id", ())) == tuple(pool)]
        graph_pool = {"segments": len(segs), "reserved_bytes": sum(x["total_size"] for x in segs),
                      "active_bytes": sum(x["active_size"] for x in segs)}
        if a.census:
            graph_pool["by_frame"] = _census(segs)
    digest = hashlib.sha256()  # every parameter's bytes after the last step, in model order
    for p in params:
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    res = {
        "mode": a.mode, "steps": a.steps, "losses": losses, "step_s": times,
        "params_sha256": digest.hexdigest(),
        "spec": a.spec, "dtype": "bf16" if config.bf16 else "fp32", "fp8": a.fp8 or None,
        "deterministic": a.deterministic, "keep_graph_buffers": a.keep_graph_buffers,
        "keep_graph_pool": a.keep_graph_pool,
        "median_step_ms_after_capture": 1000 * sorted(times[3:])[len(times[3:]) // 2] if len(times) > 3 else None,
        "driver_used_bytes": total - free, "driver_used_peak_bytes": used_peak,
        "torch_reserved_bytes": torch.cuda.memory_reserved(), "graph_pool": graph_pool,
        "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "shape": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "seq", "batch", "microbatches", "vocab")},
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
    }
    if weakrefs is not None:
        res["weakrefs"] = weakrefs()
    import sys

    import megatron.core

    res["megatron_core"] = megatron.core.__version__
    te = sys.modules.get("transformer_engine")
    res["transformer_engine"] = getattr(te, "__version__", None) if te is not None else None
    dpa = sys.modules.get("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    if dpa is not None and getattr(dpa, "_attention_backends", None):  # what TE chose
        res["te_attention_backend"] = {k: str(v) for k, v in dpa._attention_backends.items()
                                       if k in ("use_flash_attention", "use_fused_attention",
                                                "fused_attention_backend", "use_unfused_attention")}
    if offload is not None:
        res["graphslot"] = offload.report()
        offload.disable()
        if offload.pool is not None:  # what of the paged graph pool stays after disable()
            res["graph_pool_after_disable"] = offload.pool.report()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
