"""Selection quality metrics (docs/method.md, Definitions). Pure functions: tensors in, a float out.

Shapes: ``queries`` ``[g, d]`` are the query heads of one GQA group; ``keys`` ``[n, d]`` and ``values``
``[n, dv]`` the KV of one KV head. Scores are ``scale * q.k`` with ``scale = 1/sqrt(d)`` unless given.
"""

from __future__ import annotations

import math

import torch


def group_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``max over the group of q.k`` per key: ``[n]`` (float32)."""
    if keys.shape[0] == 0:
        return torch.zeros(0)
    return (queries.float() @ keys.float().T).amax(dim=0)


def exact_top_tokens(queries: torch.Tensor, keys: torch.Tensor, budget: int) -> torch.Tensor:
    """Positions of the top ``min(budget, n)`` keys by ``max_g q.k``, best first (ties: lower position)."""
    s = group_scores(queries, keys)
    k = min(int(budget), s.numel())
    order = torch.sort(-s, stable=True).indices
    return order[:k]


def hit_rate(queries: torch.Tensor, keys: torch.Tensor, selected: torch.Tensor, budget: int) -> float:
    """Fraction of the exact top-``budget`` middle tokens (by q.k, max over the GQA group) that are in
    ``selected`` (positions into ``keys``). 1.0 when there is nothing to find (n = 0 or budget = 0)."""
    top = exact_top_tokens(queries, keys, budget)
    if top.numel() == 0:
        return 1.0
    hit = torch.isin(top, selected.to(torch.int64))
    return float(hit.float().mean())


def _probs(queries: torch.Tensor, keys: torch.Tensor, scale: float | None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(queries.shape[-1]) if scale is None else scale
    return torch.softmax(scale * (queries.double() @ keys.double().T), dim=-1)


def attention_recall(queries: torch.Tensor, keys: torch.Tensor, kept: torch.Tensor, scale: float | None = None) -> float:
    """Fraction of the full softmax mass on the ``kept`` positions (sink + window + selected), averaged
    over the query heads of the group. ``keys`` ``[n, d]`` are *all* keys of the KV head."""
    if keys.shape[0] == 0:
        return 1.0
    p = _probs(queries, keys, scale)
    kept = torch.unique(kept.to(torch.int64))
    return float(p[:, kept].sum(dim=-1).mean())


def output_error(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, scale: float | None = None
) -> float:
    """``||o_sparse - o_full|| / ||o_full||`` (Frobenius over the group) where ``o_sparse`` is attention
    restricted to the ``kept`` positions. 0.0 when everything is kept; 1.0 when nothing is."""
    if keys.shape[0] == 0:
        return 0.0
    p = _probs(queries, keys, scale)
    v = values.double()
    full = p @ v
    kept = torch.unique(kept.to(torch.int64))
    if kept.numel() == 0:
        return 1.0
    ps = p[:, kept]
    ps = ps / ps.sum(dim=-1, keepdim=True)
    sparse = ps @ v[kept]
    denom = float(full.norm())
    if denom == 0.0:
        return float((sparse - full).norm())
    return float((sparse - full).norm()) / denom
