"""Evaluation harness: shared prefill equals a normal prefill, baselines agree with kvpress, a tiny slice runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache import IceCache, IceCacheConfig
from icecache.eval.harness import clone_kv, decode_forced, decode_greedy, run_prefill
from icecache.eval.methods import FixedScorePager, get_method
from icecache.eval.runner import EvalSpec, bootstrap, markdown, parse_length, run_eval, summarize, wilson
from icecache.runtime.attention import use_attention


def test_wilson_and_bootstrap():
    lo, hi = wilson(8, 10)
    assert 0.49 < lo < 0.5 and 0.94 < hi < 0.95  # the textbook Wilson interval for 8/10
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0
    lo, hi = bootstrap([1.0, 2.0, 3.0, 4.0], seed=1)
    assert 1.0 <= lo < 2.5 < hi <= 4.0
    assert math.isnan(bootstrap([1.0])[0])
    assert parse_length("4k") == 4000 and parse_length("8192") == 8192


def test_fixed_score_pager_keeps_its_choice_and_evicts_later_tokens():
    p = FixedScorePager(4, np.array([0.1, 0.9, 0.5, 0.7]))
    p.build(torch.randn(4, 4))
    assert p.select(torch.randn(2, 4), 2).positions.tolist() == [1, 3]
    p.insert(torch.randn(3, 4))
    assert sorted(p.select(torch.randn(2, 4), 10).positions.tolist()) == [0, 1, 2, 3]  # new tokens evicted


@settings(max_examples=40, deadline=None)
@given(scores=st.lists(st.sampled_from([0.1, 0.2, 0.5, 0.9, -np.inf]), min_size=1, max_size=40),
       inserts=st.lists(st.integers(1, 5), max_size=4), budget=st.integers(1, 50))
def test_fixed_score_pager_selects_the_brute_force_ranking(scores, inserts, budget):
    """At every step (after any inserts), the selection is the best ``budget`` finite scores, ties by position."""
    p = FixedScorePager(4, np.array(scores))
    p.build(torch.randn(len(scores), 4))
    expected = sorted((i for i, s in enumerate(scores) if s > -np.inf), key=lambda i: (-scores[i], i))[:budget]
    for n in [0, *inserts]:
        if n:
            p.insert(torch.randn(n, 4))
        if expected:
            assert p.select(torch.randn(2, 4), budget).positions.tolist() == expected


def test_growing_kv_decodes_bit_for_bit_like_a_dynamic_cache():
    """Full attention's cache appends in place (`growing_kv`); the logits of 300 forced steps (past its first
    spare room of 256) are identical to a `DynamicCache`'s, and the prefill's own K/V are untouched."""
    from icecache.eval.harness import growing_kv

    model = make_tiny_llama(seed=4)
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(2))
    prefill = run_prefill(model, ids, obs_window=16)
    before = [layer.keys.clone() for layer in prefill.kv.layers]
    targets = torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    grown = growing_kv(prefill.kv)
    nll = decode_forced(model, grown, prefill.last_logits, targets)
    assert torch.equal(nll, decode_forced(model, clone_kv(prefill.kv), prefill.last_logits, targets))
    assert grown.get_seq_length() == 150 + 299
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, prefill.kv.layers))


@pytest.mark.parametrize("name", ["exact", "quest", "streaming"])
def test_load_prefill_equals_prefill_through_the_cache(name):
    """Decoding from a shared prefill gives the same tokens/logits as prefilling through the method's cache."""
    model = make_tiny_llama(seed=4)
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(2))
    cfg = IceCacheConfig(budget=16, page_size=4, sink=4, window=16, dense_layers=(0,))
    prefill = run_prefill(model, ids, obs_window=16)
    cache = get_method(name).cache(model, prefill, cfg)
    shared = decode_forced(model, cache, prefill.last_logits, list(range(3, 40)))
    cache.close()
    # reference: the same method's cache prefilled by the model itself
    c = {"exact": cfg.replace(index="exact"), "quest": cfg.replace(index="sequential"),
         "streaming": cfg.replace(index="sequential", window=32, budget=0)}[name]
    ref_cache = IceCache(model.config, c)
    with use_attention(model), torch.no_grad():
        out = model(ids, past_key_values=ref_cache, use_cache=True)
    ref = decode_forced(model, ref_cache, out.logits[0, -1].float(), list(range(3, 40)))
    ref_cache.close()
    torch.testing.assert_close(shared, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, obs, kernel", [("snapkv", 16, 5), ("snapkv[window_size=6;kernel_size=3]", 6, 3)])
def test_snapkv_keeps_what_an_independent_snapkv_keeps(name, obs, kernel):
    """SnapKV from its definition (Li et al. 2024), computed from transformers' eager attention weights rather
    than from our captured queries: the observation window's attention to each earlier position, averaged over
    the window, average-pooled (kernel 5 unless set) and averaged over the GQA group; the top-B middle positions
    are kept for good. Our method's kept set must be exactly that, per (layer, KV head). The variant's
    observation window (6) is shorter than the cache window (16) the prefill captured."""
    model = make_tiny_llama(seed=6)
    T, S, W, B = 180, 4, 16, 24
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(8))
    cfg = IceCacheConfig(budget=B, page_size=4, sink=S, window=W, dense_layers=(0,))
    cache = get_method(name).cache(model, run_prefill(model, ids, obs_window=W), cfg)
    cache.workers.wait_all()  # the pagers are built on the index workers (a busy machine once read them empty)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions  # per layer [1, Hq, T, T]
    finally:
        model.set_attn_implementation(previous)
    n_rep = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer in range(1, 4):
        obs_attn = attentions[layer][0, :, T - obs :, : T - obs].double().mean(1)  # [Hq, T - obs]
        pooled = torch.nn.functional.avg_pool1d(obs_attn[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
        for h in range(model.config.num_key_value_heads):
            score = pooled[h * n_rep : (h + 1) * n_rep].mean(0)[S : T - W]  # the middle positions S .. T-W-1
            expected = set((torch.argsort(score, descending=True, stable=True)[:B] + S).tolist())
            pager = cache.layers[layer].pagers[0][h]
            kept = set((pager.select(torch.zeros(1, 16), B).positions + S).tolist())
            assert kept == expected, (layer, h, sorted(kept ^ expected))
    cache.close()


def test_full_method_clone_leaves_the_prefill_untouched():
    model = make_tiny_llama()
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    prefill = run_prefill(model, ids)
    before = prefill.kv.layers[0].keys.clone()
    a = decode_greedy(model, clone_kv(prefill.kv), prefill.last_logits, 10)
    b = decode_greedy(model, clone_kv(prefill.kv), prefill.last_logits, 10)
    assert a == b and torch.equal(prefill.kv.layers[0].keys, before) and prefill.kv.get_seq_length() == 60


def test_kvpress_agrees_with_our_baselines_on_kept_tokens():
    pytest.importorskip("kvpress")
    from icecache.eval.kvpress_check import _kept_positions, _our_kept, _press

    model = make_tiny_llama(seed=1)
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    cfg = IceCacheConfig(budget=64, sink=4, window=32, dense_layers=())
    prefill = run_prefill(model, ids, obs_window=cfg.window)
    from transformers import DynamicCache


    for name, min_overlap in (("streaming", 1.0), ("snapkv", 0.9)):
        ours = get_method(name).cache(model, prefill, cfg)
        pressed = DynamicCache()
        with _press(name, 1 - (4 + 32 + 64) / 400, cfg)(model), use_attention(model, "sdpa"), torch.no_grad():
            model(ids, past_key_values=pressed, use_cache=True)
        overlaps = []
        for layer in range(4):
            for h in range(2):
                a = set(_our_kept(ours, layer, h, 400).tolist())
                b = set(_kept_positions(prefill.kv.layers[layer].keys[0, h], pressed.layers[layer].keys[0, h]).tolist())
                overlaps.append(len(a & b) / len(a | b))
        ours.close()
        assert np.mean(overlaps) >= min_overlap, (name, overlaps)


@pytest.mark.model
def test_harness_slice_on_the_embedded_model(smollm2):
    """One task, two methods, a tiny sample: the harness cannot silently break."""
    model, tok = smollm2
    spec = EvalSpec(task="passkey", methods=["full", "quest"], budgets=[64], lengths=[600], samples=2,
                    config=IceCacheConfig(index="sequential"))
    rows = run_eval(model, tok, spec, progress=False)
    assert len(rows) == 4 and {r["method"] for r in rows} == {"full", "quest"}
    summ = summarize(rows)
    full = next(e for e in summ if e["method"] == "full")
    assert full["score"] == 1.0 and full["n"] == 2  # the model finds the key with full attention at 600 tokens
    quest = next(e for e in summ if e["method"] == "quest")
    assert 0 < quest["device_kv_fraction"] < 1
    assert "| quest | 64 |" in markdown(summ)
    # index="auto" rows say which select it chose for the prompt
    auto = EvalSpec(task="passkey", methods=["icecache"], budgets=[64], lengths=[600], samples=1,
                    config=IceCacheConfig(index="auto", index_params={"crossover": 10_000}))
    assert [r["auto_choice"] for r in run_eval(model, tok, auto, progress=False)] == ["mdci[search=exhaustive]"]
    assert all("auto_choice" not in r for r in rows)


def test_eval_spec_validates():
    with pytest.raises(ValueError, match="task"):
        EvalSpec(task="nope", methods=["full"], budgets=[64], lengths=[100])
    with pytest.raises(ValueError, match="unknown method"):
        EvalSpec(task="passkey", methods=["magic"], budgets=[64], lengths=[100])
    s = EvalSpec(task="longgen", methods=["quest"], budgets=[64], lengths=[100])
    assert s.methods[0] == "full"


def test_eval_refuses_lengths_past_the_models_context():
    """The tiny model states 4096 positions; the refusal comes before any sample is made or prefilled."""
    from icecache.core.errors import ConfigError

    spec = EvalSpec(task="passkey", methods=["full"], budgets=[64], lengths=[1000, 5000, 4097])
    with pytest.raises(ConfigError, match=r"length 4097, 5000 is past the model's context of 4096 tokens"):
        run_eval(make_tiny_llama(seed=1), None, spec, progress=False)


def test_index_params_tune_only_the_methods_of_that_pager():
    from icecache.eval.methods import for_pager

    cfg = IceCacheConfig(index="mdci", index_params={"field_of_view": 7})
    assert for_pager(cfg, "mdci", reuse_every=2).index_params == {"field_of_view": 7}
    assert for_pager(cfg, "sequential").index_params == {} and for_pager(cfg, "exact").index == "exact"
    model = make_tiny_llama()
    ids = torch.randint(3, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    pre = run_prefill(model, ids)
    for name in ("icecache", "quest", "streaming", "snapkv", "exact"):
        cache = get_method(name).cache(model, pre, cfg.replace(budget=32, dense_layers=()))
        pager = cache.layers[0].pagers[0][0]
        if name == "icecache":
            assert pager.params.query.field_of_view == 7
        else:
            assert not hasattr(pager, "params")
        cache.close()


def test_method_variants_change_only_their_settings():
    """``name[key=value;...]``: config fields and pager parameters for that row; one-line errors otherwise."""
    from icecache.core.errors import ConfigError
    from icecache.core.spec import split_items

    cfg = IceCacheConfig(index="mdci", index_params={"preset": "icecache"})
    ice = get_method("icecache[page_size=4;field_of_view=200]")
    ice.check(cfg)
    got = ice.configure(cfg)
    assert (got.index, got.index_params, got.page_size) == ("mdci", {"preset": "icecache", "field_of_view": 200}, 4)
    assert get_method("quest[page_size=4]").configure(cfg).page_size == 4
    assert get_method("icecache:ivf[nprobe=3]").configure(cfg).index_params == {"nprobe": 3}  # not mdci's preset
    assert get_method("full[window=8]").uses_budget is False
    assert split_items("full, icecache[page_size=4,field_of_view=200],quest") == [
        "full", "icecache[page_size=4,field_of_view=200]", "quest"]
    for name, message in [("quest[field_of_view=3]", "no parameter 'field_of_view'"),
                          ("full[field_of_view=3]", "runs no pager"), ("icecache[budget=3]", "cannot set budget"),
                          ("icecache[index=exact]", "cannot set index"), ("icecache[]", "empty brackets"),
                          ("icecache[page_size=0]", "page_size must be in"), ("icecache[page_size]", "key=value"),
                          ("snapkv[window_size=0]", "window_size must be an int >= 1"),
                          ("snapkv[kernel_size=4]", "kernel_size must be odd"),
                          ("snapkv[nprobe=3]", "its options: window_size, kernel_size")]:
        with pytest.raises(ConfigError, match=message):
            get_method(name).check(cfg)
    with pytest.raises(ValueError, match="unknown method"):
        get_method("magic[page_size=4]")
