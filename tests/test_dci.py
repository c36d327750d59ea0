"""Property tests of the DCI index (`icecache.indexes.dci`) against brute force: the numbered properties of
docs/index.md, Invariants."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icecache.core.errors import ConfigError, InputError, InputTypeError
from icecache.core.pages import PageTable
from icecache.core.transform import key_key_distance, transform_keys, transform_queries
from icecache.indexes import _dci_edit_kernels as edit_kernels
from icecache.indexes.dci import DCIIndex, DCIParams, PrioritizedDCI, SearchConfig

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXHAUSTIVE = SearchConfig(field_of_view=10**9, prop_to_retrieve=1.0)


def data(seed: int, n: int, d: int, clustered: bool = False, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if not clustered:
        return (rng.standard_normal((n, d)) * scale).astype(np.float32)
    centers = rng.standard_normal((max(1, n // 20), d)) * 3
    x = centers[rng.integers(0, len(centers), n)] + 0.3 * rng.standard_normal((n, d))
    return (x * rng.uniform(0.2, 2.0, (n, 1)) * scale).astype(np.float32)


def brute(X: np.ndarray, Q: np.ndarray, metric: str) -> np.ndarray:
    """Distances of every point to the query group (min over the group), float64 ``[n]``."""
    X64, Q64 = X.astype(np.float64), np.atleast_2d(Q).astype(np.float64)
    if metric == "euclidean":
        return np.sqrt(((X64[None] - Q64[:, None]) ** 2).sum(-1)).min(0)
    return -(Q64 @ X64.T).max(0)


def assert_valid_result(idx: DCIIndex, X: np.ndarray, q: np.ndarray, k: int, ids: np.ndarray, d: np.ndarray, metric: str) -> None:
    """Property 2 (sorted, distinct, min(k, n), recomputed distances) and property 3 (rank-wise bound)."""
    n = len(X)
    assert ids.dtype == np.int64 and len(ids) == len(d)
    assert len(ids) == min(k, n)
    assert len(np.unique(ids)) == len(ids)
    assert (np.diff(d) >= 0).all()
    if n == 0:
        return
    ref = brute(X, q, metric)
    scale = 1e-5 * (1.0 + np.abs(ref).max())
    np.testing.assert_allclose(d, ref[ids], atol=scale, rtol=1e-5)
    exact_sorted = np.sort(ref)[: len(d)]
    assert (d >= exact_sorted - scale).all()


# ---------------------------------------------------------------------------------------------- property 1
@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), d=st.integers(1, 12), k=st.integers(1, 40),
       metric=st.sampled_from(["euclidean", "mips"]), L=st.integers(1, 3), m=st.integers(1, 4), g=st.integers(1, 3))
def test_single_level_exhaustive_is_exact(seed, n, d, k, metric, L, m, g):
    X = data(seed, n, d)
    Q = data(seed + 1, g, d)
    idx = PrioritizedDCI(d, metric, num_comp_indices=L, num_simp_indices=m, seed=seed)
    idx.build(X)
    ids, dist = idx.query(Q, k, config=SearchConfig(prop_to_retrieve=1.0))
    assert_valid_result(idx, X, Q, k, ids, dist, metric)
    ref = brute(X, Q, metric)
    np.testing.assert_allclose(dist, np.sort(ref)[: len(dist)], atol=1e-5 * (1 + np.abs(ref).max()))


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 800), d=st.integers(1, 12), k=st.integers(1, 40),
       metric=st.sampled_from(["euclidean", "mips"]), clustered=st.booleans(), preset=st.sampled_from(["icecache", "dci-knn"]))
def test_multi_level_exhaustive_is_exact(seed, n, d, k, metric, clustered, preset):
    X = data(seed, n, d, clustered)
    q = data(seed + 7, 1, d)[0]
    idx = DCIIndex(d, metric, DCIParams.preset(preset), seed=seed)
    idx.build(X)
    ids, dist = idx.query(q, k, config=EXHAUSTIVE)
    assert_valid_result(idx, X, q, k, ids, dist, metric)
    ref = brute(X, q, metric)
    np.testing.assert_allclose(dist, np.sort(ref)[: len(dist)], atol=1e-5 * (1 + np.abs(ref).max()))
    if len(np.unique(ref)) == len(ref):
        assert np.array_equal(ids, np.argsort(ref, kind="stable")[: len(ids)])


def reference_walk(idx: DCIIndex, Q: np.ndarray, k: int, cfg: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
    """docs/index.md, Prioritized search inside one cluster, written out in plain Python over the index's own
    sorted runs (one level).

    Every query of the group walks separately; the candidates are the union; a candidate's distance is the
    minimum over the group. Returns the top min(k, n) as (ids, dists) sorted by (dist, id)."""
    L, m = idx.params.num_comp_indices, idx.params.num_simp_indices
    ntv, ptv, ntr, ptr = cfg.limits("query")
    runs = [idx.cluster(-1, j) for j in range(L * m)]
    c = len(runs[0][0])
    dirs = idx.directions()
    Q = np.atleast_2d(Q).astype(np.float64)
    if idx.metric == "mips":
        nq = np.linalg.norm(Q, axis=1, keepdims=True)
        QP = np.where(nq > 0, Q / np.where(nq > 0, nq, 1), 0) * math.sqrt(idx.msq) @ dirs[:, : idx.dim].T
    else:
        QP = Q @ dirs.T
    visit = max(ntv * m, math.ceil(ptv * c * m) if ptv >= 0 else -1)
    retrieve = max(ntr, math.ceil(ptr * c) if ptr >= 0 else -1)
    kk = min(k, c)
    cands: set[int] = set()

    def choose(j: int, qp: np.ndarray, left: dict, right: dict, prio: dict, cur: dict) -> None:
        keys = runs[j][1].astype(np.float64)
        gl = qp[j] - keys[left[j]] if left[j] >= 0 else math.inf
        gr = keys[right[j]] - qp[j] if right[j] < c else math.inf
        if gl == math.inf and gr == math.inf:
            prio[j], cur[j] = math.inf, None
        elif gr < gl:
            prio[j], cur[j] = gr, right[j]
            right[j] += 1
        else:
            prio[j], cur[j] = gl, left[j]
            left[j] -= 1

    for qp in QP:
        left, right, prio, cur = {}, {}, {}, {}
        for j in range(L * m):
            lo = int(np.sum(runs[j][1].astype(np.float64) < qp[j]))
            left[j], right[j] = lo - 1, lo
            choose(j, qp, left, right, prio, cur)
        count: dict[tuple[int, int], int] = {}
        mine: set[int] = set()
        for r in range(c * m):
            for comp in range(L):
                js = [comp * m + jj for jj in range(m)]
                h = min(js, key=lambda j: (prio[j], j))
                if prio[h] == math.inf:
                    continue
                x = int(runs[h][0][cur[h]])
                count[(comp, x)] = count.get((comp, x), 0) + 1
                if count[(comp, x)] == m and x not in mine:
                    mine.add(x)
                choose(h, qp, left, right, prio, cur)
            if len(mine) >= kk and (r + 1 >= visit or len(mine) >= retrieve):
                break
        cands |= mine
    ids = np.array(sorted(cands), np.int64)
    d = brute(idx.data(), Q.astype(np.float32), idx.metric)[ids]
    order = np.lexsort((ids, d))[: min(k, len(ids))]
    return ids[order], d[order]


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 120), d=st.integers(1, 6), k=st.integers(1, 15),
       metric=st.sampled_from(["euclidean", "mips"]), L=st.integers(1, 3), m=st.integers(1, 3), g=st.integers(1, 3),
       ntv=st.integers(-1, 30), ptv=st.sampled_from([-1.0, 0.1, 0.5, 1.0]), ntr=st.integers(-1, 30),
       ptr=st.sampled_from([-1.0, 0.0, 0.2, 0.8]), dup=st.booleans())
def test_walk_matches_spec_reference(seed, n, d, k, metric, L, m, g, ntv, ptv, ntr, ptr, dup):
    """The compiled prioritized walk (generic and the one-direction fast path) equals the written-out spec."""
    X = data(seed, n, d)
    if dup:
        X = np.round(X)  # many tied projections
    Q = data(seed + 1, g, d)
    idx = PrioritizedDCI(d, metric, num_comp_indices=L, num_simp_indices=m, seed=seed)
    idx.build(X)
    cfg = SearchConfig(num_to_visit=ntv, prop_to_visit=ptv, num_to_retrieve=ntr, prop_to_retrieve=ptr)
    ids, dist = idx.query(Q, k, config=cfg)
    rids, rdist = reference_walk(idx, Q, k, cfg)
    np.testing.assert_allclose(dist, rdist, rtol=1e-6, atol=1e-6)
    if len(np.unique(rdist)) == len(rdist):
        np.testing.assert_array_equal(ids, rids)


# ---------------------------------------------------------------------------------------------- properties 2, 3
@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(0, 1500), d=st.integers(1, 16), k=st.integers(1, 64),
       metric=st.sampled_from(["euclidean", "mips"]), g=st.integers(1, 3), preset=st.sampled_from(["icecache", "dci-knn"]),
       prop=st.floats(0.0, 1.0), fov=st.integers(1, 40), beam=st.sampled_from(["shared", "per-query"]))
def test_default_queries_are_valid(seed, n, d, k, metric, g, preset, prop, fov, beam):
    X = data(seed, n, d, clustered=True)
    Q = data(seed + 3, g, d)
    idx = DCIIndex(d, metric, replace(DCIParams.preset(preset), group_beam=beam), seed=seed)
    idx.build(X)
    for cfg in (None, SearchConfig(field_of_view=fov, prop_to_retrieve=prop)):
        ids, dist = idx.query(Q, k, config=cfg)
        assert_valid_result(idx, X, Q, k, ids, dist, metric)


# ---------------------------------------------------------------------------------------------- property 4, 5, 6
@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 3000), d=st.integers(1, 8), metric=st.sampled_from(["euclidean", "mips"]),
       p0=st.sampled_from([0.03, 0.1, 0.3]), p1=st.sampled_from([0.2, 0.5]), descent=st.booleans())
def test_tree_invariants_and_exact_parents(seed, n, d, metric, p0, p1, descent):
    """Property 5: brute force, or the descent with an exhaustive construction config, finds exact parents."""
    X = data(seed, n, d, clustered=True)
    extra = {"brute_force_threshold": 0, "bulk_brute_force_threshold": 0,
             "construction": SearchConfig(field_of_view=10**9, prop_to_retrieve=1.0)} if descent else {}
    idx = DCIIndex(d, metric, DCIParams(p0=p0, p1=p1, **extra), seed=seed)
    idx.build(X)
    idx.check()
    assert_parents_are_nearest(idx)


def assert_parents_are_nearest(idx: DCIIndex, tol: float = 1e-6) -> None:
    """Property 5/10: no node of the level above is strictly closer than a node's parent."""
    lev, par = idx.levels(), idx.parents()
    for l in range(idx.num_levels - 1):
        nodes, up = idx.members(l), idx.members(l + 1)
        if len(nodes) == 0:
            continue
        dp = idx.point_distance(nodes, par[nodes])
        best = np.min(np.stack([idx.point_distance(nodes, np.full(len(nodes), u)) for u in up]), axis=0)
        scale = tol * (1.0 + (idx.msq if idx.metric == "mips" else float(np.abs(idx.data()).max() ** 2)))
        assert (dp <= best + scale).all(), f"level {l}: a node of level {l + 1} is closer than the parent"
    assert (lev[par[par >= 0]] >= 1).all()


