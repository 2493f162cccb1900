"""graphslot.adapters.megatron: wiring on every machine, training on a CUDA device.

Megatron-Core imports without a GPU, so version checks, configuration checks and the
installation and removal of every hook run wherever it is installed (tox env
``megatron``). Its layers run only on CUDA (they allocate CUDA buffers), so training with
local CUDA graphs plus graphslot offload runs on the cuda backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphslot
from graphslot.errors import IncompatibleError, StateError, UsageError

from gpu_deps import MEGATRON_HOWTO, TE_HOWTO, have  # noqa: E402

megatron_core = pytest.importorskip("megatron.core", reason=f"megatron-core is not installed. {MEGATRON_HOWTO}")

from graphslot.adapters import megatron as gsm  # noqa: E402

cg = pytest.importorskip("megatron.core.transformer.cuda_graphs")
HERE = Path(__file__).parent


# --------------------------------------------------------------------------- versions


def test_check_megatron_reports_the_installed_version():
    info = gsm.check_megatron()
    assert info.version == megatron_core.__version__
    assert info.cuda_graphs is cg
    assert info.transformer_layer.__name__ == "TransformerLayer"


def test_an_old_version_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(megatron_core, "__version__", "0.15.3")
    with pytest.raises(IncompatibleError, match=r"Megatron-Core 0\.15\.3 is too old: graphslot needs 0\.16\.0"):
        gsm.check_megatron()


def test_a_missing_hook_point_is_named(monkeypatch):
    monkeypatch.delattr(cg, "is_graph_warmup")
    with pytest.raises(IncompatibleError, match=r"lacks what graphslot hooks into: .*cuda_graphs\.is_graph_warmup"):
        gsm.check_megatron()


def test_megatron_not_importable_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(IncompatibleError, match="Megatron-Core is not importable"):
        gsm.check_megatron()


# --------------------------------------------------------------------------- configurations


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kw)


def test_local_whole_layer_graphs_are_served():
    gsm.check_config(_config(cuda_graph_impl="local"))


def test_every_problem_of_a_configuration_is_listed():
    c = _config()  # cuda_graph_impl "none"
    c.fine_grained_activation_offloading = True
    c.recompute_granularity = "full"
    with pytest.raises(IncompatibleError) as e:
        gsm.check_config(c)
    msg = str(e.value)
    assert "cuda_graph_impl is 'none'" in msg and "set cuda_graph_impl='local'" in msg
    assert "fine_grained_activation_offloading is True" in msg
    assert "recompute_granularity is 'full'" in msg


def test_partial_layer_graphs_are_refused():
    c = _config(cuda_graph_impl="local")
    if hasattr(c, "cuda_graph_modules"):
        c.cuda_graph_modules = ["attn"]
    else:
        c.cuda_graph_scope = ["attn"]
    with pytest.raises(IncompatibleError, match="capture part of a layer \\(attn\\)"):
        gsm.check_config(c)


@pytest.mark.parametrize("recipe", gsm.FP8_RECIPES_SERVED)
def test_fp8_compute_with_a_served_recipe_is_served(recipe):
    c = _config(cuda_graph_impl="local")
    c.fp8, c.fp8_recipe = "hybrid", recipe
    gsm.check_config(c)


@pytest.mark.parametrize("setting,value,says", [
    ("fp8_param", True, r"fp8_param is True: not verified .*quantized tensors"),
    ("fp4_param", True, r"fp4_param is True: not verified .*quantized tensors"),
    ("fp8_dot_product_attention", True, r"fp8_dot_product_attention is True: not verified .*Float8Tensor"),
    ("fp8_multi_head_attention", True, r"fp8_multi_head_attention is True: not verified .*Float8Tensor"),
    ("fp8_recipe", "mxfp8", r"fp8_recipe is 'mxfp8': not verified .*served fp8 recipes: 'delayed', 'tensorwise'"),
    ("fp8_recipe", "blockwise", r"fp8_recipe is 'blockwise': not verified"),
    ("fp4", "e2m1", r"fp4 is set: NVFP4 needs Blackwell"),
    ("delay_wgrad_compute", True, r"delay_wgrad_compute is True: .*backward_dw"),
])
def test_what_the_te_spec_cannot_serve_is_refused_by_name(setting, value, says):
    c = _config(cuda_graph_impl="local")
    c.fp8 = "hybrid" if setting.startswith("fp8") else None
    setattr(c, setting, value)
    with pytest.raises(IncompatibleError, match=says):
        gsm.check_config(c)


class _Quantized(torch.Tensor):
    """A stand-in for TransformerEngine's quantized tensor classes (torch.Tensor subclasses)."""


