"""Insertion into a DCI index, one point at a time (``docs/index.md``, Incremental insert), with the page edits it
causes.

A new point gets the next level of MD's schedule and a parent by the construction rule; a point promoted to
level t > 0 adopts every level-(t-1) node strictly closer to it than to its current parent; when the schedule
opens a new top level, the new point becomes the only top node and adopts all old top nodes. A MIPS key longer
than ``sqrt(msq)`` first triggers a *rekey* (``msq`` grows, the whole tree is rebuilt by
`icecache.indexes.dci_build.construct` with the same levels).

Pages (when the tree has a table): a new token joins the page of its run-0 neighbour (``"projection"``) or the
page of its cluster with the nearest centroid (``"2means"``); a full page is split first; adopted points move into
fresh pages of their new cluster; with ``"projection"``, small pages then merge with a run-0 neighbour
(`_merge_small_page`). All page changes go through `PageTable` methods, so its move journal is complete; the
split, join and merges of a full ``"projection"`` page (`_place_beside`) run as one compiled call that makes the
same edits and journal rows on the table's arrays (`PageTable.begin_edit` / `end_edit`).

The common decode insert (a level-0 MIPS token, no rekey, parent by brute force, ``"projection"`` pages) runs as
one compiled call (`_insert_leaf`) that makes the same edits, recording its page append with
`PageTable.record_append`; what it hands back (a full cluster block or page) finishes on the Python path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from icecache.core.page_kernels import append_one, move_one, take_page_id
from icecache.indexes import _dci_edit_kernels as edit_kernels
from icecache.indexes.dci_build import (
    TWO_MEANS_ITERS,
    construct,
    even_groups,
    search_parents,
)
from icecache.indexes.dci_tree import DCITree, lift_point

#: `_insert_leaf` outcomes
LEAF_DONE, LEAF_NEEDS_CLUSTER, LEAF_PAGE_FULL = 0, 1, 2


def insert(tree: DCITree, x: np.ndarray) -> None:
    """Add ``x`` ``[m, d]`` (float32); ids continue ``n .. n + m - 1``. Each point gets the next level of the
    schedule and is inserted as described in the module docstring."""
    m = x.shape[0]
    if m == 0:
        return
    if tree.single_level:
        levels = np.zeros(m, np.int64)
        new_top = np.zeros(m, np.bool_)
        if tree.num_points == 0:
            new_top[0] = True
    else:
        levels, new_top = tree.draw_levels(m)
    sq_norms = (x.astype(np.float64) ** 2).sum(1)
    for i in range(m):
        _insert_one(tree, x[i], float(sq_norms[i]), int(levels[i]), bool(new_top[i]))


def _insert_one(tree: DCITree, vector: np.ndarray, sq_norm: float, level: int, new_top: bool) -> None:
    if level == 0 and not new_top and _leaf_fast_path(tree, vector, sq_norm):
        return
    if tree.mips and sq_norm > tree.msq:
        if tree.num_points == 0:
            tree.msq = sq_norm
        else:  # rekey: lift everything again with more headroom and rebuild the structure
            tree.msq = sq_norm * tree.params.rekey_headroom
            tree.num_rekeys += 1
            construct(tree)
    point = tree.num_points
    tree.grow(point + 1)
    tree.vectors[point] = vector
    tree.num_points = point + 1
    tree.level_of[point] = level
    tree.parent_of[point] = -1
    tree.parent_dist[point] = np.inf
    tree.num_descendants[point] = 0
    tree.cluster_start[point + 1] = 0
    tree.cluster_size[point + 1] = 0
    tree.cluster_cap[point + 1] = 0
    tree.lift_one(point)
    if new_top:
        # The new point is the only node of a new top level and adopts every old top node.
        old_tops = tree.cluster_run0(0)
        tree.cluster_start[point + 1] = tree.cluster_start[0]
        tree.cluster_size[point + 1] = tree.cluster_size[0]
        tree.cluster_cap[point + 1] = tree.cluster_cap[0]
        if len(old_tops):
            tree.parent_of[old_tops] = point
            tree.parent_dist[old_tops] = tree.point_distance(old_tops, np.full(len(old_tops), point))
        tree.num_descendants[point] = point  # every earlier point is below it
        tree.cluster_start[0] = tree.slab_alloc(np.array([4]))[0]
        tree.cluster_size[0] = 0
        tree.cluster_cap[0] = 4
        tree.add_member(level, point)
        _cluster_add(tree, 0, point)  # the old root pages now belong to the point's cluster unchanged
        return
    if level == tree.num_levels - 1:
        parent = -1
    else:
        parent, dist = _parent_of_one(tree, point, level)
        tree.parent_dist[point] = dist
    tree.parent_of[point] = parent
    _cluster_add(tree, parent + 1, point)
    _path_add(tree, parent, 1)
    tree.add_member(level, point)
    if level > 0:
        _adopt(tree, point, level)


def _leaf_fast_path(tree: DCITree, vector: np.ndarray, sq_norm: float) -> bool:
    """The common decode insert in one compiled call (`_insert_leaf`): a level-0 MIPS point that needs no rekey,
    finds its parent by brute force and joins a ``"projection"`` page. It makes exactly the edits of the general
    path below, which finishes the cases the kernel hands back (a full cluster block or page). False (nothing
    done) when the point does not qualify."""
    table = tree.table
    if (not tree.mips or sq_norm > tree.msq or tree.num_levels < 2 or table is None or table.page_size == 1
            or tree.params.page_split != "projection"):
        return False
    if tree.level_counts[1] > tree.params.brute_force_threshold:
        return False
    upper, upper_vectors, upper_ext = tree.level1_packed()
    point = tree.num_points
    tree.grow(point + 1)
    table.reserve_positions(point + 1)
    tree.num_points = point + 1
    status, parent, page, slot, neighbour = _insert_leaf(
        point, vector, upper, upper_vectors, upper_ext, tree.vectors, tree.ext, tree.proj, tree.dirs, tree.dim,
        float(tree.msq), tree.level_of,
        tree.parent_of, tree.parent_dist, tree.num_descendants, tree.cluster_start, tree.cluster_size, tree.cluster_cap,
        tree.run_key, tree.run_id, tree.vectors_run0, table.page_of_, table.slot_of_, table.members, table.sizes_,
        table.page_size,
    )
    finish_leaf(tree, int(status), point, int(parent), int(page), int(slot), int(neighbour))
    return True


def finish_leaf(tree: DCITree, status: int, point: int, parent: int, page: int, slot: int, neighbour: int, *,
                journal: bool = True) -> None:
    """What `_insert_leaf` (outcome ``status``) hands back: the cluster block or the full page it stopped at,
    or the account of its append (journalled unless ``journal`` is False: the caller wrote the host store), and
    the point's place on level 0."""
    table = tree.table
    assert table is not None
    if status == LEAF_NEEDS_CLUSTER:
        _cluster_add(tree, parent + 1, point)
        _path_add(tree, parent, 1)
    elif status == LEAF_PAGE_FULL:
        _place_beside(tree, page, neighbour, point)
    else:
        table.record_append(point, page, slot, journal=journal)
    tree.add_member(0, point)


