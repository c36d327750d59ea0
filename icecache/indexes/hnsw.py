"""``hnsw``: semantic pages from the neighbourhoods of an HNSW graph (hnswlib) over MIPS-transformed keys.

Based on HNSW (Malkov and Yashunin, "Efficient and robust approximate nearest neighbor search using
Hierarchical Navigable Small World graphs", TPAMI 2018, arXiv 1603.09320; the hnswlib library) used as the
page former and searcher of IceCache's semantic paging (arXiv 2604.10539).

* **Space.** hnswlib space ``"l2"`` over keys lifted by the shared MIPS transform
  (`icecache.core.transform.transform_keys`, paper form, ``c`` = the largest key norm at the last (re)build;
  queries by `transform_queries`), so the graph's nearest neighbours of a query are the keys of largest
  ``q.k`` and key-key neighbourhoods are metric. (hnswlib's ``"ip"`` space would search raw keys directly,
  but inner product is not a metric: key-key neighbourhoods are dominated by long keys, which makes poor pages
  and a poorer graph; hence l2 on transformed vectors.) A later key longer than ``(1 + norm_tolerance) c``
  triggers a rebuild of the graph with the new maximum (pages are kept); a smaller overshoot is clamped by
  the transform (no NaN).
* **Pages (build).** Every key's ``neighbours`` nearest keys are found with the graph. Nodes are visited as
  seeds in order of increasing distance to their ``page_size - 1``-th neighbour (dense regions first); an
  unassigned seed opens a page and fills it with its nearest unassigned neighbours, then with those of the
  page's members (a breadth-first walk over the neighbour lists), up to ``page_size`` tokens. Pages that stay
  below half full are dissolved: their tokens join the page of their nearest neighbour that is at least half
  full and has room; the rest (the graph's outliers) are paged among themselves by the balanced recursive
  split of `icecache.indexes.page_split.balanced_pages`.
* **Insert.** The new key's nearest already-indexed neighbour (graph search, beam ``ef_construction``) gives
  the page; a full page is split in two near-equal compact halves (`icecache.indexes.page_split.split_scores` over its
  ``page_size`` tokens plus the new one, via `PageTable.split`), the new token joining its half. Then the key
  is added to the graph.
* **Selection** for a GQA group ``q`` ``[g, d]``: every head searches the graph for its
  ``k = ceil(search_factor * budget)`` nearest transformed keys (``ef = max(ef, k)``); the union of the found
  tokens is scored exactly, ``max_g q_g . k``; a page's score is its best found token; pages are returned best
  first (ties: lower id). When ``k`` reaches the number of tokens the search is exhaustive (every token is
  scored, no graph), so a budget covering every token selects every page. Measured (``experiments/bench_index/README.md``):
  at 8k tokens the default ``ef`` is saturated; at 64k the search for transformed queries (which lie far from
  the transformed keys) misses the heaviest tokens unless ``ef`` is in the thousands.

Determinism: hnswlib's insertion with more than one thread is not deterministic (the graph depends on the
interleaving), so the graph is built with ``num_threads=1`` by default (the level draws use
``random_seed=seed``); searches are deterministic. ``num_threads > 1`` speeds up the build at the cost of
run-to-run differences (documented, not hidden).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from icecache.core.capacity import grown_capacity
from icecache.core.errors import InputError
from icecache.core.pager import SemanticPager
from icecache.core.transform import transform_keys, transform_queries
from icecache.indexes.checks import check_float, check_int
from icecache.indexes.page_split import SplitRule, balanced_pages, split_scores
from icecache.indexes.registry import register_pager


@register_pager("hnsw")
class HNSWPager(SemanticPager):
    """Semantic pages from HNSW graph neighbourhoods over MIPS-transformed keys (see the module docstring).

    Parameters
    ----------
    head_dim : int
        Key/query width d.
    page_size : int
        Page capacity P in tokens.
    seed : int
        hnswlib ``random_seed`` (level draws of the graph).
    record_moves : bool
        Journal page layout changes in ``self.table`` for a host store.
    M : int
        hnswlib graph degree (default 16).
    ef_construction : int
        hnswlib construction beam, also the beam of the build-time neighbour search that forms pages
        (default 64).
    ef : int
        Query beam; the search uses ``max(ef, k)`` (default 64).
    search_factor : float
        Tokens searched per query head, as a multiple of the budget: ``k = ceil(search_factor * budget)``
        (default 1.0; at least 1.0 so the found tokens' pages can fill the budget).
    neighbours : int, optional
        Neighbours per key used to form pages at build (default ``2 * page_size``).
    split : {"2means", "pca"}
        How a full page is split on insert (default "2means").
    norm_tolerance : float
        Rebuild the graph when an inserted key is longer than ``(1 + norm_tolerance) c`` (default 0.05).
    num_threads : int
        hnswlib threads for the build (default 1: deterministic; > 1 is faster but not reproducible).

    Notes
    -----
    `index_bytes` counts hnswlib's index (graph links plus its own copy of the transformed keys, as reported by
    ``index_file_size``) and the page table; not the raw keys the pager scores with (the KV itself). Attribute
    ``num_rebuilds`` counts graph rebuilds after norm drift.
    """

    def __init__(
        self,
        head_dim: int,
        page_size: int = 16,
        seed: int = 0,
        *,
        record_moves: bool = False,
        M: int = 16,
        ef_construction: int = 64,
        ef: int = 64,
        search_factor: float = 1.0,
        neighbours: int | None = None,
        split: SplitRule = "2means",
        norm_tolerance: float = 0.05,
        num_threads: int = 1,
    ) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        check_int("M", M, 2)
        check_int("ef_construction", ef_construction, 1)
        check_int("ef", ef, 1)
        check_float("search_factor", search_factor, 1.0)
        check_int("neighbours", neighbours, 1, allow_none=True)
        check_float("norm_tolerance", norm_tolerance, 0.0)
        check_int("num_threads", num_threads, 1)
        if split not in ("2means", "pca"):
            raise InputError(f"split must be '2means' or 'pca', got {split!r}")
        self.M, self.ef_construction, self.ef, self.search_factor = M, ef_construction, ef, float(search_factor)
        self.neighbours = 2 * page_size if neighbours is None else neighbours
        self.split, self.norm_tolerance, self.num_threads = split, float(norm_tolerance), num_threads
        self.num_rebuilds = 0
        self._reset()

    def _reset(self) -> None:
        self._buf = np.zeros((0, self.head_dim), dtype=np.float32)  # capacity-doubling raw keys
        self._max_norm = 1.0
        self._index = None  # hnswlib.Index over the transformed keys, labels = positions

    # ------------------------------------------------------------------ graph
    def _transform(self, x: np.ndarray) -> np.ndarray:
        """``transform_keys`` (paper form) with the current ``c`` (``_max_norm``): ``[m, d]`` -> ``[m, d + 1]`` float32."""
        return transform_keys(torch.from_numpy(x), self._max_norm, form="paper").numpy()

    def _new_graph(self, tx: np.ndarray) -> None:
        """A fresh hnswlib index holding ``tx`` ``[n, d + 1]`` with labels ``0..n-1``."""
        import hnswlib

        n = tx.shape[0]
        index = hnswlib.Index(space="l2", dim=self.head_dim + 1)
        index.init_index(max_elements=max(64, n), ef_construction=self.ef_construction, M=self.M,
                         random_seed=int(self.seed % (2**31 - 1)))
        index.set_num_threads(self.num_threads)
        if n:
            index.add_items(tx, np.arange(n), num_threads=self.num_threads)
        self._index = index

    def _add(self, t: np.ndarray, pos: int) -> None:
        index = self._index
        if index.element_count >= index.max_elements:
            index.resize_index(2 * index.max_elements)
        index.add_items(t[None], np.array([pos]), num_threads=1)

    def _knn(self, tq: np.ndarray, k: int, ef: int) -> np.ndarray:
        """Labels ``[m, k]`` of the graph's ``k`` nearest keys (nearest first) of each row of ``tq``
        ``[m, d + 1]``, searched with beam ``max(ef, k)``; ``k`` <= indexed tokens.

        hnswlib raises when it finds fewer than ``k`` (a part of the graph it cannot reach); such rows are
        answered by brute force over the stored transformed keys instead (never seen in our tests).
        """
        index = self._index
        index.set_ef(max(ef, k))
        try:
            return index.knn_query(tq, k=k, num_threads=1)[0].astype(np.int64)
        except RuntimeError:
            pass
        out = np.empty((tq.shape[0], k), dtype=np.int64)
        data = None
        for i in range(tq.shape[0]):
            try:
                out[i] = index.knn_query(tq[i : i + 1], k=k, num_threads=1)[0][0]
            except RuntimeError:
                if data is None:
                    ids = np.asarray(index.get_ids_list(), dtype=np.int64)
                    data = (ids, np.asarray(index.get_items(ids), dtype=np.float32))
                d2 = ((data[1] - tq[i]) ** 2).sum(1)
                out[i] = data[0][np.lexsort((data[0], d2))[:k]]
        return out

    # ------------------------------------------------------------------ build / insert
    def _build(self, keys: torch.Tensor) -> None:
        self._reset()
        x = keys.numpy()
        n = x.shape[0]
        self._store(x, 0)
        self._max_norm = math.sqrt(float(np.einsum("ij,ij->i", x, x).max())) if n else 1.0
        self._max_norm = self._max_norm or 1.0
        tx = self._transform(x)
        self._new_graph(tx)
        if n:
            self.table.new_pages(self._form_pages(tx))

    def _form_pages(self, tx: np.ndarray) -> list[np.ndarray]:
        """Group ``0..n-1`` into pages of <= P graph neighbours (see the module docstring)."""
        n, P = tx.shape[0], self.page_size
        k = min(n, self.neighbours + 1)
        nb = self._knn(tx, k, self.ef_construction)
        # Seeds in order of increasing distance to their (P - 1)-th neighbour: dense regions first.
        kth = min(P - 1, k - 1)
        radius = ((tx - tx[nb[:, kth]]) ** 2).sum(1)
        seeds = np.lexsort((np.arange(n), radius))
        page = np.full(n, -1, dtype=np.int64)
        groups: list[list[int]] = []
        nbl = nb.tolist()
        for s in seeds.tolist():
            if page[s] >= 0:
                continue
            gid = len(groups)
            members = [s]
            page[s] = gid
            i = 0
            while i < len(members) and len(members) < P:
                for v in nbl[members[i]]:
                    if page[v] < 0:
                        page[v] = gid
                        members.append(v)
                        if len(members) == P:
                            break
                i += 1
            groups.append(members)
        # Pages below half full are dissolved: each of their tokens joins the page of its nearest neighbour
        # that is at least half full and has room; the tokens left over are paged among themselves by the
        # balanced recursive split (they are the graph's outliers), so no small fragments remain.
        small = max(1, P // 2)
        sizes = np.array([len(g) for g in groups])
        leftover: list[int] = []
        for gid in np.flatnonzero(sizes < small).tolist():
            for v in groups[gid]:
                for u in nbl[v]:
                    h = int(page[u])
                    if sizes[h] >= small and sizes[h] < P:
                        groups[h].append(v)
                        sizes[h] += 1
                        page[v] = h
                        break
                else:
                    leftover.append(v)
            groups[gid] = []
        out = [np.asarray(g, dtype=np.int64) for g in groups if g]
        if leftover:
            rest = np.sort(np.asarray(leftover, dtype=np.int64))
            out += balanced_pages(tx[rest], rest, P, self.split)
        return out

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        x = keys.numpy()
        self._store(x, start)
        if self._index is None:  # insert without a build: start from an empty graph
            self._new_graph(np.zeros((0, self.head_dim + 1), dtype=np.float32))
        sq = float(np.einsum("ij,ij->i", x, x).max())
        if sq > (self._max_norm * (1.0 + self.norm_tolerance)) ** 2:  # norm drift: re-key the graph (pages kept)
            n_old = start
            self._max_norm = math.sqrt(sq)
            self._new_graph(self._transform(self._buf[:n_old]))
            self.num_rebuilds += 1
        tx = self._transform(x)
        for i in range(x.shape[0]):
            self._place(start + i, tx[i])
            self._add(tx[i], start + i)

    def _store(self, x: np.ndarray, start: int) -> None:
        n = start + x.shape[0]
        if n > self._buf.shape[0]:
            grown = np.empty((grown_capacity(n, self._buf.shape[0]), self.head_dim), dtype=np.float32)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:n] = x

    def _place(self, pos: int, t: np.ndarray) -> None:
        """Page a new position (transformed key ``t`` ``[d + 1]``) with its nearest indexed neighbour."""
        tb = self.table
        P = self.page_size
        if self._index.element_count == 0:
            tb.new_page((pos,))
            return
        nb = self._knn(t[None], 1, self.ef_construction)
        page = int(tb.page_of_[int(nb[0, 0])])
        size = int(tb.sizes_[page])
        if size < P:
            tb.append(page, pos)
            return
        if P == 1:
            tb.new_page((pos,))
            return
        mem = tb.members[page, :P]
        pts = np.concatenate([self._transform(self._buf[mem]), t[None]], axis=0)  # row P is the new token
        order = np.argsort(split_scores(pts, self.split), kind="stable")
        half = (P + 2) // 2
        a, b = order[:half], order[half:]
        mine = a if P in a else b
        mine_old = mine[mine != P]
        if len(mine_old) == 0:
            tb.new_page((pos,))
            return
        tb.append(tb.split(page, mine_old), pos)

    # ------------------------------------------------------------------ selection
    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        q = queries.numpy()
        n = len(self)
        k = min(n, math.ceil(self.search_factor * budget))
        tb = self.table
        if k < n:
            found = np.unique(self._knn(transform_queries(queries).numpy(), k, self.ef))
        else:  # exhaustive: every token
            found = np.arange(n, dtype=np.int64)
        s = (self._buf[found] @ q.T).max(1)  # [m]: max over the group of q.k
        pg = tb.page_of_[found]
        order = np.lexsort((-s, pg))  # by page, best token first
        pg, s = pg[order], s[order]
        first = np.flatnonzero(np.r_[True, pg[1:] != pg[:-1]])
        ids, best = pg[first], s[first]
        rank = np.lexsort((ids, -best))[:budget]
        return ids[rank], best[rank].astype(np.float32)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (tests): the page table's own invariants, every
        position ``0..n-1`` paged, and the graph holding exactly positions ``0..n-1``."""
        tb = self.table
        tb.check()
        n = len(self)
        assert tb.num_positions == n and bool((tb.page_of_[:n] >= 0).all()), "not every position is paged"
        if self._index is not None:
            assert self._index.element_count == n, "graph size differs from the number of tokens"
            assert sorted(self._index.get_ids_list()) == list(range(n)), "graph labels are not 0..n-1"

    # ------------------------------------------------------------------ memory
    def index_bytes(self) -> int:
        """Bytes of the hnswlib index (links and its transformed-key copy) and the page table."""
        tb = self.table
        b = int(self._index.index_file_size()) if self._index is not None else 0
        b += tb.id_capacity * (tb.page_size + 1) * 8 + len(self) * 2 * 8
        return int(b)


__all__ = ["HNSWPager"]
