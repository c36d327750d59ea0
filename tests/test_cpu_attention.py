"""The CPU sparse-attention kernels equal torch's SDPA (in float64) with the same boolean mask: the numba kernel
(float64 accumulation) to 1e-5, the native one (float32, every instruction set this CPU runs) to float32 SDPA's
own error at large logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from icecache.kernels.library import native_kernels
from icecache.runtime.cpu_attention import sparse_attention_cpu

KERNELS = native_kernels()
PATHS = ["numba"] + (KERNELS.available_isas() if KERNELS is not None else [])


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), R=st.integers(1, 4), S=st.integers(1, 40), D=st.sampled_from([4, 16, 64]),
    p_valid=st.floats(0.0, 1.0), scale=st.floats(0.05, 2.0), seed=st.integers(0, 2**16), big=st.booleans(),
)
@example(B=1, H=2, R=4, S=19, D=16, p_valid=1.0, scale=1.0, seed=0, big=True)  # float32 SDPA is off by 2e-5 here
@pytest.mark.parametrize("path", PATHS)
def test_matches_sdpa_with_boolean_mask(path, B, H, R, S, D, p_valid, scale, seed, big):
    g = torch.Generator().manual_seed(seed)
    amp = 30.0 if big else 1.0  # large logits: the max-subtraction must keep it finite
    q = amp * torch.randn(B, H, R, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g)
    v = torch.randn(B, H, S, D, generator=g)
    valid = torch.rand(B, H, S, generator=g) < p_valid
    valid[..., 0] |= torch.rand(B, H, generator=g) < 0.9  # most rows have a valid slot; some have none
    before = KERNELS.isa if KERNELS is not None else None
    if path != "numba":
        KERNELS.set_isa(path)
    try:
        got = sparse_attention_cpu(q, k, v, valid, scale, native=path != "numba")
    finally:
        if before is not None:
            KERNELS.set_isa(before)
    assert got.shape == (B, H, R, D) and got.dtype == q.dtype
    has = valid.any(-1)  # [B, H]
    # Reference in float64 (float32 SDPA itself is off by ~2e-5 at the large logits).
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=valid[:, :, None, :], scale=scale
    ).float()
    tol = 1e-5 if path == "numba" else 1e-4  # float32 logits of up to ~1e3 carry ~1e-4 relative error into exp
    torch.testing.assert_close(got[has], ref[has], rtol=tol, atol=tol)
    assert (got[~has] == 0).all()  # no valid slot: zeros (SDPA gives NaN there)
