"""What graphslot.profile measures for the budget planner, on the current backend."""

from __future__ import annotations

import torch
from torch import nn

from graphslot.profile import copy_bandwidth, profile_units


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
