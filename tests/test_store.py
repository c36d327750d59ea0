"""`HeadStore`: the host K/V blocks a pager's page table addresses. The prefill path's one-pass `load_layout`
must hold exactly what replaying a fresh build's journal (`sync`) holds, for every pager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from icecache.indexes import available_pagers, make_pager
from icecache.runtime.store import HeadStore

PAGERS = available_pagers()


@settings(max_examples=15)
@given(n=st.integers(0, 300), page_size=st.integers(1, 16), seed=st.integers(0, 3))
@pytest.mark.parametrize("name", PAGERS)
def test_load_layout_equals_replaying_the_build_journal(name, n, page_size, seed):
    rng = np.random.default_rng(seed)
    keys = torch.from_numpy(rng.standard_normal((n, 8), dtype=np.float32))
    values = torch.from_numpy(rng.standard_normal((n, 8), dtype=np.float32))
    journaled = make_pager(name, head_dim=8, page_size=page_size, seed=seed, record_moves=True)
    journaled.build(keys)
    replayed = HeadStore(journaled.table, 8, torch.float32)
    replayed.sync(journaled.table.take_moves(), keys, values, first_new=0)
    quiet = make_pager(name, head_dim=8, page_size=page_size, seed=seed, record_moves=False)
    quiet.build(keys)
    loaded = HeadStore(quiet.table, 8, torch.float32)
    loaded.load_layout(keys, values)
    positions = np.arange(n)
    for store in (replayed, loaded):
        k, v = store.read(positions)
        assert torch.equal(k, keys) and torch.equal(v, values)
    assert loaded.used_bytes() == replayed.used_bytes()
    # both keep working the same way after decode-time inserts
    extra = torch.from_numpy(rng.standard_normal((3, 8), dtype=np.float32))
    for pager, store in ((journaled, replayed), (quiet, loaded)):
        pager.table.record_moves = True
        pager.insert(extra)
        store.sync(pager.table.take_moves(), extra, -extra, first_new=n)
        k, v = store.read(np.arange(n + 3))
        assert torch.equal(k[n:], extra) and torch.equal(v[n:], -extra) and torch.equal(k[:n], keys)


def test_load_layout_refuses_a_store_in_use_or_mismatched_kv():
    pager = make_pager("sequential", head_dim=4, page_size=4, record_moves=False)
    pager.build(torch.zeros(10, 4))
    store = HeadStore(pager.table, 4, torch.float32)
    with pytest.raises(ValueError, match="holds 10 positions"):
        store.load_layout(torch.zeros(9, 4), torch.zeros(9, 4))
    store.load_layout(torch.zeros(10, 4), torch.zeros(10, 4))
    with pytest.raises(ValueError, match="empty store"):
        store.load_layout(torch.zeros(10, 4), torch.zeros(10, 4))


@pytest.mark.parametrize("name", PAGERS)
def test_decode_inserts_after_a_build_do_not_reallocate(name):
    """A prefill build leaves spare room (`icecache.core.capacity`): the first decode inserts reuse the host pool,
    the page table and the pager's key buffers instead of doubling each of them (a fresh zero-filled allocation
    per head that the next layer waited for)."""
    rng = np.random.default_rng(0)
    n = 400
    keys = torch.from_numpy(rng.standard_normal((n, 8), dtype=np.float32))
    pager = make_pager(name, head_dim=8, page_size=8, seed=0, record_moves=False)
    pager.build(keys)
    store = HeadStore(pager.table, 8, torch.float32)
    store.load_layout(keys, keys)
    assert store.pool.shape[0] >= len(pager.table.page_ids()) * 5 // 4

    def buffers():
        found = {"pool": store.pool.data_ptr(), "members": pager.table.members.ctypes.data,
                 "page_of": pager.table.page_of_.ctypes.data}
        for attr in ("_buf", "_lo"):
            buf = getattr(pager, attr, None)
            if buf is not None:
                found[attr] = buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.ctypes.data
        tree = getattr(getattr(pager, "index", None), "tree", None)
        if tree is not None:
            found["tree vectors"], found["tree slab"] = tree.vectors.ctypes.data, tree.run_key.ctypes.data
        return found

    before = buffers()
    pager.table.record_moves = True
    extra = torch.from_numpy(rng.standard_normal((12, 8), dtype=np.float32))
    for i in range(len(extra)):
        pager.insert(extra[i : i + 1])
        store.sync(pager.table.take_moves(), extra[i : i + 1], extra[i : i + 1], first_new=n + i)
    after = buffers()
    assert {k for k in before if before[k] != after[k]} == set(), name
    k, _ = store.read(np.arange(n + len(extra)))
    assert torch.equal(k[:n], keys) and torch.equal(k[n:], extra)


@settings(max_examples=8, deadline=None)
@given(n0=st.integers(0, 120), inserts=st.integers(1, 150), page_size=st.integers(1, 8), seed=st.integers(0, 3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", PAGERS)
def test_one_token_inserts_keep_every_position_in_any_dtype(name, dtype, n0, inserts, page_size, seed):
    """Decode inserts one token at a time; every page edit they cause (splits, merges, adoptions) is replayed by
    `sync` (numpy copies of the pool's raw bytes): afterwards every position reads back its own K/V, in the
    store's dtype (16-bit floats copied as bits, never through float arithmetic)."""
    rng = np.random.default_rng(seed)
    keys = torch.from_numpy(rng.standard_normal((n0 + inserts, 8), dtype=np.float32))
    values = torch.from_numpy(rng.standard_normal((n0 + inserts, 8), dtype=np.float32))
    pager = make_pager(name, head_dim=8, page_size=page_size, seed=seed, record_moves=True)
    pager.build(keys[:n0])
    store = HeadStore(pager.table, 8, dtype)
    store.sync(pager.table.take_moves(), keys[:n0], values[:n0], first_new=0)
    for i in range(n0, n0 + inserts):
        pager.insert(keys[i : i + 1])
        store.sync(pager.table.take_moves(), keys[i : i + 1].to(dtype), values[i : i + 1], first_new=i)
    k, v = store.read(np.arange(n0 + inserts))
    assert k.dtype == dtype and torch.equal(k, keys.to(dtype)) and torch.equal(v, values.to(dtype))


@settings(max_examples=10, deadline=None)
@given(n0=st.integers(0, 400), inserts=st.integers(1, 300), page_size=st.sampled_from([1, 2, 4, 8, 16]),
       seed=st.integers(0, 2**16), growth=st.floats(1.0, 2.5))
@example(n0=400, inserts=300, page_size=16, seed=1, growth=1.0)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", PAGERS)
def test_inserts_that_write_the_store_equal_insert_and_replay(name, dtype, n0, inserts, page_size, seed, growth):
    """`SemanticPager.insert_one_stored` (the runtime's decode insert; M-DCI writes the common append's K/V into
    the store itself and journals nothing) leaves the same tree, pages and store contents as `insert` + `sync`,
    through page splits, adoptions, new levels and rekeys (keys that grow longer)."""
    rng = np.random.default_rng(seed)
    keys = torch.from_numpy(rng.standard_normal((n0 + inserts, 8), dtype=np.float32))
    keys[n0:] *= torch.linspace(1.0, growth, inserts)[:, None]
    values = torch.from_numpy(rng.standard_normal((n0 + inserts, 8), dtype=np.float32))
    pairs = []
    for _ in range(2):
        pager = make_pager(name, head_dim=8, page_size=page_size, seed=seed, record_moves=True)
        pager.build(keys[:n0])
        store = HeadStore(pager.table, 8, dtype)
        store.sync(pager.table.take_moves(), keys[:n0], values[:n0], first_new=0)
        pairs.append((pager, store))
    (ref, ref_store), (ours, our_store) = pairs
    stored = 0
    for i in range(n0, n0 + inserts):
        k, v = keys[i : i + 1].to(dtype), values[i : i + 1].to(dtype)
        ref.insert(keys[i : i + 1])
        ref_store.sync(ref.table.take_journal(), k, v, first_new=i)
        if ours.insert_one_stored(keys[i].numpy(), our_store.raw_rows(), our_store.block_of, our_store.raw_new(k)[0],
                                  our_store.raw_new(v)[0]):
            stored += 1
            assert ours.table.journal_is_empty()
        else:
            our_store.sync(ours.table.take_journal(), k, v, first_new=i)
    for name_ in ("members", "sizes_", "page_of_", "slot_of_"):
        np.testing.assert_array_equal(getattr(ours.table, name_), getattr(ref.table, name_))
    assert len(ours) == len(ref) == len(ours.table) == n0 + inserts
    if name == "mdci":
        for name_ in ("parent_of", "level_of", "num_descendants", "run_id", "cluster_size"):
            np.testing.assert_array_equal(getattr(ours.index.tree, name_), getattr(ref.index.tree, name_))
        assert ours.index.tree.num_rekeys == ref.index.tree.num_rekeys
        if page_size == 16 and n0 >= 300 and inserts >= 100 and growth == 1.0:  # the decode's common case
            assert stored > inserts // 2
    else:
        assert stored == 0
    k, v = our_store.read(np.arange(n0 + inserts))
    assert torch.equal(k, keys.to(dtype)) and torch.equal(v, values.to(dtype))
    np.testing.assert_array_equal(our_store.block_of[: ref.table.id_capacity], ref_store.block_of[: ref.table.id_capacity])