def reference_schedule(n: int, p0: float, p1: float) -> list[int]:
    """MD's deterministic schedule written straight from docs/index.md, promotion schedule (slow, obvious)."""
    counts: list[int] = []
    nxt, out = 0, []
    for _ in range(n):
        t = nxt
        if t == len(counts):
            counts.append(1)
            nxt = 0
        else:
            counts[t] += 1
            p = p0 if t == 0 else p1
            if t == len(counts) - 1:
                nxt = t + 1 if counts[t] == math.ceil(1 / p - 1e-9) else 0
            else:
                nxt = t + 1 if counts[t] >= counts[t + 1] / p else 0
        out.append(t)
    return out


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 5000), p0=st.floats(0.01, 0.5), p1=st.floats(0.05, 0.6))
def test_level_schedule(n, p0, p1):
    """Property 6 (MD schedule): the kernel matches the spec's rule; level sizes keep their ratios; the top
    level holds at most ceil(1/p) points."""
    counts = np.zeros(64, np.int64)
    nxt = np.zeros(1, np.int64)
    lv = np.empty(n, np.int64)
    new_top = np.empty(n, np.bool_)
    edit_kernels.md_schedule(n, counts, nxt, p0, p1, math.ceil(1 / p0 - 1e-9), math.ceil(1 / p1 - 1e-9), lv, new_top)
    assert lv.tolist() == reference_schedule(n, p0, p1)
    h = int(counts[63])
    sizes = np.bincount(lv, minlength=h) if n else np.zeros(0, np.int64)
    assert np.array_equal(sizes, counts[:h])
    if h:
        assert sizes[-1] <= math.ceil(1 / (p0 if h == 1 else p1) - 1e-9)
    for t in range(h - 1):
        p = p0 if t == 0 else p1
        assert sizes[t + 1] <= p * sizes[t] + 1 + 1e-9, (t, sizes)
        assert sizes[t] <= sizes[t + 1] / p + 1 + 1e-9 or t + 1 == h - 1, (t, sizes)
    assert int(new_top.sum()) == h


