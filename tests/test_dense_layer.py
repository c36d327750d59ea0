"""`GrowingLayer` returns what transformers' `DynamicLayer` returns, under any sequence of cache operations."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from icecache.runtime.dense_layer import MIN_GROWTH, GrowingLayer

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 150)),
        st.tuples(st.just("crop"), st.integers(-20, 200)),
        st.tuples(st.just("select"), st.just(0)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_growing_layer_matches_dynamic_layer(ops, seed):
    g = torch.Generator().manual_seed(seed)
    ref, ours = DynamicLayer(), GrowingLayer()
    B, H, D = 2, 3, 4
    for op, arg in ops:
        if op == "update":
            k, v = torch.randn(B, H, arg, D, generator=g), torch.randn(B, H, arg, D, generator=g)
            rk, rv = ref.update(k, v)
            ok, ov = ours.update(k.clone(), v.clone())
            assert torch.equal(rk, ok) and torch.equal(rv, ov)
        elif op == "crop" and ref.is_initialized:
            ref.crop(arg)
            ours.crop(arg)
        elif op == "select" and ref.get_seq_length() > 0:
            idx = torch.tensor([1, 0])  # swap the two rows
            ref.batch_select_indices(idx)
            ours.batch_select_indices(idx)
        elif op == "reset":
            ref.reset()
            ours.reset()
        assert ref.get_seq_length() == ours.get_seq_length()
        if ref.get_seq_length():
            assert torch.equal(ref.keys, ours.keys) and torch.equal(ref.values, ours.values)
        assert ours.capacity >= ours.get_seq_length()


def test_decode_appends_in_place_with_amortised_growth():
    layer = GrowingLayer()
    layer.update(torch.randn(1, 2, 1000, 8), torch.randn(1, 2, 1000, 8))
    caps, moves, ptr = {layer.capacity}, 0, layer.keys.data_ptr()
    for _ in range(4000):
        k = torch.randn(1, 2, 1, 8)
        out_k, _ = layer.update(k, k)
        assert torch.equal(out_k[:, :, -1:], k)
        caps.add(layer.capacity)
        moves += layer.keys.data_ptr() != ptr  # a new buffer (the old one is alive while copying: new address)
        ptr = layer.keys.data_ptr()
    assert layer.get_seq_length() == 5000
    # grows by a quarter (at least MIN_GROWTH): 1000 -> 1250 -> ... -> >= 5000 in ~8 moves, not 4000
    assert moves == len(caps) - 1 <= 10 and max(caps) <= 5000 * 1.25 + MIN_GROWTH + 1
    assert layer.reserved_bytes() == 2 * layer.capacity * 2 * 8 * 4
    layer.release()
    assert layer.capacity == 0 and layer.keys is None and not layer.is_initialized


def test_update_with_other_heads_is_refused():
    import pytest

    from icecache.core.errors import CacheMisuseError

    layer = GrowingLayer()
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(CacheMisuseError, match="batch/heads"):
        layer.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
