"""The native kernel library (`icecache.kernels`) against brute-force references, on every instruction set this
CPU runs: key scores against float64, the layer top-k against a float64 ranking (identical away from float ties),
the float16 first pass identical to the float32 scan, the exact pager identical with and without the library, the
environment's forced ISA, the fallback's warning, and a build from the sources into a fresh folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icecache.kernels import build, library
from icecache.kernels.library import native_kernels

KERNELS = native_kernels()
ISAS = KERNELS.available_isas() if KERNELS is not None else []
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native kernels not built (make setup)")


@pytest.fixture(params=ISAS or ["none"], scope="module")
def isa(request):
    """Run the test on one instruction set, then restore the one in use."""
    before = KERNELS.isa
    KERNELS.set_isa(request.param)
    yield request.param
    KERNELS.set_isa(before)


def _keys(rng: np.random.Generator, n: int, d: int, spread: float) -> np.ndarray:
    """Keys with norms spread over ``10**±spread`` (real keys: a few much longer than the rest)."""
    return (rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-spread, spread, (n, 1))).astype(np.float32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 300), d=st.sampled_from([4, 8, 16, 24, 64, 256]), g=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_scores_match_float64(isa, n, d, g, seed):
    rng = np.random.default_rng(seed)
    keys, q = _keys(rng, n, d, 1.0), rng.standard_normal((g, d)).astype(np.float32)
    ref = (q.astype(np.float64) @ keys.T.astype(np.float64)).max(0)
    bound = 2 * d * 2.0**-24 * (np.abs(q).astype(np.float64) @ np.abs(keys).T.astype(np.float64)).max(0) + 1e-30
    assert np.all(np.abs(KERNELS.scores(q, keys) - ref) <= bound)
    half = keys.astype(np.float16)
    ref16 = (q.astype(np.float64) @ half.T.astype(np.float64)).max(0)
    assert np.all(np.abs(KERNELS.scores(q, half) - ref16) <= bound * 1.01)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 7000), k=st.integers(1, 300), d=st.sampled_from([8, 24, 64, 256]), g=st.integers(1, 4),
       heads=st.integers(1, 3), spread=st.floats(0.0, 2.0), ties=st.booleans(), near=st.sampled_from([0.0, 1e-3, 1e-4]),
       threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_layer_top_tokens_float16_pass_equals_float32_scan(isa, n, k, d, g, heads, spread, ties, near, threads, seed):
    """The reduced-precision first pass changes nothing, on any number of threads (a head's scan split in chunks
    from 2048 keys): same positions, same scores, in the same order. ``near``:
    keys within that relative distance of one another, so that float16 rounding reorders them (the error bound
    must keep every key that can reach the top k)."""
    rng = np.random.default_rng(seed)
    keys = [_keys(rng, n, d, spread) for _ in range(heads)]
    if near:
        keys = [(x[:1] * (1 + near * rng.standard_normal((n, d)))).astype(np.float32) for x in keys]
    if ties:  # repeated rows: exact score ties the order must break by position
        for x in keys:
            x[rng.integers(0, n, n // 3)] = x[0]
    q = rng.standard_normal((heads, g, d)).astype(np.float32)
    counts = rng.integers(1, n + 1, heads)
    full = KERNELS.layer_top_tokens(q, keys, counts, k)
    half = KERNELS.layer_top_tokens(q, keys, counts, k, [x.astype(np.float16) for x in keys],
                                    [np.linalg.norm(x, axis=1).astype(np.float32) for x in keys], threads=threads)
    for a, b in zip(full[:3], half[:3]):
        np.testing.assert_array_equal(a, b)
    assert np.all(full[2] == np.minimum(k, counts))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3000), k=st.integers(1, 300), d=st.sampled_from([8, 64, 256]), g=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_layer_top_tokens_match_float64_ranking(isa, n, k, d, g, seed):
    """The top k by float64 scores (ties by position), except where float32 rounding can swap two keys."""
    rng = np.random.default_rng(seed)
    keys = _keys(rng, n, d, 0.5)
    q = rng.standard_normal((1, g, d)).astype(np.float32)
    pos, scores, found, _ = KERNELS.layer_top_tokens(q, [keys], np.array([n]), k, [keys.astype(np.float16)],
                                                     [np.linalg.norm(keys, axis=1).astype(np.float32)])
    ref = (q[0].astype(np.float64) @ keys.T.astype(np.float64)).max(0)
    order = np.lexsort((np.arange(n), -ref))[: min(k, n)]
    got = pos[0, : found[0]]
    assert found[0] == min(k, n)
    slack = 4 * d * 2.0**-24 * np.abs(ref).max()
    if k < n:  # a key may differ from the reference only within float rounding of the k-th score
        kth = ref[order[-1]]
        differ = set(got) ^ set(order)
        assert all(abs(ref[j] - kth) <= slack for j in differ)
    np.testing.assert_allclose(scores[0, : found[0]], ref[got], rtol=0, atol=slack)
    assert np.all(np.diff(scores[0, : found[0]]) <= 0)  # best first


def test_float16_conversion_matches_numpy(isa):
    """The native float -> half conversion (F16C, or the scalar rounding of the generic build) is numpy's,
    bit for bit: normals, subnormals, ties to even, the edge of the range; overflow is reported."""
    rng = np.random.default_rng(5)
    values = np.concatenate([rng.standard_normal(997) * 10.0 ** rng.uniform(-9, 4.7, 997),
                             [0.0, -0.0, 65504.0, 65519.0, -65519.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-11]])
    values = values.astype(np.float32)
    got, finite = KERNELS.to_half(values)
    np.testing.assert_array_equal(got.view(np.uint16), values.astype(np.float16).view(np.uint16))
    assert finite
    assert not KERNELS.to_half(np.array([65520.0] + [1.0] * 9, np.float32))[1]


def test_float16_copy_off_beyond_its_range():
    """A key past float16's range turns the pager's copy off (the call says so); selections still equal numba's."""
    from icecache.indexes.exact import ExactPager

    rng = np.random.default_rng(4)
    pager = ExactPager(8)
    pager.build(torch.from_numpy(_keys(rng, 500, 8, 0.3)))
    q = torch.from_numpy(rng.standard_normal((2, 8)).astype(np.float32))
    pager.select_arrays(q, 16)
    assert pager._half.done == 500
    pager.insert(torch.full((1, 8), 1e5))
    got = pager.select_arrays(q, 16)
    assert pager._half.done == -1 and not pager._half.usable and pager.index_bytes() == 501 * 8 * 4
    assert got[2][0] == 500  # the long key wins
    with library.numba_kernels():
        np.testing.assert_array_equal(pager.select_arrays(q, 16)[2], got[2])


