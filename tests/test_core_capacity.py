"""`grown_capacity`: the one growth policy of the append-only buffers (doubling; a quarter spare after a bulk
fill)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from icecache.core.capacity import SPARE_DIVISOR, grown_capacity


@given(needed=st.integers(0, 10**9), current=st.integers(0, 10**9), minimum=st.integers(0, 4096))
def test_grown_capacity_fits_doubles_and_spares(needed, current, minimum):
    cap = grown_capacity(needed, current, minimum)
    assert cap >= needed + needed // SPARE_DIVISOR  # a bulk fill keeps a quarter spare
    assert cap >= 2 * current and cap >= minimum
    # and never more than the largest of those three
    assert cap == max(needed + needed // SPARE_DIVISOR, 2 * current, minimum)


@given(final=st.integers(1, 20_000), bulk=st.integers(0, 20_000))
def test_one_at_a_time_appends_reallocate_logarithmically_often(final, bulk):
    """After a bulk fill of ``bulk`` rows, appending one row at a time up to ``final`` rows reallocates at most
    ~log2(final / bulk) + 1 times (brute force over every append)."""
    cap = grown_capacity(bulk, 0) if bulk else 0
    reallocations = 0
    for n in range(bulk + 1, max(final, bulk) + 1):
        if n > cap:
            cap = grown_capacity(n, cap)
            reallocations += 1
    assert reallocations <= max(final, bulk).bit_length() + 1
    if bulk >= 4:
        # the first quarter of appends after a bulk fill never reallocates
        assert all(n <= grown_capacity(bulk, 0) for n in range(bulk, bulk + bulk // SPARE_DIVISOR + 1))


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="capacities are >= 0"):
        grown_capacity(-1, 0)
