"""`PageTable`: which token positions live in which physical page, and in which slot of it.

A page belongs to one (layer, KV head) and holds 1..``page_size`` token positions in *slots*
``0..size-1`` (slots are always compact). Page ids are small non-negative ints; a released id goes
on a free-list stack and is handed out again before any new id (so ids stay dense and host blocks are
reused). Positions are arbitrary non-negative ints (a pager uses 0..n-1 in insertion order).

Storage is a few numpy arrays, so compiled kernels can read the table directly::

    members  [id_capacity, page_size] int64   positions in slot order, -1 in unused slots
    sizes    [id_capacity]            int64   tokens per page; -1 marks a free id
    page_of  [position_capacity]      int64   page id per position, -1 when not paged
    slot_of  [position_capacity]      int64

Layout changes can be journalled as `Move` records, in the order they happened, so that a host store
holding page-shaped K/V blocks can replay them (``record_moves=True``; drained with `take_moves`, or as one
``[k, 5]`` int64 array per item with `take_journal` and `journal_array`: bulk changes are journalled as arrays)::

    Move(position, src_page, src_slot, dst_page, dst_slot)
    src_page == -1  ->  a new position (its K/V comes from the caller)
    dst_page == -1  ->  the position left the table (`remove`)

Replaying moves in order is always safe: a move reads its source slot before any later move can
overwrite it (splits move into a fresh page; removals move the last slot into the hole afterwards).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from icecache.core.capacity import grown_capacity
from icecache.core.page_kernels import budget_csr, move_many_kernel, repage_kernel


class Move(NamedTuple):
    """One slot change: ``position`` went from ``(src_page, src_slot)`` to ``(dst_page, dst_slot)``."""

    position: int
    src_page: int
    src_slot: int
    dst_page: int
    dst_slot: int


def journal_array(items: Sequence[Move | np.ndarray]) -> np.ndarray:
    """The moves of a journal (`PageTable.take_journal` or `PageTable.take_moves`) as one ``[k, 5]`` int64 array
    ``(position, src_page, src_slot, dst_page, dst_slot)`` in order."""
    parts: list[np.ndarray] = []
    single: list[Move] = []
    for item in items:
        if isinstance(item, np.ndarray):
            if single:
                parts.append(np.asarray(single, dtype=np.int64).reshape(-1, 5))
                single = []
            parts.append(item)
        else:
            single.append(item)
    if single:
        parts.append(np.asarray(single, dtype=np.int64).reshape(-1, 5))
    if not parts:
        return np.zeros((0, 5), np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class PageTable:
    """Page id -> positions (in slot order), position -> (page id, slot), capacity, split, free list.

    Parameters
    ----------
    page_size : int
        Capacity P of every page (>= 1).
    record_moves : bool
        Journal every layout change as `Move` records (see the module docstring).

    Only the table's own methods may change its arrays; readers (kernels, stores) treat them as read-only.
    """

    def __init__(self, page_size: int, *, record_moves: bool = False) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = int(page_size)
        self.record_moves = record_moves
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Forget every page and position (the free list and the journal too)."""
        self.members = np.full((0, self.page_size), -1, dtype=np.int64)
        self.sizes_ = np.full(0, -1, dtype=np.int64)
        self.page_of_ = np.full(0, -1, dtype=np.int64)
        self.slot_of_ = np.full(0, -1, dtype=np.int64)
        self._num_ids = 0  # ids 0.._num_ids-1 have been handed out at least once
        self._free: list[int] = []
        self._num_positions = 0
        self._moves: list[Move | np.ndarray] = []  # single moves, and [k, 5] int64 chunks of bulk changes

    @property
    def num_pages(self) -> int:
        """Number of live (non-free) pages."""
        return self._num_ids - len(self._free)

    @property
    def num_positions(self) -> int:
        """Number of positions held by some page."""
        return self._num_positions

    @property
    def id_capacity(self) -> int:
        """One more than the largest page id ever handed out (size a per-page array with this)."""
        return self._num_ids

    def __len__(self) -> int:
        return self._num_positions

    def __contains__(self, position: int) -> bool:
        return 0 <= position < len(self.page_of_) and self.page_of_[position] >= 0

    # ------------------------------------------------------------------ queries
    def page_ids(self) -> np.ndarray:
        """Live page ids, ascending. Shape ``[num_pages]``, int64."""
        return np.flatnonzero(self.sizes_[: self._num_ids] >= 0).astype(np.int64)

    def positions(self, page_id: int) -> np.ndarray:
        """Positions of one page in slot order. Shape ``[size]``, int64."""
        n = self._size(page_id)
        return self.members[page_id, :n].copy()

    def size(self, page_id: int) -> int:
        return self._size(page_id)

    def sizes(self, page_ids: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Token counts of the given live pages (default: every id below `id_capacity`, 0 for free ids)."""
        if page_ids is None:
            return np.maximum(self.sizes_[: self._num_ids], 0)
        ids = np.asarray(page_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self._num_ids or (self.sizes_[ids] < 0).any()):
            raise KeyError(f"not all of {ids.tolist()[:8]}... are live page ids")
        return self.sizes_[ids].copy()

    def page_of(self, positions: int | Sequence[int] | np.ndarray) -> np.ndarray | int:
        """Page id of each position (-1 where the position is not paged)."""
        return self._lookup(self.page_of_, positions)

    def slot_of(self, positions: int | Sequence[int] | np.ndarray) -> np.ndarray | int:
        """Slot of each position inside its page (-1 where the position is not paged)."""
        return self._lookup(self.slot_of_, positions)

    def as_dict(self) -> dict[int, np.ndarray]:
        """``{page id: positions in slot order}`` for every live page."""
        return {int(i): self.members[i, : self.sizes_[i]].copy() for i in self.page_ids()}

    def csr(self, page_ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of several live pages as CSR: ``(indptr [k+1], positions [indptr[-1]])``."""
        ids = np.asarray(page_ids, dtype=np.int64)
        sizes = self.sizes(ids)
        indptr = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(sizes, out=indptr[1:])
        rows = self.members[ids]
        flat = rows[np.arange(self.page_size)[None, :] < sizes[:, None]]
        return indptr, flat

    def take_within_budget(self, page_ids: np.ndarray, budget: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The budget rule on ranked live pages: the longest prefix of ``page_ids`` whose sizes sum to at
        most ``budget`` (stopping at the first page that does not fit), as ``(j, indptr [j+1],
        positions [indptr[-1]])`` (the `csr` of ``page_ids[:j]``). One compiled pass: this runs for every
        (layer, KV head) at every decode step."""
        ids = np.ascontiguousarray(page_ids, dtype=np.int64)
        j, indptr, pos = budget_csr(self.members, self.sizes_, self._num_ids, ids, int(budget))
        if j < 0:
            raise KeyError(f"not all of {ids.tolist()[:8]}... are live page ids")
        return int(j), indptr, pos

    # ------------------------------------------------------------------ mutations
    def new_page(self, positions: Iterable[int] = ()) -> int:
        """Open a page (recycling a free id first) holding ``positions`` (<= page_size, not yet paged).

        An empty page is allowed only transiently (fill it at once): `check` rejects empty live pages.
        """
        pos = [int(p) for p in positions]
        if len(pos) > self.page_size:
            raise ValueError(f"a page holds at most {self.page_size} positions, got {len(pos)}")
        page_id = self._take_id()
        for p in pos:
            self.append(page_id, p)
        return page_id

    def new_pages(self, groups: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
        """Open one page per group of positions (bulk load); returns the page ids in group order. ``groups``
        may be a 2-D array ``[pages, size]`` (every page the same size; no per-group Python work)."""
        if isinstance(groups, np.ndarray) and groups.ndim == 2:
            if groups.shape[0] == 0:
                return np.zeros(0, dtype=np.int64)
            lens = np.full(groups.shape[0], groups.shape[1], dtype=np.int64)
            flat = groups.astype(np.int64).reshape(-1)
        else:
            groups = [np.asarray(g, dtype=np.int64).reshape(-1) for g in groups]
            if not groups:
                return np.zeros(0, dtype=np.int64)
            lens = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
            flat = np.concatenate(groups)
        if lens.min() < 1 or lens.max() > self.page_size:
            raise ValueError(f"every page holds 1 to {self.page_size} positions")
        if flat.min() < 0:
            raise ValueError("positions are non-negative")
        if len(np.unique(flat)) != len(flat):
            raise ValueError("a position appears in more than one group")
        self._grow_positions(int(flat.max()) + 1)
        if (self.page_of_[flat] >= 0).any():
            raise ValueError("some positions are already paged")
        ids = self._take_ids(len(lens))
        page_rep = np.repeat(ids, lens)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        slots = np.arange(len(flat)) - starts
        self.members[page_rep, slots] = flat
        self.sizes_[ids] = lens
        self.page_of_[flat] = page_rep
        self.slot_of_[flat] = slots
        self._num_positions += len(flat)
        if self.record_moves:
            self._moves.append(np.stack([flat, np.full_like(flat, -1), np.full_like(flat, -1), page_rep, slots], 1))
        return ids

    def append(self, page_id: int, position: int) -> int:
        """Put a new (unpaged) position into the next free slot of a page; returns the slot."""
        slot = self._size(page_id)
        position = int(position)
        if slot >= self.page_size:
            raise ValueError(f"page {page_id} is full ({self.page_size} positions); split it first")
        if position < 0:
            raise ValueError(f"positions are non-negative, got {position}")
        self._grow_positions(position + 1)
        if self.page_of_[position] >= 0:
            raise ValueError(f"position {position} is already in page {int(self.page_of_[position])}")
        self.members[page_id, slot] = position
        self.sizes_[page_id] = slot + 1
        self.page_of_[position] = page_id
        self.slot_of_[position] = slot
        self._num_positions += 1
        if self.record_moves:
            self._moves.append(Move(position, -1, -1, page_id, slot))
        return slot

    def reserve_positions(self, n: int) -> None:
        """Room for positions ``0 .. n-1`` in ``page_of_`` / ``slot_of_`` (a compiled insert writes them)."""
        self._grow_positions(n)

    def record_append(self, position: int, page_id: int, slot: int, *, journal: bool = True) -> None:
        """Account for an `append` that a compiled kernel made in the arrays (``members``, ``sizes_``,
        ``page_of_``, ``slot_of_``): the position count and the move journal (``journal=False``: the caller has
        written the position's K/V where a host store keeps them, so there is nothing to replay)."""
        self._num_positions += 1
        if self.record_moves and journal:
            self._moves.append(Move(int(position), -1, -1, int(page_id), int(slot)))

    def journal_is_empty(self) -> bool:
        """No layout change waits in the journal (a host store is in step with the table)."""
        return not self._moves

    def move(self, position: int, dst_page: int) -> int:
        """Move a paged position into another page (which must have room); returns its new slot."""
        position = int(position)
        src_page = self.page_of(position)
        if src_page < 0:
            raise ValueError(f"position {position} is not paged")
        slot = self._size(dst_page)
        if dst_page == src_page:
            return int(self.slot_of_[position])
        if slot >= self.page_size:
            raise ValueError(f"page {dst_page} is full ({self.page_size} positions)")
        src_slot = int(self.slot_of_[position])
        self.members[dst_page, slot] = position
        self.sizes_[dst_page] = slot + 1
        self.page_of_[position] = dst_page
        self.slot_of_[position] = slot
        if self.record_moves:
            self._moves.append(Move(position, src_page, src_slot, dst_page, slot))
        self._close_hole(src_page, src_slot)
        return slot

    def move_many(self, positions: Sequence[int] | np.ndarray, dst_page: int) -> None:
        """`move` of each of ``positions``, in order, into ``dst_page``, in one compiled pass: the same slots,
        journal entries and freed pages as the calls one by one."""
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if pos.size == 0:
            return
        self._size(dst_page)  # a live page, or KeyError
        if pos.min() < 0 or pos.max() >= len(self.page_of_):
            raise ValueError(f"positions {pos.tolist()[:8]}... are not all paged")
        journal = np.empty((2 * pos.size, 5), np.int64)
        freed = np.empty(pos.size, np.int64)
        rows, nfreed, failed = move_many_kernel(pos, int(dst_page), self.members, self.sizes_, self.page_of_, self.slot_of_,
                                          self.page_size, journal, freed)
        if self.record_moves:
            self._moves.append(journal[:rows])
        self._free.extend(freed[:nfreed].tolist())
        if failed >= 0:
            raise ValueError(f"position {int(pos[failed])} is not paged or page {dst_page} is full "
                             f"({self.page_size} positions)")

    def repage(self, flat: np.ndarray, bounds: np.ndarray) -> None:
        """Make each group ``flat[bounds[g]:bounds[g + 1]]`` (distinct positions, 1..page_size each) one page, in
        group order: a group that is already exactly one page is kept; otherwise a `new_page` receives its
        positions in order, by `move` (or `append` for an unpaged position). One compiled pass with the same
        page ids, slots, journal and free list as those calls one by one (a rebuild re-pages every cluster)."""
        flat = np.ascontiguousarray(flat, dtype=np.int64)
        bounds = np.ascontiguousarray(bounds, dtype=np.int64)
        if len(bounds) < 2:
            return
        if flat.min() < 0:
            raise ValueError("positions are non-negative")
        self._grow_positions(int(flat.max()) + 1)
        groups = len(bounds) - 1
        free, num_free, num_ids = self.begin_edit(groups, groups + len(flat))  # pages freed on the way are pushed too
        journal = np.empty((2 * len(flat), 5), np.int64)
        rows, num_free, num_ids, appended, failed = repage_kernel(
            flat, bounds, self.members, self.sizes_, self.page_of_, self.slot_of_, self.page_size, free,
            num_free, num_ids, journal)
        self.end_edit(free, num_free, num_ids, journal[:rows], appended)
        if failed >= 0:
            raise ValueError(f"group {int(failed)} holds more than {self.page_size} positions")

    def begin_edit(self, new_ids: int, frees: int) -> tuple[np.ndarray, int, int]:
        """Prepare a compiled edit of the arrays (``members``, ``sizes_``, ``page_of_``, ``slot_of_``) that opens at
        most ``new_ids`` pages and frees at most ``frees``: room for the new ids, and the free list as an array with
        room for the frees (new pages pop its top, freed ones are pushed, as `new_page` and `move` do). Returns
        ``(free, num_free, num_ids)``; hand the kernel's results to `end_edit`."""
        if self._num_ids + new_ids > len(self.sizes_):
            self._grow_ids(self._num_ids + new_ids)
        free = np.empty(len(self._free) + frees, np.int64)
        free[: len(self._free)] = self._free
        return free, len(self._free), self._num_ids

    def end_edit(self, free: np.ndarray, num_free: int, num_ids: int, journal: np.ndarray, appended: int) -> None:
        """Take back what a compiled edit left (see `begin_edit`): the free list ``free[:num_free]``, the id count,
        the positions it appended, and its journal rows ``[k, 5]`` (in the order the one-by-one methods write them)."""
        self._free = free[:num_free].tolist()
        self._num_ids = int(num_ids)
        self._num_positions += int(appended)
        if self.record_moves and len(journal):
            self._moves.append(journal)

    def remove(self, position: int) -> None:
        """Take a position out of its page (the page's last slot fills the hole; an empty page is freed)."""
        position = int(position)
        page_id = self.page_of(position)
        if page_id < 0:
            raise ValueError(f"position {position} is not paged")
        slot = int(self.slot_of_[position])
        self.page_of_[position] = -1
        self.slot_of_[position] = -1
        self._num_positions -= 1
        if self.record_moves:
            self._moves.append(Move(position, page_id, slot, -1, -1))
        self._close_hole(page_id, slot)

    def split(self, page_id: int, move_slots: Sequence[int] | np.ndarray | None = None) -> int:
        """Move some slots of a page into a new page; returns the new page id.

        By default the upper half (slots ``size // 2 ..``) moves, so both halves keep >= P // 2 tokens
        when a full page splits. ``move_slots`` picks other slots (it must leave both pages non-empty).
        """
        size = self._size(page_id)
        if size < 2:
            raise ValueError(f"page {page_id} has {size} position(s); a split needs at least 2")
        slots = np.arange(size // 2, size) if move_slots is None else np.unique(np.asarray(move_slots, dtype=np.int64))
        if len(slots) == 0 or len(slots) >= size or slots[0] < 0 or slots[-1] >= size:
            raise ValueError(f"a split must move between 1 and {size - 1} valid slots of page {page_id}")
        moving = self.members[page_id, slots].copy()
        new_id = self._take_id()
        # Highest slots first, so the hole-filling inside `move` never touches a slot still to be moved.
        self.move_many(moving[::-1], new_id)
        return new_id

    def free_page(self, page_id: int) -> None:
        """Release an empty page id onto the free list."""
        if self._size(page_id):
            raise ValueError(f"page {page_id} still holds positions")
        self.sizes_[page_id] = -1
        self._free.append(page_id)

    def take_moves(self) -> list[Move]:
        """Return the journal of layout changes since the last call and clear it."""
        items, self._moves = self._moves, []
        moves: list[Move] = []
        for item in items:
            if isinstance(item, np.ndarray):
                moves.extend(Move(*row) for row in item.tolist())
            else:
                moves.append(item)
        return moves

    def take_journal(self) -> list[Move | np.ndarray]:
        """`take_moves` without unpacking: single `Move` records and ``[k, 5]`` int64 arrays of moves (a bulk change:
        split, merge, re-page), in order. `journal_array` makes one array of them."""
        items, self._moves = self._moves, []
        return items

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError if any invariant is broken (used by tests; O(positions))."""
        seen = 0
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate ids on the free list"
        for page_id in range(self._num_ids):
            n = int(self.sizes_[page_id])
            if n < 0:
                assert page_id in free, f"page {page_id} is free but not on the free list"
                continue
            assert page_id not in free, f"live page {page_id} is on the free list"
            assert 1 <= n <= self.page_size, f"page {page_id} holds {n} positions"
            row = self.members[page_id]
            assert (row[n:] == -1).all(), f"page {page_id} has stale slots"
            for slot in range(n):
                p = int(row[slot])
                assert self.page_of_[p] == page_id and self.slot_of_[p] == slot, f"maps disagree at {p}"
            seen += n
        assert seen == self._num_positions == int((self.page_of_ >= 0).sum()), "position count mismatch"

    # ------------------------------------------------------------------ helpers
    def _size(self, page_id: int) -> int:
        if not 0 <= page_id < self._num_ids or self.sizes_[page_id] < 0:
            raise KeyError(f"no live page with id {page_id}")
        return int(self.sizes_[page_id])

    def _take_id(self) -> int:
        """`_take_ids` of one, without its array work (a decode step opens a page per (layer, KV head))."""
        if self._free:
            page_id = self._free.pop()
        else:
            page_id = self._num_ids
            self._num_ids += 1
            if self._num_ids > len(self.sizes_):
                self._grow_ids(self._num_ids)
        self.sizes_[page_id] = 0
        self.members[page_id] = -1
        return page_id

    def _take_ids(self, count: int) -> np.ndarray:
        """``count`` fresh empty pages: recycled ids first (in free-list pop order), then new ids in order."""
        reused = [self._free.pop() for _ in range(min(count, len(self._free)))]
        start = self._num_ids
        self._num_ids += count - len(reused)
        if self._num_ids > len(self.sizes_):
            self._grow_ids(self._num_ids)
        ids = np.concatenate([np.asarray(reused, dtype=np.int64), np.arange(start, self._num_ids, dtype=np.int64)])
        self.sizes_[ids] = 0
        self.members[ids] = -1
        return ids

    def _close_hole(self, page_id: int, slot: int) -> None:
        n = int(self.sizes_[page_id]) - 1
        last = int(self.members[page_id, n])
        self.members[page_id, n] = -1
        self.sizes_[page_id] = n
        if slot < n:  # the emptied slot was not the last one: the last position fills it
            self.members[page_id, slot] = last
            self.slot_of_[last] = slot
            if self.record_moves:
                self._moves.append(Move(last, page_id, n, page_id, slot))
        if n == 0:
            self.free_page(page_id)

    def _grow_ids(self, n: int) -> None:
        cap = grown_capacity(n, len(self.sizes_))
        members = np.full((cap, self.page_size), -1, dtype=np.int64)
        members[: len(self.members)] = self.members
        sizes = np.full(cap, -1, dtype=np.int64)
        sizes[: len(self.sizes_)] = self.sizes_
        self.members, self.sizes_ = members, sizes

    def _grow_positions(self, n: int) -> None:
        if n > len(self.page_of_):
            cap = grown_capacity(n, len(self.page_of_))
            for name in ("page_of_", "slot_of_"):
                old = getattr(self, name)
                new = np.full(cap, -1, dtype=np.int64)
                new[: len(old)] = old
                setattr(self, name, new)

    @staticmethod
    def _lookup(table: np.ndarray, positions: int | Sequence[int] | np.ndarray) -> np.ndarray | int:
        if np.isscalar(positions):
            p = int(positions)  # type: ignore[arg-type]
            return int(table[p]) if 0 <= p < len(table) else -1
        pos = np.asarray(positions, dtype=np.int64)
        out = np.full(pos.shape, -1, dtype=np.int64)
        ok = (pos >= 0) & (pos < len(table))
        out[ok] = table[pos[ok]]
        return out
