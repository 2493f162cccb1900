"""Memory accounting and `graphslot bench`, on small shapes (the GPU figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json
import re
import sys
import warnings

import pytest
import torch

import graphslot
from graphslot import cli
from graphslot.cli.bench import CONFIGS, BenchShape, auto_offload_layers, run_bench
from graphslot.memory import measure, report

MiB = 1 << 20


def test_measure_sees_graphslot_pages_exactly(clean):
    b = clean
    size = graphslot.align_up(64 * MiB, b.granularity)
    with measure(b) as m:
        res, alloc = b.reserve_mapped(size)
        b.tensor_at(res.va, (size,), torch.uint8).fill_(1)
    assert m.delta.mapped_bytes == size and m.delta.allocated_bytes == size
    assert m.delta.reserved_va_bytes == size
    if b.name != "cpu":  # the host's free memory moves with everything else on the machine
        assert m.delta.driver_used_bytes >= 0.9 * size
    with measure(b) as m2:
        b.unmap_release(res, 0)
        b.free(res)
    assert m2.delta.mapped_bytes == -size and m2.delta.allocated_bytes == -size
    assert b.ledger.peak_mapped_bytes >= size


def test_allocator_stats_see_graph_private_pools(clean):
    b = clean
    x = torch.ones(1024, device=b.device)
    before = b.allocator_stats()["graph_pool_reserved_bytes"]
    g = b.new_graph()
    with g.capture():
        y = x.repeat(16 * 1024)  # 64 MiB of float32 from the graph's pool
    after = b.allocator_stats()["graph_pool_reserved_bytes"]
    assert before is not None and after is not None
    assert g.pool_bytes >= 64 * MiB  # this graph's own pool, exactly attributed
    assert after >= g.pool_bytes
    g.replay()
    b.synchronize()
    assert float(y.sum()) == y.numel()


def test_report_has_all_three_views(backend):
    r = report(backend).as_dict()
    for k in ("mapped_bytes", "allocated_bytes", "allocator_reserved_bytes",
              "graph_pool_reserved_bytes", "driver_free_bytes", "driver_total_bytes", "driver_used_bytes"):
        assert k in r
    assert 0 < r["driver_used_bytes"] <= r["driver_total_bytes"]


def test_auto_policy_offloads_what_compute_hides():
    # 1 GB per layer at 50 GB/s is 20 ms each way; 0.85 of 120 ms of compute hides
    # 5 copies, so 2 layers, spread out.
    got = auto_offload_layers(8, 10**9, fwd_ms=40.0, bwd_ms=80.0, gbps=50.0)
    assert got == [0, 2], got
    many = auto_offload_layers(8, 10**6, fwd_ms=80.0, bwd_ms=160.0, gbps=50.0)
    assert len(many) == len(set(many)) and 7 not in many and len(many) >= 5
    assert auto_offload_layers(8, 10**12, fwd_ms=1.0, bwd_ms=1.0, gbps=50.0) == []


def r_params(r: dict) -> list[torch.Tensor]:
    """The parameters of the bench's layers, rebuilt from its shape (same seed, same init)."""
    from graphslot.cli.toy import Block, GPTConfig

    sh = r["shape"]
    c = GPTConfig(hidden=sh["hidden"], heads=sh["heads"], ffn=sh["ffn"], seq=sh["seq"],
                  batch=sh["batch"], layers=sh["layers"], attention=sh["attention"])
    return [p for _ in range(sh["layers"]) for p in Block(c).parameters()]


