"""Exhaustive page ranking: every key scored, each page ranked by its best key (``mdci[search=exhaustive]``).

M-DCI's tree search finds a page's best key approximately: it scores the keys its descent reaches. Scoring every
key instead (the exact scorer's scan, `icecache.indexes.exact`) and taking each page's maximum gives the ranking
the search approximates, with no search miss, at the cost of reading all ``n`` keys per (layer, KV head) and
step. Below a few thousand keys per head that scan is cheaper than the descent (``index="auto"``).

One call ranks one pager (`rank_pages_exhaustive`) or every KV head of a layer (`layer_rank_pages_exhaustive`);
the token scores are `icecache.indexes.exact`'s inlined scan, so a page's score is the same float either way and
whatever the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from icecache.indexes.exact import MIN_KEYS_PER_THREAD, group_scores, group_scores_range, top_of_scores


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _page_scores(token_scores: np.ndarray, page_of: np.ndarray, n: int, num_ids: int) -> np.ndarray:
    """``[num_ids]`` float32: each page's best token score; ``-inf`` for ids no token of ``[0, n)`` is in."""
    out = np.full(num_ids, -np.inf, np.float32)
    for j in range(n):
        p = page_of[j]
        if token_scores[j] > out[p]:
            out[p] = token_scores[j]
    return out


@njit(nogil=True, cache=True)
def _ranked_live(page_scores: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``min(budget, live)`` pages, best first, ties by page id: ``(ids int64, scores float32)``."""
    ids, vals = top_of_scores(page_scores, budget)
    k = 0
    while k < ids.shape[0] and vals[k] > -np.inf:
        k += 1
    return ids[:k].copy(), vals[:k].copy()


@njit(nogil=True, cache=True)
def _rank_scored(scores: np.ndarray, page_of: np.ndarray, num_ids: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    return _ranked_live(_page_scores(scores, page_of, scores.shape[0], num_ids), budget)


def rank_pages_exhaustive(queries: np.ndarray, keys: np.ndarray, n: int, page_of: np.ndarray, num_ids: int,
                          budget: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Pages ranked by their best ``max_g q.k``, every key scored.

    ``queries`` ``[g, d]`` float32 (one GQA group), ``keys`` ``[>= n, d]`` float32 by position (rows ``[0, n)``
    live), ``page_of`` ``[>= n]`` int64 page id of each position (every live position paged), ``num_ids``: one
    more than the largest page id. Returns the best ``min(budget, pages)`` page ids, best first, ties by page id,
    and their scores (float32): a page holds at least one token, so no more than ``budget`` pages can fit the
    budget rule (`PageTable.take_within_budget`). The scan runs on up to ``threads`` threads
    (`icecache.indexes.exact.group_scores`); the result does not depend on it.
    """
    if n == 0 or budget <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return _rank_scored(group_scores(queries, keys, n, threads), page_of, num_ids, budget)


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, parallel=True)
def _layer_parallel(queries, keys, ns, page_of, num_ids, budget, chunks, out_ids, counts) -> None:
    """The scans of every (head, chunk) on numba's threads first, then each head's page maxima and ranking."""
    heads = queries.shape[0]
    width = 0
    for h in range(heads):
        width = max(width, ns[h])
    scores = np.empty((heads, width), np.float32)
    for t in prange(heads * chunks):
        h, c = t // chunks, t % chunks
        n = ns[h]
        group_scores_range(queries[h], keys[h], c * n // chunks, (c + 1) * n // chunks, scores[h])
    for h in prange(heads):
        ids, _ = _rank_scored(scores[h, : ns[h]], page_of[h], num_ids[h], budget)
        counts[h] = ids.shape[0]
        out_ids[h, : ids.shape[0]] = ids


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _layer_serial(queries, keys, ns, page_of, num_ids, budget, out_ids, counts) -> None:
    width = 0
    for h in range(queries.shape[0]):
        width = max(width, ns[h])
    scores = np.empty(width, np.float32)
    for h in range(queries.shape[0]):
        group_scores_range(queries[h], keys[h], 0, ns[h], scores)
        ids, _ = _rank_scored(scores[: ns[h]], page_of[h], num_ids[h], budget)
        counts[h] = ids.shape[0]
        out_ids[h, : ids.shape[0]] = ids


def layer_rank_pages_exhaustive(queries: np.ndarray, keys: tuple[np.ndarray, ...], ns: np.ndarray,
                                page_of: tuple[np.ndarray, ...], num_ids: np.ndarray, budget: int,
                                threads: int = 1) -> list[np.ndarray]:
    """`rank_pages_exhaustive` for every KV head of a layer in one compiled call (with ``threads > 1`` the
    scans of all heads split into chunks on numba's threads, as `icecache.indexes.exact.layer_top_tokens`):
    ``queries`` ``[H, g, d]``, per head ``keys[h]``, ``ns[h]`` live keys, ``page_of[h]``, ``num_ids[h]``.
    Returns each head's ranked page ids (int64), bit for bit the head-by-head result."""
    heads = queries.shape[0]
    ns = ns.astype(np.int64)
    width = max(1, min(budget, int(num_ids.max()) if heads else 1))
    out_ids = np.empty((heads, width), np.int64)
    counts = np.zeros(heads, np.int64)
    if budget > 0 and heads:
        chunks = max(1, min(threads, int(ns.min()) // MIN_KEYS_PER_THREAD))
        if threads > 1 and heads * int(ns.min()) >= 2 * MIN_KEYS_PER_THREAD:  # enough work for a second thread
            _layer_parallel(queries, keys, ns, page_of, num_ids.astype(np.int64), budget, chunks, out_ids, counts)
        else:
            _layer_serial(queries, keys, ns, page_of, num_ids.astype(np.int64), budget, out_ids, counts)
    return [out_ids[h, : counts[h]] for h in range(heads)]
