"""``exact``: the oracle. Every middle token is its own page; selection is the exact top-B tokens by
q.k (max over the GQA group). Any approximate pager is measured against it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from numba import njit, prange

from icecache.core.capacity import grown_capacity
from icecache.core.half_keys import HalfKeys
from icecache.core.pager import SemanticPager
from icecache.indexes.registry import register_pager
from icecache.kernels.library import NativeKernels, native_kernels


@njit(nogil=True, cache=True)
def _kth_largest(scores: np.ndarray, k: int) -> np.float32:
    """The k-th largest of ``scores`` ``[n]`` (1 <= k < n). A strided sample of an eighth of the scores gives a
    threshold that, taken at 1.5x the sample's expected share of the top k (+16), is at or below the k-th score
    with high probability; only the scores at or above it are partitioned. When the estimate holds fewer than
    k (unlucky sample), the whole array is partitioned: the result is exact either way."""
    n = scores.shape[0]
    if n >= 4 * k and n >= 1024:
        sample = scores[::8].copy()
        m = sample.shape[0]
        rank = min(m, int(1.5 * k * m / n) + 16)
        cut = np.partition(sample, m - rank)[m - rank]
        count = 0
        for j in range(n):
            if scores[j] >= cut:
                count += 1
        if count >= k:
            cand = np.empty(count, np.float32)
            c = 0
            for j in range(n):
                if scores[j] >= cut:
                    cand[c] = scores[j]
                    c += 1
            return np.partition(cand, count - k)[count - k]
    return np.partition(scores, n - k)[n - k]


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, inline="always")
def group_scores_range(queries: np.ndarray, keys: np.ndarray, lo: int, hi: int, scores: np.ndarray) -> None:
    """``scores[j] = max_g q_g . keys[j]`` for ``j`` in ``[lo, hi)``: one read of each key row for the group.
    Inlined into every scan (the exact scorer's, `icecache.indexes.page_scan`'s), so a key's score is the same
    float whatever the thread count."""
    g, d = queries.shape
    for j in range(lo, hi):
        best = -np.inf
        for r in range(g):
            s = np.float32(0.0)
            for i in range(d):
                s += queries[r, i] * keys[j, i]
            if s > best:
                best = s
        scores[j] = best


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, parallel=True)
def _group_scores_parallel(queries: np.ndarray, keys: np.ndarray, n: int, chunks: int, scores: np.ndarray) -> None:
    """`group_scores_range` over ``[0, n)`` in ``chunks`` contiguous ranges, one per thread (numba ``prange``)."""
    for c in prange(chunks):
        group_scores_range(queries, keys, c * n // chunks, (c + 1) * n // chunks, scores)


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _group_scores_serial(queries: np.ndarray, keys: np.ndarray, n: int, scores: np.ndarray) -> None:
    group_scores_range(queries, keys, 0, n, scores)


#: fewest keys per thread for which a parallel scan pays for waking the other threads (measured ~20 us)
MIN_KEYS_PER_THREAD = 2048


def group_scores(queries: np.ndarray, keys: np.ndarray, n: int, threads: int = 1) -> np.ndarray:
    """``max_g q.k`` of ``keys[:n]`` ``[n, d]`` for ``queries`` ``[g, d]`` (float32 ``[n]``), scanned by up to
    ``threads`` threads (fewer when ``n`` is small: `MIN_KEYS_PER_THREAD`); the floats do not depend on it."""
    scores = np.empty(n, np.float32)
    chunks = max(1, min(threads, n // MIN_KEYS_PER_THREAD))
    if chunks > 1:
        _group_scores_parallel(queries, keys, n, chunks, scores)
    else:
        _group_scores_serial(queries, keys, n, scores)
    return scores


def top_tokens(queries: np.ndarray, keys: np.ndarray, n: int, budget: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(budget, n)`` best of ``keys[:n]`` ``[n, d]`` for ``queries`` ``[g, d]`` by ``max_g q.k``, best
    first, ties by position: ``(positions int64, scores float32)``. The scan (`group_scores`) reads each key
    once for the whole group, on up to ``threads`` threads; `top_of_scores` picks the winners."""
    return top_of_scores(group_scores(queries, keys, n, threads), budget)


