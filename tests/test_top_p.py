"""Adaptive budget (`IceCacheConfig.top_p`, `icecache.core.top_p`): the cut against a brute-force reference,
the config's checks, and a decode step's attention against a brute-force selection and softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache import IceCache, IceCacheConfig
from icecache.core.errors import ConfigError
from icecache.core.top_p import pages_within_mass
from icecache.runtime.attention import use_attention


def _brute_cut(sizes: list[int], scores: list[float], scale: float, top_p: float) -> int:
    """The fewest leading pages whose mass n * exp(scale * (s - best)) reaches top_p of all (a plain loop)."""
    finite = [s for s in scores if math.isfinite(s)]
    if not scores:
        return 0
    if not finite:
        return len(scores)
    best = max(finite)
    weights = [n * math.exp(scale * (s - best)) if math.isfinite(s) else 0.0 for n, s in zip(sizes, scores)]
    total = sum(weights)
    running = 0.0
    for i, w in enumerate(weights):
        running += w
        if running >= top_p * total * (1 - 1e-9):
            return i + 1
    return len(scores)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 16), min_size=0, max_size=30),
    raw=st.lists(st.floats(-50, 50), min_size=30, max_size=30),
    unscored=st.integers(0, 5),
    scale=st.floats(0.01, 2.0),
    top_p=st.floats(0.01, 1.0),
)
def test_cut_is_the_shortest_prefix_reaching_top_p(sizes, raw, unscored, scale, top_p):
    k = len(sizes)
    scores = sorted(raw[:k], reverse=True)
    for i in range(max(0, k - unscored), k):  # unscored pages come last
        scores[i] = -math.inf
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    got = pages_within_mass(indptr, np.array(scores, np.float32), scale, top_p)
    s32 = [float(np.float32(s)) for s in scores]
    assert 0 <= got <= k
    if not any(math.isfinite(s) for s in s32):
        assert got == _brute_cut(sizes, s32, scale, top_p) == k
        return
    best = max(s for s in s32 if math.isfinite(s))
    weights = [n * math.exp(scale * (s - best)) if math.isfinite(s) else 0.0 for n, s in zip(sizes, s32)]
    target = top_p * math.fsum(weights)
    # exact sums (fsum): the kept prefix reaches the target and one page fewer does not, up to rounding (the two
    # sum in different orders, so a page whose prefix lands within ~1e-9 of the target may go either way)
    assert got >= 1 and math.fsum(weights[:got]) >= target * (1 - 1e-9), (got, weights, target)
    assert math.fsum(weights[: got - 1]) < target * (1 + 1e-9), (got, weights, target)
    if all(abs(math.fsum(weights[:j]) - target) > 1e-6 * target for j in (got - 1, got)):  # clear of the edge
        assert got == _brute_cut(sizes, s32, scale, top_p)


def test_one_dominant_page_is_enough_and_top_p_one_keeps_every_scored_page():
    indptr = np.array([0, 4, 8, 12, 16], np.int64)
    assert pages_within_mass(indptr, np.array([40.0, 1.0, 0.5, 0.2], np.float32), 1.0, 0.9) == 1
    scores = np.array([3.0, 1.0, 0.5, -np.inf], np.float32)  # masses 4, 0.54, 0.33, 0 (shares .82, .11, .07)
    assert pages_within_mass(indptr, scores, 1.0, 0.8) == 1
    assert pages_within_mass(indptr, scores, 1.0, 0.9) == 2
    assert pages_within_mass(indptr, scores, 1.0, 1.0) == 3  # the unscored page weighs nothing
    flat = np.array([1.0, 1.0, 1.0, 1.0], np.float32)  # equal masses: p of the pages
    assert pages_within_mass(indptr, flat, 1.0, 0.5) == 2
    assert pages_within_mass(indptr, np.full(4, -np.inf, np.float32), 1.0, 0.5) == 4  # nothing to estimate
    assert pages_within_mass(np.zeros(1, np.int64), np.zeros(0, np.float32), 1.0, 0.5) == 0


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, True, "0.9", float("nan")])
def test_bad_top_p_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"IceCacheConfig.top_p must be None or a number in \(0, 1\]"):
        IceCacheConfig(top_p=bad)


def test_top_p_decode_step_equals_brute_force_selection_cut_and_softmax():
    """Exact pager, one-token pages, GQA union: a page's estimate is then its token's exp(scale * best q.k over
    the group). Per KV head the step attends sink + window + the shortest prefix of the top-B tokens whose
    estimated mass reaches p, which a brute force over the dense prefill's keys reproduces; and p cuts tokens."""
    model = make_tiny_llama(seed=7)
    T, S, W, B, p = 160, 4, 16, 24, 0.6
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(3))
    cfg = IceCacheConfig(index="exact", budget=B, page_size=1, sink=S, window=W, dense_layers=(0,), threads=1, top_p=p)
    cache = IceCache(model.config, cfg)
    with use_attention(model), torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    cache.workers.wait_all()
    from transformers import DynamicCache

    dense = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=dense, use_cache=True)
    n_rep = model.config.num_attention_heads // model.config.num_key_value_heads
    D = model.config.head_dim
    scale = D**-0.5
    q = 4 * torch.randn(1, model.config.num_attention_heads, 1, D, generator=torch.Generator().manual_seed(11))
    kept_sizes = []
    for layer_idx in (1, 2, 3):
        out = cache.layers[layer_idx].attend(q, scale, None)[0, 0]  # [Hq, D]
        for h in range(model.config.num_key_value_heads):
            K, V = dense.layers[layer_idx].keys[0, h], dense.layers[layer_idx].values[0, h]
            group = q[0, h * n_rep : (h + 1) * n_rep, 0]
            middle = torch.arange(S, T - W)
            best = (group @ K[middle].T).max(0).values  # [m]
            order = torch.argsort(best, descending=True, stable=True)[:B]
            n_keep = _brute_cut([1] * B, best[order].tolist(), scale, p)
            kept_sizes.append(n_keep)
            keep = torch.cat([torch.arange(S), middle[order[:n_keep]], torch.arange(T - W, T)])
            for g in range(n_rep):
                w = torch.softmax((K[keep] @ group[g]) * scale, dim=0)
                torch.testing.assert_close(out[h * n_rep + g], w @ V[keep], atol=2e-5, rtol=1e-4)
    cache.close()
    assert min(kept_sizes) < B, kept_sizes  # the cut happened (the test would not notice a no-op otherwise)


