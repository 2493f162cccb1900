"""The interpreter exits cleanly with graphslot work still queued.

On the cpu backend a stream is a daemon thread running torch copies; one still inside a
torch op when the interpreter finalizes is ended through C++ frames and aborts the
process ("terminate called without an active exception", status 134). The same holds for
the driver worker's thread. Each run below forks from a parent that imported torch once
(one import for all runs), queues copies on several streams and driver jobs that wait on
them, and leaves through the ordinary ``sys.exit``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RUNS = 20

_CHILD = r"""
import atexit, gc, json, os, sys

CHECKS = {}

def after_graphslot_exit():
    # Registered before graphslot is imported, so it runs after graphslot's own exit
    # handlers: work queued from here on still runs, on this thread.
    if "run" not in CHECKS:
        return
    b, s, worker, host, dev = CHECKS["run"]
    host.zero_()
    b.copy_async(host, dev, s)
    b.synchronize_event(b.record_event(b.new_event(), s))
    ok = bool(host.eq(7).all()) and worker.submit(lambda: 42).result(timeout=5) == 42
    os.write(CHECKS["fd"], b"ok" if ok else b"no")

atexit.register(after_graphslot_exit)

import torch
import graphslot
from graphslot.offload import DriverWorker

def child(fd, check):
    b = graphslot.get_backend()
    size = 8 << 20
    res, _ = b.reserve_mapped(graphslot.align_up(size, b.granularity))
    dev = b.tensor_at(res.va, (size,), torch.uint8)
    dev.fill_(7)
    host = b.pinned_empty(size)
    worker = DriverWorker(b)
    for k in range(3):
        s = b.new_stream()
        for _ in range(4):
            b.copy_async(host, dev, s)
            b.copy_async(dev, host, s)
        ev = b.record_event(b.new_event(), s)
        worker.submit(lambda ev=ev: worker.wait_event(ev))
        if k == 0:
            del s  # a dropped stream's thread still runs what it had queued
    worker.submit(lambda: b.map_new(b.reserve(b.granularity), 0, b.granularity))
    if check:
        CHECKS.update(run=(b, s, worker, host, dev), fd=fd)
    else:
        os.write(fd, b"-")

gc.collect()
gc.freeze()  # the children's exit then touches fewer of the parent's pages
runs = []
for i in range(int(sys.argv[1]) + 1):  # the last run also checks work queued after the exit handlers
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(w, check=i == int(sys.argv[1]))
        gc.freeze()
        sys.exit(0)  # the interpreter's ordinary exit, with the work in flight
    os.close(w)
    runs.append((pid, r))
out = []
for pid, r in runs:
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out.append((code, os.read(r, 16).decode()))
    os.close(r)
print(json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_exit_with_copies_and_driver_jobs_in_flight_is_clean() -> None:
    env = {**os.environ, "GRAPHSLOT_BACKEND": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(RUNS)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    codes = [code for code, _ in runs]
    assert codes == [0] * (RUNS + 1), f"exit statuses {codes}; stderr: {proc.stderr[-2000:]}"
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # in the last run, work queued after graphslot's exit handlers ran on the exiting
    # thread, and completed
    assert runs[-1][1] == "ok", runs[-1]

