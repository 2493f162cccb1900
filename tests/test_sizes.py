"""graphslot.sizes: the one byte formatter and the one byte extent of a strided view."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphslot.sizes import format_bytes, view_extent


@pytest.mark.parametrize("n,kw,text", [
    (None, {}, "-"), (0, {}, "0 B"), (1023, {}, "1023 B"), (1536, {}, "1.50 KiB"),
    (3 << 30, {}, "3.00 GiB"), (-(5 << 20), {}, "-5.00 MiB"), ((3 << 29), {"digits": 1}, "1.5 GiB"),
    (2 << 20, {"exact": True}, "2 MiB"), (3000, {"exact": True}, "3000 B"),
    ((1 << 30) + (1 << 20), {"exact": True}, "1025 MiB"),
])
def test_format_bytes(n, kw, text):
    assert format_bytes(n, **kw) == text


@given(shape=st.lists(st.integers(0, 5), max_size=4), perm_seed=st.randoms(),
       dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.float64]))
def test_view_extent_matches_torch(shape, perm_seed, dtype):
    base = torch.zeros(shape, dtype=dtype)
    dims = list(range(len(shape)))
    perm_seed.shuffle(dims)
    t = base.permute(dims) if dims else base
    if t.ndim:
        t = t[(slice(None, None, 2),) + (slice(None),) * (t.ndim - 1)]
    got = view_extent(t.shape, t.stride(), t.element_size())
    if t.numel() == 0:
        assert got == 0
    else:
        ptrs = [t[idx].data_ptr() if t.ndim else t.data_ptr() for idx in
                [tuple(0 for _ in t.shape), tuple(s - 1 for s in t.shape)]]
        assert got == max(ptrs) - min(ptrs) + t.element_size()


def test_a_count_is_an_integer_of_at_least_its_least():
    from fractions import Fraction

    from graphslot.errors import UsageError
    from graphslot.sizes import whole_count

    assert whole_count(3, "n") == 3 and type(whole_count(torch.tensor(3), "n")) is int
    for bad in (True, 2.0, "2", Fraction(2), None, -1, torch.tensor([1, 2]), torch.tensor(True)):
        with pytest.raises(UsageError, match=r"^n must be an integer of bytes, at least 0, got "):
            whole_count(bad, "n", of=" of bytes")
    with pytest.raises(UsageError, match="at least 1, got 0"):
        whole_count(0, "n", least=1)
