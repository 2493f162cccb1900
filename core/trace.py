"""A timeline of device work on several streams, from timing events, as a Chrome trace.

Spans are bracketed by timing events recorded on the stream that does the work, so the
times are the device's, not the host's. Read them (:meth:`Timeline.spans`) only after the
work finished (a synchronisation). The JSON opens in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from .backend import Backend

__all__ = ["Timeline", "Span"]


@dataclass(frozen=True)
class Span:
    track: str  #: "compute", "d2h", "h2d"
    name: str
    start_ms: float  #: from the timeline's start
    dur_ms: float
    nbytes: int = 0


class Timeline:
    """Collects spans of device work; see the module docstring."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._base: Any = None
        self._raw: list[tuple[str, str, Any, Any, int]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Mark time zero on the current stream and forget earlier spans."""
        b = self.backend
        self._raw.clear()
        self._base = b.record_event(b.new_event(timing=True))

    @contextmanager
    def span(self, track: str, name: str, stream: Any = None, nbytes: int = 0) -> Iterator[None]:
        """Bracket the work issued inside on ``stream`` (default: current)."""
        b = self.backend
        s = b.current_stream() if stream is None else stream
        a = b.record_event(b.new_event(timing=True), s)
        yield
        e = b.record_event(b.new_event(timing=True), s)
        with self._lock:
            self._raw.append((track, name, a, e, nbytes))

    def spans(self) -> list[Span]:
        """The recorded spans, in device milliseconds (the work must have finished)."""
        if self._base is None:
            return []
        b = self.backend
        out = []
        for track, name, a, e, n in self._raw:
            t0 = b.elapsed_ms(self._base, a)
            out.append(Span(track, name, t0, max(b.elapsed_ms(a, e), 0.0), n))
        return sorted(out, key=lambda s: s.start_ms)

    def busy(self, track: str) -> tuple[float, int]:
        """(milliseconds, bytes) of the spans on ``track``."""
        ss = [s for s in self.spans() if s.track == track]
        return sum(s.dur_ms for s in ss), sum(s.nbytes for s in ss)

    def chrome(self) -> dict[str, Any]:
        """The spans as a Chrome trace-event document."""
        tids = {"phase": 0, "compute": 1, "d2h": 2, "h2d": 3}
        ev: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": "phases" if track == "phase" else f"{track} stream"}}
            for track, tid in tids.items()]
        for s in self.spans():
            ev.append({"name": s.name, "ph": "X", "pid": 0, "tid": tids.get(s.track, 9),
                       "ts": s.start_ms * 1e3, "dur": s.dur_ms * 1e3,
                       "args": {"bytes": s.nbytes} if s.nbytes else {}})
        return {"traceEvents": ev, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome(), f)
