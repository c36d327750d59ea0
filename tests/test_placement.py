"""Tokens leaving the window in groups (`IceCacheConfig.insert_every`): a brute-force reference for what every
decode step attends, conservation with padding, inline = background, and the option's guards."""

from __future__ import annotations

import pytest
import torch
from conftest import SparseDecodeReference, assert_host_kv_is_the_full_caches, make_tiny_llama, record_updates
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from icecache import IceCache, IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.runtime.attention import use_attention


def window_start(prompt: int, length: int, window: int, group: int, phase: int) -> int:
    """First position of the window at sequence ``length``, written from the rule alone: after a prefill of
    ``prompt`` tokens the window holds the last ``window + phase``; appending a token to a window of
    ``window + group - 1`` tokens first moves its ``group`` oldest out."""
    start = max(0, prompt - window - phase)
    for p in range(prompt, length):
        if p - start >= window + group - 1:
            start += group
    return start


class GroupedExactReference(SparseDecodeReference):
    """Sink + window (as `window_start` says) + the exact top-``budget`` middle tokens by the best q.k over the
    GQA group."""

    def __init__(self, prompt: int, sink: int, window: int, budget: int, group: int, dense: tuple[int, ...]):
        super().__init__(dense)
        self.prompt, self.S, self.W, self.B, self.G = prompt, sink, window, budget, group

    def keep(self, layer_idx, q, keys):
        T = keys.shape[0]
        w0 = window_start(self.prompt, T, self.W, self.G, layer_idx % self.G)
        middle = torch.arange(self.S, max(self.S, w0))
        best = (q @ keys[middle].T).max(0).values
        chosen = middle[torch.argsort(best, descending=True, stable=True)[: self.B]].tolist()
        return list(range(min(self.S, w0))) + chosen + list(range(w0, T))


def _generate(model, ids, steps, cache=None):
    kw = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False, "output_logits": True, "return_dict_in_generate": True,
          "pad_token_id": 0}
    with torch.no_grad():
        if cache is None:
            out = model.generate(ids, past_key_values=DynamicCache(), **kw)
        else:
            with use_attention(model):
                out = model.generate(ids, past_key_values=cache, **kw)
    return out.sequences, torch.stack(out.logits)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(seed=5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.integers(3, 70), group=st.integers(1, 6), window=st.integers(1, 12), sink=st.integers(0, 5),
       budget=st.integers(1, 20), inserts=st.sampled_from(["inline", "background"]), seed=st.integers(0, 1000))
def test_every_step_attends_sink_grouped_window_and_exact_top_b(model, prompt, group, window, sink, budget, inserts,
                                                                 seed):
    """Greedy decoding through IceCache (exact pager, pages of 1) equals the brute-force reference token for
    token, at every insert group size, for prompts shorter and longer than the window."""
    steps = 20
    ids = torch.randint(3, 128, (1, prompt), generator=torch.Generator().manual_seed(seed))
    ref = GroupedExactReference(prompt, sink, window, budget, group, dense=(0,))
    AttentionInterface.register("grouped_ref", ref)
    AttentionMaskInterface.register("grouped_ref", sdpa_mask)
    model.set_attn_implementation("grouped_ref")
    try:
        ref_seq, ref_logits = _generate(model, ids, steps)
    finally:
        model.set_attn_implementation("sdpa")
    cfg = IceCacheConfig(index="exact", budget=budget, page_size=1, sink=sink, window=window, dense_layers=(0,),
                         insert_every=group, inserts=inserts, threads=1)
    cache = IceCache(model.config, cfg)
    seq, logits = _generate(model, ids, steps, cache)
    cache.check_conservation()
    for layer_idx in (1, 2, 3):
        layer = cache.layers[layer_idx]
        assert layer.length == prompt + steps - 1  # the last token is never fed back
        assert layer.window_start == window_start(prompt, layer.length, window, group, layer_idx % group)
    cache.close()
    assert torch.equal(seq, ref_seq)
    assert (logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("index", ["mdci", "sequential"])
@pytest.mark.parametrize("group", [2, 5])
def test_grouped_inserts_conserve_tokens_and_store_the_full_caches_kv(model, index, group):
    """Left-padded rows, sinks leaving inside a group: every position is in exactly one of sink / host page /
    window, and the host pages hold exactly the K/V a full cache holds at those positions."""
    from icecache.measure.capture import left_padded_random_ids

    ids, mask = left_padded_random_ids((60, 9), seed=2)
    cfg = IceCacheConfig(index=index, budget=12, page_size=4, sink=4, window=8, dense_layers=(0,), insert_every=group)
    cache = IceCache(model.config, cfg)
    seen = record_updates(cache)  # what a full cache would hold
    with torch.no_grad(), use_attention(model):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30, do_sample=False,
                       pad_token_id=0)
    cache.check_conservation()
    assert_host_kv_is_the_full_caches(cache, seen, (1, 2, 3), rows=2, heads=2)
    cache.close()


@pytest.mark.parametrize("index", ["mdci", "sequential"])
def test_grouped_inserts_inline_and_in_the_background_decode_the_same_tokens(model, index):
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(4))
    runs = []
    for inserts in ("inline", "background"):
        cfg = IceCacheConfig(index=index, budget=16, page_size=4, sink=4, window=8, dense_layers=(0,),
                             insert_every=4, inserts=inserts)
        cache = IceCache(model.config, cfg)
        runs.append(_generate(model, ids, 24, cache))
        cache.close()
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def test_insert_every_is_checked_and_counted_against_the_context():
    with pytest.raises(ConfigError, match="insert_every"):
        IceCacheConfig(insert_every=0)
    small = make_tiny_llama(seed=0, max_position_embeddings=96)
    with pytest.raises(ConfigError, match=r"insert_every - 1 \(4 \+ 16 \+ 64 \+ 15 = 99\)"):
        IceCache(small.config, IceCacheConfig(budget=16, window=64, insert_every=16))
