"""The ``mdci`` pager: page invariants (docs/index.md, Invariants, property 11), selection against brute force,
the move journal, incremental inserts, determinism, edge cases."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np
import pytest
import torch
from conftest import assert_layer_select_is_each_pagers_own
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icecache.core.errors import ConfigError, InputError
from icecache.core.metrics import attention_recall
from icecache.indexes import make_pager
from icecache.indexes.dci import DCIParams, SearchConfig
from icecache.indexes.mdci import MDCIPager

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def keys(seed: int, n: int, d: int = 16, scale: float = 1.0, clusters: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if clusters:
        c = torch.randn(clusters, d, generator=g) * 2
        x = c[torch.randint(0, clusters, (n,), generator=g)] + 0.4 * torch.randn(n, d, generator=g)
    else:
        x = torch.randn(n, d, generator=g)
    return x * scale * (0.5 + torch.rand(n, 1, generator=g))


def exhaustive(d: int, P: int = 16, **kw) -> MDCIPager:
    return make_pager("mdci", head_dim=d, page_size=P, field_of_view=10**9, prop_to_retrieve=1.0, **kw)  # type: ignore[return-value]


def assert_pages_ok(p: MDCIPager, just_built: bool = False) -> None:
    """Property 11 (docs/index.md, Invariants): every token in exactly one page of its cluster, 1 <= size <= P,
    pages contiguous in projection order with max key of page i <= min key of page i+1; bulk load: ceil(c/P)
    near-equal pages."""
    p.table.check()
    p.index.check()  # includes contiguity of pages in run-0 order and one cluster per page
    idx, tb = p.index, p.table
    n = len(p)
    assert tb.num_positions == n
    par = idx.parents()
    for node in [-1, *np.flatnonzero(idx.subtree_sizes() > 0).tolist()]:
        ids, _ = idx.cluster(node)
        if len(ids) == 0:
            continue
        assert (par[ids] == node).all()
        pages = list(dict.fromkeys(tb.page_of(ids).tolist()))  # in run-0 order
        assert int(tb.sizes(pages).sum()) == len(ids)  # the cluster's pages hold exactly its points
        if p.params.page_split == "projection":
            for a, b in pairwise(pages):
                assert idx.projections()[tb.positions(a), 0].max() <= idx.projections()[tb.positions(b), 0].min()
        if just_built:
            sizes = tb.sizes(pages)
            assert len(pages) == -(-len(ids) // p.page_size)
            assert sizes.max() - sizes.min() <= 1
    for pos in tb.as_dict().values():
        assert 1 <= len(pos) <= p.page_size
        assert len(set(par[pos].tolist())) == 1, "a page mixes clusters"


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(0, 2500), P=st.sampled_from([1, 4, 16]), d=st.sampled_from([4, 16]),
       split=st.sampled_from(["projection", "2means"]))
def test_bulk_pages(seed, n, P, d, split):
    p = make_pager("mdci", head_dim=d, page_size=P, seed=seed, page_split=split)
    p.build(keys(seed, n, d, clusters=8))
    assert_pages_ok(p, just_built=True)


@FAST
@given(seed=st.integers(0, 2**16), n0=st.integers(0, 600),
       batches=st.lists(st.tuples(st.integers(1, 150), st.floats(0.3, 4.0)), min_size=1, max_size=5),
       P=st.sampled_from([1, 2, 5, 16]), split=st.sampled_from(["projection", "2means"]))
def test_incremental_pages_and_journal(seed, n0, batches, P, split):
    """After build + random inserts (rekeys included) the pages stay valid, and replaying the move journal
    onto ``{(page, slot): position}`` reproduces the table exactly (what the runtime's host store does)."""
    p = make_pager("mdci", head_dim=8, page_size=P, seed=seed, record_moves=True, page_split=split)
    store: dict[tuple[int, int], int] = {}

    def replay() -> None:
        for mv in p.table.take_moves():
            if mv.src_page >= 0:
                assert store.pop((mv.src_page, mv.src_slot)) == mv.position
            if mv.dst_page >= 0:
                store[(mv.dst_page, mv.dst_slot)] = mv.position

    p.build(keys(seed, n0, 8, clusters=5))
    replay()
    for i, (m, scale) in enumerate(batches):
        p.insert(keys(seed + i + 1, m, 8, scale=scale, clusters=3))
        replay()
    assert_pages_ok(p)
    truth = {(pg, s): int(pos) for pg, poss in p.table.as_dict().items() for s, pos in enumerate(poss.tolist())}
    assert store == truth


def test_one_token_inserts_keep_pages_filled():
    """Decoding inserts one token at a time; promotions then take points out of older clusters' pages.
    Those pages merge with a run-0 neighbour when both fit in one page and one is under half full (checked by
    `DCIIndex.check`), so a grown index keeps a B-tree-like page fill (it was 0.56 at 20k tokens, 0.70 with
    merging; 0.89 when built at once) and the move journal still replays exactly."""
    p = make_pager("mdci", head_dim=8, page_size=8, seed=3, record_moves=True)
    x = keys(3, 3000, 8, clusters=6)
    p.build(x[:64])
    store: dict[tuple[int, int], int] = {}
    merges = [0]
    for i in range(64, 3000):
        free_ids = p.table.id_capacity - p.table.num_pages
        p.insert(x[i : i + 1])
        merges[0] += p.table.id_capacity - p.table.num_pages > free_ids  # an insert that left a page id free
        for mv in p.table.take_moves():
            if mv.src_page >= 0:
                assert store.pop((mv.src_page, mv.src_slot), mv.position) == mv.position
            if mv.dst_page >= 0:
                store[(mv.dst_page, mv.dst_slot)] = mv.position
    assert_pages_ok(p)
    assert merges[0] > 0  # pages were emptied by merges (or adoptions) along the way
    assert len(p) / (p.num_pages * p.page_size) > 0.62
    truth = {(pg, s_): int(pos) for pg, poss in p.table.as_dict().items() for s_, pos in enumerate(poss.tolist())}
    assert {k: v for k, v in store.items() if k in truth} == truth


@pytest.mark.parametrize("split", ["projection", "2means"])
def test_split_of_a_full_page(split):
    """A full page splits at used // 2 (8 | 8: in projection order, or balanced 2-means halves), then the
    new token joins one half."""
    p = make_pager("mdci", head_dim=4, page_size=16, page_split=split)
    p.build(keys(0, 16, 4))  # 16 < ceil(1/p0): one level, one cluster, one full page
    assert p.num_pages == 1
    p.insert(keys(1, 1, 4))
    assert_pages_ok(p)
    sizes = sorted(len(v) for v in p.pages().values())
    assert sizes == [8, 9]


def test_page_ids_are_recycled():
    p = make_pager("mdci", head_dim=4, page_size=4, record_moves=True)
    p.build(keys(0, 300, 4, clusters=4))
    p.insert(keys(1, 300, 4, clusters=4, scale=5.0))  # forces a rekey: pages rebuilt by moves
    assert p.index.num_rekeys >= 1
    ids = p.table.page_ids()
    assert len(ids) == p.num_pages and ids.max() < p.table.id_capacity
    # Every id below id_capacity is live or on the free list, and freed ids were handed out again.
    moves = p.table.take_moves()
    freed_then_reused = {m.src_page for m in moves if m.src_page >= 0} & {m.dst_page for m in moves if m.src_page >= 0}
    assert freed_then_reused
    assert_pages_ok(p)


# ---------------------------------------------------------------------------------------------- selection
def oracle_pages(p: MDCIPager, q: torch.Tensor, budget: int) -> list[int]:
    """Pages ranked by their exact best token (max over the group of q.k), ties by id, under the budget."""
    X = torch.from_numpy(p.index.data())
    s = (q @ X.T).amax(0).numpy().astype(np.float64)
    best = {pg: s[pos].max() for pg, pos in p.table.as_dict().items()}
    order = sorted(best, key=lambda pg: (-best[pg], pg))
    out, total = [], 0
    for pg in order:
        size = p.table.size(pg)
        if total + size > budget:
            break
        out.append(pg)
        total += size
    return out


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 1500), g=st.integers(1, 4), budget=st.integers(0, 300), inserted=st.integers(0, 200))
def test_exhaustive_selection_matches_oracle(seed, n, g, budget, inserted):
    p = exhaustive(16, seed=seed)
    p.build(keys(seed, n, clusters=10))
    p.insert(keys(seed + 1, inserted, clusters=4))
    q = keys(seed + 2, g)
    sel = p.select(q, budget)
    ref = oracle_pages(p, q, budget)
    # Scores may tie in float32; compare page scores, and pages where scores are distinct.
    X = torch.from_numpy(p.index.data())
    s = (q @ X.T).amax(0)
    got = [float(s[torch.from_numpy(p.table.positions(pg))].max()) for pg in sel.pages.tolist()]
    want = [float(s[torch.from_numpy(p.table.positions(pg))].max()) for pg in ref]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sel.scores.numpy(), np.array(got, np.float32), rtol=1e-5, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(scores=st.lists(st.integers(-3, 3), min_size=1, max_size=60), seed=st.integers(0, 2**16))
