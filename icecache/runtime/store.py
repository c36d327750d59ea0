"""`HeadStore`: the host-resident middle K/V of one (batch row, layer, KV head), in page-shaped blocks.

The pager of that (row, layer, head) owns the page layout (its `PageTable`); the store holds the data::

    pool [num_blocks, page_size, 2, head_dim]    K = pool[..., 0, :], V = pool[..., 1, :]; pinned on CUDA
    block_of[page_id] -> block                   (-1: page not materialised)

After every `build`/`insert`, the store replays the table's move journal (`sync`): every position whose
location changed is read from where it was (or from the new K/V) and written where the table now says.
All reads happen before any write, so the order of moves inside one batch never matters.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from icecache.core.capacity import grown_capacity
from icecache.core.pages import Move, PageTable


@njit(nogil=True, cache=True)
def _flat_rows(page_of, slot_of, block_of, page_size, positions):
    """Row of each position in a store's flat view; -1 for a position with no page or no block."""
    out = np.empty(positions.shape[0], np.int64)
    n = page_of.shape[0]
    for i in range(positions.shape[0]):
        p = positions[i]
        page = page_of[p] if 0 <= p < n else -1
        blk = block_of[page] if 0 <= page < block_of.shape[0] else -1
        out[i] = blk * page_size + slot_of[p] if blk >= 0 else -1
    return out


