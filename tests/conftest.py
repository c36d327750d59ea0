"""Shared fixtures: a tiny random Llama (built from a config, no download) and the embedded model."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "icecache", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "icecache"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def make_tiny_llama(seed: int = 0, **overrides):
    """A random 4-layer Llama (8 query / 2 KV heads, head_dim 16, vocab 128), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (converted once, then cached under ICECACHE_CACHE)."""
    import icecache

    return icecache.load_model()


def assert_layer_select_is_each_pagers_own(pagers: list, q: torch.Tensor, budget: int) -> None:
    """`select_layer` of one row (``q`` ``[1, H, g, d]``) gives every head its pager's own `select_arrays`."""
    from icecache.runtime.selection import select_layer

    sel = select_layer([pagers], q, budget, "union", layer_idx=0, keep_pages=True)
    for h, pager in enumerate(pagers):
        pages, indptr, positions, _ = pager.select_arrays(q[0, h], budget, check=False)
        assert sel.positions[0][h].tolist() == positions.tolist()
        assert sel.indptrs[0][h].tolist() == indptr.tolist()
        assert sel.pages[0][h].tolist() == pages.tolist()
