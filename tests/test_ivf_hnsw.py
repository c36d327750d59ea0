"""The ``ivf`` (faiss k-means lists) and ``hnsw`` (hnswlib graph) pagers: exactness under exhaustive settings,
invariants after insert sequences (with the move journal replayed), re-training / re-keying, MIPS with keys of
very different norms, thread-count independence, bad parameters. The generic pager properties are in
``test_pagers.py`` (every registered pager gets them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache import make_pager
from icecache.core.errors import InputError
from icecache.core.metrics import group_scores, hit_rate
from icecache.core.pager import take_within_budget
from icecache.core.transform import transform_keys
from icecache.indexes.ivf import faiss_gpu_available
from icecache.indexes.page_split import balanced_pages

NAMES = ["ivf", "hnsw"]
#: parameters that make each pager's search exhaustive (every list probed / graph beam >= every token)
EXHAUSTIVE = {"ivf": {"nprobe": 10**6}, "hnsw": {"ef": 4096}}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def all_keys(pager) -> torch.Tensor:
    return torch.from_numpy(pager._buf[: len(pager)].copy())


def oracle(pager, keys: torch.Tensor, q: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Every page of ``pager`` ranked by its best ``max_g q.k`` (brute force), under the budget rule:
    (page scores in rank order, page ids)."""
    s = group_scores(q, keys).numpy()
    pages = pager.pages()
    ids = np.array(sorted(pages), dtype=np.int64)
    best = np.array([s[pages[i].numpy()].max() for i in ids])
    order = np.lexsort((ids, -best))
    j = take_within_budget(np.array([len(pages[int(i)]) for i in ids[order]]), budget)
    return best[order[:j]], ids[order[:j]]


