"""Streams and events on host threads.

A :class:`CpuStream` is a worker thread draining a FIFO queue, so work queued on two
streams really runs concurrently and only events order it. The calling thread's own
stream (:data:`INLINE`) runs work immediately, in program order, like the device's
current stream does from the program's point of view.

Errors are sticky: once a task on a stream fails, later tasks on it are skipped and
every event recorded after the failure reports it, like a device error.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable

from graphslot.errors import StreamError

_tls = threading.local()


class _Fence:
    __slots__ = ("done", "error", "time")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.time = 0.0

    def signal(self, error: BaseException | None) -> None:
        self.error = error
        self.time = time.perf_counter()
        self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise StreamError(f"work queued before this event failed: {self.error!r}") from self.error


class CpuStream:
    """A FIFO of host work; ``inline`` streams run work at once on the caller's thread."""

    _count = 0

    def __init__(self, name: str | None = None, inline: bool = False) -> None:
        CpuStream._count += 1
        self.name = name or f"stream{CpuStream._count}"
        self.inline = inline
        self.error: BaseException | None = None
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        if not inline:
            ref = weakref.ref(self)
            # The thread holds only a weak reference so an unused stream can be collected.
            self._thread = threading.Thread(target=CpuStream._run, args=(ref, self._q),
                                            name=f"graphslot-{self.name}", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._q.put, None)

    @staticmethod
    def _run(ref: weakref.ref[CpuStream], q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            task = q.get()
            if task is None:
                return
            task()
            del task

    def _current_here(self) -> bool:
        return getattr(_tls, "stream", None) is self

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn``. Work for the caller's current stream runs now, after what is queued."""
        if self.inline or self._current_here():
            if not self.inline:
                self.drain()
            if self.error is not None:
                raise StreamError(f"{self.name} failed earlier: {self.error!r}")
            fn()
            return

        def task() -> None:
            if self.error is not None:
                return
            try:
                fn()
            except BaseException as e:  # sticky, reported through events
                self.error = e

        self._q.put(task)

    def fence(self) -> _Fence:
        """A fence that completes when everything queued so far has run."""
        f = _Fence()
        if self.inline or self._current_here():
            if not self.inline:
                self.drain()
            f.signal(self.error)
        else:
            self._q.put(lambda: f.signal(self.error))
        return f

    def wait_event(self, event: CpuEvent) -> None:
        """Make future work on this stream wait for ``event`` (torch's ``Stream.wait_event``)."""
        event.wait(self)

    def drain(self) -> None:
        """Block until everything queued so far has run (a host synchronisation)."""
        if self.inline:
            return
        f = _Fence()
        self._q.put(lambda: f.signal(self.error))
        f.wait()

    def __repr__(self) -> str:
        return f"<CpuStream {self.name}{' inline' if self.inline else ''}>"


#: The calling thread's own stream: work runs immediately.
INLINE = CpuStream("inline", inline=True)


def current() -> CpuStream:
    return getattr(_tls, "stream", None) or INLINE


def set_current(stream: CpuStream | None) -> None:
    _tls.stream = stream


class CpuEvent:
    """A marker in a stream's FIFO; completes when the stream reaches it."""

    def __init__(self, timing: bool = False) -> None:
        self.timing = timing
        self._fence: _Fence | None = None

    def record(self, stream: CpuStream) -> None:
        self._fence = stream.fence()

    def wait(self, stream: CpuStream) -> None:
        """Make future work on ``stream`` wait for this event (torch's ``Event.wait``)."""
        f = self._fence
        if f is None:  # never recorded: nothing to wait for, as on a device
            return
        if stream.inline or stream._current_here():
            f.wait()
            return

        def waiter() -> None:
            f.done.wait()
            if f.error is not None:
                raise f.error

        stream.submit(waiter)

    def query(self) -> bool:
        return self._fence is None or self._fence.done.is_set()

    def synchronize(self) -> None:
        if self._fence is not None:
            self._fence.wait()

    def elapsed_time(self, end: CpuEvent) -> float:
        """Milliseconds from this event to ``end`` (torch's ``Event.elapsed_time``)."""
        if not (self.timing and end.timing):
            raise ValueError("elapsed_time needs two events created with timing=True")
        if self._fence is None or end._fence is None:
            raise ValueError("elapsed_time needs both events recorded")
        self._fence.wait()
        end._fence.wait()
        return (end._fence.time - self._fence.time) * 1e3
