"""`BulkLoader`: selected host tokens -> the device budget slots of one layer, in one copy.

Per decode step and layer::

    select (pagers)  ->  positions per (row, KV head), at most `budget` each
    gather           ->  K/V of positions NOT already resident, from every head's page blocks, into ONE
                         contiguous staging buffer [n, 2, head_dim] (pinned on CUDA)
    copy             ->  ONE host->device transfer of the staging buffer (non-blocking, side stream on CUDA)
    scatter          ->  index_copy_ into the free budget slots of the device buffers

Residency is tracked per token position: a position already in a slot from an earlier step keeps its slot
and is not copied again (so a page selected twice in a row costs nothing). A position's K/V never changes
once written, so page splits on the host never invalidate device slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from icecache.core.capacity import grown_capacity
from icecache.kernels.library import LOAD_DESCRIPTOR_WIDTH, NativeKernels, array_address, native_kernels
from icecache.runtime.store import HeadStore, raw_numpy
from icecache.runtime.timing import StageTimer


@njit(nogil=True, cache=True)
def _assign_slots(pos, slot_of_pos, slot_pos, indptr):
    """Residency update of one (row, KV head): make exactly ``pos`` resident in the budget slots.

    Slots whose position is not in ``pos`` are freed; positions not yet resident take the free slots in
    ascending order (both maps ``slot_of_pos`` / ``slot_pos`` updated in place). ``indptr`` (CSR page
    offsets of ``pos``; length <= 1 for none) counts the pages whose every token was already resident.
    Returns ``(new positions, their slots, pages, pages reused)``; pages == -1 when ``pos`` does not fit.
    """
    budget = slot_pos.shape[0]
    n = pos.shape[0]
    kept = np.empty(n, np.bool_)
    keep_slot = np.zeros(budget, np.bool_)
    n_new = 0
    for i in range(n):
        sl = slot_of_pos[pos[i]]
        kept[i] = sl >= 0
        if sl >= 0:
            keep_slot[sl] = True
        else:
            n_new += 1
    pages = 0
    reused = 0
    if indptr.shape[0] > 1 and n > 0:
        pages = indptr.shape[0] - 1
        for p in range(pages):
            whole = True
            for i in range(indptr[p], indptr[p + 1]):
                if not kept[i]:
                    whole = False
                    break
            if whole:
                reused += 1
    for sl in range(budget):
        if not keep_slot[sl] and slot_pos[sl] >= 0:
            slot_of_pos[slot_pos[sl]] = -1
            slot_pos[sl] = -1
    new = np.empty(n_new, np.int64)
    slots = np.empty(n_new, np.int64)
    k = 0
    sl = 0
    for i in range(n):
        if kept[i]:
            continue
        while sl < budget and slot_pos[sl] >= 0:
            sl += 1
        if sl == budget:
            return new, slots, -1, 0
        slot_pos[sl] = pos[i]
        slot_of_pos[pos[i]] = sl
        new[k] = pos[i]
        slots[k] = sl
        k += 1
    return new, slots, pages, reused


@njit(nogil=True, cache=True)
def _copy_rows(src, rows, dst_k, dst_v, dst_rows):
    """CPU gather+scatter in one pass: ``src`` ``[N, 2, D]`` (a host store's flat view) rows ``rows`` -> K into
    ``dst_k[dst_rows]`` and V into ``dst_v[dst_rows]`` (``[M, D]`` flat views of the layer's buffers)."""
    D = src.shape[2]
    for i in range(rows.shape[0]):
        r = rows[i]
        d = dst_rows[i]
        for j in range(D):
            dst_k[d, j] = src[r, 0, j]
            dst_v[d, j] = src[r, 1, j]


_NO_INDPTR = np.zeros(0, np.int64)
#: Dtypes the CPU direct path copies with `_copy_rows` (numpy has no bfloat16: those go through torch).
_DIRECT_DTYPES = (torch.float32, torch.float16, torch.float64)


@dataclass
class LoadReport:
    """What one `BulkLoader.load` call moved."""

    tokens_selected: int
    tokens_copied: int
    bytes_copied: int
    copies: int
    pages_selected: int
    pages_reused: int  # selected pages whose every token was already resident
    per_head: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """(row, kv head, pages selected, pages reused, tokens copied) for every (row, KV head)."""


class BulkLoader:
    """Device budget slots of one layer and the residency bookkeeping behind them.

    Parameters
    ----------
    buf_k, buf_v : Tensor ``[B, H, L, D]``
        The layer's device buffers; slots ``region_start .. region_start + budget`` are the budget region.
    buf_valid : BoolTensor ``[B, H, L]``
        Attention mask of the buffers (True = attend).
    region_start, budget : int
        First slot and number of slots of the budget region (`resize` moves to larger buffers).
    """

    def __init__(
        self, buf_k: torch.Tensor, buf_v: torch.Tensor, buf_valid: torch.Tensor, region_start: int, budget: int
    ) -> None:
        B, H, _, D = buf_k.shape
        self.B, self.H, self.D = B, H, D
        self.device = buf_k.device
        self.budget = 0
        self.slot_pos = np.full((B, H, 0), -1, dtype=np.int64)  # position held by each slot
        self._slot_of_pos = [[np.full(0, -1, dtype=np.int64) for _ in range(H)] for _ in range(B)]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.staging: torch.Tensor | None = None  # [B * H * budget, 2, D] host side of the one copy (pinned on CUDA)
        self.device_staging: torch.Tensor | None = None
        self.resize(buf_k, buf_v, buf_valid, region_start, budget)

    def resize(
        self, buf_k: torch.Tensor, buf_v: torch.Tensor, buf_valid: torch.Tensor, region_start: int, budget: int
    ) -> None:
        """Use new device buffers whose budget region starts at ``region_start`` and has ``budget`` slots (no
        fewer than now). Slot ``i`` of the old region must have been copied to slot ``i`` of the new one: the
        residency bookkeeping is kept."""
        if budget < self.budget:
            raise AssertionError(f"the budget region cannot shrink ({self.budget} -> {budget} slots)")
        self.buf_k, self.buf_v, self.buf_valid = buf_k, buf_v, buf_valid
        B, H, L, D = buf_k.shape
        self.L = L
        self.region_start = region_start
        if budget != self.budget or self.staging is None:
            slot_pos = np.full((B, H, budget), -1, dtype=np.int64)
            slot_pos[:, :, : self.budget] = self.slot_pos
            self.slot_pos = slot_pos
            self.budget = budget
            cuda = self.device.type == "cuda"
            cap = max(B * H * budget, 1)
            self.staging = torch.empty(cap, 2, D, dtype=buf_k.dtype, pin_memory=cuda)
            # On a CPU "device" host and device memory are one: the gather writes where the scatter reads, and
            # the bulk transfer (still counted in `copies`, one per layer step) moves no bytes.
            self.device_staging = (torch.empty(cap, 2, D, dtype=buf_k.dtype, device=self.device)
                                   if self.device.type != "cpu" else self.staging)
        # CPU buffers of a numpy dtype: the gather writes straight into the budget slots (no staging rows, no
        # scatter pass); the flat numpy views are taken once per buffer.
        self.direct = self.device.type == "cpu" and buf_k.dtype in _DIRECT_DTYPES
        if self.direct:
            self._flat_k = raw_numpy(buf_k.view(-1, D))  # 16-bit floats as their bits: numba copies int16
            self._flat_v = raw_numpy(buf_v.view(-1, D))
            self._units_k = buf_k.view(B * H, L, D).numpy()  # the native load's views (`_load_native`)
            self._units_v = buf_v.view(B * H, L, D).numpy()
            self._units_valid = buf_valid.view(B * H, L).numpy()

    def load(
        self,
        stores: list[list[HeadStore]],
        positions: list[list[np.ndarray]],
        indptrs: list[list[np.ndarray | None]],
        timer: StageTimer,
    ) -> LoadReport:
        """Make exactly ``positions[b][h]`` (host positions, <= budget each) resident in the budget region.

        ``indptrs[b][h]`` (CSR page offsets of those positions, or None) is only used to count page reuse.
        """
        native = native_kernels() if self.direct else None
        if native is not None:
            return self._load_native(native, stores, positions, indptrs, timer)
        B, H, budget = self.B, self.H, self.budget
        srcs: list[tuple[HeadStore, np.ndarray, int]] = []  # (store, flat indices, staging offset)
        dst_rows: list[np.ndarray] = []
        n_new = 0
        n_sel = 0
        pages_sel = pages_reused = 0
        per_head: list[tuple[int, int, int, int, int]] = []
        with timer.stage("other"):
            for b in range(B):
                for h in range(H):
                    pos = positions[b][h]
                    n_sel += len(pos)
                    sop = self._slot_map(b, h, pos)
                    ip = indptrs[b][h]
                    new, slots, head_sel, head_reused = _assign_slots(
                        np.ascontiguousarray(pos, dtype=np.int64), sop, self.slot_pos[b, h],
                        _NO_INDPTR if ip is None else np.ascontiguousarray(ip, dtype=np.int64),
                    )
                    if head_sel < 0:
                        raise AssertionError(f"selection of {len(pos)} tokens larger than the budget ({budget})")
                    pages_sel += head_sel
                    pages_reused += head_reused
                    per_head.append((b, h, head_sel, head_reused, len(new)))
                    if len(new):
                        srcs.append((stores[b][h], stores[b][h].flat_index(new), n_new))
                        dst_rows.append(((b * H + h) * self.L + self.region_start) + slots)
                        n_new += len(new)
        if self.direct:
            return self._load_direct(srcs, dst_rows, n_new, n_sel, pages_sel, pages_reused, per_head, timer)
        with timer.stage("gather"):
            for store, idx, off in srcs:
                torch.index_select(store.flat_view(), 0, torch.from_numpy(idx), out=self.staging[off : off + len(idx)])
        copies = 0
        with timer.stage("copy"):
            if n_new:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.device_staging[:n_new].copy_(self.staging[:n_new], non_blocking=True)
                    torch.cuda.current_stream(self.device).wait_stream(self.stream)
                elif self.device_staging is not self.staging:
                    self.device_staging[:n_new].copy_(self.staging[:n_new])
                copies = 1
        with timer.stage("scatter"):
            if n_new:
                dst = torch.from_numpy(np.concatenate(dst_rows)).to(self.device, non_blocking=True)
                self.buf_k.view(-1, self.D).index_copy_(0, dst, self.device_staging[:n_new, 0])
                self.buf_v.view(-1, self.D).index_copy_(0, dst, self.device_staging[:n_new, 1])
            valid = torch.from_numpy(self.slot_pos >= 0).to(self.device, non_blocking=True)
            self.buf_valid[:, :, self.region_start : self.region_start + budget] = valid
        elt = self.buf_k.element_size()
        return LoadReport(
            tokens_selected=n_sel,
            tokens_copied=n_new,
            bytes_copied=n_new * 2 * self.D * elt,
            copies=copies,
            pages_selected=pages_sel,
            pages_reused=pages_reused,
            per_head=per_head,
        )

    def _load_direct(self, srcs: list[tuple[HeadStore, np.ndarray, int]], dst_rows: list[np.ndarray], n_new: int,
                     n_sel: int, pages_sel: int, pages_reused: int, per_head: list[tuple[int, int, int, int, int]],
                     timer: StageTimer) -> LoadReport:
        """`load`'s CPU path: each head's new rows go from its store straight into the budget slots. The
        transfer still counts as the layer step's one copy when tokens moved (host and device are one memory)."""
        with timer.stage("gather"):
            for (store, idx, _), dst in zip(srcs, dst_rows):
                _copy_rows(store.raw_rows(), idx, self._flat_k, self._flat_v, dst)
        with timer.stage("copy"):
            pass  # host and device are one memory: the layer step's transfer moves nothing (timed as the staged path)
        with timer.stage("scatter"):
            self.buf_valid[:, :, self.region_start : self.region_start + self.budget] = torch.from_numpy(self.slot_pos >= 0)
        return LoadReport(
            tokens_selected=n_sel, tokens_copied=n_new, bytes_copied=n_new * 2 * self.D * self.buf_k.element_size(),
            copies=int(n_new > 0), pages_selected=pages_sel, pages_reused=pages_reused, per_head=per_head,
        )

    def _load_native(self, native: NativeKernels, stores: list[list[HeadStore]], positions: list[list[np.ndarray]],
                     indptrs: list[list[np.ndarray | None]], timer: StageTimer) -> LoadReport:
        """`load`'s CPU path in one native call (``layer_load.cpp``): every head's residency update and row copies
        from its store into the budget slots, as the numba path makes them. The call is timed as ``gather``, packing
        the heads' arrays as ``other`` and the slots' mask as ``scatter`` (as in `_load_direct`)."""
        B, H, budget = self.B, self.H, self.budget
        with timer.stage("other"):
            units = np.zeros((B * H, LOAD_DESCRIPTOR_WIDTH), np.int64)
            held = []  # contiguous copies the descriptors address: alive until the call returns
            n_sel = 0
            for b in range(B):
                for h in range(H):
                    pos = np.ascontiguousarray(positions[b][h], dtype=np.int64)
                    n_sel += len(pos)
                    sop = self._slot_map(b, h, pos)
                    ip = indptrs[b][h]
                    ip = None if ip is None else np.ascontiguousarray(ip, dtype=np.int64)
                    store = stores[b][h]
                    raw = store.raw_rows()
                    table = store.table
                    assert raw.itemsize == self._units_k.itemsize and raw.flags.c_contiguous, "store and buffers differ"
                    held.append((pos, ip))
                    a = array_address
                    units[b * H + h] = (
                        a(pos), len(pos), 0 if ip is None else a(ip), 0 if ip is None else len(ip), a(sop), len(sop),
                        a(raw), raw.shape[0], a(table.page_of_), len(table.page_of_), a(table.slot_of_),
                        a(store.block_of), len(store.block_of), store.page_size)
        with timer.stage("gather"):
            slot_pos = self.slot_pos.reshape(B * H, budget)
            assert slot_pos.size == 0 or np.may_share_memory(slot_pos, self.slot_pos), "slot map copied: updates lost"
            code, stats = native.layer_load(units, slot_pos, self._units_k, self._units_v, self.region_start)
        if code <= -1_000_000:
            raise AssertionError("position not in the host store")
        if code < 0:
            u = -1 - code
            raise AssertionError(f"selection of {len(positions[u // H][u % H])} tokens larger than the budget ({budget})")
        n_new = int(stats[:, 2].sum())
        per_head = [(u // H, u % H, int(sel), int(reused), int(copied)) for u, (sel, reused, copied) in enumerate(stats.tolist())]
        with timer.stage("copy"):
            pass  # host and device are one memory (see `_load_direct`)
        with timer.stage("scatter"):  # the slots' mask, written in place through its numpy view
            np.greater_equal(slot_pos, 0, out=self._units_valid[:, self.region_start : self.region_start + budget])
        return LoadReport(
            tokens_selected=n_sel, tokens_copied=n_new, bytes_copied=n_new * 2 * self.D * self.buf_k.element_size(),
            copies=int(n_new > 0), pages_selected=int(stats[:, 0].sum()), pages_reused=int(stats[:, 1].sum()),
            per_head=per_head,
        )

    def _slot_map(self, b: int, h: int, pos: np.ndarray) -> np.ndarray:
        """(row ``b``, head ``h``)'s position -> slot map, grown to hold every position of ``pos``."""
        sop = self._slot_of_pos[b][h]
        if len(pos) and pos.max() >= len(sop):
            grown = np.full(grown_capacity(int(pos.max()) + 1, len(sop)), -1, dtype=np.int64)
            grown[: len(sop)] = sop
            sop = self._slot_of_pos[b][h] = grown
        return sop

    def resident_positions(self, b: int, h: int) -> np.ndarray:
        """Host positions currently held in the budget slots of (row, head), sorted."""
        sp = self.slot_pos[b, h]
        return np.sort(sp[sp >= 0])
