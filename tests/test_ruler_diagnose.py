"""Loss classification of RULER samples: the decision rule, the exhaustive page ranking, answer positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given
from hypothesis import strategies as st

from icecache import IceCacheConfig, make_pager
from icecache.eval.harness import run_prefill
from icecache.eval.methods import get_method
from icecache.eval.ruler.diagnose import Replay, _exhaustive_pages, answer_positions, classify, needs_replay, replay


def test_classes_follow_the_reference_methods():
    r = lambda s, p: Replay(search_recall=s, pages_recall=p, oracle_recall=1.0, steps=5)
    assert classify(0.0, 0.0, 1.0, r(0.0, 1.0)) == "model"  # full attention fails too
    assert classify(0.0, 1.0, 0.5, r(0.0, 1.0)) != "budget"  # the oracle answers in part: more than the method
    assert classify(0.5, 1.0, 0.5, r(0.0, 1.0)) == "budget"  # the exact top-B oracle does no better
    assert classify(0.0, 1.0, 1.0, r(0.2, 0.9)) == "search miss"  # a perfect ranking of its own pages had it
    assert classify(0.0, 1.0, 1.0, r(0.2, 0.25)) == "page miss"  # even a perfect ranking drops those pages
    # when the sample was answered with the pages ranked exhaustively, that answer decides, not the recalls
    assert classify(0.0, 1.0, 1.0, r(0.2, 0.9), scan_score=1.0) == "search miss"
    assert classify(0.0, 1.0, 1.0, r(0.2, 0.9), scan_score=0.5) == "page miss"
    assert classify(0.0, 1.0, 1.0, r(0.2, 0.25), scan_score=1.0) == "search miss"
    assert classify(0.0, 0.0, 1.0, r(0.2, 0.9), scan_score=1.0) == "model" and classify(0.0, 1.0, 0.0, None, scan_score=1.0) == "budget"


def test_partial_credit_losses_are_classified_against_the_references_scores():
    """A sample full attention answers in part (fwe: 2 of 3 words) and the method less is not the model's loss."""
    r = Replay(search_recall=0.2, pages_recall=0.25, oracle_recall=1.0, steps=5)
    assert classify(1 / 3, 2 / 3, 2 / 3, r) == "page miss"
    assert classify(1 / 3, 2 / 3, 2 / 3, r, scan_score=2 / 3) == "search miss"  # as high as both references
    assert classify(1 / 3, 2 / 3, 1.0, r, scan_score=2 / 3) == "search miss"
    assert classify(1 / 3, 2 / 3, 2 / 3, r, scan_score=0.5) == "page miss"
    assert classify(1 / 3, 1 / 3, 1.0, r) == "model" and classify(1 / 3, 2 / 3, 1 / 3, r) == "budget"
    assert classify(0.5, 0.25, 0.25, r) == "model"  # the method beat both: still not ours


@given(score=st.sampled_from([0.0, 0.25, 1 / 3, 0.5, 2 / 3, 0.75]), full=st.sampled_from([0.0, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 1.0]),
       oracle=st.sampled_from([0.0, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 1.0]), scan=st.none() | st.sampled_from([0.0, 0.5, 1.0]))
def test_a_replay_decides_exactly_when_both_references_beat_the_method(score, full, oracle, scan):
    replay = Replay(search_recall=0.1, pages_recall=0.9, oracle_recall=1.0, steps=3)
    cls = classify(score, full, oracle, replay, scan_score=scan)
    assert (cls in ("search miss", "page miss")) == needs_replay(score, full, oracle)
    assert cls == ("model" if full <= score else "budget" if oracle <= score else cls)


def test_exhaustive_page_ranking_is_the_best_whole_pages_within_budget():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(200, 8, generator=g)
    pager = make_pager("sequential", head_dim=8, page_size=8, seed=0)
    pager.build(keys)
    q = torch.randn(3, 8, generator=g)
    chosen = _exhaustive_pages(pager, keys, q, budget=40)
    assert len(chosen) == 40  # five whole pages of 8
    best = (q @ keys.T).max(0).values
    page_best = sorted(((float(best[p].max()), i) for i, p in pager.table.as_dict().items()), reverse=True)
    expected = np.concatenate([pager.table.as_dict()[i] for _, i in page_best[:5]])
    assert sorted(chosen.tolist()) == sorted(expected.tolist())


