"""M-DCI's decode insert with its host-store write in one compiled call (`insert_one_stored`).

A decode step inserts one key per (layer, KV head). Most of them are the common case of `dci_update`'s compiled
leaf insert: a level-0 point that needs no rekey, whose parent is found by brute force and whose run-0
neighbour's page has room. Through `dci_update.insert` that costs a chain of Python calls (the level schedule,
the squared norm, the fast path's checks, a journal record) and then the host store's replay of the one-row
journal. Here one kernel draws the point's level, makes the leaf insert's edits and, when the point only
appended to a page that has a host block, writes its K and V into the store's rows itself, journalling nothing.
Every other case ends exactly where `dci_update` would have taken it (same edits, same journal), so the tree,
the pages and the store are the same as through `insert` + `HeadStore.sync`.

`insert_layer_stored` does it for every KV head of a layer: with the native kernels built, one call
(``dci_insert.cpp``, the kernel step for step) instead of one compiled call of ~37 typed arguments per head.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from icecache.indexes import _dci_edit_kernels as edit_kernels
from icecache.indexes import dci_update
from icecache.indexes.dci_tree import DCITree
from icecache.kernels.library import INSERT_DESCRIPTOR_WIDTH, array_address, cached_row, native_kernels

#: `_leaf_stored` outcomes beyond `dci_update`'s (`LEAF_DONE` = appended, but the page has no host block)
LEAF_STORED, NOT_A_LEAF = 3, 4


@njit(nogil=True, cache=True)
def _leaf_stored(counts, nxt, p0, p1, cap0, cap1, sq_norm, point, vector, upper, upper_X, upper_ext, X, ext, proj,
                 dirs, dim, msq, level_of, parent_of, parent_dist, num_desc, cl_start, cl_size, cl_cap, run_key, run_id,
                 Xr, page_of, slot_of, members, sizes, page_size, rows, block_of, new_k, new_v):
    """Draw the point's level (MD's schedule, advanced by one); for a level-0 point with ``sq_norm <= msq``, make
    `dci_update._insert_leaf`'s edits and, when it appended to a page with a host block, write ``new_k`` /
    ``new_v`` ``[head_dim]`` into that block's slot of ``rows`` ``[R, 2, head_dim]``. Returns ``(status, level,
    new_top, parent, page, slot, neighbour)``: `NOT_A_LEAF` (only the schedule moved), `LEAF_STORED`, or one of
    `dci_update._insert_leaf`'s outcomes."""
    level = np.empty(1, np.int64)
    new_top = np.empty(1, np.bool_)
    edit_kernels.md_schedule(1, counts, nxt, p0, p1, cap0, cap1, level, new_top)
    if level[0] != 0 or new_top[0] or sq_norm > msq:
        return NOT_A_LEAF, level[0], new_top[0], -1, -1, -1, -1
    status, parent, page, slot, neighbour = dci_update._insert_leaf(
        point, vector, upper, upper_X, upper_ext, X, ext, proj, dirs, dim, msq, level_of, parent_of, parent_dist,
        num_desc, cl_start, cl_size, cl_cap, run_key, run_id, Xr, page_of, slot_of, members, sizes, page_size)
    if status == dci_update.LEAF_DONE and page < block_of.shape[0] and block_of[page] >= 0:
        row = block_of[page] * page_size + slot
        rows[row, 0, :] = new_k
        rows[row, 1, :] = new_v
        status = LEAF_STORED
    return status, level[0], new_top[0], parent, page, slot, neighbour


def qualifies(tree: DCITree) -> bool:
    """Whether a decode insert into ``tree`` can take `insert_one_stored`'s compiled path: a multi-level MIPS tree
    with ``"projection"`` pages of more than one token whose level 1 is searched by brute force, and an empty move
    journal (the store is in step with the table)."""
    table = tree.table
    return (tree.mips and not tree.single_level and tree.num_levels >= 2 and table is not None and table.page_size > 1
            and tree.params.page_split == "projection" and table.journal_is_empty()
            and tree.level_counts[1] <= tree.params.brute_force_threshold)


def insert_one_stored(tree: DCITree, vector: np.ndarray, rows: np.ndarray, block_of: np.ndarray, new_k: np.ndarray,
                      new_v: np.ndarray) -> bool:
    """`dci_update.insert` of one point ``vector`` ``[d]`` (float32, C-contiguous) into a tree that `qualifies`.
    True when the point's K/V ``new_k`` / ``new_v`` ``[head_dim]`` were written into the host store's ``rows``
    (``block_of`` maps page ids to its blocks) and nothing was journalled; False when the table's journal holds the
    insert's page changes for `HeadStore.sync` to replay."""
    table = tree.table
    assert table is not None
    sq_norm = float((vector.astype(np.float64) ** 2).sum())  # as `dci_update.insert` computes it
    upper, upper_vectors, upper_ext = tree.level1_packed()
    point = tree.num_points
    tree.grow(point + 1)
    table.reserve_positions(point + 1)
    status, level, new_top, parent, page, slot, neighbour = _leaf_stored(
        *tree.schedule_args(), sq_norm, point,
        vector, upper, upper_vectors, upper_ext, tree.vectors, tree.ext, tree.proj, tree.dirs, tree.dim,
        float(tree.msq), tree.level_of, tree.parent_of, tree.parent_dist, tree.num_descendants, tree.cluster_start,
        tree.cluster_size, tree.cluster_cap, tree.run_key, tree.run_id, tree.vectors_run0, table.page_of_,
        table.slot_of_, table.members, table.sizes_, table.page_size, rows, block_of, new_k, new_v)
    if status == NOT_A_LEAF:
        dci_update._insert_one(tree, vector, sq_norm, int(level), bool(new_top))
        return False
    tree.num_points = point + 1
    stored = status == LEAF_STORED
    dci_update.finish_leaf(tree, int(status) if not stored else dci_update.LEAF_DONE, point, int(parent), int(page),
                           int(slot), int(neighbour), journal=not stored)
    return stored


