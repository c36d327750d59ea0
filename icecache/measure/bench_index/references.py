"""Quality references of the index benchmark: the oracle page ranking and capacity-constrained k-means pages."""

from __future__ import annotations

import math

import numpy as np
import torch

from icecache.core.pager import take_within_budget
from icecache.core.pages import PageTable

__all__ = ["oracle_rank", "kmeans_groups", "KMeansPages"]


def oracle_rank(table: PageTable, scores: torch.Tensor, budget: int) -> np.ndarray:
    """Live pages of ``table`` ranked by their best token score (``scores`` ``[n]`` per position, higher is
    better; ties by page id), under the budget rule. Returns the selected positions (int64)."""
    n = scores.numel()
    page_of = torch.from_numpy(table.page_of_[:n])
    best = torch.full((table.id_capacity,), -math.inf, dtype=torch.float64)
    best.scatter_reduce_(0, page_of, scores.double(), reduce="amax")
    ids = table.page_ids()
    order = ids[np.lexsort((ids, -best[ids].numpy()))]
    j = take_within_budget(table.sizes(order), budget)
    _, pos = table.csr(order[:j])
    return pos


def kmeans_groups(x: torch.Tensor, k: int, cap: int, seed: int, iters: int = 10, balanced_iters: int = 3,
                  chunk_rows: int | None = None) -> list[np.ndarray]:
    """Capacity-constrained k-means: ``k`` groups of at most ``cap`` rows of ``x`` ``[n, d]`` (needs
    ``k * cap >= n``; L2 on raw keys; seeded).

    ``iters`` Lloyd steps from ``k`` seeded sample points, then ``balanced_iters`` rounds of a greedy capped
    assignment (point-centroid pairs among each point's 8 nearest centroids, taken in increasing distance
    while the centroid has room; leftovers go to the nearest centroid with room) followed by a centroid
    update. Empty groups are dropped, so at most ``k`` groups come back. Distances are computed
    ``chunk_rows`` points at a time (default: 64M distances, 256 MiB, per chunk), so 128k+ points fit.
    """
    n = x.shape[0]
    k = max(1, min(k, n))
    if k * cap < n:
        raise ValueError(f"k * cap = {k * cap} < n = {n}: cannot cap {n} points in {k} groups of {cap}")
    gen = torch.Generator().manual_seed(seed)
    c = x[torch.randperm(n, generator=gen)[:k]].clone()

    rows = chunk_rows or max(1, (1 << 26) // max(1, k))  # distance rows per chunk

    def chunks() -> list[slice]:
        return [slice(i, min(n, i + rows)) for i in range(0, n, rows)]

    def dist(c: torch.Tensor, sl: slice) -> torch.Tensor:
        return (c * c).sum(1)[None, :] - 2.0 * (x[sl] @ c.T)  # [rows, k], |x|^2 dropped

    def update(assign: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        cnt = torch.bincount(assign, minlength=k).to(x.dtype)
        ok = cnt > 0
        c = c.clone()
        c[ok] = sums[ok] / cnt[ok, None]
        return c

    for _ in range(iters):
        c = update(torch.cat([torch.argmin(dist(c, sl), dim=1) for sl in chunks()]), c)
    assign = torch.zeros(n, dtype=torch.int64)
    r = min(8, k)
    for _ in range(max(1, balanced_iters)):
        near = [torch.topk(dist(c, sl), r, dim=1, largest=False) for sl in chunks()]
        dv = torch.cat([t.values for t in near])
        di = torch.cat([t.indices for t in near])
        order = torch.argsort(dv.reshape(-1), stable=True).numpy()
        pts = np.repeat(np.arange(n), r)[order]
        cen = di.reshape(-1).numpy()[order]
        room = np.full(k, cap, np.int64)
        a = np.full(n, -1, np.int64)
        for p_, c_ in zip(pts.tolist(), cen.tolist()):
            if a[p_] < 0 and room[c_] > 0:
                a[p_] = c_
                room[c_] -= 1
        left = np.flatnonzero(a < 0)
        for i0 in range(0, len(left), rows):
            part = left[i0 : i0 + rows]
            Dl = ((c * c).sum(1)[None, :] - 2.0 * (x[torch.from_numpy(part)] @ c.T)).numpy()
            for i, p_ in enumerate(part.tolist()):
                for c_ in np.argsort(Dl[i], kind="stable").tolist():
                    if room[c_] > 0:
                        a[p_] = c_
                        room[c_] -= 1
                        break
        assign = torch.from_numpy(a)
        c = update(assign, c)
    order_t = torch.argsort(assign, stable=True)
    counts = torch.bincount(assign, minlength=k).tolist()
    groups, start = [], 0
    for cnt_i in counts:
        if cnt_i:
            groups.append(order_t[start : start + cnt_i].numpy())
        start += cnt_i
    return groups


class KMeansPages:
    """The k-means quality reference: pages = capacity-constrained k-means clusters of the keys (as many as
    asked for, each <= page size), ranked by their exact best token. An inserted key joins the page of its
    nearest centroid when that page has room, else opens a page of its own."""

    def __init__(self, page_size: int, seed: int = 0) -> None:
        self.page_size, self.seed = page_size, seed
        self.table = PageTable(page_size)
        self.keys = torch.zeros(0, 0)

    def build(self, keys: torch.Tensor, num_pages: int) -> None:
        """Cluster ``keys`` ``[n, d]`` into ``max(num_pages, ceil(n / P))`` capped groups (empty ones dropped)."""
        self.keys = keys.clone()
        k = max(num_pages, -(-keys.shape[0] // self.page_size))
        groups = kmeans_groups(keys, k, self.page_size, self.seed) if keys.shape[0] else []
        self.table.clear()
        self.table.new_pages(groups)
        self.page_ids = np.asarray(self.table.page_ids())
        self.centroids = torch.stack([keys[torch.from_numpy(g)].mean(0) for g in groups]) if groups else torch.zeros(0, keys.shape[1])

    def insert(self, key: torch.Tensor) -> None:
        pos = self.keys.shape[0]
        self.keys = torch.cat([self.keys, key[None]])
        if len(self.centroids):
            j = int(torch.argmin(((self.centroids - key) ** 2).sum(1)))
            page = int(self.page_ids[j])
            if self.table.size(page) < self.page_size:
                self.table.append(page, pos)
                return
        self.table.new_page([pos])

    def select(self, queries: torch.Tensor, budget: int) -> np.ndarray:
        return oracle_rank(self.table, (queries @ self.keys.T).amax(0), budget)
