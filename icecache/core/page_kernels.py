"""The compiled kernels of `icecache.core.pages.PageTable`, on its arrays (``members``, ``sizes``, ``page_of``,
``slot_of``; see that module): the budget rule, and moves of many positions with their journal rows, as the
table's one-position methods would make them."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def budget_csr(members, sizes, num_ids, ids, budget):
    """The budget rule and CSR positions in one pass (see `PageTable.take_within_budget`). Returns
    ``(j, indptr [j + 1], positions [indptr[j]])``; ``j == -1`` when some id is not a live page."""
    k = ids.shape[0]
    indptr = np.zeros(k + 1, np.int64)
    j = 0
    total = 0
    for i in range(k):
        p = ids[i]
        if p < 0 or p >= num_ids or sizes[p] < 0:
            return -1, indptr, np.zeros(0, np.int64)
        if total + sizes[p] > budget:
            break
        total += sizes[p]
        j += 1
        indptr[j] = total
    pos = np.empty(total, np.int64)
    o = 0
    for i in range(j):
        p = ids[i]
        for sl in range(sizes[p]):
            pos[o] = members[p, sl]
            o += 1
    return j, indptr[: j + 1].copy(), pos


@njit(nogil=True, cache=True, inline="always")
def _journal_row(journal, row, position, src_page, src_slot, dst_page, dst_slot) -> None:
    journal[row, 0] = position
    journal[row, 1] = src_page
    journal[row, 2] = src_slot
    journal[row, 3] = dst_page
    journal[row, 4] = dst_slot


@njit(nogil=True, cache=True, inline="always")
def move_one(pos, src, dst, slot, members, sizes, page_of, slot_of, journal, rows, freed, nfreed):
    """`PageTable.move` of paged ``pos`` from page ``src`` into free ``slot`` of page ``dst`` on the arrays: the
    journal rows from ``rows`` on, the source's hole closed by its last slot, an emptied source freed into
    ``freed[nfreed]``. Returns ``(rows, nfreed)``."""
    src_slot = slot_of[pos]
    members[dst, slot] = pos
    sizes[dst] = slot + 1
    page_of[pos] = dst
    slot_of[pos] = slot
    _journal_row(journal, rows, pos, src, src_slot, dst, slot)
    rows += 1
    n = sizes[src] - 1  # close the hole: the source's last slot fills it
    last = members[src, n]
    members[src, n] = -1
    sizes[src] = n
    if src_slot < n:
        members[src, src_slot] = last
        slot_of[last] = src_slot
        _journal_row(journal, rows, last, src, n, src, src_slot)
        rows += 1
    if n == 0:
        sizes[src] = -1
        freed[nfreed] = src
        nfreed += 1
    return rows, nfreed


@njit(nogil=True, cache=True, inline="always")
def append_one(pos, dst, members, sizes, page_of, slot_of, journal, rows):
    """`PageTable.append` of unpaged ``pos`` to page ``dst`` (which has room) on the arrays, with its journal row
    at ``rows``. Returns the next journal row."""
    slot = sizes[dst]
    members[dst, slot] = pos
    sizes[dst] = slot + 1
    page_of[pos] = dst
    slot_of[pos] = slot
    _journal_row(journal, rows, pos, -1, -1, dst, slot)
    return rows + 1


@njit(nogil=True, cache=True, inline="always")
def take_page_id(free, num_free, num_ids, sizes, members):
    """`PageTable._take_id` on the arrays: pop the free list ``free[:num_free]``, else id ``num_ids`` (the arrays
    have room); the page is opened empty. Returns ``(page, num_free, num_ids)``."""
    if num_free > 0:
        num_free -= 1
        page = free[num_free]
    else:
        page = num_ids
        num_ids += 1
    sizes[page] = 0
    members[page, :] = -1
    return page, num_free, num_ids


@njit(nogil=True, cache=True)
def move_many_kernel(positions, dst, members, sizes, page_of, slot_of, page_size, journal, freed):
    """`PageTable.move` of each of ``positions`` in order into page ``dst``, on the arrays. Writes the journal
    rows ``(position, src_page, src_slot, dst_page, dst_slot)`` and the freed page ids in the order `move`
    would; returns ``(rows, freed count, -1)``, or ``(rows, freed, i)`` when ``positions[i]`` is not paged or
    ``dst`` is full (stopped there)."""
    rows = 0
    nfreed = 0
    for i in range(positions.shape[0]):
        pos = positions[i]
        src = page_of[pos]
        if src < 0:
            return rows, nfreed, i
        if src == dst:
            continue
        slot = sizes[dst]
        if slot >= page_size:
            return rows, nfreed, i
        rows, nfreed = move_one(pos, src, dst, slot, members, sizes, page_of, slot_of, journal, rows, freed, nfreed)
    return rows, nfreed, -1


@njit(nogil=True, cache=True)
def repage_kernel(flat, bounds, members, sizes, page_of, slot_of, page_size, free, num_free, num_ids, journal):
    """`PageTable.repage` on the arrays: for each group ``flat[bounds[g]:bounds[g + 1]]`` that is not already
    exactly one page, `PageTable.new_page` (popping ``free[:num_free]`` first, else id ``num_ids``; the arrays
    have room) and each position moved there (or appended when unpaged), as the calls one by one would, freed
    pages pushed onto ``free``. Returns ``(rows, num_free, num_ids, appended, failed)``: ``failed`` is the first
    group that does not fit in a page, else -1 (stopped there)."""
    rows = 0
    appended = 0
    for g in range(bounds.shape[0] - 1):
        lo, hi = bounds[g], bounds[g + 1]
        if hi - lo > page_size:
            return rows, num_free, num_ids, appended, g
        page = page_of[flat[lo]]
        if page >= 0 and sizes[page] == hi - lo:
            same = True
            for i in range(lo, hi):
                if page_of[flat[i]] != page:
                    same = False
                    break
            if same:
                continue
        dst, num_free, num_ids = take_page_id(free, num_free, num_ids, sizes, members)
        for i in range(lo, hi):
            pos = flat[i]
            src = page_of[pos]
            if src == dst:  # a repeated position: `move` into its own page does nothing
                continue
            slot = sizes[dst]
            if src >= 0:
                rows, num_free = move_one(pos, src, dst, slot, members, sizes, page_of, slot_of, journal, rows, free,
                                           num_free)
                continue
            rows = append_one(pos, dst, members, sizes, page_of, slot_of, journal, rows)
            appended += 1
    return rows, num_free, num_ids, appended, -1


__all__ = ["append_one", "budget_csr", "move_many_kernel", "move_one", "repage_kernel", "take_page_id"]
