"""``exact``: the oracle. Every middle token is its own page; selection is the exact top-B tokens by
q.k (max over the GQA group). Any approximate pager is measured against it."""

from __future__ import annotations

import numpy as np
import torch

from icecache.core.pager import SemanticPager
from icecache.indexes.registry import register_pager


@register_pager("exact")
class ExactPager(SemanticPager):
    """Top-``budget`` tokens by ``max_g q.k``, each token a page of one (``page_size`` is ignored)."""

    semantic = False

    def __init__(self, head_dim: int, page_size: int = 16, seed: int = 0, *, record_moves: bool = False) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        self._buf = torch.zeros(0, head_dim)  # capacity-doubling key storage; rows [0, n) are live
        self._keys = self._buf

    def _table_page_size(self) -> int:
        return 1

    def _build(self, keys: torch.Tensor) -> None:
        self._buf = keys.clone()
        self._keys = self._buf
        self.table.new_pages(np.arange(keys.shape[0]).reshape(-1, 1))

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        n = start + keys.shape[0]
        if n > self._buf.shape[0]:
            grown = torch.empty(max(n, 2 * self._buf.shape[0], 64), self.head_dim)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:n] = keys
        self._keys = self._buf[:n]
        if keys.shape[0] == 1:
            self.table.new_page((start,))
        else:
            self.table.new_pages(np.arange(start, n).reshape(-1, 1))

    def _top_tokens(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``min(budget, n)`` best positions for ``queries`` ``[g, d]`` by ``max_g q.k``, best first (ties by
        position), with their scores: one q.K product, an unsorted top-k, and a sort of the k winners only."""
        scores = queries @ self._keys.T  # [g, n]
        scores = scores[0] if scores.shape[0] == 1 else scores.amax(dim=0)  # [n]
        k = min(budget, scores.numel())
        top = torch.topk(scores, k, sorted=False)
        vals, pos = top.values.numpy(), top.indices.numpy()
        order = np.lexsort((pos, -vals))  # best first; ties by position, whatever topk's internal order
        return pos[order], vals[order]

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        pos, vals = self._top_tokens(queries, budget)
        return self.table.page_of_[pos], vals

    def _select_arrays(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        # Every page holds one token, so the budget rule takes all min(budget, n) ranked tokens: no CSR pass.
        pos, vals = self._top_tokens(queries, budget)
        return self.table.page_of_[pos], np.arange(pos.size + 1, dtype=np.int64), pos, vals

    def index_bytes(self) -> int:
        return self._keys.numel() * self._keys.element_size()
