"""Semantics of the sparse decode step against brute-force references: GQA modes, layer reuse at a sparse
budget, beam search refused, and building from an already prefilled dense cache (`IceCache.from_dense`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from icecache import IceCache, IceCacheConfig
from icecache.runtime.attention import use_attention


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(model, ids, cfg) -> IceCache:
    cache = IceCache(model.config, cfg)
    with use_attention(model), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    cache.workers.wait_all()
    return cache


def _dense_kv(model, ids) -> DynamicCache:
    dense = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=dense, use_cache=True)
    return dense


def _reference_output(q, K, V, keep, scale):
    """Softmax attention of ``q`` ``[D]`` over positions ``keep`` of ``K``/``V`` ``[T, D]``."""
    idx = torch.tensor(sorted(keep))
    w = torch.softmax((K[idx] @ q) * scale, dim=0)
    return w @ V[idx]


@pytest.mark.parametrize("gqa", ["union", "per-head"])
def test_sparse_step_equals_brute_force_selection_and_attention(gqa):
    """One decode-step attention of a sparse layer (exact pager) equals a brute-force reference: per KV head,
    the middle tokens chosen from the dense prefill's keys (union: the top-B by the best q.k over the group;
    per-head: each query head's own top B/n_rep, attended as a union) plus sink and window, softmax over them."""
    model = make_tiny_llama(seed=7)
    T, S, W, B = 160, 4, 16, 24
    ids = _ids(T, seed=3)
    cfg = IceCacheConfig(index="exact", budget=B, page_size=1, sink=S, window=W, dense_layers=(0,), gqa=gqa, threads=1)
    cache = _prefill(model, ids, cfg)
    dense = _dense_kv(model, ids)
    n_rep = model.config.num_attention_heads // model.config.num_key_value_heads
    D = model.config.head_dim
    scale = D**-0.5
    q = torch.randn(1, model.config.num_attention_heads, 1, D, generator=torch.Generator().manual_seed(11))
    for layer_idx in (1, 2, 3):
        out = cache.layers[layer_idx].attend(q, scale, None)[0, 0]  # [Hq, D]
        for h in range(model.config.num_key_value_heads):
            K, V = dense.layers[layer_idx].keys[0, h], dense.layers[layer_idx].values[0, h]
            group = q[0, h * n_rep : (h + 1) * n_rep, 0]  # [n_rep, D]
            middle = torch.arange(S, T - W)
            logits = group @ K[middle].T  # [n_rep, m]
            if gqa == "union":
                chosen = set(middle[torch.argsort(logits.max(0).values, descending=True, stable=True)[:B]].tolist())
            else:
                chosen = set()
                for g in range(n_rep):
                    chosen |= set(middle[torch.argsort(logits[g], descending=True, stable=True)[: B // n_rep]].tolist())
            keep = set(range(S)) | chosen | set(range(T - W, T))
            for g in range(n_rep):
                ref = _reference_output(group[g], K, V, keep, scale)
                torch.testing.assert_close(out[h * n_rep + g], ref, atol=2e-5, rtol=1e-4)
    cache.close()


def _attended_positions(model, ids, cfg, steps: int):
    """Decode greedily; returns ``{(step, layer): positions of row 0, KV head 0}`` and which layers selected."""
    import icecache.runtime.layer as layer_module

    cache = _prefill(model, ids, cfg)
    seen: dict[tuple[int, int], tuple] = {}
    selected: list[int] = []
    real_select = layer_module.select_layer

    def spy_select(pagers, queries, budget, gqa, *, layer_idx, **kw):
        selected.append(layer_idx)
        return real_select(pagers, queries, budget, gqa, layer_idx=layer_idx, **kw)

    for layer_idx, kind in enumerate(cache.kind):
        if kind != "sparse":
            continue
        loader = cache.layers[layer_idx].loader
        real_load = loader.load

        def spy_load(stores, positions, indptrs, timer, _layer=layer_idx, _real=real_load):
            seen[(cache.counters["steps"], _layer)] = tuple(np.sort(positions[0][0]).tolist())
            return _real(stores, positions, indptrs, timer)

        loader.load = spy_load
    layer_module.select_layer = spy_select
    try:
        tok = torch.tensor([[5]])
        with use_attention(model), torch.no_grad():
            for _ in range(steps):
                logits = model(tok, past_key_values=cache, use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)
    finally:
        layer_module.select_layer = real_select
        cache.close()
    return seen, selected


def test_layer_reuse_at_a_sparse_budget_shares_the_leaders_selection():
    """IceCache(r) with r = 2 over sparse layers 0-3: layers 1 and 3 attend exactly what their group leaders
    (0 and 2) selected and never select themselves; the two groups attend different tokens. Without reuse the
    same layers pick differently, so a cache that ignored reuse fails here."""
    model = make_tiny_llama(seed=2)
    ids = _ids(200, seed=5)
    base = dict(index="exact", budget=16, page_size=1, sink=4, window=16, dense_layers=(), threads=1)
    steps = 6
    reused, selected = _attended_positions(model, ids, IceCacheConfig(reuse_every=2, **base), steps)
    assert sorted(set(selected)) == [0, 2] and len(selected) == 2 * steps
    for step in range(1, steps + 1):
        assert reused[(step, 1)] == reused[(step, 0)] and reused[(step, 3)] == reused[(step, 2)]
    assert any(reused[(s, 0)] != reused[(s, 2)] for s in range(1, steps + 1))
    plain, selected_plain = _attended_positions(model, ids, IceCacheConfig(reuse_every=1, **base), steps)
    assert sorted(set(selected_plain)) == [0, 1, 2, 3]
    assert any(plain[(s, 1)] != plain[(s, 0)] for s in range(1, steps + 1)), "layers 0 and 1 agree anyway: no teeth"


def test_beam_search_raises_not_implemented(tiny_llama):
    ids = _ids(60)
    cache = IceCache(tiny_llama.config, IceCacheConfig(index="sequential", budget=16, window=8, dense_layers=()))
    with use_attention(tiny_llama), torch.no_grad(), pytest.raises(NotImplementedError, match="beam"):
        tiny_llama.generate(ids, past_key_values=cache, num_beams=2, max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache.close()


# ------------------------------------------------------------------------------- from_dense
def _greedy(model, cache, first_logits, steps):
    out, logits = [], first_logits
    with use_attention(model), torch.no_grad():
        for _ in range(steps):
            tok = int(logits.argmax())
            out.append(tok)
            logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return out


@pytest.mark.parametrize("index", ["mdci", "sequential", "exact"])
def test_from_dense_equals_prefilling_through_the_cache_and_leaves_the_dense_cache_alone(index):
    model = make_tiny_llama(seed=9)
    ids = _ids(180, seed=4)
    cfg = IceCacheConfig(index=index, budget=24, page_size=4, sink=4, window=16, dense_layers=(0,), threads=1)
    through = IceCache(model.config, cfg)
    with use_attention(model), torch.no_grad():
        first = model(ids, past_key_values=through, use_cache=True).logits[0, -1]
    expected = _greedy(model, through, first, 24)
    through.close()
    dense = _dense_kv(model, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in dense.layers]
    for _ in range(2):  # the same dense prefill serves twice, identically
        built = IceCache.from_dense(dense, cfg, model_config=model.config)
        assert _greedy(model, built, first, 24) == expected
        built.close()
    for layer, (k, v) in zip(dense.layers, before):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.keys.shape[-2] == 180


def test_from_dense_serves_several_questions_about_one_document():
    """Prefill a document once; each question extends a copy of the dense cache (dense forward of the question
    only) and builds its IceCache from it: the same tokens as prefilling document + question through IceCache."""
    from icecache.eval.harness import clone_kv

    model = make_tiny_llama(seed=12)
    doc = _ids(150, seed=1)
    cfg = IceCacheConfig(index="mdci", budget=16, page_size=4, sink=4, window=12, dense_layers=(0,), threads=1)
    doc_kv = _dense_kv(model, doc)
    for seed in (2, 3):
        question = _ids(10, seed=seed)
        kv = clone_kv(doc_kv)
        with torch.no_grad():
            first = model(question, past_key_values=kv, use_cache=True).logits[0, -1]
        built = IceCache.from_dense(kv, cfg, model_config=model.config)
        got = _greedy(model, built, first, 16)
        built.close()
        through = IceCache(model.config, cfg)
        with use_attention(model), torch.no_grad():
            ref_first = model(torch.cat([doc, question], 1), past_key_values=through, use_cache=True).logits[0, -1]
        assert torch.allclose(first, ref_first, atol=1e-4) and got == _greedy(model, through, ref_first, 16)
        through.close()
    assert doc_kv.get_seq_length() == 150


def test_from_dense_refuses_what_is_not_a_prefilled_dense_cache_in_one_line():
    from icecache.core.errors import InputError, InputTypeError

    model = make_tiny_llama(seed=9)
    cfg = IceCacheConfig(budget=16, page_size=4, sink=4, window=12, dense_layers=(0,), threads=1)
    shallow = _dense_kv(make_tiny_llama(seed=9, num_hidden_layers=2), _ids(40))
    for dense, error, message in ((None, InputTypeError, "must be a transformers Cache .*got NoneType"),
                                  ({"layers": []}, InputTypeError, "got dict"),
                                  (DynamicCache(), InputError, "holds no tokens"),
                                  (shallow, InputError, "has 2 layers; this model has 4")):
        with pytest.raises(error, match=message):
            IceCache.from_dense(dense, cfg, model_config=model.config)


def test_unknown_index_fails_when_the_cache_is_built(tiny_llama):
    from icecache.core.errors import UnknownNameError

    with pytest.raises(UnknownNameError, match="nope"):
        IceCache(tiny_llama.config, IceCacheConfig(index="nope"))
    with pytest.raises(Exception, match="no parameter 'bogus'"):
        IceCache(tiny_llama.config, IceCacheConfig(index="mdci", index_params={"bogus": 1}))


@pytest.mark.parametrize("where", ["query", "leaving key"])
def test_non_finite_queries_or_keys_are_refused_in_one_line(where):
    """A NaN in the step's query, or in the key that leaves the window for the host pages, is an InputError
    naming the layer (not a silent selection over garbage)."""
    from icecache.core.errors import InputError

    model = make_tiny_llama(seed=7)
    cfg = IceCacheConfig(index="exact", budget=8, page_size=1, sink=2, window=8, dense_layers=(0,), threads=1)
    cache = _prefill(model, _ids(40), cfg)
    layer = cache.layers[1]
    D = model.config.head_dim
    if where == "query":
        q = torch.zeros(1, model.config.num_attention_heads, 1, D)
        q[0, 1, 0, 3] = float("nan")
        with pytest.raises(InputError, match="layer 1: the model produced NaN/inf queries"):
            layer.attend(q, D**-0.5, None)
    else:
        layer.keys[0, 0, layer.ring_slot(layer.length - layer.window), 5] = float("inf")
        with pytest.raises(InputError, match="layer 1: the model produced NaN/inf keys"):
            layer.take_leaving(layer.length - layer.window)
    cache.close()
