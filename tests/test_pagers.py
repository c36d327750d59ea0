"""Properties every registered pager must have, plus the exact semantics of `exact` and `sequential`.

A new backend registered in `icecache.indexes` gets the generic properties here for free.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_layer_select_is_each_pagers_own
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache import available_pagers, make_pager
from icecache.core.errors import InputError, InputTypeError, UnknownNameError
from icecache.core.metrics import group_scores

ALL = available_pagers()


def keys_strategy(max_n=80, d=8):
    return st.tuples(st.integers(0, max_n), st.integers(0, 2**31 - 1)).map(
        lambda t: torch.randn(t[0], d, generator=torch.Generator().manual_seed(t[1]))
    )


def check_pages(pager, n):
    """Every position 0..n-1 is in exactly one page, sizes within [1, P], maps agree."""
    pager.table.check()
    pages = pager.pages()
    flat = torch.cat(list(pages.values())) if pages else torch.zeros(0, dtype=torch.int64)
    assert sorted(flat.tolist()) == list(range(n))
    cap = pager.table.page_size
    assert all(1 <= len(p) <= cap for p in pages.values())
    for pid, pos in pages.items():
        assert (pager.page_of(pos) == pid).all()


def check_selection(pager, sel, budget):
    assert sel.num_tokens <= budget
    assert sel.indptr[0] == 0 and sel.indptr[-1] == sel.num_tokens and len(sel.indptr) == sel.num_pages + 1
    assert len(set(sel.pages.tolist())) == sel.num_pages
    pages = pager.pages()
    for i, pid in enumerate(sel.pages.tolist()):
        got = sel.positions[sel.indptr[i] : sel.indptr[i + 1]]
        assert torch.equal(got, pages[pid])
    s = sel.scores
    assert (s[:-1] >= s[1:]).all(), "pages are not in rank order"
    # the budget rule fills the budget: either every page is selected, or selection stopped at a page that
    # did not fit (some unselected page would overflow the budget); a pager that returns too little fails
    chosen = set(sel.pages.tolist())
    rest = [len(p) for pid, p in pages.items() if pid not in chosen]
    assert not rest or sel.num_tokens + max(rest) > budget, (
        f"selection of {sel.num_tokens} tokens stops short of budget {budget}: unselected pages of sizes {sorted(rest)[:8]} all fit"
    )


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25)
@given(keys=keys_strategy(), seed=st.integers(0, 1000), budget=st.integers(0, 70), g=st.integers(1, 4), P=st.integers(1, 9))
def test_generic_build_select(name, keys, seed, budget, g, P):
    pager = make_pager(name, head_dim=8, page_size=P, seed=seed)
    pager.build(keys)
    assert len(pager) == keys.shape[0]
    check_pages(pager, keys.shape[0])
    q = torch.randn(g, 8, generator=torch.Generator().manual_seed(seed))
    sel = pager.select(q, budget)
    check_selection(pager, sel, budget)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=15)
@given(chunks=st.lists(st.integers(0, 20), min_size=1, max_size=6), seed=st.integers(0, 1000), P=st.integers(1, 6))
def test_generic_insert(name, chunks, seed, P):
    gen = torch.Generator().manual_seed(seed)
    pager = make_pager(name, head_dim=8, page_size=P, seed=seed)
    pager.build(torch.randn(chunks[0], 8, generator=gen))
    n = chunks[0]
    for m in chunks[1:]:
        pager.insert(torch.randn(m, 8, generator=gen))
        n += m
        check_pages(pager, n)
        sel = pager.select(torch.randn(2, 8, generator=gen), 24)
        check_selection(pager, sel, 24)


@pytest.mark.parametrize("name", ALL)
def test_bad_input_raises_clear_errors(name):
    pager = make_pager(name, head_dim=8, page_size=4)
    with pytest.raises(InputError, match=r"shape \[n, 8\]"):
        pager.build(torch.randn(5, 7))
    with pytest.raises(InputError, match="shape"):
        pager.build(torch.randn(5))
    with pytest.raises(InputTypeError, match="floating-point"):
        pager.build(torch.ones(5, 8, dtype=torch.int64))
    with pytest.raises(InputTypeError):
        pager.build([[0.0] * 8])
    bad = torch.randn(5, 8)
    bad[2, 3] = float("nan")
    with pytest.raises(InputError, match="NaN or inf"):
        pager.build(bad)
    bad[2, 3] = float("inf")
    with pytest.raises(InputError, match="NaN or inf"):
        pager.build(bad)
    pager.build(torch.randn(10, 8))
    with pytest.raises(InputError, match="NaN or inf"):
        pager.insert(bad)
    assert len(pager) == 10  # a rejected insert changes nothing
    with pytest.raises(InputError, match="budget"):
        pager.select(torch.randn(2, 8), -1)
    with pytest.raises(InputError, match="budget"):
        pager.select(torch.randn(2, 8), 2.5)
    with pytest.raises(InputError, match="empty"):
        pager.select(torch.randn(0, 8), 4)
    with pytest.raises(InputError, match="NaN"):
        pager.select(torch.full((2, 8), float("nan")), 4)
    with pytest.raises(InputError, match="page_size"):
        make_pager(name, head_dim=8, page_size=0)
    with pytest.raises(InputError, match="head_dim"):
        make_pager(name, head_dim=-3)


def test_unknown_pager_lists_known_names():
    with pytest.raises(UnknownNameError, match="sequential"):
        make_pager("no-such-pager", head_dim=8)


@pytest.mark.parametrize("name", ALL)
def test_empty_and_zero_budget(name):
    pager = make_pager(name, head_dim=4, page_size=4)
    pager.build(torch.zeros(0, 4))
    assert pager.select(torch.randn(1, 4), 10).num_pages == 0
    pager.insert(torch.randn(3, 4))
    assert pager.select(torch.randn(1, 4), 0).num_tokens == 0
    assert pager.select(torch.randn(4), 10).num_tokens == 3  # a 1-D query is one head


# ----------------------------------------------------------------------------------------- exact
@settings(max_examples=40)
@given(keys=keys_strategy(max_n=120), seed=st.integers(0, 1000), budget=st.integers(0, 130), g=st.integers(1, 4))
def test_exact_equals_brute_force(keys, seed, budget, g):
    pager = make_pager("exact", head_dim=8, page_size=16)
    pager.build(keys)
    q = torch.randn(g, 8, generator=torch.Generator().manual_seed(seed))
    sel = pager.select(q, budget)
    n = keys.shape[0]
    assert sel.num_tokens == min(budget, n)
    assert all(len(p) == 1 for p in pager.pages().values())
    s = group_scores(q, keys)
    ref = torch.sort(s, descending=True).values[: min(budget, n)]
    # compare scores, not ids, so ties cannot make the test flaky
    torch.testing.assert_close(s[sel.positions], ref)
    torch.testing.assert_close(sel.scores, ref)


@settings(max_examples=60)
@given(n=st.integers(1, 90), budget=st.integers(1, 100), g=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_exact_orders_ties_by_position(n, budget, g, seed):
    """Small integer keys and queries make every score exact in float32, so ties are real: the kernel must
    return the brute-force order (score descending, then position ascending)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2, 3, (n, 8), generator=gen).float()
    q = torch.randint(-2, 3, (g, 8), generator=gen).float()
    pager = make_pager("exact", head_dim=8, page_size=16)
    pager.build(keys[: n // 2])
    for row in keys[n // 2 :]:  # inserted one by one, as in decode
        pager.insert(row[None])
    sel = pager.select(q, budget)
    s = (q @ keys.T).amax(0).tolist()
    ref = sorted(range(n), key=lambda j: (-s[j], j))[: min(budget, n)]
    assert sel.positions.tolist() == ref
    assert sel.scores.tolist() == [s[j] for j in ref]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9000), budget=st.integers(1, 300), g=st.integers(1, 4), threads=st.integers(2, 5),
       seed=st.integers(0, 10_000), ties=st.booleans())
def test_exact_threaded_scan_selects_the_same_as_one_thread(n, budget, g, threads, seed, ties):
    """``select_threads`` splits the exact scan over threads (above `MIN_KEYS_PER_THREAD` keys each); the
    positions, their order and the float scores are the same as the one-thread scan's, bit for bit."""
    from icecache.indexes.exact import MIN_KEYS_PER_THREAD
    from icecache.indexes.exact import group_scores as scan

    rng = np.random.default_rng(seed)
    keys = (rng.integers(-2, 3, (n, 64)) if ties else rng.standard_normal((n, 64))).astype(np.float32)
    q = rng.standard_normal((g, 64)).astype(np.float32)
    one, many = make_pager("exact", head_dim=64), make_pager("exact", head_dim=64)
    many.select_threads = threads
    for pager in (one, many):
        pager.build(torch.from_numpy(keys[: n // 2]))
        pager.insert(torch.from_numpy(keys[n // 2 :]))
    a, b = one.select(torch.from_numpy(q), budget), many.select(torch.from_numpy(q), budget)
    assert a.positions.tolist() == b.positions.tolist()
    assert a.scores.numpy().tobytes() == b.scores.numpy().tobytes()
    big = np.tile(keys, (-(-2 * MIN_KEYS_PER_THREAD // n) + 1, 1))  # long enough that the parallel scan runs
    assert scan(q, big, big.shape[0], threads).tobytes() == scan(q, big, big.shape[0], 1).tobytes()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1024, 6000), k_frac=st.floats(0.0, 0.3), seed=st.integers(0, 10_000), ties=st.booleans(),
       layout=st.sampled_from(["random", "ascending", "sampled_slots_high"]))
def test_kth_largest_equals_a_full_sort(n, k_frac, seed, ties, layout):
    """The sampled threshold of the exact scorer's k-th score is exact, ties and unlucky samples included
    ("sampled_slots_high": the sample holds the best scores, so its estimate is too high and the whole array is
    partitioned)."""
    from icecache.indexes.exact import _kth_largest

    rng = np.random.default_rng(seed)
    scores = (rng.integers(-3, 4, n) if ties else rng.standard_normal(n)).astype(np.float32)
    if layout == "ascending":
        scores = np.sort(scores)
    elif layout == "sampled_slots_high":
        scores[::8] += 100.0
    k = max(1, min(n - 1, int(k_frac * n)))
    assert _kth_largest(scores, k) == np.sort(scores)[::-1][k - 1]


# ----------------------------------------------------------------------------------------- sequential
def quest_reference(q, keys, P):
    """Independent Quest page scores: for page i, sum_c max(q_c min_c, q_c max_c), max over the group."""
    n = keys.shape[0]
    out = []
    for start in range(0, n, P):
        blk = keys[start : start + P]
        lo, hi = blk.min(0).values, blk.max(0).values
        out.append(max(float(torch.maximum(qi * lo, qi * hi).sum()) for qi in q))
    return np.array(out)


@settings(max_examples=40)
@given(keys=keys_strategy(max_n=120), seed=st.integers(0, 1000), budget=st.integers(0, 130), P=st.integers(1, 17))
def test_sequential_matches_quest_reference(keys, seed, budget, P):
    pager = make_pager("sequential", head_dim=8, page_size=P)
    pager.build(keys)
    n = keys.shape[0]
    pages = pager.pages()
    assert [p.tolist() for p in pages.values()] == [list(range(s, min(s + P, n))) for s in range(0, n, P)]
    q = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
    sel = pager.select(q, budget)
    if n == 0 or budget == 0:
        assert sel.num_pages == 0
        return
    ref = quest_reference(q, keys, P)
    np.testing.assert_allclose(sel.scores.numpy(), ref[sel.pages.numpy()], rtol=1e-5, atol=1e-5)
    order = np.argsort(-ref, kind="stable")
    sizes = np.array([len(pages[int(i)]) for i in order])
    j = int(np.searchsorted(np.cumsum(sizes), budget, side="right"))
    # Same page scores in the same rank order as the reference, and the budget rule applied exactly.
    np.testing.assert_allclose(np.sort(ref[sel.pages.numpy()])[::-1], ref[order[:j]], rtol=1e-5, atol=1e-5)
    assert sel.num_pages == j


@settings(max_examples=40)
@given(n0=st.integers(0, 50), chunks=st.lists(st.integers(0, 20), max_size=6), P=st.integers(1, 9), seed=st.integers(0, 100))
def test_sequential_insert_equals_build_on_concatenation(n0, chunks, P, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n0, 8, generator=gen)] + [torch.randn(m, 8, generator=gen) for m in chunks]
    a = make_pager("sequential", head_dim=8, page_size=P)
    a.build(parts[0])
    for p in parts[1:]:
        a.insert(p)
    b = make_pager("sequential", head_dim=8, page_size=P)
    b.build(torch.cat(parts))
    assert {k: v.tolist() for k, v in a.pages().items()} == {k: v.tolist() for k, v in b.pages().items()}
    for x, y in zip(a.page_bounds(), b.page_bounds()):
        assert torch.equal(x, y)
    q = torch.randn(2, 8, generator=gen)
    sa, sb = a.select(q, 30), b.select(q, 30)
    assert torch.equal(sa.pages, sb.pages) and torch.equal(sa.positions, sb.positions)


def test_sequential_bound_is_an_upper_bound():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(200, 16, generator=gen)
    pager = make_pager("sequential", head_dim=16, page_size=8)
    pager.build(keys)
    q = torch.randn(3, 16, generator=gen)
    sel = pager.select(q, 200)
    s = group_scores(q, keys)
    for i, pid in enumerate(sel.pages.tolist()):
        pos = pager.pages()[pid]
        assert float(s[pos].max()) <= float(sel.scores[i]) + 1e-5


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_top_k_stable_partition_path(data):
    """Sizes where k is under a quarter of n, so the partition path (not the argsort fallback) runs, with
    heavy ties around the k-th value."""
    from icecache.core.pager import top_k_stable

    n = data.draw(st.integers(8, 400))
    k = data.draw(st.integers(1, max(1, (n - 1) // 4)))
    values = data.draw(st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0]) | st.floats(-3, 3, width=32), min_size=n, max_size=n))
    s = np.asarray(values, np.float32)
    assert 4 * k < n
    assert np.array_equal(top_k_stable(s, k), np.argsort(-s, kind="stable")[:k])


@settings(max_examples=300, deadline=None)
@given(
    scores=st.lists(st.sampled_from([-np.inf, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0]) | st.floats(-10, 10, width=32), min_size=0, max_size=300),
    k=st.integers(0, 320),
)
def test_top_k_stable_is_the_stable_argsort_prefix(scores, k):
    from icecache.core.pager import top_k_stable

    s = np.asarray(scores, np.float32)
    got = top_k_stable(s, k)
    assert got.dtype == np.int64 or got.size == 0
    assert np.array_equal(got, np.argsort(-s, kind="stable")[: max(0, min(k, s.size))])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), g=st.integers(1, 4), budget=st.integers(1, 80), seed=st.integers(0, 10_000))
def test_pq_selection_equals_brute_force_over_its_own_codes(n, g, budget, seed):
    """PQCache's GQA aggregation: every query head's softmax over the approximate logits (q . decoded key /
    sqrt(d)), summed over the group; the top-B tokens. Reference: decode every key from its codes and
    score with plain torch ops (no lookup tables)."""
    import math

    gen = torch.Generator().manual_seed(seed)
    d = 8
    pager = make_pager("pq", head_dim=d, page_size=16, seed=seed, num_subspaces=2, bits=4)
    keys = torch.randn(n, d, generator=gen)
    pager.build(keys)
    q = torch.randn(g, d, generator=gen)
    codes = torch.from_numpy(pager._codes)  # [n, M]
    decoded = torch.cat([pager._centroids[m][codes[:, m]] for m in range(codes.shape[1])], dim=1)  # [n, d]
    if n < 16:  # fewer keys than centroids: every key is its own code, so the decoded keys are the keys
        torch.testing.assert_close(decoded, keys)
    probs = torch.softmax((q @ decoded.T) / math.sqrt(d), dim=-1).sum(0).double()  # [n]
    sel = pager.select(q, budget)
    k = min(budget, n)
    chosen = sel.positions.numpy()
    assert len(chosen) == k
    kth = np.sort(probs.numpy())[::-1][k - 1]
    tol = 1e-6
    assert (probs.numpy()[chosen] >= kth - tol).all()  # every chosen token is among the top k (ties allowed)
    assert (probs.numpy() > kth + tol).sum() <= k and set(np.flatnonzero(probs.numpy() > kth + tol)) <= set(chosen.tolist())


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9000), budget=st.integers(1, 300), heads=st.integers(1, 4), threads=st.integers(1, 3),
       seed=st.integers(0, 10_000), ties=st.booleans())
def test_exact_layer_select_equals_each_pagers_own(n, budget, heads, threads, seed, ties):
    """The runtime's one-call selection of a layer row (``select_layer`` through
    ``ExactPager.select_layer_positions``) gives every head the positions, page offsets and pages of that
    pager's own `select_arrays`."""
    rng = np.random.default_rng(seed)
    pagers = [make_pager("exact", head_dim=16) for _ in range(heads)]
    for pager in pagers:
        pager.select_threads = threads
        keys = (rng.integers(-2, 3, (n, 16)) if ties else rng.standard_normal((n, 16))).astype(np.float32)
        pager.build(torch.from_numpy(keys))
    q = torch.from_numpy(rng.standard_normal((1, heads, 3, 16)).astype(np.float32))
    assert_layer_select_is_each_pagers_own(pagers, q, budget)



@pytest.mark.parametrize("name", ALL)
@settings(max_examples=10, deadline=None)
@given(n=st.integers(0, 400), heads=st.integers(1, 3), budget=st.integers(0, 90), P=st.integers(1, 9),
       seed=st.integers(0, 1000))
def test_generic_layer_select_is_each_pagers_own_or_absent(name, n, heads, budget, P, seed):
    """The declared fast path (`SemanticPager.select_layer_positions`): every backend either has none (None,
    the default) or gives each head exactly its own `select_arrays`; the runtime's `select_layer` agrees
    either way, and a pager that opts out (``layer_select = False``) is never served by it."""
    gen = torch.Generator().manual_seed(seed)
    pagers = [make_pager(name, head_dim=8, page_size=P, seed=seed) for _ in range(heads)]
    for pager in pagers:
        pager.build(torch.randn(n, 8, generator=gen))
    q = torch.randn(1, heads, 2, 8, generator=gen)
    heads_out = type(pagers[0]).select_layer_positions(pagers, q[0], budget)
    if heads_out is not None:
        assert budget > 0 and len(heads_out) == heads
        for pager, (pages, indptr, positions) in zip(pagers, heads_out):
            want = pager.select_arrays(q[0, pagers.index(pager)], budget, check=False)
            assert pages.tolist() == want[0].tolist() and indptr.tolist() == want[1].tolist()
            assert positions.tolist() == want[2].tolist()
    assert_layer_select_is_each_pagers_own(pagers, q, max(budget, 1))
    pagers[0].layer_select = False
    assert type(pagers[0]).select_layer_positions(pagers, q[0], budget) is None


def test_a_fast_path_that_breaks_the_budget_rule_is_caught():
    """The base class owns the budget rule: a backend's `_select_layer` returning too many tokens fails loudly."""
    from icecache.indexes.exact import ExactPager

    class Greedy(ExactPager):
        @classmethod
        def _select_layer(cls, pagers, queries, budget):
            n = len(pagers[0])
            return [(np.arange(n), np.arange(n + 1), np.arange(n)) for _ in pagers]

    pagers = [Greedy(head_dim=8) for _ in range(2)]
    for pager in pagers:
        pager.build(torch.randn(40, 8))
    with pytest.raises(AssertionError, match="broke the selection contract"):
        Greedy.select_layer_positions(pagers, torch.randn(2, 1, 8), 10)