class _SavesSubclass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.detach().as_subclass(_Quantized))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_a_saved_tensor_subclass_stays_on_the_device_and_is_reported():
    """TE's cached fp8 weight (a Float8Tensor, a torch.Tensor subclass) is saved by reference:
    graphslot keeps it where it is, like parameters, and offloads plain tensors only."""
    from graphslot.adapters.megatron import _Layer

    m = torch.nn.Linear(4, 4)
    L = _Layer(m, "cpu")
    x = torch.ones(2, 4, requires_grad=True)
    L.begin()
    m(x).sum()
    L.end()
    assert L.layout.recorded and len(L.layout.specs) == 1 and L.kept == {}  # the input; the weight is state
    for _ in range(2):  # the same in every forward, so discovery agrees with itself
        L.begin()
        _SavesSubclass.apply(m(x))
        L.end()
        assert len(L.layout.specs) == 1 and L.kept == {f"{__name__}._Quantized": 1}
    q = x.detach().as_subclass(_Quantized)
    assert L.keeps(q) and L.keeps(m.weight) and not L.keeps(x)  # the capture's pack hook asks the same
    assert L.kept == {f"{__name__}._Quantized": 1}  # counted while recording only


# --------------------------------------------------------------------------- hooks


@pytest.fixture(scope="module")
def cpu_gpt():
    """A real Megatron-Core GPT built on the host (its layers cannot run there)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    parallel_state.initialize_model_parallel()
    c = _config(use_cpu_initialization=True)
    model = GPTModel(config=c, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16)
    yield model
    parallel_state.destroy_model_parallel()


def test_a_model_built_without_local_graphs_is_refused(cpu_gpt):
    with pytest.raises(IncompatibleError, match="cuda_graph_impl is 'none'"):
        gsm.enable(cpu_gpt)
    assert gsm.active() is None


def test_a_plain_module_is_refused():
    with pytest.raises(UsageError, match="no megatron.core TransformerLayer"):
        gsm.enable(torch.nn.Linear(2, 2))


@pytest.fixture
def local_gpt(cpu_gpt, monkeypatch):
    """The host-built model as Megatron builds it for local graphs: the config says so and
    each layer has a graph manager (which nothing calls before the first step)."""
    monkeypatch.setattr(cpu_gpt.config, "cuda_graph_impl", "local")
    for layer in cpu_gpt.decoder.layers:
        monkeypatch.setattr(layer, "cudagraph_manager", object(), raising=False)
    yield cpu_gpt
    gsm.disable()


@pytest.fixture
def host():
    """The cpu backend: the host-built model's parameters live on the host."""
    return graphslot.get_backend("cpu")


def test_enable_installs_its_hooks_and_disable_removes_every_one(local_gpt, host):
    rec = cg._CudagraphGlobalRecord
    original = rec.__dict__["create_cudagraphs"]
    layers = list(local_gpt.decoder.layers)
    before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers]
    off = gsm.enable(local_gpt, mode="remap", layers=[2], backend=host)
    assert gsm.active() is off
    assert rec.__dict__["create_cudagraphs"] is not original
    hooked = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers]
    assert hooked == [before[0], (before[1][0] + 1, before[1][1] + 1)]  # only layer 2
    assert off.report()["layers"] == [2] and off.report()["runners"] == []
    off.disable()
    assert rec.__dict__["create_cudagraphs"] is original
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers] == before
    assert gsm.active() is None
    off.disable()  # idempotent
    assert host.ledger.mapped_bytes == 0