def test_page_heap_pops_in_full_sort_order(scores, seed):
    """The ranking kernel heapifies the scored pages and pops the best until one does not fit: the pops come
    in the order of a full sort by (score descending, id ascending), ties (here frequent) included."""
    from icecache.indexes._dci_kernels import heapify_pages, pop_best_page

    rng = np.random.default_rng(seed)
    ids = rng.permutation(200)[: len(scores)].astype(np.int64)  # scored pages in discovery order
    page_best = np.zeros(200, np.float64)
    page_best[ids] = scores
    want = sorted(ids.tolist(), key=lambda p: (-page_best[p], p))
    heap = ids.copy()
    heapify_pages(heap, len(heap), page_best)
    got = [int(pop_best_page(heap, k, page_best)) for k in range(len(heap), 0, -1)]
    assert got == want


def test_selection_ties_follow_page_id():
    """Duplicate keys give equal page scores: the selection takes the lower page ids first, like a full sort."""
    p = exhaustive(8, P=4)
    k = torch.ones(64, 8)  # every token identical: every page scores the same
    p.build(k)
    sel = p.select(torch.ones(1, 8), 12)
    assert sel.pages.tolist() == sorted(p.table.as_dict())[:3]


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 1500), g=st.integers(1, 4), budget=st.integers(0, 300))
def test_exhaustive_mass_ranking_matches_oracle(seed, n, g, budget):
    """page_score="mass": with every token scored, a page's score is sum_t sum_g exp((q_g.k_t - M_g)/sqrt(d))."""
    p = exhaustive(16, seed=seed, page_score="mass")
    p.build(keys(seed, n, clusters=10))
    q = keys(seed + 2, g)
    sel = p.select(q, budget)
    X = torch.from_numpy(p.index.data()).double()
    s = q.double() @ X.T  # [g, n]
    w = torch.exp((s - s.max(1, keepdim=True).values) / 4.0).sum(0)
    mass = {pg: float(w[torch.from_numpy(pos)].sum()) for pg, pos in p.table.as_dict().items()}
    order = sorted(mass, key=lambda pg: (-mass[pg], pg))
    want, total = [], 0
    for pg in order:
        if total + p.table.size(pg) > budget:
            break
        want.append(mass[pg])
        total += p.table.size(pg)
    np.testing.assert_allclose(sel.scores.numpy(), np.array(want, np.float32), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([mass[pg] for pg in sel.pages.tolist()], want, rtol=1e-4, atol=1e-6)


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 3000), g=st.integers(1, 4), budget=st.integers(0, 400),
       beam=st.sampled_from(["shared", "per-query"]), score=st.sampled_from(["max", "mass"]))