# ---------------------------------------------------------------------------------------------- property 7
@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 400), d=st.integers(1, 10), k=st.integers(1, 30),
       metric=st.sampled_from(["euclidean", "mips"]), props=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=5))
def test_monotone_in_retrieve_limit(seed, n, d, k, metric, props):
    X = data(seed, n, d)
    q = data(seed + 1, 1, d)[0]
    idx = PrioritizedDCI(d, metric, seed=seed)
    idx.build(X)
    prev = None
    for p in sorted(props):
        _, dist = idx.query(q, k, config=SearchConfig(prop_to_retrieve=p))
        if prev is not None:
            assert len(dist) >= len(prev)
            assert (dist[: len(prev)] <= prev + 1e-9).all()
        prev = dist


# ---------------------------------------------------------------------------------------------- property 8
@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(2, 300), d=st.integers(2, 10), k=st.integers(1, 20),
       power=st.integers(-3, 3), multi=st.booleans())
def test_scaling_by_powers_of_two_keeps_ids(seed, n, d, k, power, multi):
    """Euclidean mode: scaling everything by 2^p is exact in floating point, so ids must not change."""
    X = data(seed, n, d)
    q = data(seed + 1, 1, d)[0]
    c = np.float32(2.0**power)
    out = []
    for s in (np.float32(1.0), c):
        idx = DCIIndex(d, "euclidean", seed=seed) if multi else PrioritizedDCI(d, seed=seed, query=SearchConfig(prop_to_retrieve=0.3))
        idx.build(X * s)
        out.append(idx.query(q * s, k)[0])
    assert np.array_equal(out[0], out[1])


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(2, 300), d=st.integers(2, 10), k=st.integers(1, 20))
def test_translation_keeps_ids(seed, n, d, k):
    """Euclidean mode, single level: translating points and query shifts every projection uniformly."""
    X = data(seed, n, d).astype(np.float64)
    q = data(seed + 1, 1, d)[0].astype(np.float64)
    shift = np.random.default_rng(seed + 2).integers(-4, 5, d).astype(np.float64)
    res = []
    for s in (0.0, 1.0):
        idx = PrioritizedDCI(d, seed=seed, query=SearchConfig(prop_to_retrieve=0.3))
        idx.build((X + s * shift).astype(np.float32))
        res.append(idx.query((q + s * shift).astype(np.float32), k))
    # Float32 rounding of shifted projections may reorder near-ties; the distance profile must agree.
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- property 9
@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 200), d=st.integers(1, 16), slack=st.floats(1.0, 4.0))
def test_transform_properties(seed, n, d, slack):
    X = torch.from_numpy(data(seed, n, d, scale=3.0)).double()
    q = torch.from_numpy(data(seed + 1, 1, d)).double()
    c = float(X.norm(dim=1).max()) * slack
    for form in ("paper", "scaled"):
        T = transform_keys(X, c, form)
        norms = T.norm(dim=1)
        assert torch.allclose(norms, torch.full_like(norms, 1.0 if form == "paper" else c), rtol=1e-9, atol=1e-9)
        d2 = ((T - transform_queries(q)) ** 2).sum(1)
        ip = (X @ q[0])
        assert torch.isclose(ip[int(torch.argmin(d2))], ip.max(), rtol=1e-9, atol=1e-9)
    T = transform_keys(X, c, "scaled")
    kk = key_key_distance(X, X, c * c)
    half = 0.5 * ((T[:, None] - T[None]) ** 2).sum(-1)
    assert (kk >= 0).all()
    assert torch.allclose(kk, half, atol=1e-7 * c * c)