def test_remap_pages_megatrons_graph_pool_and_disable_gives_it_back(local_gpt, host, monkeypatch):
    """remap (by default) makes Megatron's global graph pool a graphslot paged pool and
    wraps what allocates into it or replays from it; disable() restores every one and
    frees the region. resident leaves the pool alone unless asked."""
    manager, runner = cg.CudaGraphManager, cg._CudaGraphRunner
    names = ("create_fwd_graph", "create_bwd_graph", "replay_graph_capture")
    before = {n: runner.__dict__[n] for n in names}
    pool_before = manager.__dict__.get("global_mempool")
    alloc_before = getattr(cg, "alloc_tensor_from_graph_mempool", None)
    off = gsm.enable(local_gpt, mode="remap", backend=host)
    assert off.pool is not None and manager.global_mempool is off.pool.pool_handle
    assert all(runner.__dict__[n] is not before[n] for n in names)
    if alloc_before is not None:
        assert cg.alloc_tensor_from_graph_mempool is not alloc_before
    rep = off.report()["graph_pool"]
    assert rep["state"] == "mapped" and rep["mapped_bytes"] == 0 and rep["capacity_bytes"] > 0
    assert host.ledger.reserved_bytes >= rep["capacity_bytes"]
    off.disable()
    assert manager.__dict__.get("global_mempool") is pool_before
    assert {n: runner.__dict__[n] for n in names} == before
    assert getattr(cg, "alloc_tensor_from_graph_mempool", None) is alloc_before
    assert host.ledger.reserved_bytes == 0 and off.pool.state.value == "closed"
    off = gsm.enable(local_gpt, mode="resident", backend=host)
    assert off.pool is None and off.report()["graph_pool"] is None
    assert manager.__dict__.get("global_mempool") is pool_before
    off.disable()
    off = gsm.enable(local_gpt, mode="resident", backend=host, release_graph_pool=True)
    assert off.pool is not None
    off.disable()
    # a backend whose graphs cannot draw their pool from a region is refused, naming it
    monkeypatch.setattr(host, "capabilities",
                        dataclasses.replace(host.capabilities, region_graphs=False))
    with pytest.raises(IncompatibleError, match="release_graph_pool=False"):
        gsm.enable(local_gpt, mode="resident", backend=host, release_graph_pool=True)
    assert manager.__dict__.get("global_mempool") is pool_before


def test_the_graph_pool_is_paged_with_gtp_importable_but_unused(local_gpt, host, monkeypatch):
    """With TransformerEngine importable Megatron has GTP, which allocates into the graph
    pool on its own only when in use (and check_config refuses it then)."""
    monkeypatch.setattr(cg, "HAVE_GTP", True, raising=False)
    off = gsm.enable(local_gpt, mode="remap", backend=host)
    assert off.pool is not None
    off.disable()
    off = gsm.enable(local_gpt, mode="remap", backend=host, release_graph_pool=False)
    assert off.pool is None and cg.CudaGraphManager.__dict__.get("global_mempool") is None
    off.disable()
    monkeypatch.setattr(local_gpt.config, "gtp_weight_remat_size", 2, raising=False)
    with pytest.raises(IncompatibleError, match="gtp_weight_remat_size > 1"):
        gsm.enable(local_gpt, mode="remap", backend=host)
    assert gsm.active() is None and host.ledger.reserved_bytes == 0


def test_one_adapter_at_a_time_and_only_before_the_first_step(local_gpt, host, monkeypatch):
    off = gsm.enable(local_gpt, backend=host)
    with pytest.raises(StateError, match="already enabled"):
        gsm.enable(local_gpt, backend=host)
    off.disable()
    monkeypatch.setattr(cg._CudagraphGlobalRecord, "cudagraph_record", [("runner", "fwd")])
    with pytest.raises(StateError, match="before the first training step"):
        gsm.enable(local_gpt, backend=host)
    assert gsm.active() is None


def test_bad_arguments_are_named(local_gpt, host):
    with pytest.raises(UsageError, match=r"layers \[7\] are not on this rank; its graphed layers are \[1, 2\]"):
        gsm.enable(local_gpt, layers=[7], backend=host)
    with pytest.raises(UsageError, match="unknown offload mode 'fast'"):
        gsm.enable(local_gpt, mode="fast", backend=host)
    with pytest.raises(UsageError, match="mode 'off' offloads nothing"):
        gsm.enable(local_gpt, mode="off", backend=host)
    assert gsm.active() is None


