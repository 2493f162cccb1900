"""Memory accounting and `graphslot bench`, on small shapes (the GPU figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings

import pytest
import torch

import graphslot
from graphslot import cli
from graphslot.cli import bench, bench_configs, bench_measure, bench_report
from graphslot.cli.bench import CONFIGS, BenchShape, run_bench
from graphslot.memory import measure, report

MiB, GiB = 1 << 20, 1 << 30


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
    assert r["layers_per_graph"] == 1 and r["timing"] == "per optimizer step"
    assert all(c["graphs"] == 3 for n, c in r["configs"].items() if n.startswith("graph") and "reason" not in c)
    assert r["copy_ceiling_gbps"] > 0
    for name, c in r["configs"].items():
        if "reason" in c:
            assert (name == "save_on_cpu" and b.name == "cpu") or (
                name.startswith("torch_graphed") and not b.has_graphed_callables), (name, c["reason"])
            continue
        for k in ("step_ms", "fwd_ms", "bwd_ms", "opt_ms", "peak_device_bytes", "activation_bytes_at_boundary",
                  "offloaded_bytes", "d2h_gbps", "h2d_gbps", "exposed_copy_ms", "efficiency", "memory_breakdown"):
            assert k in c, (name, k)
        assert c["step_ms"] > 0 and c["opt_ms"] > 0
        assert [p[0] for p in c["memory_curve"]][-2:] == ["end", "opt"]  # the optimizer step counts
        mb = c["memory_breakdown"]
        assert set(mb) == {"weights_bytes", "grad_bytes", "graph_pool_bytes", "slot_bytes",
                           "host_pinned_bytes", "other_bytes"}
        assert mb["weights_bytes"] == sum(p.numel() * p.element_size() for p in r_params(r))
        assert mb["grad_bytes"] == mb["weights_bytes"]  # every parameter has its gradient
        if name.startswith("graph"):
            assert mb["graph_pool_bytes"] is not None and mb["graph_pool_bytes"] >= 0
        if name in ("graph_resident", "graph_remap"):
            assert mb["host_pinned_bytes"] >= 0.9 * r["saved_activation_bytes"]
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
    # checkpointing, eager or in graphs, holds each layer's input only
    x_bytes = 2 * 32 * 64 * 4
    assert cf["checkpoint"]["activation_bytes_at_boundary"] == 3 * x_bytes
    assert cf["graph_recompute"]["activation_bytes_at_boundary"] == 3 * x_bytes
    assert cf["graph_recompute"]["offloaded_bytes"] == 0
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
    # the peers are compared with: each configuration's ratio to eager and checkpoint
    assert cf["graph"]["vs"]["checkpoint"]["step"] == pytest.approx(
        cf["graph"]["step_ms"] / cf["checkpoint"]["step_ms"])
    auto = cf["graph_auto"]
    assert len(auto["plan"]["choices"]) == 3 and auto["plan"]["budget_bytes"] is None
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"] for e in events if e["ph"] == "X"}
    # The trace is graph_auto's: compute, and each copy stream that had bytes to move (its
    # banks may hold every layer it offloads at their backward: nothing then comes back).
    assert r["trace"]["config"] == "graph_auto" and 1 in tracks
    assert (2 in tracks) == (auto["offloaded_bytes"] > 0) and (3 in tracks) == (auto["restored_bytes"] > 0)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_configuration_reports_the_warnings_it_raised(backend, monkeypatch):
    """A warning lands under the configuration that raised it (here: only the eager
    forward warns), so a stray warning in a bench run can be told apart by configuration."""
    real = bench_configs.forward

    def warning_forward(layers, x):
        warnings.warn("eager forward ran", RuntimeWarning)
        return real(layers, x)

    monkeypatch.setattr(bench_configs, "forward", warning_forward)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("eager", "graph"))
    assert r["configs"]["eager"]["warnings"] == ["RuntimeWarning: eager forward ran"]
    assert r["configs"]["graph"]["warnings"] == []
    assert "eager warned: RuntimeWarning: eager forward ran" in bench_report.render_table(r)


def test_rounds_time_every_configuration_again_in_turn(backend, monkeypatch):
    """With rounds, each configuration is built and timed once per round, the
    configurations taking turns, and its step time is the median of its rounds."""
    order: list[str] = []
    real = bench_measure.timed_steps

    def timed(r, name, built):
        order.append(name)
        return real(r, name, built)

    monkeypatch.setattr(bench_measure, "timed_steps", timed)  # round one's, in measure()
    monkeypatch.setattr(bench, "timed_steps", timed)  # the later rounds'

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
    command says so before running anything, and names the option that does without it.
    (The bar shows on a terminal alone: here stderr is made one.)"""
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    rc = cli.main(["bench", "--preset", "tiny", "--steps", "1", flag])
    cap = capsys.readouterr()
    other = "--json" if module == "tabulate" else "--quiet"
    assert rc == 1 and cap.out == "", cap
    assert f"needs {module}" in cap.err and "pip install tabulate tqdm" in cap.err and other in cap.err, cap.err


