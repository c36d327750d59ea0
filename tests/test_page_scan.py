"""`icecache.indexes.page_scan`: M-DCI's pages ranked by scoring every key (``mdci[search=exhaustive]``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_layer_select_is_each_pagers_own
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icecache.core.errors import ConfigError
from icecache.indexes import make_pager
from icecache.indexes.mdci import MDCIPager

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def keys(seed: int, n: int, d: int = 16, clusters: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=g) * 2
    return centres[torch.randint(0, clusters, (n,), generator=g)] + 0.4 * torch.randn(n, d, generator=g)


def brute_force_page_scores(pager: MDCIPager, q: torch.Tensor) -> dict[int, float]:
    """Each live page's best ``max_g q.k``, from the page table's own lists and a float64 product."""
    X = torch.from_numpy(pager.index.data()).double()
    best = (q.double() @ X.T).amax(0)
    return {page: float(best[torch.from_numpy(pos)].max()) for page, pos in pager.table.as_dict().items()}


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 5000), g=st.integers(1, 4), budget=st.integers(0, 300),
       inserted=st.integers(0, 120), page_size=st.sampled_from([1, 4, 16]), threads=st.integers(1, 3))
def test_ranking_is_the_brute_force_page_order(seed, n, g, budget, inserted, page_size, threads):
    """Pages best first by their best key, every key scored (on 1-3 threads; also after inserts, which split and
    move pages); the scores are the brute-force ones, the pages taken are the best ``budget`` of them, and the
    selection keeps the budget rule."""
    pager = make_pager("mdci", head_dim=16, page_size=page_size, search="exhaustive", seed=seed)
    pager.select_threads = threads
    pager.build(keys(seed, n))
    pager.insert(keys(seed + 1, inserted) * 1.5)
    q = keys(seed + 2, g)
    ids, scores = pager._rank_pages(q, budget)
    ref = brute_force_page_scores(pager, q)
    assert len(ids) == min(budget, len(ref)) and len(set(ids.tolist())) == len(ids)
    np.testing.assert_allclose(scores, [ref[int(i)] for i in ids], rtol=1e-4, atol=1e-4)
    assert (np.diff(scores) <= 0).all()
    if 0 < len(ids) < len(ref):  # nothing left out scores above the last page taken
        rest = max(v for page, v in ref.items() if page not in set(ids.tolist()))
        assert rest <= float(scores[-1]) + 1e-4
    sel = pager.select(q, budget)
    assert len(sel.positions) <= max(budget, 0)
    assert sel.pages.tolist() == ids[: len(sel.pages)].tolist()


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 1500), budget=st.integers(1, 300))
def test_same_pages_as_a_tree_search_that_sees_everything(seed, n, budget):
    """The pages are M-DCI's; with an unbounded field of view the tree's descent scores every key too, so both
    searches rank the same pages with the same scores (ties may order differently)."""
    fast = make_pager("mdci", head_dim=16, search="exhaustive", seed=seed)
    tree = make_pager("mdci", head_dim=16, seed=seed, field_of_view=10**9, prop_to_retrieve=1.0)
    for pager in (fast, tree):
        pager.build(keys(seed, n))
    assert fast.table.as_dict().keys() == tree.table.as_dict().keys()
    q = keys(seed + 3, 3)
    a, b = fast.select(q, budget), tree.select(q, budget)
    np.testing.assert_allclose(a.scores.numpy(), b.scores.numpy(), rtol=1e-4, atol=1e-4)


@FAST
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4), budget=st.integers(1, 300),
       threads=st.integers(1, 3), inserted=st.integers(0, 40), seed=st.integers(0, 10_000))
def test_layer_select_equals_each_pagers_own(sizes, budget, threads, inserted, seed):
    """All heads of a layer ranked in one compiled call (1-3 threads) give each head its own `select_arrays`."""
    pagers = [make_pager("mdci", head_dim=16, seed=h, search="exhaustive") for h in range(len(sizes))]
    for h, (pager, n) in enumerate(zip(pagers, sizes)):
        pager.select_threads = threads
        pager.build(keys(seed + h, n))
        pager.insert(keys(seed + 100 + h, inserted) * 1.5)
    q = keys(seed + 7, 3 * len(sizes)).reshape(1, len(sizes), 3, 16)
    assert MDCIPager.select_layer_positions(pagers, q[0], budget) is not None
    assert_layer_select_is_each_pagers_own(pagers, q, budget)


def test_mixed_searches_and_bad_values():
    """A layer mixing tree and exhaustive pagers is selected head by head; a bad ``search`` is a one-line error."""
    q = keys(0, 6).reshape(2, 3, 16)
    mixed = [make_pager("mdci", head_dim=16, search="exhaustive"), make_pager("mdci", head_dim=16)]
    for pager in mixed:
        pager.build(keys(1, 200))
    assert MDCIPager.select_layer_positions(mixed, q, 64) is None
    empty = [make_pager("mdci", head_dim=16, search="exhaustive") for _ in range(2)]
    empty[0].build(keys(1, 200))
    assert MDCIPager.select_layer_positions(empty, q, 64) is None
    with pytest.raises(ConfigError, match="search must be one of tree, exhaustive") as err:
        make_pager("mdci", head_dim=16, search="full")
    assert "\n" not in str(err.value)
