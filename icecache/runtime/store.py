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
from icecache.core.pager import SemanticPager
from icecache.core.pages import Move, PageTable, journal_array


def raw_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory: float32 (and other numpy dtypes) as is, bfloat16 / float16 as their
    bits (``int16``): for copying rows, not for arithmetic."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy()
    return t.numpy()


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


@njit(nogil=True, cache=True)
def _read_sources(moves, rows, block_of, page_size, new_k, new_v, first_new):
    """The K/V of every position a batch of ``moves`` ``[k, 5]`` touches, from where it was before the batch
    (its first move's source; ``new_k`` / ``new_v`` rows for new positions): ``(positions [m] ascending,
    data [m, 2, d])``. Empty positions when a source page has no block (the caller raises)."""
    order = np.argsort(moves[:, 0], kind="mergesort")  # stable: a position's first move comes first
    k = moves.shape[0]
    pos = np.empty(k, np.int64)
    src = np.empty(k, np.int64)  # row in the pool, or -1 - index into the new rows
    m = 0
    for t in range(k):
        i = order[t]
        if m > 0 and moves[i, 0] == pos[m - 1]:
            continue
        pos[m] = moves[i, 0]
        if moves[i, 1] < 0:
            src[m] = -1 - (moves[i, 0] - first_new)
        else:
            block = block_of[moves[i, 1]]
            if block < 0:
                return pos[:0], np.empty((0, 2, rows.shape[2]), rows.dtype)
            src[m] = block * page_size + moves[i, 2]
        m += 1
    data = np.empty((m, 2, rows.shape[2]), rows.dtype)
    for j in range(m):
        if src[j] >= 0:
            data[j] = rows[src[j]]
        else:
            data[j, 0] = new_k[-1 - src[j]]
            data[j, 1] = new_v[-1 - src[j]]
    return pos[:m], data


@njit(nogil=True, cache=True)
def _dead_and_homeless(moves, pos, sizes, page_of, block_of):
    """Pages of a batch that no longer exist but hold a block (``dead``), and live destination pages without
    one (``homeless``), each ascending and unique: ``(dead, homeless)``."""
    touched = np.concatenate((moves[:, 1], moves[:, 3]))
    touched = np.unique(touched[touched >= 0])
    dead = touched[(sizes[touched] < 0) & (block_of[touched] >= 0)]
    dst = page_of[pos]
    dst = np.unique(dst[dst >= 0])
    return dead, dst[block_of[dst] < 0]


@njit(nogil=True, cache=True)
def _write_moved(rows, pos, data, page_of, slot_of, block_of, page_size):
    """Write ``data`` ``[m, 2, d]`` of positions ``pos`` where the table now places them (live ones only)."""
    for j in range(pos.shape[0]):
        page = page_of[pos[j]]
        if page >= 0:
            rows[block_of[page] * page_size + slot_of[pos[j]]] = data[j]


