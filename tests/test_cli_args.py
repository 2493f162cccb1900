"""The command line never ends in a traceback on bad input: exit 2 and one line on stderr
that names the argument (``graphslot demo``, ``graphslot info`` and the top level)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphslot
from graphslot import cli, selection
from graphslot.cli import demo
from graphslot.cli import int_range, one_line, positive_int


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, *, names: str | None = None) -> None:
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith("graphslot") and ": error: " in err, repr(err)
    assert out == ""
    if names is not None:
        assert names in err, err


def _fake_report(b: Any, config: Any, steps: int = 6) -> dict[str, Any]:
    """Stands in for run_demo where only the argument handling is under test."""
    mode = {"matches_eager": True, "max_abs_diff": 0.0, "step_ms": 1.0,
            "device_activation_bytes_at_boundary": 0, "offloaded_bytes_per_step": 0,
            "driver_calls_per_step": 0.0, "host_syncs_per_step": 0.0, "losses": []}
    return {"backend": b.name, "device": "test", "config": {"layers": config.layers},
            "steps": steps, "saved_activation_bytes": 0,
            "eager": {"step_ms": 1.0, "device_activation_bytes_at_boundary": 0, "losses": []},
            "modes": {"resident": dict(mode), "remap": dict(mode)}}


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(demo, "run_demo", _fake_report)


def test_demo_prints_a_table(capsys, no_training):
    pytest.importorskip("tabulate")
    rc, out, err = run_main(["demo", "--steps", "2"], capsys)
    assert rc == 0, err
    assert re.search(r"^run\s+matches eager\s+max \|diff\|\s+step ms", out, re.M), out
    assert re.search(r"^resident\s+yes \(bitwise\)\s", out, re.M), out


def test_demo_table_without_tabulate_is_a_clear_error(capsys, no_training, monkeypatch):
    monkeypatch.setitem(sys.modules, "tabulate", None)  # import now raises ImportError
    rc, out, err = run_main(["demo"], capsys)
    assert rc == 1 and out == "" and "needs tabulate" in err and "--json" in err, err
    assert run_main(["demo", "--json"], capsys)[0] == 0


# --------------------------------------------------------------------------- the type functions


@pytest.mark.parametrize("text", ["0", "-1", "x", "", "1.5", "1e3", " ", "0x10", "+-1"])
def test_positive_int_refuses_with_a_message_naming_the_value(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer") as ei:
        positive_int(text)
    assert repr(text) in str(ei.value)


@pytest.mark.parametrize("text, n", [("1", 1), ("007", 7), (" 12 ", 12), ("1_000", 1000),
                                     (str(10**30), 10**30)])
def test_positive_int_accepts_positive_decimals(text, n):
    assert positive_int(text) == n


def test_int_range_bounds_both_ends():
    t = int_range(2, 5)
    assert [t(str(n)) for n in (2, 5)] == [2, 5]
    for bad in ("1", "6"):
        with pytest.raises(argparse.ArgumentTypeError, match="from 2 to 5"):
            t(bad)
    with pytest.raises(ValueError):
        int_range(3, 2)


def test_positive_int_names_the_argument_in_a_parser(capsys):
    p = cli._Parser(prog="graphslot x")
    p.add_argument("--count", type=positive_int)
    with pytest.raises(SystemExit) as ei:
        p.parse_args(["--count", "0"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err == ("graphslot x: error: argument --count: must be a positive integer, got '0' "
                   "(see graphslot x --help)\n")


@given(st.text())
def test_one_line_never_leaves_a_line_break(text):
    assert len(one_line(text).splitlines()) <= 1


# --------------------------------------------------------------------------- demo


@pytest.mark.parametrize("argv, names", [
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--steps", "1"], "--steps"),  # (the first step is not counted: nothing left)
    (["demo", "--steps", "-3"], "--steps"),
    (["demo", "--steps", "two"], "--steps"),
    (["demo", "--steps", str(demo.MAX_STEPS + 1)], "--steps"),
    (["demo", "--steps"], "--steps"),
    (["demo", "--layers", "0"], "--layers"),
    (["demo", "--layers", "-1"], "--layers"),
    (["demo", "--layers", "2.5"], "--layers"),
    (["demo", "--layers", str(10**12)], "--layers"),
    (["demo", "--bogus"], "--bogus"),
    (["demo", "extra"], "extra"),
    (["bogus"], "bogus"),
    ([], "command"),
    (["--backend", "nope", "demo"], "nope"),
    (["--backend", "nope", "info"], "nope"),
])
def test_bad_demo_and_top_level_arguments_exit_2_with_one_line(capsys, no_training, argv, names):
    assert_one_line_error(*run_main(argv, capsys), names=names)


def test_run_demo_refuses_nonpositive_steps(backend):
    for steps in (0, 1):
        with pytest.raises(graphslot.UsageError, match="steps must be an int of at least 2"):
            demo.run_demo(backend, steps=steps)
    with pytest.raises(graphslot.UsageError, match="layers must be a positive int"):
        demo.run_demo(backend, demo.GPTConfig(layers=0))


def test_help_exits_0(capsys):
    rc, out, _ = run_main(["demo", "--help"], capsys)
    assert rc == 0 and "--steps N" in out and str(demo.MAX_STEPS) in out


def test_an_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    rc, out, err = run_main(["demo"], capsys)
    assert rc == 130 and err == "graphslot demo: interrupted\n"


def test_a_graphslot_error_inside_a_command_is_one_line(capsys, monkeypatch):
    def fails(*a: Any, **k: Any) -> None:
        raise graphslot.StateError("first line\nsecond line")

    monkeypatch.setattr(demo, "run_demo", fails)
    assert_one_line_error(*run_main(["demo"], capsys), names="first line second line")


def test_the_demo_really_runs_and_matches_eager(capsys):
    rc, out, err = run_main(["demo", "--steps", "2", "--layers", "1", "--json", "--strict"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    assert r["steps"] == 2 and r["config"]["layers"] == 1
    assert all(m["matches_eager"] for m in r["modes"].values())


_OPTIONS = ["--steps", "--layers", "--json", "--strict", "--backend", "--help", "-h", "--st",
            "--lay", "--bogus", "-x", "--", "demo", "info", "plan", "bench"]


def _number_text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(min_value=-(10**20), max_value=10**20).map(str),
        st.sampled_from(["0", "-0", "1", "2", "00", "+3", "1e3", "0x10", "1.0", "nan", "inf",
                         str(demo.MAX_STEPS), str(demo.MAX_LAYERS + 1), "", " ", "\n", "\x00"]),
        st.floats(allow_nan=True).map(str),
        st.text(max_size=8),
    )


_ARGS = st.lists(st.one_of(st.sampled_from(_OPTIONS), _number_text()), max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rest=_ARGS)
def test_random_demo_arguments_exit_0_or_2_never_a_traceback(capsys, no_training, rest):
    """Random argument lists after ``demo`` (run_demo stubbed out, so valid ones are quick):
    the outcome is exit 0, or exit 2 with exactly one line naming what was wrong."""
    rc, out, err = run_main(["demo", *rest], capsys)
    if rc == 0:
        assert "Traceback" not in err
        return
    assert_one_line_error(rc, out, err)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--steps", "--layers"]), n=st.integers(-(10**6), 10**6))
def test_demo_numbers_are_checked_exactly(capsys, no_training, flag, n):
    hi = demo.MAX_STEPS if flag == "--steps" else demo.MAX_LAYERS
    rc, out, err = run_main(["demo", flag, str(n), "--json"], capsys)
    if 1 <= n <= hi:
        assert rc == 0, err
        r = json.loads(out)
        assert (r["steps"] if flag == "--steps" else r["config"]["layers"]) == n
    else:
        assert_one_line_error(rc, out, err, names=f"argument {flag}: ")


# --------------------------------------------------------------------------- bench


_BENCH_WORDS = ["--preset", "tiny", "llama", "default", "--accumulate", "--zero-grad", "none", "keep",
                "--budgets", "sweep", "10GiB", "9.5G,1", "12000MiB", "0", "-1", "--configs",
                "eager,budget:1G", "graph_auto", "budget:", "--kv-heads", "--layers", "--steps",
                "--plot", "--trace", "/nonexistent/x.png", "x.json", "--isolate", "--rounds"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rest=st.lists(st.one_of(st.sampled_from(_BENCH_WORDS), _number_text()), max_size=6))
def test_random_bench_arguments_exit_0_or_2_never_a_traceback(capsys, monkeypatch, tmp_path, rest):
    """Random argument lists after ``bench`` (the run stubbed out, so valid ones are quick):
    exit 0 with the options as parsed, or exit 2 with one line naming what was wrong."""
    from graphslot.cli import bench

    seen: dict[str, Any] = {}

    def fake_run(b: Any, shape: Any, **kw: Any) -> dict[str, Any]:
        seen.update(kw, shape=shape)
        return {"configs": {}}

    monkeypatch.chdir(tmp_path)  # a relative --trace x.json lands here, never in the repo
    monkeypatch.setattr(bench, "run_bench", fake_run)
    rc, out, err = run_main(["bench", "--json", "--quiet", *rest], capsys)
    if rc == 0:
        assert "Traceback" not in err and json.loads(out) == {"configs": {}}
        assert seen["accumulate"] >= 1 and seen["zero_grad"] in ("none", "keep")
        return
    assert_one_line_error(rc, out, err)


# --------------------------------------------------------------------------- info and the environment


@pytest.fixture
def fresh_selection(monkeypatch):
    """get_backend builds a new backend (so it reads the environment again)."""
    monkeypatch.setattr(selection, "_cache", {})
    monkeypatch.setattr(selection, "_reasons", {})


def test_info_runs(capsys, fresh_selection, monkeypatch):
    monkeypatch.setenv("GRAPHSLOT_BACKEND", "cpu")
    rc, out, err = run_main(["info", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["backend"] == "cpu"


_GRANULARITY = st.one_of(
    st.integers(-(1 << 40), 1 << 40).map(str),
    st.sampled_from(["foo", "4k", "2**12", "4096.0", "-4096", "0", "4097", "12288", "0x1000",
                     "1e4", " ", str(1 << 31), "8192"]),
    st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
            max_size=10),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_GRANULARITY)
def test_any_granularity_variable_gives_info_or_one_line(capsys, value):
    from graphslot.backends.cpu.backend import PAGE

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection, "_cache", {})
        mp.setattr(selection, "_reasons", {})
        mp.setenv("GRAPHSLOT_BACKEND", "cpu")
        mp.setenv("GRAPHSLOT_CPU_GRANULARITY", value)
        rc, out, err = run_main(["info", "--json"], capsys)
    if rc == 0:
        g = json.loads(out)["granularity"]
        assert g >= PAGE and g & (g - 1) == 0
        return
    assert_one_line_error(rc, out, err, names="GRAPHSLOT_CPU_GRANULARITY=")


@pytest.mark.parametrize("argv, env, names", [
    (["info"], {"GRAPHSLOT_CPU_GRANULARITY": "foo"}, "GRAPHSLOT_CPU_GRANULARITY='foo'"),
    (["info"], {"GRAPHSLOT_CPU_GRANULARITY": "0"}, "GRAPHSLOT_CPU_GRANULARITY='0'"),
    (["demo", "--steps", "0"], {}, "--steps"),
    # the bench checks its output paths before it runs anything (nothing here would fit)
    (["bench", "--plot", "/nonexistent/dir/x.png"], {}, "--plot /nonexistent/dir/x.png"),
    (["bench", "--trace", "/nonexistent/dir/t.json"], {}, "--trace /nonexistent/dir/t.json"),
    # (a folder access() may call writable for root, where no file can be made)
    (["bench", "--trace", "/proc/t.json"], {}, "--trace /proc/t.json: "),
    (["bench", "--accumulate", "0"], {}, "--accumulate"),
    (["bench", "--budgets", "10 parsecs"], {}, "--budgets"),
    # (a negative size after its option is not taken for an option of its own)
    (["bench", "--budgets", "-1G"], {}, "positive, got '-1G'"),
])
def test_the_console_command_exits_2_with_one_line(argv, env, names):
    full_env = dict(os.environ, GRAPHSLOT_BACKEND="cpu", **env)
    proc = subprocess.run([sys.executable, "-m", "graphslot.cli", *argv], env=full_env,
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, names=names)


def test_a_reader_that_stops_reading_ends_a_command_quietly():
    """``graphslot info | head -0``: the reader is gone before the output is flushed;
    the command says nothing more and exits 0, with stdout buffered as in a terminal's
    pipe."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        done = subprocess.run([sys.executable, "-m", "graphslot.cli", "info"], stdout=w,
                              stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(w)
    assert done.returncode == 0 and done.stderr == b"", done.stderr