def test_stats_report_tokens_per_selection_below_the_budget_with_top_p():
    model = make_tiny_llama(seed=5)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    per_selection = {}
    for top_p in (None, 0.5):
        cfg = IceCacheConfig(index="mdci", budget=64, page_size=8, sink=4, window=16, dense_layers=(0,), threads=1, top_p=top_p)
        cache = IceCache(model.config, cfg)
        with use_attention(model), torch.no_grad():
            out = model(ids, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(4):
                tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        stats = cache.stats()
        cache.close()
        assert stats["selections"] == 4 * 3 * model.config.num_key_value_heads  # steps x sparse layers x heads
        assert stats["tokens_per_selection"] == stats["tokens_selected"] / stats["selections"]
        per_selection[top_p] = stats["tokens_per_selection"]
    assert 56 <= per_selection[None] <= 64  # whole pages of <= 8 tokens within the budget
    assert per_selection[0.5] < per_selection[None]


def test_eval_summary_reports_tokens_attended_under_top_p():
    from icecache.eval.runner import markdown, summarize

    base = dict(task="passkey", variant="-", length=4000, tokens=4000, budget=256, device_kv_bytes=1, full_kv_bytes=4)
    rows = [dict(base, method="icecache", sample=i, score=1.0, tokens_per_selection=t, top_p=0.9) for i, t in enumerate((100.0, 140.0))]
    rows += [dict(base, method="exact", sample=0, score=1.0, tokens_per_selection=250.0)]
    summary = {e["method"]: e for e in summarize(rows)}
    assert summary["icecache"]["tokens_per_selection"] == 120.0 and summary["icecache"]["top_p"] == 0.9
    table = markdown(list(summary.values()))
    assert "top-p 0.9: 120 tok (2)" in table
    assert "250 tok" not in table  # without top_p the budget is what a step attends: no column noise


def test_ruler_run_signature_names_top_p_only_when_set():
    """A run made before `top_p` existed (no such key) resumes under the default config; a top-p run is a
    different run."""
    from icecache.eval.ruler.runner import RulerSpec

    spec = RulerSpec(model="m", tasks=["vt"], lengths=[4096], samples=1, methods=["icecache"], budgets=[64])
    assert "top_p" not in spec.signature()["config"]
    spec.config = IceCacheConfig(top_p=0.9)
    assert spec.signature()["config"]["top_p"] == 0.9