@FAST
@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), d=st.integers(1, 10), k=st.integers(1, 20), bump=st.floats(1.01, 3.0))
def test_mips_results_do_not_depend_on_c(seed, n, d, k, bump):
    """Exhaustive MIPS results are the same before and after a rekey (a larger c)."""
    X = data(seed, n, d)
    q = data(seed + 1, 1, d)[0]
    idx = DCIIndex(d, "mips", seed=seed)
    idx.build(X)
    before = idx.query(q, k, config=EXHAUSTIVE)
    big = np.full((1, d), math.sqrt(idx.msq) * bump / math.sqrt(d) + 1e-3, np.float32)  # longer than any key
    idx.insert(big)
    assert idx.num_rekeys == 1
    idx.check()
    ids, dist = idx.query(q, k + 1, config=EXHAUSTIVE)
    keep = ids != n  # drop the new point
    np.testing.assert_allclose(dist[keep][: len(before[1])], before[1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- property 10
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n0=st.integers(0, 400), d=st.integers(1, 8),
       batches=st.lists(st.tuples(st.integers(1, 120), st.floats(0.3, 3.0)), min_size=1, max_size=6),
       metric=st.sampled_from(["euclidean", "mips"]), p0=st.sampled_from([0.03, 0.2]), descent=st.booleans())
def test_incremental_invariants(seed, n0, d, batches, metric, p0, descent):
    X = data(seed, n0, d, clustered=True)
    extra = {"brute_force_threshold": 0, "bulk_brute_force_threshold": 0,
             "construction": SearchConfig(field_of_view=10**9, prop_to_retrieve=1.0)} if descent else {}
    idx = DCIIndex(d, metric, DCIParams(p0=p0, **extra), seed=seed)
    idx.build(X)
    allx = [X]
    for i, (m, scale) in enumerate(batches):
        B = data(seed + 100 + i, m, d, clustered=True, scale=scale)
        idx.insert(B)
        allx.append(B)
    X = np.concatenate(allx)
    assert len(idx) == len(X)
    np.testing.assert_array_equal(idx.data(), X)
    idx.check()
    assert_parents_are_nearest(idx)
    q = data(seed + 5, 1, d)[0]
    _, dist = idx.query(q, 10, config=EXHAUSTIVE)
    ref = brute(X, q, metric)
    np.testing.assert_allclose(dist, np.sort(ref)[: len(dist)], atol=1e-5 * (1 + np.abs(ref).max()))
    # The level schedule continues across build and inserts: same levels as one build of everything.
    one = DCIIndex(d, metric, DCIParams(p0=p0, **extra), seed=seed)
    one.build(X)
    assert np.array_equal(one.levels(), idx.levels())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), d=st.integers(1, 70), metric=st.sampled_from(["euclidean", "mips"]),
       scale=st.floats(1e-3, 1e3))