def test_default_selection_follows_budget_rule(seed, n, g, budget, beam, score):
    p = make_pager("mdci", head_dim=16, seed=seed, group_beam=beam, page_score=score)
    p.build(keys(seed, n, clusters=12))
    q = keys(seed + 3, g)
    sel = p.select(q, budget)
    assert sel.num_tokens <= budget
    assert len(set(sel.pages.tolist())) == sel.num_pages
    assert (sel.scores[1:] <= sel.scores[:-1]).all()
    for i, pg in enumerate(sel.pages.tolist()):
        np.testing.assert_array_equal(sel.positions[sel.indptr[i] : sel.indptr[i + 1]].numpy(), p.table.positions(pg))
    # Every reported score is the true best q.k of some token of the page, never above the page's max.
    X = torch.from_numpy(p.index.data())
    s = (q @ X.T).amax(0)
    # Every finite score is the true q.k of some token of the page, never above the page's max; pages the
    # descent did not reach come last, with score -inf.
    finite = torch.isfinite(sel.scores)
    assert not (finite[1:] & ~finite[:-1]).any()
    for pg, sc in zip(sel.pages.tolist(), sel.scores.tolist()):
        if sc == float("-inf") or score == "mass":
            continue
        tok = s[torch.from_numpy(p.table.positions(pg))]
        assert sc <= float(tok.max()) + 1e-4 and bool((tok - sc).abs().min() <= 1e-4)
    # The budget rule: unless every page is selected, the next page would not have fitted.
    if sel.num_pages < p.num_pages:
        assert budget - sel.num_tokens < p.page_size
    if budget >= n:
        assert sel.num_pages == p.num_pages