def test_slots_are_placed_in_forward_order_and_banks_alternate_in_backward_order(local_gpt, host):
    """Megatron records backward graphs last layer first; the groups are still made in
    the order a forward pass meets them, and consecutive layers go to different banks."""
    from types import SimpleNamespace

    off = gsm.enable(local_gpt, mode="remap", backend=host)
    try:
        layers = {L.number: L for L in off.layers.values()}
        for L in layers.values():
            x = torch.ones(4096, requires_grad=True)
            with L.layout.recording(lambda t: False):
                (x * x).sum()  # saves x
        runner = {n: SimpleNamespace(base_module=layers[n].module, func=None, create_bwd_graph=None,
                                     replay_graph_capture=None) for n in layers}
        off._prepare([(runner[1], "fwd"), (runner[2], "fwd"), (runner[2], "bwd"), (runner[1], "bwd")])
        assert [g.name for g in off.engine.groups] == ["layer1.graph0", "layer2.graph0"]
        assert [(r.layer.number, r.bank) for r in off.runners] == [(2, 0), (1, 1)]  # backward order
        banks = off.engine.residency.banks  # slots of one section: two banks, as resident
        assert [[g.name for g in bank.members] for bank in banks] == [["layer2.graph0"], ["layer1.graph0"]]
    finally:
        off.disable()
    assert host.ledger.mapped_bytes == 0 and host.ledger.reserved_bytes == 0


def test_enable_refuses_fp8_parameters_by_name(local_gpt, host, monkeypatch):
    monkeypatch.setattr(local_gpt.config, "fp8", "hybrid")
    monkeypatch.setattr(local_gpt.config, "fp8_param", True, raising=False)
    with pytest.raises(IncompatibleError, match="fp8_param is True"):
        gsm.enable(local_gpt, backend=host)
    assert gsm.active() is None
    monkeypatch.setattr(local_gpt.config, "fp8_param", False)
    gsm.enable(local_gpt, backend=host).disable()  # fp8 compute with bf16 parameters is served


def test_a_backend_on_another_device_type_is_refused(local_gpt, backend):
    if backend.device.type == "cpu":
        pytest.skip("needs a device backend beside a host-built model")
    with pytest.raises(UsageError, match="set GRAPHSLOT_BACKEND=cpu"):
        gsm.enable(local_gpt, backend=backend)


# --------------------------------------------------------------------------- training (cuda)