def test_progress_off_a_terminal_is_a_line_per_configuration_without_tqdm(backend, capsys, monkeypatch):
    """Where stderr is no terminal (a log file), progress is plain lines, one as each
    configuration starts, so a log a timeout cut off says how far the run got; it needs no
    tqdm; --quiet prints none."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import now raises ImportError
    argv = ["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--json",
            "--configs", "eager,graph"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [ln for ln in lines if "] eager: " in ln] and [ln for ln in lines if "] graph: " in ln], lines
    assert re.fullmatch(r"\[\d+/\d+, \d+ s\] done", lines[-1]), lines
    assert cli.main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_progress_lines_tell_budgets_and_rounds_apart_and_need_a_stderr(monkeypatch, capsys):
    """A budget's name holds a colon of its own ("budget:7GiB"), and each round of a
    configuration starts with a label that counts nothing: each gets its line. Without a
    stderr (a daemon, ``2>&-``), nothing is printed, least of all into stdout's report."""
    from graphslot.cli.output import Progress

    bar = Progress(12, True)
    for size in ("6GiB", "7GiB"):
        for rnd in (1, 2):
            bar.update(f"budget:{size}: round {rnd}/2, own process", advance=False)
            bar.update(f"budget:{size}: step 1/1")
    bar.close()
    err = capsys.readouterr().err
    for size in ("6GiB", "7GiB"):
        for rnd in (1, 2):
            assert f"budget:{size}: round {rnd}/2, own process" in err, err
    monkeypatch.setattr(sys, "stderr", None)
    bar = Progress(2, True)
    bar.update("eager: step 1/1")
    bar.close()
    assert capsys.readouterr().out == ""


