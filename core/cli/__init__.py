"""The ``graphslot`` command: ``info | demo | bench | plan``, each with ``--json``.

Bad input never ends in a traceback: a malformed argument, an out-of-range number, a bad
environment variable or any other :class:`~graphslot.errors.GraphslotError` is one line
on stderr, ``graphslot <command>: error: <message>``, and exit status 2. An interrupt
(Ctrl-C) is one line and exit status 130. Subcommands take their numeric arguments with
:func:`positive_int` or :func:`int_range`, so a bad number is an argparse error naming
the argument.

The commands import the adapters and the library; nothing in graphslot imports them
(import-linter contract ``layers``), and ``import graphslot`` loads none of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NoReturn

from ..errors import GraphslotError
from ..sizes import format_bytes

__all__ = ["main", "build_parser", "positive_int", "int_range", "one_line"]


def one_line(text: str) -> str:
    """``text`` on one line: its lines (any line break ``str.splitlines`` knows) joined by
    one space, each stripped of the whitespace around the break."""
    lines = text.splitlines()
    if lines == [text] or not text:
        return text
    return " ".join(part.strip() for part in lines if part.strip())


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a decimal integer from ``lo`` to ``hi`` (inclusive; no upper
    bound when ``hi`` is None). Anything else is an argparse error that argparse prefixes
    with the argument's name, e.g. ``argument --steps: must be a positive integer, got '0'``."""
    if hi is not None and hi < lo:
        raise ValueError(f"int_range: empty range [{lo}, {hi}]")
    want = ("a positive integer" if lo == 1 and hi is None else
            f"an integer of at least {lo}" if hi is None else f"an integer from {lo} to {hi}")

    def parse(text: str) -> int:
        try:
            n = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return n

    parse.__name__ = "positive_int" if lo == 1 and hi is None else f"int_{lo}_to_{hi}"
    return parse


#: An argparse ``type``: a decimal integer of at least 1 (``--steps 0`` is an argparse
#: error naming ``--steps``). For an upper bound as well, use :func:`int_range`.
positive_int: Callable[[str], int] = int_range(1)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and exit status 2:
    ``graphslot demo: error: argument --steps: must be a positive integer, got '0'``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _info(args: argparse.Namespace) -> int:
    from ..selection import get_backend, selection_reason

    b = get_backend(args.backend)
    info = {"backend": b.name, "reason": selection_reason(b), **b.info()}
    info["ledger"] = b.ledger.snapshot()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"backend        {info['backend']}  ({info['reason']})")
    print(f"device         {info['device']}")
    print(f"VMM supported  {info['vmm_supported']}")
    print(f"granularity    {format_bytes(info['granularity'])}")
    print(f"driver memory  {format_bytes(info['free_bytes'])} free of {format_bytes(info['total_bytes'])}")
    for k, v in info["versions"].items():
        print(f"{k:<14} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphslot", description=(
        "Fixed virtual addresses for device graphs whose memory moves."))
    p.add_argument("--backend", default=None,
                   help="auto | cpu | cuda | musa (default: $GRAPHSLOT_BACKEND or auto)")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="the chosen backend, device, granularity, memory, versions")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_info)

    from . import bench, demo, plan

    for module in (demo, bench, plan):
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphslot`` console script; ``argv`` defaults to ``sys.argv[1:]``.

    Returns the exit status instead of raising ``SystemExit``: 0 on success (and for
    ``--help``), 1 where a subcommand reports a failed check (e.g. ``demo --strict``),
    2 for bad input (one line on stderr naming the argument or what was wrong), 130 on
    an interrupt; 0 where the reader of its output stopped reading (``| head``).
    """
    import logging

    logging.basicConfig(level=logging.WARNING, format="graphslot: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    # A negative size after its option ("--budgets -1G") reads to argparse as an option
    # of its own: joined to its option, the size's check names what is wrong with it.
    for i in range(len(argv) - 1):
        if argv[i] == "--budgets" and argv[i + 1][:2] in {f"-{d}" for d in "0123456789."}:
            argv[i:i + 2] = [f"--budgets={argv[i + 1]}"]
            break
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # (named by the command they were given to, as its other errors are)
            command = str(getattr(args, "command", ""))
            subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            (subs.choices.get(command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse already printed the help or the one-line error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    where = f"graphslot {args.command}"
    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # (here, where a reader gone away is caught, not at exit)
        return rc
    except GraphslotError as e:
        print(f"{where}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader stopped reading (``| head``): what it took was written; say nothing
        # more, and let the interpreter's last flush of stdout go nowhere (where stdout
        # is a file descriptor at all: not in a notebook or a test's capture).
        import os

        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):
            return 0
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        return 0
