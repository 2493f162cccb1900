"""``graphslot plan FILE.json [--json] [--png FILE]``: plan an arena from a tensor list.

The file holds one JSON object::

    {"tensors": [{"name": "x", "size": 1048576, "start": 0, "end": 4,
                  "align": 256, "branch": "cp2", "alias_group": "qkv", "alias_offset": 0},
                 ...],
     "branches": ["cp1", "cp2"]}

``name``, ``size``, ``start`` and ``end`` are required; the other tensor keys are
optional (see :class:`graphslot.planner.TensorSpec`); ``branches`` is optional and, when
present, lists every valid branch id (branch ids are all strings or all integers).
``-`` reads standard input. Files are at most :data:`MAX_FILE_BYTES`, nested at most
:data:`MAX_DEPTH` deep, and every integer fits in 63 bits. A malformed file or argument
is one line on stderr that names the entry or argument, with exit status 2; the output
also gives the arena of the textbook planners (:func:`graphslot.planner.baselines`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from typing import Any, NoReturn

from ..planner import Plan, PlanError, TensorSpec, baselines, plan
from ..sizes import format_bytes
from .output import missing, table, unwritable

__all__ = ["add_parser", "main", "run", "load_tensors", "MAX_FILE_BYTES", "MAX_DEPTH"]

_REQUIRED = ("name", "size", "start", "end")
_OPTIONAL = ("align", "branch", "alias_group", "alias_offset")


#: Plan files larger than this are refused (at most this many bytes plus one are read).
MAX_FILE_BYTES = 64 << 20
#: Arrays and objects nested deeper than this are refused (a plan file needs 3).
MAX_DEPTH = 16
#: Every integer of a plan file, and the arena, must fit in a signed 64-bit integer.
MAX_INT = (1 << 63) - 1


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line and exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"graphslot plan: error: {_line(message)}\n")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.json",
                   help=f'the tensor list ("-" for stdin); at most {MAX_FILE_BYTES >> 20} MiB, '
                        f"nested at most {MAX_DEPTH} deep, integers below 2**63")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: arena_bytes, lower_bound_bytes, "
                        "efficiency, offsets, baselines (the textbook planners' arena bytes)")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="also draw the arena, offset against step, to FILE (needs "
                        "matplotlib; the extension names the format: .png, .pdf, .svg, ...)")


_DESCRIPTION = ("Plan byte offsets for tensors with known lifetimes in one arena, and print "
                "the plan, the lower bound, the efficiency and what the textbook planners "
                "(first-fit, greedy by size) would need. A bad file or argument is one line "
                "on stderr and exit status 2.")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse ``subparsers``; it runs :func:`run`."""
    p = subparsers.add_parser(
        "plan", help="pack tensors with known lifetimes into one fixed arena",
        description=_DESCRIPTION)
    # The subparser's class is its parent's; its argument errors still are one line.
    p.error = _Parser.error.__get__(p)  # type: ignore[method-assign]
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    """``graphslot plan`` by itself: parse ``argv`` (the arguments after ``plan``) and run.
    Returns the exit status (2 for a bad argument or file) instead of raising."""
    p = _Parser(prog="graphslot plan", description=_DESCRIPTION)
    _add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2)
        return e.code if isinstance(e.code, int) else 2
    return run(args)


def _line(msg: str) -> str:
    """``msg`` as one printable line: control characters and unencodable ones escaped."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg))
    return out.encode("utf-8", "backslashreplace").decode("utf-8")


def _fail(msg: str) -> int:
    print(f"graphslot plan: error: {_line(msg)}", file=sys.stderr)
    return 2


def _int(entry: dict[str, Any], key: str, where: str) -> int:
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(f"{where}: {key!r} must be an integer, got {_short(v)}")
    if not -MAX_INT - 1 <= v <= MAX_INT:
        raise PlanError(f"{where}: {key!r} is {_short(v)}, which does not fit in 63 bits "
                        f"(limit {MAX_INT})")
    return v


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last, silently: a second
    ``"tensors"`` would replace the first)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise PlanError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


class _Ids:
    """Branch ids (or alias group ids) must be all strings or all integers: ``1`` and
    ``"1"`` in one file would silently be two ids."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.first: tuple[type, str] | None = None

    def check(self, v: Any, where: str) -> None:
        if v is None:
            return
        if self.first is None:
            self.first = (type(v), where)
        elif type(v) is not self.first[0]:
            kind = {str: "a string", int: "an integer"}
            raise PlanError(f"{where}: {self.what} {_short(v)} is {kind[type(v)]} but "
                            f"{self.first[1]} uses {kind[self.first[0]]}; {self.what} ids "
                            f"must all be strings or all integers")