def test_isolated_configurations_each_run_in_a_process_of_their_own(backend, tmp_path):
    """With isolate, every configuration runs in a bench process of its own (none is
    charged for what an earlier one left behind); the options reach every process."""
    import os

    pytest.importorskip("matplotlib")
    plot = tmp_path / "mem.png"
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("eager", "graph_auto"), isolate=True, plot_path=str(plot),
                  accumulate=2, zero_grad="keep")
    cf = r["configs"]
    assert r["isolated"] is True and set(cf) == {"eager", "graph_auto"}
    assert r["accumulate"] == 2 and r["set_to_none"] is False
    assert len({c["pid"] for c in cf.values()} | {os.getpid()}) == 3
    for name, c in cf.items():
        assert "reason" not in c and c["memory_curve"] and c["ideal_ms"] > 0, (name, c)
    assert len(cf["graph_auto"]["plan"]["choices"]) == 3
    assert r["copy_ceiling_gbps"] > 0 and r["saved_activation_bytes"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_plan(choices: list[str], **kw) -> dict:
    return {"choices": choices, "mode": "resident", "budget_bytes": None, "predicted_peak_bytes": 5 * GiB,
            "predicted_step_ms": 6.5, "lower_bound_ms": 6.0, "offloaded_bytes": 10**6,
            "recompute_ms": 0.0, "reason": "made up", **kw}


def test_isolated_rounds_gather_what_each_process_reported(backend, monkeypatch):
    """The gathering side of isolate, with made-up process reports: a configuration's step
    is the median of the rounds that count; a round that failed, or in which graph_auto
    planned otherwise than in round one, is listed and not counted; a configuration that
    failed in round one is not run again; the ideal and the run's lower bound are derived
    across the processes."""
    steps = {"eager": iter([30.0, 10.0, 20.0]), "graph": iter([5.0, 7.0, 6.0]),
             "graph_auto": iter([8.0, 9.0, 1.0]), "graph_remap": iter([99.0])}
    # (round 2 plans round one's choices but recomputes by parts: another plan)
    plans = iter([(["recompute", "keep"], ()), (["recompute", "keep"], ("parts", None)),
                  (["recompute", "keep"], ())])
    runs: list[str] = []

    def fake(b, argv):
        assert argv[argv.index("--accumulate") + 1] == "1" and argv[argv.index("--zero-grad") + 1] == "none"
        name = argv[argv.index("--configs") + 1]
        runs.append(name)
        if name == "graph_remap":
            return {"reason": "its process failed: out of luck"}
        if name == "graph" and len(runs) > 4 and runs.count("graph") == 3:
            return {"reason": "its process failed: a later round"}
        rep = {"fwd_ms": 2.0 if name == "graph" else 3.0, "bwd_ms": 4.0 if name == "graph" else 5.0,
               "step_ms": next(steps[name]), "offloaded_bytes": 10**6 if name == "graph_auto" else 0}
        if name == "graph_auto":
            choices, ops = next(plans)
            rep["plan"] = _fake_plan(choices, recompute_ops=list(ops))
        return {"configs": {name: rep}, "saved_activation_bytes": 123,
                "copy": {"d2h_gbps": 1.0, "h2d_gbps": 2.0, "both_total_gbps": 2.5}}

    monkeypatch.setattr(bench, "_run_child", fake)
    r = run_bench(backend, BenchShape.preset("tiny"), progress=False, isolate=True, rounds=3,
                  configs=("eager", "graph", "graph_auto", "graph_remap"))
    cf = r["configs"]
    assert runs.count("graph_remap") == 1 and "out of luck" in cf["graph_remap"]["reason"]
    assert cf["eager"]["step_ms_rounds"] == [30.0, 10.0, 20.0] and cf["eager"]["step_ms"] == 20.0
    assert cf["graph"]["step_ms_rounds"] == [5.0, 7.0] and cf["graph"]["step_ms"] == 6.0
    assert cf["graph"]["rounds_not_counted"] == ["round 3: its process failed: a later round"]
    auto = cf["graph_auto"]
    assert auto["step_ms_rounds"] == [8.0, 1.0] and auto["step_ms"] == 4.5
    assert auto["rounds_not_counted"] == ["round 2: planned PK (resident), not round one's RK (resident)"]
    assert r["copy_ceiling_gbps"] == 1.0 and r["saved_activation_bytes"] == 123
    copy = 10**6 / 1e6  # bytes over 1 GB/s, in ms
    assert auto["ideal_ms"] == pytest.approx(max(2.0, copy) + max(4.0, copy))
    assert cf["eager"]["ideal_ms"] == pytest.approx(2.0 + 4.0)  # graph's phases, the fastest
    # the run's lower bound: graph's forward and backward, 1 MB out at 1 GB/s, back at 2 GB/s
    assert auto["run_lower_bound_ms"] == pytest.approx(max(2.0, 1.0) + max(4.0, 0.5))
    assert auto["step_over_run_lower_bound"] == pytest.approx(4.5 / 6.0)
    assert auto["step_over_plan_lower_bound"] == pytest.approx(4.5 / 6.0)
    assert auto["rest_of_step_ms"] == 0.0  # graph's step (6.0) is its forward and backward
    assert auto["fits_budget"] is None  # "auto" has no budget
    # Ratios to the peer (eager: torch_graphed and save_on_cpu did not run), round by round
    # over the rounds both counted, by their number, not their place in the list.
    assert "vs" not in cf["graph_remap"] and "eager" not in cf["eager"].get("vs", {})
    g, a = cf["graph"]["vs"]["eager"], auto["vs"]["eager"]
    assert g["step"] == pytest.approx(6.0 / 20.0)
    assert g["step_rounds"] == pytest.approx([5.0 / 30.0, 7.0 / 10.0])
    assert a["step_rounds"] == pytest.approx([8.0 / 30.0, 1.0 / 20.0])
    assert a["step_median_round"] == pytest.approx((8.0 / 30.0 + 1.0 / 20.0) / 2)


def test_an_isolated_configuration_s_progress_line_carries_its_figures(backend, monkeypatch, capsys):
    """Each process's "done" line says its step and peak (or why it did not run): a log
    that a time limit cuts off before the report still has the figures run so far."""
    def fake(b, argv):
        name = argv[argv.index("--configs") + 1]
        if name == "graph":
            return {"reason": "its process failed: out of luck"}
        return {"configs": {name: {"fwd_ms": 1.0, "bwd_ms": 2.0, "step_ms": 23.25,
                                   "peak_device_bytes": 3 << 30, "offloaded_bytes": 0}},
                "saved_activation_bytes": 1, "copy": {"d2h_gbps": 1.0, "h2d_gbps": 1.0}}

    monkeypatch.setattr(bench, "_run_child", fake)
    run_bench(backend, BenchShape.preset("tiny"), progress=True, isolate=True,
              configs=("eager", "graph"))
    err = capsys.readouterr().err
    assert "eager: round 1/1 done (step 23.2 ms, peak 3.00 GiB)" in err, err
    assert "graph: round 1/1 done (not run: its process failed: out of luck)" in err, err


def test_an_isolated_sweep_takes_its_budgets_from_the_checkpoint_and_graph_processes(backend, monkeypatch):
    """--budgets sweep --isolate: the checkpoint and graph processes run first, whatever
    the order asked; the budgets run after, one process each, from checkpoint's peak
    evenly up to graph's; each budget's figures are set against the peers whose peak fits."""
    runs: list[str] = []
    peaks = {"checkpoint": 8 * GiB, "graph": 18 * GiB, "eager": 17 * GiB}

    def fake(b, argv):
        name = argv[argv.index("--configs") + 1]
        runs.append(name)
        budget = bench_configs.budget_bytes(name)
        rep = {"fwd_ms": 2.0, "bwd_ms": 4.0, "step_ms": {"checkpoint": 12.0}.get(name, 10.0),
               "offloaded_bytes": 0, "peak_device_bytes": peaks.get(name, (budget or 0) - MiB)}
        if budget:
            rep["plan"] = _fake_plan(["keep"], budget_bytes=budget)
        return {"configs": {name: rep}, "saved_activation_bytes": 1,
                "copy": {"d2h_gbps": 1.0, "h2d_gbps": 1.0, "both_total_gbps": 2.0}}

    monkeypatch.setattr(bench, "_run_child", fake)
    r = run_bench(backend, BenchShape.preset("tiny"), progress=False, isolate=True,
                  configs=("eager",), budgets="sweep")
    want = [f"budget:{g}.00GiB" for g in (8, 10, 12, 14, 16, 18)]
    assert runs == ["checkpoint", "graph", "eager", *want]
    assert r["sweep"] == {"budgets": want}
    cf = r["configs"]
    for name in want:
        assert cf[name]["budget_bytes"] == int(name[7:-6]) * GiB and cf[name]["fits_budget"] is True
    # at 8 GiB only checkpoint fits; from 17 GiB eager (10 ms) is the fastest that fits
    assert cf["budget:8.00GiB"]["fastest_peer_within_budget"] == {
        "config": "checkpoint", "step_ms": 12.0, "step_ratio": pytest.approx(10.0 / 12.0)}
    assert cf["budget:18.00GiB"]["fastest_peer_within_budget"]["config"] == "eager"


def test_the_table_compares_with_the_first_peer_that_ran():
    """The table's third column: the step ratio to the first peer of PEERS that ran; with
    rounds, the median of the paired rounds' ratios, inside their range (the two medians
    may come from different rounds when one configuration lost a round)."""
    pytest.importorskip("tabulate")
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
    bench_report.peer_ratios(r["configs"], rounds=3)
    table = bench_report.render_table(r)
    assert re.search(r"^config\s+step ms\s+step / eager\s", table, re.M), table
    row = next(line for line in table.splitlines() if line.startswith("graph "))
    assert "0.50 (0.50-0.50)" in row, row  # rounds 1 and 3: 5/10 and 6/12
    assert r["configs"]["graph"]["vs"]["eager"]["step"] == pytest.approx(6.0 / 11.0)


def test_an_isolated_configuration_that_fails_says_why(backend, monkeypatch):
    """A configuration whose process fails carries the process's last error line as its
    reason."""
    real = bench._child_argv

    def argv(shape, configs, o, trace_path):
        a = real(shape, configs, o, trace_path)
        a[a.index("--layers") + 1] = "0"  # the process refuses this shape
        return a

    monkeypatch.setattr(bench, "_child_argv", argv)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("graph",), isolate=True)
    assert "--layers must be at least 1" in r["configs"]["graph"]["reason"]
    assert r["copy_ceiling_gbps"] is None


