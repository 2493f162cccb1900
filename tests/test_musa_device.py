"""The musa backend on a real Moore Threads GPU; skipped wherever ``probe()`` says it cannot run.

Written without access to MUSA hardware: these tests are the checks a MUSA user runs
(``GRAPHSLOT_BACKEND=musa tox -e musa``) to verify the parts that the stub-driven
tests cannot: torch_musa streams, events, pinned memory, graphs, and zero-copy views
at driver-mapped addresses.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import graphslot.backends.musa as musa_pkg
from graphslot.errors import StateError

from devices import spin

_WHY = musa_pkg.probe()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"musa backend unavailable: {_WHY}")


@pytest.fixture(scope="module")
def be() -> Any:
    from graphslot.backends.musa.backend import MusaBackend

    b = MusaBackend()
    yield b
    b.synchronize()
    assert all(v == 0 for v in b.ledger.snapshot().values()), b.ledger.snapshot()


def test_info(be: Any) -> None:
    info = be.info()
    assert info["backend"] == "musa" and info["vmm_supported"] is True
    assert info["granularity"] == be.granularity > 0
    assert 0 < info["free_bytes"] <= info["total_bytes"]
    assert info["versions"]["libmusa"] and info["versions"]["driver"]


def test_tensor_at_is_a_zero_copy_device_view(be: Any) -> None:
    g = be.granularity
    res, _ = be.reserve_mapped(g)
    t = be.tensor_at(res.va, (g // 4,), torch.float32)
    assert t.device == be.device and t.data_ptr() == res.va
    t.fill_(2.5)
    u = be.tensor_at(res.va + 64, (4,), torch.float32)  # a second view into the same memory
    assert torch.equal(u.cpu(), torch.full((4,), 2.5))
    be.synchronize()
    del t, u
    be.unmap_release(res, 0)
    be.free(res)


def test_graph_replay_follows_the_physical_backing(be: Any) -> None:
    g = be.granularity
    res = be.reserve(g)
    a = be.map_new(res, 0, g)
    x = be.tensor_at(res.va, (g // 4,), torch.float32)
    x.fill_(1.0)
    side = be.new_stream()  # warm up off the capture stream, as torch's graph docs advise
    side.wait_stream(be.current_stream())
    with be.stream(side):
        x.add_(0.0)
    be.current_stream().wait_stream(side)
    graph = be.new_graph()
    with graph.capture():
        x.add_(1.0)
        assert be.is_capturing()
        with pytest.raises(StateError):
            be.create(g)  # driver calls are refused while capturing
    be.synchronize()
    graph.replay()
    be.synchronize()
    assert float(x[0].cpu()) == 2.0
    be.unmap(res, 0, g)  # `a` keeps 2.0
    b = be.map_new(res, 0, g)
    x.fill_(10.0)
    graph.replay()  # the same graph, now writing into `b`
    be.synchronize()
    assert float(x[0].cpu()) == 11.0
    be.unmap(res, 0, g)
    be.map(res, 0, a)
    be.set_access(res, 0, g)
    assert float(x[-1].cpu()) == 2.0
    del x, graph
    be.unmap_release(res, 0)
    be.release(b)
    be.free(res)


def test_async_copies_through_pinned_memory(be: Any) -> None:
    g = be.granularity
    res, _ = be.reserve_mapped(g)
    dev = be.tensor_at(res.va, (g,), torch.uint8)
    host, back = be.pinned_empty(g), be.pinned_empty(g)
    assert host.is_pinned()
    host.copy_(torch.arange(g).remainder(251).to(torch.uint8))
    s = be.new_stream()
    be.copy_async(dev, host, s)
    be.copy_async(back, dev, s)
    be.synchronize_event(be.record_event(be.new_event(), s))
    assert torch.equal(back, host)
    del dev
    be.unmap_release(res, 0)
    be.free(res)


def test_events_and_spin(be: Any) -> None:
    with be.timed() as t:
        spin(be, 0.005)
    assert t["device_ms"] > 0


def test_driver_calls_from_a_worker_thread(be: Any) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            res, _ = be.reserve_mapped(be.granularity)
            be.unmap_release(res, 0)
            be.free(res)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