def _id(entry: dict[str, Any], key: str, where: str) -> str | int | None:
    v = entry.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
        raise PlanError(f"{where}: {key!r} must be a string, an integer or null, "
                        f"got {_short(v)}")
    if isinstance(v, int) and not -MAX_INT - 1 <= v <= MAX_INT:
        raise PlanError(f"{where}: {key!r} is {_short(v)}, which does not fit in 63 bits")
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
    branch_ids, group_ids = _Ids("branch"), _Ids("alias group")
    if branches is not None:
        if not isinstance(branches, list) or not all(
                isinstance(b, (str, int)) and not isinstance(b, bool) for b in branches):
            raise PlanError(f"{source}: 'branches' must be a list of strings or integers")
        for k, b in enumerate(branches):
            branch_ids.check(b, f"{source}: branches[{k}]")
            if b in branches[:k]:
                raise PlanError(f"{source}: branches[{k}]: branch {_short(b)} is listed twice "
                                f"(first at branches[{branches.index(b)}])")
    out = []
    for k, entry in enumerate(items):
        where = f"{source}: tensors[{k}]"
        if not isinstance(entry, dict):
            raise PlanError(f"{where}: expected an object, got {_short(entry)}")
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
            raise PlanError(f"{where}: 'name' must be a string, got {_short(entry['name'])}")
        kw: dict[str, Any] = {key: _int(entry, key, where) for key in ("size", "start", "end")}
        for key in ("align", "alias_offset"):
            if key in entry:
                kw[key] = _int(entry, key, where)
        branch, group = _id(entry, "branch", where), _id(entry, "alias_group", where)
        branch_ids.check(branch, where)
        group_ids.check(group, where)
        try:
            out.append(TensorSpec(entry["name"], branch=branch, alias_group=group, **kw))
        except PlanError as e:
            msg = str(e)
            own = f"tensor {entry['name']!r}: "
            raise PlanError(f"{where}: {msg[len(own):] if msg.startswith(own) else msg}") from None
    return out, branches


def _print_table(p: Plan, base: dict[str, int]) -> None:
    rows = [(_line(t.name), p.offsets[t.name], t.size, p.offsets[t.name] + t.size,
             f"[{t.start}, {t.end})", "-" if t.branch is None else _line(str(t.branch)),
             "-" if t.alias_group is None else _line(f"{t.alias_group}+{t.alias_offset}"))
            for t in sorted(p.tensors, key=lambda t: (p.offsets[t.name], t.start, t.name))]
    print(table(rows, ("name", "offset", "size", "end", "steps", "branch", "alias"), "lrrrlll"))
    print()
    print(f"arena         {p.arena_bytes} bytes ({format_bytes(p.arena_bytes)})")
    print(f"lower bound   {p.lower_bound_bytes} bytes ({format_bytes(p.lower_bound_bytes)})")
    print(f"efficiency    {p.efficiency:.4f}")
    print("textbook planners, for comparison:")
    for name, arena in base.items():
        ratio = f", {arena / p.lower_bound_bytes:.4f} x the lower bound" if p.lower_bound_bytes else ""
        print(f"{name:<15} {arena} bytes ({format_bytes(arena)}){ratio}")


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
                              linewidth=1, label=f"lower bound ({format_bytes(p.lower_bound_bytes)})"))
    ax.set_xlabel("schedule step")
    ax.set_ylabel(f"arena offset ({unit})")
    ax.set_title(f"arena {format_bytes(p.arena_bytes)}, efficiency {p.efficiency:.3f}")
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    fig.savefig(path, dpi=120)