def test_every_step_is_a_training_step(backend, monkeypatch):
    """Each optimizer step runs --accumulate microbatches' forward and backward, then
    SGD's step over the layers' parameters and zero_grad with --zero-grad's set_to_none;
    the report's times are per optimizer step."""
    forwards: list[int] = []
    steps: list[int] = []
    zeroed: list[bool] = []
    real_forward = bench_configs.forward
    monkeypatch.setattr(bench_configs, "forward", lambda mods, x: forwards.append(1) or real_forward(mods, x))
    real_step, real_zero = torch.optim.SGD.step, torch.optim.SGD.zero_grad

    def step(self, *a, **k):
        assert all(p.grad is not None for g in self.param_groups for p in g["params"])
        steps.append(len(forwards))
        return real_step(self, *a, **k)

    def zero_grad(self, set_to_none=True):
        zeroed.append(set_to_none)
        return real_zero(self, set_to_none)

    monkeypatch.setattr(torch.optim.SGD, "step", step)
    monkeypatch.setattr(torch.optim.SGD, "zero_grad", zero_grad)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=2, warmup=1, progress=False,
                  configs=("eager",), accumulate=3, zero_grad="keep")
    # warm-up, timed steps, the timeline step and the memory step: 5 optimizer steps of 3
    assert steps == [3, 6, 9, 12, 15] and zeroed == [False] * 5
    assert r["accumulate"] == 3 and r["set_to_none"] is False
    c = r["configs"]["eager"]
    assert c["fwd_ms"] > 0 and c["bwd_ms"] > 0 and c["opt_ms"] > 0


def test_a_variant_runs_beside_its_configuration_in_one_run(backend, monkeypatch):
    """graph_resident@keep@acc3 steps three microbatches and zeroes .grad in place while
    graph_resident, in the same run, steps one and sets it to None; the variant's report
    compares it with its configuration (step per microbatch, peak)."""
    zeroed: list[bool] = []
    real_zero = torch.optim.SGD.zero_grad
    monkeypatch.setattr(torch.optim.SGD, "zero_grad",
                        lambda self, set_to_none=True: zeroed.append(set_to_none) or real_zero(self, set_to_none))
    r = run_bench(backend, BenchShape.preset("tiny"), steps=2, warmup=1, progress=False,
                  configs=("graph_resident", "graph_resident@keep@acc3"))
    base, var = r["configs"]["graph_resident"], r["configs"]["graph_resident@keep@acc3"]
    assert zeroed == [True] * 5 + [False] * 5  # (warm-up, two timed, timeline, memory)
    assert (base["accumulate"], base["set_to_none"]) == (1, True)
    assert (var["accumulate"], var["set_to_none"]) == (3, False)
    assert r["accumulate"] == 1 and r["set_to_none"] is True  # the run's own, as it was
    v = var["vs_base"]
    assert v["config"] == "graph_resident" and "vs_base" not in base
    assert v["step_per_microbatch"] == pytest.approx(var["step_ms"] / 3 / base["step_ms"])
    if base["peak_device_bytes"]:  # (the cpu backend's allocator has no figures)
        assert v["peak"] == pytest.approx(var["peak_device_bytes"] / base["peak_device_bytes"])
    else:
        assert "peak" not in v
    assert "variants beside their configuration" in bench_report.render_table(r)


def test_an_isolated_variant_reaches_its_process(backend):
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("eager@acc2",), isolate=True)
    assert r["configs"]["eager@acc2"]["accumulate"] == 2


def test_the_pages_variant_builds_on_shared_pages(backend, monkeypatch):
    """graph@pages builds its stack with share_pool_pages=True, graph beside it without,
    in one run; the variant's report compares it with graph."""
    if not backend.capabilities.region_graphs:
        pytest.skip(f"the {backend.name} backend's graphs draw no pool from a region")
    from graphslot.adapters.torch import GraphedLayers

    built: list[bool] = []
    real_init = GraphedLayers.__init__

    def init(self, *a, share_pool_pages=False, **kw):
        built.append(share_pool_pages)
        real_init(self, *a, share_pool_pages=share_pool_pages, **kw)

    monkeypatch.setattr(GraphedLayers, "__init__", init)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("graph", "graph@pages"))
    assert built == [False, True]
    var = r["configs"]["graph@pages"]
    assert var["step_ms"] > 0 and var["vs_base"]["config"] == "graph"


