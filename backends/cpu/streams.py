"""Streams and events on host threads.

A :class:`CpuStream` is a worker thread draining a FIFO queue, so work queued on two
streams really runs concurrently and only events order it. The calling thread's own
stream (:data:`INLINE`) runs work immediately, in program order, like the device's
current stream does from the program's point of view.

Errors are sticky: once a task on a stream fails, later tasks on it are skipped and
every event recorded after the failure reports it, like a device error.

At interpreter exit the worker threads run what is queued and end (:func:`finish_at_exit`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Callable

from graphslot.errors import StreamError

_tls = threading.local()

#: seconds the interpreter's exit waits for the streams' queued work before dropping the rest
EXIT_WAIT_S = 10.0

#: each worker thread alive and its queue (a stream's thread outlives a dropped stream
#: until its queue is empty)
_workers: dict[threading.Thread, queue.SimpleQueue[Callable[[], None] | None]] = {}
_workers_lock = threading.Lock()
#: set once the threads ended at exit: streams then run work on the caller's thread
_stopped = False
#: set when exit stopped waiting: queued work not yet started is skipped
_dropping = False


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
            # The thread holds no reference to the stream, so an unused stream can be
            # collected; its finalizer ends the thread once the queue is empty.
            self._thread = threading.Thread(target=CpuStream._run, args=(self._q,),
                                            name=f"graphslot-{self.name}", daemon=True)
            with _workers_lock:
                _workers[self._thread] = self._q
            self._thread.start()
            # Not at exit: finish_at_exit ends the threads there, after their queued work.
            weakref.finalize(self, self._q.put, None).atexit = False

    @staticmethod
    def _run(q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        try:
            while True:
                task = q.get()
                if task is None:
                    return
                task()
                del task
        finally:
            with _workers_lock:
                _workers.pop(threading.current_thread(), None)

    def _current_here(self) -> bool:
        return getattr(_tls, "stream", None) is self

    def _runs_here(self) -> bool:
        """Whether work for this stream runs on the caller's thread: an inline stream, the
        caller's current stream, or any stream once the threads ended at exit."""
        return self.inline or _stopped or self._current_here()

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn``. Work for the caller's current stream runs now, after what is queued."""
        if self._runs_here():
            if not self.inline:
                self.drain()
            if self.error is not None:
                raise StreamError(f"{self.name} failed earlier: {self.error!r}")
            fn()
            return

        def task() -> None:
            if self.error is not None or _dropping:
                return
            try:
                fn()
            except BaseException as e:  # sticky, reported through events
                self.error = e

        self._q.put(task)

    def fence(self) -> _Fence:
        """A fence that completes when everything queued so far has run."""
        f = _Fence()
        if self._runs_here():
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
        if self.inline or _stopped:
            return
        f = _Fence()
        self._q.put(lambda: f.signal(self.error))
        f.wait()

    def __repr__(self) -> str:
        return f"<CpuStream {self.name}{' inline' if self.inline else ''}>"


def finish_at_exit(timeout: float = EXIT_WAIT_S) -> bool:
    """Run what every stream has queued and end the worker threads (registered with
    :mod:`atexit`).

    A daemon thread still inside a torch op when the interpreter finalizes is ended with
    ``pthread_exit`` through C++ frames, which aborts the process ("terminate called
    without an active exception"), so no thread may be left working. Work queued later
    runs on the caller's thread. What has not started within ``timeout`` seconds is
    dropped (a task already running is waited for briefly and then left).

    Args:
        timeout: seconds to wait for the queued work in all.

    Returns:
        True when every thread ended.
    """
    global _stopped, _dropping
    with _workers_lock:
        workers = list(_workers.items())
    for _, q in workers:
        q.put(None)  # after the work already queued
    deadline = time.monotonic() + timeout
    for t, _ in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t, _ in workers):
        _dropping = True
        for t, _ in workers:
            t.join(1.0)
    _stopped = True
    return not any(t.is_alive() for t, _ in workers)


atexit.register(finish_at_exit)


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
        if stream._runs_here():
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
