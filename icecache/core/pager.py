"""The pager interface: `SemanticPager` (one per layer and KV head) and its result, `PageSelection`.

A pager organises the *middle* keys of one (layer, KV head) into pages of at most ``page_size`` tokens
and, given the queries of one GQA group, returns the pages to attend, ranked, in whole pages, never more
than ``budget`` tokens (docs/method.md, The budget rule). Positions are pager-local: `build` numbers
its keys ``0..n-1`` and every `insert` continues from there.

A backend subclasses `SemanticPager` and fills in three methods (`_build`, `_insert`, `_rank_pages`);
input checks, the budget rule and the page bookkeeping live here, once. Optional members, each with a default
that is always correct (a backend overrides them only to be faster):

* ``select_threads`` (default 1): threads a select's scan may use, where the backend has a parallel scan;
  results never depend on it.
* ``layer_select`` (default True): whether the pager takes part in a layer's one-call selection.
* `_select_layer` (default: none): one call that selects for every KV head of one layer row, behind the public
  `select_layer_positions`, which checks its inputs and the budget rule.
* `insert_one_stored` with ``stores_inserts`` (default: the journal): write a decode insert into a host store
  directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from icecache.core.errors import InputError, InputTypeError
from icecache.core.pages import PageTable

ArrayLike = torch.Tensor | np.ndarray

#: Largest accepted |value| in keys and queries: squared norms of 1e15-sized entries still fit float32 sums.
MAX_ABS = 1e15


@dataclass(frozen=True)
class PageSelection:
    """Pages chosen for one GQA group at one decode step, best first.

    Attributes
    ----------
    pages : LongTensor ``[k]``
        Selected page ids in rank order.
    indptr : LongTensor ``[k + 1]``
        CSR offsets: the positions of ``pages[i]`` are ``positions[indptr[i]:indptr[i + 1]]``.
    positions : LongTensor ``[indptr[-1]]``
        Pager-local token positions, grouped by page in rank order (slot order inside a page).
    scores : FloatTensor ``[k]``
        Each selected page's ranking score (higher = more relevant; the meaning depends on the backend:
        best q.k in the page for semantic and exact pagers, Quest's upper bound for ``sequential``). Never
        NaN; ``-inf`` marks a page the search did not score, included only because the budget exceeds what
        the search scored; such pages come after every scored page.
    """

    pages: torch.Tensor
    indptr: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor

    @property
    def num_pages(self) -> int:
        return int(self.pages.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @classmethod
    def empty(cls) -> PageSelection:
        z = torch.zeros(0, dtype=torch.int64)
        return cls(pages=z, indptr=torch.zeros(1, dtype=torch.int64), positions=z, scores=torch.zeros(0))


def as_float_matrix(x: Any, d: int, name: str, *, allow_empty: bool = True) -> torch.Tensor:
    """Check and convert ``x`` to a contiguous float32 CPU tensor ``[n, d]``.

    Raises `InputTypeError` for non-tensors and non-float dtypes (no silent conversion of integers), and
    `InputError` for a wrong rank or width, an empty input where one is not allowed, or NaN/inf values.
    """
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise InputTypeError(f"{name} must hold floats, got numpy dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if not x.is_floating_point():
        raise InputTypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 2 or x.shape[1] != d:
        raise InputError(f"{name} must have shape [n, {d}], got {list(x.shape)}")
    if x.shape[0] == 0 and not allow_empty:
        raise InputError(f"{name} must not be empty")
    x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
    # numpy's single-threaded check: torch's OpenMP version is ~50x slower on a busy 2-core machine.
    if x.numel():
        a = x.numpy()
        if not bool(np.isfinite(a).all()):
            raise InputError(f"{name} holds NaN or inf values")
        if float(np.abs(a).max()) > MAX_ABS:
            raise InputError(f"{name} holds values with |x| > {MAX_ABS:g}, beyond what float32 scoring can hold")
    return x


def take_within_budget(sizes: np.ndarray, budget: int) -> int:
    """The budget rule: how many leading pages (in rank order) fit, stopping at the first that does not.

    ``sizes`` ``[k]``: token counts of the ranked candidate pages. Returns ``j`` with
    ``sum(sizes[:j]) <= budget`` and ``j == k`` or ``sum(sizes[:j+1]) > budget``.
    """
    if len(sizes) == 0:
        return 0
    csum = np.cumsum(sizes)
    return int(np.searchsorted(csum, budget, side="right"))



def top_k_stable(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``scores`` ``[n]`` in descending order, ties by index: exactly
    ``np.argsort(-scores, kind="stable")[:k]``, in O(n + k log k) instead of O(n log n) (a partition, then a
    sort of the ``k`` winners). Scores must not be NaN."""
    n = int(scores.shape[0])
    k = max(0, min(int(k), n))
    if k == 0:
        return np.zeros(0, np.int64)
    if 4 * k >= n:
        return np.argsort(-scores, kind="stable")[:k]
    kth = -np.partition(-scores, k - 1)[k - 1]  # the k-th largest value
    above = np.flatnonzero(scores > kth)
    cand = np.concatenate([above, np.flatnonzero(scores == kth)[: k - above.size]])
    return cand[np.lexsort((cand, -scores[cand]))]