def test_compiled_lift_of_one_point_equals_lift(seed, n, d, metric, scale):
    """The decode-time insert lifts its point with `DCITree.lift_one` (compiled); it stores what `lift` stores:
    float64 sums in another order, rounded to float32. The MIPS extension ``sqrt(msq - |x|^2)`` cancels for the
    longest keys, so both are compared on the scale of the lifted norm ``sqrt(msq)``."""
    idx = DCIIndex(d, metric, DCIParams(), seed=seed)
    idx.build(data(seed, n, d, clustered=True, scale=scale))
    tree = idx.tree
    ids = np.arange(n)
    tree.lift(ids)
    proj, ext = tree.proj[:n].copy(), tree.ext[:n].copy()
    for point in ids:
        tree.lift_one(int(point))
    scale = max(float(np.abs(proj).max()), math.sqrt(tree.msq))
    np.testing.assert_allclose(tree.proj[:n], proj, rtol=1e-6, atol=1e-6 * scale)
    np.testing.assert_allclose(tree.ext[:n], ext, rtol=1e-6, atol=1e-6 * scale)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(40, 3000), d=st.sampled_from([1, 7, 16, 64]), inserted=st.integers(0, 200),
       scale=st.floats(1e-2, 1e2))
def test_packed_level1_search_is_the_scattered_one(seed, n, d, inserted, scale):
    """A decode insert finds its parent among level 1's keys packed contiguously (`DCITree.level1_packed`,
    `brute_nearest_packed`): the same node and the same float64 distance, bit for bit, as the search over
    scattered rows (`brute_nearest_one`), and the packed copy stays the rows it copies through inserts and rekeys
    (longer keys: `DCITree.check` compares them)."""
    idx = DCIIndex(d, "mips", DCIParams(), seed=seed)
    idx.build(data(seed, n, d, clustered=True, scale=scale))
    idx.insert(data(seed + 1, inserted, d, clustered=True, scale=scale * 1.5))
    tree = idx.tree
    idx.check()
    if tree.num_levels < 2:
        return
    up, vectors, ext = tree.level1_packed()
    assert np.array_equal(up, tree.members(1))
    for point in range(0, tree.num_points, max(1, tree.num_points // 50)):
        want = edit_kernels.brute_nearest_one(point, up, tree.vectors, tree.ext, 2, float(tree.msq))
        got = edit_kernels.brute_nearest_packed(point, up, vectors, ext, tree.vectors, tree.ext, float(tree.msq))
        assert got[0] == want[0] and got[1] == want[1]


def test_slab_compaction_keeps_structure():
    """Relocated clusters leave garbage in the run slab; compaction moves blocks without changing results."""
    X = data(4, 3000, 8, clustered=True)
    idx = DCIIndex(8, "mips", seed=4)
    idx.build(X[:200])
    for i in range(200, 3000, 7):
        idx.insert(X[i : i + 7])
    q = data(5, 3, 8)
    before = idx.query(q, 20)
    used = idx.tree.slab_used
    idx.tree.compact()
    assert idx.tree.slab_used <= used
    idx.check()
    after = idx.query(q, 20)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])