@njit(nogil=True, cache=True)
def top_of_scores(scores: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(budget, n)`` best of ``scores`` ``[n]``, best first, ties by position: ``(positions int64,
    scores float32)``. The k-th score is found from a sampled threshold (`_kth_largest`); a stable sort orders
    the k winners only."""
    n = scores.shape[0]
    k = min(budget, n)
    pos = np.empty(k, np.int64)
    if k == n:
        for j in range(n):
            pos[j] = j
    elif k > 0:
        kth = _kth_largest(scores, k)
        c = 0
        for j in range(n):  # everything above it, in position order ...
            if scores[j] > kth:
                pos[c] = j
                c += 1
        for j in range(n):  # ... then ties at it, in position order, until k
            if c == k:
                break
            if scores[j] == kth:
                pos[c] = j
                c += 1
    vals = np.empty(k, np.float32)
    for t in range(k):
        vals[t] = -scores[pos[t]]
    order = np.argsort(vals, kind="mergesort")  # stable: equal scores keep position order
    out_pos = np.empty(k, np.int64)
    out_vals = np.empty(k, np.float32)
    for t in range(k):
        out_pos[t] = pos[order[t]]
        out_vals[t] = -vals[order[t]]
    return out_pos, out_vals


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, parallel=True)
def _layer_top_parallel(queries: np.ndarray, keys: tuple, n: int, budget: int, chunks: int) -> np.ndarray:
    """`layer_top_tokens` on numba's threads: the scans of every (head, chunk) first, then each head's top-k."""
    heads = queries.shape[0]
    scores = np.empty((heads, n), np.float32)
    for t in prange(heads * chunks):
        h, c = t // chunks, t % chunks
        group_scores_range(queries[h], keys[h], c * n // chunks, (c + 1) * n // chunks, scores[h])
    out = np.empty((heads, min(budget, n)), np.int64)
    for h in prange(heads):
        out[h] = top_of_scores(scores[h], budget)[0]
    return out


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _layer_top_serial(queries: np.ndarray, keys: tuple, n: int, budget: int) -> np.ndarray:
    heads = queries.shape[0]
    scores = np.empty(n, np.float32)
    out = np.empty((heads, min(budget, n)), np.int64)
    for h in range(heads):
        group_scores_range(queries[h], keys[h], 0, n, scores)
        out[h] = top_of_scores(scores, budget)[0]
    return out


def layer_top_tokens(queries: np.ndarray, keys: tuple[np.ndarray, ...], n: int, budget: int, threads: int = 1) -> np.ndarray:
    """`top_tokens` for every KV head of a layer in one compiled call: ``queries`` ``[H, g, d]`` float32, ``keys``
    one ``[>= n, d]`` float32 buffer per head (the first ``n`` rows live). Returns positions ``[H, min(budget,
    n)]`` int64, each row best first, ties by position: the same as `top_tokens` head by head, bit for bit."""
    chunks = max(1, min(threads, n // MIN_KEYS_PER_THREAD))
    if threads > 1 and len(keys) * n >= 2 * MIN_KEYS_PER_THREAD:  # enough work for a second thread
        return _layer_top_parallel(queries, keys, n, budget, chunks)
    return _layer_top_serial(queries, keys, n, budget)


def _native_top_tokens(kernels: NativeKernels, pagers: list[ExactPager], queries: np.ndarray,
                       budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`NativeKernels.layer_top_tokens` over ``pagers``' keys, with their float16 copies where every pager keeps
    one (the call extends them to the pagers' sizes and says where one turned off)."""
    counts = np.array([len(p) for p in pagers], np.int64)
    halves = [p._half for p in pagers]
    if all(h is not None and h.usable for h in halves):
        done = np.array([h.done for h in halves], np.int64)  # type: ignore[union-attr]
        out = kernels.layer_top_tokens(queries, [p._buf.numpy() for p in pagers], counts, budget,
                                       [h.half for h in halves], [h.norms for h in halves], done,  # type: ignore[union-attr]
                                       threads=pagers[0].select_threads)
        for h, d in zip(halves, done.tolist()):
            h.done = d  # type: ignore[union-attr]
        return out
    return kernels.layer_top_tokens(queries, [p._buf.numpy() for p in pagers], counts, budget,
                                    threads=pagers[0].select_threads)


@register_pager("exact")
class ExactPager(SemanticPager):
    """Top-``budget`` tokens by ``max_g q.k``, each token a page of one (``page_size`` is ignored)."""

    semantic = False

    def __init__(self, head_dim: int, page_size: int = 16, seed: int = 0, *, record_moves: bool = False) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        self._buf = torch.zeros(0, head_dim)  # capacity-doubling key storage; rows [0, n) are live
        self._keys = self._buf
        self._half = HalfKeys.for_native(head_dim)

    def _table_page_size(self) -> int:
        return 1

    def _build(self, keys: torch.Tensor) -> None:
        self._buf = torch.empty(grown_capacity(keys.shape[0], 0), keys.shape[1])  # contiguous: the kernel reads rows
        self._buf[: keys.shape[0]] = keys
        self._keys = self._buf[: keys.shape[0]]
        if self._half is not None:
            self._half.reset(keys.shape[0])
        self.table.new_pages(np.arange(keys.shape[0]).reshape(-1, 1))

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        n = start + keys.shape[0]
        if n > self._buf.shape[0]:
            grown = torch.empty(grown_capacity(n, self._buf.shape[0]), self.head_dim)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._keys = self._buf[:n]
        if keys.shape[0] == 1:  # the decode step's insert: numpy's row copy costs a fraction of torch's
            self._buf.numpy()[start] = keys.numpy()[0]
        else:
            self._buf[start:n] = keys
        if self._half is not None:
            self._half.reserve(n)
        if keys.shape[0] == 1:
            self.table.new_page((start,))
            return
        self.table.new_pages(np.arange(start, n).reshape(-1, 1))

    def _top_tokens(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``min(budget, n)`` best positions for ``queries`` ``[g, d]`` by ``max_g q.k``, best first (ties by
        position), with their scores: the native kernels' scan when loaded (`icecache.kernels`; a float16 first pass
        where the keys allow it), else `top_tokens` (numba); on ``select_threads`` threads, no torch op."""
        q = queries.detach().to(torch.float32).contiguous().numpy()
        n = self._keys.shape[0]
        kernels = native_kernels()
        if kernels is None:
            return top_tokens(q, self._buf.numpy(), n, budget, self.select_threads)
        pos, vals, found, _ = _native_top_tokens(kernels, [self], q[None], budget)
        return pos[0, : found[0]].copy(), vals[0, : found[0]].copy()

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        pos, vals = self._top_tokens(queries, budget)
        return self.table.page_of_[pos], vals

    def _select_arrays(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        # Every page holds one token, so the budget rule takes all min(budget, n) ranked tokens: no CSR pass.
        pos, vals = self._top_tokens(queries, budget)
        return self.table.page_of_[pos], np.arange(pos.size + 1, dtype=np.int64), pos, vals

    @classmethod
    def _select_layer(cls, pagers: Sequence[SemanticPager], queries: torch.Tensor,
                      budget: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """`SemanticPager.select_layer_positions`: all heads in one compiled call: the native kernels' when loaded
        (`icecache.kernels`, GIL released, float16 first pass where every head has one), else `layer_top_tokens`
        (numba; None when the pagers differ in size or are empty: select them one by one)."""
        pagers = cast(list[ExactPager], list(pagers))
        kernels = native_kernels()
        if kernels is not None:
            pos, _, found, _ = _native_top_tokens(kernels, pagers, queries.numpy(), budget)
            return [(p.table.page_of_[pos[h, : found[h]]], np.arange(found[h] + 1, dtype=np.int64), pos[h, : found[h]])
                    for h, p in enumerate(pagers)]
        n = len(pagers[0])
        if n == 0 or any(len(p) != n for p in pagers):
            return None
        keys = tuple(p._buf.numpy() for p in pagers)
        top = layer_top_tokens(queries.numpy(), keys, n, budget, pagers[0].select_threads)
        indptr = np.arange(top.shape[1] + 1, dtype=np.int64)  # every page holds one token
        return [(p.table.page_of_[pos], indptr, pos) for p, pos in zip(pagers, top)]

    def index_bytes(self) -> int:
        half = self._half.nbytes() if self._half is not None else 0
        return self._keys.numel() * self._keys.element_size() + half
