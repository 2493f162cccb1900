"""What graphslot.profile measures for the budget planner, on the current backend."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

from graphslot.errors import UsageError
from graphslot.profile import _Ahead, copy_bandwidth, profile_units


def test_copy_bandwidth_measures_every_direction(clean):
    bw = copy_bandwidth(clean, 4 << 20, reps=2)
    assert set(bw) == {"d2h_gbps", "h2d_gbps", "d2d_gbps", "both_total_gbps"}
    assert all(v > 0 for v in bw.values()), bw


def test_each_unit_costs_its_time_saved_bytes_and_gradients(clean):
    b = clean
    torch.manual_seed(0)
    a, c = nn.Linear(64, 64).to(b.device), nn.Linear(64, 64).to(b.device)
    c.weight = a.weight  # tied: one gradient, counted where it first appears
    x = torch.randn(16, 64, device=b.device, requires_grad=True)
    costs = profile_units(b, [nn.Sequential(a, nn.ReLU()), c], x)
    assert len(costs) == 2
    weight = 64 * 64 * 4
    assert costs[0].grad_bytes == weight + 64 * 4
    assert costs[1].grad_bytes == 64 * 4  # its bias alone: the weight is the first unit's
    for k in costs:
        assert k.forward_ms > 0 and k.backward_ms > 0
        assert k.input_bytes == x.numel() * 4
        # a linear saves its input; a ReLU its output: at least one activation each
        assert k.saved_bytes >= x.numel() * 4


def test_timed_says_whether_the_device_ran_the_block_alone(clean):
    b = clean
    x = torch.zeros(4, device=b.device)
    with b.timed() as t:
        x.add_(1)
    assert t["device_alone"] == 0.0  # nothing kept the device busy: host gaps may count
    assert t["host_ms"] >= 0 and t["device_ms"] >= 0
    with pytest.raises(UsageError, match="ahead_ms"):
        with b.timed(ahead_ms=-1):
            pass


def test_a_block_queued_behind_a_spin_is_timed_without_the_hosts_gaps(clean):
    """Where the backend can keep the device busy (Capabilities.spin), a block whose host
    side is slow (it sleeps between its kernels) times as the device's work alone."""
    b = clean
    if not b.capabilities.spin:
        pytest.skip(f"{b.name} cannot keep its device busy")
    x = torch.zeros(1 << 10, device=b.device)

    def slow_host() -> None:
        for _ in range(40):
            time.sleep(0.002)
            x.add_(1)

    with b.timed() as plain:
        slow_host()
    with b.timed(ahead_ms=2 * plain["host_ms"] + 10) as alone:
        slow_host()
    assert plain["host_ms"] >= 80 and plain["device_ms"] >= 60, plain
    assert alone["device_alone"] == 1.0, alone
    assert alone["device_ms"] < 10, alone
    assert torch.equal(x, torch.full_like(x, 80))