class HeadStore:
    """Page-shaped host K/V blocks addressed by page id (see module docstring)."""

    def __init__(self, table: PageTable, head_dim: int, dtype: torch.dtype, *, pin: bool = False) -> None:
        self.table = table
        self.page_size = table.page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.pin = pin
        self.pool = self._alloc(0)
        self._raw: tuple[torch.Tensor, np.ndarray] | None = None  # (pool, its `raw_rows`) while the pool lives
        self.block_of = np.full(0, -1, dtype=np.int64)
        self._free_blocks: list[int] = []
        self._num_blocks = 0  # blocks handed out at least once

    # ------------------------------------------------------------------ layout sync
    def sync(self, moves: list[Move] | list[Move | np.ndarray] | np.ndarray, new_k: torch.Tensor | None = None,
             new_v: torch.Tensor | None = None, first_new: int = 0) -> None:
        """Replay ``moves`` (``table.take_journal()``, ``table.take_moves()`` or a `journal_array`). New positions ``first_new + i`` take their K/V from
        ``new_k[i]`` / ``new_v[i]`` (``[m, head_dim]``)."""
        if not len(moves):
            return
        if (len(moves) <= 8 and not isinstance(moves, np.ndarray)
                and all(not isinstance(m, np.ndarray) and m.src_page < 0 and m.dst_page >= 0 for m in moves)):
            self._place_new(moves, new_k, new_v, first_new)  # the decode-time common case: appends only
            return
        arr = moves if isinstance(moves, np.ndarray) else journal_array(moves)
        if not len(arr):
            return
        has_new = bool((arr[:, 1] < 0).any())
        if has_new:
            assert new_k is not None and new_v is not None, "new positions need their K/V"
            raw_k, raw_v = self.raw_new(new_k), self.raw_new(new_v)
        else:
            raw_k = raw_v = np.zeros((1, self.head_dim), self.raw_rows().dtype)
        # ---- read every source first (compiled: this runs at every page split of a decode insert)
        pos, data = _read_sources(arr, self.raw_rows(), self.block_of, self.page_size, raw_k, raw_v, first_new)
        assert pos.shape[0] > 0, "a move reads a page with no block (journal out of sync)"
        # ---- release blocks of pages that no longer exist, then place every position where it now lives
        self._grow_block_map(self.table.id_capacity)
        dead, homeless = _dead_and_homeless(arr, pos, self.table.sizes_, self.table.page_of_, self.block_of)
        self._free_blocks.extend(self.block_of[dead].tolist())
        self.block_of[dead] = -1
        for page in homeless.tolist():
            self.block_of[page] = self._take_block()
        _write_moved(self.raw_rows(), pos, data, self.table.page_of_, self.table.slot_of_, self.block_of,
                     self.page_size)  # the pool may have grown

    def insert_token(self, pager: SemanticPager, key32: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     position: int) -> None:
        """A decode insert: ``pager`` (whose table this store follows) takes the key ``key32`` ``[1, head_dim]``
        (finite float32) at ``position``, and the store its K/V ``key`` / ``value`` ``[1, head_dim]``: written by
        the pager itself when it `stores_inserts` a plain append, else by replaying the table's journal."""
        assert pager.table is self.table, "a store follows its own pager's table"
        if not pager.stores_inserts:
            pager.insert(key32, check=False)
        elif pager.insert_one_stored(key32.numpy()[0], self.raw_rows(), self.block_of, self.raw_new(key)[0],
                                     self.raw_new(value)[0]):
            return  # nothing to replay
        self.sync(self.table.take_journal(), key, value, first_new=position)

    def insert_tokens(self, pager: SemanticPager, keys32: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      first_position: int) -> None:
        """Decode inserts of ``n`` consecutive positions from ``first_position`` (keys ``keys32`` ``[n, head_dim]``
        finite float32, K/V ``keys`` / ``values`` ``[n, head_dim]``): one `insert_token` each where the pager
        `stores_inserts`, else one pager insert of all n and one replay of the journal."""
        n = keys32.shape[0]
        if n == 1 or pager.stores_inserts:
            for i in range(n):
                self.insert_token(pager, keys32[i : i + 1], keys[i : i + 1], values[i : i + 1], first_position + i)
            return
        assert pager.table is self.table, "a store follows its own pager's table"
        pager.insert(keys32, check=False)
        self.sync(self.table.take_journal(), keys, values, first_new=first_position)

    @staticmethod
    def insert_layer_token(pagers: list[SemanticPager], stores: list[HeadStore], keys32: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, position: int) -> bool:
        """`insert_token` of one position for every KV head of a layer row in one pager call, where the pagers'
        class offers it (``insert_layer_stored``: ``mdci``): ``keys32`` ``[H, head_dim]`` finite float32, K/V
        ``keys`` / ``values`` ``[H, head_dim]``. The stores end as through `insert_token` head by head. Returns
        False (nothing done) when the class has no layer insert."""
        cls = type(pagers[0])
        layer_insert = getattr(cls, "insert_layer_stored", None)
        if layer_insert is None or not cls.stores_inserts or any(type(p) is not cls for p in pagers):
            return False
        for pager, store in zip(pagers, stores):
            assert pager.table is store.table, "a store follows its own pager's table"
        first = stores[0]
        stored = layer_insert(pagers, keys32.numpy(), [s.raw_rows() for s in stores], [s.block_of for s in stores],
                              first.raw_new(keys), first.raw_new(values))
        for h, ok in enumerate(stored):
            if not ok:
                stores[h].sync(stores[h].table.take_journal(), keys[h : h + 1], values[h : h + 1], first_new=position)
        return True

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
        rows = self.raw_rows()
        keys, values = self.raw_new(new_k), self.raw_new(new_v)
        for m in moves:
            row = int(self.block_of[m.dst_page]) * self.page_size + m.dst_slot
            rows[row, 0] = keys[m.position - first_new]
            rows[row, 1] = values[m.position - first_new]

    # ------------------------------------------------------------------ reads
    def flat_index(self, positions: np.ndarray) -> np.ndarray:
        """Row of each position's K/V in `flat_view`, ``[len(positions)]``."""
        rows = _flat_rows(self.table.page_of_, self.table.slot_of_, self.block_of, self.page_size,
                          np.ascontiguousarray(positions, dtype=np.int64))
        assert (rows >= 0).all(), "position not in the host store"
        return rows

    def raw_new(self, rows: torch.Tensor) -> np.ndarray:
        """New K or V rows ``[m, head_dim]`` in the store's dtype, as `raw_numpy` (no copy when already so)."""
        return raw_numpy(rows if rows.dtype == self.dtype else rows.to(self.dtype))

    def raw_rows(self) -> np.ndarray:
        """`flat_view` as a numpy array over the same memory ``[rows, 2, head_dim]``: float32 as is, 16-bit floats
        as their bits (``int16``, for copying only). Cached while the pool lives (a grown pool is a new one)."""
        if self._raw is None or self._raw[0] is not self.pool:
            self._raw = (self.pool, raw_numpy(self.flat_view()))
        return self._raw[1]

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
