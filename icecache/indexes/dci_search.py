"""Queries of a DCI index: the k-nearest-neighbour search (`query`) and the page ranking of the ``mdci`` pager
(`rank_pages`), each one field-of-view beam descent in the compiled kernels (``docs/index.md``, Query descent), and
the per-thread scratch buffers every kernel search uses (the construction's parent searches too).

The functions read a `icecache.indexes.dci_tree.DCITree` and never change it, so different trees can be
searched from parallel threads (the kernels release the GIL; the scratch is per thread).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from icecache.indexes import _dci_kernels as kernels
from icecache.indexes.dci_params import SearchConfig
from icecache.indexes.dci_tree import DCITree

_thread_local = threading.local()


class Scratch:
    """Per-thread search buffers of the kernels (stamp-tagged, never cleared; see `icecache.indexes._dci_kernels`).

    Sized for ``capacity`` points, ``num_comp`` composite indices, ``page_capacity`` page ids and query groups
    of up to ``group_size`` queries; `thread_scratch` grows them on demand.
    """

    def __init__(self, capacity: int, num_comp: int, page_capacity: int, group_size: int) -> None:
        self.capacity, self.num_comp, self.page_capacity, self.group_size = capacity, num_comp, page_capacity, group_size
        self.cnt = np.zeros((capacity, num_comp), np.int32)
        self.gsc = np.zeros((capacity, group_size), np.float64)
        self.cnt_stamp = np.full(capacity, -1, np.int64)
        self.cand_stamp = np.full(capacity, -1, np.int64)
        self.eval_stamp = np.full(capacity, -1, np.int64)
        self.dist = np.zeros(capacity, np.float64)
        self.pool = np.zeros(capacity, np.int64)
        self.stamp = np.zeros(1, np.int64)
        self.page_best = np.zeros(page_capacity, np.float64)
        self.page_stamp = np.full(page_capacity, -1, np.int64)
        self.page_list = np.zeros(page_capacity, np.int64)
        self.out_pages = np.zeros(page_capacity, np.int64)
        self.out_scores = np.zeros(page_capacity, np.float64)


def thread_scratch(num_points: int, num_comp: int, num_page_ids: int = 0, group_size: int = 1, slot: int = 0) -> Scratch:
    """This thread's `Scratch` number ``slot``, grown (capacities doubling) to hold the given sizes; the stamp
    counter carries over to a grown one. Slot 0 serves a single search; a call that searches several trees at
    once (`icecache.indexes.dci_layer`) uses one slot per tree."""
    slots: list[Scratch | None] | None = getattr(_thread_local, "scratch", None)
    if slots is None:
        slots = _thread_local.scratch = []
    while len(slots) <= slot:
        slots.append(None)
    old = slots[slot]
    if old is None:
        scratch = Scratch(max(num_points, 1024), max(num_comp, 1), max(num_page_ids, 256), max(group_size, 1))
        slots[slot] = scratch
        return scratch
    if old.capacity >= num_points and old.num_comp >= num_comp and old.page_capacity >= num_page_ids and old.group_size >= group_size:
        return old
    capacity = max(num_points, old.capacity if old.capacity >= num_points else 2 * old.capacity)
    page_capacity = max(num_page_ids, old.page_capacity if old.page_capacity >= num_page_ids else 2 * old.page_capacity)
    scratch = Scratch(capacity, max(num_comp, old.num_comp), page_capacity, max(group_size, old.group_size))
    scratch.stamp[0] = int(old.stamp[0])
    slots[slot] = scratch
    return scratch


def field_of_view(tree: DCITree) -> int:
    """The query beam width F for the tree's current size."""
    params = tree.params
    fov = params.query.field_of_view
    if fov is None:
        fov = max(int(params.fov_scale * tree.num_points), params.fov_min)
        if params.fov_max is not None:
            fov = min(fov, params.fov_max)
    return int(fov)


def query(tree: DCITree, Q: np.ndarray, k: int, config: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(k, n)`` nearest points of the query group ``Q`` ``[g, d]`` (float32; distance = min over the
    group), searched with ``config``; ``k >= 1`` and the tree is not empty.

    Returns ``(ids int64, dists float64)`` sorted by distance ascending (ties by id). Distances: Euclidean
    ``|x - q|``; MIPS ``-<q, x>``.
    """
    params = tree.params
    fov = config.field_of_view if config.field_of_view is not None else field_of_view(tree)
    ntv, ptv, ntr, ptr = config.limits("query")
    scratch = thread_scratch(tree.capacity, params.num_comp_indices)
    lo, hi = kernels.descend(
        Q, tree.query_proj(Q), np.zeros(Q.shape[0], np.float32), tree.query_mode, float(tree.msq), tree.vectors, tree.vectors_run0,
        tree.ext, tree.run_key, tree.run_id, tree.cluster_start, tree.cluster_size, tree.num_descendants,
        tree.num_levels - 1, 0, params.num_comp_indices, params.num_simp_indices, int(fov), int(k),
        int(k) if k > 1 else 0, True, ntv, ptv, ntr, ptr,
        scratch.cnt, scratch.cnt_stamp, scratch.cand_stamp, scratch.eval_stamp, scratch.dist, scratch.stamp, scratch.pool,
        scratch.gsc, False, params.group_beam == "per-query",
    )
    ids = scratch.pool[lo:hi].copy()
    dists = scratch.dist[lo:hi].copy()
    order = np.lexsort((ids, dists))[: min(k, len(ids))]
    return ids[order], dists[order]


def rank_pages(tree: DCITree, Q: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Pages for the GQA group ``Q`` ``[g, d]``, best first (score = best ``max_g q.k`` among the scored
    tokens of the page, or the estimated attention mass with ``page_score="mass"``), as many as fit in
    ``budget`` tokens. MIPS tree with a page table only.

    Returns ``(page_ids int64 [j], scores float32 [j])``.
    """
    table = tree.table
    if table is None or not tree.mips:
        raise RuntimeError("rank_pages needs a MIPS index with a page table")
    params = tree.params
    Q = np.ascontiguousarray(Q, np.float32)
    results_per_cluster = max(1, -(-budget // table.page_size))
    scratch = thread_scratch(tree.capacity, params.num_comp_indices, table.id_capacity, Q.shape[0])
    ntv, ptv, ntr, ptr = params.query.limits("query")
    scale = params.score_scale if params.score_scale is not None else 1.0 / math.sqrt(tree.dim)
    num_pages = kernels.rank_pages(
        Q, tree.query_proj(Q), tree.vectors, tree.vectors_run0, tree.run_key, tree.run_id, tree.cluster_start,
        tree.cluster_size, tree.num_descendants,
        tree.num_levels - 1, params.num_comp_indices, params.num_simp_indices, field_of_view(tree), results_per_cluster,
        int(budget), ntv, ptv, ntr, ptr,
        scratch.cnt, scratch.cnt_stamp, scratch.cand_stamp, scratch.eval_stamp, scratch.dist, scratch.stamp, scratch.pool,
        scratch.gsc, params.group_beam == "per-query", table.page_of_, table.sizes_, int(budget), params.page_score == "mass",
        float(scale), scratch.page_best, scratch.page_stamp, scratch.page_list, scratch.out_pages, scratch.out_scores,
    )
    return scratch.out_pages[:num_pages].copy(), scratch.out_scores[:num_pages].astype(np.float32)


__all__ = ["Scratch", "field_of_view", "query", "rank_pages", "thread_scratch"]