def _read(path: str) -> str:
    """The text of ``path`` (``-``: stdin), at most MAX_FILE_BYTES; PlanError otherwise."""
    limit = MAX_FILE_BYTES
    if path == "-":
        raw: bytes | str = (sys.stdin.buffer.read(limit + 1) if hasattr(sys.stdin, "buffer")
                            else sys.stdin.read(limit + 1))
    else:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    if len(raw) > limit:
        raise PlanError(f"larger than the limit of {limit} bytes ({limit >> 20} MiB) "
                        f"for a plan file")
    return raw.decode("utf-8") if isinstance(raw, bytes) else raw


_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _check_depth(text: str) -> None:
    """Refuse arrays and objects nested deeper than MAX_DEPTH, before parsing (the
    parser would recurse once per level)."""
    depth = 0
    for m in _NESTING.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise PlanError(f"nested more than {MAX_DEPTH} deep (the limit for a "
                                f"plan file) at character {m.start()}")
        elif c in "]}":
            depth -= 1


def _png_problem(path: str) -> str | None:
    """Why ``--png path`` cannot be written, or ``None``; checked before planning."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = sorted(FigureCanvasAgg.get_supported_filetypes())
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if os.path.isdir(path):
        return f"--png {path}: is a directory; give a file name such as {path}/arena.png"
    if ext not in kinds:
        return (f"--png {path}: unknown image format {ext!r}" if ext else
                f"--png {path}: no file extension") + f"; use one of: {', '.join(kinds)}"
    problem = unwritable(path)
    return f"--png {path}: {problem}" if problem else None


def run(args: argparse.Namespace) -> int:
    """Run ``graphslot plan``; 0 on success, 2 for a bad file or argument (``--png``
    without matplotlib included, as ``bench --plot``), 1 when the table's tabulate is
    missing or the drawing's write fails."""
    if args.png is not None:
        try:  # fail before any output, not after planning
            importlib.import_module("matplotlib")
        except ImportError:
            print("graphslot plan: error: --png needs matplotlib, which is not installed; "
                  "install it with: pip install 'graphslot[plot]'", file=sys.stderr)
            return 2
        problem = _png_problem(args.png)
        if problem:
            return _fail(problem)
    needed = None if args.json else missing("tabulate", "the plan table", "--json")
    if needed:
        print(f"graphslot plan: error: {needed}", file=sys.stderr)
        return 1
    source = "<stdin>" if args.file == "-" else args.file
    try:
        text = _read(args.file)
    except OSError as e:
        return _fail(f"cannot read {source}: {e.strerror or e}")
    except UnicodeDecodeError as e:
        return _fail(f"{source} is not valid JSON: {e}")
    except PlanError as e:
        return _fail(f"{source}: {e}")
    try:
        _check_depth(text)
        doc = json.loads(text, object_pairs_hook=_unique_keys)
    except PlanError as e:
        return _fail(f"{source}: {e}")
    except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits
        return _fail(f"{source} is not valid JSON: {e}")
    try:
        tensors, branches = load_tensors(doc, source)
        p = plan(tensors, branches=branches)
        if p.arena_bytes > MAX_INT:
            raise PlanError(f"the arena of {p.arena_bytes} bytes does not fit in 63 bits")
        base = {name: b.arena_bytes for name, b in baselines(tensors, branches=branches).items()}
    except PlanError as e:
        msg = str(e)
        return _fail(msg if msg.startswith(source) else f"{source}: {msg}")
    if args.json:
        print(json.dumps({"arena_bytes": p.arena_bytes,
                          "lower_bound_bytes": p.lower_bound_bytes,
                          "efficiency": p.efficiency,
                          "offsets": p.offsets,
                          "baselines": base}))
    else:
        _print_table(p, base)
    if args.png is not None:
        try:
            _draw(p, args.png)
        except (OSError, ValueError) as e:
            print(f"graphslot plan: error: cannot write {_line(args.png)}: "
                  f"{_line(getattr(e, 'strerror', None) or str(e))}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"chart         {_line(args.png)}")
    return 0