def test_a_shape_the_device_cannot_hold_is_refused_before_it_takes_the_memory(capsys, monkeypatch):
    """On the cpu backend the device is the host's memory, which overcommits instead of
    failing an allocation: a shape whose weights and gradients alone exceed what the
    device has free is one line and exit 2, before anything is allocated."""
    from graphslot.cli import bench

    def never(*a, **k):
        raise AssertionError("ran")

    monkeypatch.setattr(bench, "run_bench", never)
    rc, out, err = run_main(["bench", "--json", "--quiet", "--preset", "tiny", "--hidden", "65536",
                             "--heads", "64", "--ffn", "262144", "--layers", "4096"], capsys)
    assert_one_line_error(rc, out, err)
    assert "weights and gradients" in err and "free" in err and "--hidden" in err


@pytest.mark.parametrize("option,value", [("--batch", "100000000000000000"),
                                          ("--batch", "99999999999999999999"),
                                          ("--seq", "9223372036854775807")])
def test_a_batch_or_sequence_past_what_the_device_holds_is_refused_by_name(capsys, monkeypatch,
                                                                           option, value):
    """Activations past any device (and past what a tensor can index: torch's overflow
    errors named neither the option nor the bench) are one line and exit 2."""
    from graphslot.cli import bench

    def never(*a, **k):
        raise AssertionError("ran")

    monkeypatch.setattr(bench, "run_bench", never)
    rc, out, err = run_main(["bench", "--json", "--quiet", "--preset", "tiny", option, value], capsys)
    assert_one_line_error(rc, out, err)
    assert "input and output" in err and "free" in err and option in err