def _tree_arrays(tree: DCITree, rows: np.ndarray, block_of: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays `ice_layer_dci_leaf_insert` reads and writes, in descriptor order (see `_descriptor`)."""
    table = tree.table
    assert table is not None
    return (tree.schedule_counts, tree.schedule_next, tree.level_ids[1], tree.level1_vectors, tree.level1_ext,
            tree.vectors, tree.ext, tree.proj, tree.dirs, tree.level_of, tree.parent_of, tree.parent_dist,
            tree.num_descendants, tree.cluster_start, tree.cluster_size, tree.cluster_cap, tree.run_key, tree.run_id,
            tree.vectors_run0, table.page_of_, table.slot_of_, table.members, table.sizes_, rows, block_of)


def _descriptor(tree: DCITree, rows: np.ndarray, block_of: np.ndarray) -> np.ndarray:
    """One head's descriptor row with the point's id and level 1's size still to fill (fields 4 and 6), cached while
    the tree and store hold the same arrays (`icecache.kernels.library.cached_row`)."""
    cap0, cap1 = tree.schedule_args()[4:]
    page_size = tree.table.page_size if tree.table is not None else 0

    def make(arrays: tuple[np.ndarray, ...]) -> np.ndarray:
        (counts, nxt, upper, upper_x, upper_ext, X, ext, proj, dirs, level_of, parent_of, parent_dist, num_desc,
         cl_start, cl_size, cl_cap, run_key, run_id, Xr, page_of, slot_of, members, sizes, rows_, block_of_) = arrays
        assert members.shape[1] == page_size and proj.shape[1] == dirs.shape[0]
        a = array_address
        return np.array([
            a(counts), a(nxt), cap0, cap1, 0, a(upper), 0, a(upper_x), a(upper_ext), a(X), a(ext), a(proj), a(dirs),
            dirs.shape[0], dirs.shape[1], a(level_of), a(parent_of), a(parent_dist), a(num_desc), a(cl_start),
            a(cl_size), a(cl_cap), a(run_key), a(run_id), run_key.shape[1], a(Xr), a(page_of), a(slot_of), a(members),
            a(sizes), page_size, a(rows_), a(block_of_), block_of_.shape[0],
        ], np.int64)

    return cached_row(tree, "_native_insert_row", _tree_arrays(tree, rows, block_of), make)


def insert_layer_stored(trees: list[DCITree], keys: np.ndarray, rows: list[np.ndarray], block_ofs: list[np.ndarray],
                        new_k: np.ndarray, new_v: np.ndarray) -> list[bool]:
    """`insert_one_stored` of ``keys[h]`` (``[H, d]`` float32, C-contiguous) into ``trees[h]`` for every head, each
    with its store's ``rows[h]`` / ``block_ofs[h]`` and K/V ``new_k[h]`` / ``new_v[h]`` (``[H, hd]``, the stores'
    raw dtype). Every tree must `qualify <qualifies>`. One native call for all heads (numba, head by head, without
    the library). The trees, pages and stores end as through `insert_one_stored` head by head; returns its result
    per head."""
    native = native_kernels()
    if native is None:
        return [insert_one_stored(trees[h], keys[h], rows[h], block_ofs[h], new_k[h], new_v[h]) for h in range(len(trees))]
    fast = list(range(len(trees)))
    stored = [False] * len(trees)
    sq_norms = (keys.astype(np.float64) ** 2).sum(axis=1)  # per row as `insert_one_stored` sums it
    desc = np.empty((len(fast), INSERT_DESCRIPTOR_WIDTH), np.int64)
    reals = np.empty((len(fast), 4), np.float64)
    points = []
    for i, h in enumerate(fast):
        tree = trees[h]
        tree.level1_packed()  # bring level 1's packed copy up to date (it may grow)
        point = tree.num_points
        tree.grow(point + 1)
        tree.table.reserve_positions(point + 1)
        desc[i] = _descriptor(tree, rows[h], block_ofs[h])
        desc[i, 4], desc[i, 6] = point, tree.level_counts[1]
        reals[i] = (tree.params.p0, tree.params.p1, sq_norms[i], tree.msq)
        points.append(point)
    out = native.layer_dci_leaf_insert(desc, reals, np.ascontiguousarray(keys), np.ascontiguousarray(new_k),
                                       np.ascontiguousarray(new_v))
    for i, h in enumerate(fast):
        tree, point = trees[h], points[i]
        status, level, new_top, parent, page, slot, neighbour = out[i].tolist()
        if status == NOT_A_LEAF:
            dci_update._insert_one(tree, keys[h], float(sq_norms[i]), int(level), bool(new_top))
            continue
        tree.num_points = point + 1
        stored[h] = status == LEAF_STORED
        dci_update.finish_leaf(tree, status if not stored[h] else dci_update.LEAF_DONE, point, parent, page, slot,
                               neighbour, journal=not stored[h])
    return stored


__all__ = ["insert_layer_stored", "insert_one_stored", "qualifies"]