def test_quality_on_clustered_keys():
    """On clustered keys, the default descent finds most of what exhaustive page ranking finds."""
    d = 32
    X = keys(0, 8000, d, clusters=64)
    p = make_pager("mdci", head_dim=d)
    p.build(X)
    ex = exhaustive(d)
    ex.build(X)
    seq = make_pager("sequential", head_dim=d)
    seq.build(X)
    g = torch.Generator().manual_seed(5)
    rec, rec_ex, rec_seq = [], [], []
    for _ in range(20):
        q = X[torch.randint(0, len(X), (3,), generator=g)] + 0.3 * torch.randn(3, d, generator=g)
        for pager, out in ((p, rec), (ex, rec_ex), (seq, rec_seq)):
            out.append(attention_recall(q, X, pager.select(q, 128).positions))
    assert np.mean(rec) >= 0.95 * np.mean(rec_ex)
    assert np.mean(rec) > np.mean(rec_seq)


def test_search_recall_floor_on_many_clusters():
    """A worse search fails here (issue 56: halving M-DCI's beam in `dci_search` and `dci_layer`, with the reported
    field of view unchanged, passed every other fast test). 20k keys in 1,024 clusters (d = 32): the positions the
    tree search selects, against those of the same pages ranked exhaustively (``search=exhaustive``), through the
    single-pager path and the runtime's one-call layer path. Measured 2026-12-07: 0.955 at budget 64 and 0.833 at
    256 (both paths); with the beam halved in either path 0.741 at 64."""
    d, n = 32, 20000
    data, trees, scans = [], [], []
    for seed in (0, 1):
        X = keys(seed, n, d, clusters=1024)
        data.append(X)
        trees.append(make_pager("mdci", head_dim=d))
        scans.append(make_pager("mdci[search=exhaustive]", head_dim=d))
        trees[-1].build(X)
        scans[-1].build(X)
    g = torch.Generator().manual_seed(5)
    for budget, floor in ((64, 0.90), (256, 0.78)):
        single, layer = [], []
        for _ in range(20):
            Q = torch.stack([X[torch.randint(0, n, (3,), generator=g)] + 0.3 * torch.randn(3, d, generator=g)
                             for X in data])  # [2 heads, 3 queries (a GQA group), d]
            fused = MDCIPager.select_layer_positions(trees, Q, budget)
            assert fused is not None
            for h in range(2):
                want = set(scans[h].select(Q[h], budget).positions.tolist())
                single.append(len(want & set(trees[h].select(Q[h], budget).positions.tolist())) / len(want))
                layer.append(len(want & set(fused[h][2].tolist())) / len(want))
        assert np.mean(single) >= floor and np.mean(layer) >= floor, (budget, np.mean(single), np.mean(layer))


# ---------------------------------------------------------------------------------------------- determinism
def _run(job: tuple[int, str]):
    seed, split = job
    p = make_pager("mdci", head_dim=16, seed=seed, record_moves=True, page_split=split)
    p.build(keys(seed, 3000, clusters=20))
    p.insert(keys(seed + 1, 400, clusters=5, scale=2.0))
    sels = [p.select(keys(seed + 2 + i, 3), 128) for i in range(5)]
    return p.pages(), [(s.pages.tolist(), s.positions.tolist(), s.scores.tolist()) for s in sels], p.table.take_moves()


def test_deterministic_for_any_thread_count():
    jobs = [(0, "projection"), (1, "projection"), (2, "2means"), (3, "2means")]
    with ThreadPoolExecutor(1) as ex:
        one = list(ex.map(_run, jobs))
    with ThreadPoolExecutor(2) as ex:
        two = list(ex.map(_run, jobs))
    for (pa, sa, ma), (pb, sb, mb) in zip(one, two):
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
        assert sa == sb and ma == mb


# ---------------------------------------------------------------------------------------------- edge cases
def test_edge_cases():
    p = make_pager("mdci", head_dim=8)
    p.build(torch.zeros(0, 8))
    assert p.select(torch.randn(3, 8), 128).num_pages == 0
    p.insert(torch.randn(1, 8))
    sel = p.select(torch.randn(8), 128)
    assert sel.positions.tolist() == [0]
    assert p.select(torch.randn(8), 0).num_pages == 0
    # Duplicate keys, a zero query, keys longer than any seen before.
    p.build(torch.ones(500, 8))
    assert_pages_ok(p, just_built=True)
    sel = p.select(torch.zeros(2, 8), 64)
    assert 64 - 16 < sel.num_tokens <= 64 and torch.isfinite(sel.scores).all()
    for scale in (10.0, 100.0, 1e4):
        p.insert(torch.randn(40, 8) * scale)
        sel = p.select(torch.randn(3, 8), 128)
        assert torch.isfinite(sel.scores).all() and np.isfinite(p.index.projections()).all()
    assert_pages_ok(p)
    assert p.index.num_rekeys >= 3