@pytest.mark.parametrize("argv,prog", [(["demo", "--bogus"], "graphslot demo"),
                                       (["bench", "--json", "--bogus", "x"], "graphslot bench")])
def test_an_unknown_argument_is_named_by_its_command(capsys, argv, prog):
    rc, out, err = run_main(argv, capsys)
    assert_one_line_error(rc, out, err)
    assert err.startswith(f"{prog}: error: unrecognized arguments: ") and f"see {prog} --help" in err


def test_an_unknown_backend_says_where_its_name_came_from(capsys, monkeypatch):
    rc, out, err = run_main(["--backend", "banana", "info"], capsys)
    assert_one_line_error(rc, out, err)
    assert "'banana'" in err and "the name given" in err and "GRAPHSLOT_BACKEND" not in err
    monkeypatch.setenv("GRAPHSLOT_BACKEND", "banana")
    rc, out, err = run_main(["info"], capsys)
    assert_one_line_error(rc, out, err)
    assert "(set GRAPHSLOT_BACKEND)" in err


def test_the_output_path_check_leaves_what_is_there_and_never_waits(tmp_path):
    """It tries to make the file: an existing one keeps its bytes, a link to a file not
    made yet stays a link, and a named pipe no one reads is refused, not waited on."""
    from graphslot.cli.bench_report import check_output_path
    from graphslot.errors import UsageError

    kept = tmp_path / "kept.json"
    kept.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "later" / "t.json")
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    check_output_path(str(kept), "--trace")
    check_output_path(str(link), "--trace")
    check_output_path(str(tmp_path / "new.json"), "--trace")
    with pytest.raises(UsageError, match="--trace .*pipe.json: cannot write it"):
        check_output_path(str(pipe), "--trace")
    assert kept.read_text() == "mine" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "link.json", "pipe.json"]