def test_exact_pager_same_selection_with_and_without_the_library(monkeypatch):
    """Native (float16 first pass) and numba selections of the exact pager agree, head by head and per layer."""
    from icecache.indexes.exact import ExactPager

    rng = np.random.default_rng(3)
    pagers = []
    for _ in range(3):
        p = ExactPager(64)
        p.build(torch.from_numpy(_keys(rng, 3000, 64, 0.5)))
        for _ in range(5):
            p.insert(torch.from_numpy(_keys(rng, 1, 64, 0.5)), check=False)
        pagers.append(p)
    assert pagers[0]._half is not None
    q = torch.from_numpy(rng.standard_normal((3, 3, 64)).astype(np.float32))
    native_heads = ExactPager.select_layer_positions(pagers, q, 256)
    native_one = [p.select_arrays(q[h], 256) for h, p in enumerate(pagers)]
    monkeypatch.setitem(library._loaded, "kernels", None)
    numba_heads = ExactPager.select_layer_positions(pagers, q, 256)
    numba_one = [p.select_arrays(q[h], 256) for h, p in enumerate(pagers)]
    for a, b, c, e in zip(native_heads, numba_heads, native_one, numba_one):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(c[2], e[2])
        np.testing.assert_allclose(c[3], e[3], rtol=1e-5)