def test_registry_params_and_errors():
    p = make_pager("mdci", head_dim=8, page_size=16, seed=3, field_of_view=12, prop_to_retrieve=0.5, p0=0.1)
    assert isinstance(p, MDCIPager) and p.params.query.field_of_view == 12 and p.params.p0 == 0.1
    q = make_pager("mdci", head_dim=8, preset="dci-knn")
    assert q.params.num_comp_indices == 2 and q.params.num_simp_indices == 7
    q.build(keys(0, 500, 8))
    assert_pages_ok(q, just_built=True)
    assert q.select(torch.randn(3, 8), 64).num_tokens <= 64
    with pytest.raises(ConfigError):
        make_pager("mdci", head_dim=8, preset="bogus")
    with pytest.raises(ConfigError):
        make_pager("mdci", head_dim=8, p1=1.5)
    with pytest.raises(InputError):
        p.build(torch.randn(4, 9))
    with pytest.raises(InputError):
        p.select(torch.randn(3, 8), -1)



WIDE_FROM_ICECACHE = {"prop_to_retrieve": 1.0, "fov_scale": 7.5e-3, "fov_min": 60, "fov_max": 200}
SAME_PARAMETERS = {  # each list: ways to ask for one parameter set
    "wide": [
        lambda: MDCIPager(16, seed=3),
        lambda: MDCIPager(16, seed=3, params="wide"),
        lambda: MDCIPager(16, seed=3, preset="wide"),
        lambda: MDCIPager(16, seed=3, params=DCIParams(query=SearchConfig(field_of_view=None, prop_to_retrieve=1.0),
                                                      fov_scale=7.5e-3, fov_min=60, fov_max=200)),
        lambda: MDCIPager(16, seed=3, preset="icecache", **WIDE_FROM_ICECACHE),
        lambda: make_pager("mdci", head_dim=16, seed=3, preset="icecache", **WIDE_FROM_ICECACHE),
    ],
    "icecache, F = 30, mass": [
        lambda: MDCIPager(16, seed=3, params=DCIParams(query=SearchConfig(field_of_view=30, prop_to_retrieve=0.8), page_score="mass")),
        lambda: MDCIPager(16, seed=3, params=DCIParams.preset("icecache").with_overrides(field_of_view=30, page_score="mass")),
        lambda: MDCIPager(16, seed=3, params="icecache", field_of_view=30, page_score="mass"),
        lambda: MDCIPager(16, seed=3, preset="icecache", field_of_view=30, page_score="mass"),
        lambda: make_pager("mdci", head_dim=16, seed=3, preset="icecache", field_of_view=30, page_score="mass"),
    ],
}


@pytest.mark.parametrize("name", list(SAME_PARAMETERS))
def test_params_preset_and_overrides_select_identically(name):
    """``MDCIPager(params=DCIParams(...))``, a preset name (``params=`` or ``preset=``) and keyword overrides
    (directly or through `make_pager`, as ``IceCacheConfig.index_params`` and ``--index-params`` pass them)
    that describe the same parameters build the same pages and select the same pages, tokens and scores."""
    pagers = [make() for make in SAME_PARAMETERS[name]]
    assert all(p.params == pagers[0].params for p in pagers)
    runs = []
    for p in pagers:
        p.build(keys(1, 3000, clusters=20))
        p.insert(keys(2, 300, clusters=5, scale=2.0))  # a rekey
        sels = [p.select(keys(10 + i, 4), budget) for i in range(4) for budget in (64, 256)]
        runs.append((p.pages(), [(s.pages, s.positions, s.indptr, s.scores) for s in sels]))
    pages0, sels0 = runs[0]
    for pages, sels in runs[1:]:
        assert pages.keys() == pages0.keys() and all(torch.equal(pages[k], pages0[k]) for k in pages0)
        for sel, sel0 in zip(sels, sels0):
            assert all(torch.equal(a, b) for a, b in zip(sel, sel0))


def test_params_errors_are_one_line_config_errors():
    listing = r"its parameters: record_moves, params, preset, layer_select, search, num_comp_indices, .*, field_of_view, .*construction_prop_to_retrieve$"
    with pytest.raises(ConfigError, match=r"^pager 'mdci' has no parameter 'bogus'; " + listing):
        make_pager("mdci", head_dim=8, bogus=1)
    with pytest.raises(ConfigError, match=r"^pager 'mdci' has no parameter 'query'; " + listing):
        MDCIPager(8, query=SearchConfig())  # a whole search config goes in params=DCIParams(query=...)
    with pytest.raises(ConfigError, match="not both"):
        MDCIPager(8, params="wide", preset="icecache")
    with pytest.raises(ConfigError, match="DCIParams or a preset name"):
        MDCIPager(8, params={"p0": 0.1})
    with pytest.raises(ConfigError, match="unknown DCI preset 'bogus'"):
        MDCIPager(8, params="bogus")
    # None keeps the starting point's value (the command line's "not given"), as before.
    assert MDCIPager(8, preset="wide", fov_max=None, field_of_view=None).params == DCIParams.preset("wide")
    assert MDCIPager(8, construction_field_of_view=12).params.construction.field_of_view == 12


