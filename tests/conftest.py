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


def record_updates(cache) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Make ``cache`` keep a copy of every K/V the model hands to its ``update``: ``{layer: [(k, v), ...]}``
    (concatenated along dim 2, what a full cache would hold)."""
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    original = cache.update

    def recording_update(k, v, layer_idx, kw=None):
        seen.setdefault(layer_idx, []).append((k.clone(), v.clone()))
        return original(k, v, layer_idx, kw)

    cache.update = recording_update
    return seen


def assert_host_kv_is_the_full_caches(cache, seen, layers, rows: int, heads: int) -> None:
    """Every host page of ``layers`` holds exactly the K/V a full cache holds at its positions."""
    for layer_idx in layers:
        ref_k = torch.cat([k for k, _ in seen[layer_idx]], dim=2)
        ref_v = torch.cat([v for _, v in seen[layer_idx]], dim=2)
        for b in range(rows):
            for h in range(heads):
                pos, k, v = cache.host_kv(layer_idx, b, h)
                assert torch.equal(k, ref_k[b, h, pos]), f"layer {layer_idx} row {b} head {h}"
                assert torch.equal(v, ref_v[b, h, pos])


class SparseDecodeReference:
    """An attention function for ``AttentionInterface``: prefill and ``dense`` layers through SDPA; a decode
    step attends, per (row, KV head), the positions ``keep(layer_idx, q [n_rep, D], keys [T, D])`` returns, with
    a plain softmax over a DynamicCache's full keys. Subclasses say what to keep."""

    def __init__(self, dense=()):
        self.dense = set(dense)

    def keep(self, layer_idx: int, q: torch.Tensor, keys: torch.Tensor) -> list[int]:
        raise NotImplementedError

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[2] > 1 or module.layer_idx in self.dense:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        B, Hq, _, D = query.shape
        H = key.shape[1]
        n_rep = Hq // H
        out = torch.empty(B, 1, Hq, D)
        for b in range(B):
            for h in range(H):
                q = query[b, h * n_rep : (h + 1) * n_rep, 0]  # [n_rep, D]
                idx = torch.tensor(sorted(set(self.keep(module.layer_idx, q, key[b, h]))))
                att = torch.softmax(q @ key[b, h, idx].T * scaling, dim=-1)
                out[b, 0, h * n_rep : (h + 1) * n_rep] = att @ value[b, h, idx]
        return out, None
