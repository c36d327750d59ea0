"""`BulkLoader`: after any sequence of selections, the budget slots hold exactly the selected positions' K/V
(brute-force check from the host stores), and the CPU direct path (gather straight into the slots) leaves
the buffers exactly as the staged path (gather, copy, scatter through torch) does."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache.indexes import make_pager
from icecache.runtime.loader import BulkLoader
from icecache.runtime.store import HeadStore
from icecache.runtime.timing import StageTimer

H, D = 2, 4


def _stores(n: int, page_size: int, seed: int) -> tuple[list[list[HeadStore]], list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    stores, keys = [], []
    for _ in range(H):
        k = torch.from_numpy(rng.standard_normal((n, D), dtype=np.float32))
        pager = make_pager("sequential", head_dim=D, page_size=page_size, record_moves=False)
        pager.build(k)
        store = HeadStore(pager.table, D, torch.float32)
        store.load_layout(k, 10 + k)
        stores.append(store)
        keys.append(k)
    return [stores], keys


def _loader(budget: int, direct: bool) -> BulkLoader:
    slots = 3 + budget
    bufs = (torch.zeros(1, H, slots, D), torch.zeros(1, H, slots, D), torch.zeros(1, H, slots, dtype=torch.bool))
    loader = BulkLoader(*bufs, 3, budget)
    loader.direct = direct  # the staged path is what CUDA and bfloat16 buffers take
    return loader


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), page_size=st.integers(1, 8), budget=st.integers(1, 40), seed=st.integers(0, 1000),
       steps=st.integers(1, 6))
def test_direct_and_staged_loads_fill_the_slots_alike(n, page_size, budget, seed, steps):
    stores, keys = _stores(n, page_size, seed)
    rng = np.random.default_rng(seed + 1)
    loaders = [_loader(budget, direct=True), _loader(budget, direct=False)]
    timer = StageTimer()
    for _ in range(steps):
        positions = [[np.sort(rng.choice(n, size=min(budget, int(rng.integers(0, n + 1))), replace=False))
                      for _ in range(H)]]
        reports = [ld.load(stores, positions, [[None] * H], timer) for ld in loaders]
        assert reports[0].tokens_copied == reports[1].tokens_copied and reports[0].copies == reports[1].copies
        direct, staged = loaders
        assert torch.equal(direct.buf_k, staged.buf_k) and torch.equal(direct.buf_v, staged.buf_v)
        assert torch.equal(direct.buf_valid, staged.buf_valid)
        for h in range(H):  # brute force: every valid budget slot holds its position's K (and V = 10 + K)
            held = direct.slot_pos[0, h]
            assert sorted(held[held >= 0].tolist()) == positions[0][h].tolist()
            for slot, pos in enumerate(held):
                if pos >= 0:
                    assert torch.equal(direct.buf_k[0, h, 3 + slot], keys[h][pos])
                    assert torch.equal(direct.buf_v[0, h, 3 + slot], 10 + keys[h][pos])
            assert int(direct.buf_valid[0, h, 3:].sum()) == len(positions[0][h])
