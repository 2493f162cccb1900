"""The caching allocator's recorded history, replayed (cuda only): what the memory census
scripts (``pool_census.py``, ``recompute_memory.py``, ``capture_memory.py``) share.

Record with ``torch.cuda.memory._record_memory_history`` on; take a snapshot before the
work (:func:`live_blocks`, :func:`trace_end`) and one after (:func:`events_since`), then
:func:`highest_live` replays the events in between.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

Live = dict[int, tuple[int, str]]  # block address -> (bytes, label)


def pool_of(segment: dict[str, Any]) -> str:
    """``"graph"`` for a segment of a graph's private pool, else ``"default"``."""
    return "graph" if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0) else "default"


def live_blocks(snap: dict[str, Any], label: Callable[[str, dict[str, Any]], str]) -> Live:
    """Every allocated block of ``snap``, labelled ``label(pool, block)``."""
    return {blk["address"]: (blk["size"], label(pool_of(seg), blk))
            for seg in snap["segments"] for blk in seg["blocks"]
            if blk["state"] == "active_allocated"}


def trace_end(snap: dict[str, Any]) -> int:
    """The time of ``snap``'s newest recorded event (0 with none)."""
    return max((e.get("time_us", 0) for e in (snap.get("device_traces") or [[]])[0]), default=0)


def events_since(snap: dict[str, Any], t0: int) -> list[dict[str, Any]]:
    """``snap``'s recorded events after time ``t0``."""
    return [e for e in (snap.get("device_traces") or [[]])[0] if e.get("time_us", 0) > t0]


def highest_live(live: Live, events: list[dict[str, Any]],
                 where: Callable[[list[dict[str, Any]] | None], str]) -> tuple[int, Live, int]:
    """Replay ``events`` over ``live`` (updated in place): the most bytes live at once,
    what was live then (each allocation labelled ``where(its frames)``), and the index of
    the event that reached it (-1: none went above the start)."""
    cur = sum(v[0] for v in live.values())
    best, at_best, best_i = cur, dict(live), -1
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames")))
            cur += ev["size"]
            if cur > best:
                best, at_best, best_i = cur, dict(live), i
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    return best, at_best, best_i


def by_label(live: Live, top: int, unit: int = 1 << 20) -> dict[str, float]:
    """The ``top`` labels holding the most of ``live``, in ``unit``s."""
    by: collections.Counter[str] = collections.Counter()
    for size, label in live.values():
        by[label] += size
    return {k: round(v / unit, 1) for k, v in by.most_common(top)}
