"""Page ranking for every KV head of one layer in one compiled call: the ``mdci`` pager's fused select
(`icecache.indexes.mdci.MDCIPager.select_layer_positions`).

A decode step of a sparse layer ranks pages in one DCI tree per KV head. Head by head, that is one Python round
trip (about 35 unboxed arguments) per tree, and the heads run one after the other on the decode thread. Here
every head's `icecache.indexes._dci_kernels.rank_pages` runs inside one call, either in a plain loop or on
numba's own threads (``prange`` over the heads, ``threads > 1``). Each head has its own scratch set, so the
result is the head-by-head one, bit for bit, whatever the thread count.

With the native kernels built (`icecache.kernels`), the same ranking runs in ``dci_rank.cpp``: one ctypes call per
layer (the numba call's ~40 typed arguments per head cost about 120 us a layer) on torch's OpenMP threads, with
the token scores widened to float64 in SIMD lanes. It is the numba algorithm step for step; only the float64
summation order differs, so scores agree to ~1e-15 and the pages are the same away from exact ties
(tests/test_kernels.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numba import njit, prange

from icecache.indexes import _dci_kernels as kernels
from icecache.indexes.dci_search import Scratch, field_of_view, thread_scratch
from icecache.indexes.dci_tree import DCITree
from icecache.kernels.library import DCI_DESCRIPTOR_WIDTH, NativeKernels, array_address, cached_row, native_kernels


@njit(nogil=True, cache=True)
def _rank_head(
    h, Q, dirs, norm_c, X, Xr, run_key, run_id, cl_start, cl_size, sub, top_level, L, m, F, kk, cover,
    ntv, ptv, ntr, ptr, cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool, gsc, per_query_beam,
    page_of, page_sizes, budget, mass, scale, page_best, page_stamp, page_list, out_pages, out_scores,
) -> int:
    QP = kernels.query_projections(Q[h], dirs[h], norm_c[h], True)
    return kernels.rank_pages(
        Q[h], QP, X[h], Xr[h], run_key[h], run_id[h], cl_start[h], cl_size[h], sub[h], top_level[h], L, m, F[h],
        kk, cover, ntv, ptv, ntr, ptr, cnt[h], cnt_stamp[h], cand_stamp[h], eval_stamp[h], dist[h], stamp[h],
        pool[h], gsc[h], per_query_beam, page_of[h], page_sizes[h], budget, mass, scale[h], page_best[h],
        page_stamp[h], page_list[h], out_pages[h], out_scores[h],
    )


@njit(nogil=True, cache=True)
def _rank_heads_serial(
    Q, dirs, norm_c, X, Xr, run_key, run_id, cl_start, cl_size, sub, top_level, L, m, F, kk, cover,
    ntv, ptv, ntr, ptr, cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool, gsc, per_query_beam,
    page_of, page_sizes, budget, mass, scale, page_best, page_stamp, page_list, out_pages, out_scores, counts,
) -> None:
    for h in range(Q.shape[0]):
        counts[h] = _rank_head(
            h, Q, dirs, norm_c, X, Xr, run_key, run_id, cl_start, cl_size, sub, top_level, L, m, F, kk, cover,
            ntv, ptv, ntr, ptr, cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool, gsc, per_query_beam,
            page_of, page_sizes, budget, mass, scale, page_best, page_stamp, page_list, out_pages, out_scores,
        )


@njit(nogil=True, cache=True, parallel=True)
def _rank_heads_parallel(
    Q, dirs, norm_c, X, Xr, run_key, run_id, cl_start, cl_size, sub, top_level, L, m, F, kk, cover,
    ntv, ptv, ntr, ptr, cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool, gsc, per_query_beam,
    page_of, page_sizes, budget, mass, scale, page_best, page_stamp, page_list, out_pages, out_scores, counts,
) -> None:
    # The serial twin's body: numba's parfor lowering does not take a tuple of per-head tuples (``*args``).
    for h in prange(Q.shape[0]):
        counts[h] = _rank_head(
            h, Q, dirs, norm_c, X, Xr, run_key, run_id, cl_start, cl_size, sub, top_level, L, m, F, kk, cover,
            ntv, ptv, ntr, ptr, cnt, cnt_stamp, cand_stamp, eval_stamp, dist, stamp, pool, gsc, per_query_beam,
            page_of, page_sizes, budget, mass, scale, page_best, page_stamp, page_list, out_pages, out_scores,
        )


def _c(array: np.ndarray) -> np.ndarray:
    """C-contiguous (no copy when it already is): a tuple of per-head arrays must have one numba type."""
    return np.ascontiguousarray(array)


def layer_compatible(trees: Sequence[DCITree]) -> bool:
    """True when one call can rank the pages of every tree: non-empty MIPS trees with page tables and the
    same search parameters."""
    first = trees[0]
    for tree in trees:
        if tree.table is None or not tree.mips or tree.num_points == 0 or tree.params != first.params:
            return False
        if tree.table.page_size != first.table.page_size or tree.dim != first.dim:
            return False
    return True


def rank_pages_layer(trees: Sequence[DCITree], Q: np.ndarray, budget: int,
                     threads: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """`icecache.indexes.dci_search.rank_pages` for tree ``h`` and query group ``Q[h]`` ``[g, d]``, for every
    ``h`` of ``Q`` ``[H, g, d]`` in one compiled call, on numba's threads when ``threads > 1``. The trees must be
    `layer_compatible`; ``budget >= 1``.

    Returns one ``(page_ids int64 [j], scores float32 [j])`` per tree, equal to the tree-by-tree results.
    """
    heads = len(trees)
    Q = np.ascontiguousarray(Q, np.float32)
    params = trees[0].params
    page_size = trees[0].table.page_size
    results_per_cluster = max(1, -(-budget // page_size))
    scratches = [thread_scratch(t.capacity, params.num_comp_indices, t.table.id_capacity, Q.shape[1], slot=h)
                 for h, t in enumerate(trees)]
    native = native_kernels()
    if native is not None:
        counts = _native_rank(native, trees, scratches, Q, budget, results_per_cluster, threads)
        return [(s.out_pages[:k].copy(), s.out_scores[:k].astype(np.float32)) for s, k in zip(scratches, counts.tolist())]
    ntv, ptv, ntr, ptr = params.query.limits("query")
    default_scale = params.score_scale
    counts = np.zeros(heads, np.int64)
    kernel = _rank_heads_parallel if threads > 1 and heads > 1 else _rank_heads_serial
    kernel(
        Q, tuple(_c(t.dirs) for t in trees), np.array([math.sqrt(t.msq) for t in trees], np.float64),
        tuple(_c(t.vectors) for t in trees), tuple(_c(t.vectors_run0) for t in trees),
        tuple(_c(t.run_key) for t in trees), tuple(_c(t.run_id) for t in trees),
        tuple(_c(t.cluster_start) for t in trees), tuple(_c(t.cluster_size) for t in trees),
        tuple(_c(t.num_descendants) for t in trees), np.array([t.num_levels - 1 for t in trees], np.int64),
        params.num_comp_indices, params.num_simp_indices, np.array([field_of_view(t) for t in trees], np.int64),
        results_per_cluster, int(budget), ntv, ptv, ntr, ptr,
        tuple(s.cnt for s in scratches), tuple(s.cnt_stamp for s in scratches), tuple(s.cand_stamp for s in scratches),
        tuple(s.eval_stamp for s in scratches), tuple(s.dist for s in scratches), tuple(s.stamp for s in scratches),
        tuple(s.pool for s in scratches), tuple(s.gsc for s in scratches), params.group_beam == "per-query",
        tuple(_c(t.table.page_of_) for t in trees), tuple(_c(t.table.sizes_) for t in trees), int(budget),
        params.page_score == "mass",
        np.array([default_scale if default_scale is not None else 1.0 / math.sqrt(t.dim) for t in trees], np.float64),
        tuple(s.page_best for s in scratches), tuple(s.page_stamp for s in scratches),
        tuple(s.page_list for s in scratches), tuple(s.out_pages for s in scratches),
        tuple(s.out_scores for s in scratches), counts,
    )
    return [(s.out_pages[:k].copy(), s.out_scores[:k].astype(np.float32)) for s, k in zip(scratches, counts.tolist())]


def _scratch_row(scratch: Scratch) -> np.ndarray:
    """The scratch descriptor row of ``ice_layer_dci_rank_pages`` (cached: a scratch's arrays never change; a grown
    scratch is a new object)."""
    row = getattr(scratch, "native_row", None)
    if row is None:
        arrays = (scratch.cnt, scratch.cnt_stamp, scratch.cand_stamp, scratch.eval_stamp, scratch.dist, scratch.stamp,
                  scratch.pool, scratch.gsc, scratch.page_best, scratch.page_stamp, scratch.page_list, scratch.out_pages,
                  scratch.out_scores)
        assert all(a.flags.c_contiguous for a in arrays)
        row = np.zeros(DCI_DESCRIPTOR_WIDTH, np.int64)
        row[: len(arrays)] = [array_address(a) for a in arrays]
        row[13], row[14] = scratch.cnt.shape[1], scratch.gsc.shape[1]
        scratch.native_row = row
    return row


def _tree_row(tree: DCITree) -> np.ndarray:
    """The tree's descriptor row (addresses and slab sizes; levels and beam are filled per call), cached while the
    tree holds the same arrays (`icecache.kernels.library.cached_row`)."""
    def make(arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        assert arrays[2].shape == arrays[3].shape and arrays[1].shape[0] >= arrays[2].shape[1], "run slabs out of shape"
        row = np.zeros(DCI_DESCRIPTOR_WIDTH, np.int64)
        row[:10] = [array_address(a) for a in arrays]
        row[10], row[11], row[14] = arrays[2].shape[1], arrays[7].shape[1], arrays[9].shape[0]
        return row

    return cached_row(tree, "_native_rank_row", (tree.vectors, tree.vectors_run0, tree.run_key, tree.run_id,
                                                 tree.cluster_start, tree.cluster_size, tree.num_descendants, tree.dirs,
                                                 tree.table.page_of_, tree.table.sizes_), make)


def _native_rank(native: NativeKernels, trees: Sequence[DCITree], scratches: list[Scratch], Q: np.ndarray, budget: int,
                 results_per_cluster: int, threads: int) -> np.ndarray:
    """`rank_pages_layer` on the native library: pack each tree's arrays and sizes, call once."""
    heads = len(trees)
    params = trees[0].params
    rows = np.zeros((heads, DCI_DESCRIPTOR_WIDTH), np.int64)
    reals = np.zeros((heads, 2), np.float64)
    default_scale = params.score_scale
    for h, t in enumerate(trees):
        rows[h] = _tree_row(t)
        rows[h, 12], rows[h, 13] = t.num_levels - 1, field_of_view(t)
        reals[h] = (math.sqrt(t.msq), default_scale if default_scale is not None else 1.0 / math.sqrt(t.dim))
    works = np.stack([_scratch_row(s) for s in scratches])
    ntv, ptv, ntr, ptr = params.query.limits("query")
    limits = np.array([params.num_comp_indices, params.num_simp_indices, ntv, ntr, results_per_cluster, budget], np.int64)
    return native.layer_dci_rank_pages(Q, rows, reals, works, limits, np.array([ptv, ptr], np.float64),
                                       per_query_beam=params.group_beam == "per-query", budget=int(budget),
                                       mass=params.page_score == "mass", threads=threads)


__all__ = ["layer_compatible", "rank_pages_layer"]
