"""The ``graphslot`` command: ``info | demo | bench | plan``, each with ``--json``."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import GraphslotError

__all__ = ["main"]


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _info(args: argparse.Namespace) -> int:
    from .selection import get_backend, selection_reason

    b = get_backend(args.backend)
    info = {"backend": b.name, "reason": selection_reason(b), **b.info()}
    info["ledger"] = b.ledger.snapshot()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"backend        {info['backend']}  ({info['reason']})")
    print(f"device         {info['device']}")
    print(f"VMM supported  {info['vmm_supported']}")
    print(f"granularity    {_human_bytes(info['granularity'])}")
    print(f"driver memory  {_human_bytes(info['free_bytes'])} free of {_human_bytes(info['total_bytes'])}")
    for k, v in info["versions"].items():
        print(f"{k:<14} {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphslot", description=(
        "Fixed virtual addresses for device graphs whose memory moves."))
    p.add_argument("--backend", default=None,
                   help="auto | cpu | cuda | musa (default: $GRAPHSLOT_BACKEND or auto)")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="the chosen backend, device, granularity, memory, versions")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_info)

    from . import bench, demo, plan_cli

    for module in (demo, bench, plan_cli):
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphslot`` console script."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="graphslot: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except GraphslotError as e:
        print(f"graphslot {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