@njit(nogil=True, cache=True)
def _insert_leaf(point, vector, upper, upper_X, upper_ext, X, ext, proj, dirs, dim, msq, level_of, parent_of, parent_dist, num_desc,
                 cl_start, cl_size, cl_cap, run_key, run_id, Xr, page_of, slot_of, members, sizes, page_size):
    """`_insert_one`'s edits for a level-0 point with a brute-force MIPS parent search, as far as they go without
    Python: the point's rows, its lift, its parent, its run entries and (when the neighbour's page has room) its
    page slot, and the descendant counts up the path. Returns ``(status, parent, page, slot, neighbour)``:
    `LEAF_DONE`; `LEAF_NEEDS_CLUSTER` (stopped after the parent: the cluster block is full or empty); or
    `LEAF_PAGE_FULL` (in the runs, path counted, the run-0 neighbour's ``page`` is full)."""
    X[point] = vector
    level_of[point] = 0
    parent_of[point] = -1
    parent_dist[point] = np.inf
    num_desc[point] = 0
    cl_start[point + 1] = 0
    cl_size[point + 1] = 0
    cl_cap[point + 1] = 0
    lift_point(point, X, dirs, dim, msq, True, ext, proj)
    parent, dist = edit_kernels.brute_nearest_packed(point, upper, upper_X, upper_ext, X, ext, msq)
    parent_dist[point] = dist
    parent_of[point] = parent
    cid = parent + 1
    size = cl_size[cid]
    if size == 0 or size == cl_cap[cid]:
        return LEAF_NEEDS_CLUSTER, parent, -1, -1, -1
    start = cl_start[cid]
    pos0 = edit_kernels.cluster_insert(run_key, run_id, Xr, start, size, proj[point], point, X[point])
    cl_size[cid] = size + 1
    node = parent
    while node >= 0:
        num_desc[node] += 1
        node = parent_of[node]
    neighbour = np.int64(run_id[0, start + pos0 - 1]) if pos0 > 0 else np.int64(run_id[0, start + 1])
    page = page_of[neighbour]
    slot = sizes[page]
    if slot >= page_size:
        return LEAF_PAGE_FULL, parent, page, -1, neighbour
    members[page, slot] = point
    sizes[page] = slot + 1
    page_of[point] = page
    slot_of[point] = slot
    return LEAF_DONE, parent, page, slot, neighbour