def test_bench_runs_every_configuration_on_small_shapes(backend, tmp_path):
    b = backend
    trace, plot = tmp_path / "trace.json", tmp_path / "mem.png"
    pytest.importorskip("matplotlib")
    # one graph per layer: the engine's copies between layers are what is accounted below
    r = run_bench(b, BenchShape.preset("tiny"), steps=2, warmup=1, trace_path=str(trace),
                  plot_path=str(plot), progress=False, layers_per_graph=1)
    assert set(r["configs"]) == set(CONFIGS)
    assert r["layers_per_graph"] == 1
    assert all(c["graphs"] == 3 for n, c in r["configs"].items() if n.startswith("graph") and "reason" not in c)
    assert r["copy_ceiling_gbps"] > 0
    for name, c in r["configs"].items():
        if "reason" in c:
            assert (name == "save_on_cpu" and b.name == "cpu") or (
                name == "torch_graphed" and not b.has_graphed_callables), (name, c["reason"])
            continue
        for k in ("step_ms", "peak_device_bytes", "activation_bytes_at_boundary", "offloaded_bytes",
                  "d2h_gbps", "h2d_gbps", "exposed_copy_ms", "efficiency", "memory_breakdown"):
            assert k in c, (name, k)
        assert c["step_ms"] > 0
        mb = c["memory_breakdown"]
        assert set(mb) == {"weights_bytes", "grad_bytes", "graph_pool_bytes", "slot_bytes",
                           "host_pinned_bytes", "other_bytes"}
        assert mb["weights_bytes"] == sum(p.numel() * p.element_size() for p in r_params(r))
        assert mb["grad_bytes"] == mb["weights_bytes"]  # every parameter has its gradient
        if name.startswith("graph"):
            assert mb["graph_pool_bytes"] is not None and mb["graph_pool_bytes"] >= 0
        if name in ("graph_resident", "graph_remap"):
            assert mb["host_pinned_bytes"] >= 0.9 * r["saved_activation_bytes"] / (1 if name == "graph_remap" else 1)
        if name == "graph_resident":
            assert mb["slot_bytes"] > 0  # the two banks stay mapped
        if name == "graph_remap":
            assert mb["slot_bytes"] == 0  # nothing in flight after the step: its banks went
        if c["peak_device_bytes"] is not None:
            # The peak is the allocator's peak reserved plus graphslot's peak pages: at
            # least what both hold after the step; the driver's context is reported apart.
            held = sum(mb[k] for k in ("weights_bytes", "grad_bytes", "graph_pool_bytes",
                                       "slot_bytes", "other_bytes"))
            assert c["peak_device_bytes"] >= held, (name, c["peak_device_bytes"], mb)
            assert c["context_bytes"] >= 0
            parts = c["peak_parts"]
            assert c["peak_device_bytes"] == parts["allocator_reserved_bytes"] + parts["graphslot_pages_bytes"]
            # graphslot's pages at the peak: at least the banks that stay mapped
            assert parts["graphslot_pages_bytes"] >= mb["slot_bytes"], (name, parts, mb)
        else:
            assert c["peak_parts"] is None
    cf = r["configs"]
    saved = r["saved_activation_bytes"]
    assert cf["eager"]["activation_bytes_at_boundary"] == saved == cf["graph"]["activation_bytes_at_boundary"]
    # At the boundary remap holds its banks (a pass is in flight), no more than resident's.
    assert 0 < cf["graph_remap"]["activation_bytes_at_boundary"] <= \
        cf["graph_resident"]["activation_bytes_at_boundary"]
    # Every graph but the last goes to the host; the last one's backward follows its
    # forward, so its activations stay in their bank, never copied, and with two banks
    # (resident; remap with slots of one section) the graph before it is still in the other
    # bank at its backward, so it is not copied back.
    c = cf["graph_resident"]
    assert 0 < c["held_bytes"] < c["offloaded_bytes"], c
    assert c["offloaded_bytes"] + c["held_bytes"] >= 0.9 * saved, c
    assert c["kept_in_place_bytes"] > 0
    assert c["restored_bytes"] + c["kept_in_place_bytes"] == c["offloaded_bytes"], c
    rm = cf["graph_remap"]
    assert rm["held_bytes"] > 0 and rm["offloaded_bytes"] + rm["held_bytes"] >= 0.9 * saved, rm
    assert rm["restored_bytes"] + rm["kept_in_place_bytes"] == rm["offloaded_bytes"], rm
    # The ideal counts the bytes each way; the offload ideal is every saved activation's trip.
    assert c["ideal_ms"] <= c["offload_ideal_ms"] == rm["offload_ideal_ms"]
    assert cf["graph"]["offload_ideal_ms"] is None
    assert cf["graph_resident"]["d2h_gbps"] > 0 and cf["graph_resident"]["h2d_gbps"] > 0
    assert len(cf["graph_auto"]["offload_layers"]) < 3
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"] for e in events if e["ph"] == "X"}
    # The trace is graph_auto's: compute, and each copy stream that had bytes to move (its
    # banks may hold every layer it offloads at their backward: nothing then comes back).
    auto = cf["graph_auto"]
    assert 1 in tracks
    assert (2 in tracks) == (auto["offloaded_bytes"] > 0) and (3 in tracks) == (auto["restored_bytes"] > 0)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_configuration_reports_the_warnings_it_raised(backend, monkeypatch):
    """A warning lands under the configuration that raised it (here: only the eager
    forward warns), so a stray warning in a bench run can be told apart by configuration."""
    from graphslot.cli import bench

    real = bench._forward

    def warning_forward(layers, x):
        warnings.warn("eager forward ran", RuntimeWarning)
        return real(layers, x)

    monkeypatch.setattr(bench, "_forward", warning_forward)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("eager", "graph"))
    assert r["configs"]["eager"]["warnings"] == ["RuntimeWarning: eager forward ran"]
    assert r["configs"]["graph"]["warnings"] == []
    assert "eager warned: RuntimeWarning: eager forward ran" in bench._table(r)


