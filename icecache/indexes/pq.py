"""``pq``: PQCache-style token selection (Zhang et al., SIGMOD 2025, arXiv 2407.12820).

Keys are product-quantised per (layer, KV head): ``num_subspaces`` sub-vectors, each coded by one of
``2**bits`` k-means centroids (faiss `ProductQuantizer`; PQCache uses 2 sub-spaces x 6 bits). At a decode
step the query's inner products with every centroid give per-sub-space lookup tables; a token's approximate
logit is the sum of its codes' entries (~ q.k). As in PQCache, each query head's approximate logits are
soft-maxed and the probabilities summed over the GQA group; the top-``budget`` tokens are selected (single
-token pages). Tokens inserted later are coded with the existing centroids (no re-clustering).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from icecache.core.errors import InputError
from icecache.core.pager import SemanticPager
from icecache.indexes.registry import register_pager


@register_pager("pq")
class PQPager(SemanticPager):
    """Product-quantised keys, top tokens by approximate attention (PQCache).

    Parameters
    ----------
    num_subspaces : int
        Number of sub-vectors (must divide ``head_dim``); PQCache uses 2.
    bits : int
        Bits per code (``2**bits`` centroids per sub-space, at most 8); PQCache uses 6.
    train_iters : int
        k-means iterations (faiss).
    """

    semantic = False

    def __init__(self, head_dim: int, page_size: int = 16, seed: int = 0, *, record_moves: bool = False,
                 num_subspaces: int = 2, bits: int = 6, train_iters: int = 10) -> None:
        super().__init__(head_dim, page_size, seed, record_moves=record_moves)
        if num_subspaces < 1 or head_dim % num_subspaces:
            raise InputError(f"num_subspaces must divide head_dim={head_dim}, got {num_subspaces}")
        if not 1 <= bits <= 8:
            raise InputError(f"bits must be in [1, 8], got {bits}")
        self.num_subspaces, self.bits, self.train_iters = num_subspaces, bits, train_iters
        self._small: torch.Tensor | None = torch.zeros(0, head_dim)  # untrained: keys kept until there are enough
        self._codes = np.zeros((0, num_subspaces), dtype=np.int64)
        self._centroids = torch.zeros(num_subspaces, 0, head_dim // num_subspaces)

    def _table_page_size(self) -> int:
        return 1

    def _build(self, keys: torch.Tensor) -> None:
        self._small = None
        self._fit(keys)
        self.table.new_pages(np.arange(keys.shape[0]).reshape(-1, 1))

    def _fit(self, keys: torch.Tensor) -> None:
        """Train the codebooks on ``keys`` (fewer keys than centroids: every key is its own centroid)."""
        n, M = keys.shape[0], self.num_subspaces
        x = np.ascontiguousarray(keys.numpy())
        if n >= 2**self.bits:
            import faiss

            pq = faiss.ProductQuantizer(self.head_dim, M, self.bits)
            pq.cp.niter = self.train_iters
            pq.cp.seed = self.seed
            pq.train(x)
            cents = faiss.vector_to_array(pq.centroids).reshape(M, pq.ksub, pq.dsub)
            self._centroids = torch.from_numpy(cents.copy())
            self._small = None
        else:  # keep the raw keys until there are enough to train; exact codes meanwhile
            self._small = keys.clone()
            self._centroids = keys.view(n, M, -1).transpose(0, 1).contiguous() if n else torch.zeros(M, 0, self.head_dim // M)
        self._codes = self._encode(x)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.zeros((0, self.num_subspaces), dtype=np.int64)
        sub = torch.from_numpy(x).view(len(x), self.num_subspaces, -1)  # [n, M, dsub]
        d = torch.cdist(sub.transpose(0, 1), self._centroids)  # [M, n, ksub]: nearest centroid per sub-space
        return d.argmin(-1).T.contiguous().numpy().astype(np.int64)

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        if self._small is not None:  # still below 2**bits keys: refit on all of them
            self._fit(torch.cat([self._small, keys]))
        else:  # PQCache: new tokens take the nearest existing centroid, no re-clustering
            self._codes = np.concatenate([self._codes, self._encode(np.ascontiguousarray(keys.numpy()))])
        self.table.new_pages(np.arange(start, start + keys.shape[0]).reshape(-1, 1))

    def approx_logits(self, queries: torch.Tensor) -> torch.Tensor:
        """Approximate ``q.k`` of every key from the codes: ``[g, n]``."""
        q = queries.view(queries.shape[0], self.num_subspaces, -1)  # [g, M, dsub]
        tables = torch.einsum("gmd,mkd->gmk", q, self._centroids)  # [g, M, ksub]
        codes = torch.from_numpy(self._codes)  # [n, M]
        out = torch.zeros(queries.shape[0], codes.shape[0])
        for m in range(self.num_subspaces):
            out += tables[:, m, codes[:, m]]
        return out

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        logits = self.approx_logits(queries) / math.sqrt(self.head_dim)
        score = torch.softmax(logits, dim=-1).sum(0)  # summed over the GQA group, as PQCache does
        k = min(budget, score.numel())
        top = torch.topk(score, k, sorted=True)
        vals, pos = top.values.numpy(), top.indices.numpy()
        order = np.lexsort((pos, -vals))
        return np.asarray(self.table.page_of(pos[order])), vals[order]

    def index_bytes(self) -> int:
        return int(self._codes.shape[0] * self.num_subspaces * self.bits / 8) + self._centroids.numel() * 4

