"""The driver worker: one thread that runs VMM driver calls in submission order.
Imports nothing of the package (the paged graph pool uses it too)."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

from ..backend import Backend
from ..errors import StateError

#: seconds the interpreter's exit waits for the driver workers' queued jobs before dropping the rest
EXIT_WAIT_S = 10.0


class DriverWorker:
    """One thread that runs VMM driver work in submission order.

    Driver calls must not run inside a host callback or a capture, and should not stall
    the training thread; queueing them here keeps all of them on one serialised thread.
    At interpreter exit the thread runs what is queued and ends
    (:meth:`finish_at_exit`); a job submitted after that runs on the caller's thread.
    """

    _live: weakref.WeakSet[DriverWorker] = weakref.WeakSet()  # a running thread keeps its worker
    _exited = False  #: set once finish_at_exit ran

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="graphslot-driver", daemon=True)
        self._thread.start()
        DriverWorker._live.add(self)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            self._do(fn, fut)

    @staticmethod
    def _do(fn: Callable[[], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        if self._closed and not DriverWorker._exited:
            raise StateError("the driver worker was closed (its engine's close() ran); "
                             "build a new engine")
        fut: Future[Any] = Future()
        if DriverWorker._exited:  # the thread is gone: the interpreter is finishing
            self._do(fn, fut)
        else:
            self._q.put((fn, fut))
        return fut

    def wait_event(self, event: Any) -> None:
        """Block this worker (not the training thread) until ``event`` completes."""
        self._backend.synchronize_event(event, count_as="worker_sync")

    def drain(self) -> None:
        self.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=10)

    @classmethod
    def finish_at_exit(cls, timeout: float = EXIT_WAIT_S) -> bool:
        """Run the jobs every worker has queued and end the threads (registered with
        :mod:`atexit`): a daemon thread still inside a driver or framework call when the
        interpreter finalizes can abort the process. Jobs not started within ``timeout``
        seconds are cancelled (their futures say so); memory they would have released
        goes back with the process.

        Args:
            timeout: seconds to wait for the queued jobs in all.

        Returns:
            True when every worker's thread ended.
        """
        workers = [w for w in list(cls._live) if w._thread.is_alive()]
        for w in workers:
            w._closed = True
            w._q.put(None)  # after the jobs already queued
        deadline = time.monotonic() + timeout
        for w in workers:
            w._thread.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w._thread.is_alive():  # stuck in a job: cancel the rest of its queue
                while True:
                    try:
                        item = w._q.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[1].cancel()
                w._q.put(None)
        cls._exited = True
        return not any(w._thread.is_alive() for w in workers)


atexit.register(DriverWorker.finish_at_exit)
