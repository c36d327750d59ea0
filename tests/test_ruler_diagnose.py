"""Loss classification of RULER samples: the decision rule, the exhaustive page ranking, answer positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from icecache import make_pager
from icecache.eval.ruler.diagnose import Replay, _exhaustive_pages, answer_positions, classify, needs_replay


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
