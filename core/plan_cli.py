"""``graphslot plan FILE.json [--json] [--png FILE]``: plan an arena from a tensor list.

The file holds one JSON object::

    {"tensors": [{"name": "x", "size": 1048576, "start": 0, "end": 4,
                  "align": 256, "branch": "cp2", "alias_group": "qkv", "alias_offset": 0},
                 ...],
     "branches": ["cp1", "cp2"]}

``name``, ``size``, ``start`` and ``end`` are required; the other tensor keys are
optional (see :class:`graphslot.planner.TensorSpec`); ``branches`` is optional and, when
present, lists every valid branch id. ``-`` reads standard input. A malformed file is an
error that names the entry, on stderr, with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from .planner import Plan, PlanError, TensorSpec, plan

__all__ = ["add_parser", "run", "load_tensors"]

_REQUIRED = ("name", "size", "start", "end")
_OPTIONAL = ("align", "branch", "alias_group", "alias_offset")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse ``subparsers``; it runs :func:`run`."""
    p = subparsers.add_parser(
        "plan", help="pack tensors with known lifetimes into one fixed arena",
        description="Plan byte offsets for tensors with known lifetimes in one arena, "
                    "and print the plan, the lower bound and the efficiency.")
    p.add_argument("file", metavar="FILE.json", help='the tensor list ("-" for stdin)')
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: arena_bytes, lower_bound_bytes, "
                        "efficiency, offsets")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="also draw the arena, offset against step (needs matplotlib)")
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"graphslot plan: error: {msg}", file=sys.stderr)
    return 2


def _int(entry: dict[str, Any], key: str, where: str) -> int:
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(f"{where}: {key!r} must be an integer, got {json.dumps(v)}")
    return v


def _id(entry: dict[str, Any], key: str, where: str) -> str | int | None:
    v = entry.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
        raise PlanError(f"{where}: {key!r} must be a string, an integer or null, "
                        f"got {json.dumps(v)}")
    return v


def load_tensors(doc: Any, source: str = "input") -> tuple[list[TensorSpec], list[Any] | None]:
    """The tensors and branch list of a parsed plan file; :class:`PlanError` names the
    first bad entry as ``SOURCE: tensors[K] ('NAME')``."""
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: expected a JSON object with a 'tensors' list, "
                        f"got a {type(doc).__name__}")
    unknown = sorted(set(doc) - {"tensors", "branches"})
    if unknown:
        raise PlanError(f"{source}: unknown top-level key(s) {unknown}; "
                        f"expected 'tensors' and optionally 'branches'")
    items = doc.get("tensors")
    if not isinstance(items, list):
        raise PlanError(f"{source}: 'tensors' must be a list of objects")
    branches = doc.get("branches")
    if branches is not None:
        if not isinstance(branches, list) or not all(
                isinstance(b, (str, int)) and not isinstance(b, bool) for b in branches):
            raise PlanError(f"{source}: 'branches' must be a list of strings or integers")
    out = []
    for k, entry in enumerate(items):
        where = f"{source}: tensors[{k}]"
        if not isinstance(entry, dict):
            raise PlanError(f"{where}: expected an object, got {json.dumps(entry)}")
        if isinstance(entry.get("name"), str):
            where += f" ({entry['name']!r})"
        missing = [key for key in _REQUIRED if key not in entry]
        if missing:
            raise PlanError(f"{where}: missing {', '.join(map(repr, missing))}")
        extra = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
        if extra:
            raise PlanError(f"{where}: unknown key(s) {extra}; allowed: "
                            f"{', '.join(_REQUIRED + _OPTIONAL)}")
        if not isinstance(entry["name"], str):
            raise PlanError(f"{where}: 'name' must be a string, got {json.dumps(entry['name'])}")
        kw: dict[str, Any] = {key: _int(entry, key, where) for key in ("size", "start", "end")}
        for key in ("align", "alias_offset"):
            if key in entry:
                kw[key] = _int(entry, key, where)
        try:
            out.append(TensorSpec(entry["name"], branch=_id(entry, "branch", where),
                                  alias_group=_id(entry, "alias_group", where), **kw))
        except PlanError as e:
            msg = str(e)
            own = f"tensor {entry['name']!r}: "
            raise PlanError(f"{where}: {msg[len(own):] if msg.startswith(own) else msg}") from None
    return out, branches


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _print_table(p: Plan) -> None:
    rows = [(t.name, str(p.offsets[t.name]), str(t.size), str(p.offsets[t.name] + t.size),
             f"[{t.start}, {t.end})", "-" if t.branch is None else str(t.branch),
             "-" if t.alias_group is None else f"{t.alias_group}+{t.alias_offset}")
            for t in sorted(p.tensors, key=lambda t: (p.offsets[t.name], t.start, t.name))]
    head = ("name", "offset", "size", "end", "steps", "branch", "alias")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    right = {1, 2, 3}
    for r in [head] + rows:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    print()
    print(f"arena         {p.arena_bytes} bytes ({_human(p.arena_bytes)})")
    print(f"lower bound   {p.lower_bound_bytes} bytes ({_human(p.lower_bound_bytes)})")
    print(f"efficiency    {p.efficiency:.4f}")