def test_index_bytes_scale_with_n():
    a = make_pager("mdci", head_dim=16)
    a.build(keys(0, 2000))
    b = make_pager("mdci", head_dim=16)
    b.build(keys(0, 8000))
    assert 0 < a.index_bytes() < b.index_bytes() < 6 * a.index_bytes()


def test_default_preset_is_wide_and_recalls_more_than_icecache():
    """The default ("wide") differs from IceCache's published parameters in the query only, and on the same
    tree it recovers more attention mass (fixed seeds, 32 queries)."""
    wide, ice = make_pager("mdci", head_dim=32, seed=1), make_pager("mdci", head_dim=32, seed=1, preset="icecache")
    assert wide.params.query.prop_to_retrieve == 1.0
    assert (wide.params.fov_scale, wide.params.fov_min, wide.params.fov_max) == (7.5e-3, 60, 200)
    assert ice.params.query.prop_to_retrieve == 0.8
    assert (ice.params.fov_scale, ice.params.fov_min, ice.params.fov_max) == (1.5e-3, 30, None)
    assert (wide.params.p0, wide.params.p1, wide.params.construction) == (ice.params.p0, ice.params.p1, ice.params.construction)
    k = keys(5, 20000, 32, clusters=64)
    wide.build(k)
    ice.build(k)
    assert np.array_equal(wide.index.parents(), ice.index.parents())  # same tree
    assert wide.index.field_of_view() == 150 and ice.index.field_of_view() == 30
    g = torch.Generator().manual_seed(9)
    rw, ri = [], []
    for _ in range(32):
        q = k[torch.randint(0, 20000, (2,), generator=g)] + 0.3 * torch.randn(2, 32, generator=g)
        rw.append(attention_recall(q, k, wide.select(q, 128).positions))
        ri.append(attention_recall(q, k, ice.select(q, 128).positions))
    assert np.mean(rw) > np.mean(ri), (np.mean(rw), np.mean(ri))  # measured 0.580 vs 0.574


@pytest.mark.parametrize("n,expected", [(100, 60), (8192, 61), (20000, 150), (26666, 199), (40000, 200), (131072, 200)])
def test_wide_field_of_view_rule_is_capped(n, expected):
    """wide: F = min(max(int(7.5e-3 n), 60), 200), so select time stops growing linearly past ~27k tokens."""
    p = make_pager("mdci", head_dim=8, seed=0)
    p.index.tree.num_points = n  # the rule only reads the size
    assert p.index.field_of_view() == expected
    assert make_pager("mdci", head_dim=8, fov_max=1000).index.params.fov_max == 1000


def test_fov_max_must_not_undercut_fov_min():
    with pytest.raises(ConfigError, match="fov_max"):
        make_pager("mdci", head_dim=8, fov_min=60, fov_max=59)
    with pytest.raises(ConfigError, match="fov_max"):
        make_pager("mdci", head_dim=8, fov_max=2.5)


@FAST
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4), budget=st.integers(1, 300),
       threads=st.integers(1, 3), inserted=st.integers(0, 40), seed=st.integers(0, 10_000),
       page_score=st.sampled_from(["max", "mass"]))
def test_layer_select_equals_each_pagers_own(sizes, budget, threads, inserted, seed, page_score):
    """The runtime's one-call selection of a layer row (``select_layer`` through
    ``MDCIPager.select_layer_positions``, all heads' page rankings in one compiled call, on 1-3 threads) gives
    every head the positions, page offsets and pages of that pager's own `select_arrays`, also after inserts
    and with heads of different sizes."""
    pagers = [make_pager("mdci", head_dim=16, seed=h, page_score=page_score) for h in range(len(sizes))]
    for h, (pager, n) in enumerate(zip(pagers, sizes)):
        pager.select_threads = threads
        pager.build(keys(seed + h, n))
        pager.insert(keys(seed + 100 + h, inserted, scale=1.5))  # longer keys: some inserts rekey the tree
    q = keys(seed + 7, 3 * len(sizes)).reshape(1, len(sizes), 3, 16)
    assert MDCIPager.select_layer_positions(pagers, q[0], budget) is not None  # the one-call path is taken
    assert_layer_select_is_each_pagers_own(pagers, q, budget)


