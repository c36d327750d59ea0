"""`icecache.runtime.attention.dense_attention`: a sliding-window prefill in blocks of the window equals one SDPA
call over the whole mask (up to float rounding), and anything else is that one call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations import sdpa_attention

from icecache.runtime.attention import dense_attention


class Layer(torch.nn.Module):
    """What SDPA reads from an attention module."""

    def __init__(self, groups: int, window: int | None) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.sliding_window = window
        self.is_causal = True


def sliding_mask(lengths: list[int], T: int, window: int) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: causal, within ``window`` (transformers' rule: ``q - k < window``), left padding."""
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    base = (k <= q) & (q - k < window)
    rows = []
    for n in lengths:
        real = torch.arange(T) >= T - n
        rows.append(base & real[None, :])
    return torch.stack(rows)[:, None]


def qkv(B: int, Hkv: int, groups: int, T: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hkv * groups, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
            torch.randn(B, Hkv, T, D, generator=g))


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 300), window=st.integers(1, 64), groups=st.sampled_from([1, 4]), pad=st.integers(0, 40),
       seed=st.integers(0, 2**16))
def test_blocked_sliding_prefill_is_one_sdpa_call(T, window, groups, pad, seed):
    q, k, v = qkv(2, 2, groups, T, 16, seed)
    lengths = [T, max(1, T - pad)]
    mask = sliding_mask(lengths, T, window)
    module = Layer(groups, window)
    want, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = dense_attention(module, q, k, v, mask, scaling=0.25, sliding_window=window)
    real = torch.ones(2, T, dtype=torch.bool)
    real[1, : T - lengths[1]] = False  # padding rows see no key: what SDPA puts there is not compared
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_blocks_are_taken_only_where_the_mask_hides_the_rest(monkeypatch):
    """A long sliding prefill runs as blocks of the window; a mask that shows a query more than its window (here
    plain causal), a global layer, a short prompt or a prefill after cached tokens is one SDPA call."""
    calls: list[int] = []
    real = sdpa_attention.sdpa_attention_forward

    def counting(module, query, key, *args, **kwargs):
        calls.append(key.shape[2])
        return real(module, query, key, *args, **kwargs)

    monkeypatch.setattr("icecache.runtime.attention.sdpa_attention_forward", counting)
    T, window = 256, 32
    q, k, v = qkv(1, 1, 4, T, 8, 0)
    dense_attention(Layer(4, window), q, k, v, sliding_mask([T], T, window))
    assert len(calls) == T // window and max(calls) == 2 * window - 1
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    for module, query, key, value, mask in [
        (Layer(4, window), q, k, v, causal),  # shows more than the window: one call
        (Layer(4, None), q, k, v, sliding_mask([T], T, window)),  # a global layer
        (Layer(4, window), q[:, :, :64], k[:, :, :64], v[:, :, :64], sliding_mask([64], 64, window)),  # short
        (Layer(4, window), q[:, :, 128:], k, v, sliding_mask([T], T, window)[:, :, 128:]),  # after cached tokens
    ]:
        calls.clear()
        got, _ = dense_attention(module, query, key, value, mask)
        assert calls == [key.shape[2]]
        want, _ = real(module, query, key, value, mask)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_float_masks_take_blocks_too(dtype):
    T, window = 200, 24
    q, k, v = (x.to(dtype) for x in qkv(1, 1, 2, T, 16, 3))
    hide = ~sliding_mask([T], T, window)
    additive = torch.zeros(hide.shape, dtype=dtype).masked_fill(hide, float("-inf"))
    module = Layer(2, window)
    want, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, additive)
    got, _ = dense_attention(module, q, k, v, additive)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