class Journal:
    """Replays `PageTable` moves into {(page, slot): position}, asserting that no move overwrites a live slot."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}

    def replay(self, moves) -> None:
        for m in moves:
            if m.src_page >= 0:
                assert self.slots.pop((m.src_page, m.src_slot)) == m.position, "journal reads the wrong slot"
            if m.dst_page >= 0:
                assert (m.dst_page, m.dst_slot) not in self.slots, "journal overwrites a live slot"
                self.slots[(m.dst_page, m.dst_slot)] = m.position

    def matches(self, table) -> bool:
        want = {(int(p), s): int(pos) for p in table.page_ids() for s, pos in enumerate(table.positions(int(p)))}
        return want == self.slots


def check_all(pager, n: int) -> None:
    pager.check()
    pages = pager.pages()
    flat = torch.cat(list(pages.values())) if pages else torch.zeros(0, dtype=torch.int64)
    assert sorted(flat.tolist()) == list(range(n))
    assert all(1 <= len(p) <= pager.page_size for p in pages.values())


# ------------------------------------------------------------------------------------------- page split
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 120), P=st.integers(1, 17), rule=st.sampled_from(["2means", "pca"]), seed=st.integers(0, 999))
def test_balanced_pages_partition(m, P, rule, seed):
    x = randn(m, 5, seed=seed).numpy()
    pos = np.arange(100, 100 + m, dtype=np.int64)
    pages = balanced_pages(x, pos, P, rule)
    assert len(pages) == -(-m // P)
    assert sorted(np.concatenate(pages).tolist()) == pos.tolist()
    sizes = [len(p) for p in pages]
    assert min(sizes) >= 1 and max(sizes) <= P
    assert max(sizes) - min(sizes) <= max(1, P // 2)  # near-equal: no fragments


@pytest.mark.parametrize("rule", ["2means", "pca"])
def test_balanced_pages_keep_separated_groups_together(rule):
    # two tight groups of 8 far apart, shuffled: a list of 16 with P = 8 must become exactly those two pages
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 6, generator=g) * 0.01 + 5.0
    b = torch.randn(8, 6, generator=g) * 0.01 - 5.0
    x = torch.cat([a, b])
    perm = torch.randperm(16, generator=g)
    pages = balanced_pages(x[perm].numpy(), perm.numpy().astype(np.int64), 8, rule)
    assert sorted(sorted(p.tolist()) for p in pages) == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("name", NAMES)
def test_separated_clusters_become_pages(name):
    """Tight, well-separated clusters of exactly P tokens: (almost) every page is one whole cluster."""
    P, C, d = 8, 24, 16
    g = torch.Generator().manual_seed(1)
    centres = torch.nn.functional.normalize(torch.randn(C, d, generator=g), dim=1) * 4.0
    keys = (centres[:, None, :] + 0.02 * torch.randn(C, P, d, generator=g)).reshape(C * P, d)
    perm = torch.randperm(C * P, generator=g)
    keys = keys[perm]
    cluster = (perm // P).numpy()  # cluster of each position
    params = {"nlist": C} if name == "ivf" else {}
    pager = make_pager(name, head_dim=d, page_size=P, seed=0, **params)
    pager.build(keys)
    pure = sum(len(set(cluster[p.numpy()])) == 1 and len(p) == P for p in pager.pages().values())
    # k-means can end in a local optimum (one list holding two clusters, one cluster cut over two lists)
    assert pager.num_pages <= C + 2
    assert pure >= C - 3, f"only {pure} of {C} pages are whole clusters"


# ------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 150), P=st.integers(1, 9), budget=st.integers(1, 160), g=st.integers(1, 4), seed=st.integers(0, 10**6)
)
def test_exhaustive_settings_equal_the_page_oracle(name, n, P, budget, g, seed):
    """nprobe >= nlist (ivf) / ef >= n (hnsw): pages ranked by their true best token, budget rule applied."""
    keys = randn(n, 8, seed=seed)
    pager = make_pager(name, head_dim=8, page_size=P, seed=seed % 97, **EXHAUSTIVE[name])
    pager.build(keys)
    q = randn(g, 8, seed=seed + 1)
    sel = pager.select(q, budget)
    ref_scores, _ = oracle(pager, keys, q, budget)
    # Compare scores, not ids, so that exactly tied pages cannot make the test flaky.
    np.testing.assert_allclose(sel.scores.numpy(), ref_scores, rtol=1e-5, atol=1e-5)
    assert sel.num_tokens <= budget


@pytest.mark.parametrize("name", NAMES)
def test_page_size_one_selects_the_exact_top_tokens(name):
    """With single-token pages and exhaustive settings the selection is the exact top-B tokens by q.k."""
    keys = randn(300, 16, seed=3)
    pager = make_pager(name, head_dim=16, page_size=1, seed=0, **EXHAUSTIVE[name])
    pager.build(keys)
    for step, budget in enumerate([1, 7, 64, 300, 999]):
        q = randn(3, 16, seed=10 + step)
        sel = pager.select(q, budget)
        s = group_scores(q, keys)
        ref = torch.sort(s, descending=True).values[: min(budget, 300)]
        torch.testing.assert_close(torch.sort(s[sel.positions], descending=True).values, ref)


@pytest.mark.parametrize("name", NAMES)
def test_budget_covering_every_token_selects_every_page_at_default_settings(name):
    keys = randn(500, 8, seed=4)
    pager = make_pager(name, head_dim=8, page_size=16, seed=0)
    pager.build(keys)
    pager.insert(randn(37, 8, seed=5))
    sel = pager.select(randn(3, 8, seed=6), 537)
    assert sel.num_pages == pager.num_pages and sel.num_tokens == 537


# ------------------------------------------------------------------------------------------- inserts
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=12, deadline=None)
@given(
    n0=st.integers(0, 60),
    chunks=st.lists(st.tuples(st.integers(1, 25), st.floats(0.2, 3.0)), min_size=1, max_size=8),
    P=st.integers(1, 6),
    seed=st.integers(0, 10**6),
)
def test_insert_sequences_keep_invariants_and_a_replayable_journal(name, n0, chunks, P, seed):
    """Random insert sequences (some keys longer than any before: re-keying): table invariants, every token
    in exactly one page, the move journal replays to the table, exhaustive selection stays exact."""
    params = dict(EXHAUSTIVE[name])
    if name == "ivf":
        params["retrain_fraction"] = 0.3  # re-train often
    pager = make_pager(name, head_dim=8, page_size=P, seed=seed % 101, record_moves=True, **params)
    journal = Journal()
    keys = [randn(n0, 8, seed=seed)]
    pager.build(keys[0])
    journal.replay(pager.table.take_moves())
    check_all(pager, n0)
    for i, (m, scale) in enumerate(chunks):
        new = randn(m, 8, seed=seed + i + 1) * scale
        keys.append(new)
        if i % 2:
            for row in new:  # one token at a time, as during decoding
                pager.insert(row[None])
        else:
            pager.insert(new)
        journal.replay(pager.table.take_moves())
        n = sum(k.shape[0] for k in keys)
        check_all(pager, n)
        assert journal.matches(pager.table)
    allk = torch.cat(keys)
    q = randn(2, 8, seed=seed + 99)
    sel = pager.select(q, 20)
    np.testing.assert_allclose(sel.scores.numpy(), oracle(pager, allk, q, 20)[0], rtol=1e-5, atol=1e-5)


def test_ivf_retrains_when_inserts_exceed_the_fraction():
    # norms in [0.3, 1] and key 0 of norm 1: no later key is longer, so only the fraction rule can fire
    scale = 0.3 + 0.7 * torch.rand(400, 1, generator=torch.Generator().manual_seed(8))
    keys = torch.nn.functional.normalize(randn(400, 8, seed=7), dim=1) * scale
    keys[0] /= keys[0].norm()
    pager = make_pager("ivf", head_dim=8, page_size=8, seed=2, retrain_fraction=0.5, record_moves=True)
    journal = Journal()
    pager.build(keys[:200])
    journal.replay(pager.table.take_moves())
    assert pager.num_trainings == 1
    for i in range(200, 300):  # 100 = 0.5 * 200 inserted: not yet
        pager.insert(keys[i][None])
    assert pager.num_trainings == 1
    pager.insert(keys[300][None])  # 101 > 100: re-train on all 301 keys
    assert pager.num_trainings == 2
    journal.replay(pager.table.take_moves())
    assert journal.matches(pager.table)
    check_all(pager, 301)
    # After a re-training every token sits in the list of its nearest centroid (independent computation)...
    tx = transform_keys(keys[:301], form="paper")  # c = the largest norm of all 301 keys
    c = torch.from_numpy(pager.centroids.copy())
    nearest = torch.cdist(tx.double(), c.double()).argmin(1).numpy()
    for pid, pos in pager.pages().items():
        assert set(nearest[pos.numpy()].tolist()) == {pager.list_of_page(pid)}
    # ... and the pages are those of a fresh build on the same keys.
    fresh = make_pager("ivf", head_dim=8, page_size=8, seed=2)
    fresh.build(keys[:301])

    def as_sets(p):
        return sorted(sorted(v.tolist()) for v in p.pages().values())

    assert as_sets(pager) == as_sets(fresh)
    # The next re-training needs more than 0.5 * 301 further tokens.
    for i in range(301, 400):
        pager.insert(keys[i][None])
    assert pager.num_trainings == 2
    never = make_pager("ivf", head_dim=8, page_size=8, seed=2, retrain_fraction=None)
    never.build(keys[:50])
    never.insert(keys[50:400])
    assert never.num_trainings == 1
    check_all(never, 400)


def test_ivf_first_insert_into_an_empty_pager_trains():
    pager = make_pager("ivf", head_dim=8, page_size=4)
    pager.build(torch.zeros(0, 8))
    assert pager.num_trainings == 0 and pager.num_lists == 0
    pager.insert(randn(10, 8, seed=0))
    assert pager.num_trainings == 1 and pager.num_lists >= 1
    check_all(pager, 10)


# ------------------------------------------------------------------------------------------- MIPS
@pytest.mark.parametrize("name", NAMES)
def test_mips_not_l2_with_keys_of_very_different_norms(name):
    """Short keys right next to the query (the L2 nearest) vs long keys at 60 degrees (the largest q.k): the
    pager must select the long ones, at default settings. Norms span 0.05 .. 20."""
    d, P = 16, 8
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, d, generator=g), dim=1)
    ortho = torch.nn.functional.normalize(torch.randn(1, d, generator=g) - 0.0, dim=1)
    ortho = torch.nn.functional.normalize(ortho - (ortho @ q.T) * q, dim=1)
    near = q * 0.05 + 0.005 * torch.randn(400, d, generator=g)  # |k| ~ 0.05, q.k ~ 0.05
    far = (0.5 * q + 0.866 * ortho) * 20.0 + 0.5 * torch.randn(40, d, generator=g)  # q.k ~ 10
    noise = torch.randn(600, d, generator=g) * torch.rand(600, 1, generator=g) * 2.0  # random norms
    keys = torch.cat([near, far, noise])[torch.randperm(1040, generator=g)]
    norms = keys.norm(dim=1)
    assert float(norms.max() / norms.min()) > 100
    pager = make_pager(name, head_dim=d, page_size=P, seed=0)
    pager.build(keys)
    sel = pager.select(q, 40)
    assert hit_rate(q, keys, sel.positions, 40) >= 0.9
    assert float(sel.scores[0]) == pytest.approx(float(group_scores(q, keys).max()), rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_a_much_longer_key_rekeys_without_nan(name):
    d = 8
    keys = randn(300, d, seed=11)
    pager = make_pager(name, head_dim=d, page_size=8, seed=0)
    pager.build(keys)
    counter = "num_trainings" if name == "ivf" else "num_rebuilds"
    before = getattr(pager, counter)
    q = randn(2, d, seed=12)
    slightly = keys.norm(dim=1).max() * 1.02 * torch.nn.functional.normalize(randn(1, d, seed=13), dim=1)
    pager.insert(slightly)  # within norm_tolerance (5 %): clamped by the transform, no re-keying
    assert getattr(pager, counter) == before
    long_key = 30.0 * torch.nn.functional.normalize(q[:1], dim=1)  # 10x any earlier key, along q[0]
    pager.insert(long_key)
    assert getattr(pager, counter) == before + 1
    check_all(pager, 302)
    sel = pager.select(q, 16)
    assert np.isfinite(sel.scores.numpy()).all()
    assert 301 in sel.positions[: int(sel.indptr[1])].tolist()  # the top page holds the long key
    assert float(sel.scores[0]) == pytest.approx(float((q @ long_key.T).max()), rel=1e-5)
    if name == "ivf":
        assert np.isfinite(pager.centroids).all()


# ------------------------------------------------------------------------------------------- determinism
def _snapshot(pager, queries):
    pages = {k: v.tolist() for k, v in pager.pages().items()}
    sels = [(s.pages.tolist(), s.positions.tolist(), s.scores.tolist()) for s in (pager.select(q, 48) for q in queries)]
    return pages, sels


@pytest.mark.parametrize("name", NAMES)
def test_results_do_not_depend_on_thread_counts(name):
    import faiss

    keys = randn(3000, 32, seed=21)
    more = randn(200, 32, seed=22)
    queries = [randn(3, 32, seed=30 + i) for i in range(4)]
    old_torch, old_omp = torch.get_num_threads(), faiss.omp_get_max_threads()
    snaps = []
    try:
        for torch_threads, own_threads in [(1, 1), (2, 2), (1, 1)]:
            torch.set_num_threads(torch_threads)
            faiss.omp_set_num_threads(torch_threads)
            # ivf: faiss k-means threads are the pager's own (num_threads); hnsw builds with one thread
            # (hnswlib's multi-threaded insertion is not deterministic, so it is not compared here).
            params = {"num_threads": own_threads} if name == "ivf" else {}
            pager = make_pager(name, head_dim=32, page_size=16, seed=5, **params)
            pager.build(keys)
            pager.insert(more)
            snaps.append(_snapshot(pager, queries))
            assert faiss.omp_get_max_threads() == torch_threads  # the pager restored the OpenMP setting
    finally:
        torch.set_num_threads(old_torch)
        faiss.omp_set_num_threads(old_omp)
    assert snaps[0] == snaps[1] == snaps[2]


# ------------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("ivf", {"nlist": 0}, "nlist"),
        ("ivf", {"nlist": 2.5}, "nlist"),
        ("ivf", {"tokens_per_list": 0}, "tokens_per_list"),
        ("ivf", {"nprobe": 0}, "nprobe"),
        ("ivf", {"nprobe": True}, "nprobe"),
        ("ivf", {"probe_factor": 0.5}, "probe_factor"),
        ("ivf", {"probe_factor": float("nan")}, "probe_factor"),
        ("ivf", {"split": "kd"}, "split"),
        ("ivf", {"probe_rule": "all"}, "probe_rule"),
        ("ivf", {"train_iters": 0}, "train_iters"),
        ("ivf", {"retrain_fraction": 0.0}, "retrain_fraction"),
        ("ivf", {"norm_tolerance": -0.1}, "norm_tolerance"),
        ("ivf", {"num_threads": 0}, "num_threads"),
        ("ivf", {"use_gpu": "yes"}, "use_gpu"),
        ("hnsw", {"M": 1}, "M"),
        ("hnsw", {"ef_construction": 0}, "ef_construction"),
        ("hnsw", {"ef": 0}, "ef"),
        ("hnsw", {"search_factor": 0.9}, "search_factor"),
        ("hnsw", {"neighbours": 0}, "neighbours"),
        ("hnsw", {"split": None}, "split"),
        ("hnsw", {"norm_tolerance": float("inf")}, "norm_tolerance"),
        ("hnsw", {"num_threads": -1}, "num_threads"),
    ],
)
def test_bad_parameters_raise_input_error(name, kwargs, match):
    with pytest.raises(InputError, match=match):
        make_pager(name, head_dim=8, **kwargs)


def test_ivf_gpu_is_optional():
    if faiss_gpu_available():  # pragma: no cover - needs CUDA and a GPU build of faiss
        pytest.skip("a GPU faiss is present; this test checks the CPU-only guard")
    assert make_pager("ivf", head_dim=8).use_gpu is False
    with pytest.raises(InputError, match="GPU"):
        make_pager("ivf", head_dim=8, use_gpu=True)


@pytest.mark.parametrize("name", NAMES)
def test_index_bytes_grows_with_the_index(name):
    small, big = make_pager(name, head_dim=16), make_pager(name, head_dim=16)
    small.build(randn(200, 16, seed=1))
    big.build(randn(2000, 16, seed=1))
    assert 0 < small.index_bytes() < big.index_bytes()
    per_token = big.index_bytes() / 2000
    if name == "ivf":  # centroids, per-page sums and tables: less than the float32 keys themselves
        assert per_token < 16 * 4
    else:  # hnswlib holds its own float32 copy of the transformed keys [d + 1] plus >= M links per token
        assert per_token > (16 + 1) * 4 + 16 * 4


# ------------------------------------------------------------------------------------------- quality
@pytest.mark.parametrize("name", NAMES)
def test_quality_on_clustered_keys_beats_token_order(name):
    """Clustered synthetic keys in random token order, queries near cluster centres: at default settings the
    semantic pager's hit rate is high and far above token-order (Quest) pages at the same budget."""
    d, n, C = 32, 4000, 64
    g = torch.Generator().manual_seed(8)
    centres = torch.randn(C, d, generator=g) * 2.0
    labels = torch.randint(0, C, (n,), generator=g)
    keys = centres[labels] + 0.5 * torch.randn(n, d, generator=g)
    rates = {}
    for method in (name, "sequential"):
        pager = make_pager(method, head_dim=d, page_size=16, seed=0)
        pager.build(keys)
        hr = []
        for i in range(10):
            q = centres[i * 6 : i * 6 + 3] + 0.3 * torch.randn(3, d, generator=torch.Generator().manual_seed(i))
            hr.append(hit_rate(q, keys, pager.select(q, 128).positions, 128))
        rates[method] = float(np.mean(hr))
    assert rates[name] >= 0.7 and rates[name] >= rates["sequential"] + 0.4, rates


