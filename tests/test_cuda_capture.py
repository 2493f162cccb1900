"""CUDA only: capture that does not depend on the eager warm-up, and a quiet hot path.

* Every SDPA backend PyTorch may pick (flash, memory-efficient, math, cuDNN) x fp32 /
  bf16 / fp16 x head dims 16 to 128 captures in resident and remap mode and trains
  bitwise like eager. (The memory-efficient kernel saves its RNG seed and offset as
  device tensors under capture but as host tensors eagerly.)
* No AccumulateGrad stream-mismatch warning while training a GraphedLayers stack.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphslot.adapters.torch import GraphedLayers
from devices import selected_backend

_backend, _unavailable = selected_backend()
pytestmark = pytest.mark.skipif(
    _backend is None or _backend.name != "cuda",
    reason=_unavailable or "CUDA only: SDPA kernel selection and AccumulateGrad streams")


class _Attn(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(o.transpose(1, 2).reshape(b, s, h))


def _train(layers: nn.ModuleList, stack: nn.Module | None, dtype: torch.dtype, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(layers.parameters(), lr=0.01)
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(2, 64, layers[0].qkv.in_features, generator=g).to("cuda", dtype)
        h = x
        if stack is not None:
            h = stack(x)
        else:
            for m in layers:
                h = m(h)
        loss = h.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.detach())
    torch.cuda.synchronize()
    return out + [p.detach().clone() for p in layers.parameters()]


BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"]


@pytest.mark.parametrize("sdpa", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_every_sdpa_backend_captures_and_trains_like_eager(clean, sdpa, dtype, head_dim):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = clean
    kind = getattr(SDPBackend, sdpa, None)
    if kind is None:
        pytest.skip(f"this torch has no SDPBackend.{sdpa}")
    torch.manual_seed(0)
    base = nn.ModuleList([_Attn(2 * head_dim, 2) for _ in range(2)]).to("cuda", dtype)
    with sdpa_kernel([kind]):
        try:
            want = _train(copy.deepcopy(base), None, dtype)
        except RuntimeError as e:  # this kernel does not serve this dtype / head dim
            pytest.skip(f"{sdpa} does not run {dtype} head dim {head_dim}: {str(e).splitlines()[0]}")
        again = _train(copy.deepcopy(base), None, dtype)
        deterministic = all(torch.equal(a, c) for a, c in zip(want, again))
        for mode in ("resident", "remap"):
            layers = copy.deepcopy(base)
            sample = torch.zeros(2, 64, 2 * head_dim, device="cuda", dtype=dtype)
            with GraphedLayers(list(layers), sample, mode=mode, backend=b) as stack:
                got = _train(layers, stack, dtype)
            for i, (x, y) in enumerate(zip(got, want)):
                if deterministic:
                    assert torch.equal(x, y), f"{mode}: tensor {i} differs by {float((x.float() - y.float()).abs().max())}"
                else:  # the kernel itself is not bitwise repeatable eagerly (atomics)
                    torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-3)


def test_training_a_stack_raises_no_accumulate_grad_stream_warning(clean):
    b = clean
    torch.manual_seed(0)
    layers = nn.ModuleList([_Attn(128, 2) for _ in range(3)]).to("cuda", torch.bfloat16)
    sample = torch.zeros(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    for mode in ("off", "resident", "remap"):
        with GraphedLayers(list(layers), sample, mode=mode, backend=b) as stack:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                _train(layers, stack, torch.bfloat16, steps=2)
            assert not [w for w in seen if "stream" in str(w.message).lower()], [str(w.message) for w in seen]


def _pool_beside_gradients(layers: int, mode: str) -> tuple[int, int]:
    torch.manual_seed(0)
    blocks = [_Attn(1024, 8).cuda() for _ in range(layers)]
    x = torch.randn(4, 1024, 1024, device="cuda", requires_grad=True)  # 16 MiB a boundary
    with GraphedLayers(blocks, x, mode=mode) as stack:
        grads = sum(b.untyped_storage().nbytes() for b in stack.gradient_buffers)
        pool = stack.pool_bytes
        assert pool is not None
        return pool - grads, x.numel() * x.element_size()


@pytest.mark.parametrize("mode", ["resident", "remap"])
def test_offloaded_layer_boundaries_hold_no_pool_memory_of_their_own(mode):
    # Between two offloaded layers the output buffer (and the input gradient one) is read
    # only by the next graph, so the pool reuses it: pool memory beside the gradient
    # buffers must not grow with depth by a boundary's worth per layer.
    two, boundary = _pool_beside_gradients(2, mode)
    six, _ = _pool_beside_gradients(6, mode)
    assert six - two < 2 * boundary, (two, six, boundary)


@pytest.mark.parametrize("kind", ["ordinary", "region"])
def test_a_capture_invalidated_by_host_work_leaves_torch_working(clean, kind):
    """``.item()`` under capture invalidates it. torch's own capture context then leaves the
    default generator in capture mode (every later random op raises "Offset increment
    outside graph capture"), the capture stream current and the allocator routing into
    the graph's pool; graphslot's graphs give the error and leave none of that behind."""
    b = clean
    res = b.reserve(64 << 20) if kind == "region" else None
    try:
        x = torch.ones(1 << 12, device=b.device)
        before = torch.cuda.current_stream()
        g = b.new_graph(pool_region=(res.va, res.size)) if res is not None else b.new_graph()
        with pytest.raises(RuntimeError):  # torch words it by where the capture broke
            with g.capture():
                torch.nn.functional.dropout(x, 0.5)
                if (x * 2).sum().item() > 0:  # host work: cannot be captured
                    pass
        assert torch.cuda.current_stream() == before
        assert not torch.cuda.is_current_stream_capturing()
        torch.manual_seed(3)
        drawn = torch.rand(64, device=b.device)
        torch.manual_seed(3)
        assert torch.equal(drawn, torch.rand(64, device=b.device))
        later = torch.empty(1 << 20, device=b.device)
        pools = {tuple(s.get("segment_pool_id", (0, 0))) for s in torch.cuda.memory_snapshot()
                 if s["address"] <= later.data_ptr() < s["address"] + s["total_size"]}
        assert pools == {(0, 0)}, f"an eager tensor landed in a graph pool {pools}"
        del later
        if res is not None:
            g.release_pool()
        y = torch.zeros_like(x)
        g2 = b.new_graph()
        with g2.capture():
            y.copy_(torch.nn.functional.dropout(x, 0.5))
        g2.replay()
        b.synchronize()
        assert set(y.unique().tolist()) <= {0.0, 2.0}
    finally:
        if res is not None:
            b.free(res)