def _parent_of_one(tree: DCITree, point: int, level: int) -> tuple[int, float]:
    upper = tree.members(level + 1)
    if len(upper) <= tree.params.brute_force_threshold:
        if level == 0 and tree.mips:  # the same search as the compiled leaf insert's
            upper, upper_vectors, upper_ext = tree.level1_packed()
            parent, dist = edit_kernels.brute_nearest_packed(point, upper, upper_vectors, upper_ext, tree.vectors, tree.ext,
                                                        float(tree.msq))
            return int(parent), float(dist)
        parent, dist = edit_kernels.brute_nearest_one(point, upper, tree.vectors, tree.ext, tree.key_mode, float(tree.msq))
        return int(parent), float(dist)
    parents, dists = search_parents(tree, np.array([point], np.int64), level)
    return int(parents[0]), float(dists[0])


def _path_add(tree: DCITree, node: int, delta: int) -> None:
    """Add ``delta`` to the descendant count of ``node`` and of every ancestor."""
    while node >= 0:
        tree.num_descendants[node] += delta
        node = int(tree.parent_of[node])


def _cluster_add(tree: DCITree, cid: int, point: int) -> None:
    """Insert ``point`` into cluster ``cid``'s sorted runs and into a page of the cluster."""
    size = int(tree.cluster_size[cid])
    if size == tree.cluster_cap[cid]:
        tree.relocate(cid, 2 * size + 4)
    start = int(tree.cluster_start[cid])
    semantic = tree.table is not None and tree.params.page_split == "2means" and size > 0
    if semantic:
        before = tree.run_id[0, start : start + size].astype(np.int64)
    run0_pos = int(edit_kernels.cluster_insert(
        tree.run_key, tree.run_id, tree.vectors_run0, start, size, tree.proj[point], point, tree.vectors[point]
    ))
    tree.cluster_size[cid] = size + 1
    table = tree.table
    if table is None:
        return
    if size == 0:
        table.new_page([point])
        return
    if table.page_size == 1:  # nothing to split: every token is a page of its own
        table.new_page([point])
        return
    if semantic:
        page = int(edit_kernels.nearest_page(point, before, table.page_of_, tree.vectors))
        if table.sizes_[page] >= table.page_size:
            new_page = _split_page(tree, page)
            both = np.concatenate([table.members[page, : table.sizes_[page]], table.members[new_page, : table.sizes_[new_page]]])
            page = int(edit_kernels.nearest_page(point, both, table.page_of_, tree.vectors))
        table.append(page, point)
        return
    neighbour = int(tree.run_id[0, start + run0_pos - 1]) if run0_pos > 0 else int(tree.run_id[0, start + 1])
    page = int(table.page_of_[neighbour])
    if table.sizes_[page] < table.page_size:
        table.append(page, point)
        return
    _place_beside(tree, page, neighbour, point)


#: merges one compiled `_place_beside` makes at most before it hands the rest to `_merge_small_page`
PLACE_MERGES = 32


def _place_beside(tree: DCITree, page: int, neighbour: int, point: int) -> None:
    """Page ``point`` (already in its cluster's runs) beside its run-0 ``neighbour``, whose ``page`` is full:
    split the page (the upper half of its projection order moves to a new page), join the half that holds the
    neighbour, then merge small pages (`_merge_small_page`: a half may now fit together with a small run-0
    neighbour, one left behind by an adoption). ``"projection"`` pages only. One compiled call
    (`_place_beside_kernel`) with the same page ids, slots, free list and journal as `PageTable.split`,
    `PageTable.append` and the merges' `PageTable.move_many` one after another (a decode insert fills a page
    every ``P / 2`` tokens or so)."""
    table = tree.table
    assert table is not None and tree.params.page_split == "projection"
    page_size = table.page_size
    table.reserve_positions(point + 1)
    free, num_free, num_ids = table.begin_edit(1, PLACE_MERGES + 1)
    journal = np.empty((2 * page_size * (PLACE_MERGES + 2), 5), np.int64)
    rows, num_free, num_ids, new_page, stage, cursor = _place_beside_kernel(
        page, neighbour, point, tree.proj, tree.parent_of, tree.cluster_start, tree.cluster_size, tree.run_id,
        table.members, table.sizes_, table.page_of_, table.slot_of_, page_size, free, num_free, num_ids, journal,
        PLACE_MERGES)
    table.end_edit(free, num_free, num_ids, journal[:rows], 1)
    if stage == 0:  # out of room for more merges (never seen): the Python loop finishes them, from where it stopped
        _merge_small_page(tree, int(cursor))
        _merge_small_page(tree, int(new_page))
    elif stage == 1:
        _merge_small_page(tree, int(cursor))