def test_forced_isa_from_the_environment():
    """``ICECACHE_ISA`` picks each path this CPU runs; one it does not run is refused at load."""
    for name in ISAS:
        out = subprocess.run([sys.executable, "-c", "from icecache.kernels.library import kernel_status as s; print(s().isa)"],
                             env={**os.environ, "ICECACHE_ISA": name}, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == name
    out = subprocess.run([sys.executable, "-c", "from icecache.kernels.library import native_kernels; native_kernels()"],
                         env={**os.environ, "ICECACHE_ISA": "sse9"}, capture_output=True, text=True, check=False)
    assert out.returncode != 0 and "sse9" in out.stderr


def test_missing_build_warns_once_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "LIBRARY", tmp_path / "missing.so")
    monkeypatch.setattr(library, "_loaded", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert library.native_kernels() is None
        assert library.native_kernels() is None
    assert len(caught) == 1 and "not built" in str(caught[0].message)
    status = library.kernel_status()
    assert not status.native and "make setup" in status.reason


def test_off_by_environment_is_quiet(monkeypatch):
    monkeypatch.setenv("ICECACHE_KERNELS", "off")
    monkeypatch.setattr(library, "_loaded", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert library.native_kernels() is None
    assert library.kernel_status().reason.startswith("off")


def test_build_from_the_sources_into_a_fresh_folder(tmp_path):
    manifest = build.build(tmp_path)
    assert manifest["isas"] == list(build.ISAS) and manifest["openmp"] and not manifest["skipped"], manifest
    assert (tmp_path / build.LIBRARY.name).exists()
    assert json.loads((tmp_path / build.MANIFEST.name).read_text())["source_hash"] == build.source_hash()
    fresh = library.NativeKernels(str(tmp_path / build.LIBRARY.name))
    q = np.ones((1, 8), np.float32)
    assert fresh.scores(q, np.eye(8, dtype=np.float32)).tolist() == [1.0] * 8


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pages=st.integers(1, 700), k=st.integers(1, 100), d=st.sampled_from([8, 24, 64, 256]), g=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_quest_pages_match_float64_bounds(isa, pages, k, d, g, seed):
    """Quest's page bound against a float64 evaluation of sum_c max(q_c lo_c, q_c hi_c), max over the group: the
    top pages agree except within float rounding of the k-th bound, and come best first."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((2, pages, d)).astype(np.float32)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    q = rng.standard_normal((1, g, d)).astype(np.float32)
    got, scores, found = KERNELS.layer_quest_pages(q, [lo], [hi], np.array([pages]), k)
    q64 = q[0].astype(np.float64)[:, None, :]
    ref = np.maximum(q64 * lo.astype(np.float64), q64 * hi.astype(np.float64)).sum(-1).max(0)
    order = np.lexsort((np.arange(pages), -ref))[: min(k, pages)]
    ids = got[0, : found[0]]
    assert found[0] == min(k, pages)
    slack = 4 * d * 2.0**-24 * np.abs(q64 * np.maximum(np.abs(lo), np.abs(hi))).sum(-1).max()
    if k < pages:
        kth = ref[order[-1]]
        assert all(abs(ref[j] - kth) <= slack for j in set(ids) ^ set(order))
    np.testing.assert_allclose(scores[0, : found[0]], ref[ids], rtol=0, atol=slack)
    assert np.all(np.diff(scores[0, : found[0]]) <= 0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 2500), g=st.integers(1, 5), budget=st.integers(1, 400),
       preset=st.sampled_from(["wide", "icecache", "dci-knn"]), page_score=st.sampled_from(["max", "mass"]),
       group_beam=st.sampled_from(["shared", "per-query"]), page_size=st.sampled_from([1, 4, 16]),
       inserted=st.integers(0, 40), d=st.sampled_from([8, 20, 64]), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_mdci_layer_ranking_equals_the_numba_descent(isa, n, g, budget, preset, page_score, group_beam, page_size,
                                                     inserted, d, threads, seed):
    """The native M-DCI ranking (dci_rank.cpp) is the numba descent step for step: the same pages in the same order
    for every preset (one simple index, and dci-knn's 2 x 7 prioritized walk), page score, beam rule and ISA; scores
    agree to float64 rounding (only the summation order of the float64 dots differs)."""
    from icecache.indexes.dci_layer import rank_pages_layer
    from icecache.indexes.mdci import MDCIPager

    rng = np.random.default_rng(seed)
    trees = []
    for h in range(3):
        pager = MDCIPager(d, page_size=page_size, params=preset, page_score=page_score, group_beam=group_beam, seed=h)
        pager.build(torch.from_numpy(_keys(rng, n, d, 0.5)))
        for _ in range(inserted):
            pager.insert(torch.from_numpy(_keys(rng, 1, d, 0.5)), check=False)
        trees.append(pager.index.tree)
    queries = rng.standard_normal((3, g, d)).astype(np.float32)
    native = rank_pages_layer(trees, queries, budget, threads=threads)
    with library.numba_kernels():
        reference = rank_pages_layer(trees, queries, budget, threads=1)
    for (pages, scores), (ref_pages, ref_scores) in zip(native, reference):
        np.testing.assert_array_equal(pages, ref_pages)
        np.testing.assert_allclose(scores, ref_scores, rtol=1e-6, atol=1e-6)


def test_mdci_pager_selects_alike_head_by_head_and_per_layer():
    """With the library, a pager's own select and the layer call run the same kernel: identical selections."""
    from icecache.indexes.mdci import MDCIPager

    rng = np.random.default_rng(5)
    pagers = []
    for h in range(3):
        pager = MDCIPager(64, seed=h)
        pager.build(torch.from_numpy(_keys(rng, 3000, 64, 0.5)))
        pagers.append(pager)
    q = torch.from_numpy(rng.standard_normal((3, 3, 64)).astype(np.float32))
    layer = MDCIPager.select_layer_positions(pagers, q, 256)
    for h, pager in enumerate(pagers):
        pages, indptr, positions, _ = pager.select_arrays(q[h], 256)
        for x, y in zip(layer[h], (pages, indptr, positions)):
            np.testing.assert_array_equal(x, y)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 1200), inserted=st.integers(1, 80), seed=st.integers(0, 10_000),
       scale=st.sampled_from([0.5, 1.0, 1.3]), page_size=st.sampled_from([2, 8, 16]), half=st.booleans())
def test_mdci_layer_insert_equals_the_numba_inserts_head_by_head(n, inserted, seed, scale, page_size, half):
    """One native insert call per layer row (``dci_insert.cpp``) leaves every tree array, page table and host store
    as `HeadStore.insert_token` head by head on the numba kernels does (the parent distances to float64 rounding):
    leaf inserts written straight into the store, full pages, new clusters, and (keys longer than the index's)
    rekeys."""
    from icecache.indexes.mdci import MDCIPager
    from icecache.runtime.store import HeadStore

    dtype = torch.float16 if half else torch.float32
    rng = np.random.default_rng(seed)
    base = [_keys(rng, n, 16, 0.3) for _ in range(3)]
    extra = (rng.standard_normal((inserted, 3, 16)) * scale * np.abs(base[0]).max() / 2).astype(np.float32)

    def grown(native: bool):
        pagers = [MDCIPager(16, page_size=page_size, seed=h, record_moves=True) for h in range(3)]
        stores = []
        for h, pager in enumerate(pagers):
            pager.table.record_moves = False
            pager.build(torch.from_numpy(base[h]))
            pager.table.record_moves = True
            store = HeadStore(pager.table, 16, dtype)
            store.load_layout(torch.from_numpy(base[h]).to(dtype), torch.from_numpy(-base[h]).to(dtype))
            stores.append(store)
        for i in range(inserted):
            k32 = torch.from_numpy(extra[i])
            k, v = k32.to(dtype), (-k32).to(dtype)
            if native:
                assert HeadStore.insert_layer_token(pagers, stores, k32, k, v, n + i)
            else:
                with library.numba_kernels():
                    for h in range(3):
                        stores[h].insert_token(pagers[h], k32[h : h + 1], k[h : h + 1], v[h : h + 1], n + i)
        return pagers, stores

    (fast, fast_stores), (slow, slow_stores) = grown(True), grown(False)
    for h in range(3):
        tf, ts = fast[h].index.tree, slow[h].index.tree
        assert tf.num_points == ts.num_points == n + inserted and tf.level_counts == ts.level_counts
        for name in ("vectors", "ext", "proj", "level_of", "parent_of", "num_descendants", "cluster_start",
                     "cluster_size", "cluster_cap", "run_key", "run_id", "vectors_run0", "schedule_counts",
                     "schedule_next"):
            assert np.array_equal(getattr(tf, name), getattr(ts, name)), name
        # the parent distance is a float64 dot summed in another order (numba's fastmath vectorised sum)
        np.testing.assert_allclose(tf.parent_dist, ts.parent_dist, rtol=1e-12, atol=1e-12)
        for name in ("members", "sizes_", "page_of_", "slot_of_"):
            assert np.array_equal(getattr(fast[h].table, name), getattr(slow[h].table, name)), name
        assert fast[h].table.journal_is_empty() and len(fast[h]) == len(slow[h]) == n + inserted
        got, want = fast_stores[h].read(np.arange(n + inserted)), slow_stores[h].read(np.arange(n + inserted))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[0], torch.from_numpy(np.concatenate([base[h], extra[:, h]])).to(dtype))