def test_new_top_level_adopts_old_tops():
    """With p = 0.5 the top level caps at 2 points; the next point promoted past it opens a new level whose
    only node adopts every old top node."""
    idx = DCIIndex(2, "euclidean", DCIParams(p0=0.5, p1=0.5), seed=0)
    pts = data(3, 40, 2)
    opened = 0
    for i, p in enumerate(pts):
        h = idx.num_levels
        idx.insert(p[None])
        idx.check()
        if idx.num_levels > h:
            opened += 1
            assert idx.members(idx.num_levels - 1).tolist() == [i]
            if h:
                assert (idx.parents()[idx.members(h - 1)] == i).all()
    assert idx.levels().tolist() == reference_schedule(40, 0.5, 0.5)
    assert opened == idx.num_levels >= 3


# ---------------------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("metric", ["euclidean", "mips"])
def test_empty_and_tiny(metric):
    idx = DCIIndex(4, metric)
    idx.build(np.zeros((0, 4), np.float32))
    idx.check()
    ids, dist = idx.query(np.ones(4, np.float32), 3)
    assert len(ids) == 0 and len(dist) == 0
    idx.insert(np.ones((1, 4), np.float32))
    idx.check()
    ids, dist = idx.query(np.ones(4, np.float32), 3)
    assert ids.tolist() == [0]
    idx.build(np.arange(8, dtype=np.float32).reshape(2, 4))
    ids, _ = idx.query(np.zeros(4, np.float32), 10)
    assert sorted(ids.tolist()) == [0, 1]  # n < k: all points


