"""Adaptive budget (`IceCacheConfig.top_p`): keep ranked pages until their estimated attention mass reaches p.

A selection ranks pages best first and takes them while the budget holds (`SemanticPager.select_arrays`).
With ``top_p`` set, the step then keeps only the shortest prefix of those pages whose estimated share of the
selection's attention mass reaches ``top_p`` (the idea of Twilight's top-p, on page scores instead of per-token
estimates). The budget stays the cap: top-p can only attend fewer tokens, never more.

A page's mass is estimated from its ranking score ``s`` (best q.k in the page for the semantic and exact pagers,
Quest's upper bound for ``sequential``; see `PageSelection.scores`) as if every one of its ``n`` tokens scored
``s``: ``n * exp(scale * (s - s_best))``. That over-estimates every page, the low-ranked ones least in absolute
terms, so the cut errs towards keeping pages. Pages the search did not score (``-inf``) weigh 0.
"""

from __future__ import annotations

import numpy as np


def pages_within_mass(indptr: np.ndarray, scores: np.ndarray, scale: float, top_p: float) -> int:
    """How many of the ranked pages to keep: the fewest whose estimated mass reaches ``top_p`` of the total.

    ``indptr`` ``[k + 1]`` int64 (page ``i`` holds ``indptr[i + 1] - indptr[i]`` tokens), ``scores`` ``[k]``
    (best first; ``-inf`` = unscored), ``scale`` the attention's softmax scale (``1 / sqrt(d)`` for most models),
    ``0 < top_p <= 1``. Returns ``k`` when no page was scored (nothing to estimate: the budget rule alone).
    """
    k = int(scores.shape[0])
    if k == 0:
        return 0
    s = np.asarray(scores, dtype=np.float64)
    scored = np.isfinite(s)
    if not scored.any():
        return k
    best = s[scored].max()
    sizes = np.diff(np.asarray(indptr, dtype=np.int64)).astype(np.float64)
    weights = np.where(scored, sizes * np.exp(scale * (np.where(scored, s, best) - best)), 0.0)
    cumulative = np.cumsum(weights)
    target = top_p * cumulative[-1]
    # a prefix within 1e-9 of the target counts as reaching it (rounding; p = 1 must not need one more page
    # of negligible mass)
    return min(int(np.searchsorted(cumulative, target * (1 - 1e-9), side="left")) + 1, k)


__all__ = ["pages_within_mass"]