@njit(nogil=True, cache=True)
def _place_beside_kernel(page, neighbour, point, proj, parent_of, cl_start, cl_size, run_id, members, sizes, page_of,
                         slot_of, page_size, free, num_free, num_ids, journal, max_merges):
    """`_place_beside` on the arrays. ``free[:num_free]`` is the free list (room for the pages the merges free),
    ``num_ids`` the ids handed out (room for one more), ``journal`` has room for the split, the append and
    ``max_merges`` merges. Returns ``(rows, num_free, num_ids, new_page, stage, cursor)``: ``stage`` 2 when done,
    else the merge (0: of ``page``'s side, 1: of ``new_page``'s) that stopped for room at page ``cursor``."""
    # ---- split: the upper half of the page in (projection 0, id) order moves to a new page
    size = sizes[page]
    ids = members[page, :size].copy()
    for i in range(1, size):  # insertion sort by (proj[:, 0], id): a page holds few ids
        x = ids[i]
        key = proj[x, 0]
        j = i - 1
        while j >= 0 and (proj[ids[j], 0] > key or (proj[ids[j], 0] == key and ids[j] > x)):
            ids[j + 1] = ids[j]
            j -= 1
        ids[j + 1] = x
    moving_slots = np.sort(slot_of[ids[size // 2:]])
    moving = members[page, moving_slots]
    new_page, num_free, num_ids = take_page_id(free, num_free, num_ids, sizes, members)
    rows = 0
    for i in range(moving.shape[0] - 1, -1, -1):  # highest slot first, as `PageTable.split`
        rows, num_free = move_one(moving[i], page, new_page, sizes[new_page], members, sizes, page_of, slot_of,
                                   journal, rows, free, num_free)
    # ---- the point joins the half that holds its neighbour
    holder = new_page if page_of[neighbour] == new_page else page
    rows = append_one(point, holder, members, sizes, page_of, slot_of, journal, rows)
    # ---- `_merge_small_page` of each half
    merges = 0
    for stage in range(2):
        cursor = page if stage == 0 else new_page
        while 0 <= cursor < sizes.shape[0] and sizes[cursor] > 0:
            cid = parent_of[members[cursor, 0]] + 1
            other = _merge_partner(run_id, cl_start[cid], cl_size[cid], page_of, sizes, cursor, page_size)
            if other < 0:
                break
            if merges == max_merges:
                return rows, num_free, num_ids, new_page, stage, cursor
            merges += 1
            src, dst = (cursor, other) if sizes[cursor] <= sizes[other] else (other, cursor)
            for i in range(sizes[src] - 1, -1, -1):  # the source's positions, last slot first
                rows, num_free = move_one(members[src, i], src, dst, sizes[dst], members, sizes, page_of, slot_of,
                                           journal, rows, free, num_free)
            cursor = dst
    return rows, num_free, num_ids, new_page, 2, -1


def _split_page(tree: DCITree, page: int) -> int:
    """Split ``page`` in two halves (``used // 2`` in run-0 order, or a balanced 2-means split); the upper
    half moves to a new page, which is returned."""
    table = tree.table
    assert table is not None
    ids = table.members[page, : table.sizes_[page]].copy()
    if tree.params.page_split == "2means":
        edit_kernels.kway_order(tree.vectors, ids, 2, TWO_MEANS_ITERS)  # halves of a balanced 2-means split
        upper = ids[len(ids) // 2 :]
    else:
        order = np.lexsort((ids, tree.proj[ids, 0]))
        upper = ids[order[len(ids) // 2 :]]
    return table.split(page, move_slots=table.slot_of_[upper])


def _adopt(tree: DCITree, point: int, level: int) -> None:
    """Promoted node ``point`` (level t > 0) takes every level-(t-1) node strictly closer to it than to
    its parent (exact scan)."""
    candidates = tree.members(level - 1)
    if len(candidates) == 0:
        return
    closer = edit_kernels.adopt_scan(
        point, candidates, tree.vectors, tree.ext, tree.parent_dist, tree.key_mode, float(tree.msq), float(tree.params.adopt_margin)
    )
    stolen = candidates[closer]
    if len(stolen) == 0:
        return
    new_dists = tree.point_distance(stolen, np.full(len(stolen), point))
    table = tree.table
    shrunk = np.unique(table.page_of_[stolen]) if table is not None else None  # pages that lose points
    moved = int(_detach(stolen, tree.parent_of, tree.num_descendants, tree.cluster_start, tree.cluster_size,
                        tree.run_key, tree.run_id, tree.vectors_run0))
    tree.parent_of[stolen] = point
    tree.parent_dist[stolen] = new_dists
    cid = point + 1
    cap = len(stolen) + len(stolen) // 4 + 2
    if cap > tree.cluster_cap[cid]:
        tree.cluster_start[cid] = tree.slab_alloc(np.array([cap]))[0]
        tree.cluster_cap[cid] = cap
    tree.cluster_size[cid] = 0
    tree.fill_cluster(cid, stolen)
    _path_add(tree, point, moved)
    if table is not None:
        for group in even_groups(tree, tree.cluster_run0(cid)):
            table.move_many(group, table.new_page())
        if tree.params.page_split == "projection":
            for page in shrunk:
                _merge_small_page(tree, int(page))


def _merge_small_page(tree: DCITree, page: int) -> None:
    """After points left ``page`` (an adoption) or ``page`` was split: while it and a run-0 neighbour page of
    its cluster fit in one page and one of them holds fewer than ``P // 2`` points, move the smaller into the
    larger (contiguity in run-0 order is kept). Without this, adoptions leave ever more small pages behind:
    keys of width 16, page 8, grown one at a time from 1k to 20k gave page fill 0.56 (0.71 with merging)
    against 0.89 when built at once, so 1.6x the pages to rank, load and hold."""
    table = tree.table
    assert table is not None
    page_size = table.page_size
    while 0 <= page < len(table.sizes_) and table.sizes_[page] > 0:
        cid = int(tree.parent_of[int(table.members[page, 0])]) + 1
        other = int(_merge_partner(tree.run_id, int(tree.cluster_start[cid]), int(tree.cluster_size[cid]),
                                   table.page_of_, table.sizes_, page, page_size))
        if other < 0:
            return
        size = int(table.sizes_[page])
        src, dst = (page, other) if size <= int(table.sizes_[other]) else (other, page)
        table.move_many(table.members[src, : table.sizes_[src]][::-1].copy(), dst)  # the emptied page is freed
        page = dst


@njit(nogil=True, cache=True)
def _detach(stolen, parent_of, num_desc, cl_start, cl_size, run_key, run_id, Xr) -> int:
    """Take each of ``stolen`` (in order) out of its current parent's cluster runs and subtract its subtree from
    the descendant counts up that parent's path (``parent_of`` itself is left for the caller). Returns the
    number of points moved (the children and their descendants)."""
    moved = 0
    for i in range(stolen.shape[0]):
        child = stolen[i]
        old_parent = parent_of[child]
        cid = old_parent + 1
        edit_kernels.cluster_remove(run_key, run_id, Xr, cl_start[cid], cl_size[cid], child)
        cl_size[cid] -= 1
        subtree = 1 + num_desc[child]
        node = old_parent
        while node >= 0:
            num_desc[node] -= subtree
            node = parent_of[node]
        moved += subtree
    return moved


@njit(nogil=True, cache=True)
def _merge_partner(run_id, start, size, page_of, sizes, page, page_size) -> int:
    """The page that `_merge_small_page` merges ``page`` with, or -1: of the pages just before and just after
    ``page``'s stretch of its cluster's run 0 (the cluster block at ``start`` of ``size`` members), in that
    order, those that fit together with it where one of the two holds fewer than ``page_size // 2`` points; the
    first of the smallest."""
    first = -1
    last = -1
    for i in range(size):
        if page_of[run_id[0, start + i]] == page:
            if first < 0:
                first = i
            last = i
    mine = sizes[page]
    best = -1
    for i in (first - 1, last + 1):
        if first < 0 or i < 0 or i >= size:
            continue
        other = page_of[run_id[0, start + i]]
        if mine + sizes[other] <= page_size and min(mine, sizes[other]) < page_size // 2:
            if best < 0 or sizes[other] < sizes[best]:
                best = other
    return best


__all__ = ["insert"]
