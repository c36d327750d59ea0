"""Bulk construction of a DCI index (``docs/index.md``, Bulk construction): `build` indexes a set of points from
scratch, `construct` (re)builds parents, sorted cluster runs, descendant counts and pages for the points and
levels a `icecache.indexes.dci_tree.DCITree` holds (also after a MIPS rekey, see `icecache.indexes.dci_update`).

Parents come from `search_parents`: blocked BLAS brute force over the level above when it is small enough,
else one descent per point with the construction config. A cluster is cut into pages by `even_groups`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from icecache.indexes import _dci_edit_kernels as edit_kernels
from icecache.indexes.dci_search import thread_scratch
from icecache.indexes.dci_tree import DCITree

TWO_MEANS_ITERS = 4  # 2-means steps per bisection of page_split="2means"


def build(tree: DCITree, x: np.ndarray) -> None:
    """Index ``x`` ``[n, d]`` (float32, n may be 0) from scratch; ids ``0..n-1``. Clears the page table."""
    tree.reset()
    if tree.table is not None:
        tree.table.clear()
    n = x.shape[0]
    if n == 0:
        return
    tree.grow(n)
    tree.vectors[:n] = x
    tree.num_points = n
    if tree.single_level:
        levels = np.zeros(n, np.int32)
    else:
        levels, _ = tree.draw_levels(n)
    tree.level_of[:n] = levels
    if tree.mips:
        tree.msq = float((x.astype(np.float64) ** 2).sum(1).max())
    for level in range(int(levels.max()) + 1):
        ids = np.flatnonzero(levels == level).astype(np.int64)
        tree.level_ids.append(np.concatenate([ids, np.zeros(max(16, len(ids)), np.int64)]))
        tree.level_counts.append(len(ids))
    construct(tree)


def construct(tree: DCITree) -> None:
    """Build parents, cluster runs, subtree counts (and pages) for the current points and levels."""
    n = tree.num_points
    ids = np.arange(n, dtype=np.int64)
    tree.lift(ids)
    tree.parent_of[:n] = -1
    tree.parent_dist[:n] = np.inf
    tree.num_descendants[:n] = 0
    tree.cluster_start[: n + 1] = 0
    tree.cluster_size[: n + 1] = 0
    tree.cluster_cap[: n + 1] = 0
    tree.slab_used = 0
    top = tree.num_levels - 1
    _make_clusters(tree, np.array([-1], np.int64), tree.members(top), np.full(tree.level_counts[top], -1, np.int64))
    for level in range(top - 1, -1, -1):
        nodes = tree.members(level)
        parents, _ = search_parents(tree, nodes, level, bulk=True)
        tree.parent_of[nodes] = parents
        # Direct formula (not the BLAS expansion) so adoption compares like with like.
        tree.parent_dist[nodes] = tree.point_distance(nodes, parents)
        _make_clusters(tree, tree.members(level + 1), nodes, parents)
    for level in range(top):
        nodes = tree.members(level)
        if len(nodes):
            weights = np.bincount(tree.parent_of[nodes], weights=1 + tree.num_descendants[nodes], minlength=n)
            tree.num_descendants[:n] += weights[:n].astype(np.int64)
    if tree.table is not None:
        _bulk_pages(tree)


# ---------------------------------------------------------------------------------------------- parents
def search_parents(tree: DCITree, nodes: np.ndarray, level: int, bulk: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Parents (nearest node on ``level + 1``) of ``nodes`` by the construction rule: brute force when that
    level has at most ``brute_force_threshold`` nodes (``bulk_brute_force_threshold`` when ``bulk``), else the
    descent with the construction config. Returns ``(parents int64, dists float64)``."""
    params = tree.params
    upper = tree.members(level + 1)
    limit = params.bulk_brute_force_threshold if bulk else params.brute_force_threshold
    if len(upper) <= limit:
        return _brute_parents(tree, nodes, upper)
    config = params.construction
    ntv, ptv, ntr, ptr = config.limits("construction")
    scratch = thread_scratch(tree.capacity, params.num_comp_indices)
    parents = np.empty(len(nodes), np.int64)
    dists = np.empty(len(nodes), np.float64)
    edit_kernels.assign_parents(
        np.ascontiguousarray(nodes, np.int64), tree.vectors, tree.vectors_run0, tree.ext, tree.proj, tree.key_mode, float(tree.msq),
        tree.run_key, tree.run_id, tree.cluster_start, tree.cluster_size, tree.num_descendants,
        tree.num_levels - 1, level + 1, params.num_comp_indices, params.num_simp_indices, int(config.field_of_view),
        ntv, ptv, ntr, ptr, scratch.cnt, scratch.cnt_stamp, scratch.cand_stamp, scratch.eval_stamp, scratch.dist, scratch.stamp,
        scratch.pool, scratch.gsc, parents, dists,
    )
    if (parents < 0).any():  # cannot happen: every level's top-down search reaches some node of level + 1
        raise RuntimeError("DCI parent search found no node on the level above (internal bug)")
    return parents, dists