@pytest.mark.parametrize("name", ["eager@keeps", "graph@acc0", "graph@", "bogus@keep", "graph@acc2@acc3",
                                  "graph@keep@none", "eager@pages", "graph@pages@pages"])
def test_a_bad_variant_is_refused_naming_it(capsys, nothing_runs, name):
    rc = cli.main(["bench", "--preset", "tiny", "--quiet", "--configs", name])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and name.split("@")[0] in err and "Traceback" not in err, err


def test_the_checkpoint_peers_run_and_report(backend):
    """checkpoint runs eagerly on every backend; torch's graphed callables over
    checkpointed layers where the backend has them, else it is skipped saying why."""
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("eager", "checkpoint", "torch_graphed_checkpoint"))
    cf = r["configs"]
    ck = cf["checkpoint"]
    assert ck["step_ms"] > 0 and ck["offloaded_bytes"] == 0
    # it holds each layer's input only, far less than what eager saves
    assert ck["activation_bytes_at_boundary"] < cf["eager"]["activation_bytes_at_boundary"] / 3
    assert ck["vs"]["eager"]["step"] == pytest.approx(ck["step_ms"] / cf["eager"]["step_ms"])
    assert cf["eager"]["vs"]["checkpoint"]["step"] == pytest.approx(cf["eager"]["step_ms"] / ck["step_ms"])
    tgc = cf["torch_graphed_checkpoint"]
    if backend.has_graphed_callables:
        assert tgc["step_ms"] > 0 and tgc["activation_bytes_at_boundary"] == ck["activation_bytes_at_boundary"]
    else:
        assert "make_graphed_callables needs CUDA" in tgc["reason"]


def test_a_budget_configuration_runs_and_reports_its_plan(backend):
    """--budgets runs one planned configuration per size, beside graph (whose phases make
    the run's lower bound); one the planner cannot reach is skipped with its reason."""
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("checkpoint",), budgets=["1GiB", "1000"])
    cf = r["configs"]
    assert list(cf) == ["checkpoint", "graph", "budget:1GiB", "budget:1000"]
    refused = cf["budget:1000"]["reason"]
    assert re.search(r"below (the smallest peak|what the plans built)", refused)
    # (where plans were built before the refusal, it says which, and what each held)
    assert ("built on the way: " in refused) == ("what the plans built" in refused), refused
    c = cf["budget:1GiB"]
    plan = c["plan"]
    # what the planner built on the way, the plan itself last (built last: the one kept)
    assert plan["builds"] and plan["builds"][-1][1] == plan["mode"] and plan["builds"][-1][2] > 0
    assert len(plan["choices"]) == 3 and set(plan["choices"]) <= {"keep", "offload", "recompute"}
    assert plan["budget_bytes"] == c["budget_bytes"] == GiB
    for k in ("predicted_peak_bytes", "predicted_step_ms", "lower_bound_ms", "offloaded_bytes",
              "recompute_ms", "mode", "reason"):
        assert k in plan, k
    assert plan["predicted_peak_bytes"] <= GiB
    assert c["fits_budget"] is (None if c["peak_device_bytes"] is None else c["peak_device_bytes"] <= GiB)
    g, passes = cf["graph"], r["graph_passes_ms"]  # (graph's passes, no longer than its step)
    scale = min(1.0, g["step_ms"] / (g["fwd_ms"] + g["bwd_ms"]))
    assert passes == pytest.approx({"fwd_ms": g["fwd_ms"] * scale, "bwd_ms": g["bwd_ms"] * scale})
    want = bench_report.lower_bound_ms(passes["fwd_ms"], passes["bwd_ms"], plan["recompute_ms"],
                                       c["offloaded_bytes"], r["copy"]["d2h_gbps"], r["copy"]["h2d_gbps"])
    assert c["run_lower_bound_ms"] == pytest.approx(want)
    assert c["step_over_run_lower_bound"] == pytest.approx(c["step_ms"] / want)
    assert c["step_over_plan_lower_bound"] == pytest.approx(c["step_ms"] / plan["lower_bound_ms"])
    rest = max(0.0, g["step_ms"] - g["fwd_ms"] - g["bwd_ms"])
    assert c["rest_of_step_ms"] == pytest.approx(rest)
    assert c["step_over_run_step_bound"] == pytest.approx(c["step_ms"] / (want + rest))


def test_graph_recompute_checkpoints_every_layer_inside_the_graphs(backend):
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=1, progress=False,
                  configs=("graph", "graph_recompute"), layers_per_graph=1)
    g, rc = r["configs"]["graph"], r["configs"]["graph_recompute"]
    assert rc["graphs"] == 3 and rc["offloaded_bytes"] == 0
    assert rc["activation_bytes_at_boundary"] < g["activation_bytes_at_boundary"] / 3