@pytest.mark.parametrize("metric", ["euclidean", "mips"])
def test_duplicates_and_zero_query(metric):
    X = np.repeat(data(0, 3, 6), 200, axis=0)  # 600 points, 3 distinct
    idx = DCIIndex(6, metric)
    idx.build(X)
    idx.check()
    for q in (np.zeros(6, np.float32), X[0], -X[1]):
        ids, dist = idx.query(q, 50)
        assert np.isfinite(dist).all() and len(np.unique(ids)) == 50
        assert_valid_result(idx, X, q, 50, ids, dist, metric)


def test_larger_keys_never_make_nan():
    rng = np.random.default_rng(0)
    idx = DCIIndex(8, "mips")
    idx.build(rng.standard_normal((300, 8)).astype(np.float32))
    for scale in (2.0, 1.5, 10.0, 10.0, 100.0):
        idx.insert((rng.standard_normal((20, 8)) * scale).astype(np.float32))
        assert np.isfinite(idx.projections()).all()
        idx.check()
    assert idx.num_rekeys >= 3
    _, dist = idx.query(rng.standard_normal(8).astype(np.float32), 10)
    assert np.isfinite(dist).all()


def test_bad_input():
    idx = DCIIndex(4)
    with pytest.raises(InputError):
        idx.build(np.zeros((3, 5), np.float32))
    with pytest.raises(InputTypeError):
        idx.build(np.zeros((3, 4), np.int64))
    with pytest.raises(InputError):
        idx.build(np.full((3, 4), np.nan, np.float32))
    with pytest.raises(InputError):
        idx.query(np.zeros(4, np.float32), -1)
    with pytest.raises(ConfigError):
        DCIIndex(4, metric="cosine")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DCIParams(p0=0.0)
    with pytest.raises(ConfigError):
        SearchConfig(field_of_view=0)
    with pytest.raises(ConfigError):
        DCIParams.preset("nope")


def test_limit_conventions():
    assert SearchConfig(num_to_visit=-1, prop_to_visit=-1, num_to_retrieve=-1, prop_to_retrieve=-1).limits("query") == (-1, 1.0, -1, 0.05)
    assert SearchConfig(prop_to_retrieve=-1).limits("construction")[3] == 0.002
    assert SearchConfig(prop_to_retrieve=3.0).limits("query")[3] == 1.0
    # Only the visit limit binds: with num_to_visit = k and retrieval off, exactly the first rounds count.
    X = data(0, 200, 4)
    idx = PrioritizedDCI(4, num_comp_indices=1, num_simp_indices=1)
    idx.build(X)
    ids, _ = idx.query(X[0], 5, config=SearchConfig(num_to_visit=5, prop_to_visit=-1, num_to_retrieve=10**6, prop_to_retrieve=-1))
    assert len(ids) == 5


# ---------------------------------------------------------------------------------------------- property 12
def _build_and_query(args):
    seed, metric = args
    X = data(seed, 2500, 16, clustered=True)
    idx = DCIIndex(16, metric, seed=seed)
    idx.build(X[:2000])
    idx.insert(X[2000:])
    res = [idx.query(q, 10) for q in data(seed + 9, 5, 16)]
    return idx.levels(), idx.parents(), idx.projections(), [r[0] for r in res], [r[1] for r in res]


def test_deterministic_for_any_thread_count():
    jobs = [(s, m) for s in (1, 2) for m in ("euclidean", "mips")]
    with ThreadPoolExecutor(1) as ex:
        one = list(ex.map(_build_and_query, jobs))
    with ThreadPoolExecutor(2) as ex:
        two = list(ex.map(_build_and_query, jobs))
    for a, b in zip(one, two):
        for x, y in zip(a, b):
            if isinstance(x, list):
                for u, v in zip(x, y):
                    np.testing.assert_array_equal(u, v)
            else:
                np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------------------------- the jobs composed