class _HostHeavy(nn.Module):
    """A layer whose host side sleeps between its kernels: eager, the device waits."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(10):
            time.sleep(0.002)
            x = torch.tanh(x)
        return self.lin(x)


def test_the_profile_times_what_the_device_runs_not_the_hosts_gaps(clean):
    b = clean
    if not b.capabilities.spin:
        pytest.skip(f"{b.name} cannot keep its device busy")
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=b.device, requires_grad=True)
    (cost,) = profile_units(b, [_HostHeavy().to(b.device)], x)
    # Eager, the forward takes the host's 20 ms of sleep; its kernels take microseconds.
    assert 0 < cost.forward_ms < 5, cost


def _stand_in_spin(b, monkeypatch) -> list[float]:
    """The cpu backend declared to spin, its spins only written down (the ms each asks)."""
    if b.name != "cpu":
        pytest.skip("the stand-in spin is the cpu backend's, whose own stream runs work as "
                    "it is queued")
    asked: list[float] = []
    monkeypatch.setattr(b, "capabilities", dataclasses.replace(b.capabilities, spin=True))
    monkeypatch.setattr(b, "vendor_spin", lambda ms, stream: asked.append(ms), raising=False)
    return asked


class _SlowFirst(nn.Module):
    """A linear layer whose first forward (the profile's untimed one, which sets the first
    spins) sleeps 50 ms: the spins start at about 200 ms, beyond any stall of a busy
    machine's host, so what the tests see is the profile's rule alone. ``stall`` may make
    a later forward sleep through its whole spin (as a synchronising call would)."""

    def __init__(self, asked: list[float], stall=lambda calls: False) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.asked, self.stall, self.calls = asked, stall, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.05)
        elif self.stall(self.calls):  # the host waits until the device is through the spin
            time.sleep(self.asked[-1] / 1e3)
        return torch.relu(self.lin(x))


def test_the_profile_keeps_the_device_busy_longer_until_the_host_queues_ahead(clean, monkeypatch):
    """On a backend that declares spin, each timed region asks for a longer spin while
    the device still started before the host finished queuing (here it always does: the
    cpu's own stream runs work as it is queued)."""
    b = clean
    asked = _stand_in_spin(b, monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=b.device, requires_grad=True)
    (cost,) = profile_units(b, [_SlowFirst(asked).to(b.device)], x, iters=2)
    assert cost.forward_ms > 0 and cost.backward_ms > 0 and cost.cheap
    # a forward and a backward, each three times (iters + 1), then three cheap recomputes
    assert len(asked) == 3 * 3, asked
    forward, backward, cheap = asked[0:6:2], asked[1:6:2], asked[6:]
    assert forward[0] >= 200 and cheap[0] >= 400, asked
    for spins in (forward, backward, cheap):  # (a spin stops growing at the limit)
        assert all(later >= min(2 * earlier, _Ahead.LIMIT_MS)
                   for earlier, later in zip(spins, spins[1:])), spins


def test_the_profile_stops_spinning_for_a_region_that_waits_for_the_device(clean, monkeypatch):
    """A region that synchronises (its host waits out the whole spin, as ``.item()`` would)
    cannot get ahead of the device however long the spin: after the second such region
    running, the profile stops spinning for that kind instead of doubling the spin each
    time."""
    b = clean
    asked = _stand_in_spin(b, monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=b.device, requires_grad=True)
    unit = _SlowFirst(asked, stall=lambda calls: True).to(b.device)
    (cost,) = profile_units(b, [unit], x, iters=2)
    assert cost.forward_ms > 0 and cost.cheap
    # forward, backward; forward, backward; backward; then the cheap recompute (it runs
    # the forward) twice: the forward's spin and the cheap one asked twice each and
    # kept; the backward's (no sync) three times, doubling
    assert len(asked) == 7, asked
    forward, backward, cheap = asked[0:4:2], [asked[1], asked[3], asked[4]], asked[5:]
    assert forward[0] == forward[1] > 0 and cheap[0] == cheap[1] > 0, asked
    assert all(later >= min(2 * earlier, _Ahead.LIMIT_MS)
               for earlier, later in zip(backward, backward[1:])), asked


def test_one_stall_of_the_host_keeps_the_spin_instead_of_ending_it(clean, monkeypatch):
    """A host that sits out one spin by a stall of its own (a busy machine) is not taken
    for a region that synchronises: the spin stays, and doubles again after."""
    b = clean
    asked = _stand_in_spin(b, monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(16, 64, device=b.device, requires_grad=True)
    # calls: 1 untimed, 2-4 timed forwards, 5+ the cheap recompute's: the first stalls
    unit = _SlowFirst(asked, stall=lambda calls: calls == 2).to(b.device)
    profile_units(b, [unit], x, iters=2)
    forward = asked[0:6:2]
    assert len(asked) == 9, asked
    assert forward[1] == forward[0], asked
    assert forward[2] >= min(2 * forward[1], _Ahead.LIMIT_MS), asked
