"""The CPU sparse-attention kernel equals torch's SDPA (in float64) with the same boolean mask."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from icecache.runtime.cpu_attention import sparse_attention_cpu


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), R=st.integers(1, 4), S=st.integers(1, 40), D=st.sampled_from([4, 16, 64]),
    p_valid=st.floats(0.0, 1.0), scale=st.floats(0.05, 2.0), seed=st.integers(0, 2**16), big=st.booleans(),
)
@example(B=1, H=2, R=4, S=19, D=16, p_valid=1.0, scale=1.0, seed=0, big=True)  # float32 SDPA is off by 2e-5 here
def test_matches_sdpa_with_boolean_mask(B, H, R, S, D, p_valid, scale, seed, big):
    g = torch.Generator().manual_seed(seed)
    amp = 30.0 if big else 1.0  # large logits: the max-subtraction must keep it finite
    q = amp * torch.randn(B, H, R, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    valid = torch.rand(B, H, S, generator=g) < p_valid
    valid[..., 0] |= torch.rand(B, H, generator=g) < 0.9  # most rows have a valid slot; some have none
    got = sparse_attention_cpu(q, k, v, valid, scale)
    assert got.shape == (B, H, R, D) and got.dtype == q.dtype
    has = valid.any(-1)  # [B, H]
    # Reference in float64 (float32 SDPA itself is off by ~2e-5 at the large logits).
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=valid[:, :, None, :], scale=scale
    ).float()
    torch.testing.assert_close(got[has], ref[has], rtol=1e-5, atol=1e-5)
    assert (got[~has] == 0).all()  # no valid slot: zeros (SDPA gives NaN there)
