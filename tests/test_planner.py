"""The slot planner: placement, lower bound, verify, the seven-field slot plan, the CLI.

Pure Python: no backend is needed, so nothing here is skipped on any machine. Plans are
checked against brute-force references written independently of the planner.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from itertools import combinations
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphslot.errors import UsageError
from graphslot.cli.plan import add_parser, run
from graphslot.planner import (
    Plan,
    PlanError,
    SlotPlanEntry,
    TensorSpec,
    export_slot_plan,
    import_slot_plan,
    lower_bound,
    plan,
    verify,
)

T = TensorSpec
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- references


def _conflict(a: TensorSpec, b: TensorSpec) -> bool:
    """Would a and b collide if their bytes overlapped? (Independent of the planner.)"""
    if not (a.start < b.end and b.start < a.end):
        return False
    if a.branch is not None and b.branch is not None and a.branch != b.branch:
        return False
    return a.alias_group is None or a.alias_group != b.alias_group


def ref_conflicts(tensors, offsets) -> set[frozenset[str]]:
    out = set()
    for a, b in combinations(tensors, 2):
        oa, ob = offsets[a.name], offsets[b.name]
        if _conflict(a, b) and oa < ob + b.size and ob < oa + a.size:
            out.add(frozenset((a.name, b.name)))
    return out


def ref_lower_bound(tensors) -> int:
    """Max over branches and steps of the bytes live, views of one group counted once."""
    branches = {t.branch for t in tensors} | {None}
    best = 0
    for br in branches:
        for step in {t.start for t in tensors}:
            live = [t for t in tensors if t.start <= step < t.end and t.branch in (None, br)]
            total = sum(t.size for t in live if t.alias_group is None)
            groups: dict = {}
            for t in live:
                if t.alias_group is not None:
                    groups.setdefault(t.alias_group, set()).update(
                        range(t.alias_offset, t.alias_offset + t.size))
            total += sum(len(b) for b in groups.values())
            best = max(best, total)
    return best


# --------------------------------------------------------------------------- strategies


@st.composite
def schedules(draw, max_tensors: int = 24, max_groups: int = 3):
    """Random valid tensor lists with branches, alignments and alias groups."""
    branch_ids = [None, None, "a", "b", 7]
    out: list[TensorSpec] = []
    for i in range(draw(st.integers(0, max_tensors))):
        start = draw(st.integers(0, 30))
        out.append(T(f"t{i}", draw(st.one_of(st.sampled_from([256, 1024, 4096]),
                                             st.integers(1, 5000))),
                     start, start + draw(st.integers(1, 15)),
                     align=draw(st.sampled_from([1, 16, 256, 512])),
                     branch=draw(st.sampled_from(branch_ids))))
    for g in range(draw(st.integers(0, max_groups))):
        branch = draw(st.sampled_from(branch_ids))
        for m in range(draw(st.integers(1, 4))):
            align = draw(st.sampled_from([1, 64, 256]))
            start = draw(st.integers(0, 30))
            # Offsets that are multiples of each member's align are always satisfiable.
            out.append(T(f"g{g}.{m}", draw(st.integers(1, 3000)), start,
                         start + draw(st.integers(1, 12)), align=align, branch=branch,
                         alias_group=f"G{g}", alias_offset=align * draw(st.integers(0, 8))))
    return draw(st.permutations(out))


# --------------------------------------------------------------------------- placement


def test_disjoint_lifetimes_share_bytes_and_half_open_ends_touch():
    p = plan([T("a", 1024, 0, 3), T("b", 1024, 3, 6), T("c", 512, 6, 7)])
    assert p.offsets == {"a": 0, "b": 0, "c": 0}
    assert p.arena_bytes == p.lower_bound_bytes == 1024
    assert p.efficiency == 1.0
    verify(p)


def test_overlapping_lifetimes_get_disjoint_bytes():
    p = plan([T("a", 1000, 0, 4), T("b", 2000, 2, 6), T("c", 300, 3, 5)])
    verify(p)
    spans = sorted((p.offsets[n], p.offsets[n] + s) for n, s in (("a", 1000), ("b", 2000), ("c", 300)))
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert p.lower_bound_bytes == 3300
    assert all(o % 256 == 0 for o in p.offsets.values())


def test_exclusive_branches_share_bytes_and_common_tensors_conflict_with_all():
    ts = [T("w", 4096, 0, 10), T("cp1", 8192, 0, 10, branch="cp1"),
          T("cp2", 4096, 0, 10, branch="cp2"), T("cp4", 2048, 0, 10, branch="cp4")]
    p = plan(ts, branches=["cp1", "cp2", "cp4"])
    verify(p)
    assert p.lower_bound_bytes == 4096 + 8192  # the biggest branch plus the common tensor
    assert p.arena_bytes == p.lower_bound_bytes
    w = p.offsets["w"]
    for name in ("cp1", "cp2", "cp4"):  # no branch may touch the common tensor
        assert p.offsets[name] >= w + 4096 or p.offsets[name] + 2048 <= w
    # All three alternatives start at the same bytes: they never run together.
    assert len({p.offsets[n] for n in ("cp1", "cp2", "cp4")}) == 1


def test_alias_group_keeps_relative_offsets_and_overlap():
    ts = [T("qkv", 3072, 0, 5, alias_group="g"),
          T("k", 1024, 1, 5, alias_group="g", alias_offset=1024),
          T("v", 1024, 2, 8, alias_group="g", alias_offset=2048),
          T("other", 4096, 0, 8)]
    p = plan(ts)
    verify(p)
    base = p.offsets["qkv"]
    assert p.offsets["k"] == base + 1024 and p.offsets["v"] == base + 2048
    assert p.lower_bound_bytes == 3072 + 4096  # the views count once
    assert p.arena_bytes == p.lower_bound_bytes


def test_alias_group_with_offset_phase_is_aligned():
    # base + 128 must be 256-aligned, so the group base itself is at 128 mod 256.
    ts = [T("x", 128, 0, 2, align=128, alias_group="g"),
          T("y", 256, 0, 2, align=256, alias_group="g", alias_offset=128),
          T("z", 512, 0, 2)]
    p = plan(ts)
    verify(p)
    assert p.offsets["y"] % 256 == 0 and p.offsets["y"] - p.offsets["x"] == 128


def test_alias_group_lifetime_is_the_union_of_members():
    # The group is idle over [2, 5): another tensor may use its bytes there.
    ts = [T("a", 1024, 0, 2, alias_group="g"), T("b", 1024, 5, 7, alias_group="g"),
          T("mid", 1024, 2, 5)]
    p = plan(ts)
    verify(p)
    assert p.arena_bytes == p.lower_bound_bytes == 1024


def test_plan_is_deterministic_and_keeps_input_order():
    ts = [T(f"t{i}", 256 * (1 + i % 5), i % 7, i % 7 + 3, branch=("a", "b", None)[i % 3])
          for i in range(60)]
    p1, p2 = plan(ts), plan(list(ts))
    assert p1 == p2
    assert list(p1.offsets) == [t.name for t in ts]
    assert p1.tensors == tuple(ts)


def test_empty_plan():
    p = plan([])
    assert (p.arena_bytes, p.lower_bound_bytes, p.offsets, p.efficiency) == (0, 0, {}, 1.0)
    verify(p)


def test_lower_bound_counts_common_tensors_in_every_branch():
    ts = [T("c", 100, 0, 4), T("a1", 50, 0, 2, branch="a"), T("a2", 70, 1, 3, branch="a"),
          T("b1", 200, 3, 5, branch="b")]
    assert lower_bound(ts) == max(100 + 50 + 70, 100 + 200) == 300


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_planner", REPO / "benchmarks" / "bench_planner.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_planner"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seq", [(4096,), (8192, 4096, 2048)])
def test_interleaved_pipeline_schedules_pack_within_five_percent(seq):
    bench = _load_bench()
    case = bench.Case("t", pp=4, vpp=2, microbatches=8, layers_per_chunk=2, hidden=1024, seq=seq)
    ts = bench.tensors_for(case)
    p = plan(ts)
    verify(p)
    assert p.lower_bound_bytes <= p.arena_bytes <= 1.05 * p.lower_bound_bytes


@pytest.mark.parametrize("seed", [11, 52])
def test_hardest_cp_family_seeds_reach_one_percent(seed):
    # The two of seeds 0-55 that ended above 1.01 x the lower bound (1.0107 and 1.0143)
    # before the refinement got a larger budget and more patience.
    bench = _load_bench()
    p = plan(bench.family_tensors(bench.family_case(seed)))
    verify(p)
    assert p.arena_bytes <= 1.01 * p.lower_bound_bytes


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kw, words", [
    (dict(size=0), "size must be a positive integer"),
    (dict(size=-5), "size must be a positive integer"),
    (dict(size=1.5), "size must be a positive integer"),
    (dict(size=True), "size must be a positive integer"),
    (dict(start=3, end=3), "lifetime [3, 3) is empty"),
    (dict(start=4, end=2), "lifetime [4, 2) is empty"),
    (dict(align=3), "align must be a power of two"),
    (dict(align=0), "align must be a power of two"),
    (dict(alias_group="g", alias_offset=-1), "alias_offset must be a non-negative integer"),
    (dict(alias_offset=256), "needs an alias_group"),
    (dict(branch=["unhashable"]), "branch must be hashable"),
])
def test_bad_tensor_specs_are_rejected_naming_the_tensor(kw, words):
    args = dict(name="bad", size=256, start=0, end=1)
    args.update(kw)
    with pytest.raises(PlanError) as e:
        T(**args)
    assert "'bad'" in str(e.value) and words in str(e.value)
    assert isinstance(e.value, UsageError)


def test_duplicate_names_are_rejected():
    with pytest.raises(PlanError, match=r"tensors\[2\] 'x': duplicate name \(also tensors\[0\]\)"):
        plan([T("x", 1, 0, 1), T("y", 1, 0, 1), T("x", 2, 3, 4)])


def test_unknown_branch_is_rejected_when_branches_are_given():
    with pytest.raises(PlanError, match=r"tensors\[1\] 'b': unknown branch 'cp3'"):
        plan([T("a", 1, 0, 1, branch="cp1"), T("b", 1, 0, 1, branch="cp3")], branches=["cp1", "cp2"])
    plan([T("a", 1, 0, 1, branch="cp3")])  # without a branch list any id goes


def test_alias_group_spanning_branches_is_rejected():
    with pytest.raises(PlanError, match=r"alias group 'g': 'a' is in branch 1 but 'b' is in branch 2"):
        plan([T("a", 1, 0, 1, branch=1, alias_group="g"), T("b", 1, 0, 1, branch=2, alias_group="g")])


def test_alias_group_that_cannot_be_aligned_is_rejected_naming_both_members():
    with pytest.raises(PlanError, match=r"alias group 'g'.*'b'.*'a'.*cannot both be aligned"):
        plan([T("a", 256, 0, 1, alias_group="g"),
              T("b", 256, 0, 1, alias_group="g", alias_offset=128)])


def test_non_tensorspec_entries_are_rejected():
    with pytest.raises(PlanError, match=r"tensors\[0\] is a dict"):
        plan([{"name": "a"}])


# --------------------------------------------------------------------------- verify


def _plan(ts, offsets, arena=None):
    top = max((offsets[t.name] + t.size for t in ts), default=0)
    return Plan(top if arena is None else arena, offsets, lower_bound(ts), tuple(ts))


def test_verify_rejects_overlap_naming_both_tensors_and_the_step():
    ts = [T("act", 1024, 0, 4), T("grad", 1024, 3, 6)]
    with pytest.raises(PlanError, match=r"tensors 'act' and 'grad' overlap: both use bytes "
                                        r"\[512, 1024\) and both are live at step 3"):
        verify(_plan(ts, {"act": 0, "grad": 512}))
    verify(_plan(ts, {"act": 0, "grad": 1024}))


def test_verify_rejects_common_tensor_overlapping_any_branch():
    ts = [T("w", 512, 0, 9), T("x", 512, 0, 1, branch="b"), T("y", 512, 5, 6, branch="c")]
    verify(_plan(ts, {"w": 0, "x": 512, "y": 512}))
    with pytest.raises(PlanError, match=r"tensors 'w' and 'y' overlap.*step 5 \(branches None and 'c'\)"):
        verify(_plan(ts, {"w": 0, "x": 512, "y": 256}))


def test_verify_rejects_same_branch_overlap_but_not_across_branches():
    ts = [T("a", 512, 0, 4, branch=1), T("b", 512, 0, 4, branch=2), T("c", 512, 2, 3, branch=1)]
    verify(_plan(ts, {"a": 0, "b": 0, "c": 512}))
    with pytest.raises(PlanError, match=r"tensors 'a' and 'c' overlap"):
        verify(_plan(ts, {"a": 0, "b": 0, "c": 256}))


def test_verify_finds_a_conflict_hidden_behind_a_nested_view():
    # 'big' reaches past 'y', but the nearest entry below 'y' is the nested view 'small'.
    ts = [T("big", 4096, 0, 4, alias_group="g"),
          T("small", 256, 0, 4, alias_group="g", alias_offset=1024), T("y", 256, 1, 2)]
    with pytest.raises(PlanError, match=r"tensors 'big' and 'y' overlap"):
        verify(_plan(ts, {"big": 0, "small": 1024, "y": 2048}))


def test_verify_rejects_misaligned_missing_extra_and_out_of_arena_offsets():
    ts = [T("a", 512, 0, 2), T("b", 512, 0, 2)]
    with pytest.raises(PlanError, match=r"'b': offset 600 is not a multiple of its align 256"):
        verify(_plan(ts, {"a": 0, "b": 600}))
    with pytest.raises(PlanError, match=r"tensor 'b' has no offset"):
        verify(Plan(1024, {"a": 0}, 1024, tuple(ts)))
    with pytest.raises(PlanError, match=r"does not have: \['c'\]"):
        verify(Plan(1024, {"a": 0, "b": 512, "c": 0}, 1024, tuple(ts)))
    with pytest.raises(PlanError, match=r"'b': bytes \[512, 1024\) run past the arena of 1000"):
        verify(_plan(ts, {"a": 0, "b": 512}, arena=1000))
    with pytest.raises(PlanError, match=r"'a': offset must be a non-negative integer"):
        verify(_plan(ts, {"a": -256, "b": 512}, arena=1024))


def test_verify_rejects_broken_alias_offsets_naming_both_views():
    ts = [T("q", 256, 0, 2, alias_group="qkv"), T("k", 256, 0, 2, alias_group="qkv", alias_offset=256)]
    verify(_plan(ts, {"q": 0, "k": 256}))
    with pytest.raises(PlanError, match=r"alias group 'qkv': 'q' and 'k' do not keep their alias offsets"):
        verify(_plan(ts, {"q": 0, "k": 512}))


# --------------------------------------------------------------------------- properties


# 1,000 here, with the 1,500 placements below and the 2,300 schedules of
# test_planner_baselines.py: thousands in all, in about a minute of CI.
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_every_plan_verifies_and_respects_the_lower_bound(ts):
    p = plan(ts)
    verify(p)
    assert ref_conflicts(ts, p.offsets) == set()  # an independent check of verify too
    assert p.lower_bound_bytes == ref_lower_bound(ts)
    assert p.arena_bytes >= p.lower_bound_bytes
    assert p.arena_bytes == max((p.offsets[t.name] + t.size for t in ts), default=0)
    for t in ts:
        assert p.offsets[t.name] % t.align == 0


@st.composite
def placements(draw):
    """Crowded tensors at arbitrary aligned offsets (alias offsets kept): often invalid.

    Coarse offsets, short schedules and nested views make every kind of overlap common,
    including a view that reaches past a smaller view of its own group.
    """
    ts: list[TensorSpec] = []
    offsets: dict[str, int] = {}
    branch = st.sampled_from([None, "a", "b"])
    for i in range(draw(st.integers(0, 8))):
        start = draw(st.integers(0, 5))
        align = draw(st.sampled_from([1, 128, 256]))
        ts.append(T(f"t{i}", draw(st.integers(1, 2048)), start, start + draw(st.integers(1, 6)),
                    align=align, branch=draw(branch)))
        offsets[ts[-1].name] = align * draw(st.integers(0, 3072 // align))
    for g in range(draw(st.integers(0, 2))):
        b, base = draw(branch), 256 * draw(st.integers(0, 8))
        for m in range(draw(st.integers(1, 5))):
            start = draw(st.integers(0, 3))
            ts.append(T(f"g{g}.{m}", draw(st.sampled_from([100, 256, 1024, 2048])), start,
                        start + draw(st.integers(1, 6)), branch=b, alias_group=f"G{g}",
                        alias_offset=256 * draw(st.integers(0, 3))))
            offsets[ts[-1].name] = base + ts[-1].alias_offset
    return draw(st.permutations(ts)), offsets


@settings(max_examples=1500, deadline=None)
@given(placements())
def test_verify_agrees_with_brute_force(case):
    ts, offsets = case
    expected = ref_conflicts(ts, offsets)
    p = _plan(ts, offsets)
    if not expected:
        verify(p)
        return
    with pytest.raises(PlanError) as e:
        verify(p)
    m = re.match(r"tensors '(.+?)' and '(.+?)' overlap", str(e.value))
    assert m, str(e.value)
    assert frozenset(m.groups()) in expected


# --------------------------------------------------------------------------- slot plans


def _slot_case():
    ts = [T("w.grad", 4096, 4, 10), T("in", 1024, 0, 2, branch="cp2"),
          T("in4", 512, 0, 2, branch="cp4"),
          T("q", 256, 1, 6, branch="cp2", alias_group="qkv"),
          T("k", 256, 1, 6, branch="cp2", alias_group="qkv", alias_offset=256),
          T("lse", 100, 1, 6, align=4, branch="cp4")]
    return ts, plan(ts)


def test_export_fills_the_seven_fields_as_documented():
    ts, p = _slot_case()
    origin = {"q": (1, 3), "k": (1, 3)}
    entries = export_slot_plan(p, arena_id=5, user_grads={"w.grad"}, origin=origin)
    assert all(isinstance(e, SlotPlanEntry) and len(e) == 7 for e in entries)
    by = dict(zip((t.name for t in ts), entries))
    unit = 4  # the smallest align
    for t in ts:
        assert by[t.name].physical_slot * unit == p.offsets[t.name]
    assert by["w.grad"].user_grad_arena_id == 5 and by["w.grad"].saved_arena_id == -1
    assert by["in"].saved_arena_id == 5 and by["in"].user_grad_arena_id == -1
    assert [by[n].io_branch_id for n in ("w.grad", "in", "in4", "q", "lse")] == [-1, 0, 1, 0, 1]
    assert (by["q"].warmup_alias_group, by["k"].warmup_alias_group, by["in"].warmup_alias_group) == (0, 0, -1)
    assert (by["q"].model_chunk, by["q"].layer) == (1, 3)
    assert (by["in"].model_chunk, by["in"].layer) == (-1, -1)
    called = export_slot_plan(p, origin=lambda t: (len(t.name), 0))
    assert called[0].model_chunk == len("w.grad")


def test_slot_plan_round_trip():
    ts, p = _slot_case()
    for kw in ({}, {"slot_bytes": 4, "branches": ["cp4", "cp2", "unused"]}):
        entries = export_slot_plan(p, arena_id=2, user_grads=["w.grad"], **kw)
        back = import_slot_plan(entries, ts, **kw)
        assert back == p
        assert export_slot_plan(back, arena_id=2, user_grads=["w.grad"], **kw) == entries
    # Plain tuples from a wire format work as well.
    entries = [tuple(e) for e in export_slot_plan(p)]
    assert import_slot_plan(entries, ts).offsets == p.offsets


@settings(max_examples=300, deadline=None)
@given(schedules(max_tensors=12))
def test_slot_plan_round_trip_property(ts):
    p = plan(ts)
    assert import_slot_plan(export_slot_plan(p, arena_id=1), ts) == p


def test_import_rejects_inconsistent_entries_naming_the_entry():
    ts, p = _slot_case()
    entries = export_slot_plan(p, user_grads=["w.grad"])
    bad = list(entries)
    bad[1] = bad[1]._replace(saved_arena_id=3)
    with pytest.raises(PlanError, match=r"entry 1 \('in'\): arena 3 differs from arena 0"):
        import_slot_plan(bad, ts)
    bad = list(entries)
    bad[2] = bad[2]._replace(io_branch_id=0)
    with pytest.raises(PlanError, match=r"entry 2 \('in4'\): io_branch_id 0 but .* 'cp4' has index 1"):
        import_slot_plan(bad, ts)
    bad = list(entries)
    bad[0] = bad[0]._replace(saved_arena_id=0)
    with pytest.raises(PlanError, match=r"entry 0 \('w.grad'\): exactly one of"):
        import_slot_plan(bad, ts)
    bad = list(entries)
    bad[4] = bad[4]._replace(warmup_alias_group=-1)
    with pytest.raises(PlanError, match=r"entry 4 \('k'\): warmup_alias_group -1"):
        import_slot_plan(bad, ts)
    with pytest.raises(PlanError, match=r"5 slot plan entries for 6 tensors"):
        import_slot_plan(entries[:5], ts)
    with pytest.raises(PlanError, match=r"expected seven integers"):
        import_slot_plan([(0, 1, 2)] + list(entries[1:]), ts)
    # The entries decide the offsets, and the result must verify. Here w.grad, in and
    # in4 share slot 0 (disjoint lifetimes or exclusive branches), q/k and lse share
    # slot 1024 (exclusive branches).
    assert [e.physical_slot for e in entries] == [0, 0, 0, 1024, 1088, 1024]
    bad = list(entries)
    bad[5] = bad[5]._replace(physical_slot=0)  # lse [1, 6) under in4 [0, 2), both cp4
    with pytest.raises(PlanError, match=r"tensors 'in4' and 'lse' overlap: both use bytes "
                                        r"\[0, 100\) and both are live at step 1"):
        import_slot_plan(bad, ts)
    bad[5] = bad[5]._replace(physical_slot=128)  # past in4, inside w.grad [4, 10) at step 4
    with pytest.raises(PlanError, match=r"tensors 'lse' and 'w.grad' overlap.*step 4 "
                                        r"\(branches 'cp4' and None\)"):
        import_slot_plan(bad, ts)
    bad[5] = bad[5]._replace(physical_slot=1152)  # above everything: valid, a bigger arena
    moved = import_slot_plan(bad, ts)
    assert moved.offsets["lse"] == 4608 and moved.arena_bytes == 4708


def test_export_rejects_slot_bytes_that_do_not_divide_offsets():
    ts, p = _slot_case()
    with pytest.raises(PlanError, match=r"is not a multiple of slot_bytes 1000"):
        export_slot_plan(p, slot_bytes=1000)
    with pytest.raises(PlanError, match=r"user_grads names tensors that the plan does not have"):
        export_slot_plan(p, user_grads=["nope"])


# --------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="graphslot")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.func is run
    return run(args)


def _write(tmp_path: Path, doc, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


DOC = {"tensors": [
    {"name": "w", "size": 4096, "start": 0, "end": 10},
    {"name": "a", "size": 1000, "start": 0, "end": 4, "branch": "cp1"},
    {"name": "b", "size": 2048, "start": 2, "end": 6, "branch": "cp1"},
    {"name": "c", "size": 512, "start": 0, "end": 6, "branch": "cp2"},
    {"name": "q", "size": 256, "start": 6, "end": 9, "alias_group": "qkv"},
    {"name": "k", "size": 256, "start": 6, "end": 9, "alias_group": "qkv", "alias_offset": 256,
     "align": 256},
]}


def test_cli_json_prints_exactly_one_object(tmp_path, capsys):
    assert _cli(["plan", _write(tmp_path, DOC), "--json"]) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert set(obj) == {"arena_bytes", "lower_bound_bytes", "efficiency", "offsets", "baselines"}
    assert obj["lower_bound_bytes"] == 4096 + 1000 + 2048
    assert set(obj["baselines"]) == {"first-fit", "greedy-by-size"}
    assert all(obj["arena_bytes"] <= b for b in obj["baselines"].values())
    assert obj["efficiency"] == pytest.approx(obj["lower_bound_bytes"] / obj["arena_bytes"])
    assert list(obj["offsets"]) == [t["name"] for t in DOC["tensors"]]
    ts = [T(**t) for t in DOC["tensors"]]
    p = Plan(obj["arena_bytes"], obj["offsets"], obj["lower_bound_bytes"], tuple(ts))
    verify(p)
    assert obj["offsets"]["k"] == obj["offsets"]["q"] + 256


def test_cli_human_output_has_table_bound_and_efficiency(tmp_path, capsys):
    assert _cli(["plan", _write(tmp_path, DOC)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^name\s+offset\s+size\s+end\s+steps\s+branch\s+alias$", out, re.M)
    assert re.search(r"^k\s+\d+\s+256\s+\d+\s+\[6, 9\)\s+-\s+qkv\+256$", out, re.M)
    assert re.search(r"^lower bound\s+7144 bytes", out, re.M)
    assert re.search(r"^efficiency\s+\d\.\d{4}$", out, re.M)
    assert re.search(r"^first-fit\s+\d+ bytes .*x the lower bound$", out, re.M)
    assert re.search(r"^greedy-by-size\s+\d+ bytes", out, re.M)


def test_cli_reads_stdin(monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(DOC)))
    assert _cli(["plan", "-", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lower_bound_bytes"] == 7144


@pytest.mark.parametrize("doc, words", [
    ([1, 2], "expected a JSON object with a 'tensors' list, got a list"),
    ({"tensor": []}, "unknown top-level key(s) ['tensor']"),
    ({"tensors": {}}, "'tensors' must be a list of objects"),
    ({"tensors": [5]}, "tensors[0]: expected an object, got 5"),
    ({"tensors": [{"name": "x", "size": 1, "start": 0}]}, "tensors[0] ('x'): missing 'end'"),
    ({"tensors": [{"name": "x", "size": "1", "start": 0, "end": 1}]},
     "tensors[0] ('x'): 'size' must be an integer, got \"1\""),
    ({"tensors": [{"name": "x", "size": 1, "start": 0, "end": 1, "sise": 2}]},
     "tensors[0] ('x'): unknown key(s) ['sise']"),
    ({"tensors": [{"name": "x", "size": 1, "start": 0, "end": 1},
                  {"name": "y", "size": 0, "start": 0, "end": 1}]},
     "tensors[1] ('y'): size must be a positive integer, got 0"),
    ({"tensors": [{"name": "x", "size": 1, "start": 2, "end": 1}]}, "tensors[0] ('x'): lifetime [2, 1) is empty"),
    ({"tensors": [{"name": "x", "size": 1, "start": 0, "end": 1, "branch": [1]}]},
     "tensors[0] ('x'): 'branch' must be a string, an integer or null"),
    ({"tensors": [{"name": "x", "size": 1, "start": 0, "end": 1, "align": 48}]},
     "tensors[0] ('x'): align must be a power of two, got 48"),
    ({"tensors": [{"name": "x", "size": 1, "start": 0, "end": 1},
                  {"name": "x", "size": 1, "start": 0, "end": 1}]}, "tensors[1] 'x': duplicate name"),
    ({"tensors": [{"name": "x", "size": 1, "start": 0, "end": 1, "branch": "cp3"}], "branches": ["cp1"]},
     "tensors[0] 'x': unknown branch 'cp3'"),
    ("{not json", "is not valid JSON"),
])
def test_cli_bad_files_exit_2_naming_the_entry(tmp_path, capsys, doc, words):
    path = _write(tmp_path, doc)
    assert _cli(["plan", path, "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.startswith("graphslot plan: error: ")
    assert words in cap.err
    assert path in cap.err


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert _cli(["plan", str(tmp_path / "absent.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_png_draws_a_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "arena.png"
    assert _cli(["plan", _write(tmp_path, DOC), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().out


def test_cli_png_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    png = tmp_path / "arena.png"
    assert _cli(["plan", _write(tmp_path, DOC), "--png", str(png)]) == 2  # (as bench --plot)
    cap = capsys.readouterr()
    assert "--png needs matplotlib" in cap.err and "graphslot[plot]" in cap.err
    assert cap.out == "" and not png.exists()


def test_cli_table_without_tabulate_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tabulate", None)  # import now raises ImportError
    assert _cli(["plan", _write(tmp_path, DOC)]) == 1
    cap = capsys.readouterr()
    assert "the plan table needs tabulate" in cap.err and "pip install tabulate tqdm" in cap.err
    assert "--json" in cap.err and cap.out == ""
    assert _cli(["plan", _write(tmp_path, DOC), "--json"]) == 0  # JSON needs nothing more


def test_graphslot_main_dispatches_plan(tmp_path, capsys):
    from graphslot.cli import main

    assert main(["plan", _write(tmp_path, DOC), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lower_bound_bytes"] == 7144