class HeadStore:
    """Page-shaped host K/V blocks addressed by page id (see module docstring)."""

    def __init__(self, table: PageTable, head_dim: int, dtype: torch.dtype, *, pin: bool = False) -> None:
        self.table = table
        self.page_size = table.page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.pin = pin
        self.pool = self._alloc(0)
        self.block_of = np.full(0, -1, dtype=np.int64)
        self._free_blocks: list[int] = []
        self._num_blocks = 0  # blocks handed out at least once

    # ------------------------------------------------------------------ layout sync
    def sync(self, moves: list[Move], new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None, first_new: int = 0) -> None:
        """Replay ``moves`` (from ``table.take_moves()``). New positions ``first_new + i`` take their K/V from
        ``new_k[i]`` / ``new_v[i]`` (``[m, head_dim]``)."""
        if not moves:
            return
        if len(moves) <= 8 and all(m.src_page < 0 and m.dst_page >= 0 for m in moves):
            self._place_new(moves, new_k, new_v, first_new)  # the decode-time common case: appends only
            return
        arr = np.asarray(moves, dtype=np.int64).reshape(-1, 5)
        pos_all = arr[:, 0]
        # The first move of each position tells where its data was before this batch.
        pos, first = np.unique(pos_all, return_index=True)
        src_page, src_slot = arr[first, 1], arr[first, 2]
        is_new = src_page < 0
        P = self.page_size
        flat = self.flat_view()
        # ---- read every source first
        data = torch.empty(len(pos), 2, self.head_dim, dtype=self.dtype)
        old = ~is_new
        if old.any():
            assert (self.block_of[src_page[old]] >= 0).all(), "a move reads a page with no block (journal out of sync)"
            src = self.block_of[src_page[old]] * P + src_slot[old]
            data[torch.from_numpy(np.flatnonzero(old))] = flat[torch.from_numpy(src)]
        if is_new.any():
            assert new_k is not None and new_v is not None, "new positions need their K/V"
            idx = torch.from_numpy(pos[is_new] - first_new)
            sel = torch.from_numpy(np.flatnonzero(is_new))
            data[sel, 0] = new_k.index_select(0, idx).to(self.dtype)
            data[sel, 1] = new_v.index_select(0, idx).to(self.dtype)
        # ---- release blocks of pages that no longer exist, then place every position where it now lives
        touched = np.unique(np.concatenate([arr[:, 1], arr[:, 3]]))
        touched = touched[touched >= 0]
        self._grow_block_map(self.table.id_capacity)
        for page in touched:
            if self.table.sizes_[page] < 0 and self.block_of[page] >= 0:
                self._free_blocks.append(int(self.block_of[page]))
                self.block_of[page] = -1
        dst_page = self.table.page_of(pos)
        dst_slot = self.table.slot_of(pos)
        live = dst_page >= 0
        for page in np.unique(dst_page[live]):
            if self.block_of[page] < 0:
                self.block_of[page] = self._take_block()
        flat = self.flat_view()  # the pool may have grown
        dst = torch.from_numpy(self.block_of[dst_page[live]] * P + dst_slot[live])
        flat[dst] = data[torch.from_numpy(np.flatnonzero(live))]

    def load_layout(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill an empty store from the table's current layout in one pass: positions ``0..n-1`` take
        ``keys[i]`` / ``values[i]`` (``[n, head_dim]``), one block per live page. The result is what replaying
        a fresh build's journal gives (`sync`), without the journal: the prefill path builds with
        ``record_moves`` off and calls this."""
        if self._num_blocks:
            raise ValueError("load_layout needs an empty store")
        n = keys.shape[0]
        if self.table.num_positions != n:
            raise ValueError(f"the table holds {self.table.num_positions} positions, got K/V for {n}")
        pages = self.table.page_ids()
        self._grow_block_map(self.table.id_capacity)
        self.block_of[pages] = np.arange(len(pages))
        self._num_blocks = len(pages)
        self.pool = self._alloc(grown_capacity(len(pages), 0, 16))  # spare blocks for the decode's new pages
        if n == 0:
            return
        positions = np.arange(n)
        rows = self.block_of[self.table.page_of_[positions]] * self.page_size + self.table.slot_of_[positions]
        flat = self.flat_view()
        rows_t = torch.from_numpy(rows)
        flat[rows_t, 0] = keys.to(self.dtype)
        flat[rows_t, 1] = values.to(self.dtype)

    def _place_new(self, moves: list[Move], new_k: torch.Tensor | None, new_v: torch.Tensor | None, first_new: int) -> None:
        assert new_k is not None and new_v is not None, "new positions need their K/V"
        self._grow_block_map(self.table.id_capacity)
        for m in moves:
            if self.block_of[m.dst_page] < 0:
                self.block_of[m.dst_page] = self._take_block()
        flat = self.flat_view()
        for m in moves:
            row = flat[int(self.block_of[m.dst_page]) * self.page_size + m.dst_slot]
            i = m.position - first_new
            row[0].copy_(new_k[i])
            row[1].copy_(new_v[i])

    # ------------------------------------------------------------------ reads
    def flat_index(self, positions: np.ndarray) -> np.ndarray:
        """Row of each position's K/V in `flat_view`, ``[len(positions)]``."""
        rows = _flat_rows(self.table.page_of_, self.table.slot_of_, self.block_of, self.page_size,
                          np.ascontiguousarray(positions, dtype=np.int64))
        assert (rows >= 0).all(), "position not in the host store"
        return rows

    def flat_view(self) -> torch.Tensor:
        """The pool as ``[num_blocks * page_size, 2, head_dim]`` (K at ``[:, 0]``, V at ``[:, 1]``)."""
        return self.pool.view(-1, 2, self.head_dim)

    def read(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``positions``, each ``[len(positions), head_dim]`` (a copy)."""
        idx = torch.from_numpy(self.flat_index(np.asarray(positions, dtype=np.int64)))
        out = self.flat_view().index_select(0, idx)
        return out[:, 0], out[:, 1]

    @property
    def num_tokens(self) -> int:
        return self.table.num_positions

    def used_bytes(self) -> int:
        """Bytes of K/V actually stored (tokens x head_dim x 2 x element size)."""
        return self.num_tokens * self.head_dim * 2 * self.pool.element_size()

    def allocated_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    # ------------------------------------------------------------------ helpers
    def _alloc(self, blocks: int) -> torch.Tensor:
        t = torch.zeros(blocks, self.page_size, 2, self.head_dim, dtype=self.dtype)
        return t.pin_memory() if self.pin and blocks else t

    def _take_block(self) -> int:
        if self._free_blocks:
            return self._free_blocks.pop()
        b = self._num_blocks
        self._num_blocks += 1
        if b >= self.pool.shape[0]:
            new = self._alloc(grown_capacity(b + 1, self.pool.shape[0], 16))
            new[: self.pool.shape[0]] = self.pool
            self.pool = new
        return b

    def _grow_block_map(self, n: int) -> None:
        if n > len(self.block_of):
            m = np.full(grown_capacity(n, len(self.block_of), 16), -1, dtype=np.int64)
            m[: len(self.block_of)] = self.block_of
            self.block_of = m