def test_a_sweep_without_peaks_says_why_after_running_checkpoint_and_graph_first(backend, monkeypatch):
    """In one process too the sweep runs checkpoint and graph first; where the backend's
    allocator keeps no peak (the cpu backend's), there are no budgets, and the report says why."""
    monkeypatch.setattr(bench_measure, "_memory_step", lambda r, built, saved, curve, bd: (None, None, 0))
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("eager",), budgets="sweep")
    assert list(r["configs"]) == ["checkpoint", "graph", "eager"]
    assert "does not keep" in r["sweep"]["reason"]


def _peaks(**peaks: int | None) -> dict:
    return {n: {"peak_device_bytes": p, "step_ms": 1.0} for n, p in peaks.items()}


def test_sweep_budgets_run_evenly_from_checkpoints_peak_to_graphs():
    got = bench_configs.sweep_budgets(_peaks(checkpoint=8 * GiB, graph=18 * GiB))
    assert got == [f"budget:{g}.00GiB" for g in (8, 10, 12, 14, 16, 18)]
    # uneven figures are rounded up to a hundredth of their unit, and say their bytes
    got = bench_configs.sweep_budgets(_peaks(checkpoint=int(8.8 * GiB), graph=int(9.3 * GiB)))
    assert got == ["budget:8.80GiB", "budget:8.90GiB", "budget:9.00GiB", "budget:9.10GiB",
                   "budget:9.20GiB", "budget:9.30GiB"]
    assert [bench_configs.budget_bytes(n) for n in got] == [
        int(float(n[7:-3]) * GiB) for n in got]
    assert all(bench_configs.budget_bytes(n) >= int(8.8 * GiB) for n in got)
    # small stacks in MiB; a graph peak below checkpoint's: the one budget
    assert bench_configs.sweep_budgets(_peaks(checkpoint=3 * MiB, graph=3 * MiB)) == ["budget:3.00MiB"]
    assert bench_configs.sweep_budgets(_peaks(checkpoint=20 * GiB, graph=18 * GiB)) == ["budget:20.00GiB"]
    # and why not
    assert "did not run" in bench_configs.sweep_budgets(_peaks(graph=GiB))
    assert "does not keep" in bench_configs.sweep_budgets(_peaks(checkpoint=None, graph=GiB))
    assert "out of memory" in bench_configs.sweep_budgets(
        {"checkpoint": {"reason": "out of memory"}, **_peaks(graph=GiB)})


def test_lower_bound_is_compute_or_copies_each_phase():
    # 10 GB at 50 GB/s out (200 ms) hides no forward of 100 ms; back at 100 GB/s (100 ms)
    # hides under 150 ms of backward and 30 ms of recompute
    assert bench_report.lower_bound_ms(100.0, 150.0, 30.0, 10e9, 50.0, 100.0) == pytest.approx(200.0 + 180.0)
    assert bench_report.lower_bound_ms(100.0, 150.0, 0.0, 0, None, None) == 250.0