def _brute_parents(tree: DCITree, nodes: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact nearest node of ``upper`` for every id in ``nodes`` (BLAS, blocked); ties -> first in ``upper``."""
    V = tree.vectors[upper].astype(np.float64)
    if tree.mips:
        ext_upper = tree.ext[upper].astype(np.float64)
    else:
        sq_upper = (V * V).sum(1)
    parents = np.empty(len(nodes), np.int64)
    dists = np.empty(len(nodes), np.float64)
    block = max(1, 4_000_000 // max(len(upper), 1))
    for first in range(0, len(nodes), block):
        ids = nodes[first : first + block]
        rows = np.arange(len(ids))
        Xb = tree.vectors[ids].astype(np.float64)
        if tree.mips:
            sims = Xb @ V.T + tree.ext[ids].astype(np.float64)[:, None] * ext_upper[None, :]
            best = np.argmax(sims, axis=1)
            dists[first : first + len(ids)] = np.maximum(tree.msq - sims[rows, best], 0.0)
        else:
            partial = sq_upper[None, :] - 2.0 * (Xb @ V.T)  # |x - v|^2 - |x|^2
            best = np.argmin(partial, axis=1)
            dists[first : first + len(ids)] = np.sqrt(np.maximum(partial[rows, best] + (Xb * Xb).sum(1), 0.0))
        parents[first : first + len(ids)] = upper[best]
    return parents, dists


def _make_clusters(tree: DCITree, owners: np.ndarray, children: np.ndarray, parents: np.ndarray) -> None:
    """Allocate the clusters of ``owners`` (node ids, -1 = root) and fill them with ``children``
    (whose parents are ``parents``), every run sorted by (projection, id)."""
    owner_cids = owners + 1
    counts = np.bincount(parents + 1, minlength=tree.num_points + 1)[owner_cids] if len(children) else np.zeros(len(owners), np.int64)
    caps = counts + counts // 4 + 2
    starts = tree.slab_alloc(caps)
    tree.cluster_start[owner_cids] = starts
    tree.cluster_size[owner_cids] = counts
    tree.cluster_cap[owner_cids] = caps
    if len(children) == 0:
        return
    cids = parents + 1
    for j in range(tree.proj.shape[1]):
        order = np.lexsort((children, tree.proj[children, j], cids))
        sorted_children, sorted_cids = children[order], cids[order]
        rank = np.arange(len(sorted_children)) - np.searchsorted(sorted_cids, sorted_cids, side="left")
        slots = tree.cluster_start[sorted_cids] + rank
        tree.run_key[j, slots] = tree.proj[sorted_children, j]
        tree.run_id[j, slots] = sorted_children
        if j == 0:
            tree.vectors_run0[slots] = tree.vectors[sorted_children]


# ---------------------------------------------------------------------------------------------- pages
def even_groups(tree: DCITree, seg: np.ndarray) -> list[np.ndarray]:
    """Cut a cluster (ids ``seg`` in run-0 order) into ceil(c / P) groups whose sizes differ by <= 1:
    contiguous in run-0 order (``page_split="projection"``) or by recursive balanced 2-means (``"2means"``)."""
    assert tree.table is not None
    size = len(seg)
    num_groups = -(-size // tree.table.page_size)
    if tree.params.page_split == "2means" and num_groups > 1:
        seg = np.ascontiguousarray(seg, np.int64).copy()
        edit_kernels.kway_order(tree.vectors, seg, num_groups, TWO_MEANS_ITERS)
    bounds = (np.arange(num_groups + 1) * size) // num_groups
    return [seg[bounds[i] : bounds[i + 1]] for i in range(num_groups)]


def _bulk_pages(tree: DCITree) -> None:
    """Page every cluster (`even_groups`, clusters in id order); on a rebuild (the table already holds the
    points) the table is made to hold exactly these groups by moves (`PageTable.repage`: pages that already match
    a group are kept)."""
    table = tree.table
    assert table is not None
    cids = np.flatnonzero(tree.cluster_size[: tree.num_points + 1] > 0)
    if tree.params.page_split == "projection":
        flat, bounds = _projection_groups(tree.run_id, tree.cluster_start, tree.cluster_size, cids, table.page_size)
    else:
        groups = [g for cid in cids for g in even_groups(tree, tree.cluster_run0(int(cid)))]
        flat = np.concatenate(groups) if groups else np.zeros(0, np.int64)
        bounds = np.concatenate([[0], np.cumsum([len(g) for g in groups])]).astype(np.int64)
    if table.num_positions == 0:
        table.new_pages(np.split(flat, bounds[1:-1]) if len(flat) else [])
    else:
        table.repage(flat, bounds)


@njit(nogil=True, cache=True)
def _projection_groups(run_id, cluster_start, cluster_size, cids, page_size):
    """`even_groups` of every cluster in ``cids`` with ``page_split="projection"``, concatenated: ``(flat ids
    [n] int64, bounds [groups + 1] int64)``."""
    total = 0
    num_groups = 0
    for c in cids:
        total += cluster_size[c]
        num_groups += (cluster_size[c] + page_size - 1) // page_size
    flat = np.empty(total, np.int64)
    bounds = np.empty(num_groups + 1, np.int64)
    bounds[0] = 0
    o = 0
    g = 0
    for c in cids:
        start, size = cluster_start[c], cluster_size[c]
        for i in range(size):
            flat[o + i] = run_id[0, start + i]
        k = (size + page_size - 1) // page_size
        for i in range(1, k + 1):
            bounds[g + i] = o + (i * size) // k
        o += size
        g += k
    return flat, bounds


__all__ = ["TWO_MEANS_ITERS", "build", "construct", "even_groups", "search_parents"]