def _run(mode: str, tmp_path: Path, *extra: str, name: str | None = None, env: dict | None = None) -> dict:
    out = tmp_path / f"{name or mode}.json"
    path = os.pathsep.join(x for x in (str(HERE.parent), os.environ.get("PYTHONPATH")) if x)
    run_env = {k: v for k, v in os.environ.items() if k not in _ATTN_VARS}
    run_env.update(GRAPHSLOT_BACKEND="cuda", PYTHONPATH=path, **(env or {}))
    cmd = [sys.executable, str(HERE / "megatron_worker.py"), "--mode", mode, "--out", str(out), *extra]
    p = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=560)
    if p.returncode != 0:
        raise AssertionError(f"{name or mode} run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return json.loads(out.read_text())


def _needs_cuda(backend) -> None:
    if not torch.cuda.is_available():
        pytest.skip("Megatron-Core layers run only on CUDA")
    if backend.name != "cuda":
        pytest.skip("runs on the cuda backend")


def _needs_te() -> None:
    if not have("transformer_engine"):
        pytest.skip(f"TransformerEngine is not installed here. {TE_HOWTO}")


GiB = float(1 << 30)


def _check_offload_runs(ref: dict, runs: dict, *, bitwise: bool) -> dict:
    """Each graphslot run against Megatron's local graphs alone: the same losses (bit for bit
    with ``bitwise``, and then the same final parameters too), every layer offloaded, and
    driver-level memory down by the offloaded activations less what resident banks hold.
    Returns the summary printed and saved."""
    summary: dict = {"graphs": {k: ref[k] for k in ("driver_used_bytes", "driver_used_peak_bytes",
                                                      "median_step_ms_after_capture")}}
    for mode, r in runs.items():
        assert len(r["losses"]) == len(ref["losses"]) == ref["steps"], mode
        # The same kernels read the same bytes, from a slot instead of the pool.
        if bitwise:
            diff = [k for k, (a, b) in enumerate(zip(r["losses"], ref["losses"])) if a != b]
            assert not diff, (f"{mode}: losses differ from local graphs alone at steps {diff}: "
                              f"{[(r['losses'][k], ref['losses'][k]) for k in diff[:5]]}")
            assert r["params_sha256"] == ref["params_sha256"], (
                f"{mode}: final parameters differ from local graphs alone (losses were equal)")
        else:
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=0), mode
        rep = r["graphslot"]
        assert rep["graphs_created"] and rep["layers"] == list(range(1, ref["shape"]["layers"] + 1))
        offloaded = sum(x["offloaded_bytes"] for x in rep["runners"])
        stats = rep["stats"]  # (resident: what its bank still held at its backward is not copied back)
        assert offloaded > 0 and (stats["restored_bytes"] + stats.get("kept_in_place_bytes", 0)
                                  == stats["offloaded_bytes"])
        banks = 2 * max(x["slot_bytes"] for x in rep["runners"]) if mode == "resident" else 0
        saved = ref["driver_used_bytes"] - r["driver_used_bytes"]
        # Driver-level memory falls by the offloaded activations, less what the banks hold.
        assert saved >= 0.5 * (offloaded - banks), (mode, saved, offloaded, banks)
        summary[mode] = {"driver_used_bytes": r["driver_used_bytes"],
                         "driver_used_peak_bytes": r["driver_used_peak_bytes"], "saved_bytes": saved,
                         "offloaded_bytes": offloaded, "bank_bytes": banks,
                         "bitwise_losses": r["losses"] == ref["losses"],
                         "bitwise_params": r.get("params_sha256") == ref.get("params_sha256"),
                         "median_step_ms_after_capture": r["median_step_ms_after_capture"],
                         "graph_pool": r.get("graph_pool")}
    summary["graphs"]["graph_pool"] = ref.get("graph_pool")
    return summary


def _save_results(prefix: str, results: dict) -> None:
    dest = os.environ.get("GRAPHSLOT_RESULTS_DIR")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        for name, r in results.items():
            (Path(dest) / f"{prefix}_{name}.json").write_text(json.dumps(r, indent=1))


def test_local_graphs_with_graphslot_offload_train_like_local_graphs_alone(backend, tmp_path):
    """The local spec (torch norms): resident and remap train like local graphs alone.

    With TransformerEngine importable, Megatron weak-references graph inputs after each
    forward capture unless its ``save_for_backward`` observer saw them saved, and
    ``torch.nn.LayerNorm`` saves its input in C++, unseen: the reference would then read a
    layer's input after the pool gave its bytes to a later capture. So the reference keeps
    its graph buffers there (``--keep-graph-buffers``); graphslot's runs do not need to,
    since their slots hold a copy of every saved tensor."""
    _needs_cuda(backend)
    steps = ["--steps", "20"]
    keep = ["--keep-graph-buffers"] if have("transformer_engine") else []
    eager = _run("eager", tmp_path, *steps)
    ref = _run("graphs", tmp_path, *steps, *keep)
    runs = {m: _run(m, tmp_path, *steps, "--checksums") for m in ("resident", "remap")}
    summary = _check_offload_runs(ref, runs, bitwise=False)
    summary["transformer_engine"] = ref.get("transformer_engine")  # Megatron weak-refs graph I/O with TE
    summary["eager"] = {k: eager[k] for k in ("driver_used_bytes", "driver_used_peak_bytes",
                                              "median_step_ms_after_capture")}
    print("megatron summary:", json.dumps(summary))
    _save_results("megatron", {"eager": eager, "graphs": ref, **runs})
    # Issue 15, item 3: remap gives the graph pool's free pages back between steps, so its
    # device memory after the steps is within 1 GiB of eager's and its peak below eager's.
    remap = runs["remap"]
    pool = remap["graphslot"]["graph_pool"]
    assert pool is not None and pool["releases"] >= 1 and pool["state"] == "released", pool
    assert remap["driver_used_bytes"] <= eager["driver_used_bytes"] + GiB, (
        remap["driver_used_bytes"] / GiB, eager["driver_used_bytes"] / GiB)
    assert remap["driver_used_peak_bytes"] < eager["driver_used_peak_bytes"], (
        remap["driver_used_peak_bytes"] / GiB, eager["driver_used_peak_bytes"] / GiB)
    assert runs["resident"]["graphslot"]["graph_pool"] is None  # resident keeps Megatron's pool
    # disable(): Megatron's runners still hold buffers in the pool; only their chunks stay
    after = remap["graph_pool_after_disable"]
    assert after["state"] == "closed" or after["mapped_bytes"] == after["live_bytes"] < pool["used_bytes"], after