def test_rounds_time_every_configuration_again_in_turn(backend, monkeypatch):
    """With rounds, each configuration is built and timed once per round, the
    configurations taking turns, and its step time is the median of its rounds."""
    from graphslot.cli import bench

    order: list[str] = []
    real = bench._timed_steps

    def timed(r, name, stack, fwd):
        order.append(name)
        return real(r, name, stack, fwd)

    monkeypatch.setattr(bench, "_timed_steps", timed)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("eager", "graph"), rounds=3)
    assert order == ["eager", "graph"] * 3
    assert r["rounds"] == 3
    for c in r["configs"].values():
        assert len(c["step_ms_rounds"]) == 3 and all(t > 0 for t in c["step_ms_rounds"])
        assert c["step_ms"] == sorted(c["step_ms_rounds"])[1]
    e, g = r["configs"]["eager"], r["configs"]["graph"]
    assert g["vs"]["eager"]["step"] == pytest.approx(g["step_ms"] / e["step_ms"])
    assert g["vs"]["eager"]["step_rounds"] == pytest.approx(
        [a / b for a, b in zip(g["step_ms_rounds"], e["step_ms_rounds"])])
    with pytest.raises(graphslot.UsageError, match="rounds"):
        run_bench(backend, BenchShape.preset("tiny"), rounds=0, progress=False)


def test_bench_command_prints_one_json_object(backend, capsys):
    rc = cli.main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "1", "--quiet", "--json",
                   "--configs", "eager,graph_resident"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["backend"] == backend.name and set(r["configs"]) == {"eager", "graph_resident"}
    assert {"backend", "device", "shape", "copy_ceiling_gbps", "configs"} <= set(r)
    # by default GraphedLayers joins the tiny preset's three small layers into one graph,
    # whose resident forward stays in its bank until its backward: nothing is copied
    assert r["layers_per_graph"] == "auto" and r["configs"]["graph_resident"]["graphs"] == 1
    c = r["configs"]["graph_resident"]
    assert c["offloaded_bytes"] == 0 and c["held_bytes"] > 0, c


def test_bench_layers_per_graph_reaches_each_isolated_process(backend):
    rc = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                   configs=("graph_remap",), isolate=True, layers_per_graph=2)
    assert rc["layers_per_graph"] == 2 and rc["configs"]["graph_remap"]["graphs"] == 2


@pytest.mark.parametrize("argv,needle", [
    (["--layers", "0"], "--layers"), (["--heads", "0"], "--heads"), (["--hidden", "7", "--heads", "4"], "multiple"),
    (["--batch", "-2"], "--batch"), (["--steps", "0"], "--steps"), (["--configs", "bogus"], "bogus"),
    (["--configs", ""], "--configs"), (["--warmup", "-1"], "--warmup"), (["--rounds", "0"], "--rounds"),
    (["--layers-per-graph", "0"], "--layers-per-graph"), (["--layers-per-graph", "two"], "--layers-per-graph")])