def test_hnsw_brute_force_fallback_when_the_graph_cannot_return_k(monkeypatch):
    """If hnswlib raises (fewer than k reachable), the rows are answered exactly by brute force."""
    keys = randn(200, 8, seed=40)
    pager = make_pager("hnsw", head_dim=8, page_size=4, seed=0)
    pager.build(keys)
    q = randn(3, 8, seed=41)

    class Flaky:
        def __init__(self, index):
            self.index = index

        def __getattr__(self, name):
            return getattr(self.index, name)

        def knn_query(self, *args, **kwargs):
            raise RuntimeError("Cannot return the results in a contiguous 2D array. Probably ef or M is too small")

    pager._index = Flaky(pager._index)
    got = pager.select(q, 24)
    # the fallback finds each head's exact top-k tokens, so the page ranking is the oracle's
    np.testing.assert_allclose(got.scores.numpy(), oracle(pager, keys, q, 24)[0], rtol=1e-5, atol=1e-5)
    pager.insert(randn(5, 8, seed=42))  # inserting (nearest-neighbour search) works through the fallback too
    check_all(pager, 205)


@pytest.mark.parametrize("rule", ["union", "nearest"])
def test_ivf_probe_order(rule):
    """union: the first |U_r| lists are exactly U_r, the union of every head's r nearest centroids (L2 between
    transform_queries(q) and the centroids); nearest: ascending smallest distance over the group."""
    from icecache.core.transform import transform_queries

    pager = make_pager("ivf", head_dim=8, page_size=4, seed=0, probe_rule=rule, nlist=20)
    pager.build(randn(400, 8, seed=50))
    q = randn(3, 8, seed=51)
    order = pager.probe_order(q.numpy())
    assert sorted(order.tolist()) == list(range(pager.num_lists))
    dist = torch.cdist(transform_queries(q).double(), torch.from_numpy(pager.centroids.copy()).double())  # [3, L]
    if rule == "nearest":
        np.testing.assert_array_equal(order, torch.sort(dist.min(0).values, stable=True).indices.numpy())
        return
    per_head = torch.argsort(dist, dim=1, stable=True).numpy()
    for r in range(1, pager.num_lists + 1):
        union = set(per_head[:, :r].reshape(-1).tolist())
        assert set(order[: len(union)].tolist()) == union