#: What the TE-spec runs set: Megatron's TE layer spec, bf16, deterministic attention.
TE_SPEC = ("--spec", "te", "--bf16", "--deterministic")
#: Deterministic kernels only. The attention backend is Megatron's to pick (its default,
#: auto, asserts that NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN are unset), and
#: every run of one test picks the same.
TE_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
_ATTN_VARS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def test_te_spec_bf16_local_graphs_with_graphslot_offload_train_bitwise_like_local_graphs_alone(
        backend, tmp_path):
    """Megatron's TransformerEngine layer spec in bf16, no fp8: local graphs plus graphslot
    offload (resident, remap) train 20 steps bit for bit like local graphs alone; the eager
    run gives the memory the graphs are measured against (issue 15, item 3)."""
    _needs_cuda(backend)
    _needs_te()
    steps = ["--steps", "20", *TE_SPEC]
    ref = _run("graphs", tmp_path, *steps, env=TE_ENV)
    assert ref["transformer_engine"], "the TE spec run did not import TransformerEngine"
    runs = {m: _run(m, tmp_path, *steps, "--checksums", env=TE_ENV) for m in ("resident", "remap")}
    eager = _run("eager", tmp_path, *steps, env=TE_ENV)
    summary = _check_offload_runs(ref, runs, bitwise=True)
    e_used, e_peak = eager["driver_used_bytes"], eager["driver_used_peak_bytes"]
    summary["eager"] = {"driver_used_bytes": e_used, "driver_used_peak_bytes": e_peak,
                        "median_step_ms_after_capture": eager["median_step_ms_after_capture"]}
    for mode in ("graphs", "resident", "remap"):
        s = summary[mode]
        s["used_minus_eager_gib"] = round((s["driver_used_bytes"] - e_used) / GiB, 3)
        s["peak_minus_eager_gib"] = round((s["driver_used_peak_bytes"] - e_peak) / GiB, 3)
    # Issue 15 item 3's target, reported (not asserted): remap within 1 GiB of eager after the
    # steps, and a peak below eager's.
    summary["item3_remap_within_1GiB_of_eager"] = summary["remap"]["driver_used_bytes"] - e_used <= GiB
    summary["item3_remap_peak_below_eager"] = summary["remap"]["driver_used_peak_bytes"] < e_peak
    summary.update(transformer_engine=ref["transformer_engine"], megatron_core=ref["megatron_core"],
                   attention=ref.get("te_attention_backend"))
    print("megatron te summary:", json.dumps(summary))
    _save_results("megatron_te", {"graphs": ref, **runs, "eager": eager})


@pytest.mark.parametrize("recipe", gsm.FP8_RECIPES_SERVED)
def test_te_spec_fp8_local_graphs_with_graphslot_offload_train_bitwise_like_local_graphs_alone(
        backend, tmp_path, recipe):
    """fp8 compute (bf16 parameters) with each served recipe: the scaling state stays in TE's
    modules, the quantized activations go through the slots; bit for bit like local graphs."""
    _needs_cuda(backend)
    _needs_te()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs an Ada or Hopper GPU (sm_89+)")
    steps = ["--steps", "10", *TE_SPEC, "--fp8", recipe]
    ref = _run("graphs", tmp_path, *steps, env=TE_ENV)
    runs = {m: _run(m, tmp_path, *steps, "--checksums", env=TE_ENV) for m in ("resident", "remap")}
    summary = _check_offload_runs(ref, runs, bitwise=True)
    summary.update(fp8_recipe=recipe, transformer_engine=ref["transformer_engine"])
    print(f"megatron te fp8 {recipe} summary:", json.dumps(summary))
    _save_results(f"megatron_te_fp8_{recipe}", {"graphs": ref, **runs})