def test_the_run_bound_takes_graphs_passes_no_longer_than_its_step():
    """A timeline step that ran long (its passes add up to more than the timed step) is
    scaled to the step before the run's bound takes it; one that fits is taken as it is."""
    plan = {"choices": ["keep"], "mode": "off", "recompute_ms": 0.0, "lower_bound_ms": 150.0}
    def report():
        return {"copy": {"d2h_gbps": 50.0, "h2d_gbps": 50.0},
                "configs": {"budget:1GiB": {"step_ms": 200.0, "plan": dict(plan),
                                            "offloaded_bytes": 0, "peak_device_bytes": GiB // 2}}}
    out = report()
    bench_report.planned_figures(out, {"fwd_ms": 60.0, "bwd_ms": 144.0, "step_ms": 190.0})
    c = out["configs"]["budget:1GiB"]
    assert c["run_lower_bound_ms"] == pytest.approx(190.0) and c["rest_of_step_ms"] == 0.0
    assert out["graph_passes_ms"]["fwd_ms"] == pytest.approx(60.0 * 190.0 / 204.0)
    out = report()
    bench_report.planned_figures(out, {"fwd_ms": 60.0, "bwd_ms": 120.0, "step_ms": 190.0})
    c = out["configs"]["budget:1GiB"]
    assert c["run_lower_bound_ms"] == pytest.approx(180.0) and c["rest_of_step_ms"] == pytest.approx(10.0)


@pytest.mark.parametrize("text,n", [("10GiB", 10 * GiB), ("9.5G", int(9.5 * GiB)), ("12000MiB", 12000 * MiB),
                                    ("123", 123), ("8e9", 8 * 10**9), ("2 GB", 2 * 10**9), ("1k", 1024)])
def test_sizes(text, n):
    assert bench_configs.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "10XB", "nan", "inf", "1.2.3G", "1e400",
                                  "99999999999999999999999GiB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="size|beyond any device's memory"):
        bench_configs.parse_size(text)


def test_sizes_not_finite_read_alike_and_absurd_ones_are_refused():
    for text in ("inf", "1e400", "nan"):
        with pytest.raises(ValueError, match=rf"^'{text}' is not a size"):
            bench_configs.parse_size(text)
    with pytest.raises(ValueError, match="beyond any device's memory"):
        bench_configs.parse_size(str(2 << 60))


def test_the_memory_plot_places_each_point_by_its_label():
    """A graph configuration probes once per graph (start, F2, B0, end): its points go
    over those labels, not over the first four of eager's."""
    eager = [("start", 1), ("F0", 2), ("F1", 3), ("F2", 4), ("B2", 3), ("B1", 2), ("end", 1), ("opt", 1)]
    graph = [("start", 1), ("F2", 4), ("B0", 1), ("end", 1), ("opt", 1)]
    labels, xs = bench_report.curve_positions({"graph": graph, "eager": eager})
    assert labels == ["start", "F0", "F1", "F2", "B2", "B1", "B0", "end", "opt"]
    assert xs["eager"] == [0, 1, 2, 3, 4, 5, 7, 8]
    assert xs["graph"] == [0, 3, 6, 7, 8]
    assert [labels[i] for i in xs["graph"]] == [p[0] for p in graph]


def test_the_pareto_picture_has_one_point_per_configuration(tmp_path):
    pytest.importorskip("matplotlib")
    cf = {"eager": {"peak_device_bytes": 17 * GiB, "step_ms": 200.0},
          "checkpoint": {"peak_device_bytes": 9 * GiB, "step_ms": 250.0},
          "graph_remap": {"peak_device_bytes": 10 * GiB, "step_ms": 450.0},
          "budget:9.00GiB": {"peak_device_bytes": 8 * GiB, "step_ms": 230.0},
          "torch_graphed": {"reason": "no CUDA"}, "save_on_cpu": {"peak_device_bytes": None, "step_ms": 1.0}}
    pts = bench_report.pareto_points(cf)
    assert [p[0] for p in pts] == ["budget:9.00GiB", "checkpoint", "graph_remap", "eager"]
    assert bench_report.pareto_front(pts) == ["budget:9.00GiB", "eager"]
    out = tmp_path / "p.png"
    bench_report.plot({"configs": cf, "backend": "x"}, {"eager": [("start", 1), ("F0", 2)]}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def nothing_runs(monkeypatch):
    """The bench fails the test if it gets as far as choosing a backend."""
    from graphslot import selection

    def refuse(*a, **k):
        raise AssertionError("the bench ran before it checked its arguments")

    monkeypatch.setattr(selection, "get_backend", refuse)


@pytest.mark.parametrize("flag,path,needle", [
    ("--plot", "/nonexistent/dir/x.png", "does not exist"), ("--trace", "/nonexistent/dir/t.json", "does not exist"),
    ("--plot", "{tmp}/x.txt", "unknown file type"), ("--trace", "{tmp}/t.png", "unknown file type"),
    ("--plot", "{tmp}", "unknown file type")])
def test_bad_output_paths_fail_before_anything_runs(capsys, tmp_path, nothing_runs, flag, path, needle):
    rc = cli.main(["bench", "--preset", "tiny", "--quiet", "--json", flag, path.format(tmp=tmp_path)])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and needle in cap.err and flag in cap.err, cap
    assert len(cap.err.strip().splitlines()) == 1 and "Traceback" not in cap.err


def test_plot_without_matplotlib_fails_before_anything_runs(capsys, tmp_path, nothing_runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    rc = cli.main(["bench", "--preset", "tiny", "--quiet", "--json", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "needs matplotlib" in err and "graphslot[plot]" in err, err
    with pytest.raises(graphslot.UsageError, match="matplotlib"):
        run_bench(graphslot.get_backend(), BenchShape.preset("tiny"), plot_path=str(tmp_path / "x.png"))


def test_llama_without_transformers_exits_2_before_anything_runs(capsys, nothing_runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    rc = cli.main(["bench", "--preset", "llama", "--quiet", "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and "--preset llama needs transformers" in err and "graphslot[models]" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,needle", [
    (["--budgets", ""], "--budgets"), (["--budgets", "lots"], "not a size"), (["--budgets", "0GiB"], "positive"),
    (["--configs", "budget:x"], "budget:x"), (["--accumulate", "0"], "--accumulate"),
    (["--zero-grad", "never"], "--zero-grad"), (["--kv-heads", "2"], "--kv-heads")])
def test_bench_refuses_bad_budget_and_step_options(capsys, nothing_runs, argv, needle):
    rc = cli.main(["bench", "--preset", "tiny", "--quiet", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_tiny_llama_trains_in_every_configuration(backend):
    """The llama preset's layers are transformers' LlamaDecoderLayer, shrunk by the shape
    options; each is one tensor in, one out, rotary cos and sin its buffers."""
    pytest.importorskip("transformers")
    from graphslot.cli.bench_models import LlamaLayer, make_layers

    args = ["--preset", "llama", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "96",
            "--seq", "16", "--batch", "2", "--layers", "2", "--dtype", "float32"]
    shape, _, _ = bench.check_args(cli.build_parser().parse_args(["bench", *args]))
    assert (shape.model, shape.hidden, shape.kv_heads, shape.ffn, shape.layers) == ("llama", 64, 2, 96, 2)
    layers = make_layers(shape, backend.device)
    assert all(isinstance(m, LlamaLayer) for m in layers)
    inner = layers[0].layer
    assert (inner.self_attn.k_proj.out_features, inner.mlp.up_proj.out_features) == (2 * 16, 96)
    assert {n for n, _ in layers[0].named_buffers()} == {"cos", "sin"}
    x = torch.randn(2, 16, 64, device=backend.device)
    assert isinstance(layers[0](x), torch.Tensor) and layers[0](x).shape == x.shape
    r = run_bench(backend, shape, steps=1, warmup=1, progress=False, layers_per_graph=1,
                  configs=("eager", "checkpoint", "graph", "graph_resident"))
    for name, c in r["configs"].items():
        assert "reason" not in c and c["step_ms"] > 0, (name, c)
    assert r["shape"]["model"] == "llama" and r["configs"]["graph_resident"]["offloaded_bytes"] > 0
    argv = bench._child_argv(shape, "eager", bench._Options(1, 0, 1, 1, True, None, False), None)
    assert argv[argv.index("--preset") + 1] == "llama" and argv[argv.index("--kv-heads") + 1] == "2"


def test_llama_refuses_options_it_cannot_take(capsys, nothing_runs):
    pytest.importorskip("transformers")
    for argv, needle in ((["--attention", "math"], "sdpa"), (["--kv-heads", "3"], "--kv-heads")):
        rc = cli.main(["bench", "--preset", "llama", "--quiet", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_an_adamw_run_steps_adamw_in_every_configuration(backend, monkeypatch):
    """--optimizer adamw: every step of every configuration, a planned one too, is AdamW's
    (made once, before the builds), and the report says so; another name is refused."""
    stepped: list[str] = []
    for cls in (torch.optim.AdamW, torch.optim.SGD):  # (every step of every class, seen)
        def step(self, *a, real=cls.step, **k):
            stepped.append(type(self).__name__)
            return real(self, *a, **k)
        monkeypatch.setattr(cls, "step", step)
    shape = BenchShape.preset("tiny")
    r = run_bench(backend, shape, steps=1, warmup=1, progress=False, configs=("eager", "graph_auto"),
                  optimizer="adamw")
    # (each configuration: a warm-up and a timed step, then a timeline and a memory step)
    assert r["optimizer"] == "adamw" and stepped == ["AdamW"] * 8
    assert "forward, backward, AdamW, zero_grad" in bench_report.render_table(r)
    assert "step_ms" in r["configs"]["graph_auto"], r["configs"]["graph_auto"]
    with pytest.raises(graphslot.UsageError, match="optimizer must be one of sgd, adamw"):
        run_bench(backend, shape, steps=1, warmup=1, progress=False, configs=("eager",),
                  optimizer="adam")


def test_the_table_says_where_the_trace_and_plot_went_or_why_not(backend, tmp_path):
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("eager",), trace_path=str(tmp_path / "t.json"))
    assert r["trace"]["path"] is None and not (tmp_path / "t.json").exists()
    assert "trace: none of graph_auto, graph_resident, graph_remap ran" in bench_report.render_table(r)
    r = run_bench(backend, BenchShape.preset("tiny"), steps=1, warmup=0, progress=False,
                  configs=("graph_remap",), trace_path=str(tmp_path / "t.json"))
    assert (tmp_path / "t.json").exists()
    assert f"trace of graph_remap's step: {tmp_path / 't.json'}" in bench_report.render_table(r)


@pytest.mark.parametrize("isolate", [False, True])
def test_a_trace_or_plot_that_cannot_be_written_after_the_run_keeps_the_report(
        capsys, tmp_path, monkeypatch, isolate):
    """A write failing after the checks passed (a disk filled during the run) once ended
    in a traceback and lost the results: the report is printed, the failure named, exit 1."""
    from graphslot import trace

    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace.Timeline, "write", full)
    monkeypatch.setenv("GRAPHSLOT_BACKEND", "cpu")
    if isolate:  # (the trace is written by the configuration's own process)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [
            os.environ.get("PYTHONPATH")])]))
        (tmp_path / "sitecustomize.py").write_text(
            "from graphslot import trace\n"
            "def full(self, path):\n    raise OSError(28, 'No space left on device')\n"
            "trace.Timeline.write = full\n")
    path = tmp_path / "t.json"
    rc = cli.main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--quiet", "--json",
                   "--configs", "graph_remap", "--trace", str(path)] + (["--isolate"] if isolate else []))
    out, err = capsys.readouterr()
    r = json.loads(out)
    why = f"the trace {path}: cannot write it (No space left on device)"
    assert rc == 1 and "step_ms" in r["configs"]["graph_remap"], (out, err)
    assert r["write_errors"] == [why] and not path.exists()
    assert r["trace"] == {"config": "graph_remap", "path": None, "reason": why}
    assert err.strip() == f"graphslot bench: error: {why}"


def test_a_plot_that_cannot_be_written_after_the_run_keeps_the_report(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "plot", full)
    path = tmp_path / "p.png"
    rc = cli.main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--quiet", "--json",
                   "--configs", "eager", "--plot", str(path)])
    out, err = capsys.readouterr()
    r = json.loads(out)
    why = f"the plot {path}: cannot write it (No space left on device)"
    assert rc == 1 and "step_ms" in r["configs"]["eager"] and "plot" not in r
    assert r["write_errors"] == [why] and err.strip() == f"graphslot bench: error: {why}"


def test_budgets_given_twice_in_other_units_run_once_under_their_first_spelling():
    names, sweep = bench._order(["eager", "budget:1GiB@keep", "budget:1024MiB@keep", "eager"],
                                ["1024MiB", "1GiB", "1073741824", "2GiB"])
    assert not sweep and names == ["eager", "budget:1GiB@keep", "graph", "budget:1024MiB",
                                   "budget:2GiB"]
