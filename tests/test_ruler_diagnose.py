"""Loss classification of RULER samples: the decision rule, the exhaustive page ranking, answer positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache import make_pager
from icecache.eval.ruler.diagnose import Replay, _exhaustive_pages, answer_positions, classify


def test_classes_follow_the_reference_methods():
    r = lambda s, p: Replay(search_recall=s, pages_recall=p, oracle_recall=1.0, steps=5)
    assert classify(0.0, 1.0, r(0.0, 1.0)) == "model"  # full attention fails too
    assert classify(1.0, 0.5, r(0.0, 1.0)) == "budget"  # the exact top-B oracle fails too
    assert classify(1.0, 1.0, r(0.2, 0.9)) == "search miss"  # a perfect ranking of its own pages had it
    assert classify(1.0, 1.0, r(0.2, 0.25)) == "page miss"  # even a perfect ranking drops those pages
    # when the sample was answered with the pages ranked exhaustively, that answer decides, not the recalls
    assert classify(1.0, 1.0, r(0.2, 0.9), scan_score=1.0) == "search miss"
    assert classify(1.0, 1.0, r(0.2, 0.9), scan_score=0.5) == "page miss"
    assert classify(1.0, 1.0, r(0.2, 0.25), scan_score=1.0) == "search miss"
    assert classify(0.0, 1.0, r(0.2, 0.9), scan_score=1.0) == "model" and classify(1.0, 0.0, None, scan_score=1.0) == "budget"


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