def _draw(p: Plan, path: str) -> None:
    # The object API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    unit, scale = next(((u, s) for u, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                        if p.arena_bytes >= 4 * s), ("bytes", 1))
    fig = Figure(figsize=(10, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    keys: list[str | None] = [None] + sorted({str(t.branch) for t in p.tensors
                                              if t.branch is not None})
    boxes: dict[str | None, list[list[tuple[float, float]]]] = {k: [] for k in keys}
    for t in p.tensors:
        lo, hi = p.offsets[t.name] / scale, (p.offsets[t.name] + t.size) / scale
        boxes[None if t.branch is None else str(t.branch)].append(
            [(t.start, lo), (t.end, lo), (t.end, hi), (t.start, hi)])
    # One collection per branch draws thousands of tensors quickly; edges only while
    # they stay visible. Branches share bytes by design, so they are translucent.
    edge = 0.3 if len(p.tensors) <= 500 else 0.0
    handles: list[Any] = []
    for k, key in enumerate(keys):
        if not boxes[key]:
            continue
        color, alpha = ("0.6", 0.8) if key is None else (f"C{(k - 1) % 10}", 0.5)
        ax.add_collection(PolyCollection(boxes[key], facecolors=color, edgecolors="black",
                                         linewidths=edge, alpha=alpha))
        handles.append(Patch(facecolor=color, alpha=alpha,
                             label="common" if key is None else f"branch {key}"))
    ax.set_xlim(min((t.start for t in p.tensors), default=0),
                max((t.end for t in p.tensors), default=1))
    ax.set_ylim(0, max(p.arena_bytes / scale, 1e-9))
    handles.append(ax.axhline(p.lower_bound_bytes / scale, color="red", linestyle="--",
                              linewidth=1, label=f"lower bound ({_human(p.lower_bound_bytes)})"))
    ax.set_xlabel("schedule step")
    ax.set_ylabel(f"arena offset ({unit})")
    ax.set_title(f"arena {_human(p.arena_bytes)}, efficiency {p.efficiency:.3f}")
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    """Run ``graphslot plan``; 0 on success, 2 for a bad file, 1 when --png cannot draw."""
    if args.png is not None:
        try:  # fail before any output, not after planning
            importlib.import_module("matplotlib")
        except ImportError:
            print("graphslot plan: error: --png needs matplotlib, which is not installed; "
                  "install it with: pip install 'graphslot[plot]'", file=sys.stderr)
            return 1
    source = "<stdin>" if args.file == "-" else args.file
    try:
        if args.file == "-":
            doc = json.load(sys.stdin)
        else:
            with open(args.file, encoding="utf-8") as f:
                doc = json.load(f)
    except OSError as e:
        return _fail(f"cannot read {source}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _fail(f"{source} is not valid JSON: {e}")
    try:
        tensors, branches = load_tensors(doc, source)
        p = plan(tensors, branches=branches)
    except PlanError as e:
        msg = str(e)
        return _fail(msg if msg.startswith(source) else f"{source}: {msg}")
    if args.json:
        print(json.dumps({"arena_bytes": p.arena_bytes,
                          "lower_bound_bytes": p.lower_bound_bytes,
                          "efficiency": p.efficiency,
                          "offsets": p.offsets}))
    else:
        _print_table(p)
    if args.png is not None:
        try:
            _draw(p, args.png)
        except OSError as e:
            print(f"graphslot plan: error: cannot write {args.png}: {e.strerror or e}",
                  file=sys.stderr)
            return 1
        if not args.json:
            print(f"chart         {args.png}")
    return 0