def test_layer_select_declines_what_one_call_cannot_serve():
    """None (select head by head) for an empty pager, differing parameters or ``layer_select=False``; a
    non-boolean ``layer_select`` is a one-line `ConfigError`."""
    q = keys(0, 6).reshape(2, 3, 16)
    built = [make_pager("mdci", head_dim=16) for _ in range(2)]
    for pager in built:
        pager.build(keys(1, 200))
    assert MDCIPager.select_layer_positions(built, q, 64) is not None
    empty = make_pager("mdci", head_dim=16)
    assert MDCIPager.select_layer_positions([built[0], empty], q, 64) is None
    other = make_pager("mdci", head_dim=16, field_of_view=30)
    other.build(keys(1, 200))
    assert MDCIPager.select_layer_positions([built[0], other], q, 64) is None
    off = [make_pager("mdci", head_dim=16, layer_select=False) for _ in range(2)]
    for pager in off:
        pager.build(keys(1, 200))
    assert MDCIPager.select_layer_positions(off, q, 64) is None
    with pytest.raises(ConfigError, match="layer_select must be true or false"):
        make_pager("mdci", head_dim=16, layer_select="yes")


def grown_pager(seed: int, n: int, inserted: int, scale: float, page_size: int, **patches) -> tuple[MDCIPager, list]:
    """An mdci pager built on ``n`` keys, then fed ``inserted`` keys one at a time with `dci_update`'s functions
    replaced by ``patches``; returns it and the move journal of every insert."""
    from icecache.indexes import dci_update

    pager = make_pager("mdci", head_dim=16, page_size=page_size, seed=seed, record_moves=True)
    pager.build(keys(seed, n))
    pager.table.take_moves()
    journal = []
    with pytest.MonkeyPatch.context() as patch:
        for name, value in patches.items():
            patch.setattr(dci_update, name, value)
        for row in keys(seed + 1, inserted, scale=scale):
            pager.insert(row[None], check=False)
            journal.append(pager.table.take_moves())
    return pager, journal


def assert_same_index(a: tuple[MDCIPager, list], b: tuple[MDCIPager, list]) -> None:
    """Every tree array, the page table and the move journals are equal."""
    (fast, fast_moves), (slow, slow_moves) = a, b
    assert fast_moves == slow_moves
    tf, ts = fast.index.tree, slow.index.tree
    assert tf.num_points == ts.num_points and tf.msq == ts.msq and tf.level_counts == ts.level_counts
    for name in ("vectors", "ext", "proj", "level_of", "parent_of", "parent_dist", "num_descendants", "cluster_start",
                 "cluster_size", "cluster_cap", "run_key", "run_id", "vectors_run0"):
        assert np.array_equal(getattr(tf, name), getattr(ts, name)), name
    for name in ("members", "sizes_", "page_of_", "slot_of_"):
        assert np.array_equal(getattr(fast.table, name), getattr(slow.table, name)), name
    assert len(fast.table) == len(slow.table)
    assert_pages_ok(fast)


@FAST
@given(n=st.integers(1, 1500), inserted=st.integers(1, 120), seed=st.integers(0, 10_000),
       scale=st.sampled_from([0.5, 1.0, 1.3]), page_size=st.sampled_from([2, 8, 16]))
def test_compiled_leaf_insert_makes_the_general_paths_edits(n, inserted, seed, scale, page_size):
    """Inserting one token at a time with the compiled level-0 path (`dci_update._leaf_fast_path`) leaves every
    tree array, the page table and its move journal exactly as the general Python path does (some keys longer
    than the index's: rekeys; small pages: splits)."""
    assert_same_index(grown_pager(seed, n, inserted, scale, page_size),
                      grown_pager(seed, n, inserted, scale, page_size, _leaf_fast_path=lambda *args: False))


def detach_reference(stolen, parent_of, num_desc, cl_start, cl_size, run_key, run_id, Xr) -> int:
    """`dci_update._detach` written one child at a time in Python (the code it replaced)."""
    from icecache.indexes import _dci_edit_kernels as edit_kernels

    moved = 0
    for child in stolen.tolist():
        old_parent = int(parent_of[child])
        cid = old_parent + 1
        edit_kernels.cluster_remove(run_key, run_id, Xr, int(cl_start[cid]), int(cl_size[cid]), child)
        cl_size[cid] -= 1
        node, subtree = old_parent, 1 + int(num_desc[child])
        while node >= 0:
            num_desc[node] -= subtree
            node = int(parent_of[node])
        moved += subtree
    return moved


@FAST
@given(n=st.integers(1, 1500), inserted=st.integers(60, 240), seed=st.integers(0, 10_000),
       page_size=st.sampled_from([4, 16]))