def oracle_page_scores(idx: DCIIndex, Q: np.ndarray, budget: int) -> list[float]:
    """Scores of the pages an exact ranking takes: every page scored by its best ``max_g q_g . k``, best first
    (ties by id), taken while the next one fits in ``budget`` tokens."""
    table = idx.table
    s = -brute(idx.data(), Q, "mips")
    best = {page: float(s[pos].max()) for page, pos in table.as_dict().items()}
    out, total = [], 0
    for page in sorted(best, key=lambda pg: (-best[pg], pg)):
        if total + table.size(page) > budget:
            break
        out.append(best[page])
        total += table.size(page)
    return out


@FAST
@given(seed=st.integers(0, 2**16), n0=st.integers(0, 300), d=st.integers(1, 8),
       batches=st.lists(st.tuples(st.integers(1, 40), st.floats(0.3, 3.0)), min_size=1, max_size=5),
       metric=st.sampled_from(["euclidean", "mips"]), P=st.sampled_from([1, 4, 16]),
       split=st.sampled_from(["projection", "2means"]), beam=st.sampled_from(["shared", "per-query"]),
       g=st.integers(1, 3), budget=st.integers(0, 200))
def test_build_insert_and_search_compose_exactly(seed, n0, d, batches, metric, P, split, beam, g, budget):
    """`DCIIndex` runs the build (`dci_build`), insert (`dci_update`) and search (`dci_search`) jobs over one
    `DCITree`: after a build and inserts (one point at a time: page splits and merges, adoptions, new top
    levels and, with growing key scales, rekeys), the structure is valid and exhaustive queries and page
    rankings equal brute force."""
    table = PageTable(P) if metric == "mips" else None
    params = DCIParams(query=EXHAUSTIVE, page_split=split, group_beam=beam)
    idx = DCIIndex(d, metric, params, seed=seed, table=table)
    X = data(seed, n0, d, clustered=True)
    idx.build(X)
    parts = [X]
    for i, (m, scale) in enumerate(batches):
        parts.append(data(seed + 100 + i, m, d, clustered=True, scale=scale))
        for row in parts[-1]:
            idx.insert(row[None])
    X = np.concatenate(parts)
    np.testing.assert_array_equal(idx.data(), X)
    idx.check()
    Q = data(seed + 9, g, d)
    k = min(10, len(X))
    ids, dist = idx.query(Q, k)  # params.query is exhaustive
    assert_valid_result(idx, X, Q, k, ids, dist, metric)
    ref = brute(X, Q, metric)
    np.testing.assert_allclose(dist, np.sort(ref)[:k], atol=1e-5 * (1 + np.abs(ref).max()))
    if table is not None:
        pages, scores = idx.rank_pages(Q, budget)
        want = oracle_page_scores(idx, Q, budget)
        s = -ref  # max over the group of q . k
        got = [float(s[table.positions(int(page))].max()) for page in pages]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(s).max()))
        np.testing.assert_allclose(scores, np.array(got, np.float32), rtol=1e-5, atol=1e-5 * (1 + np.abs(s).max()))


def test_flat_overrides_name_every_knob():
    """`DCIParams.with_overrides` (what `MDCIPager` and ``--index-params`` use): flat names for the two search
    configs, ``None`` keeps a value, an unknown name is a one-line `ConfigError` listing the names."""
    base = DCIParams.preset("wide")
    p = base.with_overrides(field_of_view=30, num_to_visit=5, construction_prop_to_retrieve=0.5, p0=0.1, fov_max=None)
    assert p.query == replace(base.query, field_of_view=30, num_to_visit=5)
    assert p.construction == replace(base.construction, prop_to_retrieve=0.5)
    assert (p.p0, p.fov_max) == (0.1, 200)
    assert base.with_overrides() == base
    names = DCIParams.override_names()
    assert "query" not in names and "construction" not in names and "construction_field_of_view" in names
    with pytest.raises(ConfigError, match=r"^DCIParams has no parameter 'bogus'; its parameters: num_comp_indices, .*field_of_view"):
        base.with_overrides(bogus=1)
    with pytest.raises(ConfigError, match="p1"):
        base.with_overrides(p1=1.5)
