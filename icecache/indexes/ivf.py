"""``ivf``: semantic pages from an inverted-file (IVF) index: faiss k-means lists over MIPS-transformed keys.

Based on the IVF family (Jegou et al., "Product quantization for nearest neighbor search", TPAMI 2011;
faiss, Douze et al., arXiv 2401.08281) used as the page former of IceCache's semantic paging (arXiv
2604.10539): the lists of a coarse quantizer are the clusters, and each list is stored in pages.

Layout (one pager per layer and KV head)::

    keys [n, d] --transform_keys(c)--> unit vectors [n, d + 1] --faiss k-means--> nlist centroids
    list l = the keys whose nearest centroid is l  ->  pages of <= page_size tokens (recursive split)

* **MIPS.** Keys are lifted with the shared transform (`icecache.core.transform.transform_keys`, paper form,
  ``c`` = the largest key norm at the last (re)training), queries with `transform_queries`; the L2 nearest
  transformed key is then the key of largest ``q.k`` (docs/index.md, MIPS to L2 transform). A later key longer
  than ``c`` is clamped by the transform (no NaN) and, when it exceeds ``c`` by more than ``norm_tolerance``,
  triggers a retraining that re-keys everything with the new maximum.
* **Pages.** A list of ``m`` tokens becomes ``ceil(m / P)`` pages of near-equal size by a recursive balanced
  split of its transformed keys (``split="2means"``: a deterministic 2-means, then a cut in the order of the
  2-means score; ``split="pca"``: a cut along the principal direction), so tokens of one page are close.
* **Selection** for a GQA group ``q`` ``[g, d]``: every head ranks the lists by the L2 distance between its
  transformed query and the centroids; a list's group rank is its best rank over the heads (probing the first
  ``r`` lists of the group order probes the union of every head's ``r`` nearest lists; ``probe_rule="nearest"``
  ranks by the group's smallest distance instead); the best lists are probed, at least
  ``nprobe`` of them and until they hold ``probe_factor * budget`` tokens (so a budget that covers every token
  probes every list and selects every page). Every token of a probed list is scored exactly,
  ``max_g q_g . k``; a page's score is its best token; pages are returned best first (ties: lower id) and
  the base class applies the budget rule.
* **Insert.** A new key goes to its nearest centroid's list and there to the page with the nearest mean
  (transformed space); a full page is split in two by the same balanced 2-way split over its ``P`` tokens plus
  the new one (`PageTable.split` moves the slots of one side), the new token joining its side.
* **Retraining** (re-clustering every key and re-paging through `PageTable.move` / `split`, so a host store can
  replay the journal) happens when the tokens inserted since the last training exceed ``retrain_fraction``
  times the number trained on (a geometric schedule: amortised O(1) re-paging per token), when a key is
  longer than ``(1 + norm_tolerance) c``, and on the first insert into an empty pager.

Determinism: faiss k-means runs with ``num_threads`` OpenMP threads (set for the call and restored; the
setting is per calling thread) from a seeded initialisation; every other step is single-threaded numpy with
stable sorts. Identical results for 1 and 2 threads are checked by a test. GPU: when CUDA is available and
the faiss build has GPU support (``faiss.StandardGpuResources``; not the ``faiss-cpu`` wheel), k-means
training runs on the GPU (``use_gpu=None`` means automatic). The per-step probe is a ``[g, nlist]`` product and
stays on the CPU. The GPU path could not be tested where this was written (faiss-cpu only).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch

from icecache.core.capacity import grown_capacity
from icecache.core.errors import InputError
from icecache.core.pager import SemanticPager
from icecache.core.transform import transform_keys
from icecache.indexes.checks import check_float, check_int
from icecache.indexes.page_split import SplitRule, balanced_pages, split_scores
from icecache.indexes.registry import register_pager

ProbeRule = Literal["union", "nearest"]


def faiss_gpu_available() -> bool:
    """True when the installed faiss has GPU support and a CUDA device is visible."""
    try:
        import faiss
    except ImportError:  # pragma: no cover - faiss is a dependency of this backend
        return False
    if not hasattr(faiss, "StandardGpuResources"):
        return False
    try:  # pragma: no cover - needs a GPU build of faiss
        return bool(torch.cuda.is_available() and faiss.get_num_gpus() > 0)
    except Exception:  # pragma: no cover
        return False


@contextlib.contextmanager
def faiss_threads(num_threads: int) -> Iterator[None]:
    """Run faiss with ``num_threads`` OpenMP threads inside the block (per calling thread), then restore."""
    import faiss

    old = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(int(num_threads))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(old)


# ---------------------------------------------------------------------------------------------- pager
@register_pager("ivf")
class IVFPager(SemanticPager):
    """Semantic pages from faiss k-means (IVF) lists over MIPS-transformed keys (see the module docstring).

    Parameters
    ----------
    head_dim : int
        Key/query width d.
    page_size : int
        Page capacity P in tokens.
    seed : int
        Seed of the faiss k-means seeding (and of its subsampling when n > 256 * nlist).
    record_moves : bool
        Journal page layout changes in ``self.table`` for a host store.
    nlist : int, optional
        Number of lists (k-means centroids). Default ``None``: ``ceil(n / tokens_per_list)`` at every
        (re)training, ``n`` the tokens indexed then. Always capped at ``n``.
    tokens_per_list : int
        Average list length aimed at when ``nlist`` is None (default 64; four pages of 16).
    nprobe : int
        Fewest lists probed per selection (default 4). ``nprobe >= nlist`` probes every list, which makes
        the page ranking exact (pages by their best ``max_g q_g . k``).
    probe_factor : float
        Lists are probed, best first, until they hold at least ``probe_factor * budget`` tokens (default 8.0,
        at least 1.0, so a budget covering every token probes every list), on top of the ``nprobe`` minimum.
    split : {"2means", "pca"}
        How lists longer than P are cut into pages, and full pages split on insert (default "2means").
    probe_rule : {"union", "nearest"}
        Group order of the lists: "union" (default) ranks a list by its best per-head rank (the first ``r``
        lists are the union of every head's ``r`` nearest); "nearest" by the group's smallest distance.
    train : int
        k-means iterations (default 10). The centroids are seeded by AFK-MC2 (faiss
        ``ClusteringInitMethod_AFK_MC2``, an MCMC approximation of k-means++ seeding at the cost of random
        seeding), which avoids merged clusters that random seeding leaves (see the tests).
    retrain_fraction : float or None
        Retrain when the tokens inserted since the last training exceed this fraction of the tokens trained
        on (default 0.5). None: never for this reason.
    norm_tolerance : float
        Retrain when an inserted key is longer than ``(1 + norm_tolerance) c`` (default 0.05; ``c`` = the
        largest key norm at the last training; shorter overshoots are clamped by the transform).
    num_threads : int
        OpenMP threads of faiss k-means (default 1; results do not depend on it).
    use_gpu : bool or None
        Train k-means with faiss on the GPU: None (default) = when available, True = required (raises
        `InputError` if unavailable), False = never.

    Notes
    -----
    `index_bytes` counts centroids, list sizes, per-page list ids and key sums, and the page table; not the copy of
    the keys the pager scores with (that is the KV itself), as for ``mdci``. Attribute ``num_trainings``
    counts (re)trainings.
    """

    def __init__(
        self,
        head_dim: int,
        page_size: int = 16,
        seed: int = 0,
        *,
        record_moves: bool = False,
        nlist: int | None = None,
        tokens_per_list: int = 64,
        nprobe: int = 4,
        probe_factor: float = 8.0,
        split: SplitRule = "2means",
        probe_rule: ProbeRule = "union",
        train_iters: int = 10,
        retrain_fraction: float | None = 0.5,
        norm_tolerance: float = 0.05,
        num_threads: int = 1,
        use_gpu: bool | None = None,
    ) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        check_int("nlist", nlist, 1, allow_none=True)
        check_int("tokens_per_list", tokens_per_list, 1)
        check_int("nprobe", nprobe, 1)
        check_float("probe_factor", probe_factor, 1.0)
        check_int("train_iters", train_iters, 1)
        check_float("retrain_fraction", retrain_fraction, 0.0, allow_none=True, lo_open=True)
        check_float("norm_tolerance", norm_tolerance, 0.0)
        check_int("num_threads", num_threads, 1)
        if split not in ("2means", "pca"):
            raise InputError(f"split must be '2means' or 'pca', got {split!r}")
        if probe_rule not in ("union", "nearest"):
            raise InputError(f"probe_rule must be 'union' or 'nearest', got {probe_rule!r}")
        if use_gpu is not None and not isinstance(use_gpu, bool):
            raise InputError(f"use_gpu must be True, False or None, got {use_gpu!r}")
        if use_gpu and not faiss_gpu_available():
            raise InputError("use_gpu=True needs CUDA and a GPU build of faiss (the faiss-cpu wheel has none)")
        self.nlist, self.tokens_per_list = nlist, tokens_per_list
        self.nprobe, self.probe_factor = nprobe, float(probe_factor)
        self.split, self.probe_rule, self.train_iters, self.num_threads = split, probe_rule, train_iters, num_threads
        self.retrain_fraction = None if retrain_fraction is None else float(retrain_fraction)
        self.norm_tolerance = float(norm_tolerance)
        self.use_gpu = faiss_gpu_available() if use_gpu is None else use_gpu
        self.num_trainings = 0
        self._reset()

    def _reset(self) -> None:
        self._buf = np.zeros((0, self.head_dim), dtype=np.float32)  # capacity-doubling keys; rows [0, n) live
        self._max_norm = 1.0  # transform scale: largest key norm at the last training
        self._centroids = np.zeros((0, self.head_dim + 1), dtype=np.float32)  # [nlist, d + 1]
        self._cq = np.zeros((0, self.head_dim), dtype=np.float32)  # centroids' first d coordinates, [nlist, d]
        self._csq = np.zeros(0, dtype=np.float32)  # squared centroid norms [nlist]
        self._list_size = np.zeros(0, dtype=np.int64)  # tokens per list [nlist]
        self._list_of_page = np.zeros(0, dtype=np.int64)  # list id per page id, -1 for free ids
        self._page_sum = np.zeros((0, self.head_dim + 1))  # float64 sum of the transformed keys per page id
        self._trained_n = 0
        self._since_train = 0

    # ------------------------------------------------------------------ properties
    @property
    def num_lists(self) -> int:
        """Current number of lists (k-means centroids)."""
        return int(self._centroids.shape[0])

    @property
    def centroids(self) -> np.ndarray:
        """Centroids in the transformed space, ``[num_lists, d + 1]`` float32 (read-only view)."""
        v = self._centroids.view()
        v.flags.writeable = False
        return v

    def list_of_page(self, page_id: int) -> int:
        """The list (cluster) id of a live page."""
        self.table.size(page_id)  # raises KeyError for a dead id
        return int(self._list_of_page[page_id])

    # ------------------------------------------------------------------ build / insert
    def _build(self, keys: torch.Tensor) -> None:
        self._reset()
        n = keys.shape[0]
        self._store(keys.numpy(), 0)
        if n:
            self._retrain(n, first_new=0)

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        x = keys.numpy()
        m = x.shape[0]
        self._store(x, start)
        n = start + m
        sq = float(np.einsum("ij,ij->i", x, x).max())
        if (
            self.num_lists == 0
            or sq > (self._max_norm * (1.0 + self.norm_tolerance)) ** 2
            or (self.retrain_fraction is not None and self._since_train + m > self.retrain_fraction * self._trained_n)
        ):
            self._retrain(n, first_new=start)
            return
        tx = self._transform(x)
        lists = self._assign(tx)
        for i in range(m):
            self._place(start + i, tx[i], int(lists[i]))
        self._since_train += m

    def _store(self, x: np.ndarray, start: int) -> None:
        n = start + x.shape[0]
        if n > self._buf.shape[0]:
            grown = np.empty((grown_capacity(n, self._buf.shape[0]), self.head_dim), dtype=np.float32)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:n] = x

    def _transform(self, x: np.ndarray) -> np.ndarray:
        """``transform_keys`` (paper form) with the current ``c``: ``[m, d]`` -> ``[m, d + 1]`` float32."""
        return transform_keys(torch.from_numpy(x), self._max_norm, form="paper").numpy()

    def _assign(self, tx: np.ndarray) -> np.ndarray:
        """Nearest centroid (L2, transformed space) of each row of ``tx`` ``[m, d + 1]``; ties: lower id."""
        dist = self._csq[None, :] - 2.0 * (tx @ self._centroids.T)  # |tx|^2 is the same for every list
        return np.argmin(dist, axis=1)

    def _kmeans(self, tx: np.ndarray, k: int) -> np.ndarray:
        """faiss k-means of ``tx`` ``[n, d + 1]`` into ``k`` centroids ``[k, d + 1]`` (k <= n)."""
        if k == 1:
            return tx.mean(0, keepdims=True).astype(np.float32)
        import faiss

        km = faiss.Kmeans(
            tx.shape[1], k, niter=self.train_iters, seed=int(self.seed % (2**31 - 1)), verbose=False,
            min_points_per_centroid=1, max_points_per_centroid=256, gpu=bool(self.use_gpu),
            init_method=faiss.ClusteringInitMethod_AFK_MC2,  # k-means++-like seeding, at random-init cost
        )
        with faiss_threads(self.num_threads):
            km.train(np.ascontiguousarray(tx, dtype=np.float32))
        return np.ascontiguousarray(km.centroids, dtype=np.float32)

    def _retrain(self, n: int, first_new: int) -> None:
        """Re-cluster keys ``0..n-1`` and re-page them; positions ``>= first_new`` are not paged yet."""
        x = self._buf[:n]
        self._max_norm = math.sqrt(float(np.einsum("ij,ij->i", x, x).max())) or 1.0
        tx = self._transform(x)
        k = min(self.nlist if self.nlist is not None else -(-n // self.tokens_per_list), n)
        self._centroids = self._kmeans(tx, k)
        self._cq = np.ascontiguousarray(self._centroids[:, : self.head_dim])
        self._csq = np.einsum("ij,ij->i", self._centroids, self._centroids).astype(np.float32)
        assign = self._assign(tx)
        self._list_size = np.bincount(assign, minlength=k).astype(np.int64)
        order = np.argsort(assign, kind="stable")
        groups: list[np.ndarray] = []
        group_list: list[int] = []
        start = 0
        for lst, cnt in enumerate(self._list_size.tolist()):
            if cnt:
                idx = order[start : start + cnt]
                pages = balanced_pages(tx[idx], idx.astype(np.int64), self.page_size, self.split)
                groups += pages
                group_list += [lst] * len(pages)
            start += cnt
        ids = self._relayout(groups, first_new)
        self._list_of_page = np.full(self.table.id_capacity, -1, dtype=np.int64)
        self._list_of_page[ids] = np.asarray(group_list, dtype=np.int64)
        self._page_sum = np.zeros((self.table.id_capacity, self.head_dim + 1))
        np.add.at(self._page_sum, self.table.page_of_[:n], tx.astype(np.float64))
        self._trained_n, self._since_train = n, 0
        self.num_trainings += 1

    def _relayout(self, groups: list[np.ndarray], first_new: int) -> np.ndarray:
        """Make the page table hold exactly ``groups`` (one page each), only through `PageTable` methods.

        Positions ``< first_new`` are paged and move (at most once each, plus the table's hole-filling moves);
        positions ``>= first_new`` are new and are appended. Returns the page id of each group.
        """
        tb = self.table
        if tb.num_positions == 0:  # nothing paged yet: one bulk load
            return tb.new_pages(groups) if groups else np.zeros(0, dtype=np.int64)
        ids = np.empty(len(groups), dtype=np.int64)
        for gi, g in enumerate(groups):
            old = g[g < first_new]
            new = g[g >= first_new]
            if len(old) == 0:
                ids[gi] = tb.new_page(new)
                continue
            anchor = int(old[0])
            src = int(tb.page_of_[anchor])
            if tb.size(src) == len(old) and bool((tb.page_of_[old] == src).all()):
                page = src  # this page already holds exactly the group's old positions
            elif tb.size(src) == 1:
                page = src
            else:
                page = tb.split(src, [int(tb.slot_of_[anchor])])
            for p in old[1:]:
                if tb.page_of_[p] != page:
                    tb.move(int(p), page)
            for p in new:
                tb.append(page, int(p))
            ids[gi] = page
        return ids

    def _place(self, pos: int, t: np.ndarray, lst: int) -> None:
        """Page a new position ``pos`` (transformed key ``t`` ``[d + 1]``) in list ``lst``: the list's page
        with the nearest mean (transformed space), split first when full."""
        tb = self.table
        P = self.page_size
        self._list_size[lst] += 1
        pages = np.flatnonzero(self._list_of_page[: tb.id_capacity] == lst)
        if len(pages) == 0:
            self._new_page(pos, t, lst)
            return
        means = self._page_sum[pages] / tb.sizes_[pages][:, None]
        page = int(pages[int(np.argmin(((means - t) ** 2).sum(1)))])
        if int(tb.sizes_[page]) < P:
            tb.append(page, pos)
            self._page_sum[page] += t
            return
        if P == 1:
            self._new_page(pos, t, lst)
            return
        # Full page: cut its P tokens plus the new one into two near-equal compact halves.
        tk = self._transform(self._buf[tb.members[page]])  # [P, d + 1], slot order
        pts = np.concatenate([tk, t[None]], axis=0)  # row P is the new token
        order = np.argsort(split_scores(pts, self.split), kind="stable")
        half = (P + 2) // 2
        a, b = order[:half], order[half:]
        mine = a if P in a else b
        mine_old = mine[mine != P]
        if len(mine_old) == 0:  # the new token is alone on its side
            self._new_page(pos, t, lst)
            return
        new_id = tb.split(page, mine_old)  # slots = row indices (rows 0..P-1 are slots 0..P-1)
        tb.append(new_id, pos)
        self._grow_page_arrays()
        self._list_of_page[new_id] = lst
        moved = np.zeros(P, dtype=bool)
        moved[mine_old] = True
        self._page_sum[page] = tk[~moved].sum(0, dtype=np.float64)
        self._page_sum[new_id] = tk[moved].sum(0, dtype=np.float64) + t

    def _new_page(self, pos: int, t: np.ndarray, lst: int) -> None:
        page = self.table.new_page((pos,))
        self._grow_page_arrays()
        self._list_of_page[page] = lst
        self._page_sum[page] = t

    def _grow_page_arrays(self) -> None:
        cap = self.table.id_capacity
        if cap > len(self._list_of_page):
            new_cap = grown_capacity(cap, len(self._list_of_page))
            lop = np.full(new_cap, -1, dtype=np.int64)
            lop[: len(self._list_of_page)] = self._list_of_page
            ps = np.zeros((new_cap, self.head_dim + 1))
            ps[: len(self._page_sum)] = self._page_sum
            self._list_of_page, self._page_sum = lop, ps

    # ------------------------------------------------------------------ selection
    def probe_order(self, queries: np.ndarray) -> np.ndarray:
        """Lists ranked for a GQA group ``queries`` ``[g, d]``, best first, ``[num_lists]`` int64.

        Each head ranks the lists by the L2 distance between ``transform_queries(q)`` and the centroid.
        ``probe_rule="union"``: a list's group rank is its best rank over the heads (so probing the first ``r``
        lists probes every head's ``r`` nearest lists), ties broken by the smallest distance, then by list
        id. ``"nearest"``: ascending smallest distance over the heads (ties: list id).
        """
        norms = np.sqrt(np.einsum("ij,ij->i", queries, queries))
        nonzero = norms > 0
        qn = queries / np.where(nonzero, norms, 1.0)[:, None]  # transform_queries: [q / |q|, 0]; zero -> zeros
        # |tq - c|^2 = |tq|^2 + |c|^2 - 2 tq.c, with |tq|^2 = 1 (0 for a zero query) and tq.c = qn . c[:d].
        dist = nonzero.astype(np.float32)[:, None] + self._csq[None, :] - 2.0 * (qn @ self._cq.T)  # [g, nlist]
        if dist.shape[0] == 1 or self.probe_rule == "nearest":
            return np.argsort(dist.min(0), kind="stable")
        per_head = np.argsort(dist, axis=1, kind="stable")
        rank = np.empty_like(per_head)
        np.put_along_axis(rank, per_head, np.arange(dist.shape[1])[None, :].repeat(dist.shape[0], 0), axis=1)
        return np.lexsort((np.arange(dist.shape[1]), dist.min(0), rank.min(0)))

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        q = queries.numpy()
        order = self.probe_order(q)
        need = self.probe_factor * budget
        covered = np.cumsum(self._list_size[order])
        num_probe = min(len(order), max(self.nprobe, int(np.searchsorted(covered, need, side="left")) + 1))
        probed = order[:num_probe]
        tb = self.table
        lop = self._list_of_page[: tb.id_capacity]
        mask = np.zeros(self.num_lists + 1, dtype=bool)  # slot -1 (free page ids) stays False
        mask[probed] = True
        ids = np.flatnonzero(mask[lop])
        mem = tb.members[ids]  # [k, P]
        s = (self._buf[mem.clip(0)] @ q.T).max(-1)  # [k, P]: max over the group of q.k
        s[mem < 0] = -np.inf
        best = s.max(1)
        rank = np.lexsort((ids, -best))[:budget]  # every page holds >= 1 token: at most `budget` can fit
        return ids[rank], best[rank].astype(np.float32)

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (tests; O(n d)): the page table's own invariants,
        every position ``0..n-1`` paged, every live page in a valid list, list sizes equal to the tokens of
        their pages, per-page key sums equal to the sums of the pages' transformed keys."""
        tb = self.table
        tb.check()
        n = len(self)
        assert tb.num_positions == n and bool((tb.page_of_[:n] >= 0).all()), "not every position is paged"
        ids = tb.page_ids()
        if n == 0:
            return
        lop = self._list_of_page[ids]
        assert bool(((lop >= 0) & (lop < self.num_lists)).all()), "a live page has no list"
        counts = np.bincount(lop, weights=tb.sizes(ids), minlength=self.num_lists)
        assert np.array_equal(counts.astype(np.int64), self._list_size), "list sizes disagree with the pages"
        tx = self._transform(self._buf[:n]).astype(np.float64)
        sums = np.zeros_like(self._page_sum)
        np.add.at(sums, tb.page_of_[:n], tx)
        assert np.allclose(sums[ids], self._page_sum[ids], atol=1e-4), "page key sums are stale"

    # ------------------------------------------------------------------ memory
    def index_bytes(self) -> int:
        """Bytes of centroids, list sizes, per-page list ids and key sums, and the page table (not the stored
        keys)."""
        tb = self.table
        b = self._centroids.nbytes + self._cq.nbytes + self._csq.nbytes + self._list_size.nbytes
        b += self._list_of_page.nbytes + self._page_sum.nbytes
        b += tb.id_capacity * (tb.page_size + 1) * 8 + len(self) * 2 * 8
        return int(b)


__all__ = ["IVFPager", "faiss_gpu_available", "faiss_threads"]
