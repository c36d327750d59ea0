"""``sequential``: token-order pages ranked by Quest's upper bound (Tang et al., ICML 2024,
arXiv 2406.10774). The token-order baseline every semantic pager is compared with.

Page i holds positions ``[i P, (i + 1) P)``. Per page and channel we keep the key minimum ``m`` and maximum
``M``; a page's score for a query is ``sum_c max(q_c m_c, q_c M_c)``, an upper bound of ``q.k`` for every key
in it, and the GQA group's score is the max over its query heads. `insert` fills the last page, then opens
new ones, so insert-after-build is identical to a build on the concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from numba import njit

from icecache.core.capacity import grown_capacity
from icecache.core.pager import SemanticPager, top_k_stable
from icecache.indexes.registry import register_pager
from icecache.kernels.library import native_kernels


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _page_bounds_score(q, lo, hi, out):
    """``out[p] = max_g sum_c max(q[g, c] lo[p, c], q[g, c] hi[p, c])`` for ``q`` ``[g, d]``, ``lo``/``hi``
    ``[pages, d]`` (float32). One thread, no temporaries: torch's version forks onto both cores once
    ``g x pages x d`` passes its grain size (~170 pages at g = 3, d = 64) and then waits for the core the
    background insert worker holds (SmolLM2, quest, 7k tokens, page 32: 5.7 -> 24 ms of selects per step).
    The channel sum may be reassociated (vectorised, as in the exact and M-DCI kernels): 63 -> 14 us at 500
    pages, g = 3, d = 64; sums differ from the sequential order by float rounding only."""
    G, D = q.shape
    for p in range(lo.shape[0]):
        best = np.float32(-np.inf)
        for g in range(G):
            s = np.float32(0.0)
            for c in range(D):
                s += max(q[g, c] * lo[p, c], q[g, c] * hi[p, c])
            best = max(best, s)
        out[p] = best


@register_pager("sequential")
class SequentialPager(SemanticPager):
    """Quest-style pages in token order, scored by the channel-wise min/max bound."""

    semantic = False

    def __init__(self, head_dim: int, page_size: int = 16, seed: int = 0, *, record_moves: bool = False) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        self._reset_bounds()

    def _reset_bounds(self) -> None:
        # Capacity-doubling buffers [capacity, d]; rows [0, self._pages) are live. Appending a page copies
        # nothing old (a torch.cat per page made every insert O(n) and slowed long generations).
        self._lo = torch.zeros(0, self.head_dim)
        self._hi = torch.zeros(0, self.head_dim)
        self._pages = 0

    @property
    def _kmin(self) -> torch.Tensor:
        return self._lo[: self._pages]

    @property
    def _kmax(self) -> torch.Tensor:
        return self._hi[: self._pages]

    def _add_bounds(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        need = self._pages + lo.shape[0]
        if need > self._lo.shape[0]:
            cap = grown_capacity(need, self._lo.shape[0])
            for name in ("_lo", "_hi"):
                old = getattr(self, name)
                new = torch.empty(cap, self.head_dim)
                new[: self._pages] = old[: self._pages]
                setattr(self, name, new)
        self._lo[self._pages : need] = lo
        self._hi[self._pages : need] = hi
        self._pages = need

    def _build(self, keys: torch.Tensor) -> None:
        self._reset_bounds()
        self._append(keys, 0)

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        self._append(keys, start)

    def _append(self, keys: torch.Tensor, start: int) -> None:
        P = self.page_size
        m = keys.shape[0]
        if m == 0:
            return
        taken = 0
        fill = (P - start % P) % P  # room left in the last (partial) page
        if fill and self._pages:
            taken = min(fill, m)
            last = self._pages - 1
            page_id = int(self.table.page_of(start - 1))
            for p in range(start, start + taken):
                self.table.append(page_id, p)
            chunk = keys[:taken]
            lo, hi = self._lo[last], self._hi[last]
            torch.minimum(lo, chunk.amin(0), out=lo)
            torch.maximum(hi, chunk.amax(0), out=hi)
        rest = keys[taken:]
        if rest.shape[0] == 0:
            return
        first = start + taken
        num_new = -(-rest.shape[0] // P)
        groups = [np.arange(first + i * P, min(first + (i + 1) * P, start + m)) for i in range(num_new)]
        self.table.new_pages(groups)
        pad = num_new * P - rest.shape[0]
        lo = torch.cat([rest, rest.new_full((pad, self.head_dim), float("inf"))]).view(num_new, P, -1).amin(1)
        hi = torch.cat([rest, rest.new_full((pad, self.head_dim), float("-inf"))]).view(num_new, P, -1).amax(1)
        self._add_bounds(lo, hi)

    def page_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Channel-wise key minimum and maximum per page, each ``[num_pages, d]`` (page i = row i)."""
        return self._kmin, self._kmax

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        kernels = native_kernels()
        if kernels is not None:  # the layer path's kernel, so both give the same floats
            q = queries.detach().to(torch.float32).contiguous().numpy()[None]
            pages, scores, found = kernels.layer_quest_pages(q, [self._lo.numpy()], [self._hi.numpy()],
                                                             np.array([self._pages]), budget, self.select_threads)
            return pages[0, : found[0]].copy(), scores[0, : found[0]].copy()
        # [g, pages, d] -> bound per (query, page) -> max over the group.
        bound = np.empty(self._pages, np.float32)
        _page_bounds_score(queries.detach().to(torch.float32).contiguous().numpy(), self._kmin.numpy(), self._kmax.numpy(), bound)
        k = min(budget, bound.shape[0])  # every page holds >= 1 token, so at most `budget` can fit
        order = top_k_stable(bound, k)  # argsort of every page was ~0.1 ms per select at 2.5k pages
        return order.astype(np.int64), bound[order]

    @classmethod
    def _select_layer(cls, pagers: Sequence[SemanticPager], queries: torch.Tensor,
                      budget: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """`SemanticPager.select_layer_positions`: every head's bounds and top pages in one native call
        (`icecache.kernels`, GIL released), then each head's budget rule; None without the native kernels."""
        kernels = native_kernels()
        if kernels is None:
            return None
        heads = cast(list[SequentialPager], list(pagers))
        pages, _, found = kernels.layer_quest_pages(queries.numpy(), [p._lo.numpy() for p in heads], [p._hi.numpy() for p in heads],
                                                    np.array([p._pages for p in heads], np.int64), budget, heads[0].select_threads)
        out = []
        for h, p in enumerate(heads):
            ids = pages[h, : found[h]]
            j, indptr, positions = p.table.take_within_budget(ids, budget)
            out.append((ids[:j].copy(), indptr, positions))
        return out

    def index_bytes(self) -> int:
        return 2 * self._lo.numel() * 4  # reserved capacity included