@pytest.mark.model
def test_answer_positions_hold_the_answer_tokens(smollm2):
    from icecache.eval.ruler import make_sample

    _, tok = smollm2
    sample = make_sample("niah_single_2", tok, 1024, index=3, chat_template=True)
    pos = answer_positions(tok, sample)
    ids = tok(sample.prompt)["input_ids"]
    assert pos.size >= 1 and sample.answers[0] in tok.decode([ids[i] for i in range(pos.min(), pos.max() + 1)])


def test_replay_recalls_equal_a_brute_force_count(monkeypatch):
    """`replay`'s three recalls (per sparse layer, and over every step, layer and KV head) equal a count from
    their definitions: of the answer tokens the pager holds (absolute position - sink, below the pager's length),
    the share that (search) the method's select returned, (pages) the pager's own pages take when ranked by their
    best q.k over the GQA group, whole pages in rank order within the budget, (oracle) the budget's best-scoring
    keys take. Keys come from the dense prefill (a few steps keep every held key a prompt key); the queries, the
    pages and the selection are each step's own, recorded under replay's spy."""
    import icecache.runtime.layer as layer_module

    model = make_tiny_llama(seed=5)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    cfg = IceCacheConfig(budget=32, page_size=8, sink=4, window=16, dense_layers=(0,), threads=1, inserts="inline")
    prefill = run_prefill(model, ids, obs_window=cfg.window)
    cache = get_method("icecache").cache(model, prefill, cfg)
    cache.workers.wait_all()
    calls = []
    real_select = layer_module.select_layer

    def recording_select(pagers, queries, budget, gqa, *, layer_idx, **kw):
        sel = real_select(pagers, queries, budget, gqa, layer_idx=layer_idx, **kw)
        heads = [(len(p), [pos.tolist() for pos in p.table.as_dict().values()], set(sel.positions[0][h].tolist()))
                 for h, p in enumerate(pagers[0])]
        calls.append((layer_idx, queries[0].detach().double().clone(), heads))
        return sel

    monkeypatch.setattr(layer_module, "select_layer", recording_select)  # replay's spy wraps this one
    # in the sink, across pages, at the pager's end (it holds 181, 182, 183 keys at the three steps: 185 is held
    # from the second step on, 187 never), in the window
    answer = np.array([1, 2, *range(37, 51), 90, 91, 150, 181, 185, 187, 190])
    tokens = [5, 17, 60, 99]
    got = replay(model, prefill, cache, tokens, answer)
    cache.close()

    recalls: dict[int, list[list[float]]] = {}
    for layer, q, heads in calls:
        keys = prefill.kv.layers[layer].keys[0].double()  # [H, T, D] by absolute position
        for h, (n, pages, selected) in enumerate(heads):
            assert cfg.sink + n <= ids.shape[1]  # the pager holds prompt keys only
            held = [int(p) - cfg.sink for p in answer if 0 <= p - cfg.sink < n]
            best = (q[h] @ keys[h, cfg.sink : cfg.sink + n].T).max(0).values.tolist()
            oracle = set(sorted(range(n), key=lambda i: -best[i])[: cfg.budget])
            ranked, used = set(), 0
            for page in sorted(pages, key=lambda pos: -max(best[i] for i in pos)):
                if used + len(page) > cfg.budget:
                    break
                ranked, used = ranked | set(page), used + len(page)
            recalls.setdefault(layer, []).append([sum(i in s for i in held) / len(held) for s in (selected, ranked, oracle)])
    assert got.steps == len(tokens) - 1 and sorted(recalls) == sorted(got.per_layer) == [1, 2, 3]
    assert sorted({n for _, _, heads in calls for n, _, _ in heads}) == [181, 182, 183]  # the ends the answer probes
    assert all(len(rows) == got.steps * 2 for rows in recalls.values())  # every step, both KV heads
    for layer, rows in recalls.items():
        assert got.per_layer[layer] == pytest.approx(tuple(np.mean(rows, 0)), abs=1e-12)
    want = np.mean([row for rows in recalls.values() for row in rows], 0)
    assert (got.search_recall, got.pages_recall, got.oracle_recall) == pytest.approx(tuple(want), abs=1e-12)
    assert 0 < want.min() and want.max() < 1  # neither none nor all: a shifted or cut span changes them
