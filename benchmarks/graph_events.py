"""What a device graph's own event nodes do on this machine (cuda backend).

graphslot's offload streams a slot section by section: a forward graph records an event
inside itself when a section of the slot is written (the copy stream then takes that
section to the host) and waits, inside itself, for the copy that frees a section before
writing it; a backward graph waits inside itself for each section's copy back. That
relies on three facts about events recorded and waited on inside a graph (torch's
``Event(external=True)``), which this script checks on the real device:

1. ``wait``: a graph's wait node orders the graph after a record queued on another stream
   before the graph was launched;
2. ``record``: a wait queued on another stream after a launch waits for the graph's own
   record node in that launch;
3. ``launch_time``: a wait node waits for the record the event had when the graph was
   launched, not for one queued later (it would otherwise wait for work that waits for
   the graph itself, and never end). Checked in a child process with a time limit.

torch makes a device event at its first record, and a wait on an event that was never
recorded is no wait at all (under capture too: no wait node), so each event here is
recorded once before any capture that waits on it. It also times a graph of event nodes
against the same graph without them. Prints one JSON line.

    python benchmarks/graph_events.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

SLEEP = 200_000_000  # cycles of torch.cuda._sleep: about 0.1 s, long enough to see order


def _made(ev: torch.cuda.Event) -> torch.cuda.Event:
    """``ev``, recorded once so that the device event exists (see the module docstring)."""
    ev.record(torch.cuda.current_stream())
    return ev


def _check_wait(made: bool = True) -> bool:
    """Whether each replay of a graph that waits inside for ``ev`` ran after the record of
    ``ev`` queued on another stream before that replay (``made``: recorded once before the
    capture, as graphslot's graph events are)."""
    ev = torch.cuda.Event(external=True)
    if made:
        _made(ev)
    copy = torch.cuda.Stream()
    src = torch.zeros(1 << 20, device="cuda")
    out = torch.zeros_like(src)
    g = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=cap):
        torch.cuda.current_stream().wait_event(ev)
        out.copy_(src)
    torch.cuda.synchronize()
    ok = True
    for value in (1.0, 2.0):  # each launch waits for the record queued before it
        with torch.cuda.stream(copy):
            torch.cuda._sleep(SLEEP)
            src.fill_(value)
            ev.record(copy)
        g.replay()
        torch.cuda.synchronize()
        ok = ok and bool((out == value).all())
    return ok


def _check_record() -> bool:
    ev = torch.cuda.Event(external=True)
    flag = torch.zeros(1 << 20, device="cuda")
    seen = torch.zeros_like(flag)
    g = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=cap):
        torch.cuda._sleep(SLEEP)
        flag.fill_(1.0)
        ev.record(torch.cuda.current_stream())
        flag.fill_(2.0)  # after the record: the waiter must not need it
        torch.cuda._sleep(SLEEP)
    torch.cuda.synchronize()
    copy = torch.cuda.Stream()
    g.replay()
    copy.wait_event(ev)
    with torch.cuda.stream(copy):
        seen.copy_(flag)
    torch.cuda.synchronize()
    return bool((seen >= 1).all())


def _launch_time_child() -> None:
    """Exits 0 if a wait node waits for the record the event had at launch."""
    a = _made(torch.cuda.Event(external=True))
    r = _made(torch.cuda.Event(external=True))
    x = torch.ones(1 << 20, device="cuda")
    y = torch.zeros_like(x)
    g = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=cap):
        torch.cuda.current_stream().wait_event(a)
        y.copy_(x)
        r.record(torch.cuda.current_stream())
    copy = torch.cuda.Stream()
    a.record(copy)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)  # the graph starts well after the host queued what follows
    g.replay()
    copy.wait_event(r)  # this record of `a` waits for the graph's record node
    with torch.cuda.stream(copy):
        x.add_(1)
    a.record(copy)
    torch.cuda.synchronize()
    print("ok", float(y[0]))


def _check_launch_time() -> bool | str:
    try:
        p = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True,
                           timeout=60)
    except subprocess.TimeoutExpired:
        return False  # the graph waited for the later record: a deadlock
    if p.returncode != 0:
        return f"child failed: {p.stderr.strip().splitlines()[-1:]}"
    return p.stdout.split()[:1] == ["ok"]


def _node_cost(n: int = 200, reps: int = 50) -> dict[str, float]:
    """Device microseconds per graph replay with ``n`` record and ``n`` wait nodes, and
    with none (the same copy kernels in both)."""
    evs = [_made(torch.cuda.Event(external=True)) for _ in range(n)]
    t = torch.zeros(256, device="cuda")
    out = {}
    for name, with_events in (("plain", False), ("events", True)):
        g = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=cap):
            s = torch.cuda.current_stream()
            for ev in evs:
                if with_events:
                    s.wait_event(ev)
                t.add_(1)
                if with_events:
                    ev.record(s)
        torch.cuda.synchronize()
        for _ in range(5):
            g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        out[name] = start.elapsed_time(end) * 1e3 / reps
    out["per_node_us"] = (out["events"] - out["plain"]) / (2 * n)
    return out


def main() -> None:
    t0 = time.perf_counter()
    report = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name()}
    report["wait"] = _check_wait()
    report["wait_unrecorded_is_no_wait"] = not _check_wait(made=False)
    report["record"] = _check_record()
    report["launch_time"] = _check_launch_time()
    report["node_cost"] = _node_cost()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _launch_time_child()
    else:
        main()