class SemanticPager(ABC):
    """Pages of one (layer, KV head) and the query-time choice of which to attend.

    Parameters
    ----------
    head_dim : int
        Key/query width d.
    page_size : int
        Page capacity P in tokens.
    seed : int
        Seed of every random choice the backend makes.
    record_moves : bool
        Journal page layout changes in ``self.table`` (a host store replays them; see `PageTable`).

    Not thread-safe: use one pager per (layer, KV head), and one thread at a time per pager.

    ``select_threads`` (default 1): threads a select may use for its scan, where the backend has a parallel one
    (``exact``, ``sequential``, ``mdci``); results never depend on it. The runtime raises it when no background
    work shares the cores (`icecache.runtime.cache.IceCache`). ``layer_select`` (default True): whether the pager
    takes part in `select_layer_positions` (M-DCI's parameter of the same name turns it off).
    """

    #: registry name (set by `icecache.indexes.registry.register_pager`)
    name: ClassVar[str] = ""
    #: True when pages group tokens by key similarity rather than by position
    semantic: ClassVar[bool] = True
    #: True when `insert_one_stored` can write a host store's rows itself (the runtime then calls it instead of
    #: `insert` + the store's journal replay)
    stores_inserts: ClassVar[bool] = False

    def __init__(self, head_dim: int, page_size: int = 16, seed: int = 0, *, record_moves: bool = False) -> None:
        for field, value, lo in (("head_dim", head_dim, 1), ("page_size", page_size, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise InputError(f"{field} must be an int >= {lo}, got {value!r}")
        self.head_dim = head_dim
        self.page_size = page_size
        self.seed = seed
        self.table = PageTable(self._table_page_size(), record_moves=record_moves)
        self._n = 0
        self.select_threads: int = 1
        self.layer_select: bool = True

    # ------------------------------------------------------------------ public API
    def build(self, keys: ArrayLike) -> None:
        """Index ``keys`` ``[n, d]`` from scratch; they get positions ``0..n-1`` (n may be 0)."""
        k = as_float_matrix(keys, self.head_dim, "keys")
        self.table.clear()
        self._n = 0
        self._build(k)
        self._n = k.shape[0]

    def insert(self, keys: ArrayLike, *, check: bool = True) -> None:
        """Add ``keys`` ``[m, d]``; they get positions ``len(self) .. len(self) + m - 1``.

        ``check=False`` skips input validation: only for callers that pass a finite, contiguous float32
        CPU tensor of the right shape (the runtime, which validates a whole layer at once).
        """
        k = as_float_matrix(keys, self.head_dim, "keys") if check else keys
        if k.shape[0] == 0:
            return
        self._insert(k, self._n)
        self._n += k.shape[0]

    def insert_one_stored(self, key: np.ndarray, rows: np.ndarray, block_of: np.ndarray, new_k: np.ndarray,
                          new_v: np.ndarray) -> bool:
        """Insert one decode key ``key`` ``[d]`` (finite, C-contiguous float32; unchecked, as `insert` with
        ``check=False``). A pager that `stores_inserts` may also place the token's ``new_k`` / ``new_v``
        (``[head_dim]``, in the store's raw dtype) into a host store's ``rows`` ``[R, 2, head_dim]`` (``block_of``:
        page id -> block of ``page_size`` rows) when its only page change is an append to a page with a block;
        it then journals nothing and returns True. False: the journal holds the insert's page changes for the
        store to replay (always, here)."""
        self.insert(torch.from_numpy(key[None]), check=False)
        return False

    def select(self, queries: ArrayLike, budget: int, *, check: bool = True) -> PageSelection:
        """Rank pages for the GQA group's ``queries`` ``[g, d]`` (or ``[d]``) and take whole pages, in rank
        order, while the total stays <= ``budget`` tokens.

        ``check=False`` skips input validation (see `insert`).
        """
        pages, indptr, positions, scores = self.select_arrays(queries, budget, check=check)
        return PageSelection(
            pages=torch.from_numpy(pages),
            indptr=torch.from_numpy(indptr),
            positions=torch.from_numpy(positions),
            scores=torch.from_numpy(scores),
        )

    def select_arrays(
        self, queries: ArrayLike, budget: int, *, check: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`select` as numpy arrays ``(pages int64 [k], indptr int64 [k+1], positions int64 [indptr[-1]],
        scores float32 [k])``, the fields of `PageSelection`; the runtime's per-step path (no tensor
        wrapping)."""
        if check:
            if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
                raise InputError(f"budget must be an int >= 0, got {budget!r}")
            if isinstance(queries, (torch.Tensor, np.ndarray)) and queries.ndim == 1:
                queries = queries.reshape(1, -1)
            q = as_float_matrix(queries, self.head_dim, "queries", allow_empty=False)
        else:
            q = queries
        if self._n == 0 or budget == 0:
            z = np.zeros(0, np.int64)
            return z, np.zeros(1, np.int64), z.copy(), np.zeros(0, np.float32)
        return self._select_arrays(q, int(budget))

    def _select_arrays(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`select_arrays` after validation, on a non-empty index and ``budget > 0``: `_rank_pages`, then the
        budget rule. A backend may override it when it can apply the rule more cheaply (``exact``)."""
        page_ids, scores = self._rank_pages(queries, budget)
        page_ids = np.asarray(page_ids, dtype=np.int64)
        j, indptr, positions = self.table.take_within_budget(page_ids, budget)
        return page_ids[:j].copy(), indptr, positions, np.asarray(scores, dtype=np.float32)[:j].copy()

    @classmethod
    def select_layer_positions(cls, pagers: Sequence[SemanticPager], queries: torch.Tensor,
                               budget: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """One layer row's selection for every KV head in one call, where the backend offers it (`_select_layer`).

        ``pagers`` ``[H]`` (all of this class), ``queries`` ``[H, g, d]`` float32 on the host (the GQA group of
        each head, union rule). Returns each pager's ``(pages, indptr, positions)``: exactly its own
        `select_arrays` without the scores; or None, and the caller selects pager by pager: the backend has no
        fast path, a pager opted out (``layer_select``), ``budget`` is 0, or the pagers cannot share one call.
        Unchecked queries, as `select_arrays` with ``check=False``: the runtime validates a layer at once.
        """
        if cls._select_layer.__func__ is SemanticPager._select_layer.__func__:  # no fast path: nothing to check
            return None
        if budget <= 0 or not pagers or any(type(p) is not cls or not p.layer_select for p in pagers):
            return None
        if queries.dim() != 3 or queries.shape[0] != len(pagers) or queries.shape[2] != pagers[0].head_dim:
            raise InputError(f"select_layer_positions: queries must be [{len(pagers)}, g, {pagers[0].head_dim}], "
                             f"got {list(queries.shape)}")
        heads = cls._select_layer(pagers, queries, int(budget))
        if heads is not None:
            for pages, indptr, positions in heads:  # the budget rule, which the base class owns
                if positions.size > budget or indptr[-1] != positions.size or indptr.size != pages.size + 1:
                    raise AssertionError(f"{cls.__name__}._select_layer broke the selection contract (budget {budget}, "
                                         f"{positions.size} positions in {pages.size} pages): a bug in that backend")
        return heads

    @classmethod
    def _select_layer(cls, pagers: Sequence[SemanticPager], queries: torch.Tensor,
                      budget: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Backend hook of `select_layer_positions` (inputs checked, ``budget > 0``); None: no fast path."""
        return None

    def pages(self) -> dict[int, torch.Tensor]:
        """``{page id: positions (LongTensor, slot order)}`` for every page."""
        return {i: torch.from_numpy(p) for i, p in self.table.as_dict().items()}

    def page_of(self, positions: int | ArrayLike) -> int | torch.Tensor:
        """Page id holding each position (-1 for positions the pager has not seen)."""
        if isinstance(positions, (int, np.integer)):
            return int(self.table.page_of(int(positions)))
        pos = positions.cpu().numpy() if isinstance(positions, torch.Tensor) else np.asarray(positions)
        return torch.from_numpy(np.asarray(self.table.page_of(pos)))

    @property
    def num_pages(self) -> int:
        return self.table.num_pages

    def __len__(self) -> int:
        return self._n

    def index_bytes(self) -> int:
        """Host memory of the index structures (not counting the KV they index), in bytes."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(head_dim={self.head_dim}, page_size={self.page_size}, n={self._n}, pages={self.num_pages})"

    # ------------------------------------------------------------------ backend hooks
    def _table_page_size(self) -> int:
        """Capacity of the pages this backend forms (``page_size`` unless the backend says otherwise)."""
        return self.page_size

    @abstractmethod
    def _build(self, keys: torch.Tensor) -> None:
        """Index ``keys`` float32 ``[n, d]`` (positions 0..n-1) and fill ``self.table``; ``self.table`` is empty."""

    @abstractmethod
    def _insert(self, keys: torch.Tensor, start: int) -> None:
        """Add ``keys`` float32 ``[m, d]`` at positions ``start..start+m-1`` and page them."""

    @abstractmethod
    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidate pages for ``queries`` float32 ``[g, d]``, best first, with their scores.

        Returns ``(page_ids [k] int64, scores [k] float32)``. The base class applies the budget rule, so a
        backend may return only as many candidates as could possibly fit (``budget`` is given for that).
        """
