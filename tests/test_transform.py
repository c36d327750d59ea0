"""MIPS -> L2 transforms (docs/index.md: MIPS to L2 transform; Invariants, property 9)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from icecache.core.transform import key_key_distance, max_sq_norm, transform_keys, transform_queries

data = st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 10**6), st.floats(0.01, 100.0))


def make(n, d, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * scale, torch.randn(3, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("form", ["paper", "scaled"])
@given(data)
def test_equal_norms_and_argmin_l2_is_argmax_ip(form, args):
    keys, q = make(*args)
    c = max_sq_norm(keys) ** 0.5
    tk, tq = transform_keys(keys, form=form), transform_queries(q)
    norms = tk.norm(dim=-1)
    expect = 1.0 if form == "paper" else c
    torch.testing.assert_close(norms, torch.full_like(norms, expect), rtol=1e-9, atol=1e-9 * max(1.0, c))
    torch.testing.assert_close(tq.norm(dim=-1), torch.ones(3, dtype=torch.float64))
    l2 = torch.cdist(tq, tk)
    ip = q @ keys.T
    # distances are an exact monotone function of the inner product
    if form == "paper":
        torch.testing.assert_close(l2.pow(2), 2 - 2 * ip / (c * q.norm(dim=-1, keepdim=True)), rtol=1e-7, atol=1e-7)
    else:
        torch.testing.assert_close(l2.pow(2), c * c + 1 - 2 * ip / q.norm(dim=-1, keepdim=True), rtol=1e-7, atol=1e-6 * c * c)
    best_l2 = l2.argmin(dim=1)
    assert torch.allclose(ip.gather(1, best_l2[:, None]).squeeze(1), ip.max(dim=1).values, rtol=1e-9, atol=1e-9 * (1 + c))


@given(data, st.floats(1.0, 3.0))
def test_results_invariant_to_choice_of_c(args, factor):
    keys, q = make(*args)
    c = max_sq_norm(keys) ** 0.5 * factor
    l2 = torch.cdist(transform_queries(q), transform_keys(keys, c=c))
    ip = q @ keys.T
    top = ip.gather(1, l2.argmin(dim=1)[:, None]).squeeze(1)
    torch.testing.assert_close(top, ip.max(dim=1).values)


@given(data)
def test_key_key_distance_is_half_squared_scaled_distance(args):
    keys, _ = make(*args)
    msq = max_sq_norm(keys)
    tk = transform_keys(keys, c=msq**0.5, form="scaled")
    ref = 0.5 * torch.cdist(tk, tk).pow(2)
    got = key_key_distance(keys, keys, msq)
    assert (got >= 0).all()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8 * (1 + msq))


def test_keys_longer_than_c_and_zero_query_give_no_nan():
    keys = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    tk = transform_keys(keys, c=1.0)  # c below the largest norm: the extra coordinate is clamped at 0
    assert torch.isfinite(tk).all()
    assert torch.isfinite(key_key_distance(keys, keys, 1.0)).all()
    tq = transform_queries(torch.zeros(2, 2))
    assert torch.equal(tq, torch.zeros(2, 3))
    assert torch.isfinite(transform_keys(torch.zeros(4, 3))).all()
    with pytest.raises(ValueError, match="form"):
        transform_keys(keys, form="other")
