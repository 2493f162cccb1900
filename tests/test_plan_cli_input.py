"""``graphslot plan`` on bad input: one line on stderr, exit status 2, never a traceback."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from graphslot.cli import plan as plan_cli
from graphslot.cli.plan import MAX_DEPTH, main

_HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

GOOD = {"tensors": [{"name": "a", "size": 1024, "start": 0, "end": 4, "branch": "x"},
                    {"name": "b", "size": 512, "start": 2, "end": 6}]}


def _expect_2(capsys, *words: str) -> str:
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.startswith("graphslot plan: error: ") and cap.err.endswith("\n")
    assert cap.err.count("\n") == 1, cap.err
    assert "Traceback" not in cap.err
    for w in words:
        assert w in cap.err, cap.err
    return cap.err


def _file(tmp_path: Path, text: str, name: str = "p.json") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_deep_nesting_is_refused_naming_the_limit(tmp_path, capsys):
    path = _file(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert main([path]) == 2
    _expect_2(capsys, path, f"nested more than {MAX_DEPTH} deep")
    # Brackets inside strings do not count.
    doc = json.loads(json.dumps(GOOD))
    doc["tensors"][0]["name"] = "[" * 1000
    assert main([_file(tmp_path, json.dumps(doc)), "--json"]) == 0


def test_dev_zero_and_big_files_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "MAX_FILE_BYTES", 1 << 16)
    assert main(["/dev/zero"]) == 2
    _expect_2(capsys, "/dev/zero", "larger than the limit of 65536 bytes")
    big = json.dumps({"tensors": [{"name": f"t{i}", "size": 256, "start": 0, "end": 1}
                                  for i in range(3000)]})
    assert main([_file(tmp_path, big)]) == 2
    _expect_2(capsys, "larger than the limit")


def test_help_states_the_limits(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at most 64 MiB" in out and f"nested at most {MAX_DEPTH} deep" in out
    assert "2**63" in out


@pytest.mark.parametrize("png, words", [
    ("out.bogus", "unknown image format 'bogus'"),
    ("noext", "no file extension"),
    ("missing-dir/out.png", "does not exist"),
])
def test_png_names_bad_targets(tmp_path, capsys, png, words):
    pytest.importorskip("matplotlib")
    target = str(tmp_path / png)
    assert main([_file(tmp_path, json.dumps(GOOD)), "--png", target]) == 2
    _expect_2(capsys, "--png", words)
    assert not Path(target).exists()


def test_png_where_no_file_can_be_made_is_refused_before_planning(tmp_path, capsys):
    """(/proc: access() may say yes to root; the plan was printed, then the write failed)"""
    pytest.importorskip("matplotlib")
    assert main([_file(tmp_path, json.dumps(GOOD)), "--png", "/proc/arena.png"]) == 2
    _expect_2(capsys, "--png /proc/arena.png: ")


def test_png_to_an_existing_directory_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main([_file(tmp_path, json.dumps(GOOD)), "--png", str(tmp_path)]) == 2
    _expect_2(capsys, "is a directory")
    assert not Path(str(tmp_path) + ".png").exists()


@pytest.mark.parametrize("key, value", [
    ("size", 2 ** 63), ("start", -(2 ** 63) - 1), ("end", 10 ** 30), ("align", 2 ** 64),
])
def test_integers_beyond_63_bits_are_refused(tmp_path, capsys, key, value):
    doc = json.loads(json.dumps(GOOD))
    doc["tensors"][1][key] = value
    assert main([_file(tmp_path, json.dumps(doc))]) == 2
    _expect_2(capsys, "tensors[1] ('b')", repr(key), "does not fit in 63 bits")


def test_an_arena_beyond_63_bits_is_refused(tmp_path, capsys):
    doc = {"tensors": [{"name": n, "size": 2 ** 62, "start": 0, "end": 1} for n in "abc"]}
    assert main([_file(tmp_path, json.dumps(doc))]) == 2
    _expect_2(capsys, "does not fit in 63 bits")


def test_huge_digit_strings_are_not_a_traceback(tmp_path, capsys):
    assert main([_file(tmp_path, '{"tensors": [{"size": ' + "9" * 5000 + "}]}")]) == 2
    _expect_2(capsys, "is not valid JSON")


@pytest.mark.parametrize("doc, words", [
    ({"tensors": [{"name": "a", "size": 1, "start": 0, "end": 1, "branch": 1},
                  {"name": "b", "size": 1, "start": 0, "end": 1, "branch": "1"}]},
     ["tensors[1] ('b')", "branch \"1\" is a string", "tensors[0] ('a') uses an integer"]),
    ({"tensors": [{"name": "a", "size": 1, "start": 0, "end": 1, "branch": "1"}],
      "branches": ["1", 2]},
     ["branches[1]", "branch 2 is an integer"]),
    ({"tensors": [{"name": "a", "size": 1, "start": 0, "end": 1, "alias_group": 3},
                  {"name": "b", "size": 1, "start": 0, "end": 1, "alias_group": "3"}]},
     ["tensors[1] ('b')", "alias group"]),
])
def test_mixed_id_types_are_an_error(tmp_path, capsys, doc, words):
    assert main([_file(tmp_path, json.dumps(doc))]) == 2
    _expect_2(capsys, *words)


def test_a_key_given_twice_is_an_error(tmp_path, capsys):
    text = ('{"tensors": [{"name": "a", "size": 1, "start": 0, "end": 1}], '
            '"tensors": []}')
    assert main([_file(tmp_path, text)]) == 2
    _expect_2(capsys, "key 'tensors' appears twice")
    text = '{"tensors": [{"name": "a", "size": 1, "size": 2, "start": 0, "end": 1}]}'
    assert main([_file(tmp_path, text)]) == 2
    _expect_2(capsys, "key 'size' appears twice")


def test_a_branch_listed_twice_is_an_error(tmp_path, capsys):
    doc = {"tensors": [{"name": "a", "size": 1, "start": 0, "end": 1, "branch": "cp1"}],
           "branches": ["cp1", "cp2", "cp1"]}
    assert main([_file(tmp_path, json.dumps(doc))]) == 2
    _expect_2(capsys, "branches[2]", "is listed twice", "branches[0]")


@pytest.mark.parametrize("argv, words", [
    ([], "the following arguments are required: FILE.json"),
    (["p.json", "--bogus"], "unrecognized arguments: --bogus"),
    (["p.json", "--png"], "argument --png: expected one argument"),
])
def test_argument_errors_are_one_line(capsys, argv, words):
    assert main(argv) == 2
    _expect_2(capsys, words)


def test_argument_errors_through_graphslot_main_are_one_line(capsys):
    from graphslot.cli import main as graphslot_main

    try:
        code = graphslot_main(["plan", "x.json", "--bogus"])
    except SystemExit as e:  # older entry points let argparse exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err  # the top-level parser reports unknown options
    assert err.count("\n") == 1 and "--bogus" in err and "Traceback" not in err


# --------------------------------------------------------------------------- fuzzing


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@st.composite
def malformed_docs(draw) -> str:
    """Plan files that are wrong in exactly one way (so each must be refused)."""
    kind = draw(st.sampled_from(["top", "key", "value", "bytes", "deep", "branches"]))
    doc = json.loads(json.dumps(GOOD))
    entry = doc["tensors"][draw(st.integers(0, 1))]
    if kind == "top":
        return json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict))))
    if kind == "key":
        key = draw(st.sampled_from(["name", "size", "start", "end"]))
        del entry[key]
    elif kind == "value":
        key = draw(st.sampled_from(["name", "size", "start", "end", "align", "branch",
                                    "alias_offset"]))
        bad = {"name": json_values.filter(lambda v: not isinstance(v, str) or v == ""),
               "size": json_values.filter(lambda v: not (type(v) is int and 0 < v < 2 ** 63)),
               "start": json_values.filter(lambda v: type(v) is not int or v >= 4),
               "end": json_values.filter(lambda v: type(v) is not int or v <= 2),
               "align": json_values.filter(lambda v: not (type(v) is int and v > 0
                                                          and not v & (v - 1) and v < 2 ** 63)),
               "branch": json_values.filter(lambda v: not (v is None or type(v) in (int, str))
                                            or type(v) is int),
               "alias_offset": json_values.filter(lambda v: not (type(v) is int and v == 0))}
        entry[key] = draw(bad[key])
        if key == "branch" and type(entry[key]) is int:
            doc["tensors"][0]["branch"], doc["tensors"][1]["branch"] = entry[key], "s"
    elif kind == "bytes":
        return "{" + draw(st.text(string.printable, max_size=40))
    elif kind == "deep":
        d = draw(st.integers(MAX_DEPTH + 1, 5000))
        return "[" * d + "]" * d
    else:
        doc["branches"] = draw(json_values.filter(
            lambda v: v is not None and not (isinstance(v, list) and all(type(b) is str for b in v)
                                             and "x" in v)))
    return json.dumps(doc)


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _one_line_2(code: int, out: str, err: str, what: object) -> None:
    assert code == 2, (what, err)
    assert out == "", what
    assert err.startswith("graphslot plan: error: ") and err.count("\n") == 1, (what, err)
    assert "Traceback" not in err


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(malformed_docs())
def test_malformed_plan_files_exit_2_with_one_line(tmp_path, text):
    path = _file(tmp_path, text)
    code, out, err = _main([path, "--json"])
    _one_line_2(code, out, err, text)
    assert path in err


flags = st.sampled_from(["--json", "--png", "--bogus", "-x", "--json=1", "--png=out.xyz",
                         "extra", "--", "-"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(flags, max_size=4), st.booleans())
def test_random_argument_lists_exit_2_with_one_line(tmp_path, argv, file_first):
    # Either no plan file exists at the given path, or some flag is wrong: always bad.
    bad = str(tmp_path / "absent.json")
    args = ([bad] + argv) if file_first else (argv + [bad])
    if "-" in args:
        args = [a for a in args if a != "-"]
    # (without matplotlib, --png is refused first, with 1: run() says so)
    assume(_HAS_MATPLOTLIB or not any(a.startswith("--png") for a in args))
    _one_line_2(*_main(args), args)
