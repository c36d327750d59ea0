"""`BulkLoader`: after any sequence of selections, the budget slots hold exactly the selected positions' K/V
(brute-force check from the host stores), and the CPU direct path (gather straight into the slots; one native call
per layer when the kernels are built, else numba) leaves the buffers, slot maps and counts exactly as the staged
path (gather, copy, scatter through torch) does."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache.indexes import make_pager
from icecache.kernels.library import native_kernels, numba_kernels
from icecache.runtime.loader import BulkLoader
from icecache.runtime.store import HeadStore
from icecache.runtime.timing import StageTimer

H, D = 2, 4


def _stores(n: int, page_size: int, seed: int, rows: int = 1,
            dtype: torch.dtype = torch.float32) -> tuple[list[list[HeadStore]], list[list[torch.Tensor]]]:
    rng = np.random.default_rng(seed)
    stores, keys = [], []
    for _ in range(rows):
        row_stores, row_keys = [], []
        for _ in range(H):
            k = torch.from_numpy(rng.standard_normal((n, D), dtype=np.float32)).to(dtype)
            pager = make_pager("sequential", head_dim=D, page_size=page_size, record_moves=False)
            pager.build(k.float())
            store = HeadStore(pager.table, D, dtype)
            store.load_layout(k, 10 + k)
            row_stores.append(store)
            row_keys.append(k)
        stores.append(row_stores)
        keys.append(row_keys)
    return stores, keys


def _loader(budget: int, direct: bool, rows: int = 1, dtype: torch.dtype = torch.float32) -> BulkLoader:
    slots = 3 + budget + 2
    bufs = (torch.zeros(rows, H, slots, D, dtype=dtype), torch.zeros(rows, H, slots, D, dtype=dtype),
            torch.zeros(rows, H, slots, dtype=torch.bool))
    loader = BulkLoader(*bufs, 3, budget)
    loader.direct = direct  # the staged path is what CUDA and bfloat16 buffers take
    return loader


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), page_size=st.integers(1, 8), budget=st.integers(1, 40), seed=st.integers(0, 1000),
       steps=st.integers(1, 6), rows=st.integers(1, 2), half=st.booleans(), pages=st.booleans())
def test_direct_and_staged_loads_fill_the_slots_alike(n, page_size, budget, seed, steps, rows, half, pages):
    dtype = torch.float16 if half else torch.float32
    stores, keys = _stores(n, page_size, seed, rows, dtype)
    rng = np.random.default_rng(seed + 1)
    kinds = ["native", "numba", "staged"] if native_kernels() is not None else ["numba", "staged"]
    loaders = {kind: _loader(budget, kind != "staged", rows, dtype) for kind in kinds}
    timer = StageTimer()
    for _ in range(steps):
        positions, indptrs = [], []
        for b in range(rows):
            prow, irow = [], []
            for h in range(H):
                if pages:  # whole pages in rank order, as a selection hands them over (reuse is counted per page)
                    table = stores[b][h].table
                    ids = rng.permutation(table.page_ids())
                    _, indptr, pos = table.take_within_budget(ids, int(rng.integers(0, budget + 1)))
                    prow.append(pos)
                    irow.append(indptr)
                else:
                    prow.append(np.sort(rng.choice(n, size=min(budget, int(rng.integers(0, n + 1))), replace=False)))
                    irow.append(None)
            positions.append(prow)
            indptrs.append(irow)
        reports = {}
        for kind, loader in loaders.items():
            if kind == "numba":
                with numba_kernels():
                    reports[kind] = loader.load(stores, positions, indptrs, timer)
            else:
                reports[kind] = loader.load(stores, positions, indptrs, timer)
        first = loaders[kinds[0]]
        for kind in kinds[1:]:
            assert reports[kind] == reports[kinds[0]], kind
            assert torch.equal(loaders[kind].buf_k, first.buf_k) and torch.equal(loaders[kind].buf_v, first.buf_v), kind
            assert torch.equal(loaders[kind].buf_valid, first.buf_valid), kind
            assert np.array_equal(loaders[kind].slot_pos, first.slot_pos), kind
        for b in range(rows):
            for h in range(H):  # brute force: every valid budget slot holds its position's K (and V = 10 + K)
                held = first.slot_pos[b, h]
                assert sorted(held[held >= 0].tolist()) == sorted(positions[b][h].tolist())
                for slot, pos in enumerate(held):
                    if pos >= 0:
                        assert torch.equal(first.buf_k[b, h, 3 + slot], keys[b][h][pos])
                        assert torch.equal(first.buf_v[b, h, 3 + slot], 10 + keys[b][h][pos])
                assert int(first.buf_valid[b, h, 3:3 + budget].sum()) == len(positions[b][h])
                assert not first.buf_valid[b, h, 3 + budget:].any()


def test_a_selection_beyond_the_budget_is_refused():
    stores, _ = _stores(20, 4, 0)
    for kind in ("native", "numba"):
        if kind == "native" and native_kernels() is None:
            continue
        loader = _loader(5, True)
        with numba_kernels() if kind == "numba" else _nothing():
            try:
                loader.load(stores, [[np.arange(6), np.arange(2)]], [[None, None]], StageTimer())
            except AssertionError as err:
                assert "larger than the budget" in str(err)
            else:
                raise AssertionError(f"{kind}: a selection of 6 tokens loaded into 5 slots")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