def test_compiled_detach_makes_the_python_loops_edits(n, inserted, seed, page_size):
    """Adoptions (promoted tokens taking children from other parents) with the compiled `_detach` leave the index
    exactly as the child-by-child Python loop does."""
    assert_same_index(grown_pager(seed, n, inserted, 1.0, page_size),
                      grown_pager(seed, n, inserted, 1.0, page_size, _detach=detach_reference))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=12), page_size=st.sampled_from([2, 4, 8]),
       which=st.integers(0, 11), offset=st.integers(0, 5), seed=st.integers(0, 1000))
def test_merge_partner_is_the_reference_rule(lengths, page_size, which, offset, seed):
    """`_merge_partner` (compiled) picks what the rule says, computed here with lists: of the pages just before
    and just after ``page``'s stretch of run 0, those that fit with it where one holds < P // 2, the first of the
    smallest."""
    from icecache.indexes.dci_update import _merge_partner

    lengths = [min(n, page_size) for n in lengths]
    rng = np.random.default_rng(seed)
    ids = rng.permutation(sum(lengths) + offset)[: sum(lengths)]  # token ids in run-0 order (a block at `offset`)
    page_of = np.full(ids.max() + 1, -1, np.int64)
    sizes = np.array(lengths, np.int64)
    seg_pages = np.repeat(np.arange(len(lengths)), lengths)
    page_of[ids] = seg_pages
    run_id = np.full((1, offset + len(ids) + 3), -1, np.int32)
    run_id[0, offset : offset + len(ids)] = ids
    page = which % len(lengths)
    at = np.flatnonzero(seg_pages == page)
    neighbours = [int(seg_pages[i]) for i in (at[0] - 1, at[-1] + 1) if 0 <= i < len(ids)]
    fit = [o for o in neighbours if sizes[page] + sizes[o] <= page_size and min(sizes[page], sizes[o]) < page_size // 2]
    expected = min(fit, key=lambda o: sizes[o]) if fit else -1
    assert _merge_partner(run_id, offset, len(ids), page_of, sizes, page, page_size) == expected


def _place_beside_one_by_one(tree, page: int, neighbour: int, point: int) -> None:
    """The reference for `dci_update._place_beside`: the same edits through the page table's own methods."""
    from icecache.indexes.dci_update import _merge_small_page, _split_page

    table = tree.table
    new_page = _split_page(tree, page)
    holder = new_page if table.page_of_[neighbour] == new_page else page
    table.append(holder, point)
    _merge_small_page(tree, page)
    _merge_small_page(tree, new_page)


@FAST
@given(seed=st.integers(0, 2**16), n0=st.integers(0, 300), n=st.integers(1, 600), P=st.sampled_from([2, 3, 4, 8, 16]),
       scale=st.floats(0.5, 3.0), merges=st.sampled_from([0, 1, 32]))
def test_compiled_place_beside_is_the_one_by_one_edit(seed, n0, n, P, scale, merges):
    """A full page that a decode insert reaches is split, joined and merged in one compiled call
    (`dci_update._place_beside`): the same page ids, slots, free list, journal rows (in order) and tree as the
    page table's `split`, `append` and `move_many` one by one, through splits, merges, adoptions and rekeys
    (also when the call runs out of merges and hands the rest to the Python loop)."""
    from icecache.indexes import dci_update

    x = keys(seed, n0 + n, 8, clusters=4)
    x[n0:] *= torch.linspace(1.0, scale, n)[:, None]  # longer keys later: rekeys
    pagers = [make_pager("mdci", head_dim=8, page_size=P, seed=seed, record_moves=True) for _ in range(2)]
    journals: list[list] = [[], []]
    for which, pager in enumerate(pagers):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dci_update, "PLACE_MERGES", merges)
            if which == 1:
                patch.setattr(dci_update, "_place_beside", _place_beside_one_by_one)
            pager.build(x[:n0])
            for i in range(n0, n0 + n):
                pager.insert(x[i : i + 1])
                journals[which].extend(pager.table.take_moves())
    ours, ref = pagers
    assert journals[0] == journals[1]
    for name in ("members", "sizes_", "page_of_", "slot_of_"):
        np.testing.assert_array_equal(getattr(ours.table, name), getattr(ref.table, name))
    assert ours.table._free == ref.table._free and ours.table.id_capacity == ref.table.id_capacity
    assert len(ours.table) == len(ref.table)
    for name in ("parent_of", "run_id", "cluster_size"):
        np.testing.assert_array_equal(getattr(ours.index.tree, name), getattr(ref.index.tree, name))
    assert_pages_ok(ours)
