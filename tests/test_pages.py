"""PageTable: invariants under random operation sequences, the move journal, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from icecache.core.pages import Move, PageTable, journal_array


def replay(moves, layout=None):
    """Apply a move journal to ``{(page, slot): position}`` the way a host store would."""
    layout = {} if layout is None else layout
    for m in moves:
        if m.src_page >= 0:
            assert layout.get((m.src_page, m.src_slot)) == m.position, "move reads a slot that does not hold it"
            del layout[(m.src_page, m.src_slot)]
        if m.dst_page >= 0:
            layout[(m.dst_page, m.dst_slot)] = m.position
    return layout


def table_layout(t: PageTable):
    return {(p, s): int(x) for p, pos in t.as_dict().items() for s, x in enumerate(pos)}


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "split", "remove", "move"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=60,
)


@given(page_size=st.integers(1, 6), ops=ops)
def test_random_operations_keep_invariants_and_journal(page_size, ops):
    t = PageTable(page_size, record_moves=True)
    layout: dict = {}
    next_pos = 0
    for op, r in ops:
        ids = t.page_ids()
        if op == "new" or len(ids) == 0:
            k = 1 + r % page_size
            t.new_page(range(next_pos, next_pos + k))
            next_pos += k
        elif op == "append":
            pid = int(ids[r % len(ids)])
            if t.size(pid) < page_size:
                t.append(pid, next_pos)
                next_pos += 1
        elif op == "split":
            pid = int(ids[r % len(ids)])
            if t.size(pid) >= 2:
                before = t.size(pid)
                new = t.split(pid)
                assert t.size(pid) + t.size(new) == before
                assert t.size(pid) >= before // 2 and t.size(new) >= 1
        elif op == "remove":
            pos = t.positions(int(ids[r % len(ids)]))
            t.remove(int(pos[r % len(pos)]))
        elif op == "move" and len(ids) >= 2:
            src, dst = int(ids[r % len(ids)]), int(ids[(r // 7) % len(ids)])
            if src != dst and t.size(dst) < page_size:
                pos = t.positions(src)
                t.move(int(pos[0]), dst)
        t.check()
        layout = replay(t.take_moves(), layout)
        assert layout == table_layout(t)
    # position -> page agrees with page -> positions
    for pid, pos in t.as_dict().items():
        assert (t.page_of(pos) == pid).all()
        assert (t.slot_of(pos) == np.arange(len(pos))).all()


@given(page_size=st.integers(1, 6), ops=ops, budget=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_take_within_budget_matches_the_budget_rule_and_csr(page_size, ops, budget, seed):
    """The compiled budget rule + CSR equals the reference (prefix sums of sizes, then `csr`)."""
    from icecache.core.pager import take_within_budget

    t = PageTable(page_size)
    next_pos = 0
    for op, r in ops:  # a table with splits and removals (free ids in between live ones)
        ids = t.page_ids()
        if op in ("new", "append", "move") or len(ids) == 0:
            k = 1 + r % page_size
            t.new_page(range(next_pos, next_pos + k))
            next_pos += k
        elif op == "split" and t.size(int(ids[r % len(ids)])) >= 2:
            t.split(int(ids[r % len(ids)]))
        elif op == "remove":
            pos = t.positions(int(ids[r % len(ids)]))
            t.remove(int(pos[r % len(pos)]))
    ranked = np.random.default_rng(seed).permutation(t.page_ids())
    j, indptr, pos = t.take_within_budget(ranked, budget)
    assert j == take_within_budget(t.sizes(ranked), budget)
    ref_indptr, ref_pos = t.csr(ranked[:j])
    assert np.array_equal(indptr, ref_indptr) and np.array_equal(pos, ref_pos)
    free = [i for i in range(t.id_capacity) if i not in set(t.page_ids().tolist())]
    if free:
        with pytest.raises(KeyError):
            t.take_within_budget(np.array([free[0]]), budget)
    with pytest.raises(KeyError):
        t.take_within_budget(np.array([t.id_capacity]), budget)


def test_free_ids_are_recycled_last_in_first_out():
    t = PageTable(4)
    a, _, c = t.new_page([0]), t.new_page([1]), t.new_page([2])
    t.remove(0)
    t.remove(2)
    assert t.num_pages == 1
    assert t.new_page([5]) == c  # the most recently freed id comes back first
    assert t.new_page([6]) == a
    assert t.new_page([7]) == 3  # then fresh ids
    t.check()


def test_bulk_load_csr_and_lookups():
    t = PageTable(3)
    ids = t.new_pages([[4, 5, 6], [1], [9, 8]])
    assert list(ids) == [0, 1, 2]
    indptr, flat = t.csr([2, 0])
    assert indptr.tolist() == [0, 2, 5] and flat.tolist() == [9, 8, 4, 5, 6]
    assert t.page_of([4, 8, 3, 100]).tolist() == [0, 2, -1, -1]
    assert t.page_of(1) == 1 and t.page_of(-5) == -1
    assert t.sizes().tolist() == [3, 1, 2]
    assert len(t) == 6


@pytest.mark.parametrize(
    "action, exc",
    [
        (lambda t: t.new_page([0, 1, 2]), ValueError),  # over capacity
        (lambda t: t.new_pages([[0], [0]]), ValueError),  # duplicate position
        (lambda t: t.new_pages([[]]), ValueError),  # empty page
        (lambda t: t.append(0, 10), KeyError),  # no such page
        (lambda t: t.split(t.new_page([3])), ValueError),  # split of a single-token page
        (lambda t: t.remove(42), ValueError),  # unpaged position
        (lambda t: t.new_page([-1]), ValueError),
    ],
)
def test_bad_operations_raise(action, exc):
    t = PageTable(2)
    with pytest.raises(exc):
        action(t)


def test_page_size_must_be_positive():
    with pytest.raises(ValueError, match="page_size"):
        PageTable(0)


def _two_tables(page_size: int, groups: list[int]) -> tuple[list[PageTable], int]:
    """Two equal journalled tables with one page per group (sizes capped at the page size), journals drained;
    and the number of positions they hold (0..n-1, in group order)."""
    tables = [PageTable(page_size, record_moves=True) for _ in range(2)]
    start = 0
    for table in tables:
        start = 0
        for size in groups:
            size = min(size, page_size)
            table.new_pages([list(range(start, start + size))])
            start += size
        table.take_moves()
    return tables, start


@given(page_size=st.integers(1, 6), groups=st.lists(st.integers(1, 6), min_size=1, max_size=10),
       picks=st.lists(st.integers(0, 59), max_size=12), target=st.integers(0, 9), fresh=st.booleans())
def test_move_many_is_move_one_by_one(page_size, groups, picks, target, fresh):
    """`move_many` leaves the same members, slots, free list and journal as `move` called position by position
    (brute-force reference), including moves within the target page, sources that empty and free, and the
    error when the target fills up (the moves before it made)."""
    tables, start = _two_tables(page_size, groups)
    positions = list(dict.fromkeys(p % start for p in picks))  # distinct paged positions
    outcomes = []
    for one_by_one, table in zip((True, False), tables):
        dst = table.new_page() if fresh else target % len(groups)
        try:
            if one_by_one:
                for pos in positions:
                    table.move(pos, dst)
            else:
                table.move_many(positions, dst)
            outcomes.append("ok")
        except ValueError:
            outcomes.append("full")
    a, b = tables
    assert outcomes[0] == outcomes[1]
    assert np.array_equal(a.members, b.members) and np.array_equal(a.sizes_, b.sizes_)
    assert np.array_equal(a.page_of_, b.page_of_) and np.array_equal(a.slot_of_, b.slot_of_)
    assert a._free == b._free and a.take_moves() == b.take_moves()
    if outcomes[0] == "ok" and (positions or not fresh):  # (an unused fresh page stays empty)
        a.check()


@given(page_size=st.integers(1, 6), groups=st.lists(st.integers(1, 6), min_size=1, max_size=10),
       seed=st.integers(0, 2**16), extra=st.integers(0, 4), keep=st.integers(0, 3))
def test_repage_is_new_page_and_move_one_by_one(page_size, groups, seed, extra, keep):
    """`repage` leaves the same members, sizes, free list, id count and journal as a `new_page` per group that is
    not already one page and `move` (or `append` for an unpaged position) of its positions in order (brute-force
    reference): groups cut from a shuffled order, some kept as they are, some positions new."""
    rng = np.random.default_rng(seed)
    tables, start = _two_tables(page_size, groups)
    order = rng.permutation(start + extra)  # positions start.. are not paged yet
    kept = [table.positions(0) for table in tables[:1]][0] if keep else np.zeros(0, np.int64)
    order = np.concatenate([kept, order[~np.isin(order, kept)]])  # page 0 survives as the first group
    cuts = [len(kept)] if keep else []
    at = len(kept)
    while at < len(order):
        at += int(rng.integers(1, page_size + 1))
        cuts.append(min(at, len(order)))
    bounds = np.array([0, *cuts], np.int64)
    one, many = tables
    for g in range(len(bounds) - 1):
        group = order[bounds[g] : bounds[g + 1]]
        page = one.page_of(int(group[0]))
        if page >= 0 and one.size(page) == len(group) and (one.page_of(group) == page).all():
            continue
        dst = one.new_page()
        for pos in group.tolist():
            if one.page_of(pos) >= 0:
                one.move(pos, dst)
            else:
                one.append(dst, pos)
    many.repage(order, bounds)
    assert np.array_equal(one.members[: one.id_capacity], many.members[: many.id_capacity])
    assert np.array_equal(one.sizes_[: one.id_capacity], many.sizes_[: many.id_capacity])
    assert np.array_equal(one.page_of_, many.page_of_[: len(one.page_of_)]) and (many.page_of_[len(one.page_of_) :] == -1).all()
    assert np.array_equal(one.slot_of_, many.slot_of_[: len(one.slot_of_)])
    assert one._free == many._free and one.id_capacity == many.id_capacity and len(one) == len(many)
    journal = many.take_journal()
    assert one.take_moves() == [Move(*row) for row in journal_array(journal).tolist()]
    many.check()


def test_journal_array_keeps_the_order_of_single_and_bulk_moves():
    """A journal mixing single moves (`append`) and bulk chunks (`split`, `new_pages`) reads the same through
    `take_moves` and `journal_array(take_journal())`."""
    tables = [PageTable(4, record_moves=True) for _ in range(2)]
    for table in tables:
        table.new_pages([[0, 1, 2]])
        table.append(0, 3)
        table.split(0)
        table.append(1, 4)
    moves, journal = tables[0].take_moves(), tables[1].take_journal()
    assert any(isinstance(item, np.ndarray) for item in journal) and len(moves) == 7
    assert journal_array(journal).tolist() == [list(m) for m in moves]
    assert journal_array([]).shape == (0, 5)
