"""Cutting a group of keys into compact pages of near-equal size, used by the ``ivf`` and ``hnsw`` pagers: a
deterministic 2-way split score (`split_scores`) and the balanced recursive split built on it
(`balanced_pages`)."""

from __future__ import annotations

from typing import Literal

import numpy as np

SplitRule = Literal["2means", "pca"]


def split_scores(x: np.ndarray, rule: SplitRule) -> np.ndarray:
    """A 1-D score per row of ``x`` ``[m, D]`` such that cutting the rows in score order separates two
    compact groups. Deterministic (no random numbers)."""
    mu = x.mean(0)
    xc = x - mu
    if rule == "pca":
        cov = xc.T.astype(np.float64) @ xc.astype(np.float64)
        _, vecs = np.linalg.eigh(cov)
        return xc @ vecs[:, -1].astype(x.dtype)
    # 2-means from a deterministic farthest-point start: a = farthest from the mean, b = farthest from a.
    sq = (xc * xc).sum(1)
    a = x[int(np.argmax(sq))]
    b = x[int(np.argmax(((x - a) ** 2).sum(1)))]
    for _ in range(4):
        # |x - a|^2 - |x - b|^2 = 2 x.(b - a) + |a|^2 - |b|^2: < 0 means closer to a.
        side = x @ (b - a) * 2.0 + (a @ a - b @ b) < 0
        if side.all() or not side.any():
            break
        a, b = x[side].mean(0), x[~side].mean(0)
    return x @ (b - a)


def balanced_pages(x: np.ndarray, positions: np.ndarray, page_size: int, rule: SplitRule) -> list[np.ndarray]:
    """Cut a list of ``m`` tokens into ``ceil(m / page_size)`` pages of near-equal size, recursively.

    Parameters
    ----------
    x : float array ``[m, D]``
        The tokens' (transformed) keys.
    positions : int64 array ``[m]``
        Their positions.
    page_size : int
        Capacity P.
    rule : {"2means", "pca"}
        How each 2-way cut orders the tokens (see `split_scores`).

    Returns
    -------
    list of int64 arrays
        The pages' positions; every page holds between ``floor`` and ``ceil`` of ``m / num_pages``
        tokens, up to rounding at each level of the recursion, and at most ``page_size``.
    """
    m = len(positions)
    num_pages = -(-m // page_size)
    if num_pages <= 1:
        return [positions] if m else []
    left_pages = num_pages // 2
    left = -(-m * left_pages // num_pages)  # ceil(m * left_pages / num_pages) <= left_pages * P
    order = np.argsort(split_scores(x, rule), kind="stable")
    left_rows, right_rows = order[:left], order[left:]
    return (balanced_pages(x[left_rows], positions[left_rows], page_size, rule)
            + balanced_pages(x[right_rows], positions[right_rows], page_size, rule))


__all__ = ["SplitRule", "balanced_pages", "split_scores"]