def test_bench_refuses_bad_arguments_with_exit_2(backend, capsys, argv, needle):
    rc = cli.main(["bench", "--preset", "tiny", "--quiet", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_bench_command_prints_a_table(backend, capsys):
    pytest.importorskip("tabulate")
    rc = cli.main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--quiet",
                   "--configs", "eager,graph"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"^config\s+step ms\s+step / eager\s+peak dev\s+act@bound\s+offload\s+D2H GB/s"
                     r"\s+H2D GB/s\s+exposed\s+eff\s+eff all$", out, re.M), out
    assert re.search(r"^eager\s+\d+\.\d\d\s+1\s", out, re.M), out  # the peer itself
    assert re.search(r"^graph\s+\d+\.\d\d\s+\d+\.\d\d\s", out, re.M), out


@pytest.mark.parametrize("module,flag", [("tabulate", "--quiet"), ("tqdm", "--json")])
def test_bench_without_its_output_libraries_is_a_clear_error(backend, capsys, monkeypatch, module, flag):
    """The table needs tabulate and the progress bar tqdm (the cli extra); without one the
    command says so before running anything, and names the option that does without it."""
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    rc = cli.main(["bench", "--preset", "tiny", "--steps", "1", flag])
    cap = capsys.readouterr()
    other = "--json" if module == "tabulate" else "--quiet"
    assert rc == 1 and cap.out == "", cap
    assert f"needs {module}" in cap.err and "graphslot[cli]" in cap.err and other in cap.err, cap.err


def test_isolated_configurations_each_run_in_a_process_of_their_own(backend, tmp_path):
    """With isolate, every configuration runs in a bench process of its own (none is
    charged for what an earlier one left behind); graph_auto's process times graph for it."""
    import os

    pytest.importorskip("matplotlib")
    plot = tmp_path / "mem.png"
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("eager", "graph_auto"), isolate=True, plot_path=str(plot))
    cf = r["configs"]
    assert r["isolated"] is True and set(cf) == {"eager", "graph_auto"}
    assert len({c["pid"] for c in cf.values()} | {os.getpid()}) == 3
    for name, c in cf.items():
        assert "reason" not in c and c["memory_curve"] and c["ideal_ms"] > 0, (name, c)
    assert "offload_layers" in cf["graph_auto"]
    assert r["copy_ceiling_gbps"] > 0 and r["saved_activation_bytes"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_isolated_rounds_gather_what_each_process_reported(backend, monkeypatch):
    """The gathering side of isolate, with made-up process reports: a configuration's step
    is the median of the rounds that count; a round that failed, or in which graph_auto
    picked other layers than in round one, is listed and not counted; a configuration that
    failed in round one is not run again; the ideal is derived across the processes."""
    from graphslot.cli import bench

    steps = {"eager": iter([30.0, 10.0, 20.0]), "graph": iter([5.0, 7.0, 6.0]),
             "graph_auto": iter([8.0, 9.0, 1.0]), "graph_remap": iter([99.0])}
    layers = iter([[0], [1], [0]])
    runs: list[str] = []

    def fake(b, argv):
        configs = argv[argv.index("--configs") + 1].split(",")
        name = configs[-1]
        runs.append(name)
        if name == "graph_remap":
            return {"reason": "its process failed: out of luck"}
        if name == "graph" and len(runs) > 4 and runs.count("graph") == 3:
            return {"reason": "its process failed: a later round"}
        rep = {"fwd_ms": 2.0 if name == "graph" else 3.0, "bwd_ms": 4.0 if name == "graph" else 5.0,
               "step_ms": next(steps[name]), "offloaded_bytes": 10**6 if name == "graph_auto" else 0}
        cfgs = {name: rep}
        if name == "graph_auto":
            rep["offload_layers"] = next(layers)
            cfgs["graph"] = {"fwd_ms": 1.0, "bwd_ms": 1.5, "step_ms": 3.0}
        return {"configs": cfgs, "copy": {"d2h_gbps": 1.0, "h2d_gbps": 2.0, "both_total_gbps": 2.5},
                "saved_activation_bytes": 123}

    monkeypatch.setattr(bench, "_run_child", fake)
    r = run_bench(backend, BenchShape.preset("tiny"), progress=False, isolate=True, rounds=3,
                  configs=("eager", "graph", "graph_auto", "graph_remap"))
    cf = r["configs"]
    assert runs.count("graph_remap") == 1 and "out of luck" in cf["graph_remap"]["reason"]
    assert cf["eager"]["step_ms_rounds"] == [30.0, 10.0, 20.0] and cf["eager"]["step_ms"] == 20.0
    assert cf["graph"]["step_ms_rounds"] == [5.0, 7.0] and cf["graph"]["step_ms"] == 6.0
    assert cf["graph"]["rounds_not_counted"] == ["round 3: its process failed: a later round"]
    assert cf["graph_auto"]["step_ms_rounds"] == [8.0, 1.0]
    assert cf["graph_auto"]["rounds_not_counted"][0].startswith("round 2: picked offload layers [1]")
    assert r["copy_ceiling_gbps"] == 1.0 and r["saved_activation_bytes"] == 123
    copy = 10**6 / 1e6  # bytes over 1 GB/s, in ms
    assert cf["graph_auto"]["ideal_ms"] == pytest.approx(max(2.0, copy) + max(4.0, copy))
    assert cf["eager"]["ideal_ms"] == pytest.approx(2.0 + 4.0)  # graph's phases, the fastest
    # Ratios to the peer (eager: torch_graphed and save_on_cpu did not run), round by round
    # over the rounds both counted, by their number, not their place in the list.
    assert "vs" not in cf["graph_remap"] and "eager" not in cf["eager"].get("vs", {})
    g, auto = cf["graph"]["vs"]["eager"], cf["graph_auto"]["vs"]["eager"]
    assert g["step"] == pytest.approx(6.0 / 20.0)
    assert g["step_rounds"] == pytest.approx([5.0 / 30.0, 7.0 / 10.0])
    assert auto["step_rounds"] == pytest.approx([8.0 / 30.0, 1.0 / 20.0])
    assert auto["step_median_round"] == pytest.approx((8.0 / 30.0 + 1.0 / 20.0) / 2)


def test_the_table_compares_with_the_first_peer_that_ran():
    """The table's third column: the step ratio to the first peer of PEERS that ran; with
    rounds, the median of the paired rounds' ratios, inside their range (the two medians
    may come from different rounds when one configuration lost a round)."""
    pytest.importorskip("tabulate")
    from graphslot.cli import bench

    def cfg(step: float, rounds: list[float] | None = None, counted: list[int] | None = None):
        c = {"step_ms": step, "peak_device_bytes": 1 << 20, "activation_bytes_at_boundary": 0,
             "offloaded_bytes": 0, "d2h_gbps": None, "h2d_gbps": None}
        if rounds:
            c["step_ms_rounds"], c["rounds_counted"] = rounds, counted
        return c

    r = {"backend": "x", "device": "y", "shape": {}, "configs": {
        "torch_graphed": {"reason": "not here"},
        "eager": cfg(11.0, [10.0, 12.0], [1, 3]),
        "graph": cfg(6.0, [5.0, 100.0, 6.0], [1, 2, 3])}}
    bench._peer_ratios(r["configs"], rounds=3)
    table = bench._table(r)
    assert re.search(r"^config\s+step ms\s+step / eager\s", table, re.M), table
    row = next(line for line in table.splitlines() if line.startswith("graph "))
    assert "0.50 (0.50-0.50)" in row, row  # rounds 1 and 3: 5/10 and 6/12
    assert r["configs"]["graph"]["vs"]["eager"]["step"] == pytest.approx(6.0 / 11.0)


def test_an_isolated_configuration_that_fails_says_why(backend, monkeypatch):
    """A configuration whose process fails carries the process's last error line as its
    reason."""
    from graphslot.cli import bench

    real = bench._child_argv

    def argv(shape, steps, warmup, configs, trace_path, layers_per_graph):
        a = real(shape, steps, warmup, configs, trace_path, layers_per_graph)
        a[a.index("--layers") + 1] = "0"  # the process refuses this shape
        return a

    monkeypatch.setattr(bench, "_child_argv", argv)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("graph",), isolate=True)
    assert "--layers must be at least 1" in r["configs"]["graph"]["reason"]
    assert r["copy_ceiling_gbps"] is None
